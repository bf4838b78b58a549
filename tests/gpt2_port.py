"""A small GPT-2 written the way hand ports of it to Equinox often are.

Nothing here knows about eqpar: attention by hand with separate query, key and value
`eqx.nn.Linear`s called per token (`jax.vmap(self.q_proj)(x)`), the head count in a plain
`int` field and `x.reshape(seq, self.n_head, -1)`, dropout on the attention weights and on
each residual branch, learned positions sliced by `[:seq_len]`, a Python list of blocks, one
sequence per call (the loss `jax.vmap`s over the batch with a key per example).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

VOCAB, DIM, HEADS, LAYERS, CONTEXT, SEQ = 64, 32, 4, 2, 16, 8
DROPOUT = 0.1


class CausalSelfAttention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    c_proj: eqx.nn.Linear
    attn_dropout: eqx.nn.Dropout
    n_head: int = eqx.field(static=True)

    def __init__(self, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = eqx.nn.Linear(DIM, DIM, key=kq)
        self.k_proj = eqx.nn.Linear(DIM, DIM, key=kk)
        self.v_proj = eqx.nn.Linear(DIM, DIM, key=kv)
        self.c_proj = eqx.nn.Linear(DIM, DIM, key=ko)
        self.attn_dropout = eqx.nn.Dropout(DROPOUT)
        self.n_head = HEADS

    def __call__(self, x: Float[Array, "seq dim"], *, key: PRNGKeyArray | None) -> Array:
        seq = x.shape[0]
        q = jax.vmap(self.q_proj)(x).reshape(seq, self.n_head, -1).transpose(1, 0, 2)
        k = jax.vmap(self.k_proj)(x).reshape(seq, self.n_head, -1).transpose(1, 0, 2)
        v = jax.vmap(self.v_proj)(x).reshape(seq, self.n_head, -1).transpose(1, 0, 2)
        scores = q @ k.transpose(0, 2, 1) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        weights = self.attn_dropout(weights, key=key, inference=key is None)
        out = (weights @ v).transpose(1, 0, 2).reshape(seq, -1)
        return jax.vmap(self.c_proj)(out)


class FusedAttention(CausalSelfAttention):
    """The same attention through `jax.nn.dot_product_attention` (no dropout on the weights,
    which that function does not expose), as ports that want the fused kernel write it."""

    def __call__(self, x: Float[Array, "seq dim"], *, key: PRNGKeyArray | None) -> Array:
        seq = x.shape[0]
        q, k, v = (
            jax.vmap(proj)(x).reshape(seq, self.n_head, -1)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(seq, -1)
        return jax.vmap(self.c_proj)(out)


class MLP(eqx.Module):
    c_fc: eqx.nn.Linear
    c_proj: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.c_fc = eqx.nn.Linear(DIM, 4 * DIM, key=k1)
        self.c_proj = eqx.nn.Linear(4 * DIM, DIM, key=k2)

    def __call__(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class Block(eqx.Module):
    ln_1: eqx.nn.LayerNorm
    attn: CausalSelfAttention
    ln_2: eqx.nn.LayerNorm
    mlp: MLP
    dropout: eqx.nn.Dropout

    def __init__(self, *, key: PRNGKeyArray, fused: bool = False):
        k1, k2 = jax.random.split(key)
        self.ln_1, self.ln_2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.attn = (FusedAttention if fused else CausalSelfAttention)(key=k1)
        self.mlp = MLP(key=k2)
        self.dropout = eqx.nn.Dropout(DROPOUT)

    def __call__(self, x: Float[Array, "seq dim"], *, key: PRNGKeyArray | None) -> Array:
        k1, k2, k3 = (None, None, None) if key is None else jax.random.split(key, 3)
        inference = key is None
        x = x + self.dropout(self.attn(jax.vmap(self.ln_1)(x), key=k1), key=k2, inference=inference)
        h = jax.vmap(self.mlp)(jax.vmap(self.ln_2)(x))
        return x + self.dropout(h, key=k3, inference=inference)


class GPT(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    lm_head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray, fused: bool = False):
        keys = jax.random.split(key, LAYERS + 3)
        self.wte = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.wpe = eqx.nn.Embedding(CONTEXT, DIM, key=keys[1])
        self.blocks = [Block(key=k, fused=fused) for k in keys[2:-1]]
        self.ln_f = eqx.nn.LayerNorm(DIM)
        self.lm_head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=keys[-1])

    def __call__(self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray | None = None) -> Array:
        seq = tokens.shape[0]
        x = jax.vmap(self.wte)(tokens) + self.wpe.weight[:seq]
        keys = [None] * LAYERS if key is None else list(jax.random.split(key, LAYERS))
        for block, block_key in zip(self.blocks, keys, strict=True):
            x = block(x, key=block_key)
        return jax.vmap(self.lm_head)(jax.vmap(self.ln_f)(x))


def loss(model: GPT, tokens: Int[Array, "batch seq_plus_one"], keys: Array) -> Float[Array, ""]:
    logits = jax.vmap(lambda t, k: model(t, key=k))(tokens[:, :-1], keys)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def batch(size: int) -> tuple[Int[Array, "batch seq_plus_one"], Array]:
    tokens = jax.random.randint(jax.random.key(1), (size, SEQ + 1), 0, VOCAB)
    return tokens, jax.random.split(jax.random.key(2), size)
