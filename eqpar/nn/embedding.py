"""Embeddings split over a mesh axis (`VocabParallelEmbedding`, `FeatureParallelEmbedding`) and
the cross-entropy of logits split over the vocabulary (`vocab_parallel_cross_entropy`)."""

from collections.abc import Hashable, Mapping

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import axis_size
from ._twins import adopt, check_block, check_divides, gather_replicated, rebuilt

__all__ = [
    "FeatureParallelEmbedding",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]


class _SplitEmbedding(eqx.nn.Embedding):
    """What the two split embeddings share: the axis, conversion from and to the original."""

    axis_name: Hashable = eqx.field(static=True)

    def __init__(self, embedding: eqx.nn.Embedding, *, axis_name: Hashable = "model"):
        adopt(self, embedding, eqx.nn.Embedding, axis_name)

    def to_serial(self) -> eqx.nn.Embedding:
        """The `eqx.nn.Embedding` with the same table."""
        return rebuilt(self, eqx.nn.Embedding)


class VocabParallelEmbedding(_SplitEmbedding):
    """`eqx.nn.Embedding` with its rows (the vocabulary) split over a mesh axis.

    Each device looks the token up in its block of rows (zeros when the token is another
    device's) and one `psum` gives every device the embedding. Memory for the table falls as
    `1 / n`; communication is one vector per token.

    **Arguments:**

    - `embedding`: the `eqx.nn.Embedding` to convert.
    - `axis_name`: the mesh axis; `num_embeddings` must divide by its size.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import VocabParallelEmbedding

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    table = eqx.nn.Embedding(16, 6, key=jax.random.key(0))
    layer = VocabParallelEmbedding(table)
    ids = jnp.arange(16)
    f = eqpar.shard_map(
        lambda m, ids: jax.vmap(m)(ids), mesh=mesh,
        in_specs=(eqpar.partition_specs(layer), P()), out_specs=P(),
    )
    assert jnp.allclose(f(layer, ids), jax.vmap(table)(ids))
    ```
    """

    def __init__(self, embedding: eqx.nn.Embedding, *, axis_name: Hashable = "model"):
        super().__init__(embedding, axis_name=axis_name)

    def __partition_specs__(self) -> Mapping[str, P]:
        return {"weight": P(self.axis_name, None)}

    def __call__(self, x: Int[Array, ""], *, key: PRNGKeyArray | None = None) -> Array:
        """The embedding of token `x`, the same on every device of the axis.

        **Arguments:** `x`, the token id (an integer array); `key` unused.

        **Returns:** `[embedding_size]` (with `x`'s shape in front, as `eqx.nn.Embedding`).
        """
        del key
        owner = type(self).__name__
        n = axis_size(self.axis_name, owner)
        check_divides(owner, "num_embeddings", self.num_embeddings, n, self.axis_name)
        rows = self.num_embeddings // n
        check_block(owner, "weight", self.weight.shape, (rows, self.embedding_size))
        # As `weight[x]` in the serial layer: negative ids count from the end, ids past the
        # end clamp to the last row.
        x = jnp.clip(jnp.where(x < 0, x + self.num_embeddings, x), 0, self.num_embeddings - 1)
        local = x - lax.axis_index(self.axis_name) * rows
        mine = (local >= 0) & (local < rows)
        found = self.weight[(jnp.clip(local, 0, rows - 1),)]
        return lax.psum(jnp.where(mine[..., None], found, 0), self.axis_name)


def vocab_parallel_cross_entropy(
    logits: Float[Array, "*tokens vocab_block"],
    targets: Int[Array, "*tokens"],
    *,
    axis_name: Hashable = "model",
) -> Float[Array, "*tokens"]:
    """Cross entropy of logits whose vocabulary is split over a mesh axis, without gathering
    them (inside `shard_map`).

    Device `d` of the axis holds the logits of vocabulary entries `[d V/n, (d+1) V/n)`, as a
    `ColumnParallelLinear` head (`eqpar.ColumnParallel(gather_output=False)` on the output
    `eqx.nn.Linear`) gives them. The log-sum-exp is assembled from each device's maximum
    (`pmax`) and sum of exponentials (`psum`), and the target's logit from the one device
    that holds it (`psum`): three reductions of one number per token, where gathering the
    logits would move `V (n-1)/n` numbers per token. Computed in float32 whatever the logits'
    dtype. `jax.nn.log_softmax` and `optax`'s losses need the whole vocabulary on one device,
    which is what this avoids.

    **Arguments:**

    - `logits`: this device's vocabulary block, `[..., V/n]`.
    - `targets`: the target token ids (global, in `[0, V)`), `logits.shape[:-1]`.
    - `axis_name`: the mesh axis (or tuple of axes) the vocabulary is split over.

    **Returns:** `-log softmax(all logits)[target]` per token, `[...]`, the same on every
    device of the axis.

    ```python
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import vocab_parallel_cross_entropy

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    logits = jax.random.normal(jax.random.key(0), (3, 16))
    targets = jnp.array([0, 7, 15])
    f = eqpar.shard_map(
        lambda z, t: vocab_parallel_cross_entropy(z, t, axis_name="model"),
        mesh=mesh, in_specs=(P(None, "model"), P()), out_specs=P(),
    )
    expected = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], -1)[:, 0]
    assert jnp.allclose(f(logits, targets), expected, rtol=1e-6)
    ```
    """
    owner = "vocab_parallel_cross_entropy"
    if jnp.ndim(logits) < 1 or jnp.shape(targets) != jnp.shape(logits)[:-1]:
        raise ValueError(
            f"{owner}: `targets` must have the shape of `logits` without its last (vocabulary) "
            f"axis; got logits {list(jnp.shape(logits))} and targets {list(jnp.shape(targets))}."
        )
    if not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
        raise TypeError(
            f"{owner}: `targets` must be integer token ids, got {jnp.result_type(targets).name}."
        )
    axis_size(axis_name, owner)
    logits = logits.astype(jnp.float32)
    block = logits.shape[-1]
    # The shift only keeps exp() in range; it cancels in the result, so it needs no gradient.
    shift = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), axis_name)
    total = lax.psum(jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1), axis_name)
    local = targets - lax.axis_index(axis_name) * block
    mine = (local >= 0) & (local < block)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, block - 1)[..., None], axis=-1)
    target_logit = lax.psum(jnp.where(mine, picked[..., 0], 0.0), axis_name)
    return jnp.log(total) + shift - target_logit


class FeatureParallelEmbedding(_SplitEmbedding):
    """`eqx.nn.Embedding` with its columns (features) split over a mesh axis.

    Each device looks the token up in its columns and one all-gather joins the blocks. Prefer
    it to `VocabParallelEmbedding` when the vocabulary is small and the embedding wide.

    **Arguments:**

    - `embedding`: the `eqx.nn.Embedding` to convert.
    - `axis_name`: the mesh axis; `embedding_size` must divide by its size.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import FeatureParallelEmbedding

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    table = eqx.nn.Embedding(10, 8, key=jax.random.key(0))
    layer = FeatureParallelEmbedding(table)
    ids = jnp.arange(10)
    f = eqpar.shard_map(
        lambda m, ids: jax.vmap(m)(ids), mesh=mesh,
        in_specs=(eqpar.partition_specs(layer), P()), out_specs=P(),
    )
    assert jnp.allclose(f(layer, ids), jax.vmap(table)(ids))
    ```
    """

    def __init__(self, embedding: eqx.nn.Embedding, *, axis_name: Hashable = "model"):
        super().__init__(embedding, axis_name=axis_name)

    def __partition_specs__(self) -> Mapping[str, P]:
        return {"weight": P(None, self.axis_name)}

    def __call__(self, x: Int[Array, ""], *, key: PRNGKeyArray | None = None) -> Array:
        """The embedding of token `x`, the same on every device of the axis.

        **Arguments:** `x`, the token id (an integer array); `key` unused.

        **Returns:** `[embedding_size]` (with `x`'s shape in front, as `eqx.nn.Embedding`).
        """
        del key
        owner = type(self).__name__
        n = axis_size(self.axis_name, owner)
        check_divides(owner, "embedding_size", self.embedding_size, n, self.axis_name)
        check_block(
            owner, "weight", self.weight.shape, (self.num_embeddings, self.embedding_size // n)
        )
        found = self.weight[(x,)]
        return gather_replicated(found, self.axis_name, found.ndim - 1)
