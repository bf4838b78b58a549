"""Tensor-parallel MLP block: eqpar's layers against two baselines measured in the same run.

For n = 2, 4, 8 devices of a `model` axis, one training step (loss, gradients) of a
column-parallel -> gelu -> row-parallel MLP block, written six ways:

- `eqpar TPDense`: `eqpar.nn.TPMLPBlock` (all-gather / reduce-scatter), the baseline of every
  ratio;
- `eqpar TPAsyncDense`: the same block on ring collectives (`use_ring=True`), one ring
  direction (the default);
- `eqpar TPAsyncDense, both directions`: the same with `use_bidirectional_gather=True` and
  `use_bidirectional_scatter=True`;
- `eqpar TPAsyncDense, every collective a ring`: one direction, with the two walks that sum a
  product per block (the up projection's forward pass, the down projection's input gradient)
  forced onto the ring where `TPAsyncDense` gathers once because the ring would hold more
  (n = 2 and 4 here): the figures behind that choice;
- `(a) shard_map by hand`: the same block written by hand with `jax.shard_map` and
  `lax.all_gather` / `lax.psum_scatter`;
- `(b) jit`: plain `jax.jit` with `NamedSharding`s: the compiler's own partitioning.

Reported per device: bytes received over the interconnect for the step (from the compiled
HLO), the all-gathers left in it (the rest are ring steps) and temp memory
(`memory_analysis`), exact figures; compile time (`lower` + `compile`,
the median of `COMPILES` fresh compilations taken in turns with the other variants, after one
round of warm-up) and step time (median, alternating with TPDense's step), as ratios to
TPDense only: they are timings on simulated devices that share the host's cores. Run:
`python benchmarks/tensor_parallel.py`.
"""

import contextlib
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from _hlo import (
    collective_bytes,
    collective_ops,
    compile_timed,
    memory_figures,
    paired_median_seconds,
)
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import eqpar
from eqpar import collectives
from eqpar.nn import TPAsyncDense, TPMLPBlock

D_MODEL, D_HIDDEN, TOKENS = 256, 1024, 512
REPEATS = 5  # step-time pairs
COMPILES = 5  # timed compilations per variant (after one warm-up round)
BASELINE = "eqpar TPDense"
RING = "eqpar TPAsyncDense"
RING_BOTH = "eqpar TPAsyncDense, both directions"
RING_ALL = "eqpar TPAsyncDense, every collective a ring"


def _eqpar_step(specs, mesh):
    feature = P(None, "model")

    def loss(block, x):
        forward = eqpar.shard_map(
            lambda m, x: m(x), mesh=mesh, in_specs=(specs, feature), out_specs=feature
        )
        return jnp.mean(forward(block, x) ** 2)

    return jax.value_and_grad(loss)


@contextlib.contextmanager
def _every_walk_on_the_ring():
    """TPAsyncDense's training rule answering 'walk round the ring' everywhere (private: the
    figures behind the rule)."""
    rule = collectives._walk_holds_less
    collectives._walk_holds_less = lambda *_: True
    try:
        yield
    finally:
        collectives._walk_holds_less = rule


def _every_ring_step(specs, mesh):
    step = _eqpar_step(specs, mesh)

    def traced(*args):
        with _every_walk_on_the_ring():
            return step(*args)

    return traced


def _hand_written_step(mesh):
    def block(w_up, b_up, w_down, b_down, x):
        full = lax.all_gather(x, "model", axis=1, tiled=True)
        hidden = jax.nn.gelu(full @ w_up.T + b_up)
        partial = hidden @ w_down.T
        return lax.psum_scatter(partial, "model", scatter_dimension=1, tiled=True) + b_down

    forward = jax.shard_map(
        block,
        mesh=mesh,
        in_specs=(P("model", None), P("model"), P(None, "model"), P("model"), P(None, "model")),
        out_specs=P(None, "model"),
    )

    def loss(params, x):
        w_up, b_up, w_down, b_down = params
        return jnp.mean(forward(w_up, b_up, w_down, b_down, x) ** 2)

    return jax.value_and_grad(loss)


def _compiler_step():
    def loss(params, x):
        w_up, b_up, w_down, b_down = params
        hidden = jax.nn.gelu(x @ w_up.T + b_up)
        return jnp.mean((hidden @ w_down.T + b_down) ** 2)

    return jax.value_and_grad(loss)


def _placed(tree, specs, mesh):
    return jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)) if eqx.is_array(a) else a,
        tree,
        specs,
    )


def _both_directions(block):
    """The block with its ring layers sending both ways round the ring."""
    convert = lambda layer, mode: TPAsyncDense.from_linear(
        layer.to_linear(),
        tp_mode=mode,
        use_bidirectional_gather=True,
        use_bidirectional_scatter=True,
    )
    return eqx.tree_at(
        lambda b: (b.up, b.down),
        block,
        (convert(block.up, "gather"), convert(block.down, "scatter")),
    )


def _variants(mesh):
    """name -> (a function building a fresh step function, its arguments)."""
    x = jax.random.normal(jax.random.key(1), (TOKENS, D_MODEL))
    x = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
    dense = TPMLPBlock(D_MODEL, D_HIDDEN, key=jax.random.key(0))
    ring = TPMLPBlock(D_MODEL, D_HIDDEN, use_ring=True, key=jax.random.key(0))
    variants = {}
    for name, block in ((BASELINE, dense), (RING, ring), (RING_BOTH, _both_directions(ring))):
        specs = eqpar.partition_specs(block)
        variants[name] = (
            lambda specs=specs: _eqpar_step(specs, mesh),
            (_placed(block, specs, mesh), x),
        )
    specs = eqpar.partition_specs(ring)
    variants[RING_ALL] = (
        lambda specs=specs: _every_ring_step(specs, mesh),
        (_placed(ring, specs, mesh), x),
    )
    layout = (P("model", None), P("model"), P(None, "model"), P("model"))
    params = (dense.up.weight, dense.up.bias, dense.down.weight, dense.down.bias)
    params = tuple(jax.device_put(p, NamedSharding(mesh, s)) for p, s in zip(params, layout))
    variants["(a) shard_map by hand"] = (lambda: _hand_written_step(mesh), (params, x))
    variants["(b) jit + NamedSharding"] = (_compiler_step, (params, x))
    return variants


def measure(n: int) -> list[dict]:
    mesh = Mesh(np.array(jax.devices()[:n]), ("model",))
    variants = _variants(mesh)
    compiled, compile_s = {}, {name: [] for name in variants}
    # Taken in turns, so that load from other processes falls on every variant alike; the
    # first round (JAX and XLA warming up) is not counted.
    for round_ in range(COMPILES + 1):
        for name, (make_step, args) in variants.items():
            compiled[name], seconds = compile_timed(jax.jit(make_step()), *args)
            if round_:
                compile_s[name].append(seconds)
    baseline = (compiled[BASELINE], variants[BASELINE][1])
    rows = []
    for name, (_, args) in variants.items():
        step_ratio = 1.0
        if name != BASELINE:
            step_s, base_s = paired_median_seconds(
                (compiled[name], args), baseline, repeats=REPEATS
            )
            step_ratio = step_s / base_s
        rows.append(
            {
                "variant": name,
                "n": n,
                "collective_bytes": collective_bytes(compiled[name]),
                "all_gathers": sum(
                    op.executions
                    for op in collective_ops(compiled[name].as_text())
                    if op.kind == "all-gather"
                ),
                "temp_bytes": memory_figures(compiled[name])["temp"],
                "compile_s": statistics.median(compile_s[name]),
                "step_ratio": step_ratio,
            }
        )
    return rows


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "n/a"


def table(rows: list[dict]) -> str:
    header = (
        "| n | variant | collective KiB/device | ratio | all-gathers | temp KiB | ratio "
        "| compile ratio | step ratio |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for n in sorted({r["n"] for r in rows}):
        group = [r for r in rows if r["n"] == n]
        base = next(r for r in group if r["variant"] == BASELINE)
        for r in group:
            lines.append(
                f"| {n} | {r['variant']} | {r['collective_bytes'] / 1024:.0f} | "
                f"{_ratio(r['collective_bytes'], base['collective_bytes'])} | "
                f"{r['all_gathers']} | {r['temp_bytes'] / 1024:.0f} | "
                f"{_ratio(r['temp_bytes'], base['temp_bytes'])} | "
                f"{_ratio(r['compile_s'], base['compile_s'])} | {r['step_ratio']:.2f} |"
            )

    def summary(name: str) -> str:
        parts = []
        for n in sorted({r["n"] for r in rows}):
            ring = next(r for r in rows if r["n"] == n and r["variant"] == name)
            base = next(r for r in rows if r["n"] == n and r["variant"] == BASELINE)
            extra = ring["temp_bytes"] - base["temp_bytes"]
            parts.append(
                f"n={n}: temp {_ratio(ring['temp_bytes'], base['temp_bytes'])} "
                f"({extra:+d} bytes), compile {_ratio(ring['compile_s'], base['compile_s'])}"
            )
        return f"{name} / TPDense: " + "; ".join(parts) + "."

    ring = {r["n"]: r["compile_s"] for r in rows if r["variant"] == RING}
    growth = ", ".join(f"n={n}: {ring[n] / ring[min(ring)]:.2f}x" for n in sorted(ring))
    return (
        f"MLP block {D_MODEL} -> {D_HIDDEN} -> {D_MODEL}, {TOKENS} tokens, float32, one "
        "value_and_grad step. Ratios are to eqpar TPDense in the same run; compile ratio: "
        f"medians of {COMPILES} compilations each, taken in turns; step ratio: median of "
        f"{REPEATS} runs alternating with TPDense, on simulated CPU devices sharing the host's "
        "cores (no overlap is visible there).\n\n"
        + "\n".join(lines)
        + f"\n\n{summary(RING)}\n\n{summary(RING_BOTH)}\n\n"
        + "Where TPAsyncDense keeps an all-gather in training, a ring would sum one product per "
        "block into an accumulator (the up projection's output, the down projection's input "
        "gradient), and without a fused multiply-accumulate each product is a second "
        "accumulator-sized buffer, here at least the (n - 1) / n of the gathered array that "
        f"the all-gather adds. Forced onto the ring: {summary(RING_ALL)}\n\n"
        + f"TPAsyncDense compile time relative to n={min(ring)}: {growth}.\n"
    )


def main() -> str:
    rows = []
    for n in (2, 4, 8):
        rows.extend(measure(n))
    return table(rows)


if __name__ == "__main__":
    sys.stdout.write(main())
