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
from jax.extend.core import Literal
from jaxtyping import PyTree

from .._vma import varying_axes as _varying_axes
from ._tools import axes_tree, cast_tree, index_tree, typed_scan, zeros_like


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
    if stack is None or not jax.tree.leaves(params):  # nothing to sum
        return None
    inside = jax.tree.leaves(stack.where(params))
    return stack if len(inside) == len(jax.tree.leaves(params)) else None


class _Trace(NamedTuple):
    treedef: Any  # the structure of one layer's pullback
    # Per pullback leaf: ("param", i) for the layer's parameter leaf i, ("input", j) for its
    # input's inexact leaf j, or None (stored).
    sources: tuple
    out_axes: PyTree  # the replication types of a layer's output (its cotangent's)
    # Per stored leaf (pullback order): whether it is the same in every layer (it depends on
    # neither the layer's arrays nor its input: a stage argument, a constant such as a
    # causal mask), and so kept once rather than once per layer.
    invariant: tuple = ()


class LayeredStage:
    """The forward and backward of a `LayerStack` stage, one layer at a time.

    `forward` returns the stage's output and the residuals to keep for the backward, a
    tuple: each layer's pullback residuals stacked on a leading layer axis, less the layer's
    own parameters (the backward takes them from the parameters); then those that are the
    same in every layer, once, without the layer axis; then, where the pullbacks use their
    input, the inputs of layers 1 to L - 1 (layer 0's is the stage input, which the schedule
    keeps for the backward anyway). `backward` runs the layers' pullbacks in reverse and
    adds each layer's parameter gradient into the gradient sum `grads` at its rows. The
    pullbacks' structure is recorded when `forward` is traced and looked up by operand
    types when `backward` is (as the stage's whole residuals are)."""

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

        def step(h: PyTree, layer: tuple) -> tuple:
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
            self.recorded[key] = _Trace(treedef, sources, out_axes)
            needs_input = any(s is not None and s[0] == "input" for s in sources)
            return out, stored, tuple(jax.tree.leaves(h_diff)) if needs_input else ()

        # Which stored residuals are the same in every layer: those that depend on neither
        # the carried activation nor the layer's arrays (the probe's inputs).
        probe, shapes = jax.make_jaxpr(step, return_shape=True)(h, index_tree((diff, other), 0))
        first = len(jax.tree.leaves(shapes[0]))
        invariant = _invariant_outputs(probe)[first : first + len(shapes[1])]

        def body(carry: tuple, layer: tuple) -> tuple:
            h, _ = carry
            out, stored, inputs = step(h, layer)
            varying = tuple(r for r, same in zip(stored, invariant) if not same)
            kept = tuple(r for r, same in zip(stored, invariant) if same)  # each layer's alike
            return (out, kept), (varying, inputs)

        kept = tuple(zeros_like(r) for r, same in zip(shapes[1], invariant) if same)
        (out, kept), (varying, inputs) = typed_scan(body, (h, kept), (diff, other))
        self.recorded[key] = self.recorded[key]._replace(invariant=tuple(invariant))
        return out, (*varying, *kept, *(a[1:] for a in inputs))

    def residual_shapes(self, stage: PyTree, h: PyTree, args: tuple, kwargs: dict) -> PyTree:
        arrays, static = eqx.partition(stage, eqx.is_array)  # Python scalars stay static

        def residuals(arrays: PyTree, h: PyTree) -> PyTree:
            return self.forward(eqx.combine(arrays, static), h, args, kwargs)[1]

        return jax.eval_shape(residuals, arrays, h)

    def backward(
        self,
        stage: PyTree,
        h: PyTree,
        read: Callable[[int, jax.Array | None], jax.Array],
        cotangent: PyTree,
        grads: PyTree | None,
        repeat: Any,
    ) -> tuple[PyTree | None, PyTree]:
        """`(grads, input cotangent)`: `grads` (the whole stage's gradient sum, `None` to
        leave the weights out) with each layer's gradient added in at its rows (row
        `repeat` of a circular stack first), and the cotangent of the stage input `h`.
        `read(k, layer)` reads residual leaf `k` of what `forward` kept, at `layer` (`None`
        for a leaf without the layer axis), from the schedule's residual buffer directly
        rather than from a copy of the stage's rows."""
        diff, _, _ = self._layers(stage)
        trace = self.recorded[_types(index_tree(diff, 0), h)]
        num_layers = jax.tree.leaves(diff)[0].shape[0]
        where = self.stack.where
        stage_input = jax.tree.leaves(eqx.filter(h, eqx.is_inexact_array))
        num_varying = trace.invariant.count(False)
        num_kept = len(trace.invariant) - num_varying
        kept = [read(num_varying + k, None) for k in range(num_kept)]
        first_input = num_varying + num_kept

        def layer_input(index: jax.Array) -> list:
            """Layer `index`'s input: the stage input, or what layer `index - 1` made."""
            if num_layers == 1:
                return stage_input
            previous = jnp.maximum(index - 1, 0)
            made = [read(first_input + k, previous) for k in range(len(stage_input))]
            return [
                jnp.where(index == 0, *cast_tree((a, b), _varying_axes(a) | _varying_axes(b)))
                for a, b in zip(stage_input, made)
            ]

        def body(carry: tuple, index: jax.Array) -> tuple:
            d_out, grads = carry
            varying, once = iter([read(k, index) for k in range(num_varying)]), iter(kept)
            stored = iter([next(once if same else varying) for same in trace.invariant])
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


def _invariant_outputs(closed: Any) -> list[bool]:
    """Per output of the jaxpr `closed`: whether it depends on none of its inputs (only on
    constants and the values it closes over)."""
    jaxpr = closed.jaxpr
    return [not d for d in _dependent_outputs(jaxpr, [True] * len(jaxpr.invars))]


def _dependent_outputs(jaxpr: Any, dependent_inputs: list[bool]) -> list[bool]:
    """Which outputs of `jaxpr` depend on the inputs marked in `dependent_inputs`. Calls of
    a jaxpr with the same inputs and outputs (`jit`, `checkpoint`, custom derivatives) are
    followed output by output; any other equation counts as depending on an input if any
    of its operands does, however it uses it (conservative: a value so marked is only kept
    once per layer)."""
    dependent = {v for v, d in zip(jaxpr.invars, dependent_inputs) if d}

    def depends(v: Any) -> bool:
        return not isinstance(v, Literal) and v in dependent

    for equation in jaxpr.eqns:
        operands = [depends(v) for v in equation.invars]
        if not any(operands):
            continue
        inner = _called_jaxpr(equation)
        if inner is None:
            dependent.update(equation.outvars)
            continue
        for v, d in zip(equation.outvars, _dependent_outputs(inner, operands)):
            if d:
                dependent.add(v)
    return [depends(v) for v in jaxpr.outvars]


# Primitives that call a jaxpr once on their own operands, giving its results (no loop: a
# loop's results can depend on its operands across iterations, which one pass would miss).
_CALLS = frozenset({
    "pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
})  # fmt: skip


def _called_jaxpr(equation: Any) -> Any:
    """The jaxpr a call equation (`_CALLS`) calls with its own operands and results."""
    if equation.primitive.name not in _CALLS:
        return None
    for value in equation.params.values():
        inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's, or a Jaxpr itself
        invars, outvars = getattr(inner, "invars", None), getattr(inner, "outvars", None)
        if invars is None or outvars is None:
            continue
        if len(invars) == len(equation.invars) and len(outvars) == len(equation.outvars):
            return inner
    return None


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
    if not at:
        return buffer
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
