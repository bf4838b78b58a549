"""Ahead-of-time scale table: the example LM at GPT-2-small and ~1.3B sizes, every layout.

The decoder-only language model of `examples/lm.py` at two real sizes, one Adam training step
per layout exactly as `examples/train_lm.py` builds it (`build_model`, `storage_specs`,
`build_step`), compiled ahead of time without one parameter in memory: the model comes from
`eqx.filter_eval_shape`, the step is lowered with `jax.ShapeDtypeStruct`s that carry the
layout's `NamedSharding`s, and `.compile()` gives the figures. Nothing runs; every figure is
a statement of the compiler or of the shardings, so they are exact on any machine.

Sizes: `gpt2-small` (vocab 50304, seq 1024, d_model 768, 12 heads, MLP 3072, 12 layers) and
`1.3b` (d_model 2048, 16 heads, MLP 8192, 24 layers), global batch 16, float32, Adam. Layouts
on 8 devices: `DP` (`data=8`), `FSDP` (`data=8 --fsdp`: the block stack gathered layer by
layer), `DPxTP` (`data=2,model=4`), `DPxPP` with the GPipe, 1F1B and circular schedules
(`data=2,pipe=4`, 8 microbatches; circular with 2 stages per device where the depth allows,
else 3) and `DPxTPxPP` (`data=2,pipe=2,model=2`, GPipe). Each layer uses the per-layer remat
policy `--remat` (default `full`: a layer keeps only its input for the backward pass).

Per device:

- **params, optimizer**: bytes of one shard of every leaf (`sharding.shard_shape`), against
  the ideal `total / ways`, where `ways` is the number of devices each parameter could be split
  over in the layout: the product of the `pipe` and `model` sizes, times `data` under FSDP
  (DP 1, FSDP 8, DPxTP 4, DPxPP 4, DPxTPxPP 4).
- **temp** (`memory_analysis().temp_size_in_bytes`) and **peak** = argument + output + temp -
  alias (on CPU the reported peak ignores temp).
- **collective bytes per mesh axis**: what one device receives per step (ring model of
  `benchmarks/_hlo.py`, loops counted per iteration), each collective assigned to the mesh axes its
  device groups span (`collective_bytes_by_axes`). A collective over several axes is split
  among them as a hierarchical ring would move it (innermost axis first: a full ring over it,
  then the next axis on `1/g` of the data), which preserves its total.
- **pipe bytes, exact and HLO bound**: the pipeline executors send inside conditionals: each
  scan step's sends are a `lax.switch` over the distinct sets of device pairs the schedule
  uses, indexed by the step, and a training schedule whose loss is split over `pipe` (the
  vocabulary-parallel head) runs the loss in a `lax.switch` that computes it only at the
  steps where a last stage's backward starts. The program text does not say which branch a
  step takes, so `benchmarks/_hlo.py` counts every conditional at its busiest branch: the **HLO
  bound**. The **exact** figure is `outside + sends + loss`, where `outside` is the bytes of
  the pipe-axis collectives outside any conditional (`CollectiveOp.in_conditional` false:
  exact from the HLO), and the conditional part is counted from the compiled schedule table
  (`eqpar.pipeline._program.compile_schedule(body.schedule(kind))`, the table the step runs: the
  forward table for GPipe and circular, the training table for 1F1B): `sends` = the pairs
  of each step's pattern (`forward_pairs[forward_sends[t]]`, likewise backward), summed over
  the steps, x one microbatch's activation `A / M` / `S` (devices of the pipe axis; autodiff
  of a forward run sends each cotangent back over its activation's pair, in a conditional of
  the same branches: x 2); `loss` = the number of loss steps x the loss's pipe-axis
  all-reduces of one microbatch at ring cost `2 (S-1)/S`: the last stage's output to every
  device (`A / M`, over pipe) and, over (model, pipe) and so `1/t` of it on pipe, the head
  input's cotangent (`A / M`) and the cross entropy's three reductions (`A / (M d_model)`).
  A direction whose steps all use one pattern has no conditional; its sends are in `outside`.
  The check that the split is right: the table counted with every step at its busiest
  branch gives the HLO's in-conditional bytes to the byte (the detail list says "agrees");
  branch by branch, the compiled sends of each pattern are its pairs x `A / M / S`, in the
  table's order.
- **other axes under a forward run**: with a remat policy, GPipe and circular skip a
  device's stage in its idle steps (a `lax.switch` by device), so the stage's collectives
  over `model` sit in a conditional that runs at `M V` of the table's steps on every device
  (its transpose in the backward likewise). Their exact bytes are the HLO's in-conditional
  bytes x `M V / steps`; a figure on an axis other than pipe that has conditionals of any
  other kind is an upper bound, marked `<=`.
- **compile s**: `lower` + `compile`.

The depth sweep (12 to 96 layers at GPT-2-small width; series DP with remat `none` and
`full`, DPxPP GPipe with `full`) gives per depth the parameters per device, which are also
the gradients per device, two temps and the compile time. **step temp** is the training
step's, as above. **activation temp** is the temp of the gradient computation alone
(`compile_gradients`): `loss_and_grads(model, tokens)` built as `train_lm.build_step`
builds it, lowered from the same abstract model with the same shardings, the gradients as
outputs laid out as the parameters, no optimizer and nothing donated; with parameters as
arguments and gradients as outputs, its temp is the memory the forward and backward passes
need beyond both. The issue's target "with remat `full`, temp at 96 layers <= 1.5x temp
at 12 layers" is about that memory, so it is judged on the activation temp. The step temp's
ratio is printed beside it, not judged: beyond the activation temp the step holds the
gradients, a buffer the size of the parameters (8x the layers' at 96 layers as at 12); Adam's
update, the example's global-norm clipping included (`train_steps.clip_by_global_norm`), adds
no buffer of its own, and the sweep prints what one more layer adds to the step beyond the
gradient computation, in layers' parameters. Without the gradients the optimizer would have
to run per layer inside the backward pass, which global-norm clipping rules out: the norm
needs every gradient before the first update.

Ideal collective bytes per device per step, with `g` the axis size, `P` all parameter bytes,
`w` the layout's `ways`, `A = (batch / data) x seq x d_model x 4` one device's activation
of one layer, `L` layers, `S` pipe size, `V` stages per device, `t` model size, `M`
microbatches. The embedding (`VocabParallel`) and the output head (`ColumnParallel`, no
logits gathered, `eqpar.nn.vocab_parallel_cross_entropy`) split the vocabulary over the
tuple of axes (model, pipe) (`lm.VOCAB`), so they are on every device; an all-reduce over
(model, pipe) counts a full ring on model and `1/t` of the data on pipe.

- `data`, replicated parameters: one all-reduce of the gradient, `2 (g-1)/g x P / w`;
  FSDP (ZeRO-3): the block stack's parameters `P_L` all-gathered layer by layer in the
  forward, again in the backward, and their gradients reduce-scattered, `3 (g-1)/g x P_L`;
  the others (embeddings, head, final norm: gathered once as they enter `shard_map`, kept
  for the backward) all-gathered and reduce-scattered, `2 (g-1)/g x (P - P_L)`.
- `pipe`: the schedule's point-to-point traffic, each microbatch's activation forward and
  its cotangent backward once per stage boundary, averaged over devices,
  `2 (V S - 1) / S x A`; plus, for the vocabulary split over pipe, all-reduces over pipe at
  ring cost `2 (S-1)/S` of: the embedding's output (`A / t` on pipe), the input gradient's
  broadcast to every stage (`A`: the transpose of handing the batch to every stage, or the
  1F1B executor's sum of the first stage's input gradients), the final hidden state's
  broadcast to every stage (`A`: `broadcast_output`, or the 1F1B loss's sum of each
  microbatch's output), the head input's cotangent (`A / t`) and the cross entropy's three
  reductions (`A / (d_model t)`):
  `2 (V S - 1)/S x A + 2 (S-1)/S x (2 A + 2 A / t + 3 A / (d_model t))`. The exact figure
  meets it (the extra bytes are the loss's scalars).
- `model` (Megatron): per layer two activation all-reduces forward and two backward, plus
  one with `full` remat (the recomputed forward repeats the attention's all-reduce, whose
  output the MLP's backward needs; the MLP's own is not needed again), on the `L / S`
  layers of a device; plus, on every device, one for the vocabulary-parallel embedding, one
  for the head's input cotangent and three of `A / d_model` for the cross entropy:
  `2 (t-1)/t x ((k L / S + 2) A + 3 A / d_model)`, `k` = 4, or 5 with `full` remat. The
  forward executors (GPipe, circular) run every stage at every step, bubbles included (so
  that the stage's collectives over other axes run on every device alike), so their
  per-layer all-reduces run `V M + S - 1` times instead of `V M`: DPxTPxPP measures the
  per-layer term x `(M + S - 1) / M` (at GPT-2 small, 810 MiB = 720 MiB x 9/8).

Run: `python benchmarks/scale.py` (`--quick`: GPT-2-small only, depths 12 and 24;
`--layouts --series "DP remat full"`: that series of the depth sweep alone; `--help` for the
rest). On CPU 8 devices are simulated unless `JAX_PLATFORMS` is set; on accelerators
the device kind is recorded above the tables.
"""

import argparse
import dataclasses
import functools
import math
import os
import pathlib
import sys
import time
from typing import Any, NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import lm  # pyright: ignore[reportMissingImports]
import train_lm  # pyright: ignore[reportMissingImports]
import train_plan  # pyright: ignore[reportMissingImports]
import train_steps  # pyright: ignore[reportMissingImports]
from _hlo import (
    CollectiveOp,
    bytes_by_axes_of,
    collective_ops,
    format_bytes,
    memory_figures,
)

import eqpar
from eqpar.pipeline import _program

NUM_DEVICES = 8
AXES = (lm.DATA, lm.PIPE, lm.MODEL)
CONFIGS = {
    "gpt2-small": lm.LMConfig(
        vocab_size=50304, seq_len=1024, d_model=768, num_heads=12, d_hidden=3072, num_layers=12
    ),
    "1.3b": lm.LMConfig(
        vocab_size=50304, seq_len=1024, d_model=2048, num_heads=16, d_hidden=8192, num_layers=24
    ),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: dict[str, int]
    fsdp: bool = False
    schedule: str = "gpipe"


LAYOUTS = {
    "DP": Layout({lm.DATA: 8}),
    "FSDP": Layout({lm.DATA: 8}, fsdp=True),
    "DPxTP": Layout({lm.DATA: 2, lm.MODEL: 4}),
    "DPxPP GPipe": Layout({lm.DATA: 2, lm.PIPE: 4}),
    "DPxPP 1F1B": Layout({lm.DATA: 2, lm.PIPE: 4}, schedule="1f1b"),
    "DPxPP circular": Layout({lm.DATA: 2, lm.PIPE: 4}, schedule="circular"),
    "DPxTPxPP": Layout({lm.DATA: 2, lm.PIPE: 2, lm.MODEL: 2}),
}


@dataclasses.dataclass
class Figures:
    """What the compiler and the shardings say about one layout's training step."""

    layout: str
    run: Any  # train_lm.RunConfig
    num_params: int
    param_bytes: int  # all parameters, one copy
    layer_bytes: int  # the block stack's parameters (`model.body`), one copy
    opt_bytes: int  # all optimizer state, one copy
    params: int  # per device
    opt_state: int  # per device
    memory: dict[str, int]
    axis_bytes: dict[tuple[str, ...], float]  # per set of mesh axes, as measured (bound)
    compile_s: float
    # Per single mesh axis, the part of `per_axis` that sits inside conditionals (counted at
    # their busiest branch), and the pipe axis's exact figure where the schedule says it.
    in_conditionals: dict[str, float] = dataclasses.field(default_factory=dict)
    pipe: "PipeBytes | None" = None
    # A forward run (GPipe, circular) that skips each device's idle steps: the fraction of
    # the steps at which a device runs its stage (M V of the table's steps). Its collectives
    # over axes other than pipe inside conditionals are the stage's, under that skip.
    stage_fraction: float | None = None
    # A training table's step: bytes per mesh axis with each conditional counted at the
    # share of steps taking each branch (`table_weighted_bytes`); exact but for pipe.
    by_table: dict[str, float] | None = None
    # `memory_figures` of the gradient computation alone (`compile_gradients`): its temp is
    # the memory the forward and backward passes need beyond parameters and gradients.
    gradients: dict[str, int] | None = None

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: self.run.mesh[axis] for axis in AXES}

    @property
    def ways(self) -> int:
        """Devices each parameter could be split over in this layout."""
        return (
            self.sizes[lm.PIPE]
            * self.sizes[lm.MODEL]
            * (self.sizes[lm.DATA] if self.run.fsdp else 1)
        )

    @property
    def per_axis(self) -> dict[str, float]:
        """Measured bytes per mesh axis, collectives over several axes split among them
        (conditionals at their busiest branch: an upper bound where there are any)."""
        return split_by_axis(self.axis_bytes, self.sizes)

    @property
    def exact(self) -> dict[str, float]:
        """Bytes per mesh axis with the pipe axis's exact figure (`PipeBytes.exact`)."""
        exact = dict(self.per_axis)
        if self.pipe is not None:
            exact[lm.PIPE] = self.pipe.exact
        if self.stage_fraction is not None:  # the skipped stage runs that share of the steps
            for axis, inside in self.in_conditionals.items():
                if axis != lm.PIPE:
                    exact[axis] -= inside * (1 - self.stage_fraction)
        if self.by_table is not None:  # each action's collectives as often as the table says
            for axis in exact:
                if axis != lm.PIPE:
                    exact[axis] = self.by_table.get(axis, 0.0)
        return exact

    def is_bound(self, axis: str) -> bool:
        """Whether the figure of `axis` counts conditionals at their busiest branch."""
        inside = self.in_conditionals.get(axis, 0.0) > 0
        exact = self.stage_fraction is not None or self.by_table is not None
        return inside and axis != lm.PIPE and not exact


@dataclasses.dataclass(frozen=True)
class PipeBytes:
    """The pipe axis's bytes per device per step of a layout with a pipe axis, by origin.

    - `outside`: pipe-axis collectives outside any conditional, from the HLO (exact: each
      runs as often as its loops say);
    - `in_conditionals`: those inside conditionals, from the HLO at each conditional's
      busiest branch, as if it ran at every step (an upper bound);
    - `sends`: the schedule's point-to-point sends, counted from the compiled table step by
      step (`forward_sends` / `backward_sends` index the device-pair sets
      `forward_pairs` / `backward_pairs`): pairs x one microbatch's activation / S;
    - `loss`: the loss run on every device (`loss_everywhere`), at the steps where a last
      stage's backward starts: its pipe-axis all-reduces, from the same table;
    - `busiest`: `sends + loss` with every step taking the busiest branch instead, which is
      what the HLO counts: equal to `in_conditionals` when the table and the compiled
      conditionals agree (the check that the split is right).
    """

    outside: float
    in_conditionals: float
    sends: float
    loss: float
    busiest: float
    loss_steps: int
    steps: int

    @property
    def exact(self) -> float:
        return self.outside + self.sends + self.loss

    @property
    def upper_bound(self) -> float:
        return self.outside + self.in_conditionals


# --- compiling without parameters -----------------------------------------------------------


def _spec_axes(spec: Any) -> set[str]:
    """The mesh axes a `PartitionSpec` names."""
    axes: set[str] = set()
    for entry in spec if isinstance(spec, P) else ():
        axes.update((entry,) if isinstance(entry, str) else entry or ())
    return axes


def _is_abstract(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


_with_shardings = train_plan.with_shardings


def _nbytes(leaf: jax.ShapeDtypeStruct, shape: tuple[int, ...] | None = None) -> int:
    return math.prod(leaf.shape if shape is None else shape) * jnp.dtype(leaf.dtype).itemsize


def _shard_bytes(tree: Any) -> int:
    """Bytes of one shard of every leaf: what each device holds (the layouts split evenly)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if _is_abstract(leaf)]
    return sum(_nbytes(leaf, leaf.sharding.shard_shape(leaf.shape)) for leaf in leaves)


def _whole_bytes(tree: Any) -> int:
    return sum(_nbytes(leaf) for leaf in jax.tree.leaves(tree) if _is_abstract(leaf))


def pipe_bytes(
    ops: list[CollectiveOp],
    sizes: dict[str, int],
    body: Any,
    run: Any,
    config: lm.LMConfig,
    loss_everywhere: bool,
) -> PipeBytes:
    """The pipe axis's bytes of one training step, exact (`PipeBytes`).

    `body` is the model's `PipelineModule`, whose `schedule(...)` is the table the step
    runs: the training table of its schedule where the step runs the schedule's own
    backward pass (`train_steps.runs_own_backward`: every schedule on a pipe axis), else the
    forward table (differentiated: autodiff of the scan sends each cotangent back over the
    pair its activation came by, in a conditional of the same branches). A direction whose
    steps all send over the same pairs has no conditional: its sends are outside, counted
    from the HLO.
    """
    pipe, model = sizes[lm.PIPE], sizes[lm.MODEL]
    training = train_steps.runs_own_backward(run)
    table = body.schedule(run.schedule, include_backward=True) if training else body.schedule()
    program = _program.compile_schedule(table, store_residuals=training)
    steps = len(program.kind)
    # One microbatch's stage input on one device (float32), and how many per device a send
    # of `pairs` moves on average.
    rows = run.batch_size // sizes[lm.DATA] // run.microbatches
    block = rows * config.seq_len * config.d_model * 4
    directions = [(program.forward_sends, program.forward_pairs)]
    if training:
        directions.append((program.backward_sends, program.backward_pairs))
    sends = busiest = 0.0
    for index, pairs in directions:
        if len(pairs) < 2:  # one pattern: an unconditional send, in `outside`
            continue
        repeat = 1 if training else 2  # a forward run's cotangents go back the same way
        sends += repeat * sum(len(pairs[i]) for i in index) * block / pipe
        busiest += repeat * steps * max(map(len, pairs)) * block / pipe
    loss_steps = 0
    loss = 0.0
    if training and loss_everywhere:
        last = np.isin(program.kind, (_program.BACKWARD_LAST, _program.BACKWARD_INPUT_LAST))
        loss_steps = int(last.any(axis=1).sum())
        # Per loss step: the last stage's output to every device (an all-reduce over pipe),
        # and over (model, pipe), of which pipe moves 1/model: the head input's cotangent
        # and the cross entropy's three reductions of one value per token.
        ring = 2 * (pipe - 1) / pipe
        per_step = ring * (block + (block + 3 * block / config.d_model) / model)
        loss = loss_steps * per_step
        busiest += steps * per_step
    outside = [op for op in ops if not op.in_conditional]
    inside = [op for op in ops if op.in_conditional]
    return PipeBytes(
        outside=split_by_axis(bytes_by_axes_of(outside, sizes), sizes)[lm.PIPE],
        in_conditionals=split_by_axis(bytes_by_axes_of(inside, sizes), sizes)[lm.PIPE],
        sends=sends,
        loss=loss,
        busiest=busiest,
        loss_steps=loss_steps,
        steps=steps,
    )


AbstractStep = train_plan.AbstractStep  # a run's step from shapes and shardings
build_abstract_step = train_plan.abstract_step  # one builder for the example and benchmarks


def lower_step(config: lm.LMConfig, run: Any, devices: list[Any]) -> AbstractStep:
    """`build_abstract_step`, lowered (`lowered` a `jax.stages.Lowered`)."""
    step = build_abstract_step(config, run, devices)
    lowered = jax.jit(step.lowered, donate_argnums=(1, 2)).lower(*step.arguments)
    return step._replace(lowered=lowered)


def compile_layout(
    name: str, config: lm.LMConfig, run: Any, devices: list[Any]
) -> tuple[Figures, Any]:
    """Lower and compile `run`'s training step for `config` from shapes and shardings only."""
    started = time.perf_counter()
    lowered, model, arrays, opt_state, specs, _ = lower_step(config, run, devices)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    sizes = {axis: run.mesh[axis] for axis in AXES}
    ops = collective_ops(compiled)
    in_conditionals = split_by_axis(
        bytes_by_axes_of([op for op in ops if op.in_conditional], sizes), sizes
    )
    pipe, stage_fraction, by_table = None, None, None
    if sizes[lm.PIPE] > 1 and train_steps.runs_own_backward(run):
        by_table = table_weighted_bytes(compiled, model.body, run, sizes)
    if sizes[lm.PIPE] > 1 and not train_steps.runs_own_backward(run):
        table = model.body.schedule()
        forwards = sum(action.kind == "forward" for row in table.actions for action in row)
        stage_fraction = forwards / sizes[lm.PIPE] / len(table.actions)
    if sizes[lm.PIPE] > 1:
        # The loss runs on every device of the pipe axis when the head is split over it.
        head_specs = jax.tree.leaves(specs.unembed, is_leaf=lambda x: isinstance(x, P))
        loss_everywhere = any(lm.PIPE in _spec_axes(spec) for spec in head_specs)
        pipe = pipe_bytes(ops, sizes, model.body, run, config, loss_everywhere)
    figures = Figures(
        layout=name,
        run=run,
        num_params=sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(arrays)),
        param_bytes=_whole_bytes(arrays),
        layer_bytes=_whole_bytes(arrays.body),
        opt_bytes=_whole_bytes(opt_state),
        params=_shard_bytes(arrays),
        opt_state=_shard_bytes(opt_state),
        memory=memory_figures(compiled),
        axis_bytes=bytes_by_axes_of(ops, sizes),
        compile_s=compile_s,
        in_conditionals=in_conditionals,
        pipe=pipe,
        stage_fraction=stage_fraction,
        by_table=by_table,
    )
    return figures, compiled


def table_weighted_bytes(
    compiled: Any, body: Any, run: Any, sizes: dict[str, int]
) -> dict[str, float] | None:
    """Bytes per mesh axis of a training table's step with every conditional of the step
    loop counted at the share of steps that take each branch (averaged over the pipe axis's
    devices), as the table says: the action switch (one branch per action kind the table
    uses, in kind order) and the loss's (skip, run) switch. `None` if some other
    conditional holds collectives over an axis other than pipe (then only the busiest-
    branch bound is known). The pipe axis's own sends are counted by `pipe_bytes`."""
    program = _program.compile_schedule(
        body.schedule(run.schedule, include_backward=True), store_residuals=True
    )
    kinds = np.unique(program.kind)
    kind_shares = [float((program.kind == k).mean()) for k in kinds]
    last = np.isin(program.kind, (_program.BACKWARD_LAST, _program.BACKWARD_INPUT_LAST))
    loss_share = float(last.any(axis=1).mean())
    unknown = []

    def shares(branches: list[list[CollectiveOp]]) -> list[float] | None:
        if all(op.kind == "collective-permute" for ops in branches for op in ops):
            return None  # the sends, which `pipe_bytes` counts from the table
        if len(branches) == len(kinds):
            return kind_shares
        if len(branches) == 2 and not branches[0]:  # `loss_everywhere`: (skip, run)
            return [1 - loss_share, loss_share]
        unknown.append(branches)
        return None

    ops = collective_ops(compiled, shares=shares)
    if unknown:
        return None
    return split_by_axis(bytes_by_axes_of(ops, sizes), sizes)


def gradient_function(model: lm.LM, mesh: eqpar.DeviceMesh, run: Any) -> Any:
    """`loss_and_grads(model, tokens) -> (loss, grads)` exactly as `train_lm.build_step`
    builds it for `run`: the same `shard_map` over the same specs, the schedule's own
    backward pass for 1F1B and ZB-H1, autodiff of the loss otherwise, and the precision
    policy's casts. The meshes here have no context axis."""
    if train_steps.context_size(run) > 1:
        raise ValueError(
            f"gradient_function: expected a mesh without a context axis; got {run.mesh}. "
            "Drop the context axis (the scale layouts have none)."
        )
    specs = eqpar.partition_specs(model)  # what shard_map's body sees (no FSDP split)
    stored = train_lm.storage_specs(model, mesh, run.fsdp)
    policy = eqpar.Precision.from_name(run.precision)
    if train_steps.runs_own_backward(run):
        entering = stored if run.fsdp else specs
        sharded = eqpar.shard_map(
            functools.partial(
                train_steps.loss_and_grads_scheduled,
                schedule=run.schedule,
                stored=(stored, specs) if run.fsdp else None,
            ),
            mesh=mesh,
            in_specs=(entering, P(lm.DATA), P(lm.DATA)),
            out_specs=(P(), entering),
        )

        def loss_and_grads(model: lm.LM, tokens: jax.Array) -> tuple[jax.Array, lm.LM]:
            loss, grads = sharded(policy.cast_to_compute(model), tokens[:, :-1], tokens[:, 1:])
            return policy.cast_to_output(loss), policy.cast_to_param(grads)

        return loss_and_grads
    loss = eqpar.shard_map(
        train_steps.sequence_loss,
        mesh=mesh,
        in_specs=(specs, P(lm.DATA), P(lm.DATA)),
        out_specs=P(),
        stored_specs=(stored, P(lm.DATA), P(lm.DATA)),
    )
    return eqx.filter_value_and_grad(
        lambda model, tokens: policy.cast_to_output(
            loss(policy.cast_to_compute(model), tokens[:, :-1], tokens[:, 1:])
        )
    )


def compile_gradients(config: lm.LMConfig, run: Any, devices: list[Any]) -> dict[str, int]:
    """`memory_figures` of `run`'s gradient computation alone, compiled like
    `compile_layout`'s step but without the optimizer: `gradient_function` from the same
    abstract model with the same shardings, the gradients as outputs laid out as the
    parameters (as the optimizer gets them), nothing donated.

    Parameters are its arguments and gradients its outputs, so its `temp` is what the
    forward and backward passes need beyond both: the activations each layer keeps, the
    recomputed forward of a remat layer, the logits, and the gradients before their reduction
    over `data`: in a pipeline the sum of the stage's gradients over the microbatches; without
    a pipe axis and with a remat policy none (each layer's gradient is reduced inside the
    backward scan, straight into the outputs), with remat `none` all the layers'. The
    compiler may place buffers that die before the outputs are written (the saved layer
    inputs, say) in the output buffers, where they do not count as temp."""
    train_lm.check_sizes(config, run)
    mesh = train_lm.make_mesh(run.mesh, devices)
    model = eqx.filter_eval_shape(train_lm.build_model, config, run, mesh)
    specs = train_lm.storage_specs(model, mesh, run.fsdp)
    model = _with_shardings(model, eqpar.named_shardings(specs, mesh))
    loss_and_grads = gradient_function(model, mesh, run)
    arrays, static = eqx.partition(model, _is_abstract)

    def inexact(leaf: Any) -> bool:
        return _is_abstract(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)

    # Each gradient's sharding: its parameter's (None where there is no gradient).
    grad_shardings = jax.tree.map(lambda param: param.sharding, eqx.filter(arrays, inexact))

    def abstract_gradients(tokens: jax.Array, arrays: Any) -> Any:
        loss, grads = loss_and_grads(eqx.combine(arrays, static), tokens)
        return loss, jax.lax.with_sharding_constraint(
            eqx.filter(grads, eqx.is_array), grad_shardings
        )

    tokens = jax.ShapeDtypeStruct(
        (run.batch_size, config.seq_len + 1),
        jnp.int32,
        sharding=NamedSharding(mesh.jax_mesh, P(lm.DATA)),
    )
    return memory_figures(jax.jit(abstract_gradients).lower(tokens, arrays).compile())


def split_by_axis(
    axis_bytes: dict[tuple[str, ...], float], sizes: dict[str, int]
) -> dict[str, float]:
    """Bytes per single mesh axis. A collective over axes `a_1 .. a_k` (mesh order) moves
    `c (g-1)/g x N` for its whole group of `g = g_1 ... g_k`; a hierarchical ring moves
    `c (g_k - 1)/g_k x N` over the innermost axis `a_k`, then `c (g_j - 1)/g_j x N / (g_{j+1}
    ... g_k)` over each outer one: the same total, split in those proportions."""
    per_axis = dict.fromkeys(AXES, 0.0)
    for axes, received in axis_bytes.items():
        if not axes:
            continue
        shares, inner = {}, 1
        for axis in reversed(axes):
            g = sizes[axis]
            shares[axis] = (g - 1) / g / inner
            inner *= g
        total = sum(shares.values())
        for axis, share in shares.items():
            per_axis[axis] += received * share / total
    return per_axis


# --- ideals ---------------------------------------------------------------------------------


def ideal_collectives(f: Figures, config: lm.LMConfig) -> dict[str, float]:
    """The ideal bytes per device per step on each mesh axis (module docstring)."""
    sizes = f.sizes
    data, pipe, model = sizes[lm.DATA], sizes[lm.PIPE], sizes[lm.MODEL]
    local_batch = f.run.batch_size // data
    activation = local_batch * config.seq_len * config.d_model * 4
    ideal = dict.fromkeys(AXES, 0.0)
    if data > 1:
        share = (data - 1) / data
        if f.run.fsdp:
            rest = f.param_bytes - f.layer_bytes
            ideal[lm.DATA] = share * (3 * f.layer_bytes + 2 * rest)
        else:
            ideal[lm.DATA] = 2 * share * f.param_bytes / f.ways
    # Per token one float32 (the cross entropy's reductions); the vocabulary split over
    # (model, pipe) reduces over both, hierarchically: a full ring over model, then pipe on
    # 1/model of the data.
    per_token = activation / config.d_model
    if pipe > 1:
        repeats = train_steps.pipeline_repeats(f.run)
        sends = 2 * (repeats * pipe - 1) / pipe * activation
        # The embedding's output and the head input's cotangent (1/model on pipe), the
        # input gradient's and the final hidden state's broadcasts to every stage, and the
        # cross entropy.
        vocab = (2 * activation / model + 2 * activation + 3 * per_token / model) * (
            2 * (pipe - 1) / pipe
        )
        ideal[lm.PIPE] = sends + vocab
    if model > 1:
        per_layer = 5 if f.run.remat == "full" else 4
        reductions = (per_layer * config.num_layers / pipe + 2) * activation + 3 * per_token
        ideal[lm.MODEL] = 2 * (model - 1) / model * reductions
    return ideal


# --- report ---------------------------------------------------------------------------------


def _ratio(value: float, ideal: float) -> str:
    if ideal == 0:
        return "—" if value == 0 else "n/a"
    return f"{value / ideal:.2f}x"


def _mesh_label(run: Any) -> str:
    label = ",".join(f"{axis}={size}" for axis, size in run.mesh.items() if size > 1)
    if run.fsdp:
        label += " --fsdp"
    if run.mesh[lm.PIPE] > 1:
        label += f" {run.schedule} M={run.microbatches}"
        if run.schedule == "circular":
            label += f" V={run.repeats}"
    return label


def describe_config(name: str, config: lm.LMConfig, figures: Figures, batch: int) -> str:
    return (
        f"**{name}**: vocab {config.vocab_size}, seq {config.seq_len}, d_model "
        f"{config.d_model}, {config.num_heads} heads, MLP {config.d_hidden}, "
        f"{config.num_layers} layers: {figures.num_params:,} float32 parameters "
        f"({format_bytes(figures.param_bytes)}; Adam state {format_bytes(figures.opt_bytes)}); "
        f"global batch {batch}."
    )


def layout_table(rows: list[Figures], config: lm.LMConfig) -> list[str]:
    lines = [
        "| layout | mesh | params/dev (x ideal) | optimizer/dev (x ideal) | params+opt "
        "(x ideal) | temp/dev | peak/dev | data bytes (x ideal) | pipe bytes (x ideal) | "
        "pipe HLO bound (x ideal) | model bytes (x ideal) | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in rows:
        ideal_params = f.param_bytes / f.ways
        ideal_opt = f.opt_bytes / f.ways
        state = f.params + f.opt_state
        ideal = ideal_collectives(f, config)
        measured = f.exact
        cells = [
            f.layout,
            _mesh_label(f.run),
            f"{format_bytes(f.params)} ({_ratio(f.params, ideal_params)})",
            f"{format_bytes(f.opt_state)} ({_ratio(f.opt_state, ideal_opt)})",
            f"{format_bytes(state)} ({_ratio(state, ideal_params + ideal_opt)})",
            format_bytes(f.memory["temp"]),
            format_bytes(f.memory["total"]),
        ]
        for axis in AXES:
            if f.sizes[axis] == 1 and measured[axis] == 0:
                cells.append("—")
            else:
                # "<=": conditionals counted at their busiest branch (an upper bound)
                bound = "<= " if f.is_bound(axis) else ""
                value = f.exact[axis]
                cells.append(f"{bound}{format_bytes(value)} ({_ratio(value, ideal[axis])})")
            if axis == lm.PIPE:
                if f.pipe is None:
                    cells.append("—")
                else:
                    bound = f.pipe.upper_bound
                    cells.append(f"{format_bytes(bound)} ({_ratio(bound, ideal[axis])})")
        cells.append(f"{f.compile_s:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def collective_detail(rows: list[Figures], config: lm.LMConfig) -> list[str]:
    lines = [
        "",
        "Collective bytes per device per step by the mesh axes each collective's groups span "
        "(as measured, before splitting those over several axes), and the ideal per axis:",
        "",
    ]
    for f in rows:
        measured = ", ".join(
            f"{'+'.join(axes)}: {format_bytes(value)}"
            for axes, value in sorted(f.axis_bytes.items())
            if axes
        )
        ideal = ", ".join(
            f"{axis}: {format_bytes(value)}"
            for axis, value in ideal_collectives(f, config).items()
            if value
        )
        lines.append(f"- {f.layout}: measured {measured or 'none'}; ideal {ideal or 'none'}")
        if f.pipe is not None:
            pipe = f.pipe
            agree = math.isclose(pipe.busiest, pipe.in_conditionals, rel_tol=1e-6, abs_tol=1)
            lines.append(
                f"  - pipe exact {format_bytes(pipe.exact)} = "
                f"{format_bytes(pipe.outside)} outside conditionals (HLO) + "
                f"{format_bytes(pipe.sends)} sends (table, {pipe.steps} steps) + "
                f"{format_bytes(pipe.loss)} loss ({pipe.loss_steps} loss steps); HLO bound "
                f"{format_bytes(pipe.upper_bound)} = {format_bytes(pipe.outside)} + "
                f"{format_bytes(pipe.in_conditionals)} in conditionals at their busiest "
                f"branch; the table at the busiest branch: {format_bytes(pipe.busiest)} "
                f"({'agrees' if agree else '**differs**'})"
            )
    return lines


def _activation_temp(f: Figures) -> int:
    assert f.gradients is not None, "the sweep compiles each point's gradients"
    return f.gradients["temp"]


def _saved_input(f: Figures, width: lm.LMConfig) -> float:
    """One layer's saved input per device, averaged over the model's layers: `A / pipe`,
    `A = (batch / data) x seq x d_model x 4` (a device holds `L / pipe` layers)."""
    rows = f.run.batch_size // f.sizes[lm.DATA]
    return rows * width.seq_len * width.d_model * 4 / f.sizes[lm.PIPE]


class AddedLayer(NamedTuple):
    """What one more layer adds per device between the last two depths of a series."""

    params: float  # its parameters (= gradients) on this device
    saved_input: float  # its saved input, A / pipe
    step_temp: float
    activation_temp: float


def added_layer(
    sweep: dict[tuple[str, int], Figures], series: str, depths: list[int], width: lm.LMConfig
) -> AddedLayer:
    low, high = sweep[series, depths[-2]], sweep[series, depths[-1]]
    layers = depths[-1] - depths[-2]
    return AddedLayer(
        params=(high.params - low.params) / layers,
        saved_input=_saved_input(high, width),
        step_temp=(high.memory["temp"] - low.memory["temp"]) / layers,
        activation_temp=(_activation_temp(high) - _activation_temp(low)) / layers,
    )


def depth_table(
    sweep: dict[tuple[str, int], Figures], depths: list[int], width: lm.LMConfig
) -> list[str]:
    """One row per series and depth: the parameters (= gradients) per device, the whole
    step's temp, the gradient computation's temp ("activation temp") and the compile time,
    each with its ratio to the first depth. Below, per series, what one more layer adds
    between the last two depths, against one layer's parameters and saved input."""
    series = sorted({name for name, _ in sweep}, key=lambda n: list(SWEEP).index(n))
    first = depths[0]
    lines = [
        f"| series | layers | params = grads/dev (x {first}) | step temp (x {first}) | "
        f"activation temp (x {first}) | compile s (x {first}) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in series:
        base = sweep[name, first]
        for depth in depths:
            f = sweep[name, depth]
            temp, activation = f.memory["temp"], _activation_temp(f)
            lines.append(
                f"| {name} | {depth} | "
                f"{format_bytes(f.params)} ({_ratio(f.params, base.params)}) | "
                f"{format_bytes(temp)} ({_ratio(temp, base.memory['temp'])}) | "
                f"{format_bytes(activation)} ({_ratio(activation, _activation_temp(base))}) | "
                f"{f.compile_s:.1f} ({_ratio(f.compile_s, base.compile_s)}) |"
            )
    lines += [
        "",
        "Step temp: the whole Adam step (parameters and optimizer state donated), which holds "
        "the gradients, a buffer the size of the parameters (the update, clipping included, "
        "is written in place into the parameters and moments). Activation temp: "
        "the gradient computation alone (`compile_gradients`: loss and gradients as the step "
        "computes them, gradients as outputs, no optimizer, nothing donated), the memory the "
        "forward and backward passes need beyond parameters and gradients. Temp is the peak "
        "of the compiler's packed buffers, not a sum: the first depths' peak is set by the "
        "logits, so growth is read between the last two depths.",
    ]
    if len(depths) > 1:
        low_depth, high_depth = depths[-2], depths[-1]
        lines += ["", f"Per added layer from {low_depth} to {high_depth} layers, per device:", ""]
        for name in series:
            layer_params, saved, step, activation = added_layer(sweep, name, depths, width)
            lines.append(
                f"- {name}: step temp +{format_bytes(step)} "
                f"({step / layer_params:.2f}x one layer's parameters), activation temp "
                f"+{format_bytes(activation)} ({activation / layer_params:.2f}x one layer's "
                f"parameters {format_bytes(layer_params)}; {activation / saved:.2f}x one "
                f"layer's saved input A/pipe {format_bytes(saved)}); the step beyond the "
                f"gradient computation +{format_bytes(step - activation)} "
                f"({(step - activation) / layer_params:.2f}x one layer's parameters: its "
                "gradients are 1x)"
            )
    return lines


def targets(
    tables: dict[str, list[Figures]],
    sweep: dict[tuple[str, int], Figures],
    depths: list[int],
    configs: dict[str, lm.LMConfig],
    width: lm.LMConfig,
) -> list[str]:
    """The issue's targets, each with the measured figure and whether it is met."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines = ["", "Targets (issues 12 and 24):", ""]
    for name, rows in tables.items():
        config = configs[name]
        axis_ratios: list[tuple[float, str]] = []
        for f in rows:
            ideal, measured = ideal_collectives(f, config), f.exact
            for axis in AXES:
                if ideal[axis] or measured[axis]:
                    ratio = measured[axis] / ideal[axis] if ideal[axis] else math.inf
                    bound = " (bound)" if f.is_bound(axis) else ""
                    axis_ratios.append((ratio, f"{f.layout} {axis} {ratio:.2f}x{bound}"))
        over = [text for ratio, text in sorted(axis_ratios, reverse=True) if ratio > 1.1]
        worst = max(axis_ratios, default=(0.0, ""))
        lines.append(
            f"- {name}: collective bytes on each axis (pipe: exact) <= 1.1x ideal: "
            f"{verdict(not over)}"
            + (f" (over: {', '.join(over)})" if over else f" (largest: {worst[1]})")
        )
        by_name = {f.layout: f for f in rows}
        if "FSDP" in by_name:
            f = by_name["FSDP"]
            measured, ideal = f.exact[lm.DATA], ideal_collectives(f, config)[lm.DATA]
            lines.append(
                f"- {name}: FSDP data bytes <= 1.05x ZeRO-3's (issue 24): "
                f"{format_bytes(measured)} vs {format_bytes(ideal)} ({measured / ideal:.2f}x): "
                f"{verdict(measured <= 1.05 * ideal)}"
            )
        if "DP" in by_name and "FSDP" in by_name:
            dp, fsdp = by_name["DP"].memory["total"], by_name["FSDP"].memory["total"]
            lines.append(
                f"- {name}: FSDP peak < DP peak: {format_bytes(fsdp)} vs {format_bytes(dp)} "
                f"({fsdp / dp:.2f}x): {verdict(fsdp < dp)}"
            )
        state = []
        for f in rows:
            ratio = (f.params + f.opt_state) / ((f.param_bytes + f.opt_bytes) / f.ways)
            state.append((ratio, f"{f.layout} {ratio:.2f}x"))
        over = [text for ratio, text in sorted(state, reverse=True) if ratio > 1.05]
        lines.append(
            f"- {name}: params + optimizer per device <= 1.05x ideal: {verdict(not over)}"
            + (f" (over: {', '.join(over)})" if over else "")
        )
        if "DPxPP GPipe" in by_name and "DPxPP circular" in by_name:
            gpipe = by_name["DPxPP GPipe"].memory["temp"]
            circular = by_name["DPxPP circular"].memory["temp"]
            lines.append(
                f"- {name}: circular temp <= 1.1x GPipe temp: {format_bytes(circular)} vs "
                f"{format_bytes(gpipe)} ({circular / gpipe:.2f}x): "
                f"{verdict(circular <= 1.1 * gpipe)}"
            )
    for series in SWEEP:
        if not SWEEP[series][1] == "full" or (series, depths[-1]) not in sweep:
            continue
        low, high = sweep[series, depths[0]], sweep[series, depths[-1]]
        activation = _activation_temp(high) / _activation_temp(low)
        lines.append(
            f"- {series}: activation temp at {depths[-1]} layers <= 1.5x at {depths[0]}: "
            f"{format_bytes(_activation_temp(high))} vs {format_bytes(_activation_temp(low))} "
            f"({activation:.2f}x): {verdict(activation <= 1.5)}"
        )
        step = high.memory["temp"] / low.memory["temp"]
        lines.append(
            f"  - whole-step temp, not judged: {format_bytes(high.memory['temp'])} vs "
            f"{format_bytes(low.memory['temp'])} ({step:.2f}x). It grows because the step "
            f"holds the gradients, the size of the parameters (the layers' are "
            f"{depths[-1] / depths[0]:g}x at {depths[-1]} layers; all of them per device "
            f"{format_bytes(high.params)} vs {format_bytes(low.params)}, "
            f"{high.params / low.params:.2f}x); the update and the clipping add no buffer. "
            "Removing the gradients would need the optimizer applied per layer inside the "
            "backward pass, which global-norm clipping rules out (the norm needs every "
            "gradient before the first update)."
        )
        if activation > 1.5 and high.sizes[lm.PIPE] > 1:
            lines.append("  - " + _pipeline_growth(sweep, series, depths, width))
    return lines


def _pipeline_growth(
    sweep: dict[tuple[str, int], Figures], series: str, depths: list[int], width: lm.LMConfig
) -> str:
    """Why a pipeline series' activation temp grows by more than the layer inputs its
    schedule keeps, with the ratio it would have with only those, and with the gradient sum
    besides. Per device, one layer's share is a `1 / pipe` of it (a device holds
    `L / pipe` layers)."""
    low, high = sweep[series, depths[0]], sweep[series, depths[-1]]
    layer_params, saved, _, activation = added_layer(sweep, series, depths, width)
    microbatches, stages = high.run.microbatches, high.sizes[lm.PIPE]
    # GPipe and circular keep every microbatch's layer inputs; 1F1B and ZB-H1 at most S.
    kept_microbatches = (
        microbatches if high.run.schedule in ("gpipe", "circular") else min(stages, microbatches)
    )
    kept = saved * kept_microbatches / microbatches
    extra = (activation - kept) / layer_params
    added = depths[-1] - depths[0]
    base = _activation_temp(low)
    inputs_only = (base + added * kept) / base
    with_sum = (base + added * (kept + layer_params)) / base
    return (
        f"why: per added layer, the layer inputs the schedule keeps ({kept_microbatches} of "
        f"{microbatches} microbatches, {format_bytes(kept)}) plus {extra:.2f}x one layer's "
        f"parameters / pipe ({format_bytes(layer_params)}): the sum of the stage's gradients "
        f"over the microbatches, into which the backward adds each layer's gradient in place, "
        f"reduced over `data` once after the last microbatch into the returned gradients. With "
        f"the inputs alone the ratio would be {inputs_only:.2f}x; with the sum, "
        f"{with_sum:.2f}x. The sum cannot be the returned gradients themselves: those are "
        f"replicated over `data`, the sum is not until it is reduced, and `shard_map`'s "
        f"replication types have no in-place reduction from one to the other. Reducing each "
        f"microbatch's gradients as they are made would drop the sum for {microbatches}x the "
        f"data-axis bytes, a trade eqpar does not make. (The ratio is to a {depths[0]}-layer "
        f"figure that the in-place sum made smaller: compare the absolute figures.)"
    )


# (layout, remat) of each series of the depth sweep
SWEEP = {
    "DP remat none": ("DP", "none"),
    "DP remat full": ("DP", "full"),
    "DPxPP GPipe remat full": ("DPxPP GPipe", "full"),
    "DPxPP 1F1B remat full": ("DPxPP 1F1B", "full"),
}


def make_run(config: lm.LMConfig, layout: Layout, args: argparse.Namespace, remat: str) -> Any:
    mesh = {axis: layout.mesh.get(axis, 1) for axis in AXES}
    repeats = 2
    if layout.schedule == "circular" and config.num_layers % (2 * mesh[lm.PIPE]):
        repeats = 3
    return train_lm.RunConfig(
        mesh=mesh,
        fsdp=layout.fsdp,
        schedule=layout.schedule,
        microbatches=args.microbatches,
        repeats=repeats,
        remat=remat,
        batch_size=args.batch_size,
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description="Ahead-of-time figures of the example LM at GPT-2-small and ~1.3B sizes, "
        "every layout, without materialising parameters."
    )
    parser.add_argument(
        "--quick", action="store_true", help="GPT-2-small only; depth sweep 12 and 24"
    )
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None)
    parser.add_argument(
        "--layouts",
        nargs="*",
        choices=list(LAYOUTS),
        default=list(LAYOUTS),
        help="layouts of the tables (none: the depth sweep only)",
    )
    parser.add_argument("--depths", nargs="+", type=int, default=None, help="depth sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the depth sweep")
    parser.add_argument(
        "--series", nargs="+", choices=list(SWEEP), default=list(SWEEP), help="depth sweep series"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument(
        "--microbatches", type=int, default=8, help="microbatches of the pipe layouts"
    )
    parser.add_argument(
        "--remat", choices=("none", "full"), default="full", help="per-layer remat policy"
    )
    args = parser.parse_args(argv)
    if jax.device_count() < NUM_DEVICES:
        raise SystemExit(f"needs {NUM_DEVICES} devices; got {jax.device_count()}")
    devices = jax.devices()[:NUM_DEVICES]
    config_names = args.configs or (["gpt2-small"] if args.quick else list(CONFIGS))
    depths = args.depths or ([12, 24] if args.quick else [12, 24, 48, 96])
    configs = {name: CONFIGS[name] for name in config_names}

    def progress(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    def figures_of(layout: str, config: lm.LMConfig, remat: str) -> Figures:
        # The sweep compiles its own programs even where a table has the same one, so that
        # its compile times are taken one after the other, under the same load.
        run = make_run(config, LAYOUTS[layout], args, remat)
        return compile_layout(layout, config, run, devices)[0]

    tables: dict[str, list[Figures]] = {}
    for name, config in configs.items() if args.layouts else ():
        rows = []
        for layout in args.layouts:
            figures = figures_of(layout, config, args.remat)
            progress(f"{name} {layout}: compiled in {figures.compile_s:.1f} s")
            rows.append(figures)
        tables[name] = rows

    sweep: dict[tuple[str, int], Figures] = {}
    width = CONFIGS["gpt2-small"]  # of the depth sweep
    if not args.no_sweep:
        for series in args.series:
            layout, remat = SWEEP[series]
            for depth in depths:
                config = dataclasses.replace(width, num_layers=depth)
                figures = figures_of(layout, config, remat)
                run = make_run(config, LAYOUTS[layout], args, remat)
                figures.gradients = compile_gradients(config, run, devices)
                sweep[series, depth] = figures
                progress(f"sweep {series} {depth} layers: {sweep[series, depth].compile_s:.1f} s")

    device = devices[0]
    lines = [
        f"Devices: {NUM_DEVICES} x {device.device_kind} ({device.platform}); "
        f"jax {jax.__version__}. Every figure is per device, from the compiled program and the "
        "shardings (nothing is allocated). Remat policy of the layout tables: "
        f"`{args.remat}`; pipe layouts: {args.microbatches} microbatches.",
    ]
    for name, rows in tables.items():
        config = configs[name]
        lines += ["", describe_config(name, config, rows[0], args.batch_size), ""]
        lines += layout_table(rows, config)
        lines += collective_detail(rows, config)
    lines += [
        "",
        "Ideals: params/optimizer = one copy / ways (DP 1, FSDP 8, DPxTP 4, DPxPP 4, "
        "DPxTPxPP 4); `data` = 2(g-1)/g x P/ways (FSDP: (g-1)/g x (3 P_L + 2 (P - P_L)), P_L "
        "the block stack's); `pipe` = 2(VS-1)/S x A "
        "+ 2(S-1)/S x (2A + 2A/t + 3A/(d_model t)), A = (batch/data) x seq x d_model x 4; "
        "`model` = 2(t-1)/t x ((kL/S + 2) A + 3A/d_model), k = 4 (5 with remat full). "
        "Collectives over several axes are split among them as a hierarchical ring would move "
        "them (module docstring). Pipe bytes: exact, the conditionals' share counted from the "
        "schedule's table; pipe HLO bound: every conditional at its busiest branch.",
    ]
    if sweep:
        lines += [
            "",
            f"Depth sweep at GPT-2-small width (d_model {width.d_model}, seq {width.seq_len}, "
            f"global batch {args.batch_size}); in brackets the ratio to {depths[0]} layers:",
            "",
        ]
        lines += depth_table(sweep, depths, width)
    lines += targets(tables, sweep, depths, configs, width)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main())
