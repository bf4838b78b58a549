"""A training schedule's stage run layer by layer, its gradients added into the sum in place.

A stage made of identical layers scanned one after the other (`eqpar.nn.ScannedLayers`)
would otherwise be differentiated whole: its pullback makes the gradient of every layer of
the stage at once, a buffer the size of the stage's parameters, and only then is that
added to the sum over microbatches, so both are alive together at every backward step.
Here the forward keeps each layer's own pullback residuals (stacked by layer, as autodiff of
the scan would keep them), and the backward is a reverse scan over the layers that adds
each layer's gradient into its rows of the sum as soon as it is made: one layer's gradient
is alive at a time, whatever the depth.

A stage opts in with `__pipeline_layers__()`, which returns a `LayerStack` (or `None`);
every inexact parameter of the stage must sit in the stacked layers.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree

from .._vma import varying_axes as _varying_axes
from ._tools import axes_tree, cast_tree, index_tree, typed_scan


class LayerStack(NamedTuple):
    """How a stage splits into layers: `where(stage)` is its stacked layer module (array
    leaves `[L, ...]`; `where` also applies to a tree of the stage's structure, such as its
    gradients), and `call(layer, h, *args, **kwargs)` runs one layer as the stage runs it
    (under the layer's own `jax.checkpoint` policy, which decides what its pullback keeps)."""

    where: Callable[[PyTree], PyTree]
    call: Callable[..., PyTree]


def stack_of(node: PyTree) -> LayerStack | None:
    """What `node.__pipeline_layers__()` says (`None` without the method)."""
    hook = getattr(node, "__pipeline_layers__", None)
    stack = hook() if callable(hook) else None
    return stack if isinstance(stack, LayerStack) else None


def layer_stack(stage: PyTree, params: PyTree) -> LayerStack | None:
    """The stage's `LayerStack` if it has one and holds every inexact parameter (`params`,
    the stage's inexact leaves) in its layers, else `None` (the stage runs whole)."""
    stack = stack_of(stage)
    if stack is None:
        return None
    inside = jax.tree.leaves(stack.where(params))
    return stack if len(inside) == len(jax.tree.leaves(params)) else None


class _Trace(NamedTuple):
    treedef: Any  # the structure of one layer's pullback
    sources: tuple  # per pullback leaf: the index of the layer parameter it is, or None
    out_axes: PyTree  # the replication types of a layer's output (its cotangent's)


class LayeredStage:
    """The forward and backward of a `LayerStack` stage, one layer at a time.

    `forward` returns the stage's output and the residuals to keep for the backward (each
    layer's pullback residuals stacked on a leading layer axis, the layer's own parameters
    left out: the backward takes them from the parameters); `backward` runs the layers'
    pullbacks in reverse and adds each layer's parameter gradient into the gradient sum
    `grads` at its rows. The pullbacks' structure is recorded when `forward` is traced and
    looked up by operand types when `backward` is (as the stage's whole residuals are)."""

    def __init__(self, stack: LayerStack, num_repeats: int):
        self.stack, self.num_repeats = stack, num_repeats
        self.recorded: dict = {}

    def _layers(self, stage: PyTree) -> tuple[PyTree, PyTree, PyTree]:
        """The stage's stacked layers as (inexact arrays, other arrays, static)."""
        arrays, static = eqx.partition(self.stack.where(stage), eqx.is_array)
        diff, other = eqx.partition(arrays, eqx.is_inexact_array)
        return diff, other, static

    def forward(self, stage: PyTree, h: PyTree, args: tuple, kwargs: dict) -> tuple:
        """`(output, residuals)` of the stage on `h`.

        (Writing each layer's residuals straight into the schedule's buffer instead, in the
        scan, was measured to cost more: the buffer then passes through the step's
        conditional as a value one branch changes, and the compiler copies it.)"""
        diff, other, static = self._layers(stage)
        call = self.stack.call
        key = _types(index_tree(diff, 0), h)  # as `backward` sees them

        def body(h: PyTree, layer: tuple) -> tuple:
            layer_diff, layer_other = layer
            h_diff, h_rest = eqx.partition(h, eqx.is_inexact_array)

            def run(ld: PyTree, hd: PyTree) -> tuple:
                out = call(eqx.combine(ld, layer_other, static), eqx.combine(hd, h_rest),
                           *args, **kwargs)  # fmt: skip
                return eqx.filter(out, eqx.is_inexact_array), out

            _, pullback, out = jax.vjp(run, layer_diff, h_diff, has_aux=True)
            leaves, treedef = jax.tree.flatten(pullback)
            params = jax.tree.leaves(layer_diff)
            sources = tuple(next((i for i, a in enumerate(params) if a is r), None) for r in leaves)
            out_axes = axes_tree(eqx.filter(out, eqx.is_inexact_array))
            self.recorded[key] = _Trace(treedef, sources, out_axes)
            stored = tuple(r for r, s in zip(leaves, sources) if s is None)
            return out, stored

        return typed_scan(body, h, (diff, other))

    def residual_shapes(self, stage: PyTree, h: PyTree, args: tuple, kwargs: dict) -> PyTree:
        arrays, static = eqx.partition(stage, eqx.is_array)  # Python scalars stay static

        def residuals(arrays: PyTree, h: PyTree) -> PyTree:
            return self.forward(eqx.combine(arrays, static), h, args, kwargs)[1]

        return jax.eval_shape(residuals, arrays, h)

    def backward(
        self,
        stage: PyTree,
        h: PyTree,
        residuals_of: Callable[[jax.Array], tuple],
        cotangent: PyTree,
        grads: PyTree | None,
        repeat: Any,
    ) -> tuple[PyTree | None, PyTree]:
        """`(grads, input cotangent)`: `grads` (the whole stage's gradient sum, `None` to
        leave the weights out) with each layer's gradient added in at its rows (row
        `repeat` of a circular stack first), and the cotangent of the stage input `h`.
        `residuals_of(layer)` reads what `forward` kept for that layer (from the schedule's
        residual buffer directly, not from a copy of the stage's rows)."""
        diff, _, _ = self._layers(stage)
        trace = self.recorded[_types(index_tree(diff, 0), h)]
        num_layers = jax.tree.leaves(diff)[0].shape[0]
        where = self.stack.where

        def body(carry: tuple, index: jax.Array) -> tuple:
            d_out, grads = carry
            stored = residuals_of(index)
            params = jax.tree.leaves(index_tree(diff, index))
            rest = iter(stored)
            leaves = [next(rest) if s is None else params[s] for s in trace.sources]
            pullback = jax.tree.unflatten(trace.treedef, leaves)
            d_layer, d_h = pullback(cast_tree(d_out, trace.out_axes))
            if grads is not None:
                at = (repeat, index) if self.num_repeats > 1 else (index,)
                sums = jax.tree.map(lambda g, d: _add_at(g, at, d), where(grads), d_layer)
                grads = eqx.tree_at(where, grads, sums)
            return (d_h, grads), None

        layers = jnp.arange(num_layers, dtype=jnp.int32)
        (d_h, grads), _ = typed_scan(body, (cotangent, grads), layers, reverse=True)
        return grads, d_h


def read_block(buffer: jax.Array, at: tuple) -> jax.Array:
    """The block of `buffer` at the leading indices `at` (traced)."""
    starts = (*at, *([0] * (buffer.ndim - len(at))))
    block = lax.dynamic_slice(buffer, starts, (*([1] * len(at)), *buffer.shape[len(at) :]))
    return block.reshape(buffer.shape[len(at) :])


def _add_at(total: jax.Array, at: tuple, part: jax.Array) -> jax.Array:
    """`total` with `part` added to its block at the leading indices `at` (in place in a
    loop: one dynamic slice read, one written)."""
    starts = (*at, *([0] * part.ndim))
    sizes = (*([1] * len(at)), *part.shape)
    block = lax.dynamic_slice(total, starts, sizes) + part.reshape(sizes)
    return lax.dynamic_update_slice(total, block.astype(total.dtype), starts)


def _types(*trees: PyTree) -> tuple:
    return tuple((x.shape, x.dtype, _varying_axes(x)) for x in jax.tree.leaves(trees))
