"""Tensor-parallel Equinox layers.

Every layer here stores its parameters in the *global view* (`weight` is
`[out_features, in_features]` exactly as in `eqx.nn.Linear`) and declares how they are
sharded through `__partition_specs__`. Inside `shard_map` each device sees its own block of
the parameters and of the activations, which are sharded on the feature (last) axis.
"""

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from .. import collectives
from .._axes import axis_size as _bound_axis_size
from .._checks import check_int
from .._declare import prefixed, stacked_partition_specs

__all__ = ["ModelParallelismWrapper", "TPAsyncDense", "TPDense", "scale_init"]

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
    ) -> Any:
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

    def _matmul(self, x: Array, weight: Array) -> Array:
        return jnp.einsum("...i,oi->...o", x, weight)

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

    def _forward(self, x: Array, n: int) -> Array:
        axis = self.model_axis_name
        if self.tp_mode == "none":
            return self._matmul(x, self.weight)
        if self.tp_mode == "gather":
            if not self.skip_communication:
                x = lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)
            return self._matmul(x, self.weight)
        partial = self._matmul(x, self.weight)
        if self.skip_communication:
            return partial
        return lax.psum_scatter(partial, axis, scatter_dimension=partial.ndim - 1, tiled=True)


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
      never held. The backward pass gathers the output gradient with one all-gather and runs
      `TPDense`'s two matmuls: the weight gradient needs the whole gathered gradient anyway.
    - gather mode: without gradients, each step multiplies the input block it holds by the
      matching columns of the local weight while passing the block on; the gathered input
      `[..., in]` is never materialised. Under differentiation the weight gradient needs the
      gathered input, so the forward pass gathers it with one all-gather as `TPDense` does,
      and the backward pass reduces the input gradient around the ring like scatter mode's
      forward pass (the full `[..., in]` product is never held).

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

    def _forward(self, x: Array, n: int) -> Array:
        if self.tp_mode == "none" or self.skip_communication or n == 1:
            return super()._forward(x, n)
        ring = _Ring(self.model_axis_name, n)
        if self.tp_mode == "gather":
            return _ring_gather_matmul(x, self.weight, ring, self.use_bidirectional_gather)
        return _ring_scatter_matmul(x, self.weight, ring, self.use_bidirectional_scatter)


# --- TPAsyncDense's ring matmuls ------------------------------------------------------------
#
# Device `d` of `n` holds `x` (its input block) and `w` (its weight block). Ring step `t`
# works on the block of one other device, whose index depends on `d`, so the weight block
# that goes with it is cut out of `w` with `lax.dynamic_slice` where it lies: reordering the
# weight blocks into ring order would copy the whole weight (and scatter its gradient back).
# The steps run in a `lax.fori_loop`, so the program does not grow with `n` and each running
# sum is one loop-carried buffer.


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The mesh axis of a ring and its size."""

    axis: Hashable
    n: int

    def device(self, data: Array) -> Array:
        """This device's index `d`, tied to `data` by `lax.optimization_barrier`.

        A weight slice whose index depends only on the device depends only on the
        parameters, and XLA may then cut it at the very start of the program and hold it
        until the ring runs (for every layer of a model at once). Passed through one barrier
        with `data`, the index is known to the compiler only once `data` is.
        """
        d, _ = lax.optimization_barrier((lax.axis_index(self.axis), data))
        return d

    def index(self, d: Array, offset: Any) -> Array:
        """`(d + offset) % n` for `0 <= d < 2n` and `-n <= offset <= n` (int or traced)."""
        return lax.rem(d + offset + 2 * self.n, self.n)

    def shift(self, x: Array, up: bool = True) -> Array:
        return collectives.ring_shift(x, self.axis, up=up)


def _loop(first: int, last: int, body: Callable[[Any, Any], Any], carry: Any) -> Any:
    """`body(t, carry)` for `t = first .. last` (no loop when the range is empty)."""
    return lax.fori_loop(first, last + 1, body, carry) if last >= first else carry


def _weight_block(w: Array, index: Array, size: int, axis: int) -> Array:
    return lax.dynamic_slice_in_dim(w, index * size, size, axis=axis)


def _dot(x: Array, w: Array) -> Array:
    return jnp.einsum("...i,oi->...o", x, w)


def _ring_gather(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`all_gather(x, tiled) @ w.T` as ring steps, without holding the gathered input.

    Walking up the ring, item `t` is the block of device `d - t` (walking down, of `d + t`),
    which meets that device's weight columns. One way round, each step passes on the block
    it holds while multiplying it, so every transfer runs next to a matmul.
    """
    k = x.shape[-1]
    d = ring.device(x)

    def product(block: Array, item: Any) -> Array:
        return _dot(block, _weight_block(w, ring.index(d, -item), k, 1))

    if not bidirectional:

        def step(t: Any, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            block, acc, _ = carry
            return ring.shift(block), acc + product(block, t), t

        # The own block is multiplied while the first block travels; the last block arrives
        # after the loop, whose step count is carried out of it so that the last weight
        # slice is not cut before the loop has run.
        acc = product(x, 0)
        block, acc, t = _loop(1, ring.n - 2, step, (ring.shift(x), acc, jnp.int32(0)))
        return acc + product(block, t + 1)
    # Both directions: step t brings the block of d - t one way and of d + t the other (item
    # -t); for even n the up side has one block more, so its first step runs alone.
    acc = product(x, 0)
    up, lead = x, 1 - ring.n % 2
    if lead:
        up = ring.shift(up)
        acc = acc + product(up, 1)

    def both(t: Any, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        up, down = ring.shift(carry[0]), ring.shift(carry[1], up=False)
        return up, down, carry[2] + product(up, t + lead) + product(down, -t)

    return _loop(1, (ring.n - 1) // 2, both, (up, x, acc))[2]


def _ring_reduce(
    produce: Callable[[Array], Array], ring: _Ring, d: Array, bidirectional: bool
) -> Array:
    """This device's block of a reduce-scatter whose chunk for device `dest` is
    `produce(dest)` on every device, as running sums passed around the ring.

    Each chunk is computed in the step that adds it, next to the transfer of the running sum
    it is added to; the chunks of one device are never all held at once. Same chunk order as
    `eqpar.collectives.async_scatter` (and `async_scatter_bidirectional`). `d` is this
    device's index (`_Ring.device`).
    """
    if not bidirectional or ring.n <= 2:
        # Step t on device d adds the chunk for device d - 1 - t; after n - 1 shifts up
        # every sum has arrived at its destination.
        def step(t: Any, total: Array) -> Array:
            return ring.shift(total) + produce(ring.index(d, -1 - t))

        return _loop(1, ring.n - 1, step, produce(ring.index(d, -1)))
    # The sum for d is built from both sides: one running sum collects the devices below d
    # shifting up (the chunks for d + n//2 .. d + 1 on their way), the other the devices
    # above d shifting down; for even n the up side has one device more and starts alone.
    half = (ring.n - 1) // 2
    up = produce(ring.index(d, ring.n // 2))
    if ring.n % 2 == 0:
        up = ring.shift(up) + produce(ring.index(d, half))
    down = produce(ring.index(d, -half))

    def both(t: Any, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        up = ring.shift(carry[0]) + produce(ring.index(d, half - t))
        return up, ring.shift(carry[1], up=False) + produce(ring.index(d, t - half))

    up, down = _loop(1, half - 1, both, (up, down))
    return ring.shift(up) + ring.shift(down, up=False) + produce(ring.index(d, 0))


# In a training step the gathered input (gather mode) and the gathered output gradient
# (scatter mode) are needed whole for the weight gradient, as in TPDense, so those two
# all-gathers stay single collectives. The rings are used for the two reduce-scatters, where
# they also save memory: neither the full partial product `[..., out]` of the scatter
# forward pass nor the full input gradient `[..., in]` of the gather backward pass is held.
# Multiplying gathered blocks as they arrive would instead hold a second output-sized buffer
# for each partial product, where the backend has no fused multiply-accumulate (CPU).


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ring_gather_matmul(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`all_gather(x, tiled) @ w.T` (gather mode); around the ring when not differentiated."""
    return _ring_gather(x, w, ring, bidirectional)


def _ring_gather_matmul_fwd(
    x: Array, w: Array, ring: _Ring, bidirectional: bool
) -> tuple[Array, tuple[Array, Array]]:
    del bidirectional
    gathered = lax.all_gather(x, ring.axis, axis=x.ndim - 1, tiled=True)
    return _dot(gathered, w), (gathered, w)


def _ring_gather_matmul_bwd(
    ring: _Ring, bidirectional: bool, residuals: tuple[Array, Array], dy: Array
) -> tuple[Array, Array]:
    gathered, w = residuals
    k = w.shape[1] // ring.n
    # dx is the reduce-scatter of dy @ w over the input blocks: one chunk per ring step.
    dx = _ring_reduce(
        lambda dest: jnp.einsum("...o,oi->...i", dy, _weight_block(w, dest, k, 1)),
        ring,
        ring.device(dy),
        bidirectional,
    )
    dw = jnp.einsum("...o,...i->oi", dy, gathered)
    return dx.astype(gathered.dtype), dw.astype(w.dtype)


_ring_gather_matmul.defvjp(_ring_gather_matmul_fwd, _ring_gather_matmul_bwd)


def _ring_scatter(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`psum_scatter(x @ w.T, tiled)` as ring steps, one destination's chunk per step."""
    m = w.shape[0] // ring.n

    def produce(dest: Array) -> Array:
        return _dot(x, _weight_block(w, dest, m, 0))

    return _ring_reduce(produce, ring, ring.device(x), bidirectional)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ring_scatter_matmul(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`psum_scatter(x @ w.T, tiled)` (scatter mode) around the ring."""
    return _ring_scatter(x, w, ring, bidirectional)


def _ring_scatter_matmul_fwd(
    x: Array, w: Array, ring: _Ring, bidirectional: bool
) -> tuple[Array, tuple[Array, Array]]:
    return _ring_scatter(x, w, ring, bidirectional), (x, w)


def _ring_scatter_matmul_bwd(
    ring: _Ring, bidirectional: bool, residuals: tuple[Array, Array], dy: Array
) -> tuple[Array, Array]:
    del bidirectional
    x, w = residuals
    full = lax.all_gather(dy, ring.axis, axis=dy.ndim - 1, tiled=True)
    dx = jnp.einsum("...o,oi->...i", full, w)
    dw = jnp.einsum("...o,...i->oi", full, x)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_ring_scatter_matmul.defvjp(_ring_scatter_matmul_fwd, _ring_scatter_matmul_bwd)


def _check_config(name: str, in_features: Any, out_features: Any, tp_mode: Any) -> None:
    if tp_mode not in _MODES:
        raise ValueError(
            f"{name}: tp_mode must be one of {_MODES}; got {tp_mode!r}. Use 'gather' for a "
            "column-parallel layer, 'scatter' for a row-parallel one, 'none' to replicate."
        )
    check_int(in_features, name="in_features", owner=name)
    check_int(out_features, name="out_features", owner=name)


class ModelParallelismWrapper(eqx.Module):
    """`axis_size` independent copies of any module, one per device of a mesh axis.

    The copies are stacked on a leading axis (with `eqx.filter_vmap`) that is sharded over
    `model_axis_name`; inside `shard_map` every device calls its own copy. Use it for parts of
    a model that are cheaper to run redundantly or independently per device than to split.

    **Arguments:**

    - `module_fn`: `key -> eqx.Module`, builds one copy.
    - `model_axis_name`: the mesh axis the copies are spread over.
    - `axis_size`: the size of that axis (the number of copies).
    - `key`: a `jax.random` key.
    - `split_keys`: give each copy its own key (`True`) or the same key (identical copies).
    - `mask_except_model_idx`: if an index `i`, the output is zeroed on every device of the
      axis but `i` (so a later `psum` counts it once).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqpar
    from eqpar.nn import ModelParallelismWrapper

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    wrapper = ModelParallelismWrapper(
        lambda k: eqx.nn.Linear(3, 3, key=k), model_axis_name="model", axis_size=2,
        key=jax.random.key(0),
    )
    specs = eqpar.partition_specs(wrapper)
    out = eqpar.shard_map(
        lambda m, x: m(x)[None], mesh=mesh, in_specs=(specs, P()), out_specs=P("model")
    )(wrapper, jnp.ones(3))
    assert out.shape == (2, 3)  # one row per device's own copy
    ```
    """

    module: eqx.Module
    model_axis_name: Hashable = eqx.field(static=True)
    axis_size: int = eqx.field(static=True)
    mask_except_model_idx: int | None = eqx.field(static=True)

    def __init__(
        self,
        module_fn: Callable[[PRNGKeyArray], eqx.Module],
        *,
        model_axis_name: Hashable,
        axis_size: int,
        key: PRNGKeyArray,
        split_keys: bool = True,
        mask_except_model_idx: int | None = None,
    ):
        check_int(axis_size, name="axis_size", owner="ModelParallelismWrapper")
        if mask_except_model_idx is not None and not 0 <= mask_except_model_idx < axis_size:
            raise ValueError(
                "ModelParallelismWrapper: mask_except_model_idx must be in [0, axis_size) = "
                f"[0, {axis_size}); got {mask_except_model_idx}."
            )
        keys = (
            jax.random.split(key, axis_size)
            if split_keys
            else jnp.broadcast_to(key, (axis_size, *key.shape))
        )
        self.module = eqx.filter_vmap(module_fn)(keys)
        self.model_axis_name = model_axis_name
        self.axis_size = axis_size
        self.mask_except_model_idx = mask_except_model_idx

    def __partition_specs__(self) -> Mapping[str, P]:
        return prefixed("module", stacked_partition_specs(self.module, self.model_axis_name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call this device's copy (inside `shard_map`) with `*args, **kwargs`.

        **Returns:** the copy's output, zeroed on all devices but `mask_except_model_idx` if
        that is set.
        """
        n = _bound_axis_size(
            self.model_axis_name, "ModelParallelismWrapper", argument="model_axis_name"
        )
        if n != self.axis_size:
            raise ValueError(
                f"ModelParallelismWrapper: built with axis_size={self.axis_size} but axis "
                f"{self.model_axis_name!r} has size {n}. Rebuild it with axis_size={n}."
            )
        arrays, static = eqx.partition(self.module, eqx.is_array)
        leading = {leaf.shape[0] for leaf in jax.tree.leaves(arrays)}
        if leading - {1}:
            raise ValueError(
                "ModelParallelismWrapper: each device must see one copy (leading dimension 1); "
                f"got leading dimensions {sorted(leading)}. Pass the wrapper into shard_map "
                "with the specs of `eqpar.partition_specs(model)`."
            )
        own = eqx.combine(jax.tree.map(lambda leaf: leaf[0], arrays), static)
        out = own(*args, **kwargs)  # type: ignore[operator]
        if self.mask_except_model_idx is None:
            return out
        keep = lax.axis_index(self.model_axis_name) == self.mask_except_model_idx
        return jax.tree.map(lambda y: jnp.where(keep, y, jnp.zeros_like(y)), out)
