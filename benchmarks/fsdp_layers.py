"""FSDP layer by layer against FSDP gathered at the boundary and against data parallelism.

One training step (loss and gradients) of `L` transformer layers written the way the Equinox
documentation writes them, stacked in `eqpar.nn.ScannedLayers(remat="full")`, on a `data`
axis of 8 devices, three ways:

- `DP` (the baseline): parameters replicated, the batch split;
- `FSDP boundary`: parameters stored split by `eqpar.FSDP`, given to `eqpar.shard_map` by
  `in_specs` alone: the compiler gathers them whole before the `shard_map` and all-reduces
  their gradients;
- `FSDP stored`: the same, with the storage layout as `stored_specs`: each parameter enters
  split, is all-gathered as it enters and its gradient reduce-scattered;
- `FSDP per layer`: the same storage with `eqpar.nn.gather_layers`: each layer gathered in
  its own scan step, its gradient reduce-scattered there.

Per device, from the compiled program (exact figures): peak memory (arguments + outputs +
temp - aliased, as `memory_analysis` states them), temp alone, and bytes moved by
collectives, each with its ratio to DP. Run: `python benchmarks/fsdp_layers.py`
(`--quick`: fewer depths).
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
from _hlo import collective_bytes, format_bytes, memory_figures
from _layers import stacked_layers
from jax import lax
from jax.sharding import PartitionSpec as P

import eqpar
from eqpar.nn import ScannedLayers, gather_layers

DIM, HEADS, HIDDEN, SEQ, BATCH = 384, 6, 1536, 128, 16


def figures(
    model, storage_specs, mesh: eqpar.DeviceMesh, *, stored: bool = False
) -> tuple[int, int, float]:
    placed = eqx.filter_shard(model, eqpar.named_shardings(storage_specs, mesh))
    loss = eqpar.shard_map(
        lambda m, x: lax.pmean(jnp.mean(jax.vmap(m)(x) ** 2), "data"),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(model), P("data")),
        out_specs=P(),
        stored_specs=(storage_specs, P("data")) if stored else None,
    )
    x = jnp.zeros((BATCH, SEQ, DIM))
    compiled = eqx.filter_jit(eqx.filter_value_and_grad(loss)).lower(placed, x).compile()
    memory = memory_figures(compiled)
    return memory["total"], memory["temp"], collective_bytes(compiled)


def measure(depth: int, mesh: eqpar.DeviceMesh) -> dict:
    stack = ScannedLayers(stacked_layers(depth, DIM, HEADS, HIDDEN), remat="full")
    fsdp = eqpar.FSDP(mesh, axis="data")
    per_layer = gather_layers(stack, mesh, axis="data")
    return {
        "DP": figures(stack, eqpar.partition_specs(stack), mesh),
        "FSDP boundary": figures(stack, fsdp.partition_specs(stack), mesh),
        "FSDP stored": figures(stack, fsdp.partition_specs(stack), mesh, stored=True),
        "FSDP per layer": figures(per_layer, fsdp.partition_specs(per_layer), mesh),
    }


def table(rows: dict[int, dict]) -> str:
    names = ("DP", "FSDP boundary", "FSDP stored", "FSDP per layer")
    lines = [
        f"Width {DIM}, {HEADS} heads, MLP {HIDDEN}, sequence {SEQ}, global batch {BATCH} over "
        "data=8, remat='full'. Per device; ratio to DP in brackets.",
        "",
        "| layers | " + " | ".join(f"{n} peak" for n in names) + " | "
        + " | ".join(f"{n} temp" for n in names) + " | "
        + " | ".join(f"{n} bytes" for n in names) + " |",
        "| --- |" + " --- |" * 3 * len(names),
    ]  # fmt: skip
    for depth, row in rows.items():
        cells = []
        for index in range(3):
            base = row["DP"][index]
            for name in names:
                value = row[name][index]
                ratio = f" ({value / base:.2f}x)" if name != "DP" and base else ""
                cells.append(format_bytes(value) + ratio)
        lines.append(f"| {depth} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depths 2 and 4 only")
    args = parser.parse_args(argv)
    mesh = eqpar.DeviceMesh((8,), ("data",), devices=jax.devices()[:8])
    depths = (2, 4) if args.quick else (4, 8, 16)
    return table({depth: measure(depth, mesh) for depth in depths})


if __name__ == "__main__":
    sys.stdout.write(main())
