"""Attention split over a mesh axis: `HeadParallelAttention` (heads) and
`ContextParallelAttention` (the sequence), twins of `eqx.nn.MultiheadAttention`."""

import math
from collections.abc import Callable, Hashable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, PRNGKeyArray, PyTree

from .._axes import axis_size
from .._checks import check_bool_mask, check_context_options, check_nonempty_sequence
from .._vma import cast_varying, varies_over
from ..context import all_gather_attention, ring_attention, ulysses_attention
from ._own_region import axis_names_of, call_in_own_region, needs_own_region
from ._twins import adopt, check_block, check_divides, check_sequence_layout, rebuilt

__all__ = [
    "ContextParallelAttention",
    "HeadParallelAttention",
]


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
    check_divides(owner, "num_heads", attention.num_heads, n, axis_name)
    heads = attention.num_heads // n
    for name, size, inputs in (
        ("query_proj", attention.qk_size, attention.query_size),
        ("key_proj", attention.qk_size, attention.key_size),
        ("value_proj", attention.vo_size, attention.value_size),
    ):
        check_block(
            owner, f"{name}.weight", getattr(attention, name).weight.shape, (heads * size, inputs)
        )
    check_block(
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


# The array arguments of an attention's call, as `eqx.nn.MultiheadAttention` names them.
_ARGUMENTS = ("query", "key_", "value", "mask", "key", "process_heads")


class HeadParallelAttention(eqx.nn.MultiheadAttention):
    """`eqx.nn.MultiheadAttention` with its heads split over a mesh axis.

    Device `d` of `n` computes heads `[d * h / n, (d + 1) * h / n)`: the query, key and value
    projections are split on their output rows (head-major, as `MultiheadAttention` lays
    them out), the output projection on its input columns, and one `psum` joins the heads'
    contributions; the output bias is added once. The call is `MultiheadAttention`'s: padding
    or causal masks (bool, `True` = attend; `[q_seq, kv_seq]`, or per head
    `[num_heads, q_seq, kv_seq]`; a mask of another dtype is refused), cross
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
        adopt(self, attention, eqx.nn.MultiheadAttention, axis_name)
        self.sequence_parallel = bool(sequence_parallel)

    def __partition_specs__(self) -> Mapping[str, P]:
        return _head_split_specs(self, self.axis_name)

    def to_serial(self) -> eqx.nn.MultiheadAttention:
        """The `eqx.nn.MultiheadAttention` with the same parameters."""
        return rebuilt(self, eqx.nn.MultiheadAttention)

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
        if needs_own_region(self.axis_name) and not self.sequence_parallel:
            options = {"inference": inference, "deterministic": deterministic}
            return call_in_own_region(
                owner,
                self.axis_name,
                self,
                lambda layer, q, k, v, m, rng, heads: layer(
                    q, k, v, m, key=rng, process_heads=heads, **options
                ),
                (query, key_, value, mask, key, process_heads),
                arg_specs=(P(),) * 6,
                out_specs=P(),
                arg_names=_ARGUMENTS,
            )
        if deterministic is not None:
            inference = deterministic
        check_bool_mask(owner, "mask", mask)
        heads, first_head = self._local_heads(owner)
        check_sequence_layout(owner, "query", query, self.axis_name, self.sequence_parallel)
        if self.sequence_parallel:
            query, key_, value = _gather_sequences((query, key_, value), self.axis_name)
        else:
            check_sequence_layout(owner, "key_", key_, self.axis_name, False)
            check_sequence_layout(owner, "value", value, self.axis_name, False)
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
        check_nonempty_sequence(
            owner,
            f"query length {query.shape[0]}, key/value length {key_.shape[0]}",
            query.shape[0],
            key_.shape[0],
        )

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

        def one_head(q: Array, k: Array, v: Array, head_mask: PyTree, head_key: PyTree) -> Array:
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


class ContextParallelAttention(eqx.nn.MultiheadAttention):
    """`eqx.nn.MultiheadAttention` over a sequence split across a mesh axis (context
    parallelism), made by `eqpar.ContextParallel`.

    `query`, `key_` and `value` are this device's blocks of the sequence (`[seq / n, size]`,
    sharded over `axis_name`); the layer projects its own tokens and attends to the whole
    sequence with `eqpar.context.ring_attention` (`strategy="ring"`: key/value blocks travel
    the ring, no device holds the whole key/value) or `all_gather_attention`
    (`strategy="all_gather"`: for short sequences) or `ulysses_attention`
    (`strategy="ulysses"`: all-to-alls trade the sequence split for a split of the heads,
    which must divide over the axis; least traffic when heads are many), and returns this
    device's block of the output, `[seq / n, output_size]`. The parameters stay whole on
    every device (their gradients are summed over the axis by `shard_map`'s autodiff),
    unless `head_axis_name` also splits the heads over a second (tensor-parallel) axis, as
    `HeadParallelAttention` does.

    The mask: a `[seq, seq]` mask cannot be cut into per-device blocks (each device's queries
    meet every device's keys), so causality is the layer's option (`causal=True`), and
    `mask` is a bool per-key padding mask for this device's keys, `[kv_block]` (`False` =
    padding), which travels with the keys. A 2-D or per-head mask is refused with that advice. With
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
    - `strategy`: `"ring"`, `"all_gather"` or `"ulysses"`.
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
        adopt(self, attention, eqx.nn.MultiheadAttention, axis_name)
        self.causal = bool(causal)
        self.layout = layout
        self.strategy = strategy
        self.head_axis_name = head_axis_name

    def __partition_specs__(self) -> Mapping[str, P]:
        return {} if self.head_axis_name is None else _head_split_specs(self, self.head_axis_name)

    def to_serial(self) -> eqx.nn.MultiheadAttention:
        """The `eqx.nn.MultiheadAttention` with the same parameters."""
        return rebuilt(self, eqx.nn.MultiheadAttention)

    def _own_region(
        self,
        owner: str,
        query: Array,
        key_: Array,
        value: Array,
        mask: Array | None,
        key: PRNGKeyArray | None,
        process_heads: Callable | None,
        options: dict,
    ) -> Array:
        """Called outside `shard_map` over the sequence axis (the one-device step on placed
        arrays): the whole sequence, split over the axis inside a region of its own."""
        if self.layout != "contiguous":
            raise ValueError(
                f"{owner}: with layout={self.layout!r} the sequence is stored in an order of "
                f"its own, which only `eqpar.shard_map` with the balanced sequence as input "
                f"gives (see `eqpar.context`); outside shard_map over {self.axis_name!r} the "
                f"layer takes the serial order. Use layout='contiguous', or run the step "
                f"inside `eqpar.shard_map`."
            )
        axes = axis_names_of(self.axis_name)
        if self.head_axis_name is not None:
            axes += axis_names_of(self.head_axis_name)
        sequence = P(self.axis_name)
        return call_in_own_region(
            owner,
            axes,
            self,
            lambda layer, q, k, v, m, rng, heads: layer(
                q, k, v, m, key=rng, process_heads=heads, **options
            ),
            (query, key_, value, mask, key, process_heads),
            arg_specs=(sequence, sequence, sequence, sequence, P(), P()),
            out_specs=sequence,
            arg_names=_ARGUMENTS,
        )

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
        if needs_own_region(self.axis_name):
            return self._own_region(
                owner,
                query,
                key_,
                value,
                mask,
                key,
                process_heads,
                {"inference": inference, "deterministic": deterministic},
            )
        del key
        if deterministic is not None:
            inference = deterministic
        n = axis_size(self.axis_name, owner)
        check_bool_mask(owner, "mask", mask)
        heads = self._heads(owner)
        if self.strategy == "ulysses" and heads % n:
            held = "" if self.head_axis_name is None else f" (after {self.head_axis_name!r})"
            raise ValueError(
                f"{owner}: strategy='ulysses' splits the heads over axis {self.axis_name!r}, "
                f"but this device's {heads} heads{held} do not divide over its {n} devices. "
                f"Use strategy='ring' (any head count), or a context axis whose size divides "
                f"the heads (eqpar.context.ulysses_attention's ring_axis_name adds a ring over "
                f"a second axis)."
            )
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
        attend = {
            "ring": ring_attention,
            "all_gather": all_gather_attention,
            "ulysses": ulysses_attention,
        }[self.strategy]
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
