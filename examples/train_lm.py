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

import dataclasses
import json
import logging
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import data as input_data
import launch
import lm
import metrics
import train_options
import train_plan
from train_options import (
    CONFIG_FILE,
    ConfigError,
    RunConfig,
    TrainConfig,
    _flag,
    _usage_errors,
    parse_options,
    save_config,
)
from train_steps import (
    OWN_BACKWARD,
    build_loss_and_grads,
    build_model,
    build_step,
    check_sizes,
    check_tolerance,
    describe,
    global_loss,
    learning_rate_schedule,
    make_mesh,
    make_optimizer,
    open_data,
    place,
    row_spec,
    storage_specs,
    training_flops_per_token,
)

import eqpar
from eqpar.inspect import print_layout_table

log = logging.getLogger(metrics.LOGGER)
train_options.DESCRIPTION = __doc__  # `--help` shows this script's docstring


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
        if options.plan == "auto":  # before the run is laid out: it chooses the layout
            options, table = train_plan.choose(options, count, options.memory_bytes() or 0)
            print(f"--plan auto chose {train_plan.label(options)}:\n{table}")
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
    if options.dry_run:
        with _usage_errors():
            return train_plan.dry_run(options, run, config, count)
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
