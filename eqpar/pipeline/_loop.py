"""The step loop: any compiled schedule table run as one `lax.scan` on each device."""

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, PyTree

from .._tracing import pipeline_stage
from .._typing import AxisName
from .._vma import cast_varying as _cast_varying
from .._vma import varies_over as _varies_over
from .._vma import varying_axes as _varying_axes
from . import _program
from ._jaxpr import uses_primitive
from ._layered import LayeredStage, layer_stack, read_block
from ._tools import (
    axes_tree,
    cast_tree,
    exclusive_dispatch,
    index_tree,
    step_indices,
    tree_add,
    typed_scan,
    typed_switch,
    zeros_like,
)

# --------------------------------------------------------------------------------------
# The executor: any schedule table, run as one `lax.scan`.


# The loop's values are pytrees whose structure is the user's (stages, activations, losses):
# `Tree` names them; `Index` is a step's scalar from the table (traced int32) or a literal.
Tree: TypeAlias = PyTree
Index: TypeAlias = Array | int


class LoopState(NamedTuple):
    """The carry of the step loop (fields a run does not need are `None`)."""

    received: Tree  # the activation the previous device sent at the last step
    received_cotangent: Tree | None  # the cotangent the next device sent at the last step
    inputs: Tree  # stage inputs waiting for their actions: [input slots + 1, ...]
    cotangents: Tree | None  # cotangents, and the last stage's outputs, waiting: [slots + 1, ...]
    # The last stage's outputs' other leaves (integers, booleans), beside their inexact leaves
    # in `cotangents` (same rows): the loss sees what the stage returned, not its input's.
    kept_rest: Tree | None
    residuals: Tree  # what forwards stored for their backwards: [residual slots, ...]
    outputs: Tree | None  # forward runs: the last stage's outputs, [M + 1, ...]
    grads: Tree | None  # gradient of the stage parameters so far
    loss_grads: Tree | None  # gradient of loss_fn's parameters so far
    loss: Array | None  # the loss so far (on the device of the last stage)
    x_grads: Tree | None  # gradient of the batch so far, [M + 1, ...] (on the first device)
    # What arrived at the last step in the program's other lanes (`Program.other_lanes`).
    received_other: tuple = ()


class Work(NamedTuple):
    """What one step hands to the method of its action."""

    h: Tree  # the stage input of the action's microbatch
    microbatch: Index  # its index (selects the `Microbatched` rows and the targets)
    repeat: Index  # which of the device's stages (circular schedules)
    cotangents: Tree | None  # the cotangent buffer (a backward reads its slot in its branch)
    cotangent_slot: Index
    kept_rest: Tree | None  # the last stage's outputs' other leaves (rows as `cotangents`)
    residuals: Tree  # the residual buffer, likewise
    residual_slot: Index
    grads: Tree | None
    loss_grads: Tree | None
    loss: Array | None
    loss_cotangent: Tree | None  # the output cotangent from `loss_everywhere` (else None)


class Done(NamedTuple):
    """What an action returns (zeros where it makes nothing)."""

    sent_forward: Tree  # the stage output, for the device of the next stage
    sent_back: Tree  # the input cotangent, for the device of the previous stage
    kept_cotangent: Tree  # the last stage's output (forward) or its cotangent (backward input)
    kept_rest: Tree  # the last stage's output's other leaves (forward)
    residuals: Tree  # the residual buffer, a forward's rows written in at its slot
    output: Tree | None  # a forward run's last-stage output
    grads: Tree | None
    loss_grads: Tree | None
    loss: Array | None


def _without_stage_weights(policy: Callable) -> Callable:
    """`policy`, except that it never saves the values named `_STAGE_WEIGHTS`."""
    exclude = jax.checkpoint_policies.save_anything_except_these_names(_STAGE_WEIGHTS)
    return lambda *args, **params: exclude(*args, **params) and policy(*args, **params)


_STAGE_WEIGHTS = "eqpar_pipeline_stage_weights"


def run_schedule(
    program: _program.Program,
    stages: Tree,
    loss_fn: Callable | None,
    microbatches: Tree,
    target_microbatches: Tree,
    arguments_at: Callable,
    *,
    axis_name: AxisName,
    loss_dtype: Any = None,
    return_all_grads: bool = False,
    loss_on_every_device: bool = False,
    stage_policy: Callable | None = None,
    shards: int = 1,
) -> LoopState:
    """Run `program` (a compiled schedule table) in one `lax.scan` on this device.

    Each step writes what arrived into its buffer slot, runs the action its table names
    (`StepLoop.act`: the method of each kind in a loop of zero or one trip, so that the
    gradient sums and the residual buffer stay in place), keeps what the action made for
    later, and sends
    activations forward and cotangents back, to exactly the devices that step's actions need
    (one `lax.switch` over the distinct sets of device pairs, indexed by the step, so every
    device takes the same branch). With `loss_fn=None` it runs a forward table and collects
    the last stage's outputs (differentiate through it); otherwise a training table, each
    backward computed with `jax.vjp` from the residuals its forward stored
    (`program.num_residual_slots > 0`) or by recomputing the forward (none stored).

    With `loss_on_every_device` (a loss function split over the pipeline axis, such as a
    vocabulary-parallel head), the loss of each microbatch runs outside the branches, on
    every device at the step its last stage's backward starts: the last stage's output goes
    to every device (one `psum`), each computes the loss and the gradient of its own part
    of the loss function, and the output's cotangent comes back summed to the last stage.

    A forward run given the stage's remat policy (`stage_policy`, as `PipelineModule`
    passes it), or of several stages per device, calls each stage under one
    `jax.checkpoint` with that policy (default: keep everything), never keeping a circular
    stage's slice of the stacked weights; with a policy it also skips the stage in each
    device's idle steps (see `StepLoop.skips_bubbles`).
    """
    with pipeline_stage(axis_name):  # every trace of a stage, its shapes' probes included
        loop = StepLoop(
            program, stages, loss_fn, microbatches, target_microbatches, arguments_at,
            axis_name=axis_name, loss_dtype=loss_dtype, return_all_grads=return_all_grads,
            loss_on_every_device=loss_on_every_device, stage_policy=stage_policy,
            shards=shards,
        )  # fmt: skip
        state, _ = typed_scan(loop.step, loop.initial_state(), step_indices(len(program.kind)))
    return state


class StepLoop:
    """One device's view of a compiled schedule: what it holds, and one method per action.

    Built inside `shard_map` (it holds traced values); `run_schedule` scans `step` over the
    table's steps. The action methods (`idle`, `forward`, `forward_last`, `backward`,
    `backward_last`, `backward_input`, `backward_input_last`, `backward_weight`) take a
    `Work` and return a `Done`; `step` routes each step to its action and moves what it made.
    """

    def __init__(
        self,
        program: _program.Program,
        stages: Tree,
        loss_fn: Callable | None,
        microbatches: Tree,
        target_microbatches: Tree,
        arguments_at: Callable,
        *,
        axis_name: AxisName,
        loss_dtype: Any,
        return_all_grads: bool,
        loss_on_every_device: bool,
        stage_policy: Callable | None,
        shards: int = 1,
        mean: bool = True,
        steps: tuple[int, int] | None = None,
    ):
        self.program, self.axis_name, self.arguments_at = program, axis_name, arguments_at
        self.training = loss_fn is not None
        self.store = program.num_residual_slots > 0
        self.num_repeats = program.num_repeats
        self.num_microbatches = len(jax.tree.leaves(microbatches)[0])
        self.return_all_grads, self.loss_on_every_device = return_all_grads, loss_on_every_device
        self.stage_policy = stage_policy
        self.pipe = frozenset({axis_name})
        self.device = lax.axis_index(axis_name)
        params, static = eqx.partition(stages, eqx.is_inexact_array)
        # Circular: the other array leaves (integers) are stacked too; slice them per stage.
        others, static = (
            eqx.partition(static, eqx.is_array) if self.num_repeats > 1 else (None, static)
        )
        self.others, self.static = others, static
        self.params = cast_tree(params, self.pipe)  # outside the loop: any sum over pipe once
        self.microbatches = cast_tree(microbatches, self.pipe)
        self.first = index_tree(self.microbatches, 0)
        loss_params, self.loss_static = eqx.partition(loss_fn, eqx.is_inexact_array)
        if not loss_on_every_device:  # it runs inside the branches, which must agree on types
            loss_params = cast_tree(loss_params, self.pipe)
        self.loss_params = loss_params
        # In the branches the targets must have the branches' types; a loss run on every
        # device (`loss_everywhere`) takes them as they are, the same on every device, so that
        # its value is too (a loss typed as varying over the axis would have the cotangent of
        # its replicated output summed over the axis: a gradient S times too large).
        self.targets = (
            target_microbatches
            if loss_on_every_device
            else cast_tree(target_microbatches, self.pipe)
        )
        self.skips_bubbles = self._skips_bubbles()
        # A stage of scanned layers runs layer by layer in training, each layer's gradient
        # added into the sum in place (`_layered`); any other stage is differentiated whole.
        stack = layer_stack(stages, self.params) if self.training else None
        self.layered = LayeredStage(stack, self.num_repeats) if stack else None
        self.layout = None
        self.no_residuals: tuple = ()
        if self.store and self.layered is not None:
            stage = self.stage_at(self.stage_params(self.params, 0), 0)
            args, kwargs = arguments_at(0)
            shapes = self.layered.residual_shapes(stage, self.first, args, kwargs)
            self.no_residuals = tuple(zeros_like(shapes))
        elif self.store:
            self.layout = _Residuals(self.stage_vjp, self.stage_params(self.params, 0), self.first)
            self.no_residuals = self.layout.zeros()
        self.zero_h = zeros_like(self.first)
        self.zero_cotangent = eqx.filter(self.zero_h, eqx.is_inexact_array)
        self.zero_rest = _integer_leaves(self.zero_h)
        self.zero_output = None if self.training else self.zero_h
        self.scale = jnp.asarray(1.0 / self.num_microbatches, loss_dtype or jnp.float32)
        # Each microbatch's loss counts 1 / M towards this device's loss, and that towards
        # the whole batch's loss 1 / shards (`_executors._results`): the cotangent starts
        # scaled by both, so that every gradient comes out of the loop as the whole batch's
        # (dividing after the loop would write a second buffer the size of the stage).
        # (`mean=False`: the loss is a sum over microbatches and shards, as the linear loss
        # of a forward run's backward is, `_table_backward`.)
        self.seed = jnp.asarray(
            1.0 / (self.num_microbatches * shards) if mean else 1.0, self.scale.dtype
        )
        self.loss_steps = self._loss_steps()
        # Only the kinds the steps run use are traced: one branch each.
        start, stop = steps or (0, len(program.kind))
        kinds = program.kind[start:stop]
        if self.layout is not None:  # a backward rebuilds its pullback as a forward traced it
            forwards = np.isin(program.kind, (_program.FORWARD, _program.FORWARD_LAST))
            kinds = np.concatenate([kinds.ravel(), program.kind[forwards]])
        self.kinds = np.unique(kinds)
        # What the steps write: a half of a table that receives no activations, or runs no
        # forward (`act`), leaves those buffers as they are (then the loop only reads them, and the
        # compiler need not copy what another loop left in them).
        self.receives_inputs = any(
            bool((slots[start:stop] < program.num_input_slots).any())
            for slots in [program.received_input_slot]
            + [lane.received_slot for lane in program.other_lanes if lane.forward]
        )
        self.kinds_run = set(np.unique(program.kind[start:stop]).tolist())
        self.branches = [getattr(self, _ACTIONS[int(k)]) for k in self.kinds]
        columns = (
            program.kind, program.microbatch, program.repeat, program.input_slot,
            program.cotangent_slot, program.residual_slot, program.received_input_slot,
            program.received_cotangent_slot,
        )  # fmt: skip
        self.table = jnp.asarray(np.stack(columns, axis=-1))  # [steps, devices, columns]
        self.sends = jnp.asarray(np.stack([program.forward_sends, program.backward_sends], axis=-1))
        lanes = program.other_lanes
        if lanes:  # [steps, devices, lanes] and [steps, lanes]
            self.other_received = jnp.asarray(np.stack([x.received_slot for x in lanes], -1))
            self.other_sends = jnp.asarray(np.stack([x.sends for x in lanes], -1))

    # --- the stage ----------------------------------------------------------------------

    def stage_params(self, p: Tree, repeat: Index) -> Tree:
        if self.num_repeats == 1:
            return p
        # Named so that autodiff of a forward run recomputes the slice instead of keeping a
        # copy of the stage's weights for every step (see `forward_run`).
        return jax.tree.map(lambda a: checkpoint_name(a, _STAGE_WEIGHTS), index_tree(p, repeat))

    def stage_at(self, p: Tree, repeat: Index) -> Tree:
        """The stage module of `repeat` with the parameters `p`."""
        others = self.others
        rest = (
            self.static if others is None else eqx.combine(index_tree(others, repeat), self.static)
        )
        return eqx.combine(p, rest)

    def run_stage(self, p: Tree, h: Tree, microbatch: Index, repeat: Index) -> Tree:
        call_args, call_kwargs = self.arguments_at(microbatch)
        return self.stage_at(p, repeat)(h, *call_args, **call_kwargs)

    def layered_forward(self, p: Tree, h: Tree, microbatch: Index, repeat: Index) -> tuple:
        """A layered stage's `(output, residuals)` (see `_layered.LayeredStage`)."""
        assert self.layered is not None
        call_args, call_kwargs = self.arguments_at(microbatch)
        return self.layered.forward(self.stage_at(p, repeat), h, call_args, call_kwargs)

    def forward_run(
        self, h: Tree, microbatch: Index, repeat: Index, runs: Index | None = None
    ) -> Tree:
        """A forward run's stage call; with `runs` (1 or 0, by device) skipped where 0."""

        def call(p: Tree, h: Tree, m: Index, r: Index, runs: Index | None) -> Tree:
            def stage(h: Tree, m: Index, r: Index) -> Tree:
                return self.run_stage(self.stage_params(p, r), h, m, r)

            if runs is None:
                return stage(h, m, r)
            return typed_switch(runs, [lambda h, m, r: zeros_like(h), stage], h, m, r)

        if self.stage_policy is None and self.num_repeats == 1:  # a caller's stage, as it is
            return call(self.params, h, microbatch, repeat, None)
        # One checkpoint around the stage (and the skip), whose policy is the stage's own: a
        # policy around an inner `jax.checkpoint` decides for it too (it would keep what the
        # inner one drops), and without it autodiff of the loop keeps more (the residuals of
        # both branches of the skip, a circular stage's slice of the weights at every step).
        policy = self.stage_policy or jax.checkpoint_policies.everything_saveable
        return jax.checkpoint(call, policy=_without_stage_weights(policy))(
            self.params, h, microbatch, repeat, runs
        )

    def _skips_bubbles(self) -> bool:
        """Whether a forward run skips the stage in a device's idle (bubble) steps.

        It does, in a `lax.switch` whose branch differs by device (the devices of a
        collective over another mesh axis share their pipeline position, so they take the
        same branch), when a remat policy is in force (`stage_policy`; without one, autodiff
        of the skip keeps more than the bubbles save). A `ppermute` in such a branch gives
        wrong values (see `execute_schedule`): a stage with one runs at every step, bubbles
        included.
        """
        if self.training or self.stage_policy is None:
            return False
        if not (self.program.kind == _program.IDLE).any():
            return False
        jaxpr = jax.make_jaxpr(lambda h: self.forward_run(h, 0, 0))(self.first)
        return not uses_primitive(jaxpr, "ppermute")

    def stage_vjp(self, p: Tree, h: Tree, microbatch: Index, repeat: Index = 0) -> tuple:
        """`jax.vjp` of the stage in its inexact leaves: `(pullback, output)`. Only the
        inexact leaves of the activations carry cotangents; integer or boolean leaves (masks,
        positions) ride along unchanged."""
        h_diff, h_rest = eqx.partition(h, eqx.is_inexact_array)

        def stage_part(p: Tree, hd: Tree) -> tuple[Tree, Tree]:
            out = self.run_stage(p, eqx.combine(hd, h_rest), microbatch, repeat)
            return eqx.filter(out, eqx.is_inexact_array), out

        _, pullback, out = jax.vjp(stage_part, p, h_diff, has_aux=True)
        return pullback, out

    def add_grads(self, total: Tree, part: Tree, repeat: Index) -> Tree:
        if self.num_repeats == 1:
            return tree_add(total, part)
        return jax.tree.map(
            lambda g, d: lax.dynamic_update_index_in_dim(
                g, lax.dynamic_index_in_dim(g, repeat, keepdims=False) + d, repeat, 0
            ),
            total,
            part,
        )

    def pullback_of(self, w: Work) -> tuple[Callable, Tree | None]:
        """The stage's backward `apply(cotangent, grads) -> (grads, input cotangent)` (with
        `grads=None` it leaves the weights out) and, when recomputed, the stage's output
        (else `None`: the forward kept it)."""
        p = self.stage_params(self.params, w.repeat)
        if self.layered is not None:
            layered, stage = self.layered, self.stage_at(p, w.repeat)
            out, slot = None, ()
            if self.store:  # each layer's rows read from the buffer where they are
                residuals, slot = w.residuals, (w.residual_slot,)
            else:
                out, residuals = self.layered_forward(p, w.h, w.microbatch, w.repeat)

            def read(k: int, layer: Array | None) -> Array:
                return read_block(residuals[k], slot if layer is None else (*slot, layer))

            def apply_layered(cotangent: Tree, grads: Tree | None) -> tuple:
                return layered.backward(stage, w.h, read, cotangent, grads, w.repeat)

            return apply_layered, out
        if not self.store:
            pullback, out = self.stage_vjp(p, w.h, w.microbatch, w.repeat)
            out_axes = axes_tree(eqx.filter(out, eqx.is_inexact_array))
        else:
            assert self.layout is not None
            residuals = index_tree(w.residuals, w.residual_slot)
            (pullback, out_axes), out = self.layout.join(residuals, p, w.h), None

        def apply(cotangent: Tree, grads: Tree | None) -> tuple:
            d_params, d_h = pullback(cast_tree(cotangent, out_axes))
            return None if grads is None else self.add_grads(grads, d_params, w.repeat), d_h

        return apply, out

    # --- the loss -----------------------------------------------------------------------

    def loss_and_pullback(self, out_diff: Tree, out_rest: Tree, microbatch: Index) -> tuple:
        """The cotangent of one microbatch's output, the gradient of `loss_fn`'s parameters
        and the microbatch's share of the mean loss."""
        target = index_tree(self.targets, microbatch)

        def loss_of(od: Tree, lp: Tree) -> Array:
            return eqx.combine(lp, self.loss_static)(eqx.combine(od, out_rest), target)

        value, loss_pullback = jax.vjp(loss_of, out_diff, self.loss_params)
        if self.loss_on_every_device and _varies_over(value, self.axis_name):
            raise ValueError(
                f"`loss_fn` has parameters split over the pipeline axis "
                f"{self.axis_name!r}, so it runs on every device of it, and must give the "
                f"same loss on each; it returns a value that varies over {self.axis_name!r}. "
                f"Reduce the parts that each device computes with "
                f"`lax.psum(..., {self.axis_name!r})` before they enter the loss; a loss that "
                f"gathers its split parameters with `lax.all_gather` is typed as varying too: "
                f"compute it by blocks and `psum` the parts instead (as "
                f"`eqpar.nn.vocab_parallel_cross_entropy` does)."
            )
        d_out, d_loss_params = loss_pullback(_cast_varying(self.seed, _varying_axes(value)))
        return d_out, d_loss_params, value * self.scale

    def _loss_steps(self) -> Array:
        """Per step, where a last stage's backward starts: the device that runs it (-1: none
        at that step), its microbatch, the slot where its forward kept the output, and its
        repeat."""
        program = self.program
        last_stage = np.isin(program.kind, (_program.BACKWARD_LAST, _program.BACKWARD_INPUT_LAST))
        if (last_stage.sum(axis=1) > 1).any():  # one device holds the last stage
            raise AssertionError("a step starts two last-stage backwards")
        loss_device = np.where(last_stage.any(axis=1), last_stage.argmax(axis=1), -1)
        at = (np.arange(len(program.kind)), np.maximum(loss_device, 0))
        return jnp.asarray(np.stack([
            loss_device, program.microbatch[at], program.cotangent_slot[at], program.repeat[at],
        ], axis=-1))  # fmt: skip

    def from_device(self, owner: Array, tree: Tree) -> Tree:
        """`tree` as device `owner` of the pipeline axis holds it, on every device of it (one
        `psum`; booleans and PRNG keys go as integers)."""

        def one(a: Array) -> Array:
            is_key = jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
            data = jax.random.key_data(a) if is_key else a
            wide = data.astype(jnp.int32) if data.dtype == jnp.bool_ else data
            mine = jnp.where(self.device == owner, wide, jnp.zeros_like(wide))
            summed = lax.psum(mine, self.axis_name).astype(data.dtype)
            return (
                jax.random.wrap_key_data(summed, impl=jax.random.key_impl(a)) if is_key else summed
            )

        return jax.tree.map(one, tree)

    def loss_everywhere(self, cotangents: Tree, kept_rest: Tree, h: Tree, t: Array) -> tuple:
        """At a step where a last stage's backward starts: every device's part of its loss
        (`loss_on_every_device`); zeros at the other steps. `h` is this device's stage input
        at the step: on the last stage's device, the input of that stage's backward."""
        owner, microbatch, slot, repeat = self.loss_steps[t]

        def run(cotangents: Tree, kept_rest: Tree) -> tuple:
            if self.store:  # the last stage's forward kept its output
                kept = index_tree(cotangents, jnp.maximum(slot, 0))
                out_rest = index_tree(kept_rest, jnp.maximum(slot, 0))
            else:  # it left its forward to its backward: run it here, on every device alike
                out = self.run_stage(self.stage_params(self.params, repeat), h, microbatch, repeat)
                kept, out_rest = eqx.partition(out, eqx.is_inexact_array)
            # The whole output as the last stage returned it (integer leaves too: positions,
            # counts, masks), from its device to every device, where the loss runs.
            out_diff, out_rest = self.from_device(owner, (kept, out_rest))
            return self.loss_and_pullback(out_diff, out_rest, microbatch)

        def skip(cotangents: Tree, kept_rest: Tree) -> tuple:
            shapes = jax.eval_shape(run, cotangents, kept_rest)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        # The step, not the device, picks the branch: every device runs the same one.
        return typed_switch((owner >= 0).astype(jnp.int32), [skip, run], cotangents, kept_rest)

    # --- the actions --------------------------------------------------------------------

    def idle(self, w: Work) -> Done:
        return Done(
            self.zero_h, self.zero_cotangent, self.zero_cotangent, self.zero_rest,
            w.residuals, self.zero_output, w.grads, w.loss_grads, w.loss,
        )  # fmt: skip

    def forward(self, w: Work) -> Done:
        p = self.stage_params(self.params, w.repeat)
        if not (self.training and self.store):
            out = self.run_stage(p, w.h, w.microbatch, w.repeat)
            return self.idle(w)._replace(sent_forward=out)
        if self.layered is not None:
            out, rows = self.layered_forward(p, w.h, w.microbatch, w.repeat)
            return self.idle(w)._replace(sent_forward=out, residuals=self.store_rows(w, rows))
        pullback, out = self.stage_vjp(p, w.h, w.microbatch, w.repeat)
        assert self.layout is not None
        rows = self.layout.split(pullback, out, p, w.h)
        return self.idle(w)._replace(sent_forward=out, residuals=self.store_rows(w, rows))

    @staticmethod
    def store_rows(w: Work, rows: Tree) -> Tree:
        """The residual buffer with a forward's `rows` in at its slot."""
        return _write(w.residuals, w.residual_slot, rows)

    def forward_last(self, w: Work) -> Done:
        if not self.training:
            p = self.stage_params(self.params, w.repeat)
            return self.idle(w)._replace(output=self.run_stage(p, w.h, w.microbatch, w.repeat))
        done = self.forward(w)  # the output waits in the cotangent buffer for the loss
        kept, rest = eqx.partition(done.sent_forward, eqx.is_inexact_array)
        return done._replace(sent_forward=self.zero_h, kept_cotangent=kept, kept_rest=rest)

    def backward(self, w: Work, *, weights: bool = True, inputs: bool = True) -> Done:
        apply, _ = self.pullback_of(w)
        assert w.cotangents is not None
        grads, d_h = apply(index_tree(w.cotangents, w.cotangent_slot), w.grads if weights else None)
        done = self.idle(w)
        if weights:
            done = done._replace(grads=grads)
        return done._replace(sent_back=d_h) if inputs else done

    def backward_input(self, w: Work) -> Done:
        return self.backward(w, weights=False)

    def backward_weight(self, w: Work) -> Done:
        return self.backward(w, inputs=False)

    def backward_last(self, w: Work, *, weights: bool = True) -> Done:
        apply, out = self.pullback_of(w)
        if out is None:  # the forward kept the output, in two buffers (the second is None
            # where the activations have only inexact leaves)
            assert w.cotangents is not None
            kept = index_tree(w.cotangents, w.cotangent_slot)
            out = eqx.combine(kept, index_tree(w.kept_rest, w.cotangent_slot))
        if self.loss_on_every_device:  # the loss ran before the branches (`loss_everywhere`)
            d_out, done = w.loss_cotangent, self.idle(w)
        else:
            out_diff, out_rest = eqx.partition(out, eqx.is_inexact_array)
            d_out, d_loss_params, part = self.loss_and_pullback(out_diff, out_rest, w.microbatch)
            assert w.loss is not None
            done = self.idle(w)._replace(
                loss_grads=tree_add(w.loss_grads, d_loss_params), loss=w.loss + part
            )
        grads, d_h = apply(d_out, w.grads if weights else None)
        done = done._replace(sent_back=d_h)
        if weights:
            return done._replace(grads=grads)
        return done._replace(kept_cotangent=d_out)  # for the weight gradient, later

    def backward_input_last(self, w: Work) -> Done:
        return self.backward_last(w, weights=False)

    # --- one step -----------------------------------------------------------------------

    def send(self, tree: Tree, pattern: Array, pairs: tuple) -> Tree:
        def shift(pair_set: tuple) -> Callable:
            if not pair_set:
                return zeros_like
            return lambda t: jax.tree.map(lambda a: lax.ppermute(a, self.axis_name, pair_set), t)

        if len(pairs) == 1:
            return shift(pairs[0])(tree)
        return typed_switch(pattern, [shift(p) for p in pairs], tree)

    def step(self, state: LoopState, t: Array) -> tuple[LoopState, None]:
        program, training = self.program, self.training
        (
            kind, microbatch, repeat, input_slot, cotangent_slot, residual_slot,
            got_h, got_cot,
        ) = self.table[t, self.device]  # fmt: skip
        inputs = state.inputs
        if self.receives_inputs:
            inputs = _write(inputs, got_h, state.received)
        cotangents = state.cotangents
        if training:
            cotangents = _write(cotangents, got_cot, state.received_cotangent)
        for i, (lane, received) in enumerate(zip(program.other_lanes, state.received_other)):
            slot = self.other_received[t, self.device, i]
            if lane.forward and self.receives_inputs:
                inputs = _write(inputs, slot, received)
            elif not lane.forward:
                cotangents = _write(cotangents, slot, received)
        fresh = index_tree(self.microbatches, microbatch)
        waiting = index_tree(inputs, jnp.maximum(input_slot, 0))
        h = jax.tree.map(lambda f, s: jnp.where(input_slot < 0, f, s), fresh, waiting)
        loss_grads, loss, loss_cotangent = state.loss_grads, state.loss, None
        if training and self.loss_on_every_device:
            loss_cotangent, d_loss_params, part = self.loss_everywhere(
                cotangents, state.kept_rest, h, t
            )
            loss_grads, loss = tree_add(loss_grads, d_loss_params), loss + part
        work = Work(
            h, microbatch, repeat, cotangents, cotangent_slot, state.kept_rest, state.residuals,
            residual_slot, state.grads, loss_grads, loss, loss_cotangent,
        )  # fmt: skip
        is_forward = (kind == _program.FORWARD) | (kind == _program.FORWARD_LAST)
        if training:
            done = self.act(kind, work)
        else:
            runs = is_forward.astype(jnp.int32) if self.skips_bubbles else None
            out = self.forward_run(h, microbatch, repeat, runs)
            done = self.idle(work)._replace(sent_forward=out, output=out)
        if training:
            keeps = (kind == _program.FORWARD_LAST) | (kind == _program.BACKWARD_INPUT_LAST)
            row = jnp.where(keeps, cotangent_slot, program.num_cotangent_slots)
            cotangents = _write(cotangents, row, done.kept_cotangent)
        kept_rest = state.kept_rest
        if kept_rest is not None:
            row = jnp.where(
                kind == _program.FORWARD_LAST, cotangent_slot, program.num_cotangent_slots
            )
            kept_rest = _write(kept_rest, row, done.kept_rest)
        # Only a forward writes into the residual buffer, in place, in its own loop (`act`):
        # the buffer (a stage's residuals per slot, the largest the loop holds) has no
        # spare row, and the other steps leave it as it is.
        residuals = done.residuals
        outputs, x_grads = state.outputs, state.x_grads
        if outputs is not None:
            row = jnp.where(kind == _program.FORWARD_LAST, microbatch, self.num_microbatches)
            outputs = _write(outputs, row, done.output)
        if x_grads is not None:
            takes_input = (kind >= _program.BACKWARD) & (kind != _program.BACKWARD_WEIGHT)
            first = takes_input & (self.device == 0) & (repeat == 0)
            x_grads = _write(
                x_grads, jnp.where(first, microbatch, self.num_microbatches), done.sent_back
            )
        forward_pattern, backward_pattern = self.sends[t]
        received_other = tuple(
            self._send_lane(done, lane, self.other_sends[t, i])
            for i, lane in enumerate(program.other_lanes)
        )
        new = LoopState(
            self.send(done.sent_forward, forward_pattern, program.forward_pairs),
            self.send(done.sent_back, backward_pattern, program.backward_pairs)
            if training
            else None,
            inputs, cotangents, kept_rest, residuals, outputs,
            done.grads, done.loss_grads, done.loss, x_grads, received_other,
        )  # fmt: skip
        return new, None

    def act(self, kind: Array, work: Work) -> Done:
        """What the step's action makes: the method of `kind`, each in a loop of zero or one
        trip (`exclusive_dispatch`), so that what only some actions write (the gradient and
        loss sums, the residual buffer) stays in place on every step, and what an action
        computes runs only at its steps (its inputs are tied to its loop)."""
        names = ("h", "microbatch", "repeat", "cotangent_slot", "residual_slot")
        inputs = {name: getattr(work, name) for name in names}
        inputs["loss_cotangent"] = work.loss_cotangent

        def run(action: Callable) -> Callable:
            def at_its_step(done: Done, inputs: dict) -> Done:
                held = {
                    "grads": done.grads, "loss_grads": done.loss_grads, "loss": done.loss,
                    "residuals": done.residuals,
                }  # fmt: skip
                return action(work._replace(**held, **inputs))

            return at_its_step

        idle, keys, branches = self.idle(work), [], []
        for k, action in zip(self.kinds, self.branches):
            if k == _program.IDLE:
                continue
            if k in self.kinds_run:
                keys.append(int(k))
                branches.append(run(action))
            else:  # a forward that only records its residuals' layout for the backwards:
                # left out of the loop, a half of a table that runs no forward only reads
                # the residual buffer (and the compiler need not copy what another half left)
                jax.eval_shape(run(action), idle, inputs)
        return exclusive_dispatch(kind, keys, branches, idle, inputs)

    def _send_lane(self, done: Done, lane: _program.Lane, pattern: Array) -> Tree:
        """What this step sends in one of the other lanes: kept as it is where it stays on
        its device (the receiving step writes it where it waits, or into the spare row)."""
        value = done.sent_forward if lane.forward else done.sent_back
        return value if lane.local else self.send(value, pattern, lane.pairs)

    def initial_state(self) -> LoopState:
        training, program = self.training, self.program

        def buffer(tree: Tree, rows: int) -> Tree:
            return jax.tree.map(lambda z: jnp.zeros((rows, *z.shape), z.dtype), tree)

        def zero_grads(tree: Tree) -> Tree:
            return cast_tree(zeros_like(tree), axes_tree(tree))

        return LoopState(
            received=self.zero_h,
            received_cotangent=self.zero_cotangent if training else None,
            inputs=buffer(self.zero_h, program.num_input_slots + 1),
            cotangents=buffer(self.zero_cotangent, program.num_cotangent_slots + 1)
            if training
            else None,
            kept_rest=buffer(self.zero_rest, program.num_cotangent_slots + 1) if training else None,
            residuals=buffer(self.no_residuals, max(program.num_residual_slots, 1)),
            outputs=None if training else buffer(self.zero_h, self.num_microbatches + 1),
            grads=zero_grads(self.params) if training else None,
            loss_grads=zero_grads(self.loss_params) if training else None,
            loss=_cast_varying(jnp.zeros((), self.scale.dtype), self.pipe) if training else None,
            x_grads=buffer(self.zero_cotangent, self.num_microbatches + 1)
            if self.return_all_grads
            else None,
            received_other=tuple(
                self.zero_h if lane.forward else self.zero_cotangent for lane in program.other_lanes
            ),
        )


# The method of `StepLoop` that runs each action kind of a compiled table.
_ACTIONS = {
    _program.IDLE: "idle",
    _program.FORWARD: "forward",
    _program.FORWARD_LAST: "forward_last",
    _program.BACKWARD: "backward",
    _program.BACKWARD_LAST: "backward_last",
    _program.BACKWARD_INPUT: "backward_input",
    _program.BACKWARD_INPUT_LAST: "backward_input_last",
    _program.BACKWARD_WEIGHT: "backward_weight",
}


def _integer_leaves(tree: PyTree) -> PyTree:
    return eqx.filter(tree, eqx.is_inexact_array, inverse=True)


def _write(buffer: PyTree, row: PyTree, value: PyTree) -> PyTree:
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

    def __init__(self, stage_vjp: Callable, params: PyTree, h: PyTree):
        def probe(params: PyTree, h: PyTree) -> PyTree:
            pullback, _ = stage_vjp(params, h, jnp.zeros((), jnp.int32))
            return self._stored(pullback, _sources(pullback, params, h))

        self.shapes = jax.eval_shape(probe, params, h)
        self.recorded: dict = {}  # operand types -> the forward's treedef, sources, out axes

    @staticmethod
    def _stored(pullback: PyTree, sources: tuple) -> tuple:
        return tuple(r for r, s in zip(jax.tree.leaves(pullback), sources) if s is None)

    def zeros(self) -> tuple:
        return tuple(zeros_like(self.shapes))

    def split(self, pullback: PyTree, out: PyTree, params: PyTree, h: PyTree) -> tuple:
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

    def join(self, stored: PyTree, params: PyTree, h: PyTree) -> tuple[PyTree, PyTree]:
        """The pullback rebuilt from the stored residuals and the inputs, and the replication
        types its cotangent must have."""
        treedef, sources, out_axes = self.recorded[_types(params, h)]  # forward traced first
        inputs, rest = _inputs(params, h), iter(stored)
        leaves = [next(rest) if s is None else inputs[s] for s in sources]
        return jax.tree.unflatten(treedef, leaves), out_axes


def _types(*trees: PyTree) -> tuple:
    return tuple((x.shape, x.dtype, _varying_axes(x)) for x in jax.tree.leaves(trees))


def _inputs(params: PyTree, h: PyTree) -> list:
    return jax.tree.leaves((params, eqx.filter(h, eqx.is_inexact_array)))


def _sources(pullback: PyTree, params: PyTree, h: PyTree) -> tuple:
    """For each residual of `pullback`: the index of the input leaf it is, or None."""
    inputs = _inputs(params, h)
    return tuple(
        next((i for i, a in enumerate(inputs) if a is r), None) for r in jax.tree.leaves(pullback)
    )
