"""Run every benchmark and write `benchmarks/results.md`.

    python benchmarks/run_all.py            # all benchmarks at their default sizes
    python benchmarks/run_all.py --quick    # smaller sizes, fewer repeats
    python benchmarks/run_all.py --only full_model pipeline --output /tmp/results.md

Each benchmark runs in its own Python process (a fresh JAX with 8 simulated CPU devices, or
the real devices when `JAX_PLATFORMS` names an accelerator platform). A benchmark whose
`main()` returns Markdown contributes that text; one that only prints contributes its printed
output as a text block. Progress goes to the console; a benchmark that fails is reported in
`results.md` with its exit status, and the others still run.
"""

import argparse
import contextlib
import datetime
import importlib
import inspect
import io
import os
import pathlib
import platform
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# (module, heading, arguments at default sizes, arguments with --quick)
BENCHMARKS: list[tuple[str, str, list[str], list[str]]] = [
    ("tensor_parallel", "Tensor-parallel MLP block", [], []),
    (
        "step_unchanged",
        "The one-device step against the shard_map route (GPT-2 small, ahead of time)",
        [],
        ["--quick"],
    ),
    ("sequence_parallel", "Sequence parallelism against tensor parallelism", [], ["--quick"]),
    ("remat", "Rematerialization policies: activation memory against depth", [], ["--quick"]),
    ("fsdp_layers", "FSDP layer by layer against FSDP at the boundary and DP", [], ["--quick"]),
    (
        "pipeline",
        "Pipeline schedules",
        [],
        ["--microbatches", "4", "8", "32", "--compiles", "1", "--repeats", "3"],
    ),
    (
        "pipeline_by_plan",
        "Pipelines by plan: a model's own forward under GPipe, 1F1B and ZB-H1",
        [],
        ["--microbatches", "4", "16"],
    ),
    (
        "accumulation",
        "Gradient accumulation over microbatches on one device, by executor",
        [],
        ["--repeats", "3"],
    ),
    (
        "linear_stage",
        "A pipeline stage of eqx.nn.Linear layers against direct math",
        [],
        ["--quick"],
    ),
    ("distribution", "Distributions (DataParallel, FSDP, ModelParallel)", [], []),
    ("full_model", "Full model: the language model of examples/train_lm.py", [], ["--quick"]),
    ("precision", "Mixed precision: bfloat16 against float32", [], ["--quick"]),
    (
        "context_parallel",
        "Context parallelism: ring and all-gather attention against sequence length",
        [],
        ["--quick"],
    ),
    (
        "scale",
        "Scale table: the example LM at GPT-2-small and ~1.3B, compiled ahead of time",
        [],
        ["--quick"],
    ),
    (
        "moe",
        "Mixture of experts: expert-parallel exchange, buffers, memory, compile time",
        [],
        ["--quick"],
    ),
    (
        "check_curves",
        "Loss curves of train_lm.py --check: the parallel run against one device",
        [],
        ["--steps", "20"],
    ),
]

CAVEAT = (
    "On CPU the devices are simulated: all of them share the host's cores, so wall-clock "
    "times show no overlap of communication with computation, and other processes on the "
    "machine add noise. Read step and compile times as ratios to the baseline measured in "
    "the same run. Byte figures (collectives from the compiled HLO, `memory_analysis()`, "
    "array shards) are exact statements of the compiler and do not depend on load."
)


class _Tee(io.TextIOBase):
    """Keeps what a benchmark prints and shows it on stderr as progress."""

    def __init__(self) -> None:
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        sys.stderr.write(text)
        sys.stderr.flush()
        return self.kept.write(text)


def _configure_devices() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_num_cpu_devices", 8)


def run_child(module_name: str, argv: list[str]) -> None:
    """Run one benchmark in this process and write its Markdown section body to stdout."""
    _configure_devices()
    sys.path.insert(0, str(HERE))
    module = importlib.import_module(module_name)
    takes_argv = bool(inspect.signature(module.main).parameters)
    if argv and not takes_argv:
        raise SystemExit(f"{module_name}.main() takes no arguments; got {argv}")
    tee = _Tee()
    with contextlib.redirect_stdout(tee):
        result = module.main(argv) if takes_argv else module.main()
    if isinstance(result, str):
        body = result
    else:
        body = "```text\n" + tee.kept.getvalue().strip("\n") + "\n```\n"
    sys.stdout.write(body.rstrip("\n") + "\n")


def _environment() -> list[str]:
    _configure_devices()
    import equinox
    import jax

    devices = jax.devices()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- jax {jax.__version__}, jaxlib {getattr(jax.lib, '__version__', '?')}, "
        f"equinox {equinox.__version__}, Python {platform.python_version()}",
        f"- devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); host: "
        f"{os.cpu_count()} cores, {platform.machine()}",
        f"- repository commit: {commit} (plus any uncommitted changes in the working tree)",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    names = [name for name, *_ in BENCHMARKS]
    parser.add_argument("--only", nargs="+", choices=names, default=names)
    parser.add_argument("--output", type=pathlib.Path, default=HERE / "results.md")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.child[0], args.child[1:])
        return 0

    sections: list[str] = []
    failures = 0
    started = time.perf_counter()
    for name, heading, default_args, quick_args in BENCHMARKS:
        if name not in args.only:
            continue
        bench_args = quick_args if args.quick else default_args
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", name]
        command += bench_args
        shown = " ".join(["python", f"benchmarks/{name}.py", *bench_args])
        print(f"== {name}: {shown}", file=sys.stderr, flush=True)
        begun = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=args.timeout
            )
            status, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as error:
            status, output = f"timed out after {args.timeout:.0f} s", str(error.stdout or "")
        seconds = time.perf_counter() - begun
        print(f"== {name}: {seconds:.0f} s", file=sys.stderr, flush=True)
        section = [f"## {heading}", "", f"`{shown}` ({seconds:.0f} s)", ""]
        if status == 0:
            section.append(output.rstrip("\n"))
        else:
            failures += 1
            section.append(
                f"**Failed** (exit status {status}); the console shows its error. Rerun it "
                f"alone with `{shown}`."
            )
        sections.append("\n".join(section))

    total = time.perf_counter() - started
    header = [
        "# eqpar benchmark results",
        "",
        f"Written by `python benchmarks/run_all.py{' --quick' if args.quick else ''}` in "
        f"{total / 60:.1f} min. See `benchmarks/README.md` for what each figure means.",
        "",
        *_environment(),
        "",
        f"> {CAVEAT}",
    ]
    args.output.write_text("\n\n".join(["\n".join(header), *sections]) + "\n")
    print(f"wrote {args.output} ({total:.0f} s)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
