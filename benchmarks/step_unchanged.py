"""The one-device step, unchanged, against the `eqpar.shard_map` route, ahead of time.

A GPT-2-small-shaped language model (the example's `lm.Block`s in a Python list, 12 layers,
d_model 768, 12 heads, MLP 3072, vocabulary 50304, 1024 tokens per sequence, float32; for
experts each block's MLP is 8 such MLPs, top-2) is parallelized by a plan and one training
step (loss and gradients, then plain SGD) is compiled two ways on 8 simulated devices:

- `unchanged`: the step written for one device (`eqx.filter_jit` around
  `eqx.filter_value_and_grad(loss)`, or `eqpar.value_and_grad(loss)` for the schedules that
  run the loss inside the pipeline), on the placed model and a batch split over its rows;
  each converted part opens its own region;
- `shard_map`: the documented explicit route, the loss inside `eqpar.shard_map` over every
  axis with `lax.pmean` over the batch (and sequence) axes; for 1F1B and ZB-H1
  `eqpar.value_and_grad(loss)` inside it.

The modes: DP, FSDP, DP x TP (heads, MLP columns and rows over `model`, the output head by
columns, gathered), FSDP x TP, DP x CP (causal ring attention over `context`; the
`shard_map` route splits the sequence itself and passes each token's global position),
DP x CP with the sequence split by the plan (`SplitSequence` on the blocks, called one
sequence at a time with the causal mask given), DP x TP+SP (heads, MLP columns and rows
with `sequence_parallel=True`, the sequence split by the plan), DP x EP (the experts over
`expert`, the batch rows over `data` and `expert`), DP x GPipe,
1F1B and ZB-H1 (4 stages of 4 microbatches over `pipe`) and DP x GPipe x TP; GPT-2-small's
12 heads do not split over 8. The table gives, per device, the collective bytes of the
compiled step (from its HLO) and its temp memory (`memory_analysis()`), exact figures, and
their ratios to the `shard_map` route. Nothing is run: only `lower` and `compile`.
Run: `python benchmarks/step_unchanged.py [--quick]`.
"""

import argparse
import dataclasses
import functools
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
ROUTER_WEIGHT = 0.01  # the load-balancing loss's weight in the loss


class GPT(eqx.Module):
    """Embeddings, a list of the example's blocks (dense, or with `config.num_experts` a
    mixture of experts, which carries router statistics beside the activations), a norm and
    an output head: a model whose forward is written for one device."""

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

    def __call__(self, ids, positions):
        """Logits for a batch of sequences at the given positions (both `[batch, seq]`; each
        block takes the batch, as a pipeline stage takes a microbatch), and the router's
        load-balancing loss (0 without experts)."""
        h = jax.vmap(jax.vmap(self.embed))(ids) + jax.vmap(jax.vmap(self.position))(positions)
        experts = self.blocks[0].moe is not None
        if experts:
            h = (h, jnp.zeros((h.shape[0], 3), jnp.float32))
        for block in self.blocks:
            h = block(h)
        router = 0.0
        if experts:
            h, stats = h
            router = stats[0, 0]
        return jax.vmap(jax.vmap(lambda x: self.unembed(self.norm(x))))(h), router


class ExampleBlock(eqx.Module):
    """The example's dense block on one sequence, with its causal mask given whole: under a
    sequence split each device holds a block of the sequence, from which the whole
    sequence's mask cannot be built (context-parallel attention is causal by its option)."""

    block: lm.Block

    def __call__(self, x, causal):
        b = self.block
        assert b.up is not None and b.down is not None
        up, down = b.up, b.down
        y = jax.vmap(b.norm1)(x)
        mask = None if isinstance(b.attention, eqpar.nn.ContextParallelAttention) else causal
        x = x + b.attention(y, y, y, mask)
        y = jax.vmap(b.norm2)(x)
        return x + jax.vmap(lambda t: down(jax.nn.gelu(up(t))))(y)


class SequenceGPT(GPT):
    """`GPT` with its blocks called one sequence at a time under `jax.vmap`, as
    `SplitSequence` takes them (the sequence first in each example)."""

    def __init__(self, config: lm.LMConfig, *, key):
        super().__init__(config, key=key)
        self.blocks = [ExampleBlock(block) for block in self.blocks]

    def __call__(self, ids, positions):
        h = jax.vmap(jax.vmap(self.embed))(ids) + jax.vmap(jax.vmap(self.position))(positions)
        causal = jnp.tril(jnp.ones((ids.shape[1],) * 2, bool))
        for block in self.blocks:
            h = jax.vmap(block, in_axes=(0, None))(h, causal)
        return jax.vmap(jax.vmap(lambda x: self.unembed(self.norm(x))))(h), 0.0


def loss(model: GPT, inputs, targets, positions):
    logits, router = model(inputs, positions)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
    return nll + ROUTER_WEIGHT * router


def mean_loss(model: GPT, *batch, axes: tuple):
    """The loss inside `shard_map`: each device's, averaged over the axes that split the
    batch and the sequence."""
    return lax.pmean(loss(model, *batch), axes)


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


@eqx.filter_jit
def step(model, loss_fn, *batch):
    """One SGD step, written for one device."""
    value, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
    return value, sgd(model, grads)


@eqx.filter_jit
def scheduled_step(model, loss_fn, *batch):
    """The one-device step of a model whose pipeline runs the loss itself (1F1B, ZB-H1):
    `eqpar.value_and_grad` in place of Equinox's."""
    value, grads = eqpar.value_and_grad(loss_fn)(model, *batch)
    return value, sgd(model, grads)


@eqx.filter_jit
def gradient_step(model, gradient_fn, *batch):
    """The step around a function that returns the loss and gradients itself (the
    `shard_map` route of a scheduled pipeline)."""
    value, grads = gradient_fn(model, *batch)
    return value, sgd(model, grads)


def compile_step(step_fn, model, loss_fn, batch):
    """`step_fn` compiled for abstract arrays (`jax.ShapeDtypeStruct`s with shardings), which
    `eqx.filter_jit` would take for static values."""
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    params, static = eqx.partition(model, is_abstract, is_leaf=is_abstract)
    run = jax.jit(lambda p, b: step_fn(eqx.combine(p, static), loss_fn, *b))
    return run.lower(params, batch).compile()


@dataclasses.dataclass(frozen=True)
class Mode:
    """A mesh (axis sizes in mesh order), a plan, and what the step needs: FSDP storage
    over `data`, experts in the blocks, the loss through `eqpar.value_and_grad`, blocks
    called per sequence whose sequence the plan splits (`SplitSequence`)."""

    axes: dict
    plan: dict
    fsdp: bool = False
    experts: bool = False
    scheduled: bool = False
    split_sequence: bool = False

    @property
    def batch_axes(self) -> tuple:
        """The axes the batch rows are split over (the expert axis is one)."""
        return tuple(n for n in self.axes if n in ("data", "expert"))


def pipeline(stages: int, schedule: str = "gpipe") -> dict:
    """`stages` stages of 4 microbatches over `pipe`; the model's forward takes the batch
    (its leading axis)."""
    return {
        "blocks": eqpar.Pipeline(stages=stages, microbatches=4, batch_axis=0, schedule=schedule)
    }


CONTEXT = {r"blocks/\d+/attention": eqpar.ContextParallel(causal=True)}
SPLIT_CONTEXT = {
    "blocks": eqpar.SplitSequence("context"),
    r"blocks/\d+/block/attention": eqpar.ContextParallel(causal=True),
}
SEQUENCE_PARALLEL = {
    "blocks": eqpar.SplitSequence("model"),
    r"blocks/\d+/block/attention": eqpar.HeadParallel(sequence_parallel=True),
    r"blocks/\d+/block/up": eqpar.ColumnParallel(sequence_parallel=True),
    r"blocks/\d+/block/down": eqpar.RowParallel(sequence_parallel=True),
    "unembed": eqpar.ColumnParallel(gather_output=True),
}
EXPERTS = {r"blocks/\d+/moe": eqpar.ExpertParallel()}
MODES = {
    "DP 8": Mode({"data": 8}, {}),
    "FSDP 8": Mode({"data": 8}, {}, fsdp=True),
    "DP 4 x TP 2": Mode({"data": 4, "model": 2}, TENSOR_PARALLEL),
    "DP 2 x TP 4": Mode({"data": 2, "model": 4}, TENSOR_PARALLEL),
    "FSDP 2 x TP 4": Mode({"data": 2, "model": 4}, TENSOR_PARALLEL, fsdp=True),
    "DP 2 x CP 4": Mode({"data": 2, "context": 4}, CONTEXT),
    "DP 2 x CP 4, split": Mode({"data": 2, "context": 4}, SPLIT_CONTEXT, split_sequence=True),
    "DP 2 x TP+SP 4": Mode({"data": 2, "model": 4}, SEQUENCE_PARALLEL, split_sequence=True),
    "DP 2 x EP 4": Mode({"data": 2, "expert": 4}, EXPERTS, experts=True),
    "DP 2 x GPipe 4": Mode({"data": 2, "pipe": 4}, pipeline(4)),
    "DP 2 x 1F1B 4": Mode({"data": 2, "pipe": 4}, pipeline(4, "1f1b"), scheduled=True),
    "DP 2 x ZB-H1 4": Mode({"data": 2, "pipe": 4}, pipeline(4, "zb-h1"), scheduled=True),
    "DP 2 x GPipe 2 x TP 2": Mode(
        {"data": 2, "pipe": 2, "model": 2}, {**TENSOR_PARALLEL, **pipeline(2)}
    ),
}


def abstract(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) if s else a,
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


def measure(config: lm.LMConfig, batch: int) -> list[dict]:
    models = {}
    rows = []
    for name, mode in MODES.items():
        sized = dataclasses.replace(config, num_experts=8 if mode.experts else 0)
        kind = (mode.experts, mode.split_sequence)
        if kind not in models:
            make = SequenceGPT if mode.split_sequence else GPT
            models[kind] = eqx.filter_eval_shape(make, sized, key=jax.random.key(0))
        model = models[kind]
        mesh = eqpar.DeviceMesh(tuple(mode.axes.values()), tuple(mode.axes))
        parallel = eqpar.parallelize(model, mode.plan)
        specs = eqpar.partition_specs(parallel, mesh=mesh)
        storage = (
            eqpar.FSDP(mesh, axis="data", min_size_bytes=0).partition_specs(parallel)
            if mode.fsdp
            else specs
        )
        placed = abstract(parallel, eqpar.named_shardings(storage, mesh))
        rows_spec = P(mode.batch_axes)
        # (tokens, next tokens, positions: each [batch, seq], rows over the batch axes)
        unchanged_batch = tuple(
            jax.ShapeDtypeStruct(
                (batch, config.seq_len), jnp.int32, sharding=NamedSharding(mesh.jax_mesh, rows_spec)
            )
            for _ in range(3)
        )
        # The shard_map route splits the sequence over `context` itself (each device's
        # tokens with their global positions), unless the plan splits it.
        context = "context" if "context" in mode.axes and not mode.split_sequence else None
        token_spec = P(mode.batch_axes, context)
        in_specs = (specs, token_spec, token_spec, token_spec)
        mean_over = (*mode.batch_axes, *((context,) if context else ()))
        if mode.scheduled:
            grad_specs = eqpar.partition_specs(parallel, mesh=mesh)
            routed = eqpar.shard_map(
                eqpar.value_and_grad(loss),
                mesh=mesh,
                in_specs=in_specs,
                out_specs=(P(), grad_specs),
            )
            routes = (("unchanged", scheduled_step, loss), ("shard_map", gradient_step, routed))
        else:
            routed = eqpar.shard_map(
                functools.partial(mean_loss, axes=mean_over),
                mesh=mesh,
                in_specs=in_specs,
                out_specs=P(),
            )
            routes = (("unchanged", step, loss), ("shard_map", step, routed))
        for route, step_fn, loss_fn in routes:
            compiled = compile_step(step_fn, placed, loss_fn, unchanged_batch)
            summary = collective_summary(compiled)
            rows.append(
                {
                    "mode": name,
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
