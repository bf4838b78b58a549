"""Transformer blocks composed from the tensor-parallel layers (Megatron style).

Activations enter and leave each block sharded on the feature axis (`[..., d_model / n]`),
so blocks chain without extra communication: the first projection gathers (column parallel),
the last one reduce-scatters (row parallel).
"""

from collections.abc import Callable, Hashable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import axis_size
from .._checks import check_nonempty_sequence
from ._twins import check_block
from .linear import TPAsyncDense, TPDense

__all__ = ["TPAttentionBlock", "TPLayerNorm", "TPMLPBlock"]


def _layer_class(use_ring: bool) -> type[TPDense]:
    return TPAsyncDense if use_ring else TPDense


class TPMLPBlock(eqx.Module):
    """`down(activation(up(x)))` with `up` column parallel and `down` row parallel.

    **Arguments:**

    - `d_model`, `d_hidden`: feature sizes (each divisible by the axis size at call time).
    - `model_axis_name`: the mesh axis the block is split over.
    - `activation`: elementwise nonlinearity (runs on the local hidden block).
    - `use_ring`: use `TPAsyncDense` (ring-overlapped) instead of `TPDense`.
    - `key`: a `jax.random` key.

    Call it inside `shard_map` on `[..., d_model / n]`; it returns `[..., d_model / n]`.
    The serial twin is `down.to_linear()(activation(up.to_linear()(x)))`.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqpar
    from eqpar.nn import TPMLPBlock

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    block = TPMLPBlock(8, 16, key=jax.random.key(0))
    x = jnp.ones((2, 8))
    out = eqpar.shard_map(
        lambda m, x: m(x), mesh=mesh,
        in_specs=(eqpar.partition_specs(block), P(None, "model")),
        out_specs=P(None, "model"),
    )(block, x)
    up, down = block.up.to_linear(), block.down.to_linear()
    serial = jax.vmap(lambda v: down(jax.nn.gelu(up(v))))(x)
    assert jnp.allclose(out, serial, atol=1e-5)
    ```
    """

    up: TPDense
    down: TPDense
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        model_axis_name: Hashable = "model",
        activation: Callable[[Array], Array] = jax.nn.gelu,
        use_ring: bool = False,
        key: PRNGKeyArray,
    ):
        up_key, down_key = jax.random.split(key)
        layer = _layer_class(use_ring)
        self.up = layer(
            d_model, d_hidden, model_axis_name=model_axis_name, tp_mode="gather", key=up_key
        )
        self.down = layer(
            d_hidden, d_model, model_axis_name=model_axis_name, tp_mode="scatter", key=down_key
        )
        self.activation = activation

    def __call__(
        self, x: Float[Array, "*batch features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch features"]:
        """Apply the block to this device's feature block `[..., d_model / n]`."""
        del key
        return self.down(self.activation(self.up(x)))


class TPAttentionBlock(eqx.Module):
    """Multi-head self-attention with the heads split over a mesh axis.

    `qkv` is one column-parallel projection `d_model -> 3 * d_model` whose output features are
    ordered *head by head* (for each head: its query, key and value, `head_dim` each), so a
    device's contiguous block of rows holds complete heads whatever the parallel size; `out`
    is the row-parallel output projection. Each device attends with its
    `num_heads / n` heads; only the two projections communicate.

    **Arguments:**

    - `d_model`: model width; `num_heads`: number of heads (`d_model % num_heads == 0`, and
      `num_heads` divisible by the axis size at call time).
    - `model_axis_name`: the mesh axis the heads are split over.
    - `causal`: mask future positions.
    - `use_ring`: use `TPAsyncDense` (ring-overlapped) instead of `TPDense`.
    - `key`: a `jax.random` key.

    Call it inside `shard_map` on `[..., seq, d_model / n]`; it returns the same shape.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqpar
    from eqpar.nn import TPAttentionBlock

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    block = TPAttentionBlock(8, num_heads=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 8))  # [seq, d_model]
    run = lambda n: eqpar.shard_map(
        lambda m, x: m(x), mesh=Mesh(np.array(jax.devices()[:n]), ("model",)),
        in_specs=(eqpar.partition_specs(block), P(None, "model")),
        out_specs=P(None, "model"),
    )(block, x)
    # same result on 1 or 2 devices (compared on the host: they live on different devices)
    np.testing.assert_allclose(run(2), run(1), rtol=1e-5, atol=1e-5)
    ```
    """

    qkv: TPDense
    out: TPDense
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    model_axis_name: Hashable = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        *,
        num_heads: int,
        model_axis_name: Hashable = "model",
        causal: bool = True,
        use_ring: bool = False,
        key: PRNGKeyArray,
    ):
        if num_heads < 1 or d_model % num_heads:
            raise ValueError(
                f"TPAttentionBlock: d_model={d_model} must be a positive multiple of "
                f"num_heads={num_heads}."
            )
        qkv_key, out_key = jax.random.split(key)
        layer = _layer_class(use_ring)
        self.qkv = layer(
            d_model, 3 * d_model, model_axis_name=model_axis_name, tp_mode="gather", key=qkv_key
        )
        self.out = layer(
            d_model, d_model, model_axis_name=model_axis_name, tp_mode="scatter", key=out_key
        )
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.causal = causal
        self.model_axis_name = model_axis_name

    def __call__(
        self, x: Float[Array, "*batch seq features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch seq features"]:
        """Attend over this device's heads; `x` is `[..., seq, d_model / n]`."""
        del key
        n = axis_size(self.model_axis_name, "TPAttentionBlock", argument="model_axis_name")
        if x.ndim >= 2:
            check_nonempty_sequence(
                "TPAttentionBlock",
                f"`x` has shape {x.shape}, sequence length {x.shape[-2]} on axis -2",
                x.shape[-2],
            )
        if self.num_heads % n:
            raise ValueError(
                f"TPAttentionBlock: num_heads={self.num_heads} does not divide by the size of "
                f"axis {self.model_axis_name!r} ({n}). Use a head count that is a multiple of {n}."
            )
        qkv = self.qkv(x)  # [..., seq, 3 * d_model / n], head by head
        qkv = qkv.reshape(*qkv.shape[:-1], self.num_heads // n, 3, self.head_dim)
        return self.out(attend(qkv, causal=self.causal))


def attend(qkv: Float[Array, "*batch seq heads 3 head_dim"], *, causal: bool) -> Array:
    """Scaled dot-product attention of packed `[..., seq, heads, 3, head_dim]` projections.

    **Arguments:**

    - `qkv`: queries, keys and values stacked on the second-to-last axis.
    - `causal`: mask future positions.

    **Returns:** `[..., seq, heads * head_dim]`, heads concatenated in order.

    ```python
    import jax.numpy as jnp
    from eqpar.nn.blocks import attend

    assert attend(jnp.ones((4, 2, 3, 5)), causal=True).shape == (4, 10)
    ```
    """
    # `jax.nn.dot_product_attention` does the attending; it takes one batch axis, so any
    # leading axes are folded into one and restored.
    batch, (seq, heads, _, head_dim) = qkv.shape[:-4], qkv.shape[-4:]
    q, k, v = (qkv[..., i, :].reshape(-1, seq, heads, head_dim) for i in range(3))
    mixed = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    return mixed.reshape(*batch, seq, heads * head_dim)


class TPLayerNorm(eqx.Module):
    """Layer normalisation of activations whose feature axis is sharded over a mesh axis.

    The mean and variance are taken over all `d_model` features (a `psum` of the local sums
    across `model_axis_name`), so the result equals `eqx.nn.LayerNorm(d_model)` on the full
    vector; `weight` and `bias` are global `[d_model]` parameters sharded like the features.

    **Arguments:**

    - `d_model`: the global feature size.
    - `model_axis_name`: the mesh axis the features are sharded over.
    - `eps`: added to the variance.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqpar
    from eqpar.nn import TPLayerNorm

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    norm = TPLayerNorm(8)
    x = jax.random.normal(jax.random.key(0), (3, 8))
    out = eqpar.shard_map(
        lambda m, x: m(x), mesh=mesh,
        in_specs=(eqpar.partition_specs(norm), P(None, "model")), out_specs=P(None, "model"),
    )(norm, x)
    assert jnp.allclose(out, jax.vmap(eqx.nn.LayerNorm(8))(x), atol=1e-5)
    ```
    """

    weight: Float[Array, " d_model"]
    bias: Float[Array, " d_model"]
    d_model: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    model_axis_name: Hashable = eqx.field(static=True)

    def __init__(self, d_model: int, *, model_axis_name: Hashable = "model", eps: float = 1e-5):
        self.weight = jnp.ones((d_model,))
        self.bias = jnp.zeros((d_model,))
        self.d_model = d_model
        self.eps = eps
        self.model_axis_name = model_axis_name

    def __partition_specs__(self) -> Mapping[str, P]:
        return {"weight": P(self.model_axis_name), "bias": P(self.model_axis_name)}

    def __call__(
        self, x: Float[Array, "*batch features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch features"]:
        """Normalise this device's feature block `[..., d_model / n]`."""
        del key
        axis = self.model_axis_name
        n = axis_size(axis, "TPLayerNorm", argument="model_axis_name")
        if x.shape[-1] * n != self.d_model:
            raise ValueError(
                f"TPLayerNorm: expected a feature block of d_model / n = {self.d_model} / {n}; "
                f"got input shape {x.shape}."
            )
        for name in ("weight", "bias"):
            check_block("TPLayerNorm", name, getattr(self, name).shape, (self.d_model // n,))
        mean = lax.psum(jnp.sum(x, axis=-1, keepdims=True), axis) / self.d_model
        centered = x - mean
        variance = lax.psum(jnp.sum(centered**2, axis=-1, keepdims=True), axis) / self.d_model
        return centered * lax.rsqrt(variance + self.eps) * self.weight + self.bias
