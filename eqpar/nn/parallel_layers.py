"""Tensor-parallel twins of `eqx.nn` layers, made by `eqpar.parallelize`.

Each class here subclasses the Equinox layer it stands for and holds exactly that layer's
fields: the same parameter leaves, with the same global shapes and meaning (convention 1 of
the design), plus the mesh axis as a static field. So a model keeps its own classes' call
signatures, `isinstance(layer, eqx.nn.Linear)` still holds, a checkpoint of the converted
model loads into the original and back, and `to_serial()` returns the original class.

Inside `shard_map` each layer sees its own block of the parameters. Activations at the
boundaries are what the original layer takes and gives, replicated over the axis; inside a
block (between a column-parallel and a row-parallel layer, or the heads of an attention) they
are split over the axis on the feature dimension, and the block ends with one reduction:

| layer | split | takes | gives |
| --- | --- | --- | --- |
| `ColumnParallelLinear` | weight rows, bias | `[in]` | `[out / n]` (or `[out]`, gathered) |
| `RowParallelLinear` | weight columns | `[in / n]` | `[out]` (one `psum`) |
| `HeadParallelAttention` | heads | as `MultiheadAttention` | `[q_seq, out]` (one `psum`) |
| `VocabParallelEmbedding` | rows (vocabulary) | token ids | embeddings (one `psum`) |
| `FeatureParallelEmbedding` | columns (features) | token ids | embeddings (one gather) |
| `SequenceParallelDropout` | nothing | this device's tokens | its rows of the serial mask |
| `ContextParallelAttention` | the sequence | this device's tokens | its tokens' output |

Gradients need no help from the user: with `shard_map`'s default `check_vma=True`, JAX
types a replicated input that meets a split weight as varying, and the transpose of that
cast sums its cotangent over the axis.
"""

import dataclasses
import inspect
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Shaped

from .._axes import axis_size
from .._checks import check_column_options, check_context_options
from .._vma import cast_varying, varies_over
from ..context import all_gather_attention, ring_attention

__all__ = [
    "ColumnParallelLinear",
    "ContextParallelAttention",
    "FeatureParallelEmbedding",
    "HeadParallelAttention",
    "RowParallelLinear",
    "SequenceParallelDropout",
    "VocabParallelEmbedding",
    "gather_sequence",
    "scatter_sequence",
    "to_serial_layer",
    "vocab_parallel_cross_entropy",
]


def _copy_fields(source: eqx.Module, target: eqx.Module, cls: type) -> None:
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        object.__setattr__(target, field.name, getattr(source, field.name))


def _rebuilt(layer: eqx.Module, cls: type) -> Any:
    """`layer`'s fields of `cls` in a new `cls` instance (no initialisation, no key)."""
    new = object.__new__(cls)
    _copy_fields(layer, new, cls)
    return new


def _check_divides(owner: str, label: str, size: int, n: int, axis_name: Hashable) -> None:
    if size % n:
        raise ValueError(
            f"{owner}: {label}={size} does not divide by the size of axis {axis_name!r} ({n}). "
            f"Choose a model whose {label} is a multiple of {n}, or a smaller axis."
        )


def _check_block(owner: str, name: str, got: tuple, expected: tuple) -> None:
    if got == expected:
        return
    if len(got) > len(expected):
        raise ValueError(
            f"{owner}: the local block of {name} has shape {got}, with leading dimensions "
            f"beyond the layer's own {expected}: a stack of layers called as one. Keep stacks "
            f"in `eqpar.nn.ScannedLayers` or `PipelineModule.from_layers` (or unstack them with "
            f"`eqpar.nn.unstack_layers`), which index one layer per call and shift its layout."
        )
    raise ValueError(
        f"{owner}: the local block of {name} has shape {got} but {expected} was expected. "
        f"Pass the model into `eqpar.shard_map` with the specs of "
        f"`eqpar.partition_specs(model)` as its in_specs."
    )


def _check_sequence_layout(
    owner: str, name: str, x: Array, axis_name: Hashable, sequence_parallel: bool
) -> None:
    """Refuse an input split over the sequence where the whole one belongs, and the reverse,
    which would otherwise mix tokens of different devices silently."""
    sharded = varies_over(x, axis_name)
    if sharded is None or sharded == sequence_parallel:
        return
    if sequence_parallel:
        raise ValueError(
            f"{owner}: sequence_parallel=True, but `{name}` is the same on every device of axis "
            f"{axis_name!r}, not split over the sequence. Call `eqpar.nn.scatter_sequence` where "
            f"the sequence-parallel part of the model begins (after the embeddings), or drop "
            f"sequence_parallel=True from this layer's style."
        )
    raise ValueError(
        f"{owner}: `{name}` differs between the devices of axis {axis_name!r} (split over the "
        f"sequence by `eqpar.nn.scatter_sequence`?), but this layer takes the whole input on "
        f"every device. Set sequence_parallel=True on its style and on the rest of its block, "
        f"or call `eqpar.nn.gather_sequence` before it."
    )


_GATHER_TAKES_TO = "to" in inspect.signature(lax.all_gather).parameters


def _gather_replicated(x: Array, axis_name: Hashable, axis: int) -> Array:
    """All-gather blocks into the whole array, typed as the same on every device.

    A plain `all_gather` result is typed as varying over the axis, which a later
    `out_specs=P()` would refuse; newer JAX can state the result is replicated.
    """
    if _GATHER_TAKES_TO:
        try:
            return lax.all_gather(x, axis_name, axis=axis, tiled=True, to="invarying")  # type: ignore[call-arg]
        except ValueError:  # JAX 0.9 takes `to`, but only "varying" or "reduced"
            pass
    gather_invariant = getattr(lax, "all_gather_invariant", None)
    if gather_invariant is not None:
        return gather_invariant(x, axis_name, axis=axis, tiled=True)
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def _adopt(target: eqx.Module, source: Any, cls: type, axis_name: Hashable) -> None:
    """Make `target` (a twin of `cls` under construction) hold `source`'s fields and the axis."""
    if not isinstance(source, cls):
        raise TypeError(
            f"{type(target).__name__}: expected an eqx.nn.{cls.__name__}; got "
            f"{type(source).__name__}."
        )
    _copy_fields(source, target, cls)
    object.__setattr__(target, "axis_name", axis_name)


def _check_linear(linear: Any, owner: str) -> None:
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
        _adopt(self, linear, eqx.nn.Linear, axis_name)
        self.gather_output = bool(gather_output)
        self.sequence_parallel = bool(sequence_parallel)

    def __partition_specs__(self) -> Mapping[str, P]:
        specs = {"weight": P(self.axis_name, None), "bias": P(self.axis_name)}
        return specs if self.bias is not None else {"weight": specs["weight"]}

    def to_serial(self) -> eqx.nn.Linear:
        """The `eqx.nn.Linear` with the same parameters."""
        return _rebuilt(self, eqx.nn.Linear)

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
        n = axis_size(self.axis_name, owner)
        assert isinstance(self.out_features, int) and isinstance(self.in_features, int)
        _check_divides(owner, "out_features", self.out_features, n, self.axis_name)
        _check_block(owner, "weight", self.weight.shape, (self.out_features // n, self.in_features))
        if x.shape != (self.in_features,):
            raise ValueError(
                f"{owner}: the input must be one example's features [in_features] = "
                f"[{self.in_features}], as for eqx.nn.Linear; got shape {x.shape}. Apply the "
                f"layer to a batch with jax.vmap."
            )
        _check_sequence_layout(owner, "x", x, self.axis_name, self.sequence_parallel)
        if self.sequence_parallel:
            tokens = lax.all_gather(x, self.axis_name)  # [n, in]: one token from each device
            return jax.vmap(lambda token: eqx.nn.Linear.__call__(self, token))(tokens)
        y = super().__call__(x, key=key)
        return _gather_replicated(y, self.axis_name, y.ndim - 1) if self.gather_output else y


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
        _adopt(self, linear, eqx.nn.Linear, axis_name)
        self.sequence_parallel = bool(sequence_parallel)

    def __partition_specs__(self) -> Mapping[str, P]:
        specs = {"weight": P(None, self.axis_name), "bias": P()}
        return specs if self.bias is not None else {"weight": specs["weight"]}

    def to_serial(self) -> eqx.nn.Linear:
        """The `eqx.nn.Linear` with the same parameters."""
        return _rebuilt(self, eqx.nn.Linear)

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
        n = axis_size(self.axis_name, owner)
        assert isinstance(self.out_features, int) and isinstance(self.in_features, int)
        _check_divides(owner, "in_features", self.in_features, n, self.axis_name)
        _check_block(owner, "weight", self.weight.shape, (self.out_features, self.in_features // n))
        if self.sequence_parallel:
            if x.shape != (n, self.in_features // n):
                raise ValueError(
                    f"{owner}: with sequence_parallel=True the input must be [n, in_features / "
                    f"n] = [{n}, {self.in_features // n}], as a ColumnParallelLinear with "
                    f"sequence_parallel=True gives; got shape {x.shape}."
                )
            partial = jax.vmap(lambda block: self.weight @ block)(x)  # [n, out]
            y = lax.psum_scatter(partial, self.axis_name, scatter_dimension=0)
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
        y = lax.psum(self.weight @ x, self.axis_name)
        return y if self.bias is None else y + self.bias


_ATTENTION_PROJECTIONS = ("query_proj", "key_proj", "value_proj")


def _head_split_specs(attention: eqx.nn.MultiheadAttention, axis: Hashable) -> dict[str, P]:
    """The specs of an attention whose heads are split over `axis`."""
    specs: dict[str, P] = {}
    for name in _ATTENTION_PROJECTIONS:
        specs[f"{name}/weight"] = P(axis, None)
        if getattr(attention, name).bias is not None:
            specs[f"{name}/bias"] = P(axis)
    specs["output_proj/weight"] = P(None, axis)
    if attention.output_proj.bias is not None:
        specs["output_proj/bias"] = P()
    return specs


def _local_heads(
    attention: eqx.nn.MultiheadAttention, axis_name: Hashable, owner: str
) -> tuple[int, Array]:
    """This device's number of heads and its first head, heads split over `axis_name`."""
    n = axis_size(axis_name, owner)
    _check_divides(owner, "num_heads", attention.num_heads, n, axis_name)
    heads = attention.num_heads // n
    for name, size, inputs in (
        ("query_proj", attention.qk_size, attention.query_size),
        ("key_proj", attention.qk_size, attention.key_size),
        ("value_proj", attention.vo_size, attention.value_size),
    ):
        _check_block(
            owner, f"{name}.weight", getattr(attention, name).weight.shape, (heads * size, inputs)
        )
    _check_block(
        owner,
        "output_proj.weight",
        attention.output_proj.weight.shape,
        (attention.output_size, heads * attention.vo_size),
    )
    return heads, lax.axis_index(axis_name) * heads


def _project_heads(
    attention: eqx.nn.MultiheadAttention,
    query: Array,
    key_: Array,
    value: Array,
    heads: int,
    process_heads: Callable | None,
    owner: str,
) -> tuple[Array, Array, Array]:
    """Query, key and value projected into `heads` heads each (`[seq, heads, size]`), then
    through `process_heads`, which must keep their shapes: the step the converted attention
    layers share with `eqx.nn.MultiheadAttention`."""

    def project(linear: eqx.nn.Linear, x: Array) -> Array:
        return jax.vmap(linear)(x).reshape(x.shape[0], heads, -1)

    query_heads = project(attention.query_proj, query)
    key_heads = project(attention.key_proj, key_)
    value_heads = project(attention.value_proj, value)
    if process_heads is not None:
        shapes = (query_heads.shape, key_heads.shape, value_heads.shape)
        query_heads, key_heads, value_heads = process_heads(query_heads, key_heads, value_heads)
        if (query_heads.shape, key_heads.shape, value_heads.shape) != shapes:
            raise ValueError(f"{owner}: process_heads must not change the heads' shapes.")
    return query_heads, key_heads, value_heads


class HeadParallelAttention(eqx.nn.MultiheadAttention):
    """`eqx.nn.MultiheadAttention` with its heads split over a mesh axis.

    Device `d` of `n` computes heads `[d * h / n, (d + 1) * h / n)`: the query, key and value
    projections are split on their output rows (head-major, as `MultiheadAttention` lays
    them out), the output projection on its input columns, and one `psum` joins the heads'
    contributions; the output bias is added once. The call is `MultiheadAttention`'s: padding
    or causal masks (`[q_seq, kv_seq]`, or per head `[num_heads, q_seq, kv_seq]`), cross
    attention (key and value of another length), `inference`, `process_heads`, and dropout
    on the attention weights. `process_heads` sees this device's heads only
    (`[seq, num_heads / n, size]`), so it must treat every head alike (rotary embeddings do);
    one that depends on the head's index (ALiBi slopes) would need that index passed in. Dropout
    draws the same per-head keys as the serial layer
    (`jax.random.split(key, num_heads)`) and uses this device's, so a training step with
    dropout equals the serial one.

    With `sequence_parallel=True`, `query`, `key_` and `value` are this device's blocks of the
    sequence (`[seq / n, size]`, sharded over the same axis, as between the blocks of a
    sequence-parallel model) while `mask` is still the whole `[q_seq, kv_seq]`: the layer
    all-gathers the sequence (once for self-attention), attends with its heads, and a
    reduce-scatter in place of the `psum` returns this device's block of the output,
    `[q_seq / n, output_size]`. In cross attention `key_` and `value` may be split over the
    sequence too or held whole by every device (an encoder's output): a whole one is used as
    it is, without a gather. A query that is not split, or a split input given to a layer
    without `sequence_parallel=True`, is an error rather than a silent mix of tokens.

    **Arguments:**

    - `attention`: the `eqx.nn.MultiheadAttention` to convert.
    - `axis_name`: the mesh axis to split the heads over; `num_heads` must divide by its size.
    - `sequence_parallel`: inputs and output are sequence-sharded over the same axis.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import HeadParallelAttention

    mesh = eqpar.DeviceMesh((4,), ("model",), devices=jax.devices()[:4])
    attention = eqx.nn.MultiheadAttention(8, 32, key=jax.random.key(0))
    layer = HeadParallelAttention(attention)
    x = jax.random.normal(jax.random.key(1), (6, 32))
    mask = jnp.tril(jnp.ones((6, 6), bool))  # causal
    f = eqpar.shard_map(
        lambda m, x, mask: m(x, x, x, mask), mesh=mesh,
        in_specs=(eqpar.partition_specs(layer), P(), P()), out_specs=P(),
    )
    assert jnp.allclose(f(layer, x, mask), attention(x, x, x, mask), atol=1e-5)
    ```
    """

    axis_name: Hashable = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self,
        attention: eqx.nn.MultiheadAttention,
        *,
        axis_name: Hashable = "model",
        sequence_parallel: bool = False,
    ):
        _adopt(self, attention, eqx.nn.MultiheadAttention, axis_name)
        self.sequence_parallel = bool(sequence_parallel)

    def __partition_specs__(self) -> Mapping[str, P]:
        return _head_split_specs(self, self.axis_name)

    def to_serial(self) -> eqx.nn.MultiheadAttention:
        """The `eqx.nn.MultiheadAttention` with the same parameters."""
        return _rebuilt(self, eqx.nn.MultiheadAttention)

    def _local_heads(self, owner: str) -> tuple[int, Array]:
        return _local_heads(self, self.axis_name, owner)

    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        # The mask's own names: under sequence parallelism it is whole while the inputs are
        # this device's blocks of the sequence.
        mask: Bool[Array, "mask_q mask_kv"] | Bool[Array, "num_heads mask_q mask_kv"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: Callable | None = None,
    ) -> Float[Array, "q_seq o_size"]:
        """Attention over this device's heads, summed over the axis.

        **Arguments:** as `eqx.nn.MultiheadAttention.__call__`; `query`, `key_`, `value` and
        `mask` are the whole arrays, the same on every device of the axis. With
        `sequence_parallel=True`, `query` (and `key_` / `value`, unless every device holds them
        whole) are this device's blocks of the sequence, while `mask` is whole.

        **Returns:** `[q_seq, output_size]`, the same on every device of the axis; with
        `sequence_parallel=True`, this device's block `[q_seq / n, output_size]`.
        """
        owner = type(self).__name__
        if deterministic is not None:
            inference = deterministic
        heads, first_head = self._local_heads(owner)
        _check_sequence_layout(owner, "query", query, self.axis_name, self.sequence_parallel)
        if self.sequence_parallel:
            query, key_, value = _gather_sequences((query, key_, value), self.axis_name)
        else:
            _check_sequence_layout(owner, "key_", key_, self.axis_name, False)
            _check_sequence_layout(owner, "value", value, self.axis_name, False)
            # Each projection's weight differs over the axis, so autodiff sums the cotangent
            # of the input it reads over the axis. Cast each distinct input once (self
            # attention passes one array three times): one sum in the backward pass, not three.
            varying: dict[int, Array] = {}
            for x in (query, key_, value):
                if id(x) not in varying:
                    varying[id(x)] = cast_varying(x, frozenset({self.axis_name}))
            query, key_, value = (varying[id(x)] for x in (query, key_, value))
        if key_.shape[0] != value.shape[0]:
            raise ValueError(
                f"{owner}: key_ and value must have the same sequence length; got "
                f"{key_.shape[0]} and {value.shape[0]}."
            )
        _check_sequences(owner, query.shape[0], key_.shape[0])

        query_heads, key_heads, value_heads = _project_heads(
            self, query, key_, value, heads, process_heads, owner
        )
        if mask is not None and mask.ndim == 3:
            if mask.shape[0] != self.num_heads:
                raise ValueError(
                    f"{owner}: a per-head mask must have num_heads={self.num_heads} rows; got "
                    f"shape {mask.shape}."
                )
            mask = lax.dynamic_slice_in_dim(mask, first_head, heads, axis=0)
        # The serial layer gives head i the key split(key, num_heads)[i]: draw them all and
        # keep this device's, so the dropout masks are the serial ones.
        keys = None
        if key is not None:
            keys = lax.dynamic_slice_in_dim(
                jax.random.split(key, self.num_heads), first_head, heads, axis=0
            )

        def one_head(q: Array, k: Array, v: Array, head_mask: Any, head_key: Any) -> Array:
            logits = jnp.einsum("sd,Sd->sS", q / math.sqrt(q.shape[-1]), k)
            if head_mask is not None:
                if head_mask.shape != logits.shape:
                    raise ValueError(
                        f"{owner}: mask must have shape (q_seq, kv_seq) = {logits.shape} (or "
                        f"(num_heads, q_seq, kv_seq)); got {head_mask.shape}."
                    )
                logits = jnp.where(head_mask, logits, jnp.finfo(logits.dtype).min)
            with jax.numpy_dtype_promotion("standard"):
                dtype = jnp.result_type(logits.dtype, jnp.float32)
            weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
            weights = self.dropout(weights, key=head_key, inference=inference)
            return jnp.einsum("sS,Sd->sd", weights, v)

        mask_axis = 0 if mask is not None and mask.ndim == 3 else None
        key_axis = None if keys is None else 0
        attn = jax.vmap(one_head, in_axes=(1, 1, 1, mask_axis, key_axis), out_axes=1)(
            query_heads, key_heads, value_heads, mask, keys
        )
        attn = attn.reshape(query.shape[0], -1)
        partial = jax.vmap(lambda row: self.output_proj.weight @ row)(attn)
        if self.sequence_parallel:
            out = lax.psum_scatter(partial, self.axis_name, scatter_dimension=0, tiled=True)
        else:
            out = lax.psum(partial, self.axis_name)
        return out if self.output_proj.bias is None else out + self.output_proj.bias


def _check_sequences(owner: str, query_length: int, key_length: int) -> None:
    """Attention over an empty sequence has no softmax to take: refuse it by name."""
    if query_length == 0 or key_length == 0:
        raise ValueError(
            f"{owner}: zero-length sequence (query length {query_length}, key/value length "
            f"{key_length}); attention needs at least one token on each side. Drop empty "
            f"examples, or pad them to one token and mask it out."
        )


def _gather_sequences(arrays: tuple[Array, ...], axis_name: Hashable) -> tuple[Array, ...]:
    """All-gather each array's blocks along its first (sequence) axis. An array passed more
    than once (self-attention) is gathered once; one that every device already holds whole
    (an encoder memory in cross attention) is used as it is."""
    gathered: dict[int, Array] = {}
    for x in arrays:
        if id(x) not in gathered:
            whole = varies_over(x, axis_name) is False
            gathered[id(x)] = x if whole else lax.all_gather(x, axis_name, axis=0, tiled=True)
    return tuple(gathered[id(x)] for x in arrays)


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
    return _gather_replicated(x, axis_name, 0)


class _SplitEmbedding(eqx.nn.Embedding):
    """What the two split embeddings share: the axis, conversion from and to the original."""

    axis_name: Hashable = eqx.field(static=True)

    def __init__(self, embedding: eqx.nn.Embedding, *, axis_name: Hashable = "model"):
        _adopt(self, embedding, eqx.nn.Embedding, axis_name)

    def to_serial(self) -> eqx.nn.Embedding:
        """The `eqx.nn.Embedding` with the same table."""
        return _rebuilt(self, eqx.nn.Embedding)


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
        _check_divides(owner, "num_embeddings", self.num_embeddings, n, self.axis_name)
        rows = self.num_embeddings // n
        _check_block(owner, "weight", self.weight.shape, (rows, self.embedding_size))
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
        _check_divides(owner, "embedding_size", self.embedding_size, n, self.axis_name)
        _check_block(
            owner, "weight", self.weight.shape, (self.num_embeddings, self.embedding_size // n)
        )
        found = self.weight[(x,)]
        return _gather_replicated(found, self.axis_name, found.ndim - 1)


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
        _adopt(self, dropout, eqx.nn.Dropout, axis_name)

    def to_serial(self) -> eqx.nn.Dropout:
        """The `eqx.nn.Dropout` with the same `p` and `inference`."""
        return _rebuilt(self, eqx.nn.Dropout)

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
        if deterministic is not None:
            inference = deterministic
        if inference is None:
            inference = self.inference
        if isinstance(self.p, int | float) and self.p == 0:
            inference = True
        if inference:
            return x
        if key is None:
            raise RuntimeError(f"{owner} requires a key when running in non-deterministic mode.")
        n = axis_size(self.axis_name, owner)
        if x.ndim == 0:
            raise ValueError(f"{owner}: x must have a sequence axis first; got a scalar.")
        _check_sequence_layout(owner, "x", x, self.axis_name, True)
        block = x.shape[0]
        keep = 1 - lax.stop_gradient(self.p)
        mask = jax.random.bernoulli(key, keep, (n * block, *x.shape[1:]))
        mask = lax.dynamic_slice_in_dim(mask, lax.axis_index(self.axis_name) * block, block, 0)
        return jnp.where(mask, x / keep, 0)


class ContextParallelAttention(eqx.nn.MultiheadAttention):
    """`eqx.nn.MultiheadAttention` over a sequence split across a mesh axis (context
    parallelism), made by `eqpar.ContextParallel`.

    `query`, `key_` and `value` are this device's blocks of the sequence (`[seq / n, size]`,
    sharded over `axis_name`); the layer projects its own tokens and attends to the whole
    sequence with `eqpar.context.ring_attention` (`strategy="ring"`: key/value blocks travel
    the ring, no device holds the whole key/value) or `all_gather_attention`
    (`strategy="all_gather"`: for short sequences), and returns this device's block of the
    output, `[seq / n, output_size]`. The parameters stay whole on every device (their
    gradients are summed over the axis by `shard_map`'s autodiff), unless `head_axis_name`
    also splits the heads over a second (tensor-parallel) axis, as `HeadParallelAttention`
    does.

    The mask: a `[seq, seq]` mask cannot be cut into per-device blocks (each device's queries
    meet every device's keys), so causality is the layer's option (`causal=True`), and
    `mask` is a per-key padding mask for this device's keys, `[kv_block]` (`False` = padding),
    which travels with the keys. A 2-D or per-head mask is refused with that advice. With
    `layout="balanced"` the sequence is stored in the balanced order of
    `eqpar.context.balance_sequence` (causal work equal on every device). `process_heads` sees
    this device's tokens: a position-dependent one (rotary embeddings) must use their global
    positions, `eqpar.context.sequence_positions`. Dropout on the attention weights is
    refused in training (the weights never exist whole); `inference=True` or `p=0` runs.

    **Arguments:**

    - `attention`: the `eqx.nn.MultiheadAttention` to convert; its parameters are kept.
    - `axis_name`: the mesh axis the sequence is split over.
    - `causal`: causal attention over the whole sequence.
    - `layout`: `"contiguous"` or `"balanced"` (see `eqpar.context`).
    - `strategy`: `"ring"` or `"all_gather"`.
    - `head_axis_name`: optional second mesh axis to split the heads over.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn.parallel_layers import ContextParallelAttention

    mesh = eqpar.DeviceMesh((4,), ("context",), devices=jax.devices()[:4])
    attention = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    layer = ContextParallelAttention(attention, causal=True)
    x = jax.random.normal(jax.random.key(1), (12, 16))
    f = eqpar.shard_map(
        lambda m, x: m(x, x, x), mesh=mesh,
        in_specs=(eqpar.partition_specs(layer), P("context")), out_specs=P("context"),
    )
    causal = jnp.tril(jnp.ones((12, 12), bool))
    assert jnp.allclose(f(layer, x), attention(x, x, x, causal), atol=1e-5)
    ```
    """

    axis_name: Hashable = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    layout: str = eqx.field(static=True)
    strategy: str = eqx.field(static=True)
    head_axis_name: Hashable | None = eqx.field(static=True)

    def __init__(
        self,
        attention: eqx.nn.MultiheadAttention,
        *,
        axis_name: Hashable = "context",
        causal: bool = False,
        layout: str = "contiguous",
        strategy: str = "ring",
        head_axis_name: Hashable | None = None,
    ):
        check_context_options(type(self).__name__, layout, strategy, axis_name, head_axis_name)
        _adopt(self, attention, eqx.nn.MultiheadAttention, axis_name)
        self.causal = bool(causal)
        self.layout = layout
        self.strategy = strategy
        self.head_axis_name = head_axis_name

    def __partition_specs__(self) -> Mapping[str, P]:
        return {} if self.head_axis_name is None else _head_split_specs(self, self.head_axis_name)

    def to_serial(self) -> eqx.nn.MultiheadAttention:
        """The `eqx.nn.MultiheadAttention` with the same parameters."""
        return _rebuilt(self, eqx.nn.MultiheadAttention)

    def _heads(self, owner: str) -> int:
        if self.head_axis_name is None:
            return self.num_heads
        return _local_heads(self, self.head_axis_name, owner)[0]

    def __call__(
        self,
        query: Float[Array, "q_block q_size"],
        key_: Float[Array, "kv_block k_size"],
        value: Float[Array, "kv_block v_size"],
        mask: Bool[Array, "..."] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: Callable | None = None,
    ) -> Float[Array, "q_block o_size"]:
        """This device's block of the attention output over the whole sequence.

        **Arguments:** as `eqx.nn.MultiheadAttention.__call__`, with `query`, `key_` and
        `value` this device's blocks of the sequence and `mask` a per-key padding mask
        `[kv_block]` of this device's keys (or `None`).

        **Returns:** `[q_block, output_size]`, this device's block of the output.
        """
        owner = type(self).__name__
        del key
        if deterministic is not None:
            inference = deterministic
        axis_size(self.axis_name, owner)
        heads = self._heads(owner)
        if inference is None:
            inference = self.dropout.inference
        p = self.dropout.p
        if not inference and not (isinstance(p, int | float) and p == 0):
            raise ValueError(
                f"{owner}: dropout on the attention weights (p={p}) cannot run under context "
                f"parallelism, where the weights of a query never exist whole. Build the "
                f"attention with dropout_p=0 (dropout after the attention is fine), or call it "
                f"with inference=True."
            )
        if varies_over(query, self.axis_name) is False:
            raise ValueError(
                f"{owner}: `query` is the same on every device of axis {self.axis_name!r}, not "
                f"split over the sequence. Give the sequence to shard_map with "
                f"P({self.axis_name!r}) on its axis (or `eqpar.nn.scatter_sequence(x, "
                f"{self.axis_name!r})`)."
            )
        if key_.shape[0] != value.shape[0]:
            raise ValueError(
                f"{owner}: key_ and value must have the same sequence length; got "
                f"{key_.shape[0]} and {value.shape[0]}."
            )
        if mask is not None and mask.shape != (key_.shape[0],):
            raise ValueError(
                f"{owner}: under context parallelism `mask` is a per-key padding mask of this "
                f"device's keys, shape (kv_block,) = ({key_.shape[0]},); got {mask.shape}. A "
                f"[q_seq, kv_seq] mask cannot be split over devices: for causal attention set "
                f"causal=True on the ContextParallel style, and pass padding as one boolean "
                f"per key."
            )
        if self.head_axis_name is not None:
            # As in HeadParallelAttention: each distinct input cast once, so its gradient is
            # summed over the head axis once.
            varying: dict[int, Array] = {}
            for x in (query, key_, value):
                if id(x) not in varying:
                    varying[id(x)] = cast_varying(x, frozenset({self.head_axis_name}))
            query, key_, value = (varying[id(x)] for x in (query, key_, value))

        query_heads, key_heads, value_heads = _project_heads(
            self, query, key_, value, heads, process_heads, owner
        )
        attend = ring_attention if self.strategy == "ring" else all_gather_attention
        attn = attend(
            query_heads,
            key_heads,
            value_heads,
            axis_name=self.axis_name,
            causal=self.causal,
            key_mask=mask,
            layout=self.layout,  # type: ignore[arg-type]
        ).reshape(query.shape[0], -1)
        if self.head_axis_name is None:
            return jax.vmap(self.output_proj)(attn)
        partial = jax.vmap(lambda row: self.output_proj.weight @ row)(attn)
        out = lax.psum(partial, self.head_axis_name)
        return out if self.output_proj.bias is None else out + self.output_proj.bias


# Every layer class of this module (each has `to_serial()`).
PARALLEL_LAYERS = (
    ColumnParallelLinear,
    RowParallelLinear,
    HeadParallelAttention,
    VocabParallelEmbedding,
    FeatureParallelEmbedding,
    SequenceParallelDropout,
    ContextParallelAttention,
)


def to_serial_layer(layer: Any) -> Any:
    """`layer.to_serial()` for the layers of this module; any other value as it is.

    **Arguments:**

    - `layer`: any value.

    **Returns:** the original `eqx.nn` layer for a converted one, else `layer` itself.

    ```python
    import equinox as eqx, jax
    from eqpar.nn import RowParallelLinear
    from eqpar.nn.parallel_layers import to_serial_layer
    linear = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    assert type(to_serial_layer(RowParallelLinear(linear))) is eqx.nn.Linear
    assert to_serial_layer(3) == 3
    ```
    """
    return layer.to_serial() if isinstance(layer, PARALLEL_LAYERS) else layer
