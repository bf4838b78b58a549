"""Calibration of `eqpar.estimate` and `eqpar.search` against the compiler.

For a grid of the example LM's training steps (`examples/train_lm.py`'s step, built as
`benchmarks/scale.py` builds it from shapes and shardings only), at two sizes, on 8 simulated
devices, with layouts DP, FSDP, DPxTP, FSDPxTP, GPipe, 1F1B, ZB-H1, circular and 3D, and remat
policies `none` and `full`: the estimate from the trace (no compiling) against the compiled
program, per device:

- memory: arguments, temp and peak (argument + output + temp - alias), predicted / compiled;
- collective bytes per step, predicted / the compiled HLO's (`benchmarks/_hlo.py`, each
  conditional at its busiest branch, as the estimate counts it);
- seconds: trace and read against lower and compile.

Then `search` over the same grid with a memory limit per device (default: the median compiled
peak, so that about half the grid fits): its choice against the best plan of the grid under the
same step-time model fed with the compiler's figures, and its wall time against compiling the
grid.

    python benchmarks/planner.py                     # every size
    python benchmarks/planner.py --quick             # the small size only
    python benchmarks/planner.py --sizes gpt2-small  # one size
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]

import jax  # noqa: E402
import lm  # noqa: E402
import scale  # noqa: E402
from _hlo import bytes_by_axes_of, collective_ops, memory_figures  # noqa: E402

import eqpar  # noqa: E402
from eqpar.planning import DEVICES, estimate  # noqa: E402

NUM_DEVICES = 8
SIZES = {
    "small": lm.LMConfig(
        vocab_size=512, seq_len=64, d_model=128, num_heads=4, d_hidden=512, num_layers=8
    ),
    "gpt2-small": scale.CONFIGS["gpt2-small"],
    "1.3b": scale.CONFIGS["1.3b"],
}
LAYOUTS = {
    "DP": scale.Layout({lm.DATA: 8}),
    "FSDP": scale.Layout({lm.DATA: 8}, fsdp=True),
    "DPxTP": scale.Layout({lm.DATA: 2, lm.MODEL: 4}),
    "FSDPxTP": scale.Layout({lm.DATA: 2, lm.MODEL: 4}, fsdp=True),
    "GPipe": scale.Layout({lm.DATA: 2, lm.PIPE: 4}),
    "1F1B": scale.Layout({lm.DATA: 2, lm.PIPE: 4}, schedule="1f1b"),
    "ZB-H1": scale.Layout({lm.DATA: 2, lm.PIPE: 4}, schedule="zb-h1"),
    "circular": scale.Layout({lm.DATA: 2, lm.PIPE: 4}, schedule="circular"),
    "3D": scale.Layout({lm.DATA: 2, lm.PIPE: 2, lm.MODEL: 2}),
}


@dataclasses.dataclass
class Row:
    size: str
    layout: str
    remat: str
    predicted: eqpar.Estimate
    compiled: dict[str, int]
    compiled_bytes: float
    compile_s: float

    @property
    def name(self) -> str:
        return f"{self.size} {self.layout} remat={self.remat}"


def run_of(config: lm.LMConfig, layout: str, remat: str, microbatches: int) -> Any:
    args = argparse.Namespace(microbatches=microbatches, batch_size=16)
    return scale.make_run(config, LAYOUTS[layout], args, remat)


def measure(size: str, layout: str, remat: str, microbatches: int, devices: list[Any]) -> Row:
    """One configuration: the estimate from the trace, then the compiled program."""
    config = SIZES[size]
    run = run_of(config, layout, remat, microbatches)
    step = scale.build_abstract_step(config, run, devices)
    predicted = estimate(step.lowered, *step.arguments, donate_argnums=(1, 2))
    started = time.perf_counter()
    compiled = jax.jit(step.lowered, donate_argnums=(1, 2)).lower(*step.arguments).compile()
    compile_s = time.perf_counter() - started
    sizes = {axis: run.mesh[axis] for axis in scale.AXES}
    by_axes = bytes_by_axes_of(collective_ops(compiled), sizes)
    return Row(
        size, layout, remat, predicted, memory_figures(compiled), sum(by_axes.values()), compile_s
    )


def calibration_table(rows: list[Row]) -> list[str]:
    mib = 2**20
    lines = [
        "| configuration | args MiB (pred / comp) | temp MiB (pred / comp) | peak MiB (pred / "
        "comp) | peak ratio | temp ratio | collective MiB (pred / HLO) | bytes ratio | trace s "
        "| compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, c = r.predicted, r.compiled
        predicted_bytes = p.collective_bytes()
        bytes_ratio = predicted_bytes / r.compiled_bytes if r.compiled_bytes else 1.0
        lines.append(
            f"| {r.name} | {sum(p.arguments) / mib:.1f} / {c['argument'] / mib:.1f} | "
            f"{p.temp / mib:.1f} / {c['temp'] / mib:.1f} | {p.peak / mib:.1f} / "
            f"{c['total'] / mib:.1f} | {p.peak / c['total']:.2f} | "
            f"{p.temp / max(1, c['temp']):.2f} | {predicted_bytes / mib:.2f} / "
            f"{r.compiled_bytes / mib:.2f} | {bytes_ratio:.4f} | {p.trace_seconds:.2f} | "
            f"{r.compile_s:.1f} |"
        )
    return lines


def modelled_seconds(flops: float, collective_bytes: float, device: Any) -> float:
    return flops / device.flops_per_s + collective_bytes / device.bytes_per_s


def search_summary(rows: list[Row], device_name: str, microbatches: int) -> list[str]:
    """`search`'s choice (from predictions) against the grid's best (from compiled figures),
    both under the same step-time model; `search`'s wall time against compiling the grid."""
    device = DEVICES[device_name]
    by_name = {r.name: r for r in rows}

    def build(name: str) -> tuple[Any, tuple[Any, ...]]:
        r = by_name[name]
        config = SIZES[r.size]
        run = run_of(config, r.layout, r.remat, microbatches)
        step = scale.build_abstract_step(config, run, jax.devices()[:NUM_DEVICES])
        return step.lowered, step.arguments

    lines = []
    for size in dict.fromkeys(r.size for r in rows):
        names = [r.name for r in rows if r.size == size]
        # About half the grid fits: the median compiled peak.
        limit = int(statistics.median(r.compiled["total"] for r in rows if r.size == size))
        result = eqpar.search(
            build, names, memory_per_device=limit, device=device, donate_argnums=(1, 2)
        )
        fitting = [r for r in rows if r.size == size and r.compiled["total"] <= limit]
        grid_s = sum(r.compile_s for r in rows if r.size == size)
        lines.append(f"**{size}**, memory per device {limit / 2**20:.1f} MiB, device model "
                     f"`{device_name}`:")  # fmt: skip
        lines.append("")
        lines.extend(result.table().splitlines())
        lines.append("")
        if not fitting:
            lines.append("No configuration of the grid fits by the compiler's figures.")
            continue
        best = min(
            fitting, key=lambda r: modelled_seconds(r.predicted.flops, r.compiled_bytes, device)
        )
        best_s = modelled_seconds(best.predicted.flops, best.compiled_bytes, device)
        chosen = by_name[result.best.candidate]
        chosen_s = modelled_seconds(chosen.predicted.flops, chosen.compiled_bytes, device)
        lines.append(
            f"search chose **{chosen.name}** (compiled peak {chosen.compiled['total'] / 2**20:.1f}"
            f" MiB, fits: {chosen.compiled['total'] <= limit}); the grid's best by the "
            f"compiler's figures is **{best.name}**; chosen / best step model "
            f"{chosen_s / best_s:.3f}. search took {result.seconds:.1f} s, compiling the grid "
            f"{grid_s:.1f} s ({grid_s / result.seconds:.1f}x)."
        )
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small size only")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--remat", nargs="+", choices=("none", "full"), default=["none", "full"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--device", choices=list(DEVICES), default="h100-sxm")
    args = parser.parse_args(argv)
    if jax.device_count() < NUM_DEVICES:
        raise SystemExit(f"needs {NUM_DEVICES} devices; got {jax.device_count()}")
    devices = jax.devices()[:NUM_DEVICES]
    sizes = args.sizes or (["small"] if args.quick else list(SIZES))
    rows = []
    for size in sizes:
        for remat in args.remat:
            for layout in args.layouts:
                row = measure(size, layout, remat, args.microbatches, devices)
                print(f"  {row.name}: peak {row.predicted.peak / row.compiled['total']:.2f}x",
                      file=sys.stderr, flush=True)  # fmt: skip
                rows.append(row)
    out = [
        f"Devices: {NUM_DEVICES} x {devices[0].platform}; jax {jax.__version__}. Per device; "
        "predicted from the trace (`eqpar.estimate`), compiled from `memory_analysis()` and "
        "the HLO.",
        "",
        *calibration_table(rows),
        "",
    ]
    peaks = [r.predicted.peak / r.compiled["total"] for r in rows]
    within = sum(0.9 <= q <= 1.1 for q in peaks)
    exact = sum(
        abs(r.predicted.collective_bytes() - r.compiled_bytes) <= 0.01 * max(1, r.compiled_bytes)
        for r in rows
    )
    out.append(
        f"{len(rows)} configurations: peak within 10% on {within}, collective bytes within 1% "
        f"on {exact}; median trace {statistics.median(r.predicted.trace_seconds for r in rows):.2f}"
        f" s, median compile {statistics.median(r.compile_s for r in rows):.1f} s."
    )
    out.append("")
    out.extend(search_summary(rows, args.device, args.microbatches))
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
