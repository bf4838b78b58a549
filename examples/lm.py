"""A small decoder-only transformer language model in plain Equinox, parallel with eqpar.

Shared by `train_lm.py` (one host) and `multihost.py` (several processes). The model keeps the
global view of every parameter: `layers` is one stack of `num_layers` blocks in model order,
whatever the mesh, so a checkpoint written with one layout restores under any other.

Inside `shard_map` over a `("data", "pipe", "model")` mesh:

- `data`: the batch is split; gradients are averaged by the transpose of the replication.
- `model`: features and heads are split (Megatron style, `eqpar.nn` blocks); the embedding is
  split on features, the output head on the vocabulary (a vocabulary-parallel cross entropy).
- `pipe`: the layer stack is split into contiguous stages (GPipe, 1F1B) or interleaved ones
  (circular), run by `eqpar.pipeline`.
"""

import dataclasses
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqpar._declare import prefixed, stacked_partition_specs
from eqpar.nn import TPAttentionBlock, TPDense, TPLayerNorm, TPMLPBlock
from eqpar.nn.pipeline import ScannedLayers
from eqpar.pipeline import execute_1f1b, execute_circular_pipeline, execute_pipeline

DATA, PIPE, MODEL = "data", "pipe", "model"
SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Sizes of the language model (defaults train in about a minute on 2 CPU cores)."""

    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 64
    num_heads: int = 8
    d_hidden: int = 256
    num_layers: int = 8


# --- data ----------------------------------------------------------------------------------

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "every child", "the robot"]
_VERBS = ["sees", "likes", "finds", "builds", "paints", "follows"]
_OBJECTS = ["a red ball", "the moon", "two birds", "a small house", "the river", "green tea"]
_ENDINGS = [".", " today.", " again.", " at night.", " with care."]


def make_corpus(num_chars: int, *, seed: int = 0) -> str:
    """Generated English-like text (no download): random sentences from a tiny grammar."""
    rng = np.random.default_rng(seed)
    parts: list[str] = []
    length = 0
    while length < num_chars:
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
            f"{rng.choice(_ENDINGS)} "
        )
        parts.append(sentence)
        length += len(sentence)
    return "".join(parts)[:num_chars]


def encode(text: str, vocab_size: int) -> np.ndarray:
    """Characters to token ids (byte value modulo the vocabulary)."""
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.int32) % vocab_size


class Batches:
    """Deterministic batches of `seq_len + 1` tokens; `position` is the only state."""

    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int = 0):
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed

    def batch(self, position: int) -> np.ndarray:
        """The batch at `position` (same position -> same batch, on every process)."""
        rng = np.random.default_rng([self.seed, position])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        return np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])


# --- model ---------------------------------------------------------------------------------


class Block(eqx.Module):
    """Pre-norm transformer block on feature-sharded activations `[batch, seq, d / n]`."""

    norm1: TPLayerNorm
    attention: TPAttentionBlock
    norm2: TPLayerNorm
    mlp: TPMLPBlock

    def __init__(self, config: LMConfig, *, use_ring: bool, key: PRNGKeyArray):
        attention_key, mlp_key = jax.random.split(key)
        self.norm1 = TPLayerNorm(config.d_model, model_axis_name=MODEL)
        self.attention = TPAttentionBlock(
            config.d_model,
            num_heads=config.num_heads,
            model_axis_name=MODEL,
            use_ring=use_ring,
            key=attention_key,
        )
        self.norm2 = TPLayerNorm(config.d_model, model_axis_name=MODEL)
        self.mlp = TPMLPBlock(
            config.d_model, config.d_hidden, model_axis_name=MODEL, use_ring=use_ring, key=mlp_key
        )

    def __call__(self, x: Float[Array, "batch seq features"]) -> Float[Array, "batch seq features"]:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(eqx.Module):
    """A `[num, d_model]` table sharded on features, so a lookup needs no communication."""

    weight: Float[Array, "num d_model"]

    def __init__(self, num: int, d_model: int, *, key: PRNGKeyArray):
        self.weight = 0.02 * jax.random.normal(key, (num, d_model))

    def __partition_specs__(self) -> Mapping[str, P]:
        return {"weight": P(None, MODEL)}

    def __call__(self, ids: Int[Array, "..."]) -> Float[Array, "... features"]:
        return jnp.take(self.weight, ids, axis=0)


class LM(eqx.Module):
    """Token + position embedding, `num_layers` blocks, final norm, vocabulary-parallel head."""

    embed: Embedding
    position: Embedding
    layers: ScannedLayers  # [num_layers, ...] in model order
    norm: TPLayerNorm
    unembed: TPDense

    def __init__(self, config: LMConfig, *, use_ring: bool = False, key: PRNGKeyArray):
        keys = jax.random.split(key, 4)
        self.embed = Embedding(config.vocab_size, config.d_model, key=keys[0])
        self.position = Embedding(config.seq_len, config.d_model, key=keys[1])
        layer_keys = jax.random.split(keys[2], config.num_layers)
        self.layers = ScannedLayers(
            eqx.filter_vmap(lambda k: Block(config, use_ring=use_ring, key=k))(layer_keys)
        )
        self.norm = TPLayerNorm(config.d_model, model_axis_name=MODEL)
        self.unembed = TPDense(
            config.d_model,
            config.vocab_size,
            model_axis_name=MODEL,
            tp_mode="gather",
            use_bias=False,
            key=keys[3],
        )

    def __partition_specs__(self) -> Mapping[str, P]:
        # The layer axis is cut into contiguous pipeline stages: device p holds layers
        # [p * L / S, (p + 1) * L / S) (or, for the circular schedule, the device-major order
        # made by `to_device_major`).
        specs = {
            **prefixed("embed", self.embed.__partition_specs__()),
            **prefixed("position", self.position.__partition_specs__()),
            **prefixed("layers/layers", stacked_partition_specs(self.layers.layers, PIPE)),
            **prefixed("norm", self.norm.__partition_specs__()),
            **prefixed("unembed", self.unembed.__partition_specs__()),
        }
        return specs

    def embed_tokens(self, ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq features"]:
        return self.embed(ids) + self.position.weight[None, : ids.shape[1]]

    def head_loss(
        self, h: Float[Array, "batch seq features"], targets: Int[Array, "batch seq"]
    ) -> Float[Array, ""]:
        return vocab_parallel_cross_entropy(self.unembed(self.norm(h)), targets, MODEL)


def vocab_parallel_cross_entropy(
    logits: Float[Array, "*batch vocab_block"], targets: Int[Array, "*batch"], axis_name: str
) -> Float[Array, ""]:
    """Mean cross entropy of logits whose vocabulary axis is sharded over `axis_name`."""
    block = logits.shape[-1]
    start = lax.axis_index(axis_name) * block
    top = lax.pmax(lax.stop_gradient(logits.max(axis=-1)), axis_name)
    sum_exp = lax.psum(jnp.exp(logits - top[..., None]).sum(axis=-1), axis_name)
    local = targets - start
    mine = (local >= 0) & (local < block)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, block - 1)[..., None], axis=-1)[..., 0]
    target_logit = lax.psum(jnp.where(mine, picked, 0.0), axis_name)
    return jnp.mean(jnp.log(sum_exp) + top - target_logit)


# --- pipeline order ------------------------------------------------------------------------


def _permute_layers(model: LM, order: np.ndarray) -> LM:
    return eqx.tree_at(
        lambda m: m.layers.layers,
        model,
        jax.tree.map(lambda a: a[order] if eqx.is_array(a) else a, model.layers.layers),
    )


def device_major_order(num_layers: int, num_stages: int, num_repeats: int) -> np.ndarray:
    """Model-order layer indices in the order the circular schedule stores them.

    The model is cut into `S * V` stages of `L / (S * V)` layers; stage `s` lives on device
    `s % S`, as entry `s // S` of that device's stack.
    """
    per_stage = num_layers // (num_stages * num_repeats)
    order = [
        (repeat * num_stages + device) * per_stage + i
        for device in range(num_stages)
        for repeat in range(num_repeats)
        for i in range(per_stage)
    ]
    return np.asarray(order)


def to_device_major(model: LM, num_stages: int, num_repeats: int) -> LM:
    """The same model with its layer stack reordered for the circular schedule."""
    if num_repeats == 1:
        return model
    order = device_major_order(model.layers.num_layers, num_stages, num_repeats)
    return _permute_layers(model, order)


def to_model_order(model: LM, num_stages: int, num_repeats: int) -> LM:
    """Undo `to_device_major` (checkpoints always hold the model order)."""
    if num_repeats == 1:
        return model
    order = device_major_order(model.layers.num_layers, num_stages, num_repeats)
    return _permute_layers(model, np.argsort(order))


# --- one training step ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How a step is parallelised: schedule, microbatches, repeats (circular), remat."""

    schedule: str = "gpipe"
    num_microbatches: int = 2
    num_repeats: int = 2
    remat: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}; got {self.schedule!r}.")


class Stage(eqx.Module):
    """A pipeline stage: a slice of the layer stack, optionally rematerialised."""

    stack: ScannedLayers
    remat: bool = eqx.field(static=True)

    def __call__(self, h: Float[Array, "batch seq features"]) -> Float[Array, "batch seq features"]:
        if self.remat:
            return jax.checkpoint(lambda stack, h: stack(h))(self.stack, h)
        return self.stack(h)


class Head(eqx.Module):
    """Final norm, vocabulary-parallel unembedding and loss: the 1F1B schedule's loss_fn."""

    norm: TPLayerNorm
    unembed: TPDense

    def __call__(self, h: Array, targets: Array) -> Array:
        return vocab_parallel_cross_entropy(self.unembed(self.norm(h)), targets, MODEL)


def _pipeline_output(model: LM, h: Array, plan: Parallelism) -> Array:
    num_stages = lax.axis_size(PIPE)
    if plan.schedule == "circular" and num_stages > 1:
        stages = Stage(
            ScannedLayers(
                jax.tree.map(
                    lambda a: a.reshape(plan.num_repeats, -1, *a.shape[1:]),
                    model.layers.layers,
                )
            ),
            plan.remat,
        )
        return execute_circular_pipeline(
            stages,
            h,
            num_microbatches=plan.num_microbatches,
            model_axis_name=PIPE,
            broadcast_output=True,
        )
    return execute_pipeline(
        Stage(model.layers, plan.remat),
        h,
        num_microbatches=plan.num_microbatches,
        model_axis_name=PIPE,
        broadcast_output=True,
    )


def local_loss(model: LM, tokens: Int[Array, "batch seq1"], plan: Parallelism) -> Array:
    """The loss inside `shard_map` (GPipe / circular), averaged over the data axis."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h = _pipeline_output(model, model.embed_tokens(inputs), plan)
    return lax.pmean(model.head_loss(h, targets), DATA)


def local_loss_and_grads_1f1b(
    model: LM, tokens: Int[Array, "batch seq1"], plan: Parallelism
) -> tuple[Array, LM]:
    """Loss and gradients inside `shard_map` with the 1F1B schedule."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    embedding = (model.embed, model.position)
    h, embed_vjp = eqx.filter_vjp(
        lambda e: LM.embed_tokens(eqx.tree_at(lambda m: (m.embed, m.position), model, e), inputs),
        embedding,
    )
    head = Head(model.norm, model.unembed)
    loss, (stage_grads, head_grads, h_grads) = execute_1f1b(
        Stage(model.layers, plan.remat),
        head,
        h,
        targets,
        num_microbatches=plan.num_microbatches,
        model_axis_name=PIPE,
        return_all_grads=True,
    )
    (embed_grads,) = embed_vjp(h_grads)
    grads = eqx.tree_at(
        lambda m: (m.embed, m.position, m.layers, m.norm, m.unembed),
        eqx.filter(model, eqx.is_inexact_array),
        (*embed_grads, stage_grads.stack, head_grads.norm, head_grads.unembed),
    )
    # Every gradient arrives summed over the data axis (execute_1f1b sums those of parameters
    # replicated over it, and the embedding's vjp transposes the replication into a sum);
    # the loss is the mean over data shards, so divide by their number.
    data_shards = lax.axis_size(DATA)
    return lax.pmean(loss, DATA), jax.tree.map(lambda g: g / data_shards, grads)
