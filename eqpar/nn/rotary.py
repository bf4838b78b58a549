"""Rotary positions on a split sequence: each token rotated by its place in the whole sequence.

`eqx.nn.RotaryPositionalEmbedding` numbers the rows it is given `0, 1, ...`. Under context
parallelism a device holds `seq / n` tokens, so the serial layer would give every device's
block the first block's positions. `eqpar.parallelize` converts the layer where its plan
splits the sequence (`ParallelRotaryEmbedding`), and the author's `process_heads` keeps
calling it unchanged.
"""

from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import bound_axis_size
from .._splits import open_splits, split_of
from .._vma import varies_over
from ..context import sequence_positions
from ._twins import rebuilt

__all__ = ["ParallelRotaryEmbedding"]


class ParallelRotaryEmbedding(eqx.nn.RotaryPositionalEmbedding):
    """`eqx.nn.RotaryPositionalEmbedding` for a sequence split over mesh axes.

    Given this device's block of a sequence (`[seq / n, embedding_size]`, e.g. one head of
    the query inside a `ContextParallelAttention`'s `process_heads`), it rotates row `i` by
    the angle of the row's global position, `eqpar.context.sequence_positions` (in the
    `"contiguous"` or `"balanced"` layout of the context axis), so the result is this
    device's rows of what the serial layer gives for the whole sequence. The angle tables
    are the serial layer's own (`precompute_freqs_cis`). An input that is the same on every
    device (a whole sequence) gets the serial layer's result.

    **Arguments:**

    - `rotary`: the `eqx.nn.RotaryPositionalEmbedding` to convert.
    - `sequence_axes`: `(axis_name, layout)` pairs: the axes a sequence is split over from
      the model's inputs onwards (context parallelism). A sequence split by
      `eqpar.nn.scatter_sequence` is found without naming it.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import ParallelRotaryEmbedding

    rotary = eqx.nn.RotaryPositionalEmbedding(8)
    parallel = ParallelRotaryEmbedding(rotary, sequence_axes=(("context", "contiguous"),))
    mesh = eqpar.DeviceMesh((4,), ("context",), devices=jax.devices()[:4])
    x = jax.random.normal(jax.random.key(0), (16, 8))
    run = eqpar.shard_map(
        lambda x: parallel(x), mesh=mesh, in_specs=P("context"), out_specs=P("context")
    )
    assert jnp.allclose(run(x), rotary(x), atol=1e-6)
    ```
    """

    sequence_axes: tuple[tuple[Hashable, str], ...] = eqx.field(static=True, default=())

    def __init__(
        self,
        rotary: eqx.nn.RotaryPositionalEmbedding,
        *,
        sequence_axes: tuple[tuple[Hashable, str], ...] = (("context", "contiguous"),),
    ):
        if not isinstance(rotary, eqx.nn.RotaryPositionalEmbedding):
            raise TypeError(
                f"ParallelRotaryEmbedding: expected an eqx.nn.RotaryPositionalEmbedding; got "
                f"{type(rotary).__name__}."
            )
        self.embedding_size = rotary.embedding_size
        self.theta = rotary.theta
        self.dtype = rotary.dtype
        self.sequence_axes = tuple((axis, layout) for axis, layout in sequence_axes)

    def to_serial(self) -> eqx.nn.RotaryPositionalEmbedding:
        """The `eqx.nn.RotaryPositionalEmbedding` with the same size, theta and dtype."""
        return rebuilt(self, eqx.nn.RotaryPositionalEmbedding)

    def __call__(
        self,
        x: Float[Array, "seq_block embedding_size"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq_block embedding_size"]:
        """`x` rotated by its rows' global positions.

        **Arguments:** as `eqx.nn.RotaryPositionalEmbedding.__call__`; `x` may be this
        device's block of the sequence.

        **Returns:** `[seq_block, embedding_size]`.
        """
        if x.ndim != 2 or x.shape[-1] != self.embedding_size:
            return super().__call__(x, key=key)  # the serial layer's own error
        found = self._global_positions(x)
        if found is None:
            return super().__call__(x, key=key)
        positions, length = found
        # Traced, not evaluated at compile time: that path fails inside shard_map.
        cos, sin = self.precompute_freqs_cis(self.embedding_size, length, self.theta, self.dtype)
        cos = jnp.tile(jnp.take(cos, positions, axis=0), (1, 2))
        sin = jnp.tile(jnp.take(sin, positions, axis=0), (1, 2))
        return (x * cos + self.rotate_half(x) * sin).astype(x.dtype)

    def _global_positions(self, x: Array) -> tuple[Array, int] | None:
        """The global positions of `x`'s rows and the whole sequence's length, or `None`
        when `x` is not a block of a split sequence."""
        block = x.shape[0]
        found = []
        for axis, layout in self.sequence_axes:
            if bound_axis_size(axis) is not None and varies_over(x, axis):
                found.append((axis, layout))
        for split in open_splits():  # a sequence split by scatter_sequence: contiguous
            if split.kind != "sequence" or split_of(x.shape, split.axis_name) != split:
                continue
            if varies_over(x, split.axis_name) and split.axis_name not in dict(found):
                found.append((split.axis_name, "contiguous"))
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(
                f"{type(self).__name__}: the input (shape {x.shape}) is split over the "
                f"sequence on several axes {[axis for axis, _ in found]}; split it on one."
            )
        ((axis, layout),) = found
        positions = sequence_positions(block, axis_name=axis, layout=layout)  # type: ignore[arg-type]
        return positions, block * int(lax.axis_size(axis))
