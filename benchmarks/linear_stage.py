"""A pipeline stage of `eqx.nn.Linear` layers against the same math written on arrays.

The pipeline tutorial builds its stages the way the Equinox documentation writes a model: an
MLP block of two `eqx.nn.Linear` (weights stored `[out, in]`, applied per example under
`jax.vmap`), stacked by `eqx.filter_vmap` and cut into stages by
`PipelineModule.from_layers`. The baseline is the same block written directly on stored
`[in, out]` matrices (`x @ w1 + b1`), with the same parameters transposed once up front. If
the `[out, in]` layout made the compiler copy or transpose weights per step, the Linear
stage's temp would exceed the baseline's; this measures it.

For each batch per microbatch and remat policy, one training step (loss and gradients of
every stage) on a pipeline axis of 4 devices, 4 microbatches, 8 layers, width 512, hidden
2048: temp per device from the compiled program (`memory_analysis`, exact) and step time
(median of paired runs, a ratio in the same process), Linear / direct.

Run: `python benchmarks/linear_stage.py` (`--quick`: one batch size).
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 4)

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from _hlo import format_bytes, memory_figures, paired_median_seconds
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import eqpar
from eqpar.nn import PipelineModule

LAYERS, WIDTH, HIDDEN, STAGES, MICROBATCHES = 8, 512, 2048, 4, 4


class LinearBlock(eqx.Module):
    """Written as in the Equinox documentation: per example, `vmap`ped over the batch."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        up_key, down_key = jax.random.split(key)
        self.up = eqx.nn.Linear(WIDTH, HIDDEN, key=up_key)
        self.down = eqx.nn.Linear(HIDDEN, WIDTH, key=down_key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(lambda t: t + self.down(jax.nn.gelu(self.up(t))))(x)


class DirectBlock(eqx.Module):
    """The same math on `[in, out]` matrices, the batch in the matmul."""

    w_up: jax.Array
    b_up: jax.Array
    w_down: jax.Array
    b_down: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.nn.gelu(x @ self.w_up + self.b_up) @ self.w_down + self.b_down


def step_and_temp(layers: eqx.Module, remat: str, x: jax.Array, mesh: Mesh) -> tuple:
    """The jitted training step of `layers` as a pipeline, its arguments and its temp."""
    module = PipelineModule.from_layers(
        layers, num_stages=STAGES, num_microbatches=MICROBATCHES, remat=remat,
        axis_name="pipe", broadcast_output=True,
    )  # fmt: skip
    arrays, static = eqx.partition(module, eqx.is_array)
    run = eqpar.shard_map(
        lambda m, x: m(x), mesh=mesh, in_specs=(eqpar.partition_specs(module), P()), out_specs=P()
    )
    step = jax.jit(jax.value_and_grad(lambda a, x: jnp.mean(run(eqx.combine(a, static), x) ** 2)))
    return step, (arrays, x), memory_figures(step.lower(arrays, x).compile())["temp"]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description="A pipeline stage of eqx.nn.Linear layers against direct math."
    )
    parser.add_argument("--quick", action="store_true", help="one batch size, fewer runs")
    args = parser.parse_args(argv)
    batches = (64,) if args.quick else (64, 256)
    mesh = Mesh(np.array(jax.devices()[:STAGES]), ("pipe",))
    linear = eqx.filter_vmap(LinearBlock)(jax.random.split(jax.random.key(0), LAYERS))
    direct = DirectBlock(
        jnp.swapaxes(linear.up.weight, 1, 2), linear.up.bias,
        jnp.swapaxes(linear.down.weight, 1, 2), linear.down.bias,
    )  # fmt: skip
    lines = [
        f"{LAYERS} layers of width {WIDTH} (MLP {HIDDEN}) on a pipe axis of {STAGES} devices, "
        f"{MICROBATCHES} microbatches; device: {jax.devices()[0].device_kind}.",
        "",
        "| rows per microbatch | remat | Linear temp | direct temp | temp Linear / direct "
        "| step Linear / direct |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for rows in batches:
        x = jax.random.normal(jax.random.key(1), (MICROBATCHES * rows, WIDTH))
        for remat in ("none", "full"):
            linear_step, linear_args, linear_temp = step_and_temp(linear, remat, x, mesh)
            direct_step, direct_args, direct_temp = step_and_temp(direct, remat, x, mesh)
            linear_s, direct_s = paired_median_seconds(
                (linear_step, linear_args), (direct_step, direct_args),
                repeats=3 if args.quick else 5,
            )  # fmt: skip
            lines.append(
                f"| {rows} | {remat} | {format_bytes(linear_temp)} | {format_bytes(direct_temp)} "
                f"| {linear_temp / direct_temp:.2f}x | {linear_s / direct_s:.2f}x |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main())
