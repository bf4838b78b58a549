"""Tensor-parallel MLP block: eqpar's layers against two baselines measured in the same run.

For n = 2, 4, 8 devices of a `model` axis, one training step (loss, gradients) of a
column-parallel -> gelu -> row-parallel MLP block, written four ways:

- `eqpar TPDense`: `eqpar.nn.TPMLPBlock` (all-gather / reduce-scatter);
- `eqpar TPAsyncDense`: the same block on ring collectives (`use_ring=True`);
- `(a) shard_map`: the same block written by hand with `jax.shard_map` and
  `lax.all_gather` / `lax.psum_scatter` (baseline for the ratios);
- `(b) jit`: plain `jax.jit` with `NamedSharding`s: the compiler's own partitioning.

Reported per device: bytes received over the interconnect for the step (from the compiled
HLO), temp memory (`memory_analysis`), compile time, and step time; every figure also as a
ratio to baseline (a). Run: `python benchmarks/tensor_parallel.py`.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import eqpar
from eqpar._hlo import collective_bytes, median_seconds, memory_figures
from eqpar.nn import TPMLPBlock

D_MODEL, D_HIDDEN, TOKENS = 256, 1024, 512
REPEATS = 5


def _timed_compile(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _eqpar_step(block, mesh):
    specs = eqpar.partition_specs(block)
    feature = P(None, "model")

    def loss(block, x):
        forward = eqpar.shard_map(
            lambda m, x: m(x), mesh=mesh, in_specs=(specs, feature), out_specs=feature
        )
        return jnp.mean(forward(block, x) ** 2)

    return jax.value_and_grad(loss)


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
        return jnp.mean(forward(*params, x) ** 2)

    return jax.value_and_grad(loss)


def _compiler_step():
    def loss(params, x):
        w_up, b_up, w_down, b_down = params
        hidden = jax.nn.gelu(x @ w_up.T + b_up)
        return jnp.mean((hidden @ w_down.T + b_down) ** 2)

    return jax.value_and_grad(loss)


def _params(block):
    return (block.up.weight, block.up.bias, block.down.weight, block.down.bias)


def measure(n: int) -> list[dict]:
    mesh = Mesh(np.array(jax.devices()[:n]), ("model",))
    x = jax.random.normal(jax.random.key(1), (TOKENS, D_MODEL))
    x_sharded = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
    rows = []
    for name, use_ring in (("eqpar TPDense", False), ("eqpar TPAsyncDense", True)):
        block = TPMLPBlock(D_MODEL, D_HIDDEN, use_ring=use_ring, key=jax.random.key(0))
        specs = eqpar.partition_specs(block)
        block = eqx.filter_jit(lambda b: b)(block)  # plain copy
        block = jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)) if eqx.is_array(a) else a,
            block,
            specs,
        )
        compiled, compile_s = _timed_compile(_eqpar_step(block, mesh), block, x_sharded)
        rows.append(_row(name, n, compiled, compile_s, (block, x_sharded)))

    block = TPMLPBlock(D_MODEL, D_HIDDEN, key=jax.random.key(0))
    layout = (P("model", None), P("model"), P(None, "model"), P("model"))
    params = tuple(
        jax.device_put(p, NamedSharding(mesh, s)) for p, s in zip(_params(block), layout)
    )
    compiled, compile_s = _timed_compile(_hand_written_step(mesh), params, x_sharded)
    rows.append(_row("(a) shard_map by hand", n, compiled, compile_s, (params, x_sharded)))
    compiled, compile_s = _timed_compile(_compiler_step(), params, x_sharded)
    rows.append(_row("(b) jit + NamedSharding", n, compiled, compile_s, (params, x_sharded)))
    return rows


def _row(name, n, compiled, compile_s, args) -> dict:
    return {
        "variant": name,
        "n": n,
        "collective_bytes": collective_bytes(compiled.as_text()),
        "temp_bytes": memory_figures(compiled)["temp"],
        "compile_s": compile_s,
        "step_s": median_seconds(compiled, *args, repeats=REPEATS),
    }


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "n/a"


def table(rows: list[dict]) -> str:
    header = (
        "| n | variant | collective KiB/device | ratio | temp KiB | ratio | compile s | ratio "
        "| step ms | ratio |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for n in sorted({r["n"] for r in rows}):
        group = [r for r in rows if r["n"] == n]
        base = next(r for r in group if r["variant"].startswith("(a)"))
        for r in group:
            lines.append(
                f"| {n} | {r['variant']} | {r['collective_bytes'] / 1024:.0f} | "
                f"{_ratio(r['collective_bytes'], base['collective_bytes'])} | "
                f"{r['temp_bytes'] / 1024:.0f} | {_ratio(r['temp_bytes'], base['temp_bytes'])} | "
                f"{r['compile_s']:.2f} | {_ratio(r['compile_s'], base['compile_s'])} | "
                f"{r['step_s'] * 1e3:.1f} | {_ratio(r['step_s'], base['step_s'])} |"
            )
    ring = {r["n"]: r["compile_s"] for r in rows if r["variant"] == "eqpar TPAsyncDense"}
    growth = ", ".join(f"n={n}: {ring[n] / ring[min(ring)]:.2f}x" for n in sorted(ring))
    return (
        f"MLP block {D_MODEL} -> {D_HIDDEN} -> {D_MODEL}, {TOKENS} tokens, float32, one "
        f"value_and_grad step; step time is the median of {REPEATS} runs on simulated CPU "
        "devices sharing the host's cores (no overlap is visible there; read it as a ratio).\n\n"
        + "\n".join(lines)
        + f"\n\nTPAsyncDense compile time relative to n={min(ring)}: {growth}.\n"
    )


def main() -> str:
    rows = []
    for n in (2, 4, 8):
        rows.extend(measure(n))
    return table(rows)


if __name__ == "__main__":
    sys.stdout.write(main())
