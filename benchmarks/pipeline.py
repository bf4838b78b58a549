"""Pipeline schedules on 4 simulated CPU devices: bubble, compile, memory and step time.

For a pipeline axis of S = 4 devices and M microbatches this measures, for one training step
(loss and gradients of every stage) of GPipe (`jax.grad` through the forward run, whose
backward pass is the training table's backward half), GPipe with each stage rematerialised,
the circular schedule with 2 stages per device, and of the
schedules whose own backward pass `PipelineModule.value_and_grad` runs (layer by layer,
each layer's gradient added into the sum in place): GPipe and circular again (`gpipe table`,
`circular table`), 1F1B (storing each stage's residuals, and recomputing the forward
instead), the zero-bubble ZB-H1 schedule and the V-shaped ZB-V and DualPipeV (two stages
per device, stage `d` and `2S - 1 - d`):

- the bubble fraction of the schedule, and the layer inputs a device holds at once (its
  `max_stored_inputs()` times the layers per stage: a V stage is half a 1F1B stage);
- the bytes one device receives over the pipe axis per step, exactly as the schedule's sends
  move them (counted from the compiled schedule table: each step sends only what its actions
  made; autodiff of a forward run sends the cotangents back over the same pairs), against the
  ideal `2 (S - 1) / S x M x` one microbatch's activation (every microbatch crosses each
  stage boundary once forward and once backward; the circular schedule's `V S - 1`
  boundaries include `V - 1` wraps, a V's `2 S - 1` its turn on the last device, which
  sends nothing), and as read from the compiled program, where the sends of a step are a
  conditional over the step's pairs and count as their busiest branch (a V also exchanges
  each device's up stage's parameters, and their gradients back, once per step);
- compile time (lower + compile) and the size of the compiled program text, which must stay
  flat as M grows (the microbatch loop is one `lax.scan`);
- per-device memory from `compiled.memory_analysis()`: arguments, temporaries and
  argument + output + temp - alias (on CPU the peak field ignores temporaries). Every device
  of the pipeline axis receives the whole batch, which grows with M whatever the schedule, so
  the table also gives that total without the batch (inputs and targets);
- step time as a ratio to the same layers run one after the other on one device over the same
  batch, measured in the same process (fastest of a few runs). The simulated devices share the
  host's cores: the serial run uses one device's thread pool while the pipeline spreads over
  several, so the ratio says little about real accelerators.

Run: `python benchmarks/pipeline.py` (about a minute on 2 cores); `--help` for options.
"""

import argparse
import os
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _hlo import collective_summary
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqpar._declare import declared_partition_specs
from eqpar._paths import path_to_str
from eqpar.nn.pipeline import PipelineModule
from eqpar.pipeline import _program

NUM_STAGES = 4
MIB = 2**20


class Residual(eqx.Module):
    """One layer: x + W2 tanh(W1 x), applied to a microbatch [rows, features]."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, features: int, hidden: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(features, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, features, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.vmap(self.down)(jnp.tanh(jax.vmap(self.up)(x)))


# The rows of the table: autodiff of the forward run (GPipe, with remat, circular), and the
# schedules run by `PipelineModule.value_and_grad` (the schedule's own backward pass), by the
# name `value_and_grad` takes.
TABLE_KINDS = {
    "gpipe table": "gpipe",
    "circular table": "circular",
    "1f1b": "1f1b",
    "1f1b+recompute": "1f1b",
    "zb-h1": "zb-h1",
    "zb-v": "zb-v",
    "dualpipe-v": "dualpipe-v",
}
# Two stages per device: the circular schedule's and the V-shaped ones'.
TWO_STAGES = ("circular", "circular table", "zb-v", "dualpipe-v")
SCHEDULES = ("gpipe", "gpipe+remat", "circular", *TABLE_KINDS)


def mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def build(schedule: str, num_microbatches: int, args: argparse.Namespace) -> PipelineModule:
    layers = eqx.filter_vmap(lambda k: Residual(args.features, args.hidden, k))(
        jax.random.split(jax.random.key(0), args.layers)
    )
    return PipelineModule.from_layers(
        layers,
        num_stages=NUM_STAGES,
        num_microbatches=num_microbatches,
        num_repeats=2 if schedule in TWO_STAGES else 1,
        remat=schedule in ("gpipe+remat", "1f1b+recompute"),
    )


def layout(module: PipelineModule):
    declared = declared_partition_specs(module)
    arrays, static = eqx.partition(module, eqx.is_array)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: declared.get(path_to_str(path), P()), arrays
    )
    return arrays, static, specs


def training_step(schedule: str, module: PipelineModule, mesh: Mesh) -> tuple[Callable, object]:
    arrays, static, specs = layout(module)
    last = module.num_stages - 1

    def step(arrays, x, t):
        model = eqx.combine(arrays, static)
        if schedule in TABLE_KINDS:  # the schedule's own backward pass
            loss, grads = model.value_and_grad(mse, x, t, schedule=TABLE_KINDS[schedule])
            return loss, eqx.filter(grads, eqx.is_array)

        def loss_fn(arrays):
            y = eqx.combine(arrays, static)(x)
            is_last = lax.axis_index("pipe") == last
            return lax.psum(jnp.where(is_last, mse(y, t), 0.0), "pipe")

        return jax.value_and_grad(loss_fn)(arrays)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs)))
    return fn, arrays


def serial_step(module: PipelineModule) -> tuple[Callable, object]:
    arrays, static = eqx.partition(module, eqx.is_array)

    def loss_fn(arrays, x, t):
        return mse(eqx.combine(arrays, static).apply_serially(x), t)

    return jax.jit(jax.value_and_grad(loss_fn)), arrays


def time_call(fn: Callable, *args: object, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed run: other processes share the cores


def measure(schedule: str, num_microbatches: int, args: argparse.Namespace, mesh: Mesh) -> dict:
    module = build(schedule, num_microbatches, args)
    rows = num_microbatches * args.rows
    x = jax.random.normal(jax.random.key(1), (rows, args.features))
    t = jax.random.normal(jax.random.key(2), (rows, args.features))
    fn, arrays = training_step(schedule, module, mesh)
    compile_times = []
    for _ in range(args.compiles):  # the fastest of a few: the cores are shared
        jax.clear_caches()
        start = time.perf_counter()
        compiled = fn.lower(arrays, x, t).compile()
        compile_times.append(time.perf_counter() - start)
    compile_seconds = min(compile_times)
    memory = compiled.memory_analysis()
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    kind = TABLE_KINDS.get(schedule, "forward")
    table = module.schedule() if kind == "forward" else module.schedule(kind, include_backward=True)
    bubble = table.bubble_fraction
    block = args.rows * args.features * 4  # one microbatch's activation, float32
    program = _program.compile_schedule(table, store_residuals=kind != "forward")
    sends = sum(len(program.forward_pairs[i]) for i in program.forward_sends)
    sends += sum(len(program.backward_pairs[i]) for i in program.backward_sends)
    for lane in program.other_lanes:  # a V's way back up (its turn stays on its device)
        if not lane.local:
            sends += sum(len(lane.pairs[i]) for i in lane.sends)
    if kind == "forward":  # autodiff sends each cotangent back over the pair it came by
        sends *= 2
    # Stage boundaries between devices: a V's turn at the last device is not one.
    boundaries = module.num_stages * module.num_repeats - 1 - (table.placement == "v")
    ideal = 2 * boundaries * num_microbatches * block / module.num_stages
    step_seconds = time_call(compiled, arrays, x, t, repeats=args.repeats)
    serial, serial_arrays = serial_step(module)
    serial_seconds = time_call(serial, serial_arrays, x, t, repeats=args.repeats)
    return {
        "schedule": schedule,
        "M": num_microbatches,
        "bubble": bubble,
        # stage inputs held at once, in layers (a V stage is half a 1F1B stage)
        "held_layers": table.max_stored_inputs()
        * args.layers
        // (module.num_stages * module.num_repeats),
        "compile_s": compile_seconds,
        "hlo_chars": len(compiled.as_text()),
        "pipe_kib": sends * block / module.num_stages / 1024,
        "pipe_ideal_kib": ideal / 1024,
        "pipe_hlo_kib": collective_summary(compiled).bytes.get("collective-permute", 0.0) / 1024,
        "argument_mib": memory.argument_size_in_bytes / MIB,
        "temp_mib": memory.temp_size_in_bytes / MIB,
        "total_mib": total / MIB,
        "model_mib": (total - x.nbytes - t.nbytes) / MIB,
        "time_ratio": step_seconds / serial_seconds,
        "step_s": step_seconds,
    }


def as_markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"Pipeline training step, S = {NUM_STAGES} devices, {args.layers} residual layers "
        f"({args.features} -> {args.hidden} -> {args.features}), {args.rows} rows per "
        f"microbatch, float32; memory per device (`memory_analysis`); time ratio = step time / "
        f"the same layers run serially on one device, same batch, same process "
        f"(JAX {jax.__version__}, {os.cpu_count()} host cores shared by the simulated devices).",
        "",
        "| schedule | M | bubble | layer inputs held | pipe KiB (table) | / ideal "
        "| pipe KiB (HLO) | compile s | compiled chars | argument MiB | temp MiB "
        "| arg+out+temp-alias MiB | same without batch MiB | time / serial |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['schedule']} | {r['M']} | {r['bubble']:.3f} | {r['held_layers']} "
            f"| {r['pipe_kib']:.0f} "
            f"| {r['pipe_kib'] / r['pipe_ideal_kib']:.2f} | {r['pipe_hlo_kib']:.0f} "
            f"| {r['compile_s']:.2f} "
            f"| {r['hlo_chars']} | {r['argument_mib']:.2f} | {r['temp_mib']:.2f} "
            f"| {r['total_mib']:.2f} | {r['model_mib']:.2f} | {r['time_ratio']:.2f} |"
        )
    by_key = {(r["schedule"], r["M"]): r for r in results}
    checks = []
    sizes = sorted({r["M"] for r in results})
    lo, hi = sizes[0], sizes[-1]
    for schedule in args.schedules:
        if (schedule, lo) in by_key and (schedule, hi) in by_key:
            ratio = by_key[(schedule, hi)]["compile_s"] / by_key[(schedule, lo)]["compile_s"]
            checks.append(f"{schedule} compile time M={hi} / M={lo}: {ratio:.2f}x (target <= 1.5)")
    for m in sizes:
        for suffix in ("", " table"):
            circular, gpipe = (
                by_key.get((f"circular{suffix}", m)),
                by_key.get((f"gpipe{suffix}", m)),
            )
            if circular and gpipe:
                checks.append(
                    f"circular{suffix} temp / gpipe{suffix} temp at M={m}: "
                    f"{circular['temp_mib'] / gpipe['temp_mib']:.2f}x (target <= 1.1)"
                )
    mem_lo, mem_hi = 8, 32
    for schedule in args.schedules:
        if (schedule, mem_lo) in by_key and (schedule, mem_hi) in by_key:
            high, low = by_key[(schedule, mem_hi)], by_key[(schedule, mem_lo)]
            ratio = {
                name: high[name] / low[name] for name in ("temp_mib", "model_mib", "total_mib")
            }
            target = " (target <= 1.25)" if schedule == "1f1b" else ""
            checks.append(
                f"{schedule} memory M={mem_hi} / M={mem_lo}: temp {ratio['temp_mib']:.2f}x, "
                f"total without the batch {ratio['model_mib']:.2f}x{target}, "
                f"total {ratio['total_mib']:.2f}x"
            )
    for m in sizes:
        for schedule in ("zb-v", "dualpipe-v"):
            v, h1 = by_key.get((schedule, m)), by_key.get(("zb-h1", m))
            if v and h1:
                checks.append(
                    f"{schedule} / zb-h1 at M={m}: bubble {v['bubble']:.3f} vs "
                    f"{h1['bubble']:.3f}, layer inputs held {v['held_layers']} vs "
                    f"{h1['held_layers']}, temp {v['temp_mib'] / h1['temp_mib']:.2f}x, step "
                    f"{v['step_s'] / h1['step_s']:.2f}x"
                )
    for schedule in ("gpipe table", "1f1b", "1f1b+recompute", "zb-h1", "zb-v", "dualpipe-v"):
        pairs = [(m, by_key.get((schedule, m)), by_key.get(("gpipe", m))) for m in sizes]
        ratios = [f"M={m}: {a['step_s'] / b['step_s']:.2f}x" for m, a, b in pairs if a and b]
        if ratios:
            target = " (target <= 1.05 at M >= 16)" if schedule == "1f1b" else ""
            checks.append(f"{schedule} step / gpipe step: {', '.join(ratios)}{target}")
    return "\n".join([*lines, "", *[f"- {c}" for c in checks]])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        choices=list(SCHEDULES),
    )
    parser.add_argument("--layers", type=int, default=8, help="divisible by 8")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64, help="rows per microbatch")
    parser.add_argument("--compiles", type=int, default=3, help="compiles timed (fastest)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (fastest)")
    args = parser.parse_args(argv)
    if jax.device_count() < NUM_STAGES:
        raise SystemExit(f"needs {NUM_STAGES} devices; got {jax.device_count()}")
    mesh = Mesh(np.array(jax.devices()[:NUM_STAGES]), ("pipe",))
    results = []
    for schedule in args.schedules:
        for m in args.microbatches:
            if schedule == "dualpipe-v" and m < 2 * NUM_STAGES:
                print(f"  skipped dualpipe-v M={m}: it needs M >= 2S = {2 * NUM_STAGES}")
                continue
            results.append(measure(schedule, m, args, mesh))
            print(f"  measured {schedule} M={m}", flush=True)
    table = as_markdown(results, args)
    print(table)
    return table


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)  # before the first use of a device
    main()
