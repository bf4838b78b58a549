"""The one-device step, unchanged, against the `eqpar.shard_map` route, ahead of time.

A GPT-2-small-shaped language model (the example's `lm.Block`s in a Python list, 12 layers,
d_model 768, 12 heads, MLP 3072, vocabulary 50304, 1024 tokens per sequence, float32) is
parallelized by a plan (for tensor parallelism: heads, MLP columns and rows over `model`, the
output head by columns, gathered; for the pipeline: the blocks in 4 or 2 GPipe stages of 4
microbatches over `pipe`) and one training step (loss and gradients, then plain SGD) is
compiled two ways on 8 simulated devices:

- `unchanged`: the step written for one device (`eqx.filter_jit` around
  `eqx.filter_value_and_grad(loss)`), on the placed model and a batch split over `data`;
  each converted layer opens its own region (`jax.shard_map` over `model`);
- `shard_map`: the documented explicit route, the loss inside `eqpar.shard_map` over every
  axis with `lax.pmean` over `data`.

For each mode (DP, FSDP, DP x TP, FSDP x TP, DP x GPipe, DP x GPipe x TP; GPT-2-small's 12
heads do not split over 8) the table gives, per device, the
collective bytes of the compiled step (from its HLO) and its temp memory
(`memory_analysis()`), exact figures, and their ratios to the `shard_map` route. Nothing is
run: only `lower` and `compile`. Run: `python benchmarks/step_unchanged.py [--quick]`.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import pathlib

import equinox as eqx
import jax.numpy as jnp
from _hlo import collective_summary, format_bytes, memory_figures
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import lm

import eqpar

TENSOR_PARALLEL = {
    r"blocks/\d+/attention": eqpar.HeadParallel(),
    r"blocks/\d+/up": eqpar.ColumnParallel(),
    r"blocks/\d+/down": eqpar.RowParallel(),
    "unembed": eqpar.ColumnParallel(gather_output=True),
}
LR = 0.1


class GPT(eqx.Module):
    """Embeddings, a list of the example's dense blocks, a norm and an output head: a model
    whose forward is written for one device."""

    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, config: lm.LMConfig, *, key):
        keys = jax.random.split(key, 3 + config.num_layers)
        self.embed = eqx.nn.Embedding(config.vocab_size, config.d_model, key=keys[0])
        self.position = eqx.nn.Embedding(config.seq_len, config.d_model, key=keys[1])
        self.blocks = [lm.Block(config, key=k) for k in keys[3:]]
        self.norm = eqx.nn.LayerNorm(config.d_model)
        self.unembed = eqx.nn.Linear(config.d_model, config.vocab_size, use_bias=False, key=keys[2])

    def __call__(self, ids):
        """Logits for a batch of sequences (each block takes the batch, as a pipeline stage
        takes a microbatch)."""
        positions = jax.vmap(self.position)(jnp.arange(ids.shape[1]))
        h = jax.vmap(jax.vmap(self.embed))(ids) + positions
        for block in self.blocks:
            h = block(h)
        return jax.vmap(jax.vmap(lambda x: self.unembed(self.norm(x))))(h)


def loss(model: GPT, tokens):
    logits = model(tokens[:, :-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))


@eqx.filter_jit
def step(model, loss_fn, tokens):
    """One SGD step, written for one device."""
    value, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
    return value, eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def compile_step(model, loss_fn, tokens):
    """`step` compiled for abstract arrays (`jax.ShapeDtypeStruct`s with shardings), which
    `eqx.filter_jit` would take for static values."""
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    params, static = eqx.partition(model, is_abstract, is_leaf=is_abstract)
    run = jax.jit(lambda p, t: step(eqx.combine(p, static), loss_fn, t))
    return run.lower(params, tokens).compile()


def pipeline(stages: int) -> dict:
    """GPipe over `pipe`; the model's forward takes the batch (its leading axis)."""
    return {"blocks": eqpar.Pipeline(stages=stages, microbatches=4, batch_axis=0)}


MODES = {  # name: (mesh shape (data, pipe, model), FSDP over data, plan)
    "DP 8": ((8, 1, 1), False, {}),
    "FSDP 8": ((8, 1, 1), True, {}),
    "DP 4 x TP 2": ((4, 1, 2), False, TENSOR_PARALLEL),
    "DP 2 x TP 4": ((2, 1, 4), False, TENSOR_PARALLEL),
    "FSDP 2 x TP 4": ((2, 1, 4), True, TENSOR_PARALLEL),
    "DP 2 x GPipe 4": ((2, 4, 1), False, pipeline(4)),
    "DP 2 x GPipe 2 x TP 2": ((2, 2, 2), False, {**TENSOR_PARALLEL, **pipeline(2)}),
}
AXES = ("data", "pipe", "model")


def abstract(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) if s else a,
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


def measure(config: lm.LMConfig, batch: int) -> list[dict]:
    model = eqx.filter_eval_shape(lambda: GPT(config, key=jax.random.key(0)))
    rows = []
    for mode, (shape, fsdp, plan) in MODES.items():
        mesh = eqpar.DeviceMesh(shape, AXES)
        parallel = eqpar.parallelize(model, plan)
        specs = eqpar.partition_specs(parallel, mesh=mesh)
        storage = (
            eqpar.FSDP(mesh, axis="data", min_size_bytes=0).partition_specs(parallel)
            if fsdp
            else specs
        )
        placed = abstract(parallel, eqpar.named_shardings(storage, mesh))
        tokens = jax.ShapeDtypeStruct(
            (batch, config.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh.jax_mesh, P("data"))
        )
        routed = eqpar.shard_map(
            lambda m, t: lax.pmean(loss(m, t), "data"),
            mesh=mesh,
            in_specs=(specs, P("data")),
            out_specs=P(),
        )
        for route, loss_fn in (("unchanged", loss), ("shard_map", routed)):
            compiled = compile_step(placed, loss_fn, tokens)
            summary = collective_summary(compiled)
            rows.append(
                {
                    "mode": mode,
                    "route": route,
                    "bytes": summary.total_bytes,
                    "counts": dict(summary.counts),
                    "temp": memory_figures(compiled)["temp"],
                }
            )
    return rows


def table(rows: list[dict], config: lm.LMConfig, batch: int) -> str:
    lines = [
        "| mode | route | collective bytes/device | ratio | collectives | temp/device | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        base = next(r for r in rows if r["mode"] == mode and r["route"] == "shard_map")
        for r in (r for r in rows if r["mode"] == mode):
            counts = ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items()))
            lines.append(
                f"| {mode} | {r['route']} | {format_bytes(r['bytes'])} | "
                f"{r['bytes'] / base['bytes']:.3f} | {counts} | {format_bytes(r['temp'])} | "
                f"{r['temp'] / base['temp']:.3f} |"
            )
    return (
        f"{config.num_layers} layers, d_model {config.d_model}, {config.num_heads} heads, MLP "
        f"{config.d_hidden}, vocabulary {config.vocab_size}, {config.seq_len} tokens x "
        f"{batch} sequences, float32; one SGD step compiled ahead of time on 8 simulated "
        "devices. Ratios are to the `shard_map` route of the same mode.\n\n"
        + "\n".join(lines)
        + "\n"
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4-layer model of width 256")
    args = parser.parse_args(argv)
    if args.quick:
        config = lm.LMConfig(
            vocab_size=512, d_model=256, num_heads=8, num_layers=4, d_hidden=1024, seq_len=128
        )
    else:
        config = lm.LMConfig(
            vocab_size=50304, d_model=768, num_heads=12, num_layers=12, d_hidden=3072,
            seq_len=1024,
        )  # fmt: skip
    batch = 8
    return table(measure(config, batch), config, batch)


if __name__ == "__main__":
    sys.stdout.write(main())
