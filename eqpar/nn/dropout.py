"""Dropout on split activations: the serial layer's mask, this device's block of it.

`eqpar.parallelize` converts every `eqx.nn.Dropout` of a model (`ParallelDropout`), so a
dropout the author put anywhere, between the two linears of a tensor-parallel MLP, between
sequence-parallel blocks, on a context-parallel sequence, draws the mask the serial model
draws. Where eqpar cannot say which part of the serial activation a block is, the layer
refuses at trace time instead of repeating one mask on every device.
"""

from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from .._axes import bound_axis_size
from .._splits import Split, split_of
from .._vma import varies_over, varying_axes
from ..context import sequence_positions
from ._twins import active_dropout, rebuilt

__all__ = ["ParallelDropout"]


def serial_mask_block(
    key: PRNGKeyArray, keep: Array | float, shape: tuple[int, ...], splits: list[tuple[Split, int]]
) -> Array:
    """This device's block of `jax.random.bernoulli(key, keep, serial_shape)`, where
    `shape` is the block's shape and `splits` (each with its axis size) say how it was cut
    from the serial activation."""
    ndim = len(shape)
    serial_shape = list(shape)
    for split, n in splits:
        if split.kind == "features_of_tokens":
            # [..., tokens / n, n, features / n] is cut from [..., tokens, features].
            serial_shape[-3:] = [shape[-3] * n, shape[-1] * n]
        else:
            serial_shape[split.dim] *= n
    mask = jax.random.bernoulli(key, keep, tuple(serial_shape))
    for split, n in splits:
        if split.kind == "features_of_tokens":
            tokens, features = mask.shape[-2:]
            mask = mask.reshape(*mask.shape[:-2], n, tokens // n, features)
            mask = jnp.swapaxes(mask, -3, -2)
        dim = split.dim if split.dim >= 0 else ndim + split.dim
        if split.layout == "contiguous":
            start = lax.axis_index(split.axis_name) * split.block
            mask = lax.dynamic_slice_in_dim(mask, start, split.block, axis=dim)
        else:
            rows = sequence_positions(split.block, axis_name=split.axis_name, layout="balanced")
            mask = jnp.take(mask, rows, axis=dim)
    return mask


class ParallelDropout(eqx.nn.Dropout):
    """`eqx.nn.Dropout` that draws the serial layer's mask when its input is split.

    `eqpar.parallelize` puts one in place of every `eqx.nn.Dropout` that its plan does not
    name. Inside `shard_map` each device may hold only a block of the activation the serial
    layer saw whole, while every device has the same key: a plain dropout would then use one
    mask for every device's block. This layer finds how its input was split (the record the
    splitting layers keep while they are traced: a column-parallel linear splits the
    features until its row-parallel partner, `scatter_sequence` the sequence until
    `gather_sequence`; a context-parallel axis splits the sequence, `[seq / n, ...]`,
    throughout), draws the mask for the whole activation and applies this device's block of
    it. An input that is the same on every device, or whose key differs per device along
    with it, gets the plain layer's mask.

    When the input differs over one of `axis_names` while its key does not, and no split
    on that axis fits the input's shape, the layer raises: the activation is split in a
    way only the model knows (its own reshaping, a per-token call under `jax.vmap`), so one
    mask per device would be silently wrong. A split fits by its block's size: the last
    dimension for features, the first (each example's sequence) for tokens. An activation
    derived some other way whose dimension happens to have that size (attention weights
    over a sequence as long as a feature block, computed by the author's own attention
    from column-parallel projections) is taken for the split one; attention written with
    `eqx.nn.MultiheadAttention` and a `HeadParallel` style draws its own masks right.
    The author's own subclasses of `eqx.nn.Dropout` are left as they are.

    **Arguments:**

    - `dropout`: the `eqx.nn.Dropout` to convert (its `p` and `inference` are kept).
    - `axis_names`: the mesh axes the plan splits activations over (the axes of its styles).
    - `sequence_axes`: `(axis_name, layout)` pairs: the context-parallel axes among them,
      over which each example's sequence (its first dimension, `[seq / n, ...]`) is split
      from the model's inputs onwards, in the `"contiguous"` or `"balanced"` layout.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar

    class MLP(eqx.Module):  # dropout between the two linears, as many authors write it
        up: eqx.nn.Linear
        dropout: eqx.nn.Dropout
        down: eqx.nn.Linear
        def __call__(self, x, key):
            h = self.dropout(jax.nn.gelu(jax.vmap(self.up)(x)), key=key)
            return jax.vmap(self.down)(h)

    k1, k2 = jax.random.split(jax.random.key(0))
    mlp = MLP(eqx.nn.Linear(4, 16, key=k1), eqx.nn.Dropout(0.5), eqx.nn.Linear(16, 4, key=k2))
    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    plan = {"up": eqpar.ColumnParallel(), "down": eqpar.RowParallel()}
    parallel = eqpar.parallelize(mlp, plan, mesh=mesh)
    assert isinstance(parallel.dropout, eqpar.nn.ParallelDropout)
    x, key = jnp.ones((3, 4)), jax.random.key(1)
    run = eqpar.shard_map(
        lambda m, x, k: m(x, k), mesh=mesh,
        in_specs=(eqpar.partition_specs(parallel), P(), P()), out_specs=P(),
    )
    assert jnp.allclose(run(parallel, x, key), mlp(x, key), atol=1e-5)
    ```
    """

    axis_names: tuple[Hashable, ...] = eqx.field(static=True)
    sequence_axes: tuple[tuple[Hashable, str], ...] = eqx.field(static=True)

    def __init__(
        self,
        dropout: eqx.nn.Dropout,
        *,
        axis_names: tuple[Hashable, ...] = ("model",),
        sequence_axes: tuple[tuple[Hashable, str], ...] = (),
    ):
        if not isinstance(dropout, eqx.nn.Dropout):
            raise TypeError(
                f"ParallelDropout: expected an eqx.nn.Dropout; got {type(dropout).__name__}."
            )
        self.p = dropout.p
        self.inference = dropout.inference
        self.sequence_axes = tuple((axis, layout) for axis, layout in sequence_axes)
        self.axis_names = tuple(
            dict.fromkeys((*axis_names, *(axis for axis, _ in self.sequence_axes)))
        )

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
        """`dropout(x)` with the serial layer's mask for this device's block of `x`.

        **Arguments:** as `eqx.nn.Dropout.__call__`.

        **Returns:** `x` with the mask applied (and scaled by `1 / (1 - p)`).
        """
        if not active_dropout(self, inference, deterministic, key, "Dropout"):
            return x
        assert key is not None
        splits = self._splits(x, key)
        keep = 1 - lax.stop_gradient(self.p)
        if splits:
            mask = serial_mask_block(key, keep, x.shape, splits)
        else:
            mask = jax.random.bernoulli(key, keep, x.shape)
        return jnp.where(mask, x / keep, 0)

    def _splits(self, x: Array, key: PRNGKeyArray) -> list[tuple[Split, int]]:
        """How `x` was cut from the serial activation: one split per axis it is a block over."""
        owner = type(self).__name__
        key_axes = varying_axes(key)
        layouts = dict(self.sequence_axes)
        splits = []
        for axis in self.axis_names:
            names = axis if isinstance(axis, tuple) else (axis,)
            n = bound_axis_size(axis)
            if n is None:
                continue  # not inside shard_map over this axis: nothing is split over it
            varies = varies_over(x, axis)
            if varies is False or key_axes & set(names):
                continue  # the same on every device, or a key of its own per device
            split = split_of(x.shape, axis)
            if split is None and varies and axis in layouts and x.ndim >= 2:
                # Context parallelism: each example's sequence comes first, split from the
                # inputs on. (A one-token input is a per-token call: refused below.)
                split = Split(axis, "sequence", 0, x.shape[0], layouts[axis])
            if split is None:
                if varies is None:
                    continue  # check_vma=False: JAX does not say whether x differs
                raise ValueError(
                    f"{owner}: the input (shape {x.shape}) differs between the devices of "
                    f"axis {axis!r} while its key is the same on each, and no split eqpar made "
                    f"fits it (the features between a ColumnParallel and a RowParallel layer, "
                    f"or the sequence, first in [seq / n, ...], between scatter_sequence and "
                    f"gather_sequence or on a context axis). One mask on every device would "
                    f"repeat the pattern across the blocks. Call the dropout on the activation "
                    f"as the serial model holds it (a whole [seq, ...] per example, not one "
                    f"token at a time under jax.vmap, nor reshaped), or give each device its "
                    f"own key on purpose (`jax.random.fold_in(key, jax.lax.axis_index("
                    f"{axis!r}))`: then the masks are no longer the serial model's)."
                )
            splits.append((split, n))
        if len(splits) > 1 and any(s.kind == "features_of_tokens" for s, _ in splits):
            raise ValueError(
                f"{owner}: the input (shape {x.shape}) is split over several axes "
                f"{[s.axis_name for s, _ in splits]}, one of them by a sequence-parallel "
                f"column linear; eqpar cannot draw that mask. Put the dropout outside the "
                f"column -> row pair, or drop sequence_parallel=True from the pair."
            )
        if len({s.dim for s, _ in splits}) < len(splits):
            raise ValueError(
                f"{owner}: the input (shape {x.shape}) is split over several axes on the "
                f"same dimension; eqpar cannot say which block of the serial mask it holds."
            )
        return splits
