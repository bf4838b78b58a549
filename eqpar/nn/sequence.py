"""Sequence parallelism: splitting activations over the sequence (`scatter_sequence`,
`gather_sequence`) and dropout whose mask is the serial draw's rows (`SequenceParallelDropout`)."""

from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray, Shaped

from .._axes import axis_size
from .._splits import Split, close_split, open_split
from .._vma import varies_over
from ._twins import active_dropout, adopt, check_sequence_layout, gather_replicated, rebuilt
from .dropout import serial_mask_block

__all__ = [
    "SequenceParallelDropout",
    "gather_sequence",
    "scatter_sequence",
]


def scatter_sequence(
    x: Shaped[Array, " seq *rest"], axis_name: Hashable = "model"
) -> Shaped[Array, " seq_block *rest"]:
    """This device's block of a sequence that every device of `axis_name` holds whole.

    Where a sequence-parallel trunk begins (after the embeddings, which need the whole
    sequence for positions and masks), each device keeps `seq / n` consecutive tokens: device
    `d` of `n` keeps tokens `[d * seq / n, (d + 1) * seq / n)`. No communication; the gradient
    flows back to the whole sequence.

    **Arguments:**

    - `x`: `[seq, ...]`, the same on every device of the axis; `seq` must divide by `n`.
    - `axis_name`: the mesh axis the sequence is split over.

    **Returns:** `[seq / n, ...]`, this device's tokens.

    ```python
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import gather_sequence, scatter_sequence

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    x = jnp.arange(8.0)[:, None]
    blocks = eqpar.shard_map(
        lambda x: scatter_sequence(x), mesh=mesh, in_specs=P(), out_specs=P("model")
    )(x)
    assert (blocks == x).all()  # the blocks, laid side by side, are the sequence
    whole = eqpar.shard_map(
        lambda x: gather_sequence(scatter_sequence(x)), mesh=mesh, in_specs=P(), out_specs=P()
    )(x)
    assert (whole == x).all()
    ```
    """
    owner = "scatter_sequence"
    n = axis_size(axis_name, owner)
    if x.ndim == 0 or x.shape[0] % n:
        raise ValueError(
            f"{owner}: x must have a sequence axis first whose length divides by the size of "
            f"axis {axis_name!r} ({n}); got shape {x.shape}. Pad the sequence to a multiple "
            f"of {n} (and mask the padding)."
        )
    if varies_over(x, axis_name):
        raise ValueError(
            f"{owner}: x already differs between the devices of axis {axis_name!r}: it is split "
            f"(or was computed from split values). Scatter the whole sequence once, where the "
            f"sequence-parallel part of the model begins."
        )
    block = x.shape[0] // n
    open_split(Split(axis_name, "sequence", 0, block))
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * block, block, axis=0)


def gather_sequence(
    x: Shaped[Array, " seq_block *rest"], axis_name: Hashable = "model"
) -> Shaped[Array, " seq *rest"]:
    """The whole sequence from each device's block: the inverse of `scatter_sequence`, where a
    sequence-parallel trunk ends (before a head that reads the whole sequence).

    **Arguments:**

    - `x`: `[seq / n, ...]`, this device's tokens.
    - `axis_name`: the mesh axis the sequence is split over.

    **Returns:** `[seq, ...]`, the same on every device of the axis (typed as replicated
    where JAX can say so, so an `out_specs=P()` accepts it).

    ```python
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import gather_sequence

    mesh = eqpar.DeviceMesh((2,), ("model",), devices=jax.devices()[:2])
    x = jnp.arange(6.0)
    whole = eqpar.shard_map(
        gather_sequence, mesh=mesh, in_specs=P("model"), out_specs=P()
    )(x)
    assert (whole == x).all()
    ```
    """
    axis_size(axis_name, "gather_sequence")
    if x.ndim == 0:
        raise ValueError("gather_sequence: x must have a sequence axis first; got a scalar.")
    if varies_over(x, axis_name) is False:
        raise ValueError(
            f"gather_sequence: x is the same on every device of axis {axis_name!r}, so it is not "
            f"split over the sequence; gathering it would repeat it {lax.axis_size(axis_name)} "
            f"times. Gather only what `scatter_sequence` (or a sequence-parallel layer) split."
        )
    close_split(axis_name, ("sequence",))
    return gather_replicated(x, axis_name, 0)


class SequenceParallelDropout(eqx.nn.Dropout):
    """`eqx.nn.Dropout` for activations split over the sequence (sequence parallelism).

    Between sequence-parallel blocks each device holds `seq / n` tokens, and every device has
    the same key. A plain `Dropout` would draw the same mask for every device's block, so
    tokens `t`, `t + seq / n`, ... would share their dropout pattern. This layer draws the
    mask for the whole sequence from the key, as the serial layer does, and applies this
    device's rows of it: the result is the serial layer's, block by block.

    Call it where the serial model calls its dropout on a `[seq, ...]` activation (after an
    attention or a block). A dropout the model calls per token under `jax.vmap`, with one key
    per token, sees no sequence axis; its keys are the model's to split.

    **Arguments:**

    - `dropout`: the `eqx.nn.Dropout` to convert (its `p` and `inference` are kept).
    - `axis_name`: the mesh axis the sequence is split over.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import SequenceParallelDropout

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    dropout = eqx.nn.Dropout(0.5)
    layer = SequenceParallelDropout(dropout)
    x, key = jnp.ones((8, 3)), jax.random.key(0)
    blocks = eqpar.shard_map(
        lambda x, key: layer(x, key=key), mesh=mesh, in_specs=(P("model"), P()),
        out_specs=P("model"),
    )(x, key)
    assert (blocks == dropout(x, key=key)).all()
    ```
    """

    axis_name: Hashable = eqx.field(static=True)

    def __init__(self, dropout: eqx.nn.Dropout, *, axis_name: Hashable = "model"):
        adopt(self, dropout, eqx.nn.Dropout, axis_name)

    def to_serial(self) -> eqx.nn.Dropout:
        """The `eqx.nn.Dropout` with the same `p` and `inference`."""
        return rebuilt(self, eqx.nn.Dropout)

    def __call__(
        self,
        x: Array,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
    ) -> Array:
        """This device's block of `dropout(whole_x, key=key)`.

        **Arguments:** as `eqx.nn.Dropout.__call__`; `x` is this device's block of a
        sequence, `[seq / n, ...]`.

        **Returns:** `x` with the serial layer's mask for these rows applied.
        """
        owner = type(self).__name__
        if not active_dropout(self, inference, deterministic, key, owner):
            return x
        assert key is not None
        n = axis_size(self.axis_name, owner)
        if x.ndim == 0:
            raise ValueError(f"{owner}: x must have a sequence axis first; got a scalar.")
        check_sequence_layout(owner, "x", x, self.axis_name, True)
        keep = 1 - lax.stop_gradient(self.p)
        split = Split(self.axis_name, "sequence", 0, x.shape[0])
        mask = serial_mask_block(key, keep, x.shape, [(split, n)])
        return jnp.where(mask, x / keep, 0)
