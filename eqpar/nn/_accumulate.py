"""Gradient accumulation: a batch's loss and gradients as the sum of its microbatches'.

`eqpar.value_and_grad(loss_fn, microbatches=N)` runs here. Optax's `MultiSteps` accumulates
across optimizer steps (N calls of the step, N host round trips, the update skipped N-1
times); this accumulates inside one step, over one `lax.scan`, so the step holds one
microbatch's activations and gradients and one gradient sum whatever N is, on any mesh.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree

from .._vma import cast_varying, varying_axes
from ..pipeline._tools import vary_like_input


def split_microbatches(
    batch: tuple, microbatches: int, owner: str, option: str = "microbatches"
) -> tuple[list, Any, int]:
    """The leaves of `batch` cut into `[microbatches, rows, ...]`, the batch's treedef, and
    the rows of the whole batch. `option` names the count in the errors."""
    leaves, treedef = jax.tree.flatten(batch)
    sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"{owner}: every leaf of the batch needs the batch as its leading axis, to cut it "
            f"into {option}={microbatches}; found leading sizes {sorted(map(str, sizes))}."
        )
    size = int(sizes.pop() or 0)
    if size % microbatches:
        raise ValueError(
            f"{owner}: the batch of {size} rows on this device does not divide into "
            f"{option}={microbatches}; choose a batch size or a microbatch count that "
            f"divides it."
        )
    rows = size // microbatches
    split = [leaf.reshape(microbatches, rows, *leaf.shape[1:]) for leaf in leaves]
    return split, treedef, size


def _accumulator(leaf: jax.Array) -> jax.Array:
    """A zero sum for `leaf`'s gradients: float32 at least (a bfloat16 sum over many
    microbatches would round away the later ones), typed varying as `leaf` is."""
    dtype = jnp.promote_types(leaf.dtype, jnp.float32)
    return cast_varying(jnp.zeros(leaf.shape, dtype), varying_axes(leaf))


def accumulated_value_and_grad(
    loss_fn: Callable,
    model: PyTree,
    batch: tuple,
    *,
    has_aux: bool,
    reduction: str,
    microbatches: int,
    owner: str = "value_and_grad",
) -> tuple:
    """`value_and_grad`'s rule (the loss of the whole batch and its gradients) computed as a
    `lax.scan` over `microbatches` equal slices of the batch's rows.

    The parameters are cast once, before the loop, to vary over the mesh axes the batch is
    split over: inside the loop each microbatch's gradients are this device's, unreduced,
    and added into float32 sums; the transpose of the cast sums them over those axes once,
    after the loop (one all-reduce per parameter per step, as without microbatches). The
    mean over examples is the mean of the microbatches' means, as their sizes are equal.
    `aux` (with `has_aux`) comes back stacked, one entry per microbatch."""
    split, treedef, _ = split_microbatches(batch, microbatches, owner)
    arrays, static = eqx.partition(model, eqx.is_inexact_array)
    varying, cast_back = jax.vjp(lambda a: vary_like_input(a, batch, None), arrays)

    def local(arrays: PyTree, microbatch: tuple) -> tuple[jax.Array, Any]:
        out = loss_fn(eqx.combine(arrays, static), *microbatch)
        return out if has_aux else (out, None)

    # The loss's type (dtype, and the axes it varies over: none where `loss_fn` reduces
    # over the shards itself) fixes the loop's carry and the reduction after it.
    first = jax.tree.unflatten(treedef, [leaf[0] for leaf in split])
    loss_axes: list[frozenset] = []

    def probe(arrays: PyTree) -> jax.Array:
        loss, _ = local(arrays, first)
        loss_axes.append(varying_axes(loss))
        return loss

    loss_shape = jax.eval_shape(probe, varying)
    axes = tuple(sorted(loss_axes[0], key=str))
    if loss_shape.shape != ():
        raise ValueError(
            f"{owner}: `loss_fn` must return a scalar loss; got shape {loss_shape.shape}."
        )

    # Under the mean, each microbatch's gradients enter the sum already divided by the
    # microbatches, and by the shards where the loss still varies (`loss_fn` left that to
    # this rule: `lax.pmean`, whose transpose divides likewise): the sum is then the result,
    # and the loop's buffer can be the output's.
    shards = lax.psum(1, axes) if axes else 1
    weight = 1 / (microbatches * shards) if reduction == "mean" else 1

    def step(carry: tuple, microbatch: list) -> tuple[tuple, Any]:
        loss_sum, grad_sums = carry
        (loss, aux), grads = jax.value_and_grad(local, has_aux=True)(
            varying, jax.tree.unflatten(treedef, microbatch)
        )
        grad_sums = jax.tree.map(lambda s, g: s + g.astype(s.dtype) * weight, grad_sums, grads)
        return (loss_sum + loss.astype(loss_sum.dtype), grad_sums), aux

    start = (
        cast_varying(jnp.zeros((), jnp.promote_types(loss_shape.dtype, jnp.float32)), loss_axes[0]),
        jax.tree.map(_accumulator, varying),
    )
    (loss_sum, grad_sums), aux = lax.scan(step, start, split)
    grad_sums = jax.tree.map(lambda s, a: s.astype(a.dtype), grad_sums, varying)
    (grads,) = cast_back(grad_sums)
    if reduction == "mean":
        loss = loss_sum / microbatches
        loss = lax.pmean(loss, axes) if axes else loss
    else:
        loss = lax.psum(loss_sum, axes) if axes else loss_sum
    loss = loss.astype(loss_shape.dtype)
    return ((loss, aux), grads) if has_aux else (loss, grads)
