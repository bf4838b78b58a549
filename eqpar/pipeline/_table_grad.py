"""The gradient of a forward pipeline run (GPipe, circular) by the training table.

Autodiff of the forward executors' step loop keeps, at every clock step, whatever the
stage's backward needs, including values the stage derives from its weights (a circular
stage's slice of the stacked weights, a transposed weight): one copy per step, whatever the
checkpoint policy says. The training table of the same schedule (`include_backward=True`)
keeps exactly what its backward actions read, and adds each layer's gradient into the sum
over microbatches in place. Its actions are all forwards, then all backwards, so it splits
in two at the first backward step: the forward half runs as the forward pass of a
`jax.custom_vjp`, and what it leaves in its buffers is the residual; the backward half runs
as the backward pass, with the loss of each microbatch the linear map `<output, cotangent>`,
whose gradient is the output cotangent autodiff hands in. The result is autodiff's, computed
as `value_and_grad(schedule="gpipe" | "circular")` computes it.

Extra stage arguments get no gradients from the table: a forward run whose floating-point
arguments are being differentiated (computed from parameters) is differentiated by autodiff
of the loop instead, as are stages the table refuses (a `ppermute` inside), stages that close
over traced floating-point values (a function such as `lambda h: h * scale`, whose `scale` a
custom VJP could give no gradient) and runs under `check_vma=False`. So is a run traced
under forward mode (`jax.jvp`, `jax.jacfwd`), which a custom VJP does not support; a run
that forward mode reaches otherwise (`jax.linearize`, which linearizes as reverse mode
does, or `jax.jvp` of a function jitted before) needs `backward="autodiff"` on the module.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import PyTree

from .._tracing import pipeline_stage
from .._typing import AxisName
from .._vma import cast_varying, varies_over, varying_axes
from ..schedule import CircularSchedule
from . import _program
from ._jaxpr import uses_primitive
from ._loop import LoopState, StepLoop, run_schedule
from ._tools import first_of_stack, index_tree, step_indices, typed_scan


class TableBackward(NamedTuple):
    """How the training table runs a forward run's stages in its backward pass.

    - `stage`: the stages as the table calls them (say under their remat policy), given the
      stages as the forward run holds them.
    - `recompute`: keep only each stage's input and recompute its forward in the backward
      (remat `full`), instead of storing its residuals.
    """

    stage: Callable[[PyTree], PyTree]
    recompute: bool


# The stages called as they are, each forward storing its residuals.
PLAIN_TABLE = TableBackward(stage=lambda stages: stages, recompute=False)


def forward_outputs(
    stages: PyTree,
    microbatches: PyTree,
    args: tuple,
    kwargs: dict,
    arguments: Callable[[tuple, dict], Callable],
    *,
    axis_name: AxisName,
    num_stages: int,
    num_repeats: int,
    stage_policy: Callable | None,
    table: TableBackward | None,
) -> PyTree:
    """The last stage's outputs `[M, ...]` of a GPipe (`num_repeats == 1`) or circular run
    (zeros off the last stage's device); differentiated by the training table's backward
    half where `table` is given and the table can run the stages (see the module)."""
    num_microbatches = len(jax.tree.leaves(microbatches)[0])
    program_forward = forward_program(num_stages, num_microbatches, num_repeats)

    def autodiff_run(stages: PyTree, microbatches: PyTree, args: tuple, kwargs: dict) -> PyTree:
        carry = run_schedule(
            program_forward, stages, None, microbatches, None, arguments(args, kwargs),
            axis_name=axis_name, stage_policy=stage_policy,
        )  # fmt: skip
        return jax.tree.map(lambda o: o[:num_microbatches], carry.outputs)

    if (
        table is None
        or _forward_mode((stages, microbatches, args, kwargs))
        or not _table_runs(
            table.stage(stages), microbatches, args, kwargs, arguments, axis_name, num_repeats
        )
    ):
        return autodiff_run(stages, microbatches, args, kwargs)

    inputs, static = eqx.partition((stages, microbatches, args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree.flatten(inputs)
    # Which input leaves are floating-point extra arguments, and which the batch's.
    kinds = jax.tree.leaves(
        (
            jax.tree.map(lambda _: "stage", inputs[0]),
            jax.tree.map(lambda _: "batch", inputs[1]),
            jax.tree.map(lambda _: "argument", (inputs[2], inputs[3])),
        )
    )
    program = _training_program(num_stages, num_microbatches, num_repeats, table.recompute)
    split = _first_backward_step(program)
    out_slot = _output_slots(program, num_microbatches)

    def rebuild(values: list) -> tuple:
        return eqx.combine(jax.tree.unflatten(treedef, values), static)

    def loop(values: list, targets: PyTree, steps: tuple[int, int], x_grads: bool) -> StepLoop:
        stages, microbatches, args, kwargs = rebuild(values)
        return StepLoop(
            program, table.stage(stages), _linear_loss, microbatches, targets,
            arguments(args, kwargs), axis_name=axis_name, loss_dtype=jnp.float32,
            return_all_grads=x_grads, loss_on_every_device=False, stage_policy=None,
            mean=False, steps=steps,
        )  # fmt: skip

    def scan(loop: StepLoop, state: LoopState, steps: tuple[int, int]) -> LoopState:
        with pipeline_stage(axis_name):
            indices = step_indices(len(program.kind))[steps[0] : steps[1]]
            state, _ = typed_scan(loop.step, state, indices)
        return state

    @jax.custom_vjp
    def run(values: list) -> PyTree:
        return autodiff_run(*rebuild(values))

    def run_forward(primals: list) -> tuple[PyTree, dict]:
        values = [p.value for p in primals]
        perturbed = [p.perturbed for p in primals]
        if any(
            p and k == "argument" and eqx.is_inexact_array(v)
            for p, k, v in zip(perturbed, kinds, values)
        ):  # the table gives extra arguments no gradients: autodiff of the loop does
            outputs, pullback = jax.vjp(lambda vs: autodiff_run(*rebuild(vs)), values)
            return outputs, {"autodiff": pullback}
        microbatches = rebuild(values)[1]
        targets = _output_cotangents(microbatches)  # read only by the backward half
        with pipeline_stage(axis_name):
            forward = loop(values, targets, (0, split), False)
            state = scan(forward, forward.initial_state(), (0, split))
        outputs = _outputs(forward, state, out_slot, num_stages)
        kept = state._replace(grads=None, loss_grads=None, loss=None, x_grads=None)
        if table.recompute:  # the backward recomputes the outputs: keep no copy of them
            kept = kept._replace(cotangents=None, kept_rest=None)
        x_perturbed = any(p and k == "batch" for p, k in zip(perturbed, kinds))
        return outputs, {"table": (kept, values), "x": () if x_perturbed else None}

    def run_backward(residuals: dict, cotangents: PyTree) -> tuple[list]:
        if "autodiff" in residuals:
            (d_values,) = residuals["autodiff"](_instantiate(cotangents))
            return (d_values,)
        kept, values = residuals["table"]
        x_grads = residuals["x"] is not None
        targets = eqx.filter(_instantiate(cotangents), eqx.is_inexact_array)
        with pipeline_stage(axis_name):
            backward = loop(values, targets, (split, len(program.kind)), x_grads)
            fresh = backward.initial_state()
            state = kept._replace(
                grads=fresh.grads, loss_grads=fresh.loss_grads, loss=fresh.loss,
                x_grads=fresh.x_grads,
            )  # fmt: skip
            if table.recompute:
                state = state._replace(cotangents=fresh.cotangents, kept_rest=fresh.kept_rest)
            state = scan(backward, state, (split, len(program.kind)))
        # Back onto the input leaves: the stages' floating-point leaves in order (the table
        # took the gradients of the same leaves, wrapped), then the batch's.
        d_stage = iter(jax.tree.leaves(state.grads))
        d_batch = iter([])
        if x_grads:
            first = lax.axis_index(axis_name) == 0
            d_batch = iter(jax.tree.leaves(jax.tree.map(
                lambda g: lax.psum(jnp.where(first, g[:num_microbatches], 0), axis_name),
                state.x_grads,
            )))  # fmt: skip
        d_leaves: list = []
        for value, kind in zip(values, kinds):
            if not eqx.is_inexact_array(value) or kind == "argument":
                d_leaves.append(None)
            elif kind == "stage":
                d_leaves.append(_sum_to_type(next(d_stage), value))
            else:
                d_leaves.append(_sum_to_type(next(d_batch), value) if x_grads else None)
        return (d_leaves,)

    run.defvjp(run_forward, run_backward, symbolic_zeros=True)
    try:
        return run(leaves)
    except TypeError as error:
        if "forward-mode" not in str(error):
            raise
        raise TypeError(_FORWARD_MODE_ERROR) from error
    except NotImplementedError as error:
        # `shard_map` run eagerly (not under `jit`) takes no custom VJP with symbolic
        # zeros; it only ever runs the primal there (differentiation traces the body
        # first), which is the loop itself.
        if "symbolic_zeros" not in str(error):
            raise
        return autodiff_run(stages, microbatches, args, kwargs)


_FORWARD_MODE_ERROR = (
    "A GPipe or circular pipeline run (execute_pipeline, execute_circular_pipeline, "
    "PipelineModule, or blocks pipelined by eqpar.Pipeline) is differentiated in reverse "
    "mode by its training table's backward (a custom VJP), which forward mode cannot pass "
    "through. `jax.jvp` and `jax.jacfwd` traced through the run differentiate the step loop "
    "instead; for `jax.linearize`, or a function jitted before `jax.jvp` reached it, build "
    "the module with `PipelineModule(..., backward='autodiff')`, or use reverse mode "
    "(`jax.grad`, `jax.vjp`)."
)


def _forward_mode(tree: PyTree) -> bool:
    """Whether `tree`'s arrays are being differentiated in forward mode (`jax.jvp`,
    `jax.jacfwd`): the innermost autodiff of the trace is a JVP.
    Reverse mode (`jax.grad`, `jax.vjp`, `jax.linearize`) linearizes instead; a JVP around
    it (a Hessian by `jax.jacfwd(jax.grad(f))`) differentiates the custom VJP's rules."""
    # JAX exposes its tracer classes only in internal modules, which eqpar does not import:
    # the forward-mode tracer is known by its class's name (a JAX that renames it takes the
    # table, and forward mode then gets JAX's own error).
    return any(type(leaf).__name__ == "JVPTracer" for leaf in jax.tree.leaves(tree))


# --------------------------------------------------------------------------------------


def _linear_loss(outputs: PyTree, cotangents: PyTree) -> jax.Array:
    """`<outputs, cotangents>` over the outputs' floating-point leaves: its gradient in the
    outputs is the cotangents."""
    pairs = zip(jax.tree.leaves(eqx.filter(outputs, eqx.is_inexact_array)),
                jax.tree.leaves(cotangents))  # fmt: skip
    return sum(
        (jnp.vdot(o.astype(jnp.float32), c.astype(jnp.float32)) for o, c in pairs),
        start=jnp.zeros((), jnp.float32),
    )


def _output_cotangents(microbatches: PyTree) -> PyTree:
    """Zeros shaped like the outputs' floating-point leaves (the stage keeps shapes)."""
    return jax.tree.map(jnp.zeros_like, eqx.filter(microbatches, eqx.is_inexact_array))


def _instantiate(cotangents: PyTree) -> PyTree:
    def one(c: Any) -> Any:
        if not isinstance(c, SymbolicZero):
            return c
        aval: Any = c.aval
        if aval.dtype == jax.dtypes.float0:  # an integer output's
            return np.zeros(aval.shape, jax.dtypes.float0)
        zeros = jnp.zeros(aval.shape, aval.dtype)
        return cast_varying(zeros, frozenset(getattr(aval, "vma", None) or ()))

    return jax.tree.map(one, cotangents, is_leaf=lambda c: isinstance(c, SymbolicZero))


def _outputs(loop: StepLoop, state: LoopState, slots: np.ndarray, num_stages: int) -> PyTree:
    """The last stage's outputs in microbatch order, from where its forwards kept them (the
    cotangent buffer's rows, and the integer leaves beside them); zeros on other devices."""
    rows = jnp.asarray(slots)
    kept = jax.tree.map(lambda b: b[rows], state.cotangents)
    rest = jax.tree.map(lambda b: b[rows], state.kept_rest)  # None: no such leaves
    last = lax.axis_index(loop.axis_name) == num_stages - 1
    outputs = kept if rest is None else eqx.combine(kept, rest)
    return jax.tree.map(lambda o: jnp.where(last, o, jnp.zeros_like(o)), outputs)


def _table_runs(
    stage: PyTree, microbatches: PyTree, args: tuple, kwargs: dict, arguments: Callable,
    axis_name: AxisName, num_repeats: int,
) -> bool:  # fmt: skip
    """Whether the training table can run the stages: replication types tracked, a stage
    without `ppermute` (its branches differ by device) that holds every value it computes
    with as an array leaf, and outputs to differentiate."""
    if varies_over(jnp.zeros(()), axis_name) is None:
        return False
    if not jax.tree.leaves(eqx.filter(microbatches, eqx.is_inexact_array)):
        return False
    first = index_tree(microbatches, 0)
    call_args, call_kwargs = arguments(args, kwargs)(0)
    if num_repeats > 1:
        stage = first_of_stack(stage)
    arrays, static = eqx.partition((stage, call_args, call_kwargs), eqx.is_array)

    def call(arrays: PyTree, h: PyTree) -> PyTree:
        stage, call_args, call_kwargs = eqx.combine(arrays, static)
        return stage(h, *call_args, **call_kwargs)

    with pipeline_stage(axis_name):
        jaxpr = jax.make_jaxpr(call)(arrays, first)
        # A stage that closes over traced floating-point values (a function holding the
        # weights it is differentiated in, `lambda h: h * scale`) gets their gradients from
        # autodiff only: a custom VJP gives none to what it closes over.
        _, closed_over = jax.closure_convert(call, arrays, first)
    if any(eqx.is_inexact_array(c) for c in closed_over):
        return False
    return not uses_primitive(jaxpr, "ppermute")


def _sum_to_type(gradient: jax.Array, primal: jax.Array) -> jax.Array:
    """`gradient` summed over the mesh axes it varies over and `primal` does not (the
    transpose of the casts the table made), in `primal`'s dtype."""
    extra = tuple(sorted(varying_axes(gradient) - varying_axes(primal), key=str))
    if extra:
        gradient = lax.psum(gradient, extra)
    return gradient.astype(primal.dtype)


@functools.lru_cache(maxsize=64)
def forward_program(num_stages: int, num_microbatches: int, num_repeats: int):
    """The program of the GPipe (`num_repeats == 1`) or circular forward table."""
    schedule = CircularSchedule(num_stages, num_microbatches, num_repeats)
    return _program.compile_schedule(schedule, store_residuals=False)


@functools.lru_cache(maxsize=64)
def _training_program(num_stages: int, num_microbatches: int, num_repeats: int,
                      recompute: bool):  # fmt: skip
    schedule = CircularSchedule(num_stages, num_microbatches, num_repeats, include_backward=True)
    # The forward half returns the outputs: the last stage runs its forwards (and keeps their
    # outputs) even where the backward recomputes them.
    return _program.compile_schedule(schedule, store_residuals=not recompute, keep_outputs=True)


def _first_backward_step(program: _program.Program) -> int:
    """The step where the backward half starts: every action before it is a forward or
    idle, every action from it a backward or idle (as in GPipe's and circular's tables)."""
    backward = np.asarray((program.kind >= _program.BACKWARD).any(axis=1))
    forward = np.asarray(
        np.isin(program.kind, (_program.FORWARD, _program.FORWARD_LAST)).any(axis=1)
    )
    split = int(np.argmax(backward))
    if forward[split:].any() or backward[:split].any():
        raise AssertionError("the training table does not split into forwards, then backwards")
    return split


def _output_slots(program: _program.Program, num_microbatches: int) -> np.ndarray:
    """For each microbatch, the cotangent-buffer row where the last stage's forward keeps
    its output (on the last stage's device)."""
    slots = np.full(num_microbatches, -1)
    for step, device in zip(*np.nonzero(program.kind == _program.FORWARD_LAST)):
        slots[program.microbatch[step, device]] = program.cotangent_slot[step, device]
    assert (slots >= 0).all()
    return slots
