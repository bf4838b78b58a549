"""How a loss reduces over the examples of its batch (a mean or a sum), read off stand-in
values: the test `eqpar.value_and_grad` runs before a schedule that takes the mean of its
microbatches' losses.

A loss that is a mean over examples gives the same value on one example and on that example
given twice over; a sum doubles. The loss is evaluated on both at trace time, in one small
compiled program of its own, on stand-in values made inside it (deterministic arrays of the
shapes and dtypes of its parameters and of one example's inputs); code that cannot run
outside the program being traced (a collective over a mesh axis, say) leaves the question
open.
"""

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

__all__ = ["reduction_of"]

# The two readings differ by a factor of 2; float32 rounding of a doubled sum is ~1e-6.
_TOLERANCE = 1e-3


def reduction_of(
    loss: Callable[[PyTree, PyTree], jax.Array], fixed: PyTree, batched: PyTree
) -> Literal["mean", "sum"] | None:
    """`"mean"` when `loss(fixed, batched)` on one example (the first row of every array of
    `batched`) equals the loss on that example given twice over, `"sum"` when it is twice
    that, `None` when neither or when it cannot be evaluated here. The arrays of `fixed`
    (the parameters) and of `batched` are replaced by stand-ins of their shapes and
    dtypes."""
    fixed_arrays, fixed_rest = eqx.partition(fixed, eqx.is_array)
    rows_arrays, rows_rest = eqx.partition(batched, eqx.is_array)
    fixed_specs = jax.tree.map(_spec, fixed_arrays)
    one_row = jax.tree.map(lambda a: _spec(a, rows=1), rows_arrays)

    def both(offset: jax.Array) -> tuple[jax.Array, jax.Array]:
        # `offset` (0) makes the stand-ins traced values: constants would be evaluated op
        # by op while tracing, each op compiled on its own.
        counter = iter(range(1 << 30))
        params = jax.tree.map(lambda s: _stand_in(s, next(counter), offset), fixed_specs)
        rows = jax.tree.map(lambda s: _stand_in(s, next(counter), offset), one_row)
        twice = jax.tree.map(lambda a: jnp.concatenate([a, a]), rows)
        params = eqx.combine(params, fixed_rest)
        return loss(params, eqx.combine(rows, rows_rest)), loss(
            params, eqx.combine(twice, rows_rest)
        )

    try:
        with jax.ensure_compile_time_eval():
            once_value, twice_value = map(float, jax.jit(both)(jnp.zeros((), jnp.int32)))
    except Exception:  # the loss cannot run on its own here: nothing to conclude
        return None
    if not (np.isfinite(once_value) and np.isfinite(twice_value)) or once_value == 0.0:
        return None
    ratio = twice_value / once_value
    if abs(ratio - 1.0) <= _TOLERANCE:
        return "mean"
    if abs(ratio - 2.0) <= 2 * _TOLERANCE:
        return "sum"
    return None


def _spec(leaf: jax.Array, rows: int | None = None) -> jax.ShapeDtypeStruct:
    shape = tuple(jnp.shape(leaf))
    if rows is not None:
        shape = (rows, *shape[1:])
    return jax.ShapeDtypeStruct(shape, leaf.dtype)


def _stand_in(spec: jax.ShapeDtypeStruct, salt: int, offset: jax.Array) -> jax.Array:
    """A deterministic array of `spec`'s shape and dtype: floats in [-1, 1] (a different
    pattern per leaf), integers 0 (a valid index or label), booleans True (a mask that
    keeps), keys split from key 0."""
    shape, dtype = spec.shape, spec.dtype
    size = int(np.prod(shape, dtype=np.int64))
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(offset + salt), size).reshape(shape)
    if jnp.issubdtype(dtype, jnp.inexact):
        phase = jnp.arange(size, dtype=jnp.float32) * 0.754877 + 0.569840 * (salt + 1)
        return jnp.sin((phase + offset) * 12.9898).reshape(shape).astype(dtype)
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.full(shape, offset == 0)
    return jnp.full(shape, offset, dtype)
