"""How `examples/train_lm.py` lays out a run and builds its step: the mesh and the checks of
the sizes against it, the model built and placed by the plan the run asks for, the loss and
gradients (through `eqpar.shard_map`, a pipeline schedule that runs its own backward, or
accumulation over microbatches), the optimizer and the jitted step. `train_lm.py` imports
them; they live here so that the training script stays one concern."""

import functools
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

import eqpar
from eqpar.context import balance_sequence, sequence_positions
from eqpar.distributions import match_param_specs
from eqpar.nn import PipelineModule
from eqpar.spmd import gather_stored

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import data as input_data
import lm
from train_options import (
    AXES,
    CHECK_TOLERANCE,
    CHECK_TOLERANCE_BFLOAT16,
    OPTIONAL_AXES,
    ConfigError,
    RunConfig,
    format_mesh,
)


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
