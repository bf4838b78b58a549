"""Embeddings split over a mesh axis (`VocabParallelEmbedding`, `FeatureParallelEmbedding`) and
the cross-entropy of logits split over the vocabulary (`vocab_parallel_cross_entropy`)."""

from collections.abc import Hashable, Mapping

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, Integer, PRNGKeyArray

from .._axes import axis_size
from .._checks import check_int
from .._vma import varies_over
from ._own_region import call_in_own_region, needs_own_region
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

    def _in_own_region(self, x: Array) -> Array:
        """Called outside `shard_map` over the axis: the lookup inside a region of its own,
        the ids and the embedding whole over the axis."""
        return call_in_own_region(
            type(self).__name__,
            self.axis_name,
            self,
            lambda layer, x: layer(x),
            (x,),
            arg_names=("x",),
            arg_specs=(P(),),
            out_specs=P(),
        )


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
        if needs_own_region(self.axis_name):
            return self._in_own_region(x)
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
    targets: Integer[Array, "*tokens"],
    *,
    axis_name: Hashable = "model",
    ignore_index: int | None = None,
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

    Its serial twin is `-take_along_axis(log_softmax(logits), targets[..., None], -1)[..., 0]`
    on the whole logits, which `optax.softmax_cross_entropy_with_integer_labels` also
    computes, and it reads targets as that indexing does: a target in `[-V, 0)` counts from
    the end of the vocabulary (`-1` is entry `V - 1`), and one outside `[-V, V)` has no logit,
    so its loss is nan (its gradient, as in optax's loss, is the softmax alone); under
    `jax.config.update("jax_debug_nans", True)` it raises where the nan appears. For padding,
    pass `ignore_index` (`-100` is the usual value): don't rely on an out-of-range id, which
    is nan, or on a negative one, which is a real entry of a large vocabulary.

    Logits that are the same on every device of `axis_name` (`in_specs=P()` where the
    vocabulary should be split) are refused at trace time, read from the replication types
    that `shard_map` keeps with `check_vma=True` (unchecked with `check_vma=False`).

    **Arguments:**

    - `logits`: this device's vocabulary block, `[..., V/n]`.
    - `targets`: the target token ids (global, in `[0, V)`; see above for others),
      `logits.shape[:-1]`.
    - `axis_name`: the mesh axis (or tuple of axes) the vocabulary is split over.
    - `ignore_index`: optional target id that marks a position to leave out (padding): its
      loss is 0 and it contributes no gradient, whatever its logits.

    **Returns:** `-log softmax(all logits)[target]` per token, `[...]`, the same on every
    device of the axis (0 where `targets == ignore_index`). Nothing is averaged: the mean
    over the real tokens, as a serial masked loss takes it, is
    `jnp.sum(loss) / jnp.sum(targets != ignore_index)`.

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

    padded = jnp.array([0, 7, -100])  # the last position is padding
    g = eqpar.shard_map(
        lambda z, t: vocab_parallel_cross_entropy(z, t, axis_name="model", ignore_index=-100),
        mesh=mesh, in_specs=(P(None, "model"), P()), out_specs=P(),
    )
    loss = g(logits, padded)
    assert loss[2] == 0 and jnp.allclose(loss[:2], expected[:2], rtol=1e-6)
    mean = jnp.sum(loss) / jnp.sum(padded != -100)  # the mean over the real tokens
    ```
    """
    owner = "vocab_parallel_cross_entropy"
    if jnp.ndim(logits) < 1 or jnp.shape(targets) != jnp.shape(logits)[:-1]:
        raise ValueError(
            f"{owner}: `targets` must have the shape of `logits` without its last (vocabulary) "
            f"axis; got logits {list(jnp.shape(logits))} and targets {list(jnp.shape(targets))}."
        )
    target_type = jnp.result_type(targets)
    if not jnp.issubdtype(target_type, jnp.integer):
        raise TypeError(f"{owner}: `targets` must be integer token ids, got {target_type.name}.")
    if ignore_index is not None:
        ignore_index = check_int(ignore_index, name="ignore_index", owner=owner, minimum=None)
    n = axis_size(axis_name, owner)
    _check_vocabulary_split(owner, logits, axis_name)
    logits = logits.astype(jnp.float32)
    block = logits.shape[-1]
    vocab = block * n
    # Compared and shifted in at least 32 bits: in uint8 (byte-level ids) V = 256 would wrap
    # to 0, and -100 to 156.
    if jnp.iinfo(target_type).bits < 32:
        targets = targets.astype(jnp.int32)
    # The serial twin's indexing: [-V, 0) counts from the end, outside [-V, V) is no entry.
    signed = jnp.issubdtype(target_type, jnp.signedinteger)
    if signed:
        in_range = (targets >= -vocab) & (targets < vocab)
        ids = jnp.where(targets < 0, targets + vocab, targets)
    else:
        in_range = targets < vocab
        ids = targets
    # The shift only keeps exp() in range; it cancels in the result, so it needs no gradient.
    shift = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), axis_name)
    total = lax.psum(jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1), axis_name)
    local = ids - lax.axis_index(axis_name) * block
    mine = (local >= 0) & (local < block)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, block - 1)[..., None], axis=-1)
    target_logit = lax.psum(jnp.where(mine, picked[..., 0], 0.0), axis_name)
    # No logit for an id out of range: nan, and (as the twin's) a gradient of the softmax
    # alone. The nan is computed (log(-1)), not a nan constant: under `jax_debug_nans` JAX then
    # raises FloatingPointError, where a nan constant inside shard_map sends its re-run into a
    # recursion.
    no_logit = jnp.log(jnp.where(in_range, 1.0, -1.0))
    loss = jnp.log(total) + shift - target_logit + no_logit
    if ignore_index is not None and (ignore_index >= 0 or signed):  # no unsigned id is < 0
        loss = jnp.where(targets == ignore_index, 0.0, loss)
    return loss


def _check_vocabulary_split(owner: str, logits: Array, axis_name: Hashable) -> None:
    """Refuse logits typed as the same on every device of an axis the vocabulary is split
    over: each device would count the whole vocabulary as its block (the serial loss plus
    `log n`)."""
    for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
        if varies_over(logits, name) is False:
            raise ValueError(
                f"{owner}: `logits` are the same on every device of axis {name!r}, but their "
                f"last dimension must be this device's block of the vocabulary, split over "
                f"axis_name={axis_name!r}; as they are, the loss would be the serial one plus "
                f"log({axis_size(name, owner)}). Split the vocabulary dimension over the axis: "
                f"in_specs with P(..., {axis_name!r}) on the logits' last dimension, or logits "
                f"from a head converted by `eqpar.ColumnParallel(gather_output=False)`. Logits "
                f"whole on every device need no vocabulary-parallel loss: use "
                f"`optax.softmax_cross_entropy_with_integer_labels`."
            )


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
        if needs_own_region(self.axis_name):
            return self._in_own_region(x)
        n = axis_size(self.axis_name, owner)
        check_divides(owner, "embedding_size", self.embedding_size, n, self.axis_name)
        check_block(
            owner, "weight", self.weight.shape, (self.num_embeddings, self.embedding_size // n)
        )
        found = self.weight[(x,)]
        return gather_replicated(found, self.axis_name, found.ndim - 1)
