"""Context (sequence) parallelism: attention over a sequence split across a mesh axis.

Inside `shard_map`, each device of a `context` axis holds `seq / n` tokens of every
sequence: its block of the queries, keys and values. Three ways to attend over the whole
sequence from there:

- `ring_attention`: every device keeps its queries while the key/value blocks travel the
  ring (`lax.ppermute`, one neighbour per step); an online (log-sum-exp) softmax in float32
  folds in one block at a time. No device ever holds the whole key/value or a `[seq, seq]`
  score matrix; the backward pass (a `jax.custom_vjp`) sends the key/value blocks round the
  ring again, with their gradients travelling beside them, and keeps only this device's
  blocks, its output and the log-sum-exp as residuals.
- `all_gather_attention`: all-gather the keys and values, attend locally. Less
  communication in the backward pass (one reduce-scatter of the key/value gradients), but
  every device holds the whole key/value: the choice for short sequences.
- `ulysses_attention`: an all-to-all trades the sequence split for a split of the heads
  (each device gets the whole sequence of `H / n` heads), attention runs locally, and a
  second all-to-all trades back. The heads must divide over the axis (with
  `ring_axis_name`, only over this axis: a ring over another axis attends between the
  longer blocks). Least traffic when `n` is large: the bytes do not grow with `n`.

Memory and communication per device, for one attention call of `B` sequences of length `S`
with `H` heads of size `D` (`b` bytes per element, `n` devices, `c = S / n`, and
`X = B c H D`, one device's block of queries, keys or values):

| | ring | all-gather | Ulysses |
| --- | --- | --- | --- |
| scores held at once | `B H c^2` | `B H c S` | `B (H/n) S^2` |
| keys/values held | `2 X` (2 blocks) | `2 n X` (whole) | `2 X` (`H/n` heads, whole) |
| bytes received, forward | `2 (n-1) X b` | `2 (n-1) X b` | `4 (n-1)/n X b` |
| bytes received, backward | `2 (n-1) X b + 2 n X 4` | `2 (n-1) X 4` | `4 (n-1)/n X b` |

(plus `(n - 1) B c` bytes per pass for a key padding mask). The ring's backward moves the
key/value blocks again and their float32 gradients one full turn. Ulysses's four arrays are
the queries, keys, values and output forward, and their gradients backward (with
grouped-query attention the keys and values count the heads that cross, `lcm(H_kv, n)` at
most, instead of `H`; with values of another size, `Dv` for the values and the output).

**Causal attention and load balance.** With `causal=True` a device whose tokens come late in
the sequence attends to more keys than one whose tokens come early. With
`layout="balanced"` the sequence is cut into `2 n` chunks and device `i` holds chunks `i` and
`2 n - 1 - i` (one early, one late), so every device does the same work: at each ring step
it attends either all its queries to half the visiting block or half its queries to all of
it, and pairs that the causal mask hides entirely are skipped. Put a global array in this
order with `balance_sequence` before the `shard_map` (tokens, labels, masks: everything
split over the sequence), and back with `unbalance_sequence` after it; `sequence_positions`
gives each device the global positions of its tokens (for position embeddings). With
`layout="contiguous"` device `i` holds tokens `[i c, (i + 1) c)` in natural order, and the
ring skips the blocks above the diagonal (device `n - 1` does `n` times device 0's work).

A query that sees no key at all (every visible key padded) gets zeros, as does its gradient;
`eqx.nn.MultiheadAttention` would give it the mean of all values.
"""

import functools
import math
from collections.abc import Hashable
from typing import Literal, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Shaped

from ._axes import axis_names, axis_size
from ._checks import check_bool_mask, check_nonempty_sequence
from ._typing import AxisName
from ._vma import cast_varying, varying_axes
from .collectives import ring_shift

__all__ = [
    "all_gather_attention",
    "balance_sequence",
    "ring_attention",
    "sequence_positions",
    "ulysses_attention",
    "unbalance_sequence",
]

Layout = Literal["contiguous", "balanced"]
_LAYOUTS = ("contiguous", "balanced")


def _check_layout(owner: str, layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"{owner}: layout must be 'contiguous' or 'balanced'; got {layout!r}.")


def _balanced_order(length: int, num_devices: int) -> jax.Array:
    """Natural positions in balanced order: entry `p` is the token stored at place `p`."""
    chunk = length // (2 * num_devices)
    chunks = jnp.arange(length).reshape(2 * num_devices, chunk)
    first = jnp.arange(num_devices)
    pairs = jnp.stack([chunks[first], chunks[2 * num_devices - 1 - first]], axis=1)
    return pairs.reshape(length)


def _check_balanced_length(owner: str, length: int, num_devices: int) -> None:
    if num_devices < 1 or length % (2 * num_devices):
        raise ValueError(
            f"{owner}: the sequence length {length} must divide by 2 * num_devices = "
            f"{2 * num_devices} for the balanced layout (2 chunks per device). Pad the sequence "
            f"to a multiple of {2 * max(num_devices, 1)} and mask the padding."
        )


def balance_sequence(
    x: Shaped[ArrayLike, "..."], num_devices: int, *, axis: int = 0
) -> Shaped[Array, "..."]:
    """`x` with its sequence axis reordered for `layout="balanced"` context parallelism.

    The sequence is cut into `2 n` chunks and reordered so that, split into `n` equal blocks
    (as `shard_map` with `P("context")` on that axis does), block `i` holds chunks `i` and
    `2 n - 1 - i`. Apply it outside `shard_map` to every array split over the sequence
    (tokens, targets, padding masks); `unbalance_sequence` undoes it.

    **Arguments:**

    - `x`: an array with a sequence axis of length divisible by `2 * num_devices`.
    - `num_devices`: the size `n` of the context axis.
    - `axis`: the sequence axis of `x`.

    **Returns:** `x` with the sequence axis in balanced order.

    ```python
    import jax.numpy as jnp
    from eqpar.context import balance_sequence, unbalance_sequence
    x = jnp.arange(8)
    assert balance_sequence(x, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert (unbalance_sequence(balance_sequence(x, 2), 2) == x).all()
    ```
    """
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"balance_sequence: axis={axis} is out of range for shape {x.shape}.")
    _check_balanced_length("balance_sequence", x.shape[axis], num_devices)
    return jnp.take(x, _balanced_order(x.shape[axis], num_devices), axis=axis)


def unbalance_sequence(
    x: Shaped[ArrayLike, "..."], num_devices: int, *, axis: int = 0
) -> Shaped[Array, "..."]:
    """The inverse of `balance_sequence`: the sequence axis back in natural order.

    **Arguments:**

    - `x`: an array whose sequence axis is in balanced order (e.g. a model's output
      gathered from a `shard_map` that ran with `layout="balanced"`).
    - `num_devices`: the size `n` of the context axis.
    - `axis`: the sequence axis of `x`.

    **Returns:** `x` with the sequence axis in natural order.

    ```python
    import jax.numpy as jnp
    from eqpar.context import unbalance_sequence
    assert unbalance_sequence(jnp.array([0, 1, 6, 7, 2, 3, 4, 5]), 2).tolist() == list(range(8))
    ```
    """
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"unbalance_sequence: axis={axis} is out of range for shape {x.shape}.")
    _check_balanced_length("unbalance_sequence", x.shape[axis], num_devices)
    inverse = jnp.argsort(_balanced_order(x.shape[axis], num_devices))
    return jnp.take(x, inverse, axis=axis)


def _positions(device: Array | int, block: int, n: int, layout: str) -> Array:
    """Global positions of the `block` tokens that `device` holds."""
    local = jnp.arange(block)
    if layout == "contiguous":
        return device * block + local
    half = block // 2
    chunk = jnp.where(local < half, device, 2 * n - 1 - device)
    return chunk * half + local % half


def sequence_positions(
    block_length: int, *, axis_name: AxisName, layout: Layout = "contiguous"
) -> Int[Array, " block_length"]:
    """Global positions (in the natural sequence) of this device's tokens, inside `shard_map`.

    For position embeddings (`embedding(positions)`, rotary angles) in a model whose sequence
    is split over `axis_name`.

    **Arguments:**

    - `block_length`: the number of tokens this device holds (`seq / n`).
    - `axis_name`: the context axis.
    - `layout`: `"contiguous"` or `"balanced"`, as given to the attention.

    **Returns:** int32 positions `[block_length]`.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.context import sequence_positions

    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    f = jax.shard_map(
        lambda x: sequence_positions(4, axis_name="context", layout="balanced"),
        mesh=mesh, in_specs=P("context"), out_specs=P("context"),
    )
    assert f(jnp.zeros(8)).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    ```
    """
    owner = "sequence_positions"
    _check_layout(owner, layout)
    n = axis_size(axis_name, owner)
    if layout == "balanced" and block_length % 2:
        raise ValueError(
            f"{owner}: with layout='balanced' each device holds two equal chunks, so "
            f"block_length must be even; got {block_length}."
        )
    return _positions(lax.axis_index(axis_name), block_length, n, layout).astype(jnp.int32)


# ----------------------------------------------------------------------------------------
# Shared checks and the per-block arithmetic (arrays are [B, seq, heads, size] here).


class _Config(NamedTuple):
    axis_name: Hashable
    causal: bool
    layout: str
    scale: float


def _check_inputs(
    owner: str,
    query: Array,
    key: Array,
    value: Array,
    key_mask: Array | None,
    causal: bool,
    layout: str,
    *,
    grouped: bool = False,
) -> None:
    """`grouped`: keys and values may have fewer heads than the queries, a divisor of
    theirs (grouped-query attention)."""
    _check_layout(owner, layout)
    if query.ndim < 3:
        raise ValueError(
            f"{owner}: query must be [*batch, seq_block, heads, head_dim]; got shape "
            f"{query.shape}. A single head still needs its heads axis of size 1."
        )
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch or key.ndim != query.ndim:
        raise ValueError(
            f"{owner}: query, key and value must share their batch dimensions; got shapes "
            f"{query.shape}, {key.shape}, {value.shape}."
        )
    kv_heads = key.shape[-2]
    divides = kv_heads > 0 and query.shape[-2] % kv_heads == 0
    if grouped and key.shape[-1] == query.shape[-1] and divides:
        pass  # grouped-query attention: each key/value head serves a group of query heads
    elif grouped:
        raise ValueError(
            f"{owner}: key must have query's head size {query.shape[-1]} and a number of "
            f"heads that divides query's {query.shape[-2]} (grouped-query attention); got "
            f"{key.shape[-2:]} (heads, head size)."
        )
    elif key.shape[-2:] != query.shape[-2:]:
        raise ValueError(
            f"{owner}: key must have query's heads and head size {query.shape[-2:]}; got "
            f"{key.shape[-2:]}."
        )
    if value.shape[-3:-1] != key.shape[-3:-1]:
        raise ValueError(
            f"{owner}: value must have key's sequence block and heads {key.shape[-3:-1]}; got "
            f"{value.shape[-3:-1]}."
        )
    check_nonempty_sequence(
        owner,
        f"query block length {query.shape[-3]}, key/value block length {key.shape[-3]}",
        query.shape[-3],
        key.shape[-3],
    )
    check_bool_mask(owner, "key_mask", key_mask)
    if key_mask is not None and key_mask.shape != key.shape[:-2]:
        raise ValueError(
            f"{owner}: key_mask must be one boolean per key, [*batch, kv_block] = "
            f"{key.shape[:-2]}; got {key_mask.shape}."
        )
    if causal and query.shape[-3] != key.shape[-3]:
        raise ValueError(
            f"{owner}: causal=True needs query and key blocks of the same length (self "
            f"attention); got {query.shape[-3]} and {key.shape[-3]}."
        )
    if layout == "balanced" and query.shape[-3] % 2:
        raise ValueError(
            f"{owner}: layout='balanced' holds two equal chunks per device, so the local "
            f"sequence block must be even; got {query.shape[-3]}."
        )


def _scores(q: Array, k: Array, mask: Array | None, scale: float) -> Array:
    """Masked scores `[B, H, q, k]` in float32 (-inf where masked)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _block_mask(q_pos: Array, k_pos: Array, key_mask: Array | None, causal: bool) -> Array | None:
    """`[B or 1, 1, q, k]` booleans, or None when nothing is masked."""
    mask = None
    if causal:
        mask = (q_pos[:, None] >= k_pos[None, :])[None, None]
    if key_mask is not None:
        padding = key_mask[:, None, None, :]
        mask = padding if mask is None else mask & padding
    return mask


class _Softmax(NamedTuple):
    """Online softmax state for this device's queries: unnormalised output, running max and
    running sum of exponentials."""

    acc: Array  # [B, q, H, Dv] float32
    row_max: Array  # [B, H, q]
    row_sum: Array  # [B, H, q]


def _fold(state: _Softmax, q: Array, k: Array, v: Array, mask: Array | None, scale: float):
    s = _scores(q, k, mask, scale)
    new_max = jnp.maximum(state.row_max, s.max(axis=-1))
    # A row that has seen only masked keys keeps max -inf: shift by 0 instead, so that
    # exp(-inf - 0) = 0 and no nan appears.
    shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    rescale = jnp.exp(state.row_max - shift)
    p = jnp.exp(s - shift[..., None])
    row_sum = state.row_sum * rescale + p.sum(axis=-1)
    acc = state.acc * jnp.swapaxes(rescale, 1, 2)[..., None]
    acc = acc + jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    return _Softmax(acc, new_max, row_sum)


def _rows(state: _Softmax, rows: slice) -> _Softmax:
    return _Softmax(state.acc[:, rows], state.row_max[..., rows], state.row_sum[..., rows])


def _put_rows(state: _Softmax, rows: slice, part: _Softmax) -> _Softmax:
    return _Softmax(
        state.acc.at[:, rows].set(part.acc),
        state.row_max.at[..., rows].set(part.row_max),
        state.row_sum.at[..., rows].set(part.row_sum),
    )


class _Grads(NamedTuple):
    dq: Array
    dk: Array
    dv: Array


def _block_grads(q, k, v, mask, d_out, lse, delta, scale) -> _Grads:
    """Gradients of one (query block, key block) pair from the saved log-sum-exp."""
    s = _scores(q, k, mask, scale)
    p = jnp.exp(s - lse[..., None])  # masked -> exp(-inf) = 0
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, d_out)
    dp = jnp.einsum("bqhd,bkhd->bhqk", d_out, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32)) * scale
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * scale
    return _Grads(dq, dk, dv)


def _padded(x: Array, rows: slice, length: int) -> Array:
    """`x` (rows `rows` of a `[B, length, ...]` array) placed in zeros of the full length."""
    return jnp.zeros((x.shape[0], length, *x.shape[2:]), x.dtype).at[:, rows].set(x)


# ----------------------------------------------------------------------------------------
# The ring.

_ALL = slice(None)


def _pair_plan(config: _Config, block: int, step_kind: str) -> tuple[slice, slice, bool] | None:
    """Which query rows meet which key rows at a ring step, and whether the causal mask is
    still needed; `None` when the causal mask hides the pair entirely.

    `step_kind` is `"own"` (the device's own block), `"earlier"` (the block of a device with
    a lower index) or `"later"`."""
    if not config.causal:
        return _ALL, _ALL, False
    if step_kind == "own":
        return _ALL, _ALL, True
    if config.layout == "contiguous":
        return (_ALL, _ALL, False) if step_kind == "earlier" else None
    half = block // 2
    # Device i holds chunks (i, 2n-1-i). An earlier device j < i: its first chunk j precedes
    # both of ours, its second chunk 2n-1-j follows both. A later device j > i: both its
    # chunks follow our first chunk and precede our second.
    if step_kind == "earlier":
        return _ALL, slice(0, half), False
    return slice(half, None), _ALL, False


def _source(t: Array | int, n: int, axis_name: Hashable) -> tuple[Array, Array]:
    me = lax.axis_index(axis_name)
    return me, (me - t) % n


def _ring_forward(config: _Config, q, k, v, key_mask):
    n = axis_size(config.axis_name, "ring_attention")
    batch, q_len, heads, _ = q.shape
    kv_len = k.shape[1]
    me = lax.axis_index(config.axis_name)
    q_pos = _positions(me, q_len, n, config.layout)

    def fold(state, kv, source, step_kind):
        k_blk, v_blk, m_blk = kv
        plan = _pair_plan(config, kv_len, step_kind)
        if plan is None:
            return state
        rows, cols, causal = plan
        k_pos = _positions(source, kv_len, n, config.layout)
        mask = _block_mask(
            q_pos[rows], k_pos[cols], None if m_blk is None else m_blk[:, cols], causal
        )
        part = _fold(_rows(state, rows), q[:, rows], k_blk[:, cols], v_blk[:, cols], mask,
                     config.scale)  # fmt: skip
        return _put_rows(state, rows, part)

    state = _Softmax(
        jnp.zeros((batch, q_len, heads, v.shape[-1]), jnp.float32),
        jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32),
        jnp.zeros((batch, heads, q_len), jnp.float32),
    )
    state = jax.tree.map(lambda x: cast_varying(x, varying_axes(q)), state)
    kv = (k, v, key_mask)
    state = fold(state, kv, me, "own")

    def step(carry, t):
        state, kv = carry
        kv = ring_shift(kv, config.axis_name)
        _, source = _source(t, n, config.axis_name)
        if config.causal:
            state = lax.cond(
                source < me,
                lambda s: fold(s, kv, source, "earlier"),
                lambda s: fold(s, kv, source, "later"),
                state,
            )
        else:
            state = fold(state, kv, source, "any")
        return (state, kv), None

    if n > 1:
        (state, _), _ = lax.scan(step, (state, kv), jnp.arange(1, n))
    empty = state.row_sum == 0
    row_sum = jnp.where(empty, 1.0, state.row_sum)
    out = state.acc / jnp.swapaxes(row_sum, 1, 2)[..., None]
    # Rows that saw no key: +inf makes exp(s - lse) = 0 in the backward pass.
    lse = jnp.where(empty, jnp.inf, state.row_max + jnp.log(row_sum))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(config: _Config, q, k, v, key_mask):
    out, _ = _ring_forward(config, q, k, v, key_mask)
    return out.astype(q.dtype)


def _ring_fwd(config: _Config, q, k, v, key_mask):
    out, lse = _ring_forward(config, q, k, v, key_mask)
    out = out.astype(q.dtype)
    return out, (q, k, v, key_mask, out, lse)


def _ring_bwd(config: _Config, residuals, d_out):
    q, k, v, key_mask, out, lse = residuals
    n = axis_size(config.axis_name, "ring_attention")
    q_len, kv_len = q.shape[1], k.shape[1]
    me = lax.axis_index(config.axis_name)
    q_pos = _positions(me, q_len, n, config.layout)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.swapaxes(jnp.sum(d_out * out.astype(jnp.float32), axis=-1), 1, 2)  # [B, H, q]
    axes = varying_axes(q) | varying_axes(d_out)

    def grads(kv, source, step_kind) -> _Grads:
        k_blk, v_blk, m_blk = kv
        plan = _pair_plan(config, kv_len, step_kind)
        if plan is None:
            zeros = (jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
            return _Grads(*(cast_varying(z, axes) for z in zeros))
        rows, cols, causal = plan
        k_pos = _positions(source, kv_len, n, config.layout)
        mask = _block_mask(
            q_pos[rows], k_pos[cols], None if m_blk is None else m_blk[:, cols], causal
        )
        g = _block_grads(
            q[:, rows], k_blk[:, cols], v_blk[:, cols], mask, d_out[:, rows],
            lse[..., rows], delta[..., rows], config.scale,
        )  # fmt: skip
        return _Grads(
            _padded(g.dq, rows, q_len), _padded(g.dk, cols, kv_len), _padded(g.dv, cols, kv_len)
        )

    own = grads((k, v, key_mask), me, "own")
    dq, dkv = own.dq, (own.dk, own.dv)
    dq, dkv = jax.tree.map(lambda x: cast_varying(x, axes), (dq, dkv))

    def step(carry, t):
        dq, kv, dkv = carry
        kv, dkv = ring_shift((kv, dkv), config.axis_name)
        _, source = _source(t, n, config.axis_name)
        if config.causal:
            g = lax.cond(
                source < me,
                lambda: grads(kv, source, "earlier"),
                lambda: grads(kv, source, "later"),
            )
        else:
            g = grads(kv, source, "any")
        return (dq + g.dq, kv, (dkv[0] + g.dk, dkv[1] + g.dv)), None

    if n > 1:
        (dq, _, dkv), _ = lax.scan(step, (dq, (k, v, key_mask), dkv), jnp.arange(1, n))
        # The gradients now sit one device before their owner: one more step home.
        dkv = ring_shift(dkv, config.axis_name)
    dk, dv = dkv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _prepare(
    owner: str,
    query: Array,
    key: Array,
    value: Array,
    key_mask: Array | None,
    axis_name: AxisName,
    causal: bool,
    layout: str,
    scale: float | None,
    *,
    grouped: bool = False,
) -> tuple[int, float, Array, Array, Array, Array | None]:
    """Checked inputs, typed as varying alike, with their batch dimensions flattened into one
    (one added where there are none)."""
    _check_inputs(owner, query, key, value, key_mask, causal, layout, grouped=grouped)
    n = axis_size(axis_name, owner)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    # Every input typed as varying over the same axes (the context axis at least), so the
    # ring's loop carries one type; the transpose of the cast sums a gradient over the axes an
    # input did not vary over, once, outside the custom rule.
    axes = frozenset({axis_name}).union(
        *(varying_axes(x) for x in (query, key, value, key_mask) if x is not None)
    )
    lead = query.ndim - 3
    q, k, v = (cast_varying(x, axes).reshape((-1, *x.shape[lead:])) for x in (query, key, value))
    mask = None
    if key_mask is not None:
        mask = cast_varying(key_mask, axes).reshape((-1, key_mask.shape[-1]))
    return n, float(scale), q, k, v, mask


def ring_attention(
    query: Float[Array, "*batch q_block heads qk_size"],
    key: Float[Array, "*batch kv_block heads qk_size"],
    value: Float[Array, "*batch kv_block heads v_size"],
    *,
    axis_name: AxisName,
    causal: bool = False,
    key_mask: Bool[Array, "*batch kv_block"] | None = None,
    layout: Layout = "contiguous",
    scale: float | None = None,
) -> Float[Array, "*batch q_block heads v_size"]:
    """Attention over a sequence split across `axis_name`, the key/value blocks travelling the
    ring (inside `shard_map`).

    Each device keeps its query block; at each of `n - 1` steps the key/value block (and its
    padding mask) moves one device up the ring and is folded into a float32 online softmax,
    so a device holds at most two key/value blocks and one `[q_block, kv_block]` score matrix
    per head. The gradient is a custom rule that sends the key/value blocks round again with
    their gradients beside them; its residuals are this device's inputs, output and
    log-sum-exp. With `causal=True`, pairs of blocks that the mask hides are skipped (see the
    module's notes on `layout`). `jax.nn.dot_product_attention` attends to a whole key/value
    sequence; this function exists for the sequence that no device holds whole.

    **Rotary positions.** A model that rotates its queries and keys with its own code (a
    port with raw weight arrays, say) numbers tokens with something like
    `jnp.arange(seq)`; under context parallelism that numbers every device's block from 0.
    Rotate by `sequence_positions(q_block, axis_name=axis_name, layout=layout)` instead,
    the global positions of this device's tokens: that one line is the whole change.

    **Arguments:**

    - `query`: this device's queries, `[*batch, q_block, heads, qk_size]`.
    - `key`, `value`: this device's keys and values, `[*batch, kv_block, heads, size]`, split
      over the axis in the same layout as the queries.
    - `axis_name`: the mesh axis the sequence is split over.
    - `causal`: each token attends only to tokens at or before its position in the whole
      sequence (positions from `layout`; needs `q_block == kv_block`).
    - `key_mask`: optional bool `[*batch, kv_block]`, `False` for padding keys; it travels
      with its keys. A mask of another dtype is refused (an additive mask, 0 / -inf,
      converts with `key_mask == 0`).
    - `layout`: `"contiguous"` (device `i` holds block `i`) or `"balanced"` (device `i` holds
      chunks `i` and `2 n - 1 - i`; see `balance_sequence`).
    - `scale`: the factor on the scores (default `1 / sqrt(qk_size)`).

    **Returns:** `[*batch, q_block, heads, v_size]`, this device's block of the attention
    output, in the query's dtype.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.context import ring_attention

    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 16, 2, 8))  # [seq, heads, size] each
    f = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name="context", causal=True),
        mesh=mesh, in_specs=P("context"), out_specs=P("context"),
    )
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert jnp.allclose(f(q, k, v), expected, atol=1e-5)
    ```
    """
    owner = "ring_attention"
    batch = query.shape[:-3]
    _, scale, q, k, v, mask = _prepare(
        owner, query, key, value, key_mask, axis_name, causal, layout, scale
    )
    out = cast(Array, _ring(_Config(axis_name, bool(causal), layout, scale), q, k, v, mask))
    return out.reshape((*batch, *out.shape[1:]))


def all_gather_attention(
    query: Float[Array, "*batch q_block heads qk_size"],
    key: Float[Array, "*batch kv_block heads qk_size"],
    value: Float[Array, "*batch kv_block heads v_size"],
    *,
    axis_name: AxisName,
    causal: bool = False,
    key_mask: Bool[Array, "*batch kv_block"] | None = None,
    layout: Layout = "contiguous",
    scale: float | None = None,
) -> Float[Array, "*batch q_block heads v_size"]:
    """Attention over a sequence split across `axis_name` by all-gathering the keys and values
    (inside `shard_map`): the short-sequence twin of `ring_attention`, with the same
    arguments and result.

    One all-gather brings every device the whole key/value (and padding mask); the local
    queries attend to it with a float32 softmax. The gradient flows back through the
    all-gather's transpose, a reduce-scatter of the key/value gradients. Every device holds
    the whole key/value and `[q_block, seq]` scores per head, so memory grows with the
    sequence; communication is one all-gather forward and one reduce-scatter backward (no
    second pass of the keys and values, as the ring needs).

    The softmax is written here rather than with `jax.nn.dot_product_attention` so that
    values may have another head size than keys (as `eqx.nn.MultiheadAttention` allows) and
    so that a query that sees no key gets zeros, as in `ring_attention`.

    **Arguments:** as `ring_attention`.

    **Returns:** `[*batch, q_block, heads, v_size]`, this device's block of the output.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.context import all_gather_attention

    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 16, 2, 8))
    f = jax.shard_map(
        lambda q, k, v: all_gather_attention(q, k, v, axis_name="context", causal=True),
        mesh=mesh, in_specs=P("context"), out_specs=P("context"),
    )
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert jnp.allclose(f(q, k, v), expected, atol=1e-5)
    ```
    """
    owner = "all_gather_attention"
    batch = query.shape[:-3]
    n, scale, q, k, v, key_mask = _prepare(
        owner, query, key, value, key_mask, axis_name, causal, layout, scale
    )
    q_len, kv_len = q.shape[1], k.shape[1]
    whole_k = lax.all_gather(k, axis_name, axis=1, tiled=True)
    whole_v = lax.all_gather(v, axis_name, axis=1, tiled=True)
    whole_mask = None
    if key_mask is not None:
        whole_mask = lax.all_gather(key_mask, axis_name, axis=1, tiled=True)
    me = lax.axis_index(axis_name)
    q_pos = _positions(me, q_len, n, layout)
    k_pos = jnp.concatenate([_positions(j, kv_len, n, layout) for j in range(n)])
    mask = _block_mask(q_pos, k_pos, whole_mask, causal)
    out = _attend(q, whole_k, whole_v, mask, scale).astype(query.dtype)
    return out.reshape((*batch, *out.shape[1:]))


def _attend(q: Array, k: Array, v: Array, mask: Array | None, scale: float) -> Array:
    """Softmax attention of `q` over all of `k` and `v` in float32, `[B, q, H, Dv]`; a query
    that sees no key gets zeros. Written here rather than with
    `jax.nn.dot_product_attention` so that values may have another head size than keys (as
    `eqx.nn.MultiheadAttention` allows) and so that such a query gets zeros, as in
    `ring_attention`."""
    s = _scores(q, k, mask, scale)
    row_max = s.max(axis=-1, keepdims=True)
    seen = ~jnp.isneginf(row_max)
    p = jnp.exp(s - jnp.where(seen, row_max, 0.0))
    weights = p / jnp.where(seen, p.sum(axis=-1, keepdims=True), 1.0)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(jnp.float32))


def ulysses_attention(
    query: Float[Array, "*batch q_block heads qk_size"],
    key: Float[Array, "*batch kv_block kv_heads qk_size"],
    value: Float[Array, "*batch kv_block kv_heads v_size"],
    *,
    axis_name: AxisName,
    causal: bool = False,
    key_mask: Bool[Array, "*batch kv_block"] | None = None,
    layout: Layout = "contiguous",
    scale: float | None = None,
    ring_axis_name: AxisName | None = None,
) -> Float[Array, "*batch q_block heads v_size"]:
    """Attention over a sequence split across `axis_name` by trading the split for a split
    of the heads (Ulysses; inside `shard_map`): the twin of `ring_attention`, with the same
    arguments and result.

    An all-to-all gives each device the whole sequence of `heads / n` of the heads (its
    block of every device's queries, keys and values), it attends over the whole sequence
    for those heads, and a second all-to-all returns each device its block of the sequence
    with every head. Per device and attention call it receives `(n - 1) / n` of its queries,
    keys, values and output, `(n - 1) / n x B c (H D + 2 H' D + H Dv) b` bytes forward and
    the same backward (the all-to-alls' transposes), with `H'` the key/value heads that cross
    (`lcm(kv_heads, n)` when they are repeated, below); against the ring's forward
    `(n - 1) 2 B c H D b` that is `2 / n` of it for `H' = H` and `Dv = D`. It holds `[S, S]`
    scores for its `H / n` heads, like `all_gather_attention` for its whole heads.

    - **Heads.** The query heads must divide over the axis. Keys and values may have fewer
      heads, a divisor of the query's (grouped-query attention): they travel as they are
      when their count divides the axis too; otherwise each is repeated the fewest times
      that make it divide (to `lcm(kv_heads, n)` heads), which moves that many more bytes.
    - **Hybrid.** With `ring_axis_name`, the sequence is split over both axes, in this
      order: `P((ring_axis_name, axis_name))` on it (contiguous layout). The all-to-all runs
      over `axis_name` only, and the ring over `ring_axis_name` attends between the
      resulting longer blocks. Heads need to divide only `axis_name`'s size, so a head count
      that does not divide all the devices still runs. The other order,
      `P((axis_name, ring_axis_name))`, cannot be told apart inside `shard_map` and gives
      wrong results. With grouped-query keys and values the ring carries them repeated to
      the local query heads (`H / n` heads, not `H' / n`).
    - Causal and padding masks and the layouts are as in `ring_attention`; rotary positions
      are the caller's, from `sequence_positions` (global positions, as for the ring).

    **Arguments:** as `ring_attention`, and

    - `key`, `value`: `kv_heads` heads, a divisor of the query's `heads`.
    - `ring_axis_name`: an optional second axis the sequence is split over, attended over
      by `ring_attention` (the hybrid above).

    **Returns:** `[*batch, q_block, heads, v_size]`, this device's block of the output.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.context import ulysses_attention

    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 16, 4, 8))  # [seq, heads, size] each
    f = jax.shard_map(
        lambda q, k, v: ulysses_attention(q, k, v, axis_name="context", causal=True),
        mesh=mesh, in_specs=P("context"), out_specs=P("context"),
    )
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert jnp.allclose(f(q, k, v), expected, atol=1e-5)
    ```
    """
    owner = "ulysses_attention"
    batch = query.shape[:-3]
    if ring_axis_name is not None and set(axis_names(ring_axis_name)) & set(axis_names(axis_name)):
        raise ValueError(
            f"{owner}: ring_axis_name={ring_axis_name!r} shares a mesh axis with "
            f"axis_name={axis_name!r}; the hybrid needs two different axes, the sequence split "
            f"over both as P((ring_axis_name, axis_name)). Without a second axis, leave "
            f"ring_axis_name out."
        )
    if ring_axis_name is not None and layout != "contiguous":
        raise ValueError(
            f"{owner}: with ring_axis_name the sequence is split over two axes in contiguous "
            f"blocks; layout={layout!r} is for one axis. Use layout='contiguous'."
        )
    n, scale, q, k, v, key_mask = _prepare(
        owner, query, key, value, key_mask, axis_name, causal, layout, scale, grouped=True
    )
    if ring_axis_name is not None:
        axis_size(ring_axis_name, owner)
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % n:
        raise ValueError(
            f"{owner}: the {heads} query heads do not divide over the {n} devices of axis "
            f"{axis_name!r}. Split the sequence over fewer devices for the all-to-all and the "
            f"rest with ring_axis_name=..., or use ring_attention, which takes any head count."
        )
    # Key/value heads repeated the fewest times that make them divide the axis (each query
    # head keeps its key/value head: head h becomes heads h r ... h r + r - 1).
    repeat = math.lcm(kv_heads, n) // kv_heads
    if repeat > 1:
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)

    def to_heads(x: Array) -> Array:  # [B, c, H, D] -> [B, n c, H / n, D]
        return lax.all_to_all(x, axis_name, 2, 1, tiled=True)

    q_heads, k_heads, v_heads = to_heads(q), to_heads(k), to_heads(v)
    whole_mask = None
    if key_mask is not None:
        whole_mask = lax.all_gather(key_mask, axis_name, axis=1, tiled=True)
    # This device's key/value heads, each repeated for its group of local query heads.
    group = q_heads.shape[2] // k_heads.shape[2]
    k_heads, v_heads = (jnp.repeat(x, group, axis=2) for x in (k_heads, v_heads))
    if ring_axis_name is None:
        # Every device's block in axis order: the whole sequence, in `layout` order.
        positions = jnp.concatenate([_positions(j, q.shape[1], n, layout) for j in range(n)])
        mask = _block_mask(positions, positions, whole_mask, causal)
        out = _attend(q_heads, k_heads, v_heads, mask, scale).astype(query.dtype)
    else:
        out = ring_attention(
            q_heads,
            k_heads,
            v_heads,
            axis_name=ring_axis_name,
            causal=causal,
            key_mask=whole_mask,
            scale=scale,
        )
    out = lax.all_to_all(out, axis_name, 1, 2, tiled=True)  # back to [B, c, H, Dv]
    return out.reshape((*batch, *out.shape[1:]))
