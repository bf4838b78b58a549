"""Gradient accumulation over microbatches on one device: memory and step time by executor.

The transformer blocks of `examples/lm.py` in one `PipelineModule` stage (`num_stages=1`),
trained on a batch cut into M microbatches, each layer rematerialized (`remat="full"`):

- `serial`: the whole batch at once, `jax.value_and_grad` (no microbatches; the baseline);
- `scan`: `eqpar.value_and_grad(loss, microbatches=M)`, a plain `lax.scan` over the
  microbatches adding their gradients (the accumulation any mesh gets, pipe axis or not);
- `autodiff`: `jax.value_and_grad` through the pipeline's forward run, whose backward pass
  is the GPipe training table's backward half (with remat `full`: each microbatch's stage
  input kept, the layers recomputed);
- `table gpipe` / `table 1f1b`: `PipelineModule.value_and_grad`, the schedule's own
  backward, which differentiates the stage layer by layer and adds each layer's gradient
  into the total in place.

Per row: temp (`compiled.memory_analysis()`, exact) and its growth per added layer between
the two depths, the step time as a ratio to `serial` at the same depth (median of
alternating runs), and the size of the compiled program; the table executors' time and
program also as ratios to `scan`, the plain accumulation. One device: the CPU by default,
or the accelerator that `JAX_PLATFORMS` names (e.g. `JAX_PLATFORMS=cuda`), where the
times mean something.

Run: `python benchmarks/accumulation.py` (about 1 min on 2 CPU cores); `--help`.
"""

import argparse
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import lm

import eqpar
from eqpar.nn.pipeline import PipelineModule

EXECUTORS = ("serial", "scan", "autodiff", "table gpipe", "table 1f1b")


def build(config: lm.LMConfig, microbatches: int) -> PipelineModule:
    keys = jax.random.split(jax.random.key(0), config.num_layers)
    layers = eqx.filter_vmap(lambda k: lm.Block(config, key=k))(keys)
    return PipelineModule.from_layers(
        layers, num_stages=1, num_microbatches=microbatches, axis_name="pipe", remat="full"
    )


def mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def step_function(executor: str, module: PipelineModule, mesh: Mesh) -> Callable:
    """`(arrays, x, t) -> (loss, grads)` for one executor, jitted."""
    static = eqx.partition(module, eqx.is_array)[1]
    specs = eqpar.partition_specs(module)

    if executor == "serial":

        def serial(arrays, x, t):
            model = eqx.combine(arrays, static)
            return jax.value_and_grad(lambda a: mse(eqx.combine(a, static).apply_serially(x), t))(
                eqx.filter(model, eqx.is_array)
            )

        return jax.jit(serial)

    if executor == "scan":
        # The plain accumulation: one `lax.scan` over the microbatches, each layer
        # rematerialised by its `ScannedLayers` policy, the gradients summed in float32.
        def loss_fn(model, x, t):
            return mse(model.apply_serially(x), t)

        accumulate = eqpar.value_and_grad(loss_fn, microbatches=module.num_microbatches)

        def scanned(arrays, x, t):
            loss, grads = accumulate(eqx.combine(arrays, static), x, t)
            return loss, eqx.filter(grads, eqx.is_array)

        return jax.jit(scanned)

    def inside(arrays, x, t):
        model = eqx.combine(arrays, static)
        if executor == "autodiff":
            # one device: the pipeline's last stage is here, `psum` only types the loss
            return jax.value_and_grad(
                lambda a: jax.lax.psum(mse(eqx.combine(a, static)(x), t), "pipe")
            )(arrays)
        schedule = executor.removeprefix("table ")
        loss, grads = model.value_and_grad(mse, x, t, schedule=schedule)
        return loss, eqx.filter(grads, eqx.is_array)

    return jax.jit(
        jax.shard_map(inside, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs))
    )


def measure(args: argparse.Namespace, depth: int, mesh: Mesh) -> dict[str, dict]:
    config = lm.LMConfig(
        vocab_size=8, seq_len=args.seq, d_model=args.width, num_heads=args.heads,
        d_hidden=4 * args.width, num_layers=depth,
    )  # fmt: skip
    module = build(config, args.microbatches)
    arrays = eqx.filter(module, eqx.is_array)
    keys = jax.random.split(jax.random.key(1))
    x = jax.random.normal(keys[0], (args.batch, args.seq, args.width))
    t = jax.random.normal(keys[1], (args.batch, args.seq, args.width))
    rows: dict[str, dict] = {}
    compiled = {}
    for executor in EXECUTORS:
        fn = step_function(executor, module, mesh)
        lowered = fn.lower(arrays, x, t).compile()
        compiled[executor] = lowered
        loss, _ = jax.block_until_ready(lowered(arrays, x, t))
        rows[executor] = {
            "temp": lowered.memory_analysis().temp_size_in_bytes,
            "loss": loss,
            "program": len(lowered.as_text()),
        }
    times: dict[str, list[float]] = {e: [] for e in EXECUTORS}
    for _ in range(args.repeats):  # alternating, so that load affects every executor alike
        for executor in EXECUTORS:
            started = time.perf_counter()
            jax.block_until_ready(compiled[executor](arrays, x, t))
            times[executor].append(time.perf_counter() - started)
    for executor in EXECUTORS:
        rows[executor]["time"] = statistics.median(times[executor])
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs=2, default=[4, 12])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    mesh = Mesh(np.array([device]), ("pipe",))
    low, high = args.depths
    by_depth = {depth: measure(args, depth, mesh) for depth in (low, high)}
    layer_bytes = 4 * (4 * args.width**2 + 2 * 4 * args.width**2)  # float32 weights
    lines = [
        f"Device: {device.device_kind} ({device.platform}); jax {jax.__version__}. Blocks of "
        f"`examples/lm.py` (width {args.width}, {args.heads} heads, MLP {4 * args.width}, seq "
        f"{args.seq}), batch {args.batch} in {args.microbatches} microbatches, remat `full`; "
        f"one layer's weights {mib(layer_bytes)}. Time ratio: median of {args.repeats} "
        f"alternating runs / `serial`'s at the same depth; program: characters of the compiled "
        f"program's text at {high} layers, and their ratio to `scan`'s (the plain "
        f"accumulation), as the step time's.",
        "",
        f"| executor | temp at {low} layers | temp at {high} layers | added per layer "
        f"(x one layer's weights) | time / serial at {low} | time / serial at {high} | "
        f"time / scan at {high} | program | / scan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    scan = by_depth[high]["scan"]
    for executor in EXECUTORS:
        a, b = by_depth[low][executor], by_depth[high][executor]
        per_layer = (b["temp"] - a["temp"]) / (high - low)
        lines.append(
            f"| {executor} | {mib(a['temp'])} | {mib(b['temp'])} | {mib(per_layer)} "
            f"({per_layer / layer_bytes:.2f}x) | "
            f"{a['time'] / by_depth[low]['serial']['time']:.2f} | "
            f"{b['time'] / by_depth[high]['serial']['time']:.2f} | "
            f"{b['time'] / scan['time']:.2f} | {b['program']} | "
            f"{b['program'] / scan['program']:.2f} |"
        )
    losses = [float(by_depth[high][e]["loss"]) for e in EXECUTORS]
    spread = max(losses) - min(losses)
    lines += ["", f"Same loss at {high} layers: largest difference {spread:.1e}."]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
