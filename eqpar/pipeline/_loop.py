"""The step loop: any compiled schedule table run as one `lax.scan` on each device."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array

from .._typing import AxisName
from .._vma import cast_varying as _cast_varying
from .._vma import varying_axes as _varying_axes
from . import _program
from ._jaxpr import uses_primitive
from ._tools import (
    axes_tree,
    cast_tree,
    index_tree,
    step_indices,
    tree_add,
    typed_scan,
    typed_switch,
    zeros_like,
)

# --------------------------------------------------------------------------------------
# The executor: any schedule table, run as one `lax.scan`.


class _Carry(NamedTuple):
    """The loop state of `run_schedule` (fields a run does not need are `None`)."""

    received: Any  # the activation the previous device sent at the last step
    received_cotangent: Any  # the cotangent the next device sent at the last step
    inputs: Any  # stage inputs waiting for their actions: [input slots + 1, ...]
    cotangents: Any  # cotangents, and the last stage's outputs, waiting: [slots + 1, ...]
    residuals: Any  # what forwards stored for their backwards: [residual slots + 1, ...]
    outputs: Any  # forward runs: the last stage's outputs, [M + 1, ...]
    grads: Any  # gradient of the stage parameters so far
    loss_grads: Any  # gradient of loss_fn's parameters so far
    loss: Any  # the loss so far (on the device of the last stage)
    x_grads: Any  # gradient of the batch so far, [M + 1, ...] (on the first device)


class _Work(NamedTuple):
    """What one step hands to the branch of its action."""

    h: Any  # the stage input of the action's microbatch
    microbatch: Any  # its index (selects the `Microbatched` rows and the targets)
    repeat: Any  # which of the device's stages (circular schedules)
    cotangents: Any  # the cotangent buffer (a backward reads its slot inside its branch)
    cotangent_slot: Any
    residuals: Any  # the residual buffer, likewise
    residual_slot: Any
    grads: Any
    loss_grads: Any
    loss: Any
    loss_cotangent: Any  # the output cotangent from `loss_everywhere` (else None)


class _Done(NamedTuple):
    """What a branch returns (zeros where its action makes nothing)."""

    sent_forward: Any  # the stage output, for the device of the next stage
    sent_back: Any  # the input cotangent, for the device of the previous stage
    kept_cotangent: Any  # the last stage's output (forward) or its cotangent (backward input)
    residuals: Any  # what a forward stores for its backward
    output: Any  # a forward run's last-stage output
    grads: Any
    loss_grads: Any
    loss: Any


def _without_stage_weights(policy: Callable) -> Callable:
    """`policy`, except that it never saves the values named `_STAGE_WEIGHTS`."""
    exclude = jax.checkpoint_policies.save_anything_except_these_names(_STAGE_WEIGHTS)
    return lambda *args, **params: exclude(*args, **params) and policy(*args, **params)


_STAGE_WEIGHTS = "eqpar_pipeline_stage_weights"


def run_schedule(
    program: _program.Program,
    stages: Any,
    loss_fn: Callable | None,
    microbatches: Any,
    target_microbatches: Any,
    arguments_at: Callable,
    *,
    axis_name: AxisName,
    loss_dtype: Any = None,
    return_all_grads: bool = False,
    loss_on_every_device: bool = False,
    stage_policy: Callable | None = None,
) -> _Carry:
    """Run `program` (a compiled schedule table) in one `lax.scan` on this device.

    Each step writes what arrived into its buffer slot, runs the branch its action names
    (`lax.switch`), keeps what the action made for later, and sends activations forward and
    cotangents back, to exactly the devices that step's actions need (one `lax.switch` over
    the distinct sets of device pairs, indexed by the step, so every device takes the same
    branch). With `loss_fn=None` it runs a forward table and collects the last stage's
    outputs (differentiate through it); otherwise a training table, each backward computed
    with `jax.vjp` from the residuals its forward stored (`program.num_residual_slots > 0`)
    or by recomputing the forward (none stored).

    With `loss_on_every_device` (a loss function split over the pipeline axis, such as a
    vocabulary-parallel head), the loss of each microbatch runs outside the branches, on
    every device at the step its last stage's backward starts: the last stage's output goes
    to every device (one `psum`), each computes the loss and the gradient of its own part
    of the loss function, and the output's cotangent comes back summed to the last stage.

    A forward run given the stage's remat policy (`stage_policy`, as `PipelineModule`
    passes it), or of several stages per device, calls each stage under one
    `jax.checkpoint` with that policy (default: keep everything), never keeping a circular
    stage's slice of the stacked weights; with a policy it also skips the stage in each
    device's idle steps (see `skips_bubbles`).
    """
    training = loss_fn is not None
    store = program.num_residual_slots > 0
    num_repeats, num_microbatches = program.num_repeats, len(jax.tree.leaves(microbatches)[0])
    pipe = frozenset({axis_name})
    device = lax.axis_index(axis_name)
    params, static = eqx.partition(stages, eqx.is_inexact_array)
    # Circular: the other array leaves (integers) are stacked too; slice them per stage.
    others, static = eqx.partition(static, eqx.is_array) if num_repeats > 1 else (None, static)
    params = cast_tree(params, pipe)  # stays outside the loop: any sum over pipe runs once
    microbatches = cast_tree(microbatches, pipe)
    first = index_tree(microbatches, 0)
    loss_params, loss_static = eqx.partition(loss_fn, eqx.is_inexact_array)
    if not loss_on_every_device:  # it runs inside the branches, which must agree on types
        loss_params = cast_tree(loss_params, pipe)
    targets = cast_tree(target_microbatches, pipe)

    def stage_params(p: Any, repeat: Any) -> Any:
        if num_repeats == 1:
            return p
        # Named so that autodiff of a forward run recomputes the slice instead of keeping a
        # copy of the stage's weights for every step (see `call` below).
        return jax.tree.map(lambda a: checkpoint_name(a, _STAGE_WEIGHTS), index_tree(p, repeat))

    def run_stage(p: Any, h: Any, microbatch: Any, repeat: Any) -> Any:
        call_args, call_kwargs = arguments_at(microbatch)
        rest = static if others is None else eqx.combine(index_tree(others, repeat), static)
        return eqx.combine(p, rest)(h, *call_args, **call_kwargs)

    def forward_run(h: Any, microbatch: Any, repeat: Any, runs: Any = None) -> Any:
        """A forward run's stage call; with `runs` (1 or 0, by device) skipped where 0."""

        def call(p: Any, h: Any, m: Any, r: Any, runs: Any) -> Any:
            def stage(h: Any, m: Any, r: Any) -> Any:
                return run_stage(stage_params(p, r), h, m, r)

            if runs is None:
                return stage(h, m, r)
            return typed_switch(runs, [lambda h, m, r: zeros_like(h), stage], h, m, r)

        if stage_policy is None and num_repeats == 1:  # a caller's stage, called as it is
            return call(params, h, microbatch, repeat, None)
        # One checkpoint around the stage (and the skip), whose policy is the stage's own: a
        # policy around an inner `jax.checkpoint` decides for it too (it would keep what the
        # inner one drops), and without it autodiff of the loop keeps more (the residuals of
        # both branches of the skip, a circular stage's slice of the weights at every step).
        policy = _without_stage_weights(stage_policy or jax.checkpoint_policies.everything_saveable)
        return jax.checkpoint(call, policy=policy)(params, h, microbatch, repeat, runs)

    # A forward run skips the stage in a device's idle (bubble) steps, in a `lax.switch` whose
    # branch differs by device (the devices of a collective over another mesh axis share
    # their pipeline position, so they take the same branch), when a remat policy is in
    # force (`stage_policy`; without one, autodiff of the skip keeps more than the bubbles
    # save). A `ppermute` in such a branch gives wrong values (see `execute_schedule`): a
    # stage with one runs at every step, bubbles included.
    skips_bubbles = (
        not training
        and stage_policy is not None
        and bool((program.kind == _program.IDLE).any())
        and not uses_primitive(jax.make_jaxpr(lambda h: forward_run(h, 0, 0))(first), "ppermute")
    )

    def stage_vjp(p: Any, h: Any, microbatch: Any, repeat: Any = 0) -> tuple:
        """`jax.vjp` of the stage in its inexact leaves: `(pullback, output)`. Only the
        inexact leaves of the activations carry cotangents; integer or boolean leaves (masks,
        positions) ride along unchanged."""
        h_diff, h_rest = eqx.partition(h, eqx.is_inexact_array)

        def stage_part(p: Any, hd: Any) -> Any:
            out = run_stage(p, eqx.combine(hd, h_rest), microbatch, repeat)
            return eqx.filter(out, eqx.is_inexact_array), out

        _, pullback, out = jax.vjp(stage_part, p, h_diff, has_aux=True)
        return pullback, out

    layout = _Residuals(stage_vjp, stage_params(params, 0), first) if store else None
    no_residuals = layout.zeros() if layout else ()
    zero_h = zeros_like(first)
    zero_cotangent = eqx.filter(zero_h, eqx.is_inexact_array)
    zero_output = zero_h if not training else None
    scale = jnp.asarray(1.0 / num_microbatches, loss_dtype or jnp.float32)

    def add(total: Any, part: Any, repeat: Any) -> Any:
        if num_repeats == 1:
            return tree_add(total, part)
        return jax.tree.map(
            lambda g, d: lax.dynamic_update_index_in_dim(
                g, lax.dynamic_index_in_dim(g, repeat, keepdims=False) + d, repeat, 0
            ),
            total,
            part,
        )

    def nothing(w: _Work) -> _Done:
        return _Done(
            zero_h, zero_cotangent, zero_cotangent, no_residuals, zero_output,
            w.grads, w.loss_grads, w.loss,
        )  # fmt: skip

    def forward(w: _Work) -> _Done:
        p = stage_params(params, w.repeat)
        if not (training and store):
            return nothing(w)._replace(sent_forward=run_stage(p, w.h, w.microbatch, w.repeat))
        pullback, out = stage_vjp(p, w.h, w.microbatch, w.repeat)
        assert layout is not None
        residuals = layout.split(pullback, out, p, w.h)
        return nothing(w)._replace(sent_forward=out, residuals=residuals)

    def forward_last(w: _Work) -> _Done:
        if not training:
            out = run_stage(stage_params(params, w.repeat), w.h, w.microbatch, w.repeat)
            return nothing(w)._replace(output=out)
        done = forward(w)  # the output waits in the cotangent buffer for the loss
        return done._replace(
            sent_forward=zero_h, kept_cotangent=eqx.filter(done.sent_forward, eqx.is_inexact_array)
        )

    def pullback_of(w: _Work) -> tuple[Callable, Any, Any]:
        """The stage's pullback, the replication types of its output (which the cotangent
        must have) and, when recomputed, the output itself (else `None`)."""
        p = stage_params(params, w.repeat)
        if not store:
            pullback, out = stage_vjp(p, w.h, w.microbatch, w.repeat)
            return pullback, axes_tree(eqx.filter(out, eqx.is_inexact_array)), out
        assert layout is not None
        pullback, out_axes = layout.join(index_tree(w.residuals, w.residual_slot), p, w.h)
        return pullback, out_axes, None

    def backward(w: _Work, *, weights: bool = True, inputs: bool = True) -> _Done:
        pullback, out_axes, _ = pullback_of(w)
        cotangent = cast_tree(index_tree(w.cotangents, w.cotangent_slot), out_axes)
        d_params, d_h = pullback(cotangent)
        done = nothing(w)
        if weights:
            done = done._replace(grads=add(w.grads, d_params, w.repeat))
        return done._replace(sent_back=d_h) if inputs else done

    def loss_and_pullback(out_diff: Any, out_rest: Any, microbatch: Any) -> tuple:
        """The cotangent of one microbatch's output, the gradient of `loss_fn`'s parameters
        and the microbatch's share of the mean loss."""
        target = index_tree(targets, microbatch)

        def loss_of(od: Any, lp: Any) -> Any:
            return eqx.combine(lp, loss_static)(eqx.combine(od, out_rest), target)

        value, loss_pullback = jax.vjp(loss_of, out_diff, loss_params)
        d_out, d_loss_params = loss_pullback(_cast_varying(scale, _varying_axes(value)))
        return d_out, d_loss_params, value * scale

    # The steps at which a last stage's backward starts: the device that runs it, its
    # microbatch and the slot where its forward kept the output (-1: none at that step).
    last_stage = np.isin(program.kind, (_program.BACKWARD_LAST, _program.BACKWARD_INPUT_LAST))
    if (last_stage.sum(axis=1) > 1).any():  # one device holds the last stage
        raise AssertionError("a step starts two last-stage backwards")
    loss_device = np.where(last_stage.any(axis=1), last_stage.argmax(axis=1), -1)
    steps = np.arange(len(program.kind))
    at_loss_device = (steps, np.maximum(loss_device, 0))
    loss_steps = jnp.asarray(np.stack([
        loss_device, program.microbatch[at_loss_device], program.cotangent_slot[at_loss_device],
        program.repeat[at_loss_device],
    ], axis=-1))  # fmt: skip

    def loss_everywhere(cotangents: Any, h: Any, t: Array) -> tuple:
        """At a step where a last stage's backward starts: every device's part of its loss
        (`loss_on_every_device`); zeros at the other steps. `h` is this device's stage input
        at the step: on the last stage's device, the input of that stage's backward."""
        owner, microbatch, slot, repeat = loss_steps[t]

        def run(cotangents: Any) -> tuple:
            if store:  # the last stage's forward kept its output
                kept = index_tree(cotangents, jnp.maximum(slot, 0))
            else:  # it left its forward to its backward: run it here, on every device alike
                out = run_stage(stage_params(params, repeat), h, microbatch, repeat)
                kept = eqx.filter(out, eqx.is_inexact_array)
            out_diff = jax.tree.map(
                lambda a: lax.psum(jnp.where(device == owner, a, jnp.zeros_like(a)), axis_name),
                kept,
            )
            # Integer leaves (masks) pass through the stages unchanged: the microbatch's own.
            out_rest = _integer_leaves(index_tree(microbatches, microbatch))
            return loss_and_pullback(out_diff, out_rest, microbatch)

        def skip(cotangents: Any) -> tuple:
            shapes = jax.eval_shape(run, cotangents)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        # The step, not the device, picks the branch: every device runs the same one.
        return typed_switch((owner >= 0).astype(jnp.int32), [skip, run], cotangents)

    def backward_last(w: _Work, *, weights: bool = True) -> _Done:
        pullback, out_axes, out = pullback_of(w)
        if out is None:  # the forward kept the output's inexact leaves; the others are the
            # input's (a stage passes integer leaves such as masks through unchanged)
            out = eqx.combine(index_tree(w.cotangents, w.cotangent_slot), _integer_leaves(w.h))
        if loss_on_every_device:  # the loss ran before the branches (`loss_everywhere`)
            d_out, done = w.loss_cotangent, nothing(w)
        else:
            out_diff, out_rest = eqx.partition(out, eqx.is_inexact_array)
            d_out, d_loss_params, part = loss_and_pullback(out_diff, out_rest, w.microbatch)
            done = nothing(w)._replace(
                loss_grads=tree_add(w.loss_grads, d_loss_params), loss=w.loss + part
            )
        d_params, d_h = pullback(cast_tree(d_out, out_axes))
        done = done._replace(sent_back=d_h)
        if weights:
            return done._replace(grads=add(w.grads, d_params, w.repeat))
        return done._replace(kept_cotangent=d_out)  # for the weight gradient, later

    by_kind = {
        _program.IDLE: nothing,
        _program.FORWARD: forward,
        _program.FORWARD_LAST: forward_last,
        _program.BACKWARD: backward,
        _program.BACKWARD_LAST: backward_last,
        _program.BACKWARD_INPUT: lambda w: backward(w, weights=False),
        _program.BACKWARD_INPUT_LAST: lambda w: backward_last(w, weights=False),
        _program.BACKWARD_WEIGHT: lambda w: backward(w, inputs=False),
    }
    # Only the kinds the table uses are traced: one branch each.
    kinds = np.unique(program.kind)
    branches = [by_kind[int(k)] for k in kinds]
    columns = (
        program.kind, np.searchsorted(kinds, program.kind), program.microbatch, program.repeat,
        program.input_slot, program.cotangent_slot, program.residual_slot,
        program.received_input_slot, program.received_cotangent_slot,
    )  # fmt: skip
    table = jnp.asarray(np.stack(columns, axis=-1))  # [steps, devices, columns]
    sends = jnp.asarray(np.stack([program.forward_sends, program.backward_sends], axis=-1))

    def send(tree: Any, pattern: Any, pairs: tuple) -> Any:
        def shift(pair_set: tuple) -> Callable:
            if not pair_set:
                return zeros_like
            return lambda t: jax.tree.map(lambda a: lax.ppermute(a, axis_name, pair_set), t)

        if len(pairs) == 1:
            return shift(pairs[0])(tree)
        return typed_switch(pattern, [shift(p) for p in pairs], tree)

    def step(carry: _Carry, t: Array) -> tuple[_Carry, None]:
        (
            kind,
            branch,
            microbatch,
            repeat,
            input_slot,
            cotangent_slot,
            residual_slot,
            got_h,
            got_cot,
        ) = table[t, device]
        inputs = _write(carry.inputs, got_h, carry.received)
        cotangents = carry.cotangents
        if training:
            cotangents = _write(cotangents, got_cot, carry.received_cotangent)
        fresh = index_tree(microbatches, microbatch)
        waiting = index_tree(inputs, jnp.maximum(input_slot, 0))
        h = jax.tree.map(lambda f, s: jnp.where(input_slot < 0, f, s), fresh, waiting)
        loss_grads, loss, loss_cotangent = carry.loss_grads, carry.loss, None
        if training and loss_on_every_device:
            loss_cotangent, d_loss_params, part = loss_everywhere(cotangents, h, t)
            loss_grads, loss = tree_add(loss_grads, d_loss_params), loss + part
        work = _Work(
            h, microbatch, repeat, cotangents, cotangent_slot, carry.residuals, residual_slot,
            carry.grads, loss_grads, loss, loss_cotangent,
        )  # fmt: skip
        if training:
            done = typed_switch(branch, branches, work) if len(branches) > 1 else branches[0](work)
        is_forward = (kind == _program.FORWARD) | (kind == _program.FORWARD_LAST)
        if not training:
            out = forward_run(
                h, microbatch, repeat, is_forward.astype(jnp.int32) if skips_bubbles else None
            )
            done = nothing(work)._replace(sent_forward=out, output=out)
        keeps_cotangent = (kind == _program.FORWARD_LAST) | (kind == _program.BACKWARD_INPUT_LAST)
        spare_cotangent = program.num_cotangent_slots
        if training:
            cotangents = _write(
                cotangents, jnp.where(keeps_cotangent, cotangent_slot, spare_cotangent),
                done.kept_cotangent,
            )  # fmt: skip
        residuals = carry.residuals
        if store:
            spare = program.num_residual_slots
            residuals = _write(
                residuals, jnp.where(is_forward, residual_slot, spare), done.residuals
            )
        outputs, x_grads = carry.outputs, carry.x_grads
        if outputs is not None:
            row = jnp.where(kind == _program.FORWARD_LAST, microbatch, num_microbatches)
            outputs = _write(outputs, row, done.output)
        if x_grads is not None:
            takes_input = (kind >= _program.BACKWARD) & (kind != _program.BACKWARD_WEIGHT)
            row = jnp.where(
                takes_input & (device == 0) & (repeat == 0), microbatch, num_microbatches
            )
            x_grads = _write(x_grads, row, done.sent_back)
        forward_pattern, backward_pattern = sends[t]
        new = _Carry(
            send(done.sent_forward, forward_pattern, program.forward_pairs),
            send(done.sent_back, backward_pattern, program.backward_pairs) if training else None,
            inputs, cotangents, residuals, outputs,
            done.grads, done.loss_grads, done.loss, x_grads,
        )  # fmt: skip
        return new, None

    def buffer(tree: Any, rows: int) -> Any:
        return jax.tree.map(lambda z: jnp.zeros((rows, *z.shape), z.dtype), tree)

    init = _Carry(
        received=zero_h,
        received_cotangent=zero_cotangent if training else None,
        inputs=buffer(zero_h, program.num_input_slots + 1),
        cotangents=buffer(zero_cotangent, program.num_cotangent_slots + 1) if training else None,
        residuals=buffer(no_residuals, program.num_residual_slots + 1),
        outputs=None if training else buffer(zero_h, num_microbatches + 1),
        grads=cast_tree(zeros_like(params), axes_tree(params)) if training else None,
        loss_grads=cast_tree(zeros_like(loss_params), axes_tree(loss_params)) if training else None,
        loss=_cast_varying(jnp.zeros((), scale.dtype), pipe) if training else None,
        x_grads=buffer(zero_cotangent, num_microbatches + 1) if return_all_grads else None,
    )
    carry, _ = typed_scan(step, init, step_indices(len(program.kind)))
    return carry


def _integer_leaves(tree: Any) -> Any:
    return eqx.filter(tree, eqx.is_inexact_array, inverse=True)


def _write(buffer: Any, row: Any, value: Any) -> Any:
    """`buffer` with `value` in row `row` (traced)."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, row, 0), buffer, value)


class _Residuals:
    """The residuals a 1F1B forward stores for its backward.

    `jax.vjp`'s pullback is a pytree whose leaves are its residuals. The forward step stores
    those that are not the parameters or the stage input themselves (a linear layer's weight
    and input are kept anyway, so they are not copied into every slot); the backward step
    rebuilds the pullback from the stored ones and the inputs. The backward uses the tree
    structure and the leaf sources that the forward branch recorded when it was traced with
    the same operand types (shapes, dtypes, replication types; the branches of one step share
    their operands), so the two always agree even where JAX caches a trace; an abstract probe
    beforehand gives only the shapes the other branches return as zeros."""

    def __init__(self, stage_vjp: Callable, params: Any, h: Any):
        def probe(params: Any, h: Any) -> Any:
            pullback, _ = stage_vjp(params, h, jnp.zeros((), jnp.int32))
            return self._stored(pullback, _sources(pullback, params, h))

        self.shapes = jax.eval_shape(probe, params, h)
        self.recorded: dict = {}  # operand types -> the forward's treedef, sources, out axes

    @staticmethod
    def _stored(pullback: Any, sources: tuple) -> tuple:
        return tuple(r for r, s in zip(jax.tree.leaves(pullback), sources) if s is None)

    def zeros(self) -> tuple:
        return tuple(zeros_like(self.shapes))

    def split(self, pullback: Any, out: Any, params: Any, h: Any) -> tuple:
        """The residuals of `pullback` to store (recording where the others come from, and
        the replication types of the output `out`, which its cotangent must have)."""
        sources = _sources(pullback, params, h)
        out_axes = axes_tree(eqx.filter(out, eqx.is_inexact_array))
        self.recorded[_types(params, h)] = (jax.tree.structure(pullback), sources, out_axes)
        stored = self._stored(pullback, sources)
        if [(r.shape, r.dtype) for r in stored] != [(r.shape, r.dtype) for r in self.shapes]:
            raise RuntimeError(
                "execute_1f1b: the stage's residuals differ between two traces of the same "
                "stage, so they cannot be stored for the backward step; pass recompute=True."
            )
        return stored

    def join(self, stored: Any, params: Any, h: Any) -> tuple[Any, Any]:
        """The pullback rebuilt from the stored residuals and the inputs, and the replication
        types its cotangent must have."""
        treedef, sources, out_axes = self.recorded[_types(params, h)]  # forward traced first
        inputs, rest = _inputs(params, h), iter(stored)
        leaves = [next(rest) if s is None else inputs[s] for s in sources]
        return jax.tree.unflatten(treedef, leaves), out_axes


def _types(*trees: Any) -> tuple:
    return tuple((x.shape, x.dtype, _varying_axes(x)) for x in jax.tree.leaves(trees))


def _inputs(params: Any, h: Any) -> list:
    return jax.tree.leaves((params, eqx.filter(h, eqx.is_inexact_array)))


def _sources(pullback: Any, params: Any, h: Any) -> tuple:
    """For each residual of `pullback`: the index of the input leaf it is, or None."""
    inputs = _inputs(params, h)
    return tuple(
        next((i for i, a in enumerate(inputs) if a is r), None) for r in jax.tree.leaves(pullback)
    )
