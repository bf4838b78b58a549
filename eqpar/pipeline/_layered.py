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
    # Per pullback leaf: ("param", i) for the layer's parameter leaf i, ("input", j) for its
    # input's inexact leaf j, or None (stored).
    sources: tuple
    out_axes: PyTree  # the replication types of a layer's output (its cotangent's)
    num_stored: int  # stored leaves per layer; the layer inputs follow when a source is one


class LayeredStage:
    """The forward and backward of a `LayerStack` stage, one layer at a time.

    `forward` returns the stage's output and the residuals to keep for the backward: each
    layer's pullback residuals stacked on a leading layer axis, less the layer's own
    parameters (the backward takes them from the parameters) and its input, which is kept
    once, as the inputs of layers 1 to L - 1 (layer 0's is the stage input, which the
    schedule keeps for the backward anyway); `backward` runs the layers' pullbacks in
    reverse and adds each layer's parameter gradient into the gradient sum `grads` at its
    rows. The pullbacks' structure is recorded when `forward` is traced and
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
            named = [("param", a) for a in jax.tree.leaves(layer_diff)]
            named += [("input", a) for a in jax.tree.leaves(h_diff)]
            sources = tuple(_source(r, named) for r in leaves)
            out_axes = axes_tree(eqx.filter(out, eqx.is_inexact_array))
            stored = tuple(r for r, s in zip(leaves, sources) if s is None)
            self.recorded[key] = _Trace(treedef, sources, out_axes, len(stored))
            needs_input = any(s is not None and s[0] == "input" for s in sources)
            return out, (stored, tuple(jax.tree.leaves(h_diff)) if needs_input else ())

        out, (stored, inputs) = typed_scan(body, h, (diff, other))
        return out, (*stored, *(a[1:] for a in inputs))

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
        stage_input = jax.tree.leaves(eqx.filter(h, eqx.is_inexact_array))

        def layer_input(index: jax.Array) -> list:
            """Layer `index`'s input: the stage input, or what layer `index - 1` made."""
            if num_layers == 1:
                return stage_input
            kept = residuals_of(jnp.maximum(index - 1, 0))[trace.num_stored :]
            return [
                jnp.where(index == 0, *cast_tree((a, b), _varying_axes(a) | _varying_axes(b)))
                for a, b in zip(stage_input, kept)
            ]

        def body(carry: tuple, index: jax.Array) -> tuple:
            d_out, grads = carry
            stored = iter(residuals_of(index)[: trace.num_stored])
            inputs = {"param": jax.tree.leaves(index_tree(diff, index))}
            if any(s is not None and s[0] == "input" for s in trace.sources):
                inputs["input"] = layer_input(index)
            leaves = [next(stored) if s is None else inputs[s[0]][s[1]] for s in trace.sources]
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


def _source(residual: Any, named: list) -> tuple | None:
    """`(kind, index)` of the input leaf `residual` is (by identity) among `named`'s
    `(kind, leaf)` pairs, the index counted within its kind; None if it is none of them."""
    counts: dict[str, int] = {}
    for kind, leaf in named:
        if leaf is residual:
            return kind, counts.get(kind, 0)
        counts[kind] = counts.get(kind, 0) + 1
    return None


def read_block(buffer: jax.Array, at: tuple) -> jax.Array:
    """The block of `buffer` at the leading indices `at` (traced); zeros where a leading
    dimension is empty (the layer inputs of a one-layer stage, which are never read)."""
    if 0 in buffer.shape[: len(at)]:
        return jnp.zeros(buffer.shape[len(at) :], buffer.dtype)
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
