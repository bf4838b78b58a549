"""bfloat16 mixed precision against float32: the bytes of the gradient reduction over `data`.

For the decoder-only transformer of `examples/lm.py`, one Adam training step exactly as
`examples/train_lm.py` runs it (`build_step`) under `--precision float32` and `--precision
bfloat16` (`eqpar.Precision`: float32 parameters and optimizer state, bfloat16 forward and
backward passes), for the layouts `DP` (`data=8`), `DPxTP` (`data=2,model=4`) and `DPxPP`
(`data=2,pipe=4`, GPipe, 4 microbatches).

**Gradient reduction** is the bytes one device receives per step in the all-reduces and
reduce-scatters over the `data` axis (its groups are the only ones of that size here), read
from the program JAX hands to XLA (`lowered.as_text(dialect="hlo")`, see `benchmarks/_hlo.py` for
the counting). That program is what GPU and TPU compilers get; XLA's CPU compiler promotes
every bfloat16 all-reduce to float32 (its collectives have no bfloat16 reduction), so on CPU
the compiled program moves float32 bytes either way. **temp** is the compiled program's
scratch memory per device (`memory_analysis().temp`); on CPU it does not shrink, because the
CPU compiler also computes bfloat16 arithmetic in float32 (converting in and out), so read it
as a CPU figure only. Run: `python benchmarks/precision.py` (`--quick`: a smaller model).
"""

import argparse
import os
import pathlib
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import lm  # pyright: ignore[reportMissingImports]
import train_lm  # pyright: ignore[reportMissingImports]
import train_options  # pyright: ignore[reportMissingImports]
import train_steps  # pyright: ignore[reportMissingImports]
from _hlo import collective_ops, format_bytes, memory_figures

LAYOUTS = {
    "DP": {lm.DATA: 8, lm.PIPE: 1, lm.MODEL: 1},
    "DPxTP": {lm.DATA: 2, lm.PIPE: 1, lm.MODEL: 4},
    "DPxPP": {lm.DATA: 2, lm.PIPE: 4, lm.MODEL: 1},
}
PRECISIONS = ("float32", "bfloat16")


def lowered_hlo(lowered) -> str:
    """The HLO text of a lowered (not yet compiled) program, in the form `_hlo` parses."""
    text = lowered.as_text(dialect="hlo")
    # Unoptimized HLO writes computations without parameter lists: `ENTRY main.9 {`.
    return re.sub(r"^((?:ENTRY )?\S+) \{$", r"\1 () {", text, flags=re.MULTILINE)


def measure(config: lm.LMConfig, mesh_sizes: dict[str, int], precision: str) -> tuple[float, int]:
    """(gradient-reduction bytes per device over `data`, temp bytes per device)."""
    run = train_lm.RunConfig(mesh=mesh_sizes, batch_size=16, precision=precision)
    mesh = train_lm.make_mesh(run.mesh)
    optimizer = train_lm.make_optimizer(run)
    model, opt_state = train_lm.place(
        train_lm.build_model(config, run, mesh), optimizer, mesh, fsdp=False
    )
    step = train_lm.build_step(model, mesh, run, optimizer)
    tokens = train_steps.place_global_batch(
        lm.Batches(
            jnp.zeros(4 * config.seq_len, jnp.int32),
            batch_size=run.batch_size,
            seq_len=config.seq_len,
        ),
        0,
        mesh,
    )
    lowered = step.lower(tokens, model, opt_state)
    data = mesh_sizes[lm.DATA]
    reduction = sum(
        op.bytes_per_device * op.executions
        for op in collective_ops(lowered_hlo(lowered.lowered))
        if op.kind in ("all-reduce", "reduce-scatter") and op.group_size == data
    )
    return reduction, memory_figures(lowered.compile())["temp"]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model of train_lm.py")
    args = parser.parse_args(argv)
    config = train_options.SIZES["tiny" if args.quick else "small"]
    figures = {
        (name, precision): measure(config, sizes, precision)
        for name, sizes in LAYOUTS.items()
        for precision in PRECISIONS
    }
    lines = [
        f"`examples/lm.py` {'tiny' if args.quick else 'small'} model ({config.num_layers} layers, "
        f"width {config.d_model}), batch 16, one Adam step. Per device; ratio bfloat16 / float32.",
        "",
        "| layout | gradient reduction float32 | bfloat16 | ratio | temp float32 | bfloat16 "
        "(CPU) | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in LAYOUTS:
        (bytes32, temp32), (bytes16, temp16) = (figures[name, p] for p in PRECISIONS)
        lines.append(
            f"| {name} | {format_bytes(bytes32)} | {format_bytes(bytes16)} | "
            f"{bytes16 / bytes32:.3f} | {format_bytes(temp32)} | {format_bytes(temp16)} | "
            f"{temp16 / temp32:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main())
