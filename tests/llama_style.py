"""A small Llama-style language model written the way ports of it to Equinox often are.

Nothing here knows about eqpar: raw weight arrays rather than `eqx.nn.Linear`, its own RMSNorm
and rotary code, a Python list of layers, each knowing its index as a static field, one
sequence per call (the loss `jax.vmap`s over the batch).

`CachedLlama` is the inference-minded variant of the same port: each decoder layer returns
`(x, cache)`, its keys and values, names its cache by a per-instance static key
(`str(id(self))`, which its computation never reads), and the model's loop collects the
caches and returns them with the logits.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ = 64, 32, 4, 64, 2, 8


def rms_norm(x: Float[Array, "seq dim"], weight: Float[Array, " dim"]) -> Float[Array, "seq dim"]:
    return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * weight


def rotate(x: Float[Array, "seq heads size"], positions: Int[Array, " seq"]) -> Array:
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    angles = positions[:, None, None] * freqs
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class LlamaLayer(eqx.Module):
    attention_norm: Array
    wq: Array
    wk: Array
    wv: Array
    wo: Array
    mlp_norm: Array
    w_gate: Array
    w_up: Array
    w_down: Array
    layer_index: int = eqx.field(static=True)

    def __init__(self, layer_index: int, *, key: PRNGKeyArray):
        keys = jax.random.split(key, 7)
        scale = DIM**-0.5
        self.attention_norm = jnp.ones(DIM)
        self.wq, self.wk, self.wv, self.wo = (
            jax.random.normal(k, (DIM, DIM)) * scale for k in keys[:4]
        )
        self.mlp_norm = jnp.ones(DIM)
        self.w_gate = jax.random.normal(keys[4], (DIM, HIDDEN)) * scale
        self.w_up = jax.random.normal(keys[5], (DIM, HIDDEN)) * scale
        self.w_down = jax.random.normal(keys[6], (HIDDEN, DIM)) * HIDDEN**-0.5
        self.layer_index = layer_index

    def __call__(self, x: Float[Array, "seq dim"], positions: Int[Array, " seq"]) -> Array:
        return decoder_layer(self, x, positions)[0]


def decoder_layer(layer, x: Float[Array, "seq dim"], positions: Int[Array, " seq"]) -> tuple:
    """Attention and MLP of a layer holding the weights of `LlamaLayer`: `(output, (keys,
    values))`, the keys rotated, both `[seq, heads, head_size]`."""
    seq = x.shape[0]
    h = rms_norm(x, layer.attention_norm)
    heads = lambda w: (h @ w).reshape(seq, HEADS, DIM // HEADS)
    q, k, v = (
        rotate(heads(layer.wq), positions),
        rotate(heads(layer.wk), positions),
        heads(layer.wv),
    )
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + attended.reshape(seq, DIM) @ layer.wo
    h = rms_norm(x, layer.mlp_norm)
    return x + (jax.nn.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down, (k, v)


class Llama(eqx.Module):
    embedding: Array
    layers: list[LlamaLayer]
    norm: Array

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.embedding = jax.random.normal(k1, (VOCAB, DIM)) * 0.1
        self.layers = [LlamaLayer(i, key=k) for i, k in enumerate(jax.random.split(k2, LAYERS))]
        self.norm = jnp.ones(DIM)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = self.embedding[tokens]
        positions = jnp.arange(tokens.shape[0])
        for layer in self.layers:
            x = layer(x, positions)
        return rms_norm(x, self.norm) @ self.embedding.T  # tied unembedding


def loss(model: Llama, tokens: Int[Array, "batch seq"]) -> Float[Array, ""]:
    logits = jax.vmap(model)(tokens[:, :-1])
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))


def batch(size: int) -> Int[Array, "batch seq_plus_one"]:
    return jax.random.randint(jax.random.key(11), (size, SEQ + 1), 0, VOCAB)


class CachedLlamaLayer(eqx.Module):
    """A decoder layer that returns its keys and values with its output, and keys its cache by
    a per-instance static field."""

    attention_norm: Array
    wq: Array
    wk: Array
    wv: Array
    wo: Array
    mlp_norm: Array
    w_gate: Array
    w_up: Array
    w_down: Array
    cache_key: str = eqx.field(static=True)

    def __init__(self, *, key: PRNGKeyArray):
        weights = LlamaLayer(0, key=key)
        for name in ("attention_norm", "wq", "wk", "wv", "wo", "mlp_norm"):
            setattr(self, name, getattr(weights, name))
        self.w_gate, self.w_up, self.w_down = weights.w_gate, weights.w_up, weights.w_down
        self.cache_key = str(id(self))

    def __call__(
        self, x: Float[Array, "seq dim"], positions: Int[Array, " seq"]
    ) -> tuple[Array, tuple[Array, Array]]:
        return decoder_layer(self, x, positions)


class CachedLlama(eqx.Module):
    embedding: Array
    layers: list[CachedLlamaLayer]
    norm: Array

    def __init__(self, *, key: PRNGKeyArray, layers: int = LAYERS):
        k1, k2 = jax.random.split(key)
        self.embedding = jax.random.normal(k1, (VOCAB, DIM)) * 0.1
        self.layers = [CachedLlamaLayer(key=k) for k in jax.random.split(k2, layers)]
        self.norm = jnp.ones(DIM)

    def __call__(self, tokens: Int[Array, " seq"]) -> tuple[Array, list]:
        x = self.embedding[tokens]
        positions = jnp.arange(tokens.shape[0])
        caches = []
        for layer in self.layers:
            x, cache = layer(x, positions)
            caches.append(cache)
        return rms_norm(x, self.norm) @ self.embedding.T, caches


def cached_loss(model: CachedLlama, tokens: Int[Array, "batch seq"]) -> tuple[Array, list]:
    """The next-token loss, and the caches the model returned (as auxiliary data)."""
    logits, caches = jax.vmap(model)(tokens[:, :-1])
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)), caches
