"""A small decoder-only transformer language model in plain Equinox, and the plan that makes
it parallel.

Used by `train_lm.py` (on one process or many) and `data.py` (its corpus). The model is
written the way Equinox's documentation writes one: `eqx.nn` layers, a block that works on
one example and a `jax.vmap` over the batch (a mixture-of-experts block runs its experts on
the whole batch: routing groups the tokens of every example). The only eqpar pieces inside
it are `body`, an `eqpar.nn.PipelineModule` holding the `num_layers` blocks as one stack in
model order, and with experts the blocks' `eqpar.nn.MixtureOfExperts`.

`PLAN` says how the layers split over the `model` mesh axis (Megatron style: heads of the
attention, hidden units of the MLP) and the vocabulary of the embedding and of the output
head over `model` and `pipe` together (`VOCAB`); `build` applies it with
`eqpar.parallelize`. Inside `eqpar.shard_map` over a `("data", "pipe", "model")` mesh, or
`("data", "pipe", "context", "model")`, `LM.loss` is then the same code as on one device:

- `data`: the batch rows are split over it;
- `pipe`: `body` runs its stages with the GPipe or circular schedule (or, in the trainer,
  1F1B and ZB-H1); every stage holds its block of the embedding's and the head's
  vocabulary and takes part in the lookup and the loss;
- `context`: the sequence is split over it (context parallelism): `build` converts the
  blocks' attention with `eqpar.ContextParallel(causal=True, layout="balanced")` (ring
  attention over the whole sequence), the token arrays are stored in
  `eqpar.context.balance_sequence` order, and the position embedding takes each token's
  global position (`LM.next_token_loss(inputs, targets, positions)`); with `pipe` as well
  the attention all-gathers the keys and values instead (see `plan_for`);
- `model`: each converted layer computes its block and hands on whole activations;
- `expert` (with `LMConfig.num_experts`, where each block's MLP is an
  `eqpar.nn.MixtureOfExperts`): the experts are split over it by `eqpar.ExpertParallel`,
  each expert's hidden units over `model`, and the batch rows over `data` and `expert`.

`model_order` gives the serial form (plain `eqx.nn` layers, the block stack `[L, ...]`),
which is the same for every layout.

**Precision.** The model is built in float32. Under a bfloat16 policy (`PRECISIONS`,
`eqpar.Precision`) the trainer casts its parameters to bfloat16 before they enter
`shard_map`, so the blocks, the pipeline's activations and the collectives run in bfloat16,
while the layer norms and the attention softmax compute in float32 (Equinox's layers and
eqpar's converted attention upcast internally) and `Head` takes the log-softmax and the loss
in float32.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqpar
from eqpar.nn import (
    ColumnParallelLinear,
    ContextParallelAttention,
    MixtureOfExperts,
    PipelineModule,
    vocab_parallel_cross_entropy,
)

DATA, PIPE, CONTEXT, MODEL = "data", "pipe", "context", "model"
EXPERT = "expert"  # the mesh axis the experts are split over (`eqpar.ExpertParallel`)
SCHEDULES = ("gpipe", "circular", "1f1b", "zb-h1", "zb-v", "dualpipe-v")
PRECISIONS = ("float32", "bfloat16")  # names of `eqpar.Precision` presets


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Sizes of the language model (defaults train in about a minute on 2 CPU cores)."""

    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 64
    num_heads: int = 8
    d_hidden: int = 256
    num_layers: int = 8
    # Mixture of experts: with `num_experts > 0` each block's MLP is `num_experts` MLPs of
    # `d_hidden` units, each token routed to `top_k` of them (`eqpar.nn.MixtureOfExperts`).
    num_experts: int = 0
    top_k: int = 2


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


# The auxiliary losses of a mixture of experts, added to the loss for every MoE block.
LOAD_BALANCING_WEIGHT = 0.01
Z_LOSS_WEIGHT = 0.001
# What an MoE block adds to each row's `[3]` of router statistics (see `Block.__call__`).
ROUTER_STATS = ("load_balancing", "z_loss", "dropped")


class Block(eqx.Module):
    """A pre-norm transformer block: causal self-attention, then a gelu MLP, or with
    `config.num_experts` a mixture of gelu MLPs (`moe`; `up` and `down` are then `None`).

    A dense block maps a batch `[batch, seq, d_model]` to the same. An MoE block maps
    `(h, stats)` to the same, `stats` being `[batch, 3]` float32 router statistics to which
    it adds its own (`ROUTER_STATS`: load-balancing loss, z-loss, dropped assignments), the
    same in every row: so they pass through a pipeline or a layer scan as part of the
    activations, and `LM` reads them from any row."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear | None
    down: eqx.nn.Linear | None
    moe: MixtureOfExperts | None

    def __init__(self, config: LMConfig, *, key: PRNGKeyArray):
        attention_key, up_key, down_key = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(config.d_model)
        self.attention = eqx.nn.MultiheadAttention(
            config.num_heads, config.d_model, key=attention_key
        )
        self.norm2 = eqx.nn.LayerNorm(config.d_model)
        if config.num_experts:
            # The dense MLP's kind (gelu, not gated, with biases), once per expert.
            self.up = self.down = None
            self.moe = MixtureOfExperts(
                config.d_model,
                config.d_hidden,
                config.num_experts,
                top_k=config.top_k,
                activation=jax.nn.gelu,
                use_bias=True,
                key=up_key,
            )
        else:
            self.up = eqx.nn.Linear(config.d_model, config.d_hidden, key=up_key)
            self.down = eqx.nn.Linear(config.d_hidden, config.d_model, key=down_key)
            self.moe = None

    def attend(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        """The attention half of the block on one sequence (this device's tokens of it under
        context parallelism), with its residual."""
        if isinstance(self.attention, ContextParallelAttention):
            # A [seq, seq] mask cannot be cut into per-device blocks: the converted attention
            # is causal over the whole split sequence by its own option (`causal=True`).
            causal = None
        else:
            seq = x.shape[0]
            causal = jnp.tril(jnp.ones((seq, seq), bool))
        y = jax.vmap(self.norm1)(x)
        return x + self.attention(y, y, y, causal)

    def example(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        """One sequence through a dense block."""
        assert self.up is not None and self.down is not None, "an MoE block takes the batch"
        up, down = self.up, self.down
        x = self.attend(x)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda t: down(jax.nn.gelu(up(t))))(y)

    def __call__(self, x: Any) -> Any:
        """A batch of sequences (what a pipeline stage gets: one microbatch); `(h, stats)`
        for an MoE block."""
        if self.moe is None:
            return jax.vmap(self.example)(x)
        h, stats = x
        h = jax.vmap(self.attend)(h)
        # The experts take the whole batch of tokens: routing groups them across sequences
        # (`lax.ragged_dot` has no rule for a per-example `vmap`).
        y, losses = self.moe(jax.vmap(jax.vmap(self.norm2))(h))
        own = jnp.stack([losses.load_balancing, losses.z_loss, losses.dropped.astype(jnp.float32)])
        return h + y, stats + own


class Head(eqx.Module):
    """Final norm, unembedding and the mean next-token cross entropy."""

    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear | ColumnParallelLinear

    def __call__(
        self, h: Float[Array, "batch seq d_model"], targets: Int[Array, "batch seq"]
    ) -> Float[Array, ""]:
        logits = jax.vmap(jax.vmap(lambda x: self.unembed(self.norm(x))))(h)
        # The softmax and the loss in float32 whatever the compute dtype (inside
        # `vocab_parallel_cross_entropy` too): bfloat16's 8-bit mantissa would round the
        # log-probabilities.
        if isinstance(self.unembed, ColumnParallelLinear):
            # The plan split the vocabulary (`VOCAB`): these are this device's logits only;
            # the loss takes the softmax over all of them without gathering them.
            losses = vocab_parallel_cross_entropy(logits, targets, axis_name=self.unembed.axis_name)
            return jnp.mean(losses)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


class LM(eqx.Module):
    """Token and position embeddings, `num_layers` blocks, final norm, output head.

    `body` is a `PipelineModule` over the `pipe` axis (the serial form from `model_order`
    holds the stacked blocks `[L, ...]` there instead). With `config.num_experts` the blocks
    are mixtures of experts and the loss adds their auxiliary losses (`loss_and_stats`).
    """

    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    body: PipelineModule | Block
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear
    num_experts: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)

    def __init__(
        self,
        config: LMConfig,
        *,
        num_stages: int = 1,
        num_microbatches: int = 1,
        num_repeats: int = 1,
        remat: str = "none",
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(config.vocab_size, config.d_model, key=keys[0])
        self.position = eqx.nn.Embedding(config.seq_len, config.d_model, key=keys[1])
        layer_keys = jax.random.split(keys[2], config.num_layers)
        self.body = PipelineModule.from_layers(
            eqx.filter_vmap(lambda k: Block(config, key=k))(layer_keys),
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            num_repeats=num_repeats,
            axis_name=PIPE,
            remat=remat,
            broadcast_output=True,
        )
        self.norm = eqx.nn.LayerNorm(config.d_model)
        self.unembed = eqx.nn.Linear(config.d_model, config.vocab_size, use_bias=False, key=keys[3])
        self.num_experts = config.num_experts
        self.num_layers = config.num_layers

    @property
    def head(self) -> Head:
        return Head(self.norm, self.unembed)

    def embed_tokens(
        self, ids: Int[Array, "batch seq"], positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "batch seq d_model"]:
        """Token plus position embeddings; `positions` are the tokens' places in the whole
        sequence (default `0 ... seq - 1`; under context parallelism this device's, from
        `eqpar.context.sequence_positions`)."""
        positions = jnp.arange(ids.shape[1]) if positions is None else positions
        return jax.vmap(jax.vmap(self.embed))(ids) + jax.vmap(self.position)(positions)

    def blocks(self, h: Float[Array, "batch seq d_model"]) -> Any:
        """The blocks on `h`; with experts `(h, stats)`, `stats` `[batch, 3]` the router
        statistics summed over the blocks (see `Block`)."""
        x = (h, jnp.zeros((h.shape[0], len(ROUTER_STATS)), jnp.float32)) if self.num_experts else h
        if isinstance(self.body, PipelineModule):
            return self.body(x)  # inside shard_map
        arrays, static = eqx.partition(self.body, eqx.is_array)  # serial form: scan the stack
        x, _ = lax.scan(lambda x, layer: (eqx.combine(layer, static)(x), None), x, arrays)
        return x

    def loss(self, tokens: Int[Array, "batch seq_plus_1"]) -> Float[Array, ""]:
        """Mean next-token cross entropy of this batch (this data shard inside shard_map)."""
        return self.next_token_loss(tokens[:, :-1], tokens[:, 1:])

    def next_token_loss(
        self,
        inputs: Int[Array, "batch seq"],
        targets: Int[Array, "batch seq"],
        positions: Int[Array, " seq"] | None = None,
    ) -> Float[Array, ""]:
        """Mean cross entropy of predicting `targets` from `inputs` (the token after each
        input), the inputs at `positions` (see `embed_tokens`). Under context parallelism
        these are this device's tokens: each pair stays together, so any order works.
        With experts, the auxiliary losses are added (`loss_and_stats`)."""
        return self.loss_and_stats(inputs, targets, positions)[0]

    def loss_and_stats(
        self,
        inputs: Int[Array, "batch seq"],
        targets: Int[Array, "batch seq"],
        positions: Int[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
        """`next_token_loss` and, with experts, what it is made of: the cross entropy and the
        router statistics (`ROUTER_STATS`), the losses as means over the blocks and the
        dropped assignments as a sum. The loss is the cross entropy plus
        `LOAD_BALANCING_WEIGHT` and `Z_LOSS_WEIGHT` times each block's auxiliary losses.
        Without experts the statistics are `{}`."""
        out = self.blocks(self.embed_tokens(inputs, positions))
        if not self.num_experts:
            return self.head(out, targets), {}
        h, stats = out
        cross_entropy = self.head(h, targets)
        # Every row holds the same sums (the losses are over all tokens): their mean is it.
        balance, z, dropped = jnp.mean(stats, axis=0)
        loss = cross_entropy + LOAD_BALANCING_WEIGHT * balance + Z_LOSS_WEIGHT * z
        return loss, {
            "cross_entropy": cross_entropy,
            "load_balancing": balance / self.num_layers,
            "z_loss": z / self.num_layers,
            "dropped": dropped,
        }


# --- parallelization -----------------------------------------------------------------------

ATTENTION = "body/stages/layers/attention"  # the plan key of the blocks' attention
# The vocabulary of the embedding and of the head is split over `pipe` as well as `model`:
# they are the largest layers (at GPT-2 size 45% of the parameters), and on a pipe axis they
# would otherwise be whole on every stage. Every stage then takes part in the embedding
# lookup and in the loss, of every microbatch.
VOCAB = (MODEL, PIPE)
PLAN = {
    "embed": eqpar.VocabParallel(VOCAB),
    ATTENTION: eqpar.HeadParallel(MODEL),
    "body/stages/layers/up": eqpar.ColumnParallel(MODEL),
    "body/stages/layers/down": eqpar.RowParallel(MODEL),
    "unembed": eqpar.ColumnParallel(VOCAB),
}


MOE = "body/stages/layers/moe"  # the plan key of the blocks' mixture of experts


def plan_for(mesh: eqpar.DeviceMesh, *, experts: bool = False) -> dict[str, eqpar.Style]:
    """`PLAN`, with the attention made context parallel where `mesh` has a `context` axis
    of more than one device: causal attention over the whole sequence in the balanced
    layout, its heads still split over `model`. With `experts` (MoE blocks), the experts
    are split over the `expert` axis where `mesh` has one, each expert's hidden units over
    `model` (`eqpar.ExpertParallel`); without an `expert` axis every device holds every
    expert.

    The attention is ring attention, except with a `pipe` axis too: the 1F1B and ZB-H1
    schedules run each stage inside a `lax.switch` whose branch differs by device, where a
    `ppermute` (the ring's) gives wrong values, so `execute_schedule` refuses it; the
    all-gather strategy has none and serves every schedule."""
    plan = dict(PLAN)
    if experts:
        del plan["body/stages/layers/up"], plan["body/stages/layers/down"]
        if EXPERT in mesh.axis_names:
            plan[MOE] = eqpar.ExpertParallel(axis_name=EXPERT, model_axis_name=MODEL)
    if CONTEXT not in mesh.axis_names or mesh.axis_size(CONTEXT) == 1:
        return plan
    strategy = "all_gather" if mesh.axis_size(PIPE) > 1 else "ring"
    attention = eqpar.ContextParallel(
        CONTEXT, causal=True, layout="balanced", strategy=strategy, head_axis_name=MODEL
    )
    return {**plan, ATTENTION: attention}


def build(
    config: LMConfig,
    mesh: eqpar.DeviceMesh,
    *,
    num_microbatches: int,
    num_repeats: int = 1,
    remat: str = "none",
    key: PRNGKeyArray,
) -> LM:
    """The model for `mesh`: one pipeline stage (or `num_repeats`) per `pipe` device, the
    layers of `plan_for(mesh)` split over `model` (and the attention over `context`). The
    parameters are the same for every mesh."""
    model = LM(
        config,
        num_stages=mesh.axis_size(PIPE),
        num_microbatches=num_microbatches,
        num_repeats=num_repeats,
        remat=remat,
        key=key,
    )
    return eqpar.parallelize(model, plan_for(mesh, experts=config.num_experts > 0), mesh=mesh)


def model_order(model: LM) -> LM:
    """The serial form: plain `eqx.nn` layers and the block stack `[L, ...]` as `body`. It
    does not depend on the layout, so it is what digests and comparisons use."""
    body = model.body
    if isinstance(body, PipelineModule):
        model = eqx.tree_at(lambda m: m.body, model, body.to_layers())
    return eqpar.unparallelize(model)
