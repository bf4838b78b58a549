"""A small Vision Transformer written the way Equinox's documentation writes one.

Nothing here knows about eqpar: a patch embedding (one `eqx.nn.Linear` on flattened
patches), a class token and learned positions as raw arrays, `eqx.nn.MultiheadAttention`,
an MLP with a dropout between its two linears, a Python list of blocks, one image per call
(the loss `jax.vmap`s over the batch). The tests parallelize it with a plan and compare with
running it as it is.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

IMAGE, PATCH, CHANNELS = 8, 4, 3
DIM, HIDDEN, HEADS, LAYERS, CLASSES = 16, 64, 4, 2, 4
TOKENS = (IMAGE // PATCH) ** 2 + 1  # the patches and the class token
DROPOUT = 0.3


class PatchEmbedding(eqx.Module):
    linear: eqx.nn.Linear
    patch_size: int = eqx.field(static=True)

    def __init__(self, *, key: PRNGKeyArray):
        self.patch_size = PATCH
        self.linear = eqx.nn.Linear(PATCH * PATCH * CHANNELS, DIM, key=key)

    def __call__(self, image: Float[Array, "channels height width"]) -> Float[Array, "n dim"]:
        c, h, w = image.shape
        p = self.patch_size
        patches = image.reshape(c, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0)
        return jax.vmap(self.linear)(patches.reshape(-1, p * p * c))


class AttentionBlock(eqx.Module):
    layer_norm1: eqx.nn.LayerNorm
    layer_norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layer_norm1 = eqx.nn.LayerNorm(DIM)
        self.layer_norm2 = eqx.nn.LayerNorm(DIM)
        self.attention = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.linear1 = eqx.nn.Linear(DIM, HIDDEN, key=k2)
        self.linear2 = eqx.nn.Linear(HIDDEN, DIM, key=k3)
        self.dropout1 = eqx.nn.Dropout(DROPOUT)
        self.dropout2 = eqx.nn.Dropout(DROPOUT)

    def __call__(
        self, x: Float[Array, "n dim"], enable_dropout: bool, key: PRNGKeyArray
    ) -> Float[Array, "n dim"]:
        normed = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(normed, normed, normed)
        hidden = jax.nn.gelu(jax.vmap(self.linear1)(jax.vmap(self.layer_norm2)(x)))
        key1, key2 = jax.random.split(key)
        hidden = self.dropout1(hidden, inference=not enable_dropout, key=key1)
        out = jax.vmap(self.linear2)(hidden)
        out = self.dropout2(out, inference=not enable_dropout, key=key2)
        return x + out


class VisionTransformer(eqx.Module):
    patch_embedding: PatchEmbedding
    positional_embedding: Float[Array, "tokens dim"]
    cls_token: Float[Array, "1 dim"]
    attention_blocks: list[AttentionBlock]
    dropout: eqx.nn.Dropout
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.patch_embedding = PatchEmbedding(key=k1)
        self.positional_embedding = jax.random.normal(k2, (TOKENS, DIM))
        self.cls_token = jax.random.normal(k3, (1, DIM))
        self.attention_blocks = [AttentionBlock(key=k) for k in jax.random.split(k4, LAYERS)]
        self.dropout = eqx.nn.Dropout(DROPOUT)
        self.norm = eqx.nn.LayerNorm(DIM)
        self.head = eqx.nn.Linear(DIM, CLASSES, key=k5)

    def __call__(
        self, image: Float[Array, "channels height width"], enable_dropout: bool, key: PRNGKeyArray
    ) -> Float[Array, " classes"]:
        x = self.patch_embedding(image)
        x = jnp.concatenate([self.cls_token, x], axis=0) + self.positional_embedding
        keys = jax.random.split(key, LAYERS + 1)
        x = self.dropout(x, inference=not enable_dropout, key=keys[0])
        for block, block_key in zip(self.attention_blocks, keys[1:]):
            x = block(x, enable_dropout, block_key)
        return self.head(self.norm(x[0]))


def loss(
    model: VisionTransformer,
    images: Float[Array, "batch channels height width"],
    labels: Int[Array, " batch"],
    keys: PRNGKeyArray,
) -> Float[Array, ""]:
    logits = jax.vmap(lambda image, key: model(image, True, key))(images, keys)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def batch(size: int):
    k1, k2, k3 = jax.random.split(jax.random.key(42), 3)
    images = jax.random.normal(k1, (size, CHANNELS, IMAGE, IMAGE))
    labels = jax.random.randint(k2, (size,), 0, CLASSES)
    return images, labels, jax.random.split(k3, size)
