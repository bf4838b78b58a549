"""Train a small language model with data x pipeline x tensor parallelism (and optional FSDP
and context parallelism).

    python examples/train_lm.py                                  # 8 simulated CPU devices
    python examples/train_lm.py --mesh data=2,pipe=2,model=2 --schedule 1f1b
    python examples/train_lm.py --mesh data=8 --fsdp --check     # compare with one device
    python examples/train_lm.py --mesh data=2,context=4 --check  # the sequence split over 4
    python examples/train_lm.py --experts 8 --top-k 2 --mesh data=2,expert=4 --check  # MoE
    python examples/train_lm.py --precision bfloat16             # float32 params, bf16 compute
    python examples/train_lm.py --ckpt-dir /tmp/ckpt --resume    # continue from the latest
    python examples/train_lm.py --config outputs/config.json     # the run that wrote it, again
    python examples/train_lm.py --processes 2                    # 2 processes x 4 CPU devices
    python examples/train_lm.py --data /tmp/corpus               # written by examples/data.py

On CPU, 8 devices are simulated; on accelerators the device count comes from JAX. Any mesh
whose product is the device count works, 1 device included. A `context` axis splits every
sequence over its devices (ring attention, all-gather attention with a pipe axis; balanced
causal layout): the sequence length (`--seq-len`) must divide by 2 x context. With
`--experts`, each block's MLP is a mixture of experts and an `expert` axis splits the experts
over its devices (the batch rows split over data and expert), a `model` axis each expert's
hidden units.

The options are a typed dataclass, `TrainConfig`, read by tyro; a run writes them to
`config.json` in `--out` (and `--ckpt-dir`), and `--config FILE` reads them back. Before
training it says what it does (building, compiling) and prints the memory per device of the
compiled step (parameters, optimizer state, temp). Every step's loss, learning rate,
gradient norm, tokens/s and, on accelerators of known peak, model FLOPs utilisation go to the
console (a progress bar on a terminal, a line every `--log-every` steps in a log), to
`metrics.jsonl` and, with tensorboardX installed, to TensorBoard (`--out`/tensorboard). The
loss curve and the pipeline schedule's picture go to `--out`.

A step whose loss, gradient norm or updated state is not finite stops the run (exit status
1) unsaved, so the checkpoints stay finite (`--allow-nonfinite` trains on); `metrics.jsonl`
stays strict JSON (such values `null`, named in `"nonfinite"`). Every refusal of the
options, the data or the checkpoint directory is one `train_lm.py: error: ...` line naming
the option and the fix, with exit status 2.

The same program runs as every process of a multi-process job, with every flag:
`--processes N` starts N processes on this machine (`launch.py`), `--distributed` joins a job
started by SLURM, `mpirun` or by hand (`eqpar.initialize()`). With `--data` the rows come from
a tokenized corpus on disk (`data.py`), each process reading only its own; the checkpoint holds
the data position, so a resume on any number of processes continues with the next examples.
"""

import contextlib
import dataclasses
import functools
import io
import itertools
import json
import logging
import math
import os
import pathlib
import re
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, Literal

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
import tyro
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import data as input_data
import launch
import lm
import metrics

import eqpar
from eqpar.context import balance_sequence, sequence_positions
from eqpar.distributions import match_param_specs
from eqpar.inspect import print_layout_table
from eqpar.nn import PipelineModule
from eqpar.spmd import gather_stored

log = logging.getLogger(metrics.LOGGER)


class ConfigError(ValueError):
    """A refusal of the command line: a bad option, options that do not go together
    (`TrainConfig.validate`), sizes the mesh cannot split (`check_sizes`), a checkpoint
    directory that does not fit the run. The message names the options and the fix; `main`
    prints it after `train_lm.py: error:` and exits with status 2 (tyro reports a
    `ValueError` of an option's parser with the option's name)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    mesh: dict[str, int]
    schedule: str = "gpipe"
    microbatches: int = 4  # per step on a pipe axis; without one a step is not cut up
    accumulate: int = 1  # without a pipe axis: the step's gradients summed over this many slices
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
            raise ConfigError(
                f"--mesh: expected entries like data=2,pipe=2,model=2, data=2,context=4 or "
                f"data=2,expert=4 with axes {sorted(AXES)}; got {part!r}."
            )
        given[name] = int(value)
    names = [name for name in AXES if name in given or name not in OPTIONAL_AXES]
    sizes = {name: given.get(name, 1) for name in names}
    product = int(np.prod(list(sizes.values())))
    if product != device_count:
        raise ConfigError(
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
        repeats = f" x {pipeline_repeats(run)} repeats" if pipeline_repeats(run) > 1 else ""
        parts.append(f"{run.schedule}{repeats} schedule, {run.microbatches} microbatches")
    if run.accumulate > 1:
        parts.append(f"gradients accumulated over {run.accumulate} microbatches")
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


# The schedules that run the loss inside the pipeline, and their own backward pass.
OWN_BACKWARD = ("1f1b", "zb-h1", "zb-v", "dualpipe-v")


def pipeline_repeats(run: RunConfig) -> int:
    """Stages per device on a pipe axis: `run.repeats` for the circular schedule, 2 for the
    V-shaped ones (`zb-v`, `dualpipe-v`), else 1."""
    if run.mesh[lm.PIPE] == 1:
        return 1
    return {"circular": run.repeats, "zb-v": 2, "dualpipe-v": 2}.get(run.schedule, 1)


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
    """Refuse sizes the mesh cannot split (`ConfigError` naming every problem with the flag
    that fixes it)."""
    pipe, model, data = run.mesh[lm.PIPE], run.mesh[lm.MODEL], run.mesh[lm.DATA]
    expert = expert_size(run)
    repeats, microbatches = pipeline_repeats(run), pipeline_microbatches(run) * run.accumulate
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
    if run.schedule == "dualpipe-v" and pipe > 1 and run.microbatches < 2 * pipe:
        problems.append(
            f"--schedule dualpipe-v needs at least 2 x pipe = {2 * pipe} --microbatches (got "
            f"{run.microbatches}): use --microbatches {2 * pipe}, or --schedule zb-v"
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
            ["data"]
            + ["expert"] * (lm.EXPERT in run.mesh)
            + ["microbatches"] * (pipe > 1)
            + ["accumulate"] * (run.accumulate > 1)
        )
        flag = "--accumulate" if run.accumulate > 1 else "--microbatches"
        fewer = f" or fewer {flag}" if microbatches > 1 else ""
        multiple = -(-run.batch_size // rows) * rows
        problems.append(
            f"batch_size={run.batch_size} must divide by {what} = {rows}: use a --batch-size "
            f"that is a multiple of {rows} (e.g. {multiple}){fewer}"
        )
    if problems:
        raise ConfigError("; ".join(problems) + ".")


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
    elif run.schedule in OWN_BACKWARD:
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


def gathered(model: lm.LM, stored: tuple[Any, Any] | None) -> tuple[lm.LM, Any]:
    """Inside `shard_map`: with `stored` (`--fsdp`: the model's stored and computed specs),
    the parameters that come in split as stored gathered into the split the layers compute
    with (`eqpar.spmd.gather_stored`; the stacks that gather their layers themselves stay as
    they are), and the function that reduce-scatters their gradients back; else the model
    as it is and `None`."""
    if stored is None:
        return model, None
    stored_specs, in_specs = stored
    return eqx.filter_vjp(
        lambda m: gather_stored(m, stored_specs=stored_specs, in_specs=in_specs), model
    )


def loss_and_grads_accumulated(
    model: lm.LM,
    inputs: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    microbatches: int,
    context: bool = False,
    expert: bool = False,
    stored: tuple[Any, Any] | None = None,
) -> tuple[tuple[Array, dict[str, Array]], lm.LM]:
    """Loss, statistics and gradients inside `shard_map` with the gradients accumulated over
    `microbatches` slices of this device's rows (`eqpar.value_and_grad(...,
    microbatches=)`): one microbatch's activations held at a time, the gradients reduced
    over the data axes once. The statistics are the mean of the microbatches'. With
    `stored` (`--fsdp`), as `loss_and_grads_scheduled`."""
    model, scatter = gathered(model, stored)
    loss = functools.partial(sequence_loss, context=context, expert=expert, with_stats=True)
    (value, stats), grads = eqpar.value_and_grad(loss, has_aux=True, microbatches=microbatches)(
        model, inputs, targets
    )
    if scatter is not None:
        (grads,) = scatter(grads)
    return (value, {name: each.mean() for name, each in stats.items()}), grads


def loss_and_grads_scheduled(
    model: lm.LM,
    inputs: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    schedule: str = "1f1b",
    context: bool = False,
    stored: tuple[Any, Any] | None = None,
) -> tuple[Array, lm.LM]:
    """Loss and gradients inside `shard_map` with a schedule that runs its own backward pass
    (`PipelineModule.value_and_grad`: `"1f1b"`, `"zb-h1"`, `"zb-v"`, `"dualpipe-v"`,
    `"gpipe"` or `"circular"`); with
    `context`, the sequence is split over the context axis (the batches of `context_batch`).

    The embedding's pullback is applied to the gradient the pipeline returns for its input.
    With `stored` (`--fsdp`: the model's stored and computed specs), the parameters come in
    split as stored: those that the layers do not gather themselves (`gather_layers`) are
    gathered here, and their gradients reduce-scattered back (`eqpar.spmd.gather_stored`).
    """
    model, scatter = gathered(model, stored)
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
    (and the V-shaped ZB-V and DualPipeV) always, and on a pipe axis GPipe and circular
    too, whose table's backward adds each
    layer's gradient into the sum over microbatches in place (`jax.grad` of the forward pass
    runs the same table's backward, holding the outputs and their cotangent besides)."""
    return run.schedule in OWN_BACKWARD or run.mesh[lm.PIPE] > 1


def build_loss_and_grads(model: lm.LM, mesh: eqpar.DeviceMesh, run: RunConfig) -> Any:
    """`(model, tokens) -> ((loss, stats), grads)` on `mesh`: the loss of the whole batch
    and its gradients, shaped as the model's parameters.

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

    # The routes that take gradients inside `shard_map`: with `--fsdp` the parameters enter
    # split as stored; the function gathers them itself and reduce-scatters their gradients.
    stored = (param_specs, specs) if run.fsdp else None
    entering = param_specs if run.fsdp else specs
    if run.accumulate > 1:
        # Gradient accumulation (no pipe axis): the loss's gradients summed over
        # `run.accumulate` slices of each device's rows.
        sharded = eqpar.shard_map(
            functools.partial(
                loss_and_grads_accumulated,
                microbatches=run.accumulate,
                context=context > 1,
                expert=expert,
                stored=stored,
            ),
            mesh=mesh,
            in_specs=(entering, sequence_spec, sequence_spec),
            out_specs=((P(), P()), entering),
        )

        def loss_and_grads(model: lm.LM, tokens: jax.Array) -> tuple[Any, lm.LM]:
            (loss, stats), grads = sharded(
                policy.cast_to_compute(model), *inputs_and_targets(tokens)
            )
            return (policy.cast_to_output(loss), stats), policy.cast_to_param(grads)

    elif runs_own_backward(run):
        # The schedule's own backward pass (1F1B, ZB-H1, or a pipe axis).
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

    return loss_and_grads


def build_step(
    model: lm.LM,
    mesh: eqpar.DeviceMesh,
    run: RunConfig,
    optimizer: Any,
    *,
    with_stats: bool = False,
) -> Any:
    """The jitted train step `(tokens, model, opt_state) -> (model, opt_state, loss)`; with
    `with_stats`, `(model, opt_state, loss, stats, grad_norm, finite)`, `stats` the parts of
    the loss of an MoE model (`lm.LM.loss_and_stats`: cross entropy, auxiliary losses,
    dropped assignments; `{}` for a dense one), `grad_norm` the global norm of the gradients
    before clipping and `finite` whether every updated parameter and optimizer state value
    is finite (a scalar: one reduction per array, no gather). The gradients are
    `build_loss_and_grads`'."""
    loss_and_grads = build_loss_and_grads(model, mesh, run)
    param_specs = storage_specs(model, mesh, run.fsdp)
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
        if with_stats:
            return model, opt_state, loss, stats, global_norm(grads), all_finite((model, opt_state))
        return model, opt_state, loss

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


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all of `tree`'s arrays together. Each array's sum of squares keeps its
    sharding (a `vdot` would flatten the array, which gathers one split over devices: 10x a
    layer's parameters more per layer under FSDP)."""
    return jax.numpy.sqrt(sum(jax.numpy.sum(g * g) for g in jax.tree.leaves(tree)))


def all_finite(tree: Any) -> jax.Array:
    """Whether every value of `tree`'s floating-point arrays is finite (a boolean scalar; each
    array reduced where it lives, as `global_norm`)."""
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return jax.numpy.stack([jax.numpy.isfinite(leaf).all() for leaf in leaves]).all()


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
        norm = global_norm(updates)
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
        return optax.chain(clip_by_global_norm(1.0), optax.adam(learning_rate_schedule(run)))
    if run.optimizer == "sgd":
        return optax.sgd(SGD_LR_SCALE * run.lr, momentum=0.9)
    raise ConfigError(f"--optimizer must be adam or sgd; got {run.optimizer!r}")


def learning_rate_schedule(run: RunConfig) -> optax.Schedule:
    """The learning rate of each update of `make_optimizer(run)` by its index (0 for the
    first step's): Adam's warms up linearly from 0 to `run.lr` over 10 steps; plain SGD's is
    `SGD_LR_SCALE * run.lr` throughout."""
    if run.optimizer == "adam":
        return optax.linear_schedule(0.0, run.lr, transition_steps=10)
    return optax.constant_schedule(SGD_LR_SCALE * run.lr)


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


# The metrics file of a run with --ckpt-dir, beside its checkpoints: a resumed run goes on
# with it, so that its loss curve starts at step 1 (`Training.curve`).
METRICS_FILE = "metrics.jsonl"


def saved_steps(directory: pathlib.Path) -> list[int]:
    """The committed checkpoint steps in `directory`, oldest first (`[]` where there is no
    such directory; nothing is created)."""
    from orbax.checkpoint import utils

    if not pathlib.Path(directory).is_dir():
        return []
    # A listing, not a `Checkpointer`: in a multi-process run the directory may exist for one
    # process and not yet for another, and a Checkpointer opened on only some processes
    # would wait in orbax's barriers for the others (what `Checkpointer.all_steps` lists).
    return sorted(utils.checkpoint_steps(directory))


def check_checkpoint_start(checkpoint: CheckpointOptions, steps: Sequence[int], last: int) -> None:
    """Refuse a checkpoint directory holding `steps` that a run to step `last` with
    `checkpoint` would not continue as asked (`ConfigError` naming the option and the fix):
    `--resume` with nothing to resume (a typo in `--ckpt-dir`), a fresh run beside the steps
    of another (whose saves would not happen: a step is never overwritten, and none is
    written before the latest one), or a resume from a step past `--steps`."""
    directory, latest = checkpoint.directory, max(steps, default=None)
    if checkpoint.resume and latest is None:
        where = (
            "holds no checkpoint (no step saved there yet)"
            if pathlib.Path(directory).is_dir()
            else "does not exist"
        )
        raise ConfigError(
            f"--resume: nothing to resume from: --ckpt-dir {directory} {where}. Check the path "
            "(a typo?), or leave out --resume to start from step 0."
        )
    if not checkpoint.resume and latest is not None:
        listed = ", ".join(map(str, steps)) if len(steps) <= 5 else f"{steps[0]}, ..., {latest}"
        raise ConfigError(
            f"--ckpt-dir {directory} already holds checkpoints (steps {listed}); without "
            "--resume this run would start from step 0 beside them, and its saves up to step "
            f"{latest} would not happen (a step is never overwritten). Pass --resume to "
            f"continue from step {latest}, or another --ckpt-dir to start afresh."
        )
    if checkpoint.resume and latest is not None and latest > last:
        raise ConfigError(
            f"--resume: the latest checkpoint in --ckpt-dir {directory} is step {latest}, past "
            f"--steps {last}: pass --steps above {latest} to train on from it, or another "
            "--ckpt-dir."
        )


def restore_checkpoint(checkpointer: Any, target: dict[str, Any]) -> dict[str, Any]:
    """`checkpointer.restore(target=target, reshape=True)`; a checkpoint of another structure
    (`CheckpointMismatchError`) as a `ConfigError` naming its first difference and the fix."""
    from eqpar.checkpoint import CheckpointMismatchError

    try:
        return checkpointer.restore(target=target, reshape=True)
    except CheckpointMismatchError as error:
        lines = str(error).splitlines()
        count = next((line.rstrip(":") for line in lines if line.startswith("All ")), "")
        directory = pathlib.Path(str(checkpointer.directory))
        raise ConfigError(
            f"--resume: the checkpoint in --ckpt-dir {directory} does not fit this run's "
            f"model and optimizer: {lines[0].rstrip('.')}{f' ({count.lower()})' if count else ''}. "
            "Resume with the "
            f"options it was written with (--config {directory / CONFIG_FILE} --resume, where "
            "its run wrote one), or start afresh in another --ckpt-dir."
        ) from None


# The options that say what a checkpoint holds: another value gives another model, optimizer
# state or data position (`--data`: given or not); the others (mesh, schedule, FSDP, remat,
# precision, ...) are layouts and ways of computing that a checkpoint restores under.
RECORDED = ("size", "seq_len", "experts", "top_k", "optimizer", "data")


def recorded_differences(recorded: dict[str, Any], options: "TrainConfig") -> list[str]:
    """The options of `RECORDED` whose value in `recorded` (a checkpoint's `config.json`)
    differs from `options` (resolved); `--data` only where one gives it and the other not,
    `--top-k` only where both have `--experts`."""
    differences = []
    for name in RECORDED:
        if name not in recorded:
            continue
        there, here = recorded[name], getattr(options, name)
        if name == "data":  # another directory may hold the same corpus
            differs = (there is None) != (here is None)
        elif name == "top_k":
            differs = None not in (recorded.get("experts"), options.experts) and there != here
        else:
            differs = there != here
        if differs:
            differences.append(name)
    return differences


def check_recorded_options(options: "TrainConfig") -> None:
    """Refuse `--resume` with options that would not fit the checkpoint in `--ckpt-dir`, as
    its `config.json` records them (`ConfigError` naming each option with its recorded and
    given values, and the fix); nothing to check where there is no such file."""
    assert options.ckpt_dir is not None
    path = options.ckpt_dir / CONFIG_FILE
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # no record (a run of `run_training` alone): the restore checks the structure
    if not isinstance(recorded, dict):
        return
    differences = recorded_differences(recorded, options)
    if not differences:
        return

    def shown(value: Any) -> str:
        return "unset" if value is None else str(value)

    found = "; ".join(
        f"{_flag(name)} {shown(recorded[name])} there, {shown(getattr(options, name))} here"
        for name in differences
    )
    fix = ", ".join(
        f"no {_flag(name)}" if recorded[name] is None else f"{_flag(name)} {recorded[name]}"
        for name in differences
    )
    raise ConfigError(
        f"--resume: the checkpoint in --ckpt-dir {options.ckpt_dir} was written with other "
        f"options ({path}): {found}. Its model and optimizer state would not fit this run: "
        f"resume with the options it was written with ({fix}), or with --config {path} "
        "--resume; or start afresh in another --ckpt-dir."
    )


@dataclasses.dataclass(frozen=True)
class Training:
    """What `run_training` gives back.

    - `losses`: the loss of each step run by this call, steps `start + 1 ... run.steps`.
    - `model`: the final model as trained (`lm.model_order` gives its serial form).
    - `start`: the step this call started from: 0, or the step of the checkpoint it resumed.
    - `curve`: `(steps, losses)` of the whole run so far: the steps before `start` read back
      from the metrics file of the run it resumed, then this call's steps.
    - `first_step_seconds`: wall time of this call's first step (compiled before it).
    - `tokens_per_second`: throughput of the steps after the first (`None` with fewer than 2).
    - `router_stats`: with `--experts`, the parts of the last step's loss (see
      `lm.LM.loss_and_stats`); `{}` otherwise.
    - `compile_seconds`: the time it took to compile the step (`None` with no step to run).
    - `memory`: the compiled step's memory per device (`metrics.memory_figures`; `{}` with no
      step to run).
    - `last`: the record of the last step (`metrics.Recorder.step`'s; `{}` with none).
    - `stopped`: where a run stopped on a non-finite step (`None` where it did not): its
      `step`, what was not finite (`nonfinite`: `loss`, `grad_norm`, `state` for the updated
      parameters and optimizer state, and any MoE statistic), the last checkpoint on disk
      (`last_checkpoint`, every one of them finite; `None` without one) and the `message`.
    - `nonfinite_steps`: the steps with anything non-finite (with `allow_nonfinite`, all of
      them; otherwise the one it stopped at).
    """

    losses: list[float]
    model: lm.LM
    start: int
    curve: tuple[list[int], list[float]]
    first_step_seconds: float | None
    tokens_per_second: float | None
    router_stats: dict[str, float] = dataclasses.field(default_factory=dict)
    compile_seconds: float | None = None
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    last: dict[str, Any] = dataclasses.field(default_factory=dict)
    stopped: dict[str, Any] | None = None
    nonfinite_steps: list[int] = dataclasses.field(default_factory=list)


def training_flops_per_token(config: lm.LMConfig) -> float:
    """The model FLOPs of one token's forward and backward pass (3 x the forward's): the
    matmuls of the blocks (with experts, the `top_k` chosen ones and the router), the
    attention's scores and weighted sums over the whole sequence, and the head. Recomputation
    (`--remat`) and pipeline bubbles are not counted: model FLOPs utilisation is the work the
    model needs, over what the devices could do."""
    d, hidden = config.d_model, config.d_hidden
    if config.num_experts:
        mlp = 2 * d * hidden * config.top_k + d * config.num_experts
    else:
        mlp = 2 * d * hidden
    per_layer = 4 * d * d + mlp + 2 * config.seq_len * d
    forward = 2 * (config.num_layers * per_layer + d * config.vocab_size)
    return 3.0 * forward


# How long a process waits at start-up for the others to have compiled the step. Gloo, which
# connects CPU processes at their first collective, waits only 30 s for a peer (a limit JAX
# does not expose); a process that compiles faster than its peer would fail there.
COMPILED_BARRIER_SECONDS = 600


def wait_for_every_process(name: str, step: int) -> None:
    """Meet the other processes of a multi-process run (a no-op alone) at a barrier of JAX's
    coordination service (through orbax's public wrapper of it), which waits up to
    `COMPILED_BARRIER_SECONDS` and runs nothing on the devices; every process calls it with
    the same `name` and `step`."""
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    barrier = multihost.get_barrier_sync_fn()
    barrier(key=f"train_lm:{name}:{step}", timeout_ms=COMPILED_BARRIER_SECONDS * 1000)


def run_training(
    run: RunConfig,
    *,
    config: lm.LMConfig | None = None,
    devices: Sequence[Any] | None = None,
    progress: bool = True,
    log_every: int = 10,
    show_layout: bool = True,
    checkpoint: CheckpointOptions | None = None,
    metrics_file: pathlib.Path | None = None,
    tensorboard_dir: pathlib.Path | None = None,
    source: input_data.RowSource | None = None,
    example_log: input_data.ExampleLog | None = None,
    allow_nonfinite: bool = False,
    on_start: Callable[[int], Any] | None = None,
) -> Training:
    """Train until step `run.steps`, from step 0 or from the latest checkpoint.

    Messages (compiling, memory per device, checkpoints) go to the logger `metrics.LOGGER`;
    the numbers of every step to the writers of a `metrics.Recorder`.

    **Arguments:**

    - `run`: the mesh, schedule, sizes and optimizer.
    - `config`: the model's sizes (default `lm.LMConfig()`).
    - `devices`: the devices of the mesh (default all of JAX's).
    - `progress`: show the steps on the console: a progress bar when stdout is a terminal,
      otherwise a log line every `log_every` steps.
    - `show_layout`: print the layout table of the placed model first.
    - `checkpoint`: save the model, optimizer state and data position every `save_every`
      steps and at the end; `resume` starts from the latest good checkpoint. Stacked layers
      are stored in model order under every layout, so a checkpoint restores under any other
      mesh or schedule (`restore(..., reshape=True)` reshapes the stage stacks). Refused
      (`ConfigError`, before anything is built) where the directory does not fit:
      `check_checkpoint_start`. A step with anything not finite is never saved.
    - `metrics_file`: a JSONL file for a start-up record and one record per step (process 0
      writes it); default `metrics.jsonl` in the checkpoint directory when checkpointing,
      else none. A resumed run keeps the lines up to the restored step and goes on.
    - `tensorboard_dir`: TensorBoard event files of the same numbers (tensorboardX), or none.
    - `source`: where each step's rows come from (`data.PackedCorpus` for `--data`); by
      default the generated text of `lm.Batches`. Each process reads only the rows on its
      own devices (`data.place_rows`); the position, the global batches consumed, is the
      step.
    - `example_log`: write each step's example ids there (`--log-examples`).
    - `allow_nonfinite`: train on after a step whose loss, gradient norm or updated state is
      not finite (NaN or inf). By default the run stops after that step's record, without
      saving it, and `Training.stopped` says where.
    - `on_start`: called with the starting step once the run starts from it (after a
      resume's restore succeeded), before compiling (`main` writes `config.json` there).

    **Returns:** a `Training`: this call's losses, the final model, the whole loss curve, the
    compilation time and memory per device, and the first step's time and tokens per second
    after it (checkpoint writes not counted).
    """
    config = lm.LMConfig() if config is None else config
    check_sizes(config, run)
    checkpointer = None
    if checkpoint is not None:
        from eqpar.checkpoint import Checkpointer

        check_checkpoint_start(checkpoint, saved_steps(checkpoint.directory), run.steps)
        checkpointer = Checkpointer(
            checkpoint.directory, save_every=checkpoint.save_every, keep=checkpoint.keep
        )
        if metrics_file is None:
            metrics_file = pathlib.Path(checkpoint.directory) / METRICS_FILE
    try:
        log.info("building the model and placing it on the mesh...")
        mesh = make_mesh(run.mesh, devices)
        model = build_model(config, run, mesh)
        optimizer = make_optimizer(run)
        model, opt_state = place(model, optimizer, mesh, run.fsdp)
        start = 0
        if checkpointer is not None and checkpoint is not None and checkpoint.resume:
            target = {"model": model, "opt_state": opt_state, "position": 0}
            began = time.perf_counter()
            target.update(input_data.checkpoint_state(source))
            state = restore_checkpoint(checkpointer, target)
            model, opt_state, start = state["model"], state["opt_state"], int(state["position"])
            input_data.check_restored(state, source)
            log.info(
                f"resumed from step {checkpointer.restored_step} ({checkpoint.directory}, "
                f"restored in {time.perf_counter() - began:.1f} s)"
            )
        if on_start is not None:
            on_start(start)
    except BaseException:
        if checkpointer is not None:
            checkpointer.close()
        raise
    history: dict[int, float] = {}
    if start and metrics_file is not None:
        history = metrics.step_losses(metrics.read_records(metrics_file, upto=start))
        if len(history) < start:
            log.info(f"no losses of steps 1 to {start} in {metrics_file}: the loss curve "
                     f"starts after step {start}")  # fmt: skip
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
    writers: list[Any] = []
    if progress:
        writers.append(metrics.ConsoleWriter(run.steps, every=log_every, start=start))
    if jax.process_index() == 0:
        if metrics_file is not None:
            writers.append(metrics.JsonlWriter(metrics_file, keep_until=start or None))
        if tensorboard_dir is not None:
            writers.append(metrics.TensorBoardWriter(tensorboard_dir))
    recorder = metrics.Recorder(writers)
    losses: list[float] = []
    stats: dict[str, float] = {}
    last: dict[str, Any] = {}
    tokens_per_step = run.batch_size * config.seq_len
    learning_rate = learning_rate_schedule(run)
    device = mesh.jax_mesh.devices.flat[0]
    peak = metrics.peak_flops(device, run.precision)
    flops_per_token = training_flops_per_token(config)
    first_step_seconds: float | None = None
    tokens_per_second: float | None = None
    compile_seconds: float | None = None
    memory: dict[str, int] = {}
    timed_from = 0.0  # the end of the first step: what comes after runs compiled code only
    saving = 0.0  # seconds spent writing checkpoints since then, which tokens/s leaves out

    def so_far(position: int) -> dict[int, float]:
        return {**history, **dict(zip(range(start + 1, position + 1), losses))}

    skipped: list[int] = []  # steps whose non-finite state was not saved

    def save(position: int, *, force: bool, finite: bool) -> None:
        if checkpointer is None or checkpoint is None:
            return
        if not (force or checkpointer.should_save(position)):
            return
        if not finite:
            if not skipped:
                log.warning(
                    f"not saving step {position}: not finite (--allow-nonfinite trains on); "
                    f"the checkpoints in {checkpoint.directory} stay those of finite steps "
                    f"(latest: {checkpointer.latest_step()}), and later non-finite steps are "
                    "not saved either"
                )
            skipped.append(position)
            return
        began = time.perf_counter()
        state = {"model": model, "opt_state": opt_state, "position": position}
        state.update(input_data.checkpoint_state(source))
        if checkpointer.save(position, state, force=force):
            log.info(
                f"saved the checkpoint of step {position} in {checkpoint.directory} "
                f"({time.perf_counter() - began:.2f} s)"
            )
        else:
            steps = checkpointer.all_steps()
            why = (
                f"it already holds step {position} (a step is never overwritten)"
                if position in steps
                else f"it holds steps up to {max(steps)}, after it"
                if steps and max(steps) > position
                else "the checkpointer declined to write it"
            )
            log.warning(
                f"the checkpoint of step {position} was NOT saved in {checkpoint.directory}: {why}"
            )

    stopped: dict[str, Any] | None = None
    nonfinite_steps: list[int] = []

    try:
        if start < run.steps:
            tokens = input_data.place_rows(source, start, rows, width)
            log.info("compiling the training step...")
            began = time.perf_counter()
            compiled = step.lower(tokens, model, opt_state).compile()
            compile_seconds = time.perf_counter() - began
            memory = metrics.memory_figures(
                compiled, parameters=model, optimizer_state=opt_state, batch=tokens
            )
            log.info(f"compiled in {compile_seconds:.1f} s; {metrics.format_memory(memory)}")
            wait_for_every_process("compiled", start)
            note = metrics.utilisation_note(device, run.precision)
            if device.platform == "cpu":
                log.info(
                    "on simulated CPU devices tokens/s does not rank layouts (every device "
                    "shares the host's cores) and model FLOPs utilisation is not meaningful; "
                    "compare layouts by the memory figures"
                )
            elif note:
                log.info(f"model FLOPs utilisation: {note}")
            recorder.startup(
                {
                    "step": start,
                    "platform": device.platform,
                    "device_kind": str(device.device_kind),
                    "devices": mesh.jax_mesh.devices.size,
                    "compile_seconds": compile_seconds,
                    "memory": memory,
                    "model_flops_per_token": flops_per_token,
                    "peak_flops_per_device": peak,
                }
            )
        else:
            compiled, tokens = None, None
        for position in range(start, run.steps):
            began = time.perf_counter()
            if position > start:
                tokens = input_data.place_rows(source, position, rows, width)
            assert compiled is not None
            model, opt_state, loss, step_stats, grad_norm, state_finite = compiled(
                tokens, model, opt_state
            )
            losses.append(float(loss))  # waits for the step to finish
            if example_log is not None:
                example_log.write(position + 1, losses[-1], source, rows, width)
            stats = {name: float(value) for name, value in step_stats.items()}
            now = time.perf_counter()
            if first_step_seconds is None:
                first_step_seconds, timed_from = now - began, now
                if progress:
                    log.info(
                        f"step {position + 1} took {first_step_seconds:.2f} s; tokens/s count "
                        "from the next"
                    )
            else:
                training_seconds = now - timed_from - saving
                tokens_per_second = tokens_per_step * (position - start) / training_seconds
            utilisation = None
            if peak is not None and tokens_per_second is not None:
                utilisation = flops_per_token * tokens_per_second / (peak * mesh.jax_mesh.size)
            last = {
                "step": position + 1,
                "loss": losses[-1],
                "learning_rate": float(np.asarray(learning_rate(position))),
                "grad_norm": float(grad_norm),
                "tokens_per_second": tokens_per_second,
                "mfu": utilisation,
                "step_seconds": now - began,
                **stats,
            }
            # Fetched with the step's other figures: no further wait for the devices.
            nonfinite = [name for name, value in last.items()
                         if isinstance(value, float) and not math.isfinite(value)]  # fmt: skip
            if not bool(state_finite):
                nonfinite.append("state")
            if nonfinite:
                last["nonfinite"] = nonfinite
                nonfinite_steps.append(position + 1)
            recorder.step({**last, "extra": format_router_stats(stats)})
            if nonfinite and allow_nonfinite and len(nonfinite_steps) == 1:
                log.warning(
                    f"step {position + 1}: not finite: {', '.join(nonfinite)}; training on "
                    "(--allow-nonfinite), without saving non-finite steps"
                )
            if nonfinite and not allow_nonfinite:
                latest = None if checkpointer is None else checkpointer.latest_step()
                stopped = {
                    "step": position + 1,
                    "nonfinite": nonfinite,
                    "last_checkpoint": latest,
                    "message": nonfinite_message(position + 1, last, checkpoint, latest),
                }
                break
            save(position + 1, force=position + 1 == run.steps, finite=not nonfinite)
            saving += time.perf_counter() - now
    finally:
        recorder.close()
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
        compile_seconds=compile_seconds,
        memory=memory,
        last=last,
        stopped=stopped,
        nonfinite_steps=nonfinite_steps,
    )


def nonfinite_message(
    step: int,
    record: dict[str, Any],
    checkpoint: CheckpointOptions | None,
    latest: int | None,
) -> str:
    """Why a run stopped at `step`, whose `record` holds non-finite values (its
    `"nonfinite"` names them), and what is kept: the last checkpoint `latest` in
    `checkpoint`'s directory."""
    values = ", ".join(
        "the updated parameters or optimizer state"
        if name == "state"
        else f"{name.replace('_', ' ')} {record[name]}"
        for name in record["nonfinite"]
    )
    if checkpoint is None:
        kept = "nothing was saved (no --ckpt-dir)"
    elif latest is None:
        kept = f"no checkpoint was saved in {checkpoint.directory} before it"
    else:
        kept = (
            f"the last checkpoint, step {latest} in {checkpoint.directory}, is finite: resume "
            f"from it with --resume (e.g. with a smaller --lr)"
        )
    return (
        f"stopped at step {step}: not finite: {values}. The step was not saved; {kept}. "
        "Pass --allow-nonfinite to train on regardless (non-finite states are never saved)."
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
            DualPipeVSchedule,
            GPipeSchedule,
            OneFOneBSchedule,
            ZeroBubbleH1Schedule,
            ZeroBubbleVSchedule,
        )

        tables = {
            "1f1b": OneFOneBSchedule,
            "zb-h1": ZeroBubbleH1Schedule,
            "zb-v": ZeroBubbleVSchedule,
            "dualpipe-v": DualPipeVSchedule,
        }

        if run.schedule == "circular":
            schedule: Any = CircularSchedule(
                stages, run.microbatches, run.repeats, include_backward=True
            )
        elif run.schedule in OWN_BACKWARD:
            schedule = tables[run.schedule](stages, run.microbatches)
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
    """A count of at least 1 read from the command line (`ConfigError` saying what came)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A learning rate read from the command line: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or not np.isfinite(value):
        raise ConfigError(f"must be a number above 0, got {text!r}")
    return value


def _read_with(parse: Callable[[str], Any], metavar: str) -> Any:
    """How tyro reads an option of one word with `parse` (whose `ValueError` tyro reports
    with the option's name)."""
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar=metavar,
        instance_from_str=lambda words: parse(words[0]),
        is_instance=lambda value: isinstance(value, int | float),
        str_from_instance=lambda value: [str(value)],
    )


PositiveInt = Annotated[int, _read_with(positive_int, "N")]
PositiveFloat = Annotated[float, _read_with(positive_float, "FLOAT")]
Schedule = Literal["gpipe", "circular", "1f1b", "zb-h1", "zb-v", "dualpipe-v"]
Precision = Literal["float32", "bfloat16"]
assert typing.get_args(Schedule) == lm.SCHEDULES and typing.get_args(Precision) == lm.PRECISIONS


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every option of the command line (`main` parses it with tyro: `--batch-size` is
    `batch_size`). `save_config` writes it to a file and `--config FILE` reads it back, so
    a run is reproducible from the `config.json` it writes beside its outputs."""

    mesh: str | None = None
    """axis sizes whose product is the device count, e.g. data=2,pipe=2,model=2; missing
    axes are 1; a context axis (e.g. data=2,context=4) splits every sequence over its
    devices, by ring attention (--seq-len must divide by 2 x context); unset:
    data=2,pipe=2,model=2 on 8 devices, else data=<count>"""
    schedule: Schedule | None = None
    """pipeline schedule on the pipe axis (unset: gpipe); refused without a pipe axis"""
    microbatches: PositiveInt = 4
    """microbatches per step on the pipe axis; without one a step is not cut up"""
    accumulate: PositiveInt = 1
    """without a pipe axis: accumulate the step's gradients over this many slices of each
    device's rows (one slice's activations held at a time, the same update as the whole
    batch); with a pipe axis the pipeline cuts the batch into --microbatches instead"""
    repeats: PositiveInt = 2
    """stages per device (circular schedule; zb-v and dualpipe-v run 2)"""
    fsdp: bool = False
    """also shard parameters over data"""
    remat: Literal["none", "full", "matmuls"] = "none"
    """recompute each layer's activations in the backward pass: 'full' keeps only its input
    and 'matmuls' also its matmul outputs"""
    steps: PositiveInt = 120
    """training steps"""
    batch_size: PositiveInt = 16
    """sequences per step (global)"""
    lr: PositiveFloat = 3e-3
    """Adam's learning rate; plain SGD uses 30 times it"""
    optimizer: Literal["adam", "sgd"] | None = None
    """adam (with warmup and clipping), or plain SGD with momentum (unset: adam, and sgd
    with --check)"""
    experts: PositiveInt | None = None
    """a mixture of E experts in every block instead of its MLP (eqpar.nn.MixtureOfExperts,
    each expert the dense MLP's kind, dropless), with the load-balancing and router z
    auxiliary losses of every block added to the loss; an expert axis in --mesh (e.g.
    data=2,expert=4) splits the experts over its devices (the batch rows split over data and
    expert), a model axis each expert's hidden units; not with a pipe axis (unset: a dense
    MLP)"""
    top_k: PositiveInt | None = None
    """experts per token (with --experts; unset: 2); refused without --experts"""
    seed: int = 0
    """initialization and data order"""
    precision: Precision = "float32"
    """the compute dtype (eqpar.Precision): bfloat16 computes the forward and backward passes
    and their collectives in bfloat16, keeping float32 parameters, optimizer state, layer
    norms, softmax and loss"""
    check: bool = False
    """train the same steps again on one device with plain SGD under the same --precision
    and print PASS or FAIL: losses (relative) and parameters within 1e-05 (bfloat16: 3e-02);
    exit status 1 on FAIL"""
    allow_nonfinite: bool = False
    """train on after a step whose loss, gradient norm or updated parameters are not finite
    (NaN or inf); by default the run stops there with exit status 1, keeping the last finite
    checkpoint. A non-finite state is never saved either way"""
    size: Literal["small", "tiny"] = "small"
    """model size"""
    seq_len: PositiveInt | None = None
    """tokens per sequence (unset: the --size's: 32 for small, 16 for tiny)"""
    out: pathlib.Path = pathlib.Path("outputs")
    """where the loss curve and schedule pictures, config.json, tensorboard/ and (without
    a --ckpt-dir) metrics.jsonl go"""
    progress: bool = True
    """show the steps: a progress bar on a terminal, a log line every --log-every steps in a
    log (--no-progress: neither)"""
    log_every: PositiveInt = 10
    """when stdout is not a terminal (a log file, CI): a line every N steps instead of a
    progress bar"""
    json: pathlib.Path | None = None
    """write a summary (losses, timings, memory) here"""
    metrics: pathlib.Path | None = None
    """the JSONL file of a start-up record and one record per step (unset: metrics.jsonl
    in the --ckpt-dir, where a resumed run goes on with it, else in --out)"""
    tensorboard: bool = True
    """TensorBoard events in --out/tensorboard where tensorboardX is installed"""
    ckpt_dir: pathlib.Path | None = None
    """checkpoint directory (also gets config.json and metrics.jsonl); one that holds
    another run's steps needs --resume"""
    save_every: PositiveInt = 20
    """checkpoint every N steps"""
    keep: PositiveInt = 3
    """checkpoints to keep"""
    resume: bool = False
    """continue from the latest checkpoint in --ckpt-dir (refused where there is none, or
    where its config.json records another --size, --seq-len, --experts, --top-k,
    --optimizer or --data)"""
    config: pathlib.Path | None = None
    """read the options from this file (a config.json written by a run); options given
    beside it override the file's"""
    processes: PositiveInt = 1
    """run as N processes on this machine (127.0.0.1), each with 8/N simulated CPU devices
    (EQPAR_NUM_CPU_DEVICES sets another count), started and watched by examples/launch.py,
    their lines prefixed [p<id>]; inside a job, its process count"""
    distributed: bool = False
    """join a multi-process job started by SLURM, mpirun or by hand: eqpar.initialize()
    reads EQPAR_COORDINATOR_ADDRESS, EQPAR_NUM_PROCESSES and EQPAR_PROCESS_ID, or else
    JAX's cluster detection (implied when those variables are set)"""
    timeout: PositiveFloat = 3600.0
    """with --processes: seconds each process may run before it is killed"""
    verbose: bool = False
    """with --processes: also show JAX's and Gloo's start-up chatter"""
    data: pathlib.Path | None = None
    """train on the tokenized corpus in this directory (ArrayRecord files read with Grain,
    each process reading only its own rows; write the demo corpus with python
    examples/data.py DIR --vocab-size V) instead of generated text"""
    log_examples: pathlib.Path | None = None
    """append each step's loss and example ids to DIR/process<P>.jsonl"""

    def validate(self, device_count: int) -> None:
        """Refuse options that do not go together (`ConfigError` naming them and the fix);
        sizes the mesh cannot split are `check_sizes`'s."""
        if self.resume and self.ckpt_dir is None:
            raise ConfigError("--resume needs --ckpt-dir DIR (the directory to resume from)")
        if self.top_k is not None and self.experts is None:
            raise ConfigError(
                f"--top-k {self.top_k} chooses among the experts of --experts, and there is no "
                f"--experts: add --experts E (E at least {self.top_k}) for a mixture of "
                "experts, or leave --top-k out"
            )
        if self.check and self.optimizer == "adam":
            # A config.json names the optimizer its run resolved: it cannot be left out there.
            fix = (
                f"pass --optimizer sgd (--config {self.config} says adam)"
                if self.config is not None
                else "leave out --optimizer adam (--check then trains with sgd)"
            )
            raise ConfigError(
                f"--check compares with one device within {CHECK_TOLERANCE:.0e}, which holds "
                "for plain SGD only: Adam turns float32 rounding differences into full-size "
                f"updates. To check, {fix}."
            )
        mesh = parse_mesh(self.mesh or default_mesh(device_count), device_count)
        if self.accumulate > 1 and mesh[lm.PIPE] > 1:
            raise ConfigError(
                f"--accumulate {self.accumulate} cuts a step without a pipe axis; --mesh "
                f"{self.mesh or format_mesh(mesh)} has one, whose pipeline already cuts the "
                f"batch into --microbatches ({self.microbatches}): use --microbatches "
                f"{self.microbatches * self.accumulate} instead, or drop the pipe axis"
            )
        if self.schedule is not None and mesh[lm.PIPE] == 1:
            example = f" (e.g. --mesh data={device_count // 2},pipe=2)" * (device_count % 2 == 0)
            raise ConfigError(
                f"--schedule {self.schedule} needs a pipe axis in --mesh: without one every "
                f"device holds every layer and there is no pipeline to schedule; add a pipe "
                f"axis{example} or leave --schedule out"
            )

    def resolved(self, device_count: int) -> "TrainConfig":
        """The options with every unset one that the run fills in filled in as it is (mesh,
        schedule, optimizer, sequence length), so that a saved file says what ran."""
        mesh = parse_mesh(self.mesh or default_mesh(device_count), device_count)
        return dataclasses.replace(
            self,
            mesh=format_mesh(mesh),
            schedule=self.schedule or ("gpipe" if mesh[lm.PIPE] > 1 else None),
            optimizer=self.optimizer or ("sgd" if self.check else "adam"),
            seq_len=self.seq_len or SIZES[self.size].seq_len,
            top_k=self.top_k or (DEFAULT_TOP_K if self.experts is not None else None),
        )

    def run_config(self, device_count: int) -> RunConfig:
        """The `RunConfig` of these options."""
        options = self.resolved(device_count)
        assert options.mesh is not None and options.optimizer is not None
        return RunConfig(
            mesh=parse_mesh(options.mesh, device_count),
            schedule=options.schedule or "gpipe",
            microbatches=options.microbatches,
            accumulate=options.accumulate,
            repeats=options.repeats,
            fsdp=options.fsdp,
            remat=options.remat,
            steps=options.steps,
            batch_size=options.batch_size,
            lr=options.lr,
            optimizer=options.optimizer,
            seed=options.seed,
            precision=options.precision,
        )

    def model_config(self) -> lm.LMConfig:
        """The model's sizes: the `--size`'s, with `--seq-len` and `--experts` applied."""
        config = SIZES[self.size]
        if self.seq_len is not None:
            config = dataclasses.replace(config, seq_len=self.seq_len)
        if self.experts is not None:
            top_k = DEFAULT_TOP_K if self.top_k is None else self.top_k
            config = dataclasses.replace(config, num_experts=self.experts, top_k=top_k)
        return config


DEFAULT_TOP_K = 2  # experts per token of --experts without --top-k


def default_mesh(device_count: int) -> str:
    """The mesh of a run without `--mesh`: 3D on 8 devices, else all data."""
    return "data=2,pipe=2,model=2" if device_count == 8 else f"data={device_count}"


CONFIG_FILE = "config.json"  # what a run writes into --out and --ckpt-dir
# How to read the file, whether to resume and how to join a job: not what runs.
_NOT_SAVED = ("config", "resume", "distributed")


def save_config(options: TrainConfig, path: pathlib.Path) -> pathlib.Path:
    """Write `options` to `path` as JSON (through a rename, so never half written); `--config
    path` reads it back. `resume` and `config` are left out: a file says what to run.

    **Returns:** `path`."""
    values = {
        field.name: getattr(options, field.name)
        for field in dataclasses.fields(options)
        if field.name not in _NOT_SAVED
    }
    text = json.dumps(
        {name: str(v) if isinstance(v, pathlib.Path) else v for name, v in values.items()},
        indent=2,
    )
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text + "\n")
    os.replace(partial, path)
    return path


def config_arguments(path: pathlib.Path) -> list[str]:
    """The options saved in `path` as the command line they stand for (`--steps 20 --fsdp
    ...`), so that tyro reads a file's values as it reads typed ones. Each value is first
    checked against its option's type (`ConfigError` naming the file, the entry and the
    option)."""
    try:
        saved = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--config {path}: cannot read it ({error})") from None
    known = {field.name for field in dataclasses.fields(TrainConfig)} - set(_NOT_SAVED)
    if not isinstance(saved, dict) or set(saved) - known:
        unknown = sorted(set(saved) - known) if isinstance(saved, dict) else saved
        raise ConfigError(
            f"--config {path}: expected a JSON object of the options {sorted(known)} (the "
            f"config.json a run writes); got {unknown!r}"
        )
    if saved.get("experts") is None and saved.get("top_k") == DEFAULT_TOP_K:
        del saved["top_k"]  # written before --top-k was refused without --experts: its default
    hints = typing.get_type_hints(TrainConfig, include_extras=True)
    problems = [
        f'"{name}": {json.dumps(value)} is not {expected} (for {_flag(name)})'
        for name, value in saved.items()
        if (expected := _not_a(value, hints[name])) is not None
    ]
    if problems:
        raise ConfigError(f"--config {path}: " + "; ".join(problems))
    words: list[str] = []
    for name, value in saved.items():
        if isinstance(value, bool):
            words.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        else:
            words += [_flag(name), "None" if value is None else str(value)]
    return words


def _flag(name: str) -> str:
    """The command-line flag of the option `name` (`batch_size` -> `--batch-size`)."""
    return "--" + name.replace("_", "-")


def _not_a(value: Any, hint: Any) -> str | None:
    """What a JSON `value` is not, for an option of type `hint` (e.g. `"a bool (true or
    false)"`), or `None` where it fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (rest,) = [arg for arg in args if arg is not type(None)]
        return _not_a(value, rest)
    if value is None:
        return "a value (null is not allowed here)"
    if origin is Annotated:  # PositiveInt, PositiveFloat
        base = args[0]
        if isinstance(value, bool) or not isinstance(value, int if base is int else int | float):
            return "a positive integer" if base is int else "a number above 0"
        parse = positive_int if base is int else positive_float
        try:
            parse(str(value))
        except ConfigError:
            return "a positive integer" if base is int else "a number above 0"
        return None
    if origin is Literal:
        return None if value in args else "one of " + ", ".join(json.dumps(a) for a in args)
    if hint is bool:
        return None if isinstance(value, bool) else "a bool (true or false)"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint in (str, pathlib.Path):
        return None if isinstance(value, str) else "a string"
    return None


def parse_options(argv: Sequence[str] | None, device_count: int | None = None) -> TrainConfig:
    """The options of the command line `argv` (default `sys.argv[1:]`): with `--config FILE`,
    the file's options first, then `argv`'s over them; with `device_count`, validated
    (`TrainConfig.validate`). A usage error exits with status 2 and the reason on stderr
    after `train_lm.py: error:`, as argparse's do. Without `device_count` it touches no
    device (`main`: a launcher starts its processes, and a process joins its job, before JAX
    picks its devices)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with _usage_errors():
        options = _read_options(argv)
        if options.config is not None:
            words = [*config_arguments(options.config), *argv]
            try:
                options = _read_options(words)
            except ConfigError as error:  # `argv` alone was fine: the file's values are not
                raise ConfigError(f"--config {options.config}: {error}") from None
        if device_count is not None:
            options.validate(device_count)
    return options


_PROG = "train_lm.py"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours, where tyro writes to a terminal


def _read_options(words: list[str]) -> TrainConfig:
    """`TrainConfig` from the command line `words` through tyro; its parse errors as one
    `ConfigError` (tyro draws them in a box on stderr: its text, unboxed, becomes the
    message, with a hint where a flag was given a value)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            options = tyro.cli(TrainConfig, args=words, prog=_PROG, description=__doc__)
    except SystemExit as exit_:
        if exit_.code in (0, None):  # --help
            raise
        raise ConfigError(_unboxed(captured.getvalue(), words)) from None
    sys.stderr.write(captured.getvalue())  # tyro's warnings, if any
    return options


def _unboxed(text: str, words: list[str]) -> str:
    """tyro's error box `text` as plain lines: its first part (the error) on one line, the
    rest (help on the option) indented below. tyro draws the box with UTF-8 characters where
    stdout's encoding is UTF-8, else with a title line and dashes."""
    lines = [line for line in (_ANSI.sub("", raw).rstrip() for raw in text.splitlines()) if line]
    if lines and not lines[0].lstrip().startswith("╭"):
        lines = lines[1:]  # the title, on a line of its own
    parts: list[list[str]] = [[]]
    for line in lines:
        inner = line.strip()
        if inner[:1] in ("╭", "╰"):  # the top edge (with the title) and the bottom edge
            continue
        if inner.startswith("│") and inner.endswith("│"):
            line = inner[1:-1].rstrip()
        if set(line.strip()) <= {"─", "-"}:  # a rule between parts
            parts.append([])
        else:
            parts[-1].append(line)
    indent = min((len(line) - len(line.lstrip()) for part in parts for line in part), default=0)
    parts = [[line[indent:] for line in part] for part in parts]
    parts = [part for part in parts if part]
    if not parts:
        return f"cannot read the options {' '.join(words)!r}"
    message = " ".join(line.strip() for line in parts[0])
    if message.startswith("Unrecognized options:"):
        flags = {_flag(f.name) for f in dataclasses.fields(TrainConfig) if f.type is bool}
        given = [w for w, after in itertools.pairwise(words) if w in flags and after[:2] != "--"]
        message += "".join(f"; {flag} takes no value: write {flag} or --no-{flag[2:]}"
                           for flag in given)  # fmt: skip
    rest = [f"  {line}" for part in parts[1:] for line in part]
    return "\n".join([message, *rest])


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """A `ConfigError` or `data.DataError` inside exits with status 2 and the reason on
    stderr, after `train_lm.py: error:` (every refusal of the example's options)."""
    try:
        yield
    except (ConfigError, input_data.DataError) as error:
        print(f"{_PROG}: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def first_step_parity(
    run: RunConfig, config: lm.LMConfig, source: input_data.RowSource | None = None
) -> eqpar.CheckReport:
    """`eqpar.check` on the first step: the gradients of the run's own step on its mesh
    against the same step on one device, leaf by leaf (in model order, `lm.model_order`),
    from the same initial parameters and the first batch. On a mismatch the report names the
    leaves; the curves of `check_against_one_device` then say how far it carries."""
    devices = jax.devices()[: math.prod(run.mesh.values())]
    mesh = make_mesh(run.mesh, devices)
    serial_run = dataclasses.replace(run, mesh={lm.DATA: 1, lm.PIPE: 1, lm.MODEL: 1}, fsdp=False)
    serial_mesh = make_mesh(serial_run.mesh, jax.devices()[:1])
    model = build_model(config, run, mesh)
    model = eqx.filter_shard(
        model, eqpar.named_shardings(storage_specs(model, mesh, run.fsdp), mesh)
    )
    serial = build_model(config, serial_run, serial_mesh)
    if source is None:
        corpus = lm.encode(lm.make_corpus(200_000, seed=run.seed), config.vocab_size)
        source = input_data.SyntheticRows(
            lm.Batches(corpus, batch_size=run.batch_size, seq_len=config.seq_len, seed=run.seed)
        )
    rows = NamedSharding(serial_mesh.jax_mesh, P())
    tokens = np.asarray(input_data.place_rows(source, 0, rows, config.seq_len + 1))

    def as_step(loss_and_grads: Any) -> Any:
        @eqx.filter_jit
        def step(model: lm.LM, tokens: jax.Array) -> tuple[jax.Array, lm.LM]:
            (loss, _), grads = loss_and_grads(model, tokens)
            return loss, lm.model_order(grads)

        return step

    return eqpar.check(
        global_loss,
        model,
        tokens,
        mesh=mesh,
        batch_specs=row_spec(mesh.axis_names),
        step=as_step(build_loss_and_grads(model, mesh, run)),
        serial=serial,
        serial_step=as_step(build_loss_and_grads(serial, serial_mesh, serial_run)),
        rtol=check_tolerance(run.precision),
        raise_on_mismatch=False,
    )


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
    parity = None
    if jax.process_count() == 1:  # eqpar.check places both runs from one process
        log.info("check: the first step's gradients on the mesh and on one device (eqpar.check)")
        parity = first_step_parity(run, config, source)
        log.info(f"{parity}")
    log.info(f"check: the same {run.steps} steps on one device (compiling...)")
    tolerance = check_tolerance(run.precision)
    serial_run = dataclasses.replace(run, mesh={lm.DATA: 1, lm.PIPE: 1, lm.MODEL: 1}, fsdp=False)
    level = log.level
    log.setLevel(logging.WARNING)  # the serial run's own messages would read as the run's
    try:
        serial = run_training(
            serial_run,
            config=config,
            devices=jax.local_devices()[:1],
            progress=False,
            show_layout=False,
            source=source,
        )
    finally:
        log.setLevel(level)
    serial_losses = serial.losses[training.start :]  # the steps this process ran
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(training.losses, serial_losses))
    param_diff = largest_differences(trained, serial.model)
    passed = loss_diff <= tolerance and param_diff <= tolerance and (parity is None or parity.ok)
    log.info(
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
        **(
            {}
            if parity is None
            else {
                "first_step": {
                    "passed": parity.ok,
                    "leaves": len(parity.leaves),
                    "largest_difference": max(leaf.difference for leaf in parity.leaves),
                    "mismatches": [leaf.path for leaf in parity.mismatches],
                }
            }
        ),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the command line `argv` (default `sys.argv[1:]`; see `TrainConfig` for the
    options); returns the summary that `--json` writes (with `--processes N` outside a job,
    the launcher's exit status). Every refusal of the options, the data or the checkpoint
    directory prints `train_lm.py: error: ...` on stderr and exits with status 2."""
    options = parse_options(argv)
    if options.processes > 1 and not (launch.in_job() or options.distributed):
        command = list(sys.argv[1:] if argv is None else argv)  # start them here
        status = launch.launch_command(
            command, options.processes, timeout=options.timeout, verbose=options.verbose,
            script=__file__,
        )  # fmt: skip
        return {"processes": options.processes, "exit_status": status}
    if options.distributed or launch.in_job():
        launch.join()
    count = jax.device_count()
    with _usage_errors():
        if options.processes > 1 and options.processes != jax.process_count():
            raise ConfigError(
                f"--processes {options.processes}: this job has {jax.process_count()}"
            )
        options.validate(count)
        run, config = options.run_config(count), options.model_config()
        check_sizes(config, run)  # before any output: a usage error comes first
        options = options.resolved(count)
        if options.ckpt_dir is not None:
            checkpoint = CheckpointOptions(
                options.ckpt_dir, options.save_every, options.keep, options.resume
            )
            check_checkpoint_start(checkpoint, saved_steps(options.ckpt_dir), run.steps)
            if options.resume:
                check_recorded_options(options)
    with metrics.console_logging(), _usage_errors():
        return _main(options, run, config)


def _main(options: TrainConfig, run: RunConfig, config: lm.LMConfig) -> dict[str, Any]:
    """`main` after the options are parsed and checked, with messages on the console."""
    first = jax.process_index() == 0  # writes the files and pictures, runs --check
    checkpoint = None
    if options.ckpt_dir is not None:
        checkpoint = CheckpointOptions(
            options.ckpt_dir, options.save_every, options.keep, options.resume
        )
    source = None if options.data is None else open_data(options.data, config, run)
    example_log = None
    if options.log_examples is not None:
        example_log = input_data.ExampleLog(options.log_examples)
    platform = jax.devices()[0].platform
    experts = f"; {config.num_experts} experts, top {config.top_k}" if config.num_experts else ""
    processes = jax.process_count()
    job, here = "", ""
    if processes > 1:
        job = f"process {jax.process_index()} of {processes}: "
        here = f" ({jax.local_device_count()} here)"
    data = "" if options.data is None else f"; data {options.data}"
    log.info(
        f"{job}{jax.device_count()} {platform} devices{here}; {describe(run)}{experts}; "
        f"optimizer {run.optimizer}{data}"
    )
    metrics_file = options.metrics or (options.ckpt_dir or options.out) / METRICS_FILE
    tensorboard_dir = None
    if options.tensorboard and metrics.tensorboard_available():
        tensorboard_dir = options.out / "tensorboard"
    if first and tensorboard_dir is None and options.tensorboard:
        log.info('no TensorBoard events: tensorboardX is not installed (pip install -e '
                 '".[tensorboard]")')  # fmt: skip

    def write_configs(start: int) -> None:
        # Once the run starts from what the files will say: a resume that fails (another
        # model, a damaged checkpoint) leaves the checkpoint's record as it was.
        if first:
            for directory in (options.out, options.ckpt_dir):
                if directory is not None:
                    log.info(f"wrote {save_config(options, directory / CONFIG_FILE)}")

    started = time.perf_counter()
    training = run_training(
        run,
        config=config,
        progress=options.progress,
        log_every=options.log_every,
        show_layout=first,
        checkpoint=checkpoint,
        metrics_file=metrics_file,
        tensorboard_dir=tensorboard_dir,
        source=source,
        example_log=example_log,
        allow_nonfinite=options.allow_nonfinite,
        on_start=write_configs,
    )
    losses, model = training.losses, training.model
    trained = host_parameters(model)
    seconds = time.perf_counter() - started
    steps, curve = training.curve
    summary: dict[str, Any] = {
        "losses": losses,
        "seconds": seconds,
        "compile_seconds": training.compile_seconds,
        "first_step_seconds": training.first_step_seconds,
        "tokens_per_second": training.tokens_per_second,
        "memory": training.memory,
        "last_step": training.last,
        "mesh": run.mesh,
        "curve": {"steps": steps, "losses": curve},
        "parameter_digest": parameter_digest(trained),
        "router_stats": training.router_stats,
        "metrics_file": str(metrics_file),
        "tensorboard_dir": None if tensorboard_dir is None else str(tensorboard_dir),
        "config": json.loads(json.dumps(dataclasses.asdict(options), default=str)),
        "nonfinite_steps": training.nonfinite_steps,
    }
    if training.stopped is not None:
        summary["stopped"] = {k: v for k, v in training.stopped.items() if k != "message"}
    if options.json and first:
        options.json.parent.mkdir(parents=True, exist_ok=True)
    if not losses:
        log.info(f"nothing to do: already at step {run.steps}")
        if options.json and first:
            options.json.write_text(metrics.strict_json(summary))
        return summary
    rate = training.tokens_per_second
    after = "" if rate is None else f"; {rate:.0f} tokens/s after the first step"
    log.info(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} step"
        f"{'' if len(losses) == 1 else 's'} ({seconds:.1f} s, compiling "
        f"{training.compile_seconds:.1f} s{after})"
    )
    if training.nonfinite_steps and training.stopped is None:
        log.warning(
            f"{len(training.nonfinite_steps)} steps were not finite (from step "
            f"{training.nonfinite_steps[0]}; --allow-nonfinite), none of them saved"
        )
    if training.router_stats:
        log.info(f"experts at the last step: {format_router_stats(training.router_stats)}")
    if first:
        for path in write_pictures(curve, run, options.out, steps=steps, resumed_at=training.start):
            log.info(f"wrote {path}")
        log.info(f"metrics of every step in {metrics_file}")
    if training.stopped is not None:
        log.error(training.stopped["message"])
    elif options.check:
        summary["check"] = check_against_one_device(
            run, config, training, source=source, trained=trained
        )
    if options.json and first:
        options.json.write_text(metrics.strict_json(summary))
    return summary


def open_data(directory: pathlib.Path, config: lm.LMConfig, run: RunConfig) -> Any:
    """The `--data` corpus as the rows of `run`'s batches; refused where its tokens do not
    fit the model's vocabulary."""
    corpus = input_data.open_corpus(directory)
    if corpus.vocab_size > config.vocab_size:
        raise ConfigError(
            f"--data {directory}: its vocabulary has {corpus.vocab_size} tokens, the model's "
            f"{config.vocab_size}: choose a --size with at least {corpus.vocab_size} or write "
            f"the corpus with --vocab-size {config.vocab_size}."
        )
    return input_data.PackedCorpus(
        corpus, batch_size=run.batch_size, seq_len=config.seq_len, seed=run.seed
    )


def exit_status(argv: Sequence[str] | None = None) -> int:
    """The command's exit status: 1 on a failed `--check` or a run stopped on a non-finite
    step (so that scripts and CI notice), the launcher's with `--processes`, 2 on a refusal
    of the options (`SystemExit`), else 0."""
    summary = main(argv)
    if "exit_status" in summary:
        return summary["exit_status"]
    if "stopped" in summary:
        return 1
    return 0 if summary.get("check", {}).get("passed", True) else 1


if __name__ == "__main__":
    distributed = launch.in_job() or "--distributed" in sys.argv
    sys.exit(launch.exit_status(exit_status, distributed=distributed))
