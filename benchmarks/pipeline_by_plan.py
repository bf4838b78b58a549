"""Pipelines by plan: a model's own forward under GPipe, 1F1B and ZB-H1, memory per device.

A model written per example (an embedding, a Python list of MLP blocks, a head; the loss
`jax.vmap`s it), pipelined over 4 devices with one plan entry on its list of blocks,
`eqpar.Pipeline(stages=4, microbatches=M, schedule=...)`, the step taken by
`eqpar.value_and_grad` inside `shard_map`. For M microbatches of a fixed batch this prints
the temporaries per device (`compiled.memory_analysis()`, exact) of one training step under
GPipe (autodiff through the forward), GPipe with each block rematerialized, 1F1B and ZB-H1,
and each as a ratio to GPipe's in the same run. The point of 1F1B by plan: the schedule
runs the author's head and loss inside the pipeline, so a device keeps the activations of
at most S microbatches, not M.

Run: `python benchmarks/pipeline_by_plan.py` (under a minute on 2 cores); `--help`.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import eqpar  # noqa: E402

STAGES = 4


class Block(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, h: jax.Array) -> jax.Array:  # [seq, width]
        return h + jax.vmap(self.mlp)(h)


class Model(eqx.Module):
    """Written without eqpar in mind: one example per call."""

    embed: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.embed)(x)  # [seq, width]
        for block in self.blocks:
            h = block(h)
        return jax.vmap(self.head)(h)


def make_model(width: int, depth: int) -> Model:
    keys = jax.random.split(jax.random.key(0), depth + 2)
    blocks = [Block(eqx.nn.MLP(width, width, 4 * width, 1, key=k)) for k in keys[2:]]
    return Model(eqx.nn.Linear(width, width, key=keys[0]), blocks,
                 eqx.nn.Linear(width, width, key=keys[1]))  # fmt: skip


def loss_fn(model: Model, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def temp_bytes(model: Model, style: eqpar.Pipeline, batch: tuple) -> int:
    mesh = eqpar.DeviceMesh((STAGES,), ("pipe",), devices=jax.devices()[:STAGES])
    parallel = eqpar.parallelize(model, {"blocks": style}, mesh=mesh)
    grad_specs = eqpar.partition_specs(eqx.filter(parallel, eqx.is_inexact_array))
    step = eqpar.shard_map(
        eqpar.value_and_grad(loss_fn), mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(), P()), out_specs=(P(), grad_specs),
    )  # fmt: skip
    arrays, static = eqx.partition(parallel, eqx.is_array)
    run = jax.jit(lambda a, *b: step(eqx.combine(a, static), *b))
    compiled = run.lower(arrays, *batch).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args(argv)
    model = make_model(args.width, args.depth)
    kx, ky = jax.random.split(jax.random.key(1))
    shape = (args.batch, args.seq, args.width)
    batch = (jax.random.normal(kx, shape), jax.random.normal(ky, shape))
    print(f"{args.depth} blocks of width {args.width} on {STAGES} devices, batch {args.batch} "
          f"x {args.seq} tokens; temporaries per device (KiB), ratio to GPipe's")  # fmt: skip
    print("| M | GPipe | GPipe, remat full | 1F1B | ZB-H1 |")
    print("| --- | --- | --- | --- | --- |")
    for m in args.microbatches:
        styles = {
            "gpipe": eqpar.Pipeline(STAGES, m),
            "remat": eqpar.Pipeline(STAGES, m, remat="full"),
            "1f1b": eqpar.Pipeline(STAGES, m, schedule="1f1b"),
            "zb-h1": eqpar.Pipeline(STAGES, m, schedule="zb-h1"),
        }
        temps = {name: temp_bytes(model, style, batch) for name, style in styles.items()}
        base = temps["gpipe"]
        cells = [f"{temps['gpipe'] / 1024:.0f}"] + [
            f"{temps[name] / 1024:.0f} ({temps[name] / base:.2f}x)"
            for name in ("remat", "1f1b", "zb-h1")
        ]
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
