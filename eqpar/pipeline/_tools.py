"""Tree helpers of the pipeline executors: replication types (shard_map's `check_vma`) kept
consistent through `lax.scan` and `lax.switch`, and small pytree operations."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PyTree

from .._typing import AxisName
from .._vma import cast_varying as _cast_varying
from .._vma import varying_axes as _varying_axes

# --------------------------------------------------------------------------------------
# Replication types (shard_map's `check_vma`) across JAX versions.


def cast_tree(tree: PyTree, axes: PyTree) -> PyTree:
    """`_cast_varying` leaf by leaf; `axes` is a frozenset or a tree of them like `tree`."""
    if isinstance(axes, frozenset):
        return jax.tree.map(lambda x: _cast_varying(x, axes), tree)
    return jax.tree.map(_cast_varying, tree, axes)


def batch_axes(x: PyTree, axis_name: AxisName | None) -> frozenset:
    """The mesh axes the batch `x` is split over: those its leaves vary over, but
    `axis_name` (the pipeline's, over which it is the same on every device)."""
    return frozenset().union(*(_varying_axes(leaf) for leaf in jax.tree.leaves(x))) - {axis_name}


def vary_like_input(tree: PyTree, x: PyTree, axis_name: AxisName | None) -> PyTree:
    """`tree`'s inexact arrays marked varying over the mesh axes the batch `x` varies over
    (but `axis_name`).

    Parameters replicated over, say, a data axis would otherwise become varying only inside
    the pipeline's scan, and autodiff would then sum their gradients over that axis at every
    step of the scan; cast once here, the sum happens once, outside the loop.
    """
    axes = batch_axes(x, axis_name)
    if not axes:
        return tree
    return jax.tree.map(
        lambda leaf: _cast_varying(leaf, axes) if eqx.is_inexact_array(leaf) else leaf, tree
    )


def sum_over_cast_axes(
    grads: PyTree, original_axes: PyTree, x: PyTree, axis_name: AxisName
) -> PyTree:
    """Undo `vary_like_input` for gradients: `psum` each over the axes it was cast to."""
    axes = batch_axes(x, axis_name)

    def total(g: PyTree, original: frozenset) -> PyTree:
        added = tuple(sorted(axes - original, key=str))
        return lax.psum(g, added) if added else g

    return jax.tree.map(total, grads, original_axes)


def axes_tree(tree: PyTree) -> PyTree:
    return jax.tree.map(_varying_axes, tree)


def _union_axes(*trees: PyTree) -> PyTree:
    return jax.tree.map(lambda *sets: frozenset().union(*sets), *trees)


def typed_scan(
    body: Callable, init: PyTree, xs: PyTree, *, reverse: bool = False
) -> tuple[PyTree, PyTree]:
    """`lax.scan(body, init, xs, reverse=reverse)` with the carry's replication types
    widened until the body maps them to themselves (as `check_vma` requires of a scan
    carry); a body output narrower than its carry is widened to it."""
    carry = init
    for _ in range(8):
        out_carry, _ = jax.eval_shape(body, carry, index_tree(xs, 0))
        wanted = _union_axes(axes_tree(carry), axes_tree(out_carry))
        if jax.tree.leaves(wanted) == jax.tree.leaves(axes_tree(carry)):
            break
        carry = cast_tree(carry, wanted)
    types = axes_tree(carry)

    def typed_body(c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
        new, out = body(c, x)
        return cast_tree(new, types), out

    return lax.scan(typed_body, carry, xs, reverse=reverse)


def step_indices(length: int) -> Array:
    return jnp.arange(length, dtype=jnp.int32)


def typed_switch(index: PyTree, branches: list[Callable], *operands: PyTree) -> PyTree:
    """`lax.switch` whose branches may return values of different replication types."""
    results = [jax.eval_shape(branch, *operands) for branch in branches]
    wanted = _union_axes(*[axes_tree(r) for r in results])

    def widen(branch: Callable) -> Callable:
        return lambda *ops: cast_tree(branch(*ops), wanted)

    return lax.switch(index, [widen(b) for b in branches], *operands)


def exclusive_dispatch(
    index: Array,
    keys: Sequence[int],
    branches: Sequence[Callable],
    initial: PyTree,
    inputs: PyTree,
) -> PyTree:
    """`branches[i](initial, inputs)` where `index == keys[i]`, else `initial`: as
    `lax.switch` (the replication types widened to their union), but each branch its own
    `lax.while_loop` of zero or one trip, run one after another, carrying `initial`.

    Why not `lax.switch`: XLA updates a buffer in place through a conditional only when it
    has two branches. With more, every branch that passes the buffer through (an idle or a
    forward step, for a schedule's gradient sums) copies it, and the step copies the result
    once more after the conditional: two or three copies of a stage's gradients per step
    (`benchmarks/pipeline.py`). A while loop's carry stays in place whether it runs or not.

    Each loop's body sees `inputs` (the branch's read-only operands, a tree of arrays)
    through a select on the loop's own state, which XLA cannot fold: what a body computes
    from values the loop does not change is invariant to it, and XLA hoists it out of the
    loop, to run at every step whether the loop runs or not. As with a `lax.switch` whose
    index differs by device, a branch must not call a collective over an axis whose
    devices take different branches.
    """
    shapes = [jax.eval_shape(branch, initial, inputs) for branch in branches]
    wanted = _union_axes(axes_tree(initial), *[axes_tree(s) for s in shapes])
    value = cast_tree(initial, wanted)
    for key, branch in zip(keys, branches):

        def body(state: tuple, branch: Callable = branch) -> tuple:
            ran, value = state
            tied = jax.tree.map(lambda a: jnp.where(ran, jnp.zeros_like(a), a), inputs)
            return jnp.ones((), jnp.bool_), cast_tree(branch(value, tied), wanted)

        def runs(state: tuple, key: int = key) -> Array:
            return jnp.logical_and(jnp.logical_not(state[0]), index == key)

        _, value = lax.while_loop(runs, body, (jnp.zeros((), jnp.bool_), value))
    return value


# --------------------------------------------------------------------------------------
# Small shared helpers.


def index_tree(tree: PyTree, index: PyTree) -> PyTree:
    """Row `index` (traced) of every array leaf of `tree`."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def zeros_like(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.result_type(a)), tree)


def ring_shift_tree(
    tree: PyTree, axis_name: AxisName, size: int, offset: int, wrap: bool = True
) -> PyTree:
    """Send every leaf `offset` devices along the axis. Without `wrap` the pair that would go
    round the end of the ring (last -> first, or first -> last) is left out, and the device
    it would reach gets zeros: GPipe and 1F1B never use what crosses there."""
    perm = [(i, (i + offset) % size) for i in range(size) if wrap or 0 <= i + offset < size]
    return jax.tree.map(lambda a: lax.ppermute(a, axis_name, perm), tree)


def describe_tree(tree: PyTree) -> str:
    return str(jax.tree.map(lambda a: f"{jnp.result_type(a).name}{list(jnp.shape(a))}", tree))


def first_of_stack(stages: PyTree) -> PyTree:
    """Entry 0 of stages stacked on their array leaves' leading axis."""
    arrays, static = eqx.partition(stages, eqx.is_array)
    return eqx.combine(index_tree(arrays, 0), static)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(lambda u, v: u + v, a, b)
