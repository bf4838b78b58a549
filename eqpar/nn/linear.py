"""The linear layer split over a mesh axis: one column/row core, and the classes that use it.

`column_linear` and `row_linear` are the one implementation of a column-parallel (output
features split) and a row-parallel (input features split) matmul: with or without gathering
the input or reducing the output, around a ring (`eqpar.collectives`) or as one collective,
over the feature or the sequence axis. Every linear layer of eqpar is one of them:

| layer | core | takes | gives |
| --- | --- | --- | --- |
| `TPDense`, gather mode | column, gathers features | `[..., in/n]` | `[..., out/n]` |
| `TPDense`, scatter mode | row, scatters features | `[..., in/n]` | `[..., out/n]` |
| `TPAsyncDense` | the same around a ring | as `TPDense` | as `TPDense` |
| `ColumnParallelLinear` | column, input whole | `[in]` | `[out/n]` |
| ... with `sequence_parallel` | column, gathers tokens | its token `[in]` | `[n, out/n]` |
| `RowParallelLinear` | row, `psum` | `[in/n]` | `[out]` |
| ... with `sequence_parallel` | row, scatters tokens | `[n, in/n]` | its token's `[out]` |

Every layer stores its parameters in the *global view* (`weight` is `[out_features,
in_features]` exactly as in `eqx.nn.Linear`) and declares how they are sharded through
`__partition_specs__`, so a checkpoint written at one parallel size loads at any other.
"""

from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .. import collectives
from .._axes import axis_size
from .._axes import axis_size as _bound_axis_size
from .._checks import (
    check_column_options,
    check_int,
    columns_in_a_row_fix,
    per_token_sequence_fix,
)
from .._splits import Split, close_split, open_split
from ._heads import mark_column_output
from ._own_region import (
    axis_is_explicit,
    call_in_own_region,
    feature_spec,
    needs_own_region,
)
from ._twins import (
    adopt,
    check_block,
    check_divides,
    check_sequence_layout,
    gather_replicated,
    rebuilt,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPAsyncDense",
    "TPDense",
    "column_linear",
    "row_linear",
    "scale_init",
]


TPMode = Literal["gather", "scatter", "none"]
_MODES = ("gather", "scatter", "none")

Initializer = Callable[[PRNGKeyArray, tuple[int, ...], Any], Array]


def scale_init(init_fn: Initializer, scale_factor: float = 1.0) -> Initializer:
    """An initialiser returning `scale_factor` times what `init_fn` returns.

    Useful to shrink the output projections of residual blocks by `1 / sqrt(2 * depth)`.

    **Arguments:**

    - `init_fn`: any `(key, shape, dtype) -> array` initialiser, e.g. from
      `jax.nn.initializers`.
    - `scale_factor`: the factor applied to the result.

    **Returns:** an initialiser with the same signature.

    ```python
    import jax, jax.numpy as jnp
    from eqpar.nn import scale_init

    init = scale_init(jax.nn.initializers.ones, 0.5)
    assert init(jax.random.key(0), (2, 3), jnp.float32).tolist() == [[0.5] * 3] * 2
    ```
    """
    if not callable(init_fn):
        raise TypeError(f"scale_init: init_fn must be callable; got {type(init_fn).__name__}.")

    def scaled(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
        return init_fn(key, shape, dtype) * jnp.asarray(scale_factor, dtype=dtype)

    return scaled


def _check_config(name: str, in_features: PyTree, out_features: PyTree, tp_mode: PyTree) -> None:
    if tp_mode not in _MODES:
        raise ValueError(
            f"{name}: tp_mode must be one of {_MODES}; got {tp_mode!r}. Use 'gather' for a "
            "column-parallel layer, 'scatter' for a row-parallel one, 'none' to replicate."
        )
    check_int(in_features, name="in_features", owner=name)
    check_int(out_features, name="out_features", owner=name)


# --- the column/row core ----------------------------------------------------------------------

Gather: TypeAlias = Literal["features", "tokens"] | None
Reduce: TypeAlias = Literal["sum", "features", "tokens"] | None


def _dot(x: Array, weight: Array) -> Array:
    return jnp.einsum("...i,oi->...o", x, weight)


def column_linear(
    x: Float[Array, "..."],
    weight: Float[Array, "out_block in_features"],
    *,
    axis_name: Hashable,
    gather: Gather = None,
    ring: bool = False,
    bidirectional: bool = False,
) -> Float[Array, "..."]:
    """`x @ weight.T` where `weight` holds this device's rows (output features): the core of
    every column-parallel layer (inside `shard_map`; no bias).

    **Arguments:**

    - `x`: the input as this device holds it.
    - `weight`: this device's block of rows, `[out / n, in]`.
    - `axis_name`: the mesh axis the rows are split over.
    - `gather`: what to gather over the axis first: `None` (the input is already whole),
      `"features"` (`x` is `[..., in / n]`, gathered on its last axis) or `"tokens"` (`x` is
      this device's token, `[in]`; the tokens of every device are stacked to `[n, in]`).
    - `ring`: gather the features around a ring next to the partial products
      (`eqpar.collectives.ring_gather_matmul`) instead of one all-gather.
    - `bidirectional`: with `ring`, walk both directions.

    **Returns:** `[..., out / n]` (`[n, out / n]` with `gather="tokens"`).

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.nn.linear import column_linear

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    x, w = jnp.arange(16.0).reshape(2, 8), jnp.ones((12, 8))
    f = jax.shard_map(
        lambda x, w: column_linear(x, w, axis_name="model", gather="features"), mesh=mesh,
        in_specs=(P(None, "model"), P("model")), out_specs=P(None, "model"),
    )
    assert jnp.allclose(f(x, w), x @ w.T)
    ```
    """
    if gather == "features":
        if ring:
            return collectives.ring_gather_matmul(x, weight, axis_name, bidirectional=bidirectional)
        x = lax.all_gather(x, axis_name, axis=x.ndim - 1, tiled=True)
    elif gather == "tokens":
        x = lax.all_gather(x, axis_name)  # [n, in]: one token from each device
    elif gather is not None:
        raise ValueError(
            f"column_linear: `gather` must be None, 'features' or 'tokens', got {gather!r}."
        )
    return _dot(x, weight)


def row_linear(
    x: Float[Array, "..."],
    weight: Float[Array, "out_features in_block"],
    *,
    axis_name: Hashable,
    reduce: Reduce,
    ring: bool = False,
    bidirectional: bool = False,
) -> Float[Array, "..."]:
    """`x @ weight.T` where `x` and `weight` hold this device's block of the input features,
    reduced over the axis: the core of every row-parallel layer (inside `shard_map`; no bias).

    **Arguments:**

    - `x`: this device's block of the input, `[..., in / n]`.
    - `weight`: all output features, this device's block of the input features, `[out, in /
      n]`.
    - `axis_name`: the mesh axis the input features are split over.
    - `reduce`: how the partial products meet: `"sum"` (a `psum`: the whole `[..., out]` on
      every device), `"features"` (a reduce-scatter on the last axis: `[..., out / n]`),
      `"tokens"` (`x` is `[n, in / n]`, one token from each device: a reduce-scatter that
      leaves each device its own token's `[out]`) or `None` (the partial sums, for the caller
      to reduce).
    - `ring`: with `"features"`, reduce around a ring next to the partial products
      (`eqpar.collectives.ring_matmul_scatter`), never holding the whole partial product.
    - `bidirectional`: with `ring`, run the sums both ways round.

    **Returns:** the reduced product, as `reduce` says.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.nn.linear import row_linear

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    x, w = jnp.arange(16.0).reshape(2, 8), jnp.ones((4, 8))
    f = jax.shard_map(
        lambda x, w: row_linear(x, w, axis_name="model", reduce="sum"), mesh=mesh,
        in_specs=(P(None, "model"), P(None, "model")), out_specs=P(),
    )
    assert jnp.allclose(f(x, w), x @ w.T)
    ```
    """
    if reduce not in (None, "sum", "features", "tokens"):
        raise ValueError(
            f"row_linear: `reduce` must be None, 'sum', 'features' or 'tokens', got {reduce!r}."
        )
    if reduce == "features" and ring:
        return collectives.ring_matmul_scatter(x, weight, axis_name, bidirectional=bidirectional)
    partial = _dot(x, weight)
    if reduce == "sum":
        return lax.psum(partial, axis_name)
    if reduce == "features":
        return lax.psum_scatter(partial, axis_name, scatter_dimension=partial.ndim - 1, tiled=True)
    if reduce == "tokens":
        return lax.psum_scatter(partial, axis_name, scatter_dimension=0)
    return partial


class TPDense(eqx.Module):
    """A linear layer split over a mesh axis, the same parameters as `eqx.nn.Linear`.

    `weight` (`[out_features, in_features]`) and `bias` (`[out_features]`) are global arrays
    whose meaning does not depend on the parallel size, so a checkpoint written at one size
    loads at any other, or into `eqx.nn.Linear` through `to_linear()`.

    Call it inside `shard_map` (with the specs from `eqpar.partition_specs`) on activations
    whose last axis is sharded over `model_axis_name`:

    - `tp_mode="gather"` (column parallel): the input `[..., in/n]` is all-gathered, the weight
      is sharded on `out_features`, the output is `[..., out/n]`.
    - `tp_mode="scatter"` (row parallel): the weight is sharded on `in_features`, the local
      product `[..., out]` is reduce-scattered to `[..., out/n]`; the bias, sharded like the
      output, is added once.
    - `tp_mode="none"`: replicated weight, input `[..., in]`, output `[..., out]`, no
      communication.

    With `skip_communication=True` the caller does the communication: in gather mode the input
    is already the full `[..., in]` (so several projections can share one gather); in scatter
    mode the layer returns its partial sums `[..., out]` for the caller to reduce, and the
    caller adds the bias block after its reduction, so `use_bias` must be `False`.

    **Arguments:**

    - `in_features`, `out_features`: global sizes; each must divide by the axis size of the
      mode's sharded dimension at call time.
    - `model_axis_name`: the mesh axis the layer is split over.
    - `tp_mode`: `"gather"`, `"scatter"` or `"none"`.
    - `use_bias`: whether to add a bias.
    - `skip_communication`: see above.
    - `kernel_init`: `(key, shape, dtype) -> array` for the weight; by default the weight and
      bias are initialised exactly as `eqx.nn.Linear` with the same key.
    - `key`: a `jax.random` key.
    - `dtype`: parameter dtype (default float32).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqpar
    from eqpar.nn import TPDense

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    layer = TPDense(8, 12, tp_mode="gather", key=jax.random.key(0))
    specs = eqpar.partition_specs(layer)  # weight P("model", None), bias P("model")
    x = jnp.ones((2, 8))

    @eqpar.shard_map(mesh=mesh, in_specs=(specs, P(None, "model")), out_specs=P(None, "model"))
    def forward(layer, x):
        return layer(x)

    reference = jax.vmap(layer.to_linear())(x)
    assert jnp.allclose(forward(layer, x), reference, atol=1e-6)
    ```
    """

    weight: Float[Array, "out_features in_features"]
    bias: Float[Array, " out_features"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    model_axis_name: Hashable = eqx.field(static=True)
    tp_mode: str = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    skip_communication: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        model_axis_name: Hashable = "model",
        tp_mode: str,
        use_bias: bool = True,
        skip_communication: bool = False,
        kernel_init: Initializer | None = None,
        key: PRNGKeyArray,
        dtype: Any = None,
    ):
        _check_config(type(self).__name__, in_features, out_features, tp_mode)
        if skip_communication and tp_mode == "scatter" and use_bias:
            raise ValueError(
                f"{type(self).__name__}: with tp_mode='scatter' and skip_communication=True the "
                "layer returns partial sums that the caller reduces, so a bias added here would "
                "be counted once per device. Pass use_bias=False and add the bias after your "
                "reduction."
            )
        dtype = jnp.float32 if dtype is None else dtype
        # Same draws as eqx.nn.Linear with the same key, so serial and parallel models
        # built from one key start from the same parameters.
        linear = eqx.nn.Linear(in_features, out_features, use_bias=use_bias, key=key, dtype=dtype)
        weight = linear.weight
        if kernel_init is not None:
            weight_key, _ = jax.random.split(key)
            weight = kernel_init(weight_key, (out_features, in_features), dtype)
            if weight.shape != (out_features, in_features):
                raise ValueError(
                    f"{type(self).__name__}: kernel_init returned shape {weight.shape}; expected "
                    f"({out_features}, {in_features}) = (out_features, in_features)."
                )
            if not jnp.issubdtype(weight.dtype, jnp.inexact):
                raise ValueError(
                    f"{type(self).__name__}: kernel_init returned dtype {weight.dtype}; a weight "
                    f"must be floating point ({jnp.dtype(dtype)} was asked for), or it would "
                    f"get no gradient. Return `initializer(key, shape, dtype)` in the dtype given."
                )
        self.weight = weight
        self.bias = linear.bias
        self.in_features = in_features
        self.out_features = out_features
        self.model_axis_name = model_axis_name
        self.tp_mode = tp_mode
        self.use_bias = use_bias
        self.skip_communication = skip_communication

    @classmethod
    def from_linear(
        cls,
        linear: eqx.nn.Linear,
        *,
        model_axis_name: Hashable = "model",
        tp_mode: str,
        skip_communication: bool = False,
        **kwargs: Any,
    ) -> PyTree:
        """The tensor-parallel layer holding `linear`'s weight and bias.

        **Arguments:**

        - `linear`: an `eqx.nn.Linear` (its `in_features`/`out_features` must be integers).
        - `model_axis_name`, `tp_mode`, `skip_communication`: as in the constructor; other
          keyword options of the subclass (e.g. `use_bidirectional_gather`) pass through.

        **Returns:** a layer of this class with the same parameters.

        ```python
        import equinox as eqx, jax
        from eqpar.nn import TPDense

        linear = eqx.nn.Linear(4, 6, key=jax.random.key(0))
        layer = TPDense.from_linear(linear, tp_mode="scatter")
        assert (layer.to_linear().weight == linear.weight).all()
        ```
        """
        if not isinstance(linear, eqx.nn.Linear):
            raise TypeError(
                f"{cls.__name__}.from_linear: expected an eqx.nn.Linear; got "
                f"{type(linear).__name__}."
            )
        if not isinstance(linear.in_features, int) or not isinstance(linear.out_features, int):
            raise ValueError(
                f"{cls.__name__}.from_linear: only linear layers with integer in_features and "
                f"out_features convert; got in_features={linear.in_features!r}, "
                f"out_features={linear.out_features!r}."
            )
        layer = cls(
            linear.in_features,
            linear.out_features,
            model_axis_name=model_axis_name,
            tp_mode=tp_mode,
            use_bias=linear.use_bias,
            skip_communication=skip_communication,
            key=jax.random.key(0),
            dtype=linear.weight.dtype,
            **kwargs,
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.bias),
            layer,
            (linear.weight, linear.bias),
            is_leaf=lambda x: x is None,
        )

    def to_linear(self) -> eqx.nn.Linear:
        """The `eqx.nn.Linear` with the same weight and bias (call it outside `shard_map`).

        **Returns:** an `eqx.nn.Linear`.

        ```python
        import jax
        from eqpar.nn import TPDense

        layer = TPDense(4, 6, tp_mode="gather", key=jax.random.key(0))
        assert layer.to_linear().weight.shape == (6, 4)
        ```
        """
        linear = eqx.nn.Linear(
            self.in_features,
            self.out_features,
            use_bias=self.use_bias,
            key=jax.random.key(0),
            dtype=self.weight.dtype,
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.bias),
            linear,
            (self.weight, self.bias),
            is_leaf=lambda x: x is None,
        )

    def __partition_specs__(self) -> Mapping[str, P]:
        axis = self.model_axis_name
        if self.tp_mode == "gather":
            specs = {"weight": P(axis, None), "bias": P(axis)}
        elif self.tp_mode == "scatter":
            specs = {"weight": P(None, axis), "bias": P(axis)}
        else:
            specs = {"weight": P(), "bias": P()}
        if self.bias is None:
            del specs["bias"]
        return specs

    def _check_local(self, x: Array, n: int) -> None:
        name = type(self).__name__
        for label, size in (("in_features", self.in_features), ("out_features", self.out_features)):
            if self.tp_mode != "none" and size % n:
                raise ValueError(
                    f"{name}({self.in_features} -> {self.out_features}, tp_mode="
                    f"{self.tp_mode!r}): {label}={size} does not divide by the size of axis "
                    f"{self.model_axis_name!r} ({n}). Choose sizes that are multiples of {n}."
                )
        expected_weight = {
            "gather": (self.out_features // n, self.in_features),
            "scatter": (self.out_features, self.in_features // n),
            "none": (self.out_features, self.in_features),
        }[self.tp_mode]
        if self.weight.shape != expected_weight:
            raise ValueError(
                f"{name}: the local weight block has shape {self.weight.shape}; tp_mode="
                f"{self.tp_mode!r} over {n} devices expects {expected_weight}. Pass the layer "
                "into shard_map with the specs of `eqpar.partition_specs(model)`."
            )
        gathered_input = self.tp_mode == "none" or (
            self.tp_mode == "gather" and self.skip_communication
        )
        expected_in = self.in_features if gathered_input else self.in_features // n
        if x.ndim == 0 or x.shape[-1] != expected_in:
            raise ValueError(
                f"{name}: input last dimension must be {expected_in} (in_features="
                f"{self.in_features}, tp_mode={self.tp_mode!r}, skip_communication="
                f"{self.skip_communication}, axis size {n}); got input shape {x.shape}."
            )

    def __call__(
        self, x: Float[Array, "*batch features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch out"]:
        """Apply the layer to this device's block of `x` (inside `shard_map`).

        **Arguments:**

        - `x`: `[..., in_features / n]` (or `[..., in_features]` in mode `"none"` and in
          gather mode with `skip_communication=True`); any leading dimensions.
        - `key`: unused; accepted for `eqx.nn` compatibility.

        **Returns:** `[..., out_features / n]` (`[..., out_features]` in mode `"none"`, and
        partial sums `[..., out_features]` in scatter mode with `skip_communication=True`).
        """
        del key
        n = (
            1
            if self.tp_mode == "none"
            else _bound_axis_size(
                self.model_axis_name, type(self).__name__, argument="model_axis_name"
            )
        )
        self._check_local(x, n)
        y = self._forward(x, n)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _forward(self, x: Array, n: int, *, ring: bool = False) -> Array:
        axis, communicate = self.model_axis_name, not self.skip_communication
        if self.tp_mode == "none":
            return row_linear(x, self.weight, axis_name=axis, reduce=None)
        if self.tp_mode == "gather":
            gather = "features" if communicate else None
            bidirectional = getattr(self, "use_bidirectional_gather", False)
            return column_linear(
                x,
                self.weight,
                axis_name=axis,
                gather=gather,
                ring=ring,
                bidirectional=bidirectional,
            )
        bidirectional = getattr(self, "use_bidirectional_scatter", False)
        reduce = "features" if communicate else None
        return row_linear(
            x, self.weight, axis_name=axis, reduce=reduce, ring=ring, bidirectional=bidirectional
        )


class TPAsyncDense(TPDense):
    """[`TPDense`][eqpar.nn.TPDense] computed block by block around a ring.

    Same parameters, layout and results as `TPDense` (a checkpoint of one loads into the
    other). Where it pays, the communication runs as ring steps (`eqpar.collectives.ring_shift`
    inside a `lax.fori_loop`) next to partial matmuls, so the compiler can overlap each
    transfer with the compute on a block already at hand. Each step takes the weight block it
    needs with a dynamic slice of the local weight, one block at a time; the weight is never
    reordered or copied whole.

    - scatter mode: each step computes the partial product for one destination device and
      adds it to the running sum passing by, so the full partial product `[..., out]` is
      never held. The backward pass walks the output-gradient blocks round the ring: each
      block's product with the matching rows of the local weight adds to the input gradient,
      and its product with the input is written in place as its rows of the weight gradient,
      so the gathered gradient `[..., out]` is never held either.
    - gather mode: each step multiplies the input block it holds by the matching columns of
      the local weight while passing the block on; the gathered input `[..., in]` is never
      materialised. The forward pass saves only the local block: the backward pass walks the
      input blocks round the ring again, writing each block's columns of the weight gradient
      in place as it arrives, and reduces the input gradient around the ring like scatter
      mode's forward pass. Walking the input twice moves up to `(n - 1) / n` of the input
      once more than `TPDense`, which keeps the gathered input from the forward pass.

    In a training step every collective is then a ring of transfers next to block matmuls,
    with one exception. Two of the walks sum one product per arriving block (the gather
    forward pass's output `[..., out / n]`, the scatter backward pass's input gradient
    `[..., in / n]`), and where the backend has no fused multiply-accumulate (XLA:CPU) each
    product is a second buffer of that size. Where that buffer is at least the `(n - 1) / n`
    of the gathered array that an all-gather would add (`out / n >= in (n - 1) / n` in
    gather mode, `in / n >= out (n - 1) / n` in scatter mode: an MLP's up and down
    projections at `n <= 4`), the walk would hold more than `TPDense`, so that layer gathers
    once as `TPDense` does (the gather-mode input for the forward pass and the weight
    gradient, or the scatter-mode output gradient) and rings the other collectives. In
    `benchmarks/tensor_parallel.py` (an MLP block `256 -> 1024 -> 256`) the walks forced at
    n = 2 and 4 hold 1.56x and 1.17x `TPDense`'s temporary memory; chosen this way the step
    holds exactly `TPDense`'s at n = 2 and 4, and 0.76x at n = 8 with every collective a
    ring (for 1.29x the bytes: the up projection's input walked twice).

    Gradients come from a custom VJP: reverse mode (`jax.grad`, `jax.vjp`) only, forward-mode
    `jax.jvp` does not pass through this layer.

    **Arguments:** as `TPDense`, plus

    - `use_bidirectional_gather`: run gather mode's ring over both directions (about half
      the steps until the last block arrives, two blocks per step).
    - `use_bidirectional_scatter`: run the running sums over both directions (as
      `eqpar.collectives.async_scatter_bidirectional`: about half the steps).

    Both default to `False`: in `benchmarks/tensor_parallel.py` the bidirectional rings hold
    the same memory, compile more slowly and are no faster; what they save is latency on
    interconnects that carry both directions at once.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqpar
    from eqpar.nn import TPAsyncDense

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    layer = TPAsyncDense(8, 4, tp_mode="scatter", key=jax.random.key(0))
    specs = eqpar.partition_specs(layer)
    x = jnp.ones((3, 8))
    forward = eqpar.shard_map(
        lambda m, x: m(x), mesh=mesh, in_specs=(specs, P(None, "model")),
        out_specs=P(None, "model"),
    )
    assert jnp.allclose(forward(layer, x), jax.vmap(layer.to_linear())(x), atol=1e-5)
    ```
    """

    use_bidirectional_gather: bool = eqx.field(static=True)
    use_bidirectional_scatter: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        model_axis_name: Hashable = "model",
        tp_mode: str,
        use_bias: bool = True,
        skip_communication: bool = False,
        use_bidirectional_gather: bool = False,
        use_bidirectional_scatter: bool = False,
        kernel_init: Initializer | None = None,
        key: PRNGKeyArray,
        dtype: Any = None,
    ):
        super().__init__(
            in_features,
            out_features,
            model_axis_name=model_axis_name,
            tp_mode=tp_mode,
            use_bias=use_bias,
            skip_communication=skip_communication,
            kernel_init=kernel_init,
            key=key,
            dtype=dtype,
        )
        self.use_bidirectional_gather = use_bidirectional_gather
        self.use_bidirectional_scatter = use_bidirectional_scatter

    def _forward(self, x: Array, n: int, *, ring: bool = True) -> Array:
        return super()._forward(x, n, ring=ring and n > 1)


def _check_linear(linear: PyTree, owner: str) -> None:
    if not isinstance(linear, eqx.nn.Linear):
        raise TypeError(f"{owner}: expected an eqx.nn.Linear; got {type(linear).__name__}.")
    if linear.in_features == "scalar" or linear.out_features == "scalar":
        raise ValueError(
            f"{owner}: a Linear with in_features or out_features 'scalar' has nothing to "
            f"split; leave it replicated (eqpar.Replicated())."
        )


class ColumnParallelLinear(eqx.nn.Linear):
    """`eqx.nn.Linear` with its output features split over a mesh axis.

    The weight's rows (`out_features`) and the bias are split; each device computes its block
    of the output from the whole (replicated) input. Follow it with a `RowParallelLinear` (any
    elementwise function between them), which brings the block back to a replicated output,
    or set `gather_output=True` to return the whole output here.

    Under sequence parallelism (`sequence_parallel=True`) the input is one of this device's
    tokens of a sequence-sharded activation (the author's per-token `jax.vmap` runs over the
    local tokens). The layer all-gathers the token at the same local position from every
    device of the axis and returns `[n, out / n]`: row `j` is device `j`'s token, in this
    device's block of features. A `RowParallelLinear(sequence_parallel=True)` brings it back
    to this device's token with a reduce-scatter, so the block moves what Megatron's sequence
    parallelism moves (one all-gather in, one reduce-scatter out) while every layer keeps its
    per-token call.

    **Arguments:**

    - `linear`: the `eqx.nn.Linear` to convert; its parameters are kept as they are.
    - `axis_name`: the mesh axis to split over.
    - `gather_output`: all-gather the output (`[out]` replicated) instead of returning this
      device's block `[out / n]`.
    - `sequence_parallel`: the input is sequence-sharded over the same axis (see above).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import ColumnParallelLinear

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    linear = eqx.nn.Linear(8, 12, key=jax.random.key(0))
    layer = ColumnParallelLinear(linear, gather_output=True)
    x = jnp.ones((5, 8))
    f = eqpar.shard_map(
        lambda m, x: jax.vmap(m)(x), mesh=mesh,
        in_specs=(eqpar.partition_specs(layer), P()), out_specs=P(),
    )
    assert jnp.allclose(f(layer, x), jax.vmap(linear)(x), atol=1e-6)
    ```
    """

    axis_name: Hashable = eqx.field(static=True)
    gather_output: bool = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self,
        linear: eqx.nn.Linear,
        *,
        axis_name: Hashable = "model",
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ):
        _check_linear(linear, type(self).__name__)
        check_column_options(type(self).__name__, gather_output, sequence_parallel)
        adopt(self, linear, eqx.nn.Linear, axis_name)
        self.gather_output = bool(gather_output)
        self.sequence_parallel = bool(sequence_parallel)

    def __partition_specs__(self) -> Mapping[str, P]:
        specs = {"weight": P(self.axis_name, None), "bias": P(self.axis_name)}
        return specs if self.bias is not None else {"weight": specs["weight"]}

    def to_serial(self) -> eqx.nn.Linear:
        """The `eqx.nn.Linear` with the same parameters."""
        return rebuilt(self, eqx.nn.Linear)

    def __call__(
        self, x: Float[Array, "..."], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*gathered out_block"]:
        """This device's block of `linear(x)` (or all of it with `gather_output=True`).

        **Arguments:**

        - `x`: the whole input `[in_features]`, the same on every device of the axis (with
          `sequence_parallel=True`: this device's token).
        - `key`: unused, as in `eqx.nn.Linear`.

        **Returns:** `[out_features / n]`, or `[out_features]` with `gather_output=True`, or
        `[n, out_features / n]` with `sequence_parallel=True`.
        """
        owner = type(self).__name__
        if needs_own_region(self.axis_name) and not self.sequence_parallel:
            # The whole output either way (the global view). With gather_output=True on an
            # Auto axis the compiler gathers it where the code after needs it (it may not:
            # a softmax runs on the split logits); on an Explicit axis the sharding is in the
            # output's type, and the code after was written for a whole one.
            gather = self.gather_output and axis_is_explicit(owner, self, self.axis_name)
            return call_in_own_region(
                owner,
                self.axis_name,
                self,
                lambda layer, x: layer._forward_block(x, gather=gather),
                (x,),
                arg_names=("x",),
                arg_specs=(P(),),
                out_specs=P() if gather else feature_spec(x, self.axis_name),
            )
        return self._forward_block(x, gather=self.gather_output)

    def _forward_block(self, x: Array, *, gather: bool = False) -> Array:
        """Inside the region: this device's block of the output (gathered if `gather`)."""
        owner = type(self).__name__
        n = axis_size(self.axis_name, owner)
        assert isinstance(self.out_features, int) and isinstance(self.in_features, int)
        check_divides(owner, "out_features", self.out_features, n, self.axis_name)
        check_block(owner, "weight", self.weight.shape, (self.out_features // n, self.in_features))
        if x.shape != (self.in_features,):
            raise ValueError(
                _column_input_error(owner, x.shape, self.in_features, n, self.axis_name)
            )
        check_sequence_layout(owner, "x", x, self.axis_name, self.sequence_parallel)
        if self.sequence_parallel:
            y = column_linear(x, self.weight, axis_name=self.axis_name, gather="tokens")
        else:
            y = column_linear(x, self.weight, axis_name=self.axis_name, gather=None)
        y = y if self.bias is None else y + self.bias
        if gather:
            return gather_replicated(y, self.axis_name, y.ndim - 1)
        # Until the row-parallel partner, the features are split: a dropout between reads this.
        kind = "features_of_tokens" if self.sequence_parallel else "features"
        open_split(Split(self.axis_name, kind, -1, self.out_features // n))
        return mark_column_output(y)


def _column_input_error(
    owner: str, shape: tuple[int, ...], in_features: int, n: int, axis_name: Hashable
) -> str:
    """Why a column-parallel layer's input is not `[in_features]`, and the fix: a batch
    (vmap it), a block of features another column-parallel layer left split (the plan gives
    this layer the wrong style), or some other shape."""
    expected = (
        f"{owner}: the input must be one example's features [in_features] = [{in_features}], "
        f"as for eqx.nn.Linear; got shape {shape}."
    )
    if len(shape) > 1 and shape[-1] == in_features:
        return f"{expected} Apply the layer to a batch with jax.vmap."
    if n > 1 and in_features % n == 0 and shape == (in_features // n,):
        return (
            f"{expected} That is [in_features / n], this device's block of features split "
            f"over axis {axis_name!r} ({n} devices), as a ColumnParallel layer before "
            f"this one leaves its output. A column-parallel layer needs the whole input: "
            f"this happens when one plan key (a regular expression such as 'layers/\\d+', or "
            f"several keys) gives ColumnParallel to two linears in a row. "
            + columns_in_a_row_fix("this layer", "the first layer")
        )
    return expected


class RowParallelLinear(eqx.nn.Linear):
    """`eqx.nn.Linear` with its input features split over a mesh axis.

    Each device multiplies its block of the input (`[in / n]`, e.g. the output of a
    `ColumnParallelLinear`) by its columns of the weight; one `psum` adds the partial
    products, and the bias (replicated) is added once. The output is the whole `[out]`, the
    same on every device.

    With `sequence_parallel=True` the input is what a `ColumnParallelLinear(sequence_parallel
    =True)` gives, `[n, in / n]` (one token from each device), and a reduce-scatter in place of
    the `psum` leaves each device the `[out]` of its own token: the activation stays sharded
    on the sequence, and a norm after it runs on this device's tokens only.

    **Arguments:**

    - `linear`: the `eqx.nn.Linear` to convert.
    - `axis_name`: the mesh axis to split over.
    - `sequence_parallel`: the activations around the block are sequence-sharded.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import ColumnParallelLinear, RowParallelLinear

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    k1, k2 = jax.random.split(jax.random.key(0))
    up, down = eqx.nn.Linear(8, 16, key=k1), eqx.nn.Linear(16, 8, key=k2)
    layers = (ColumnParallelLinear(up), RowParallelLinear(down))
    mlp = lambda ls, x: ls[1](jax.nn.relu(ls[0](x)))
    x = jnp.ones((3, 8))
    f = eqpar.shard_map(
        lambda ls, x: jax.vmap(lambda row: mlp(ls, row))(x), mesh=mesh,
        in_specs=(eqpar.partition_specs(layers), P()), out_specs=P(),
    )
    assert jnp.allclose(f(layers, x), jax.vmap(lambda r: mlp((up, down), r))(x), atol=1e-5)
    ```
    """

    axis_name: Hashable = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self,
        linear: eqx.nn.Linear,
        *,
        axis_name: Hashable = "model",
        sequence_parallel: bool = False,
    ):
        _check_linear(linear, type(self).__name__)
        adopt(self, linear, eqx.nn.Linear, axis_name)
        self.sequence_parallel = bool(sequence_parallel)

    def __partition_specs__(self) -> Mapping[str, P]:
        specs = {"weight": P(None, self.axis_name), "bias": P()}
        return specs if self.bias is not None else {"weight": specs["weight"]}

    def to_serial(self) -> eqx.nn.Linear:
        """The `eqx.nn.Linear` with the same parameters."""
        return rebuilt(self, eqx.nn.Linear)

    def __call__(
        self, x: Float[Array, "*gathered in_block"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out_features"]:
        """`linear(x)` from this device's input block, summed over the axis.

        **Arguments:**

        - `x`: this device's block of the input, `[in_features / n]` (with
          `sequence_parallel=True`: `[n, in_features / n]`).
        - `key`: unused, as in `eqx.nn.Linear`.

        **Returns:** `[out_features]`, the same on every device of the axis (with
        `sequence_parallel=True`: the output for this device's own token).
        """
        del key
        owner = type(self).__name__
        if needs_own_region(self.axis_name) and not self.sequence_parallel:
            return call_in_own_region(
                owner,
                self.axis_name,
                self,
                lambda layer, x: layer(x),
                (x,),
                arg_names=("x",),
                arg_specs=(feature_spec(x, self.axis_name),),
                out_specs=P(),
            )
        n = axis_size(self.axis_name, owner)
        assert isinstance(self.out_features, int) and isinstance(self.in_features, int)
        check_divides(owner, "in_features", self.in_features, n, self.axis_name)
        close_split(self.axis_name, ("features", "features_of_tokens"))
        check_block(owner, "weight", self.weight.shape, (self.out_features, self.in_features // n))
        if self.sequence_parallel:
            if x.shape == (self.in_features,) and n > 1:
                raise ValueError(
                    f"{owner}: with sequence_parallel=True the input must be [n, in_features / "
                    f"n] = [{n}, {self.in_features // n}] per token, but it is one token's "
                    f"whole [in_features] = [{self.in_features}]: the output of the "
                    f"sequence-parallel column linear before it was reshaped on the way (into "
                    f"attention heads and back, say). " + per_token_sequence_fix(self.axis_name)
                )
            if x.shape != (n, self.in_features // n):
                raise ValueError(
                    f"{owner}: with sequence_parallel=True the input must be [n, in_features / "
                    f"n] = [{n}, {self.in_features // n}], as a ColumnParallelLinear with "
                    f"sequence_parallel=True gives; got shape {x.shape}."
                )
            y = row_linear(x, self.weight, axis_name=self.axis_name, reduce="tokens")
            return y if self.bias is None else y + self.bias
        if x.shape == (n, self.in_features // n):
            raise ValueError(
                f"{owner}: got [n, in_features / n] = {x.shape}, what a ColumnParallelLinear "
                f"with sequence_parallel=True gives; set sequence_parallel=True on this layer "
                f"too (RowParallel(sequence_parallel=True) in the plan)."
            )
        if x.shape != (self.in_features // n,):
            raise ValueError(
                f"{owner}: the input must be this device's block [in_features / n] = "
                f"[{self.in_features // n}] (e.g. from a ColumnParallelLinear); got shape "
                f"{x.shape}. A replicated input of [{self.in_features}] belongs to a "
                f"ColumnParallel layer, or call this layer on its slice."
            )
        y = row_linear(x, self.weight, axis_name=self.axis_name, reduce="sum")
        return y if self.bias is None else y + self.bias
