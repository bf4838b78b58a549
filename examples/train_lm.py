"""Train a small language model with data x pipeline x tensor parallelism (and optional FSDP
and context parallelism).

    python examples/train_lm.py                                  # 8 simulated CPU devices
    python examples/train_lm.py --mesh data=2,pipe=2,model=2 --schedule 1f1b
    python examples/train_lm.py --mesh data=8 --fsdp --check     # compare with one device
    python examples/train_lm.py --mesh data=2,context=4 --check  # the sequence split over 4
    python examples/train_lm.py --experts 8 --top-k 2 --mesh data=2,expert=4 --check  # MoE
    python examples/train_lm.py --precision bfloat16             # float32 params, bf16 compute
    python examples/train_lm.py --ckpt-dir /tmp/ckpt --resume    # continue from the latest
    python examples/train_lm.py --processes 2                    # 2 processes x 4 CPU devices
    python examples/train_lm.py --data /tmp/corpus               # written by examples/data.py

On CPU, 8 devices are simulated; on accelerators the device count comes from JAX. Any mesh
whose product is the device count works, 1 device included. A `context` axis splits every
sequence over its devices (ring attention, all-gather attention with a pipe axis; balanced
causal layout): the sequence length
(`--seq-len`) must divide by 2 x context. With `--experts`, each block's MLP is a mixture of
experts and an `expert` axis splits the experts over its devices (the batch rows split over
data and expert), a `model` axis each expert's hidden units. Outputs (loss curve, pipeline
schedule) go to `--out`. On a terminal a progress bar shows the loss and tokens/s; in a log
(stdout not a terminal) a line is printed every `--log-every` steps instead.

The same program runs as every process of a multi-process job, with every flag:
`--processes N` starts N processes on this machine (`launch.py`), `--distributed` joins a job
started by SLURM, `mpirun` or by hand (`eqpar.initialize()`). With `--data` the rows come from
a tokenized corpus on disk (`data.py`), each process reading only its own; the checkpoint holds
the data position, so a resume on any number of processes continues with the next examples.
"""

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

# On a machine without accelerators JAX runs on the CPU: simulate 8 devices there (or
# EQPAR_NUM_CPU_DEVICES). Accelerators are unaffected and keep their real device count.
try:
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("EQPAR_NUM_CPU_DEVICES", "8")))
except RuntimeError:  # the backends are already running (imported by a test or a launcher)
    pass

import equinox as eqx
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import data as input_data
import launch
import lm

import eqpar
from eqpar.context import balance_sequence, sequence_positions
from eqpar.distributions import match_param_specs
from eqpar.inspect import print_layout_table
from eqpar.nn import PipelineModule
from eqpar.spmd import gather_stored


@dataclasses.dataclass(frozen=True)
class RunConfig:
    mesh: dict[str, int]
    schedule: str = "gpipe"
    microbatches: int = 4  # per step on a pipe axis; without one a step is not cut up
    repeats: int = 2
    fsdp: bool = False
    remat: str = "none"  # what each layer keeps for the backward pass: none, full, matmuls
    steps: int = 120
    batch_size: int = 16
    lr: float = 3e-3
    optimizer: str = "adam"
    seed: int = 0
    precision: str = "float32"  # an `eqpar.Precision` preset: float32 or bfloat16


# The mesh axes in device order. `context` sits next to `model`: the ring attention's
# key/value blocks and the tensor-parallel reductions are the traffic of every layer.
# `expert` (the experts of `--experts` split over it) follows `data`: the batch rows are
# split over both, as over one data axis.
AXES = (lm.DATA, lm.EXPERT, lm.PIPE, lm.CONTEXT, lm.MODEL)
OPTIONAL_AXES = (lm.EXPERT, lm.CONTEXT)  # in a mesh only where `--mesh` names them


def parse_mesh(text: str, device_count: int) -> dict[str, int]:
    """`data=2,pipe=2,model=2` -> sizes of the axes in `AXES` order: data, pipe and model
    always (missing ones are 1), expert and context only where `text` names them."""
    given: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in AXES or not value.isdigit() or int(value) < 1:
            raise SystemExit(
                f"--mesh: expected entries like data=2,pipe=2,model=2, data=2,context=4 or "
                f"data=2,expert=4 with axes {sorted(AXES)}; got {part!r}."
            )
        given[name] = int(value)
    names = [name for name in AXES if name in given or name not in OPTIONAL_AXES]
    sizes = {name: given.get(name, 1) for name in names}
    product = int(np.prod(list(sizes.values())))
    if product != device_count:
        raise SystemExit(
            f"--mesh {text}: the axis sizes multiply to {product} but there are "
            f"{device_count} devices; choose sizes whose product is {device_count}."
        )
    return sizes


def format_mesh(sizes: dict[str, int]) -> str:
    """`{"data": 2, "pipe": 2, "model": 2}` -> `data=2,pipe=2,model=2` (the `--mesh` syntax)."""
    return ",".join(f"{name}={size}" for name, size in sizes.items())


def context_size(run: RunConfig) -> int:
    """The devices each sequence is split over (the `context` axis; 1 without one)."""
    return run.mesh.get(lm.CONTEXT, 1)


def expert_size(run: RunConfig) -> int:
    """The devices the experts are split over (the `expert` axis; 1 without one)."""
    return run.mesh.get(lm.EXPERT, 1)


def row_axes(axis_names: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes the batch rows are split over: data, and expert where the mesh has it
    (each device of the expert axis routes its own tokens to every expert)."""
    return (lm.DATA, lm.EXPERT) if lm.EXPERT in axis_names else (lm.DATA,)


def row_spec(axis_names: Sequence[str]) -> P:
    """The `PartitionSpec` of a batch split by rows over `row_axes(axis_names)`."""
    rows = row_axes(axis_names)
    return P(rows if len(rows) > 1 else rows[0])


def describe(run: RunConfig) -> str:
    """`run` in words for logs and picture titles, e.g. `mesh data=2,pipe=2,model=2 | gpipe
    schedule, 4 microbatches`; the schedule is named only where a pipe axis runs one."""
    parts = [f"mesh {format_mesh(run.mesh)}"]
    if run.mesh[lm.PIPE] > 1:
        repeats = f" x {run.repeats} repeats" if run.schedule == "circular" else ""
        parts.append(f"{run.schedule}{repeats} schedule, {run.microbatches} microbatches")
    if run.fsdp:
        parts.append("FSDP")
    if run.remat != "none":
        parts.append(f"remat {run.remat}")
    if run.precision != "float32":
        parts.append(f"{run.precision} compute")
    return " | ".join(parts)


def pipeline_microbatches(run: RunConfig) -> int:
    """The microbatches a step is cut into: `run.microbatches` with a pipe axis, else 1.

    Microbatches exist to fill the pipeline; without a pipe axis every device holds every
    layer, and cutting the batch would only make each matmul smaller."""
    return run.microbatches if run.mesh[lm.PIPE] > 1 else 1


def pipeline_repeats(run: RunConfig) -> int:
    """Stages per device: `run.repeats` for the circular schedule on a pipe axis, else 1."""
    return run.repeats if run.schedule == "circular" and run.mesh[lm.PIPE] > 1 else 1


def _divisors(n: int) -> str:
    values = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


def make_mesh(sizes: dict[str, int], devices: Sequence[Any] | None = None) -> eqpar.DeviceMesh:
    """The mesh of `sizes`: axes data, pipe, model (missing sizes 1), expert after data and
    context between pipe and model where `sizes` has them."""
    names = tuple(name for name in AXES if name in sizes or name not in OPTIONAL_AXES)
    shape = tuple(sizes.get(name, 1) for name in names)
    chosen = list(jax.devices() if devices is None else devices)[: int(np.prod(shape))]
    return eqpar.DeviceMesh(shape, names, devices=chosen)


def check_sizes(config: lm.LMConfig, run: RunConfig) -> None:
    """Refuse sizes the mesh cannot split, each problem with the flag that fixes it."""
    pipe, model, data = run.mesh[lm.PIPE], run.mesh[lm.MODEL], run.mesh[lm.DATA]
    expert = expert_size(run)
    repeats, microbatches = pipeline_repeats(run), pipeline_microbatches(run)
    problems = experts_problems(config, run)
    if config.num_layers % (pipe * repeats):
        if repeats > 1:
            what = "pipe x repeats"
            fix = "a smaller pipe in --mesh or fewer --repeats, so that pipe x repeats divides"
        else:
            what, fix = "pipe", "a pipe size in --mesh that divides"
        problems.append(
            f"num_layers={config.num_layers} must divide by {what} = {pipe * repeats}: choose "
            f"{fix} {config.num_layers}"
        )
    split_over_model = {
        "num_heads": config.num_heads,
        "d_hidden": config.d_hidden,
        "vocab_size": config.vocab_size,
    }
    uneven = [f"{name}={size}" for name, size in split_over_model.items() if size % model]
    if uneven:
        common = np.gcd.reduce(list(split_over_model.values()))
        problems.append(
            f"{' and '.join(uneven)} must divide by model={model}: choose model="
            f"{_divisors(int(common))} in --mesh"
        )
    context = context_size(run)
    if config.seq_len % (2 * context):
        multiple = -(-config.seq_len // (2 * context)) * 2 * context
        fits = (
            f" or context={_divisors(config.seq_len // 2)} in --mesh"
            if config.seq_len % 2 == 0
            else ""
        )
        problems.append(
            f"seq_len={config.seq_len} must divide by 2 x context = {2 * context} (the balanced "
            f"causal layout gives each context device two equal chunks of every sequence): use "
            f"a --seq-len that is a multiple of {2 * context} (e.g. {multiple}){fits}"
        )
    rows = data * expert * microbatches
    if run.batch_size % rows:
        what = " x ".join(
            ["data"] + ["expert"] * (lm.EXPERT in run.mesh) + ["microbatches"] * (pipe > 1)
        )
        fewer = " or fewer --microbatches" if microbatches > 1 else ""
        multiple = -(-run.batch_size // rows) * rows
        problems.append(
            f"batch_size={run.batch_size} must divide by {what} = {rows}: use a --batch-size "
            f"that is a multiple of {rows} (e.g. {multiple}){fewer}"
        )
    if problems:
        raise SystemExit("invalid sizes: " + "; ".join(problems) + ".")


def experts_problems(config: lm.LMConfig, run: RunConfig) -> list[str]:
    """What `check_sizes` refuses about `--experts`, `--top-k` and the `expert` axis."""
    expert, experts = expert_size(run), config.num_experts
    if not experts:
        if expert > 1:
            return [
                f"expert={expert} in --mesh splits the experts of a mixture of experts: give "
                f"--experts E with E a multiple of {expert} (or leave the expert axis out)"
            ]
        return []
    problems = []
    if experts % expert:
        problems.append(
            f"--experts {experts} must divide by expert={expert} (each device of the expert "
            f"axis holds experts/expert of them): choose --experts "
            f"{-(-experts // expert) * expert} or expert={_divisors(experts)} in --mesh"
        )
    if config.top_k > experts:
        problems.append(f"--top-k {config.top_k} must be at most --experts {experts}")
    if run.mesh[lm.PIPE] > 1:
        # A stage routes one microbatch at a time, so its auxiliary losses would be those of
        # a microbatch, not of the whole batch as on one device (the load-balancing loss is
        # not linear in the tokens). The pipeline schedules also take their loss from the
        # head alone (`Head`), not from the blocks' statistics carried beside the
        # activations.
        problems.append(
            f"--experts does not run with a pipe axis (pipe={run.mesh[lm.PIPE]}): a pipelined "
            f"stage routes one microbatch at a time, so its auxiliary losses would not be "
            f"those of the whole batch; use pipe=1 in --mesh (e.g. data=2,expert=2,model=2)"
        )
    elif run.schedule in ("1f1b", "zb-h1"):
        problems.append(
            f"--experts trains by autodiff of the loss and its auxiliary losses; --schedule "
            f"{run.schedule} runs the pipeline's own backward pass: leave --schedule out"
        )
    return problems


def build_model(config: lm.LMConfig, run: RunConfig, mesh: eqpar.DeviceMesh) -> lm.LM:
    """The example's model for `mesh`, parallelized by `lm.PLAN` (same parameters on any mesh).

    With `--fsdp` the block stack also gathers its parameters over `data` one layer at a time
    (`eqpar.nn.gather_layers`); the embeddings and the head are split by `eqpar.FSDP` and
    gathered as they enter `shard_map` (`build_step` gives it their `stored_specs`), whence
    their gradients leave by reduce-scatter."""
    model = lm.build(
        config,
        mesh,
        num_microbatches=pipeline_microbatches(run),
        num_repeats=pipeline_repeats(run),
        remat=run.remat,
        key=jax.random.key(run.seed),
    )
    return eqpar.nn.gather_layers(model, mesh, axis=lm.DATA) if run.fsdp else model


def storage_specs(model: lm.LM, mesh: eqpar.DeviceMesh, fsdp: bool) -> Any:
    """Where each parameter lives: its declared spec, with `--fsdp` also split over data."""
    if fsdp:
        return eqpar.FSDP(mesh, axis=lm.DATA).partition_specs(model)
    return eqpar.partition_specs(model)


def global_loss(model: lm.LM, tokens: Int[Array, "batch seq1"]) -> Array:
    """The loss inside `shard_map` (GPipe / circular): the mean over the data shards."""
    return sequence_loss(model, tokens[:, :-1], tokens[:, 1:])


def context_batch(
    tokens: Int[Array, "batch seq1"], context: int
) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]:
    """The inputs and targets of `tokens` for a `context` axis of `context` devices, outside
    `shard_map`: each with its sequence in the balanced order of
    `eqpar.context.balance_sequence` (device `i` of `context` gets chunks `i` and
    `2 context - 1 - i`). Both are cut from `tokens` first and reordered alike, so every
    input keeps its target beside it and the mean over tokens is that of the natural order.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return balance_sequence(inputs, context, axis=1), balance_sequence(targets, context, axis=1)


def context_positions(inputs: Int[Array, "batch seq"]) -> Int[Array, " seq"]:
    """Inside `shard_map`: the global positions of this device's tokens (balanced layout)."""
    return sequence_positions(inputs.shape[1], axis_name=lm.CONTEXT, layout="balanced")


def sequence_loss(
    model: lm.LM,
    inputs: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    context: bool = False,
    *,
    expert: bool = False,
    with_stats: bool = False,
) -> Any:
    """The loss inside `shard_map` (GPipe / circular, or no pipe): the mean over the data
    shards. With `context`, the sequence is split over the context axis (the batches of
    `context_batch`): each device's tokens at their global positions, and the mean over the
    data and context shards. With `expert` the rows are split over the expert axis too.
    Every shard holds as many tokens, so that is the mean over the whole batch, as on one
    device. With `with_stats`, `(loss, stats)`: the loss's parts of `lm.LM.loss_and_stats`
    (`{}` without experts), of the whole batch too."""
    axes = (*row_axes([lm.EXPERT] if expert else []), *([lm.CONTEXT] if context else []))
    positions = context_positions(inputs) if context else None
    loss, stats = model.loss_and_stats(inputs, targets, positions)
    loss = lax.pmean(loss, axes)
    if not with_stats:
        return loss
    return loss, {name: lax.pmean(value, axes) for name, value in stats.items()}


def loss_and_grads_scheduled(
    model: lm.LM,
    inputs: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    schedule: str = "1f1b",
    context: bool = False,
    stored: tuple[Any, Any] | None = None,
) -> tuple[Array, lm.LM]:
    """Loss and gradients inside `shard_map` with a schedule that runs its own backward pass
    (`PipelineModule.value_and_grad`: `"1f1b"`, `"zb-h1"`, `"gpipe"` or `"circular"`); with
    `context`, the sequence is split over the context axis (the batches of `context_batch`).

    The embedding's pullback is applied to the gradient the pipeline returns for its input.
    With `stored` (`--fsdp`: the model's stored and computed specs), the parameters come in
    split as stored: those that the layers do not gather themselves (`gather_layers`) are
    gathered here, and their gradients reduce-scattered back (`eqpar.spmd.gather_stored`).
    """
    scatter = None
    if stored is not None:
        stored_specs, in_specs = stored
        model, scatter = eqx.filter_vjp(
            lambda m: gather_stored(m, stored_specs=stored_specs, in_specs=in_specs), model
        )
    positions = context_positions(inputs) if context else None
    h, embed_vjp = eqx.filter_vjp(
        lambda e: eqx.tree_at(lambda m: (m.embed, m.position), model, e).embed_tokens(
            inputs, positions
        ),
        (model.embed, model.position),
    )
    assert isinstance(model.body, PipelineModule), "1F1B runs the model of lm.build"
    loss, (body_grads, head_grads, h_grads) = model.body.value_and_grad(
        model.head, h, targets, schedule=schedule, return_all_grads=True
    )
    (embed_grads,) = embed_vjp(h_grads)
    grads = eqx.tree_at(
        lambda m: (m.embed, m.position, m.body, m.norm, m.unembed),
        eqx.filter(model, eqx.is_inexact_array),
        (*embed_grads, body_grads, head_grads.norm, head_grads.unembed),
    )
    if scatter is not None:
        (grads,) = scatter(grads)
    # The loss of the whole batch (the mean over the shards of `data`, and of `context` when
    # the sequence is split) and its gradients: nothing to divide by hand.
    return loss, grads


def runs_own_backward(run: RunConfig) -> bool:
    """Whether the step takes its gradients from the pipeline schedule's own backward pass
    (`loss_and_grads_scheduled`) rather than from autodiff of the loss: 1F1B and ZB-H1
    always, and on a pipe axis GPipe and circular too, whose table's backward adds each
    layer's gradient into the sum over microbatches in place (autodiff of the forward pass
    holds each step's whole stage gradient beside that sum)."""
    return run.schedule in ("1f1b", "zb-h1") or run.mesh[lm.PIPE] > 1


def build_step(
    model: lm.LM,
    mesh: eqpar.DeviceMesh,
    run: RunConfig,
    optimizer: Any,
    *,
    with_stats: bool = False,
) -> Any:
    """The jitted train step `(tokens, model, opt_state) -> (model, opt_state, loss)`; with
    `with_stats`, `(model, opt_state, loss, stats)`, `stats` the parts of the loss of an MoE
    model (`lm.LM.loss_and_stats`: cross entropy, auxiliary losses, dropped assignments;
    `{}` for a dense one).

    Under a bfloat16 `run.precision` the float32 parameters are cast before they enter
    `shard_map`: everything inside, the gradient reductions over `data` included, runs in
    bfloat16, and the optimizer gets float32 gradients (the cast's transpose; after the own
    backward pass of 1F1B or ZB-H1, an explicit cast) to update the float32 parameters."""
    specs = eqpar.partition_specs(model)  # what shard_map's body sees (no FSDP split)
    policy = eqpar.Precision.from_name(run.precision)
    context = context_size(run)
    expert = lm.EXPERT in mesh.axis_names
    param_specs = storage_specs(model, mesh, run.fsdp)
    # Rows split over `data` (and `expert`); with a context axis the sequence also over
    # `context`.
    rows = row_spec(mesh.axis_names)
    sequence_spec = P(*rows, lm.CONTEXT) if context > 1 else rows

    def inputs_and_targets(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        if context > 1:
            return context_batch(tokens, context)
        return tokens[:, :-1], tokens[:, 1:]

    if runs_own_backward(run):
        # With `--fsdp` the parameters enter split as stored; the function gathers them
        # itself, inside its own backward pass.
        stored = (param_specs, specs) if run.fsdp else None
        entering = param_specs if run.fsdp else specs
        sharded = eqpar.shard_map(
            functools.partial(
                loss_and_grads_scheduled,
                schedule=run.schedule,
                context=context > 1,
                stored=stored,
            ),
            mesh=mesh,
            in_specs=(entering, sequence_spec, sequence_spec),
            out_specs=(P(), entering),
        )

        def loss_and_grads(model: lm.LM, tokens: jax.Array) -> tuple[Any, lm.LM]:
            inputs, targets = inputs_and_targets(tokens)
            loss, grads = sharded(policy.cast_to_compute(model), inputs, targets)
            # No statistics: an MoE model is refused here (`experts_problems`).
            return (policy.cast_to_output(loss), {}), policy.cast_to_param(grads)

    else:
        # Parameters enter split as stored and are gathered inside, so that with `--fsdp`
        # their gradients leave by reduce-scatter (`stored_specs`), the embeddings' and the
        # head's included.
        loss = eqpar.shard_map(
            functools.partial(sequence_loss, context=context > 1, expert=expert, with_stats=True),
            mesh=mesh,
            in_specs=(specs, sequence_spec, sequence_spec),
            out_specs=P(),
            stored_specs=(param_specs, sequence_spec, sequence_spec),
        )

        def loss_and_stats(model: lm.LM, tokens: jax.Array) -> tuple[jax.Array, Any]:
            value, stats = loss(policy.cast_to_compute(model), *inputs_and_targets(tokens))
            return policy.cast_to_output(value), stats

        loss_and_grads = eqx.filter_value_and_grad(loss_and_stats, has_aux=True)

    param_shardings = eqpar.named_shardings(param_specs, mesh)

    @eqx.filter_jit(donate="all-except-first")
    def step(tokens: jax.Array, model: lm.LM, opt_state: Any) -> tuple[Any, ...]:
        (loss, stats), grads = loss_and_grads(model, tokens)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        model = eqx.filter_shard(model, param_shardings)
        opt_state = eqx.filter_shard(
            opt_state, eqpar.named_shardings(match_param_specs(opt_state, model, param_specs), mesh)
        )
        return (model, opt_state, loss, stats) if with_stats else (model, opt_state, loss)

    return step


def place(model: lm.LM, optimizer: Any, mesh: eqpar.DeviceMesh, fsdp: bool) -> tuple[lm.LM, Any]:
    """The model and a fresh optimizer state, each leaf sharded as its parameter's layout."""
    specs = storage_specs(model, mesh, fsdp)
    model = eqx.filter_shard(model, eqpar.named_shardings(specs, mesh))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    opt_specs = match_param_specs(opt_state, model, specs)
    return model, eqx.filter_shard(opt_state, eqpar.named_shardings(opt_specs, mesh))


# How close `--check` requires the parallel run to be to the one-device run, with plain SGD:
# float32 rounding gives about 4e-7 for both after 120 steps of the default model.
CHECK_TOLERANCE = 1e-5
# The same under bfloat16 compute: both runs round to bfloat16 (2**-9 relative) but sum over
# devices in other orders; after 120 steps of the default model (data=2,pipe=2,model=2) the
# losses differ by 2.1e-3 (relative) and the parameters by 6.9e-3.
CHECK_TOLERANCE_BFLOAT16 = 3e-2


def check_tolerance(precision: str) -> float:
    """The tolerance of `--check` under `precision` (`CHECK_TOLERANCE*`)."""
    return CHECK_TOLERANCE_BFLOAT16 if precision == "bfloat16" else CHECK_TOLERANCE


SGD_LR_SCALE = 30  # plain SGD's learning rate is this multiple of --lr (Adam's)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm(max_norm)` with the clipping factor as one scalar: below
    `max_norm` the gradients pass unchanged, above it each is multiplied by `max_norm / norm`;
    the same updates to float32 rounding.

    optax's computes `gradient / norm * max_norm` per array, and XLA's CPU compiler counts a
    division as too dear to compute twice: where Adam's two moments both read the clipped
    gradient, it writes the quotient to a buffer of its own, a second copy of the gradients in
    the step's temp (+1x the parameters with `data=8`; `benchmarks/scale.py`'s depth sweep).
    A product by a scalar fuses into each reader, so the step holds the gradients and the
    optimizer state only: in every layout of the example each added layer adds what it adds
    to the step of Adam without clipping. XLA's GPU compiler fuses the division too: on an
    H100 both give the same temp. optax has no clipping by a scalar factor, hence this one."""

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, Any]:
        del params
        # Each array's sum of squares keeps its sharding (a `vdot` would flatten the array,
        # which gathers one split over devices: 10x a layer's parameters more per layer under
        # FSDP).
        norm = jax.numpy.sqrt(sum(jax.numpy.sum(g * g) for g in jax.tree.leaves(updates)))
        factor = max_norm / norm
        # A select of the whole array, as optax's: a `where` on the factor alone costs the
        # 1F1B step a copy of one weight's gradients per layer in the schedule's loop.
        return jax.tree.map(
            lambda g: lax.select(norm < max_norm, g, g * factor.astype(g.dtype)), updates
        ), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(run: RunConfig) -> Any:
    """Adam (with warmup and clipping) by default; plain SGD with momentum (`--optimizer sgd`)
    for `--check` and the tests' comparisons.

    An update of plain SGD is a fixed linear function of the gradients, so a parallel run
    stays within float32 rounding of the one-device run and a gradient `n` times too large
    shows. Adam divides by the gradient's running magnitude and clipping rescales it: both
    hide such a gradient, and Adam turns rounding noise in a gradient that is zero in exact
    arithmetic into a full-size update."""
    if run.optimizer == "adam":
        warmup = optax.linear_schedule(0.0, run.lr, transition_steps=10)
        return optax.chain(clip_by_global_norm(1.0), optax.adam(warmup))
    if run.optimizer == "sgd":
        return optax.sgd(SGD_LR_SCALE * run.lr, momentum=0.9)
    raise SystemExit(f"--optimizer must be adam or sgd; got {run.optimizer!r}")


def place_global_batch(batches: lm.Batches, position: int, mesh: eqpar.DeviceMesh) -> jax.Array:
    """The whole batch at `position` as one array, its rows split over the data axis (and
    the expert axis where the mesh has one; one process)."""
    rows = NamedSharding(mesh.jax_mesh, row_spec(mesh.axis_names))
    return jax.device_put(batches.batch(position), rows)


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often to checkpoint; `resume` continues from the latest good step."""

    directory: pathlib.Path
    save_every: int = 10
    keep: int = 3
    resume: bool = False


# Beside the numbered steps in the checkpoint directory: the loss of every step so far, so
# that the loss curve of a resumed run goes on from the earlier one.
LOSS_HISTORY = "losses.json"


def read_loss_history(directory: pathlib.Path, upto: int) -> dict[int, float]:
    """The losses of steps `1 ... upto` saved in `directory` by `write_loss_history`.

    **Arguments:**

    - `directory`: the checkpoint directory.
    - `upto`: the restored step; losses of later steps (written before a save that did not
      complete, or of steps past an older checkpoint restored instead) are left out.

    **Returns:** `{step: loss}`, empty (with a note) when there is no readable history.
    """
    path = pathlib.Path(directory) / LOSS_HISTORY
    try:
        saved = json.loads(path.read_text())
        pairs = zip(saved["steps"], saved["losses"], strict=True)
        return {int(step): float(loss) for step, loss in pairs if int(step) <= upto}
    except (OSError, ValueError, KeyError, TypeError) as error:
        note = f"no loss history in {path} ({type(error).__name__})"
        print(f"{note}: the loss curve starts after step {upto}")
        return {}


def write_loss_history(directory: pathlib.Path, history: dict[int, float]) -> None:
    """Write `{step: loss}` to `directory`; through a rename, so a kill midway leaves the
    previous file whole.

    **Arguments:**

    - `directory`: the checkpoint directory (created if missing).
    - `history`: the loss of each step so far.

    **Returns:** `None`.
    """
    path = pathlib.Path(directory) / LOSS_HISTORY
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(LOSS_HISTORY + ".partial")
    partial.write_text(json.dumps({"steps": list(history), "losses": list(history.values())}))
    os.replace(partial, path)


@dataclasses.dataclass(frozen=True)
class Training:
    """What `run_training` gives back.

    - `losses`: the loss of each step run by this call, steps `start + 1 ... run.steps`.
    - `model`: the final model as trained (`lm.model_order` gives its serial form).
    - `start`: the step this call started from: 0, or the step of the checkpoint it resumed.
    - `curve`: `(steps, losses)` of the whole run so far: the history saved with that
      checkpoint, then this call's steps.
    - `first_step_seconds`: wall time of this call's first step, compilation included.
    - `tokens_per_second`: throughput of the steps after the first (`None` with fewer than 2).
    - `router_stats`: with `--experts`, the parts of the last step's loss (see
      `lm.LM.loss_and_stats`); `{}` otherwise.
    """

    losses: list[float]
    model: lm.LM
    start: int
    curve: tuple[list[int], list[float]]
    first_step_seconds: float | None
    tokens_per_second: float | None
    router_stats: dict[str, float] = dataclasses.field(default_factory=dict)


def run_training(
    run: RunConfig,
    *,
    config: lm.LMConfig | None = None,
    devices: Sequence[Any] | None = None,
    progress: bool = True,
    log_every: int = 10,
    show_layout: bool = True,
    checkpoint: CheckpointOptions | None = None,
    source: input_data.RowSource | None = None,
    example_log: input_data.ExampleLog | None = None,
) -> Training:
    """Train until step `run.steps`, from step 0 or from the latest checkpoint.

    **Arguments:**

    - `run`: the mesh, schedule, sizes and optimizer.
    - `config`: the model's sizes (default `lm.LMConfig()`).
    - `devices`: the devices of the mesh (default all of JAX's).
    - `progress`: say when it compiles, then show a progress bar when stdout is a terminal
      and otherwise print a line every `log_every` steps (a bar's carriage returns would
      fill a log file with partial lines).
    - `show_layout`: print the layout table of the placed model first.
    - `checkpoint`: save the model, optimizer state and data position every `save_every`
      steps and at the end, with the losses so far beside them (`LOSS_HISTORY`); `resume`
      starts from the latest good checkpoint. Stacked layers are stored in model order
      under every layout, so a checkpoint restores under any other mesh or schedule
      (`restore(..., reshape=True)` reshapes the stage stacks).
    - `source`: where each step's rows come from (`data.PackedCorpus` for `--data`); by
      default the generated text of `lm.Batches`. Each process reads only the rows on its
      own devices (`data.place_rows`); the position, the global batches consumed, is the
      step.
    - `example_log`: write each step's example ids there (`--log-examples`).

    **Returns:** a `Training`: this call's losses, the final model, the whole loss curve, and
    the first step's time (compilation included) and tokens per second after it (checkpoint
    writes not counted).
    """
    config = lm.LMConfig() if config is None else config
    check_sizes(config, run)
    mesh = make_mesh(run.mesh, devices)
    model = build_model(config, run, mesh)
    optimizer = make_optimizer(run)
    model, opt_state = place(model, optimizer, mesh, run.fsdp)
    start = 0
    history: dict[int, float] = {}
    checkpointer = None
    if checkpoint is not None:
        from eqpar.checkpoint import Checkpointer

        checkpointer = Checkpointer(
            checkpoint.directory, save_every=checkpoint.save_every, keep=checkpoint.keep
        )
        if checkpoint.resume and checkpointer.latest_step() is not None:
            target = {"model": model, "opt_state": opt_state, "position": 0}
            target.update(input_data.checkpoint_state(source))
            state = checkpointer.restore(target=target, reshape=True)
            model, opt_state, start = state["model"], state["opt_state"], int(state["position"])
            input_data.check_restored(state, source)
            print(f"resumed from step {checkpointer.restored_step} ({checkpoint.directory})")
            history = read_loss_history(checkpoint.directory, start)
    if show_layout:
        print_layout_table(model, mesh=mesh)
    step = build_step(model, mesh, run, optimizer, with_stats=True)
    if source is None:
        corpus = lm.encode(lm.make_corpus(200_000, seed=run.seed), config.vocab_size)
        batches = lm.Batches(
            corpus, batch_size=run.batch_size, seq_len=config.seq_len, seed=run.seed
        )
        source = input_data.SyntheticRows(batches)
    rows = NamedSharding(mesh.jax_mesh, row_spec(mesh.axis_names))
    width = config.seq_len + 1
    losses: list[float] = []
    stats: dict[str, float] = {}
    reporter = _Reporter(run.steps, enabled=progress, every=log_every)
    tokens_per_step = run.batch_size * config.seq_len
    first_step_seconds: float | None = None
    tokens_per_second: float | None = None
    timed_from = 0.0  # the end of the first step: what comes after runs compiled code only
    saving = 0.0  # seconds spent writing checkpoints since then, which tokens/s leaves out

    def so_far(position: int) -> dict[int, float]:
        return {**history, **dict(zip(range(start + 1, position + 1), losses))}

    def save(position: int, *, force: bool) -> None:
        if checkpointer is None or checkpoint is None:
            return
        if force or checkpointer.should_save(position):
            if jax.process_index() == 0:
                # Before the checkpoint, so that a step on disk always has its losses there.
                write_loss_history(checkpoint.directory, so_far(position))
            state = {"model": model, "opt_state": opt_state, "position": position}
            state.update(input_data.checkpoint_state(source))
            checkpointer.save(position, state, force=force)

    try:
        for position in range(start, run.steps):
            if position == start and progress:
                print("compiling the training step (the first step includes it)...", flush=True)
            began = time.perf_counter()
            tokens = input_data.place_rows(source, position, rows, width)
            model, opt_state, loss, step_stats = step(tokens, model, opt_state)
            losses.append(float(loss))  # waits for the step to finish
            if example_log is not None:
                example_log.write(position + 1, losses[-1], source, rows, width)
            stats = {name: float(value) for name, value in step_stats.items()}
            now = time.perf_counter()
            if first_step_seconds is None:
                first_step_seconds, timed_from = now - began, now
                reporter.first_step(position + 1, first_step_seconds)
            else:
                training_seconds = now - timed_from - saving
                tokens_per_second = tokens_per_step * (position - start) / training_seconds
            reporter.update(position + 1, losses[-1], tokens_per_second, stats)
            save(position + 1, force=position + 1 == run.steps)
            saving += time.perf_counter() - now
    finally:
        reporter.close()
        if checkpointer is not None:
            checkpointer.close()
    curve = so_far(run.steps)
    return Training(
        losses=losses,
        model=model,
        start=start,
        curve=(list(curve), list(curve.values())),
        first_step_seconds=first_step_seconds,
        tokens_per_second=tokens_per_second,
        router_stats=stats,
    )


def format_router_stats(stats: dict[str, float]) -> str:
    """The MoE parts of a step's loss in words (`""` without experts), e.g.
    `load balancing 1.0123  z 0.4512  dropped 0`: the auxiliary losses as means over the
    blocks, the dropped (token, expert) assignments over all of them (0 when dropless)."""
    if not stats:
        return ""
    return (
        f"load balancing {stats['load_balancing']:.4f}  z {stats['z_loss']:.4f}  "
        f"dropped {stats['dropped']:.0f}"
    )


def train(
    run: RunConfig,
    *,
    config: lm.LMConfig | None = None,
    devices: Sequence[Any] | None = None,
    progress: bool = True,
    show_layout: bool = True,
    checkpoint: CheckpointOptions | None = None,
    source: input_data.RowSource | None = None,
) -> tuple[list[float], lm.LM]:
    """`run_training` for callers that need only the losses and the model.

    **Arguments:** as `run_training` (its progress lines every 10 steps).

    **Returns:** `(losses, model)`: the losses of the steps run here and the final model as
    trained (`lm.model_order` gives its serial form, the same for every layout).
    """
    training = run_training(
        run,
        config=config,
        devices=devices,
        progress=progress,
        show_layout=show_layout,
        checkpoint=checkpoint,
        source=source,
    )
    return training.losses, training.model


class _Reporter:
    """The progress of the training loop on stdout: a tqdm bar on a terminal, otherwise a
    plain line every `every` steps (a bar redraws itself with carriage returns, which fill a
    log file with partial lines)."""

    def __init__(self, total: int, *, enabled: bool, every: int):
        self.total, self.enabled, self.every = total, enabled, every
        self.stream = sys.stdout
        self.bar: Any = None

    def first_step(self, step: int, seconds: float) -> None:
        if not self.enabled:
            return
        print(
            f"step {step} took {seconds:.1f} s with the compilation; tokens/s count from the next",
            file=self.stream,
            flush=True,
        )
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                initial=step - 1,
                desc="training",
                file=self.stream,
                dynamic_ncols=True,
            )

    def update(
        self,
        step: int,
        loss: float,
        tokens_per_second: float | None,
        stats: dict[str, float] | None = None,
    ) -> None:
        if not self.enabled:
            return
        rate = "-" if tokens_per_second is None else f"{tokens_per_second:.0f}"
        router = format_router_stats(stats or {})
        if self.bar is not None:
            extra = {}
            if stats:
                balance, dropped = stats["load_balancing"], int(stats["dropped"])
                extra = {"balance": f"{balance:.3f}", "dropped": dropped}
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=rate, **extra, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            print(
                f"step {step}/{self.total}  loss {loss:.4f}  tokens/s {rate}"
                + (f"  {router}" if router else ""),
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_pictures(
    losses: Sequence[float],
    run: RunConfig,
    out: pathlib.Path,
    *,
    steps: Sequence[int] | None = None,
    resumed_at: int = 0,
) -> list[pathlib.Path]:
    """Draw the loss curve and, with a pipe axis, the schedule's picture into `out`.

    **Arguments:**

    - `losses`: the losses to draw.
    - `run`: what ran them (the title says it in words, see `describe`).
    - `out`: the directory for `loss_curve.png` and `schedule_<name>.png`.
    - `steps`: the step of each loss (default 1, 2, ...).
    - `resumed_at`: where a resumed run took over (a dotted line), 0 for none.

    **Returns:** the paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(losses) + 1) if steps is None else steps
    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(list(steps), list(losses))
    if resumed_at:
        axes.axvline(resumed_at, color="gray", linestyle=":", label=f"resumed at {resumed_at}")
        axes.legend()
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title(describe(run), fontsize="medium")
    figure.tight_layout()
    curve = out / "loss_curve.png"
    figure.savefig(curve, dpi=120)
    plt.close(figure)
    written = [curve]
    stages = run.mesh[lm.PIPE]
    if stages > 1:
        from eqpar.schedule import (
            CircularSchedule,
            GPipeSchedule,
            OneFOneBSchedule,
            ZeroBubbleH1Schedule,
        )

        if run.schedule == "circular":
            schedule: Any = CircularSchedule(
                stages, run.microbatches, run.repeats, include_backward=True
            )
        elif run.schedule == "1f1b":
            schedule = OneFOneBSchedule(stages, run.microbatches)
        elif run.schedule == "zb-h1":
            schedule = ZeroBubbleH1Schedule(stages, run.microbatches)
        else:
            schedule = GPipeSchedule(stages, run.microbatches, include_backward=True)
        written.append(schedule.plot(out / f"schedule_{run.schedule}.png"))
    return written


SIZES = {
    "small": lm.LMConfig(),
    "tiny": lm.LMConfig(
        vocab_size=32, seq_len=16, d_model=32, num_heads=8, d_hidden=64, num_layers=4
    ),
}


def host_parameters(model: lm.LM) -> list[np.ndarray]:
    """Every parameter of `model` in model order, whole, as NumPy arrays; with several
    processes a collective (`multihost_utils.process_allgather`): every process calls it."""
    from jax.experimental import multihost_utils

    leaves = jax.tree.leaves(eqx.filter(lm.model_order(model), eqx.is_array))
    return [
        np.asarray(leaf)
        if leaf.is_fully_addressable
        else np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        for leaf in leaves
    ]


def parameter_digest(model: lm.LM | list[np.ndarray]) -> str:
    """A hash of every parameter's bytes (equal digests: bitwise equal parameters)."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in model if isinstance(model, list) else host_parameters(model):
        digest.update(leaf.tobytes())
    return digest.hexdigest()


def largest_differences(a: lm.LM | list[np.ndarray], b: lm.LM | list[np.ndarray]) -> float:
    """The largest parameter difference of two models (any layouts)."""
    leaves_a = a if isinstance(a, list) else host_parameters(a)
    leaves_b = b if isinstance(b, list) else host_parameters(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(leaves_a, leaves_b))


def positive_int(text: str) -> int:
    """An argparse `type` for counts that must be at least 1 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse `type` for a learning rate: a number above 0 (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}")
    return value


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each flag's default after its help; flags that
    are off or unset by default say what that means in their help instead."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument(
        "--mesh",
        default=None,
        help="axis sizes whose product is the device count, e.g. data=2,pipe=2,model=2; "
        "missing axes are 1; a context axis (e.g. data=2,context=4) splits every sequence "
        "over its devices (ring attention; --seq-len must divide by 2 x context) "
        "(default: data=2,pipe=2,model=2 on 8 devices, else data=<count>)",
    )
    parser.add_argument(
        "--schedule",
        choices=lm.SCHEDULES,
        default="gpipe",
        help="pipeline schedule on the pipe axis",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=4,
        help="microbatches per step on the pipe axis; without one a step is not cut up",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=2, help="stages per device (circular schedule)"
    )
    parser.add_argument("--fsdp", action="store_true", help="also shard parameters over data")
    parser.add_argument(
        "--remat",
        nargs="?",
        const="full",
        default="none",
        choices=["none", "full", "matmuls"],
        help="recompute each layer's activations in the backward pass: 'full' keeps only its "
        "input, 'matmuls' also its matmul outputs; --remat alone means full",
    )
    parser.add_argument("--steps", type=positive_int, default=120, help="training steps")
    parser.add_argument(
        "--batch-size", type=positive_int, default=16, help="sequences per step (global)"
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        default=3e-3,
        help=f"Adam's learning rate; plain SGD uses {SGD_LR_SCALE} times it",
    )
    parser.add_argument(
        "--optimizer",
        choices=("adam", "sgd"),
        default=None,
        help="adam (with warmup and clipping), or plain SGD with momentum (default: adam; "
        "sgd with --check)",
    )
    parser.add_argument(
        "--experts",
        type=positive_int,
        default=None,
        help="a mixture of E experts in every block instead of its MLP (eqpar.nn."
        "MixtureOfExperts, each expert the dense MLP's kind, dropless), with the load-balancing "
        f"({lm.LOAD_BALANCING_WEIGHT}) and router z ({lm.Z_LOSS_WEIGHT}) auxiliary losses of "
        "every block added to the loss; an expert axis in --mesh (e.g. data=2,expert=4) splits "
        "the experts over its devices (eqpar.ExpertParallel; the batch rows split over data "
        "and expert), a model axis each expert's hidden units; not with a pipe axis "
        "(default: a dense MLP)",
    )
    parser.add_argument(
        "--top-k", type=positive_int, default=2, help="experts per token (with --experts)"
    )
    parser.add_argument("--seed", type=int, default=0, help="initialization and data order")
    parser.add_argument(
        "--precision",
        choices=lm.PRECISIONS,
        default="float32",
        help="the compute dtype (eqpar.Precision): bfloat16 computes the forward and backward "
        "passes and their collectives in bfloat16, keeping float32 parameters, optimizer state, "
        "layer norms, softmax and loss",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="train the same steps again on one device with plain SGD under the same "
        "--precision and print PASS or FAIL: losses (relative) and parameters within "
        f"{CHECK_TOLERANCE:.0e} (bfloat16: {CHECK_TOLERANCE_BFLOAT16:.0e}); exit status 1 on "
        "FAIL",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("outputs"),
        help="where the loss curve and schedule pictures go",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
    parser.add_argument(
        "--log-every",
        type=positive_int,
        default=10,
        help="when stdout is not a terminal (a log file, CI): a line every N steps instead of "
        "a progress bar",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write a summary (losses, timings) here")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="model size")
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="tokens per sequence (default: the --size's: "
        + ", ".join(f"{config.seq_len} for {name}" for name, config in SIZES.items())
        + ")",
    )
    parser.add_argument("--ckpt-dir", type=pathlib.Path, help="checkpoint directory")
    parser.add_argument(
        "--save-every", type=positive_int, default=20, help="checkpoint every N steps"
    )
    parser.add_argument("--keep", type=positive_int, default=3, help="checkpoints to keep")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir"
    )
    # Several processes and real data (docs/tutorials/multihost.md, docs/running.md).
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="run as N processes on this machine (127.0.0.1), each with 8/N simulated CPU "
        "devices (EQPAR_NUM_CPU_DEVICES sets another count), started and watched by "
        "examples/launch.py, their lines prefixed [p<id>]",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process job started by SLURM, mpirun or by hand: eqpar.initialize() "
        "reads EQPAR_COORDINATOR_ADDRESS, EQPAR_NUM_PROCESSES and EQPAR_PROCESS_ID, or else "
        "JAX's cluster detection (implied when those variables are set)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=3600.0,
        help="with --processes: seconds each process may run before it is killed",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="with --processes: also show JAX's and Gloo's start-up chatter",
    )
    parser.add_argument(
        "--data",
        type=pathlib.Path,
        help="train on the tokenized corpus in this directory (ArrayRecord files read with "
        "Grain, each process reading only its own rows; write the demo corpus with "
        "python examples/data.py DIR --vocab-size V) instead of generated text",
    )
    parser.add_argument(
        "--log-examples",
        type=pathlib.Path,
        help="append each step's loss and example ids to DIR/process<P>.jsonl",
    )
    return parser


def check_against_one_device(
    run: RunConfig,
    config: lm.LMConfig,
    training: Training,
    *,
    source: input_data.RowSource | None = None,
    trained: list[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Train `run` again on one device and compare with `training`, as `--check` does.

    **Arguments:**

    - `run`, `config`: what `training` ran.
    - `training`: its result; after a resume only its own steps' losses are compared.
    - `source`: the rows it read (default: the generated text).
    - `trained`: its parameters from `host_parameters` (default: gathered here). With
      several processes every process gathers them, and process 0 alone trains on one of
      its own devices and compares.

    **Returns:** the largest relative loss difference, the largest parameter difference,
    the tolerance, whether both are within it (`passed`) and the one-device run's losses
    (`serial_losses`, from step 1); on processes other than 0, `{}`.
    """
    trained = host_parameters(training.model) if trained is None else trained
    if jax.process_index() != 0:
        return {}
    print(f"check: the same {run.steps} steps on one device (compiling...)", flush=True)
    tolerance = check_tolerance(run.precision)
    serial_run = dataclasses.replace(run, mesh={lm.DATA: 1, lm.PIPE: 1, lm.MODEL: 1}, fsdp=False)
    serial = run_training(
        serial_run,
        config=config,
        devices=jax.local_devices()[:1],
        progress=False,
        show_layout=False,
        source=source,
    )
    serial_losses = serial.losses[training.start :]  # the steps this process ran
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(training.losses, serial_losses))
    param_diff = largest_differences(trained, serial.model)
    passed = loss_diff <= tolerance and param_diff <= tolerance
    print(
        f"check against one device ({run.optimizer}, {run.precision}, tolerance "
        f"{tolerance:.0e}): "
        f"largest relative loss difference {loss_diff:.2e}, largest parameter difference "
        f"{param_diff:.2e}: {'PASS' if passed else 'FAIL'}"
    )
    return {
        "loss_difference": loss_diff,
        "parameter_difference": param_diff,
        "tolerance": tolerance,
        "passed": passed,
        "serial_losses": serial.losses,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the command line `argv`; returns the summary that `--json` writes."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume and args.ckpt_dir is None:
        parser.error("--resume needs --ckpt-dir DIR (the directory to resume from)")
    if args.check and args.optimizer == "adam":
        parser.error(
            f"--check compares with one device within {CHECK_TOLERANCE:.0e}, which holds for "
            "plain SGD only: Adam turns float32 rounding differences into full-size updates. "
            "Leave out --optimizer adam (--check then trains with sgd)."
        )
    checkpoint = (
        None
        if args.ckpt_dir is None
        else CheckpointOptions(args.ckpt_dir, args.save_every, args.keep, args.resume)
    )
    if args.processes > 1 and not (launch.in_job() or args.distributed):  # start them here
        command = list(sys.argv[1:] if argv is None else argv)
        status = launch.launch_command(
            command, args.processes, timeout=args.timeout, verbose=args.verbose, script=__file__
        )
        return {"processes": args.processes, "exit_status": status}
    if args.distributed or launch.in_job():
        launch.join()
    if args.processes > 1 and args.processes != jax.process_count():
        parser.error(f"--processes {args.processes}: this job has {jax.process_count()}")
    first = jax.process_index() == 0  # writes the files and pictures, runs --check

    count = jax.device_count()
    default_mesh = "data=2,pipe=2,model=2" if count == 8 else f"data={count}"
    run = RunConfig(
        mesh=parse_mesh(args.mesh or default_mesh, count),
        schedule=args.schedule,
        microbatches=args.microbatches,
        repeats=args.repeats,
        fsdp=args.fsdp,
        remat=args.remat,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer or ("sgd" if args.check else "adam"),
        seed=args.seed,
        precision=args.precision,
    )
    config = SIZES[args.size]
    if args.seq_len is not None:
        config = dataclasses.replace(config, seq_len=args.seq_len)
    if args.experts is not None:
        config = dataclasses.replace(config, num_experts=args.experts, top_k=args.top_k)
    check_sizes(config, run)  # before any output: a usage error comes first
    source = None if args.data is None else open_data(args.data, config, run)
    example_log = None if args.log_examples is None else input_data.ExampleLog(args.log_examples)
    platform = jax.devices()[0].platform
    experts = f"; {config.num_experts} experts, top {config.top_k}" if config.num_experts else ""
    processes = jax.process_count()
    job, here = "", ""
    if processes > 1:
        job = f"process {jax.process_index()} of {processes}: "
        here = f" ({jax.local_device_count()} here)"
    data = "" if args.data is None else f"; data {args.data}"
    print(
        f"{job}{count} {platform} devices{here}; {describe(run)}{experts}; optimizer "
        f"{run.optimizer}{data}",
        flush=True,
    )
    started = time.perf_counter()
    training = run_training(
        run,
        config=config,
        progress=not args.no_progress,
        log_every=args.log_every,
        show_layout=first,
        checkpoint=checkpoint,
        source=source,
        example_log=example_log,
    )
    losses, model = training.losses, training.model
    trained = host_parameters(model)
    seconds = time.perf_counter() - started
    steps, curve = training.curve
    summary: dict[str, Any] = {
        "losses": losses,
        "seconds": seconds,
        "first_step_seconds": training.first_step_seconds,
        "tokens_per_second": training.tokens_per_second,
        "mesh": run.mesh,
        "curve": {"steps": steps, "losses": curve},
        "parameter_digest": parameter_digest(trained),
        "router_stats": training.router_stats,
    }
    if args.json and first:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    if not losses:
        print(f"nothing to do: already at step {run.steps}")
        if args.json and first:
            args.json.write_text(json.dumps(summary))
        return summary
    rate = training.tokens_per_second
    after = "" if rate is None else f"; {rate:.0f} tokens/s after the first step"
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} step"
        f"{'' if len(losses) == 1 else 's'} ({seconds:.1f} s, "
        f"first step {training.first_step_seconds:.1f} s with the compilation{after})"
    )
    if training.router_stats:
        print(f"experts at the last step: {format_router_stats(training.router_stats)}")
    if first:
        for path in write_pictures(curve, run, args.out, steps=steps, resumed_at=training.start):
            print(f"wrote {path}")
    if args.check:
        summary["check"] = check_against_one_device(
            run, config, training, source=source, trained=trained
        )
    if args.json and first:
        args.json.write_text(json.dumps(summary))
    return summary


def open_data(directory: pathlib.Path, config: lm.LMConfig, run: RunConfig) -> Any:
    """The `--data` corpus as the rows of `run`'s batches; refused where its tokens do not
    fit the model's vocabulary."""
    corpus = input_data.open_corpus(directory)
    if corpus.vocab_size > config.vocab_size:
        raise SystemExit(
            f"--data {directory}: its vocabulary has {corpus.vocab_size} tokens, the model's "
            f"{config.vocab_size}: choose a --size with at least {corpus.vocab_size} or write "
            f"the corpus with --vocab-size {config.vocab_size}."
        )
    return input_data.PackedCorpus(
        corpus, batch_size=run.batch_size, seq_len=config.seq_len, seed=run.seed
    )


def exit_status(argv: Sequence[str] | None = None) -> int:
    """The command's exit status: 1 on a failed `--check` (so that scripts and CI notice),
    the launcher's with `--processes`, else 0."""
    summary = main(argv)
    if "exit_status" in summary:
        return summary["exit_status"]
    return 0 if summary.get("check", {}).get("passed", True) else 1


if __name__ == "__main__":
    distributed = launch.in_job() or "--distributed" in sys.argv
    sys.exit(launch.exit_status(exit_status, distributed=distributed))
