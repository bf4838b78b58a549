"""Train a small language model with data x pipeline x tensor parallelism (and optional FSDP).

    python examples/train_lm.py                                  # 8 simulated CPU devices
    python examples/train_lm.py --mesh data=2,pipe=2,model=2 --schedule 1f1b
    python examples/train_lm.py --mesh data=8 --fsdp --check     # compare with one device
    python examples/train_lm.py --ckpt-dir /tmp/ckpt --resume    # continue from the latest

On CPU, 8 devices are simulated; on accelerators the device count comes from JAX. Any mesh
whose product is the device count works, 1 device included. Outputs (loss curve, pipeline
schedule) go to `--out` (default `outputs/`).
"""

import argparse
import dataclasses
import json
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
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import lm

import eqpar
from eqpar.distributions import match_param_specs
from eqpar.inspect import print_layout_table
from eqpar.nn import PipelineModule


@dataclasses.dataclass(frozen=True)
class RunConfig:
    mesh: dict[str, int]
    schedule: str = "gpipe"
    microbatches: int = 4
    repeats: int = 2
    fsdp: bool = False
    remat: str = "none"  # what each layer keeps for the backward pass: none, full, matmuls
    steps: int = 120
    batch_size: int = 16
    lr: float = 3e-3
    optimizer: str = "adam"
    seed: int = 0


def parse_mesh(text: str, device_count: int) -> dict[str, int]:
    """`data=2,pipe=2,model=2` -> sizes of all three axes (missing ones are 1)."""
    sizes = {lm.DATA: 1, lm.PIPE: 1, lm.MODEL: 1}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise SystemExit(
                f"--mesh: expected entries like data=2,pipe=2,model=2 with axes "
                f"{sorted(sizes)}; got {part!r}."
            )
        sizes[name] = int(value)
    product = int(np.prod(list(sizes.values())))
    if product != device_count:
        raise SystemExit(
            f"--mesh {text}: the axis sizes multiply to {product} but there are "
            f"{device_count} devices; choose sizes whose product is {device_count}."
        )
    return sizes


def make_mesh(sizes: dict[str, int], devices: Sequence[Any] | None = None) -> eqpar.DeviceMesh:
    shape = (sizes[lm.DATA], sizes[lm.PIPE], sizes[lm.MODEL])
    chosen = list(jax.devices() if devices is None else devices)[: int(np.prod(shape))]
    return eqpar.DeviceMesh(shape, (lm.DATA, lm.PIPE, lm.MODEL), devices=chosen)


def check_sizes(config: lm.LMConfig, run: RunConfig) -> None:
    pipe, model, data = run.mesh[lm.PIPE], run.mesh[lm.MODEL], run.mesh[lm.DATA]
    repeats = run.repeats if run.schedule == "circular" else 1
    problems = []
    if config.num_layers % (pipe * repeats):
        problems.append(
            f"num_layers={config.num_layers} must divide by pipe x repeats = {pipe * repeats}"
        )
    split_over_model = (
        ("num_heads", config.num_heads),
        ("d_hidden", config.d_hidden),
        ("vocab_size", config.vocab_size),
    )
    for name, size in split_over_model:
        if size % model:
            problems.append(f"{name}={size} must divide by model={model}")
    if run.batch_size % (data * run.microbatches):
        problems.append(
            f"batch_size={run.batch_size} must divide by data x microbatches = "
            f"{data * run.microbatches}"
        )
    if problems:
        raise SystemExit("invalid sizes: " + "; ".join(problems))


def build_model(config: lm.LMConfig, run: RunConfig, mesh: eqpar.DeviceMesh) -> lm.LM:
    """The example's model for `mesh`, parallelized by `lm.PLAN` (same parameters on any mesh).

    With `--fsdp` the block stack also gathers its parameters over `data` one layer at a time
    (`eqpar.nn.gather_layers`); the embeddings and the head are split by `eqpar.FSDP` and
    gathered at the `shard_map` boundary."""
    repeats = run.repeats if run.schedule == "circular" and run.mesh[lm.PIPE] > 1 else 1
    model = lm.build(
        config,
        mesh,
        num_microbatches=run.microbatches,
        num_repeats=repeats,
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
    return lax.pmean(model.loss(tokens), lm.DATA)


def loss_and_grads_1f1b(model: lm.LM, tokens: Int[Array, "batch seq1"]) -> tuple[Array, lm.LM]:
    """Loss and gradients inside `shard_map` with the 1F1B schedule.

    The pipeline runs its own backward pass, so the embedding's pullback is applied to the
    gradient it returns for its input.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h, embed_vjp = eqx.filter_vjp(
        lambda e: eqx.tree_at(lambda m: (m.embed, m.position), model, e).embed_tokens(inputs),
        (model.embed, model.position),
    )
    assert isinstance(model.body, PipelineModule), "1F1B runs the model of lm.build"
    loss, (body_grads, head_grads, h_grads) = model.body.value_and_grad_1f1b(
        model.head, h, targets, return_all_grads=True
    )
    (embed_grads,) = embed_vjp(h_grads)
    grads = eqx.tree_at(
        lambda m: (m.embed, m.position, m.body, m.norm, m.unembed),
        eqx.filter(model, eqx.is_inexact_array),
        (*embed_grads, body_grads, head_grads.norm, head_grads.unembed),
    )
    # This is the one place gradients come from each shard's own loss: those of parameters
    # replicated over `data` arrive summed over it, so divide by its size for the mean.
    data_shards = lax.axis_size(lm.DATA)
    return lax.pmean(loss, lm.DATA), jax.tree.map(lambda g: g / data_shards, grads)


def build_step(model: lm.LM, mesh: eqpar.DeviceMesh, run: RunConfig, optimizer: Any) -> Any:
    specs = eqpar.partition_specs(model)  # what shard_map's body sees (no FSDP split)
    batch_spec = P(lm.DATA)
    if run.schedule == "1f1b":
        loss_and_grads = eqpar.shard_map(
            loss_and_grads_1f1b, mesh=mesh, in_specs=(specs, batch_spec), out_specs=(P(), specs)
        )
    else:
        loss = eqpar.shard_map(global_loss, mesh=mesh, in_specs=(specs, batch_spec), out_specs=P())
        loss_and_grads = eqx.filter_value_and_grad(loss)

    param_specs = storage_specs(model, mesh, run.fsdp)
    param_shardings = eqpar.named_shardings(param_specs, mesh)

    @eqx.filter_jit(donate="all-except-first")
    def step(tokens: jax.Array, model: lm.LM, opt_state: Any) -> tuple[lm.LM, Any, jax.Array]:
        loss, grads = loss_and_grads(model, tokens)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        model = eqx.filter_shard(model, param_shardings)
        opt_state = eqx.filter_shard(
            opt_state, eqpar.named_shardings(match_param_specs(opt_state, model, param_specs), mesh)
        )
        return model, opt_state, loss

    return step


def place(model: lm.LM, optimizer: Any, mesh: eqpar.DeviceMesh, fsdp: bool) -> tuple[lm.LM, Any]:
    """The model and a fresh optimizer state, each leaf sharded as its parameter's layout."""
    specs = storage_specs(model, mesh, fsdp)
    model = eqx.filter_shard(model, eqpar.named_shardings(specs, mesh))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    opt_specs = match_param_specs(opt_state, model, specs)
    return model, eqx.filter_shard(opt_state, eqpar.named_shardings(opt_specs, mesh))


def make_optimizer(run: RunConfig) -> Any:
    """Adam by default; SGD with momentum (`--optimizer sgd`) for the tests' comparisons: Adam
    divides by the gradient's running magnitude, which hides a gradient that is `n` times too
    large and turns rounding noise in a gradient that is zero in exact arithmetic into a
    full-size update."""
    warmup = optax.linear_schedule(0.0, run.lr, transition_steps=10)
    if run.optimizer == "adam":
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(warmup))
    if run.optimizer == "sgd":
        return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(30 * run.lr, momentum=0.9))
    raise SystemExit(f"--optimizer must be adam or sgd; got {run.optimizer!r}")


def place_global_batch(batches: lm.Batches, position: int, mesh: eqpar.DeviceMesh) -> jax.Array:
    """The whole batch at `position` as one array split over the data axis (one process)."""
    return jax.device_put(batches.batch(position), NamedSharding(mesh.jax_mesh, P(lm.DATA)))


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often to checkpoint; `resume` continues from the latest good step."""

    directory: pathlib.Path
    save_every: int = 10
    keep: int = 3
    resume: bool = False


def train(
    run: RunConfig,
    *,
    config: lm.LMConfig | None = None,
    devices: Sequence[Any] | None = None,
    progress: bool = True,
    show_layout: bool = True,
    place_batch: Callable[[lm.Batches, int, eqpar.DeviceMesh], jax.Array] = place_global_batch,
    checkpoint: CheckpointOptions | None = None,
) -> tuple[list[float], lm.LM]:
    """Train until step `run.steps`; returns the losses of the steps run here and the final
    model as trained (`lm.model_order` gives its serial form, the same for every layout).

    `place_batch(batches, position, mesh)` gives the global token array of a step; with
    several processes each one feeds its own rows (see `multihost.py`). With `checkpoint`,
    the model, optimizer state and data position are saved every `save_every` steps and at
    the end, and `resume` starts from the latest good checkpoint. Stacked layers are stored
    in model order under every layout, so a checkpoint restores under any other mesh or
    schedule (`restore(..., reshape=True)` reshapes the stage stacks).
    """
    config = lm.LMConfig() if config is None else config
    check_sizes(config, run)
    mesh = make_mesh(run.mesh, devices)
    model = build_model(config, run, mesh)
    optimizer = make_optimizer(run)
    model, opt_state = place(model, optimizer, mesh, run.fsdp)
    start = 0
    checkpointer = None
    if checkpoint is not None:
        from eqpar.checkpoint import Checkpointer

        checkpointer = Checkpointer(
            checkpoint.directory, save_every=checkpoint.save_every, keep=checkpoint.keep
        )
        if checkpoint.resume and checkpointer.latest_step() is not None:
            target = {"model": model, "opt_state": opt_state, "position": 0}
            state = checkpointer.restore(target=target, reshape=True)
            model, opt_state, start = state["model"], state["opt_state"], int(state["position"])
            print(f"resumed from step {checkpointer.restored_step} ({checkpoint.directory})")
    if show_layout:
        print_layout_table(model, mesh=mesh)
    step = build_step(model, mesh, run, optimizer)
    corpus = lm.encode(lm.make_corpus(200_000, seed=run.seed), config.vocab_size)
    batches = lm.Batches(corpus, batch_size=run.batch_size, seq_len=config.seq_len, seed=run.seed)
    losses: list[float] = []
    bar = _progress(run.steps, progress, initial=start)
    tokens_per_step = run.batch_size * config.seq_len
    started = time.perf_counter()

    def save(position: int, *, force: bool) -> None:
        if checkpointer is not None and (force or checkpointer.should_save(position)):
            state = {"model": model, "opt_state": opt_state, "position": position}
            checkpointer.save(position, state, force=force)

    try:
        for position in range(start, run.steps):
            tokens = place_batch(batches, position, mesh)
            model, opt_state, loss = step(tokens, model, opt_state)
            losses.append(float(loss))
            elapsed = time.perf_counter() - started
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step * len(losses) / elapsed:.0f}"
            )
            bar.update(1)
            save(position + 1, force=position + 1 == run.steps)
    finally:
        bar.close()
        if checkpointer is not None:
            checkpointer.close()
    return losses, model


def _progress(total: int, enabled: bool, *, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, desc="training", disable=not enabled, dynamic_ncols=True
    )


def write_pictures(losses: list[float], run: RunConfig, out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(range(1, len(losses) + 1), losses)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title(f"mesh {run.mesh}, schedule {run.schedule}")
    figure.tight_layout()
    curve = out / "loss_curve.png"
    figure.savefig(curve, dpi=120)
    plt.close(figure)
    written = [curve]
    stages = run.mesh[lm.PIPE]
    if stages > 1:
        from eqpar.schedule import CircularSchedule, GPipeSchedule, OneFOneBSchedule

        if run.schedule == "circular":
            schedule: Any = CircularSchedule(stages, run.microbatches, run.repeats)
        elif run.schedule == "1f1b":
            schedule = OneFOneBSchedule(stages, run.microbatches)
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


def parameter_digest(model: lm.LM) -> str:
    """A hash of every parameter's bytes (equal digests: bitwise equal parameters)."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(eqx.filter(lm.model_order(model), eqx.is_array)):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


def largest_differences(a: lm.LM, b: lm.LM) -> float:
    """The largest parameter difference of two models (any layouts)."""
    leaves_a = jax.tree.leaves(eqx.filter(lm.model_order(a), eqx.is_array))
    leaves_b = jax.tree.leaves(eqx.filter(lm.model_order(b), eqx.is_array))
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(leaves_a, leaves_b)
    )


def positive_int(text: str) -> int:
    """An argparse `type` for counts that must be at least 1 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,pipe=2,model=2")
    parser.add_argument("--schedule", choices=lm.SCHEDULES, default="gpipe")
    parser.add_argument("--microbatches", type=positive_int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="stages per device (circular)")
    parser.add_argument("--fsdp", action="store_true", help="also shard parameters over data")
    parser.add_argument(
        "--remat",
        nargs="?",
        const="full",
        default="none",
        choices=["none", "full", "matmuls"],
        help="recompute each layer's activations in the backward pass: 'full' keeps only its "
        "input, 'matmuls' also its matmul outputs (default none; --remat alone means full)",
    )
    parser.add_argument("--steps", type=positive_int, default=120)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="also run on one device and compare")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("outputs"))
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", type=pathlib.Path, help="write the losses and figures here")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="model size")
    parser.add_argument("--ckpt-dir", type=pathlib.Path, help="checkpoint directory")
    parser.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--resume", action="store_true", help="continue from the latest")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume and args.ckpt_dir is None:
        parser.error("--resume needs --ckpt-dir")
    checkpoint = (
        None
        if args.ckpt_dir is None
        else CheckpointOptions(args.ckpt_dir, args.save_every, args.keep, args.resume)
    )

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
        optimizer=args.optimizer,
        seed=args.seed,
    )
    print(f"{count} {jax.devices()[0].platform} devices; mesh {run.mesh}; schedule {run.schedule}")
    started = time.perf_counter()
    config = SIZES[args.size]
    losses, model = train(run, config=config, progress=not args.no_progress, checkpoint=checkpoint)
    seconds = time.perf_counter() - started
    summary: dict[str, Any] = {
        "losses": losses,
        "seconds": seconds,
        "mesh": run.mesh,
        "parameter_digest": parameter_digest(model),
    }
    if not losses:
        print(f"nothing to do: already at step {run.steps}")
        if args.json:
            args.json.write_text(json.dumps(summary))
        return summary
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps ({seconds:.1f} s)")
    for path in write_pictures(losses, run, args.out):
        print(f"wrote {path}")
    if args.check:
        serial_run = dataclasses.replace(
            run, mesh={lm.DATA: 1, lm.PIPE: 1, lm.MODEL: 1}, fsdp=False
        )
        serial_losses, serial_model = train(
            serial_run, config=config, devices=jax.devices()[:1], progress=False, show_layout=False
        )
        loss_diff = max(abs(a - b) for a, b in zip(losses, serial_losses))
        param_diff = largest_differences(model, serial_model)
        print(
            f"check against one device: largest loss difference {loss_diff:.2e}, "
            f"largest parameter difference {param_diff:.2e}"
        )
        summary.update(loss_difference=loss_diff, parameter_difference=param_diff)
    if args.json:
        args.json.write_text(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
