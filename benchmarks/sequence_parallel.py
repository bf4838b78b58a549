"""Sequence parallelism: what `sequence_parallel=True` saves, against plain tensor parallelism.

One training step (loss and gradients) of a stack of transformer layers written the way the
Equinox documentation writes them (`eqx.nn.MultiheadAttention`, `eqx.nn.LayerNorm`, two
`eqx.nn.Linear`s applied per token with `jax.vmap`), converted by `eqpar.parallelize` with
heads, MLP columns and MLP rows split over a `model` axis of n = 8 devices:

- `TP` (the baseline): activations between blocks replicated over `model` (one `psum` per
  block);
- `TP + SP`: the same plan with `sequence_parallel=True`, and `scatter_sequence` /
  `gather_sequence` around the layers: activations between blocks split over the sequence.

Reported per device, from the compiled program (exact figures, not timings): temp memory
(`memory_analysis`), bytes received by collectives, and their ratios to TP. The step time is
the median of alternating runs, as a ratio only. Run: `python benchmarks/sequence_parallel.py`
(`--quick` for the smallest size only).
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
from _hlo import collective_bytes, format_bytes, memory_figures, paired_median_seconds
from _layers import Layer
from jax.sharding import PartitionSpec as P

import eqpar

DIM, HEADS, HIDDEN, LAYERS, BATCH = 256, 8, 1024, 4, 2


class Trunk(eqx.Module):
    layers: list
    sequence_parallel: bool = eqx.field(static=True)

    def __call__(self, x):
        if self.sequence_parallel:
            x = eqpar.nn.scatter_sequence(x)
        for layer in self.layers:
            x = layer(x)
        return eqpar.nn.gather_sequence(x) if self.sequence_parallel else x


def plan(sequence_parallel: bool) -> dict:
    return {
        r"layers/\d+/attention": eqpar.HeadParallel(sequence_parallel=sequence_parallel),
        r"layers/\d+/up": eqpar.ColumnParallel(sequence_parallel=sequence_parallel),
        r"layers/\d+/down": eqpar.RowParallel(sequence_parallel=sequence_parallel),
    }


def step_for(sequence_parallel: bool, mesh: eqpar.DeviceMesh, seq: int):
    keys = jax.random.split(jax.random.key(0), LAYERS)
    layers = [Layer(DIM, HEADS, HIDDEN, key=k) for k in keys]
    model = eqpar.parallelize(Trunk(layers, sequence_parallel), plan(sequence_parallel), mesh=mesh)
    loss = eqpar.shard_map(
        lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2),
        mesh=mesh,
        in_specs=(eqpar.partition_specs(model), P()),
        out_specs=P(),
    )
    x = jax.random.normal(jax.random.key(1), (BATCH, seq, DIM))
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    return step, model, x


def measure(seq: int, mesh: eqpar.DeviceMesh) -> dict:
    figures = {}
    runs = {}
    for name, sequence_parallel in (("TP", False), ("TP + SP", True)):
        step, model, x = step_for(sequence_parallel, mesh, seq)
        compiled = step.lower(model, x).compile()
        figures[name] = (memory_figures(compiled)["temp"], collective_bytes(compiled))
        runs[name] = (step, model, x)
    base, sp = paired_median_seconds(
        (runs["TP"][0], runs["TP"][1:]), (runs["TP + SP"][0], runs["TP + SP"][1:]), repeats=3
    )
    return {"seq": seq, "figures": figures, "time_ratio": sp / base}


def table(rows: list[dict]) -> str:
    lines = [
        f"{LAYERS} layers, width {DIM}, {HEADS} heads, MLP {HIDDEN}, batch {BATCH}, model=8; "
        "per device, ratio to TP in brackets.",
        "",
        "| seq | TP temp | TP + SP temp | TP collective bytes | TP + SP collective bytes | "
        "step time (TP + SP / TP) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        (tp_temp, tp_bytes), (sp_temp, sp_bytes) = row["figures"]["TP"], row["figures"]["TP + SP"]
        lines.append(
            f"| {row['seq']} | {format_bytes(tp_temp)} | {format_bytes(sp_temp)} "
            f"({sp_temp / tp_temp:.2f}x) | {format_bytes(tp_bytes)} | {format_bytes(sp_bytes)} "
            f"({sp_bytes / tp_bytes:.2f}x) | {row['time_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest sequence only")
    args = parser.parse_args(argv)
    mesh = eqpar.DeviceMesh((8,), ("model",), devices=jax.devices()[:8])
    lengths = (256,) if args.quick else (256, 1024, 2048)
    return table([measure(seq, mesh) for seq in lengths])


if __name__ == "__main__":
    sys.stdout.write(main())
