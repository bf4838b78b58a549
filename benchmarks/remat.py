"""Rematerialization policies: activation memory against depth.

One training step (loss and gradients) of `L` transformer layers written the way the
Equinox documentation writes them (`eqx.nn.MultiheadAttention`, `LayerNorm`, a per-token
MLP of two `eqx.nn.Linear`s), stacked in `eqpar.nn.ScannedLayers` with each `remat` policy:
`none` (the baseline: everything stored), `full` (each layer keeps only its input) and
`matmuls` (its input and its projections' outputs). The figures are temp memory from the
compiled program (`memory_analysis`, exact), for one device's share of a data-parallel batch,
and how much each extra layer adds. Run: `python benchmarks/remat.py` (`--quick`: fewer
depths).
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
from _hlo import format_bytes, memory_figures
from _layers import stacked_layers

from eqpar.nn import ScannedLayers

DIM, HEADS, HIDDEN, SEQ, BATCH = 256, 8, 1024, 256, 2
POLICIES = ("none", "full", "matmuls")


def temp_bytes(depth: int, remat: str) -> int:
    stack = ScannedLayers(stacked_layers(depth, DIM, HEADS, HIDDEN), remat=remat)
    x = jnp.zeros((BATCH, SEQ, DIM))

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    compiled = eqx.filter_jit(eqx.filter_value_and_grad(loss)).lower(stack, x).compile()
    return memory_figures(compiled)["temp"]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depths 4 and 8 only")
    args = parser.parse_args(argv)
    depths = (4, 8) if args.quick else (4, 8, 16, 32)
    temps = {(d, p): temp_bytes(d, p) for d in depths for p in POLICIES}
    layer_input = BATCH * SEQ * DIM * 4
    lines = [
        f"Width {DIM}, {HEADS} heads, MLP {HIDDEN}, sequence {SEQ}, batch {BATCH} per device; "
        f"one layer's input is {format_bytes(layer_input)}. Temp per device, ratio to `none` "
        "in brackets.",
        "",
        "| layers | " + " | ".join(f"`{p}`" for p in POLICIES) + " |",
        "| --- |" + " --- |" * len(POLICIES),
    ]
    for d in depths:
        cells = [format_bytes(temps[d, "none"])]
        cells += [
            f"{format_bytes(temps[d, p])} ({temps[d, p] / temps[d, 'none']:.2f}x)"
            for p in POLICIES[1:]
        ]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    first, last = depths[0], depths[-1]
    growth = [format_bytes((temps[last, p] - temps[first, p]) / (last - first)) for p in POLICIES]
    lines.append("| added per layer | " + " | ".join(growth) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main())
