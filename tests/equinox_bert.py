"""A small BERT-style classifier written the way Equinox's documentation writes one.

Nothing here knows about eqpar: `eqx.nn.MultiheadAttention` with a padding mask, dropout,
`eqx.nn.Linear` / `LayerNorm` / `Embedding`, a Python list of layers and per-example
`jax.vmap`s. The tests parallelize it with a plan and compare with running it as it is.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

VOCAB, SEQ, DIM, HEADS, HIDDEN, LAYERS, CLASSES = 64, 8, 32, 8, 64, 2, 8


class EmbedderBlock(eqx.Module):
    token_embedder: eqx.nn.Embedding
    position_embedder: eqx.nn.Embedding
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, *, key: PRNGKeyArray):
        token_key, position_key = jax.random.split(key)
        self.token_embedder = eqx.nn.Embedding(VOCAB, DIM, key=token_key)
        self.position_embedder = eqx.nn.Embedding(SEQ, DIM, key=position_key)
        self.layernorm = eqx.nn.LayerNorm(DIM)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(
        self, token_ids: Int[Array, " seq"], *, enable_dropout: bool, key: PRNGKeyArray | None
    ) -> Float[Array, "seq dim"]:
        tokens = jax.vmap(self.token_embedder)(token_ids)
        positions = jax.vmap(self.position_embedder)(jnp.arange(token_ids.shape[0]))
        embedded = jax.vmap(self.layernorm)(tokens + positions)
        return self.dropout(embedded, inference=not enable_dropout, key=key)


class AttentionBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, *, key: PRNGKeyArray):
        self.attention = eqx.nn.MultiheadAttention(
            HEADS, DIM, use_query_bias=True, use_output_bias=True, dropout_p=0.1, key=key
        )
        self.layernorm = eqx.nn.LayerNorm(DIM)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(
        self,
        inputs: Float[Array, "seq dim"],
        mask: Bool[Array, " seq"],
        *,
        enable_dropout: bool,
        key: PRNGKeyArray | None,
    ) -> Float[Array, "seq dim"]:
        pair_mask = mask[:, None] & mask[None, :]
        attention_key, dropout_key = (None, None) if key is None else jax.random.split(key)
        out = self.attention(
            inputs, inputs, inputs, pair_mask, inference=not enable_dropout, key=attention_key
        )
        out = self.dropout(out, inference=not enable_dropout, key=dropout_key)
        return jax.vmap(self.layernorm)(out + inputs)


class FeedForwardBlock(eqx.Module):
    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, *, key: PRNGKeyArray):
        mlp_key, output_key = jax.random.split(key)
        self.mlp = eqx.nn.Linear(DIM, HIDDEN, key=mlp_key)
        self.output = eqx.nn.Linear(HIDDEN, DIM, key=output_key)
        self.layernorm = eqx.nn.LayerNorm(DIM)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(
        self, inputs: Float[Array, " dim"], enable_dropout: bool, key: PRNGKeyArray | None
    ) -> Float[Array, " dim"]:
        hidden = jax.nn.gelu(self.mlp(inputs))
        output = self.dropout(self.output(hidden), inference=not enable_dropout, key=key)
        return self.layernorm(output + inputs)


class TransformerLayer(eqx.Module):
    attention_block: AttentionBlock
    ff_block: FeedForwardBlock

    def __init__(self, *, key: PRNGKeyArray):
        attention_key, ff_key = jax.random.split(key)
        self.attention_block = AttentionBlock(key=attention_key)
        self.ff_block = FeedForwardBlock(key=ff_key)

    def __call__(
        self,
        inputs: Float[Array, "seq dim"],
        mask: Bool[Array, " seq"],
        *,
        enable_dropout: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq dim"]:
        attention_key, ff_key = (None, None) if key is None else jax.random.split(key)
        x = self.attention_block(inputs, mask, enable_dropout=enable_dropout, key=attention_key)
        ff_keys = None if ff_key is None else jax.random.split(ff_key, x.shape[0])
        return jax.vmap(self.ff_block, in_axes=(0, None, 0))(x, enable_dropout, ff_keys)


class Encoder(eqx.Module):
    embedder_block: EmbedderBlock
    layers: list[TransformerLayer]
    pooler: eqx.nn.Linear
    classifier: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        embed_key, layers_key, pool_key, head_key = jax.random.split(key, 4)
        self.embedder_block = EmbedderBlock(key=embed_key)
        self.layers = [TransformerLayer(key=k) for k in jax.random.split(layers_key, LAYERS)]
        self.pooler = eqx.nn.Linear(DIM, DIM, key=pool_key)
        self.classifier = eqx.nn.Linear(DIM, CLASSES, key=head_key)

    def __call__(
        self,
        token_ids: Int[Array, " seq"],
        *,
        enable_dropout: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " classes"]:
        embed_key, layer_key = (None, None) if key is None else jax.random.split(key)
        x = self.embedder_block(token_ids, enable_dropout=enable_dropout, key=embed_key)
        mask = token_ids != 0
        for layer in self.layers:
            this_key, layer_key = (None, None) if layer_key is None else jax.random.split(layer_key)
            x = layer(x, mask, enable_dropout=enable_dropout, key=this_key)
        pooled = jnp.tanh(self.pooler(x[0]))
        return self.classifier(pooled)


def batch(size: int, *, seed: int = 0) -> tuple[Array, Array, Array]:
    """Token ids with padding (id 0) at the end of each row, labels and dropout keys."""
    keys = jax.random.split(jax.random.key(seed), 4)
    tokens = jax.random.randint(keys[0], (size, SEQ), 1, VOCAB)
    lengths = jax.random.randint(keys[1], (size, 1), 3, SEQ + 1)
    tokens = jnp.where(jnp.arange(SEQ)[None] < lengths, tokens, 0)
    labels = jax.random.randint(keys[2], (size,), 0, CLASSES)
    return tokens, labels, jax.random.split(keys[3], size)


def loss(model: Encoder, tokens: Array, labels: Array, keys: Array) -> Array:
    """Mean cross entropy over the rows given, dropout on (each row its own key)."""
    logits = jax.vmap(lambda t, k: model(t, enable_dropout=True, key=k))(tokens, keys)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))
