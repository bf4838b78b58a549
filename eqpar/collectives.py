"""Ring collectives built on `lax.ppermute`, for use inside `shard_map`.

Each function here splits an `all_gather` or a `psum_scatter` into the `n - 1` neighbour
exchanges of a ring. Written this way, every step is a separate `collective-permute` that the
compiler can schedule next to the matmul consuming (or producing) its block, which is how the
tensor-parallel layers overlap communication with compute.

Direction convention (`n` devices on the axis, `d` this device's index):

- *shifting up* sends device `j`'s block to `j + 1`; after `i` steps device `d` holds the
  block of `d - i`;
- *shifting down* sends it to `j - 1`; after `i` steps device `d` holds the block of `d + i`.

All functions accept any pytree of arrays in place of a single array. The rings are unrolled
Python loops: `n` is a static mesh-axis size (typically 2-16), and each step must be its own
operation for the scheduler to overlap it.
"""

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PyTree

from ._axes import axis_size
from ._paths import path_to_str
from ._typing import AxisName

__all__ = [
    "async_gather",
    "async_gather_bidirectional",
    "async_gather_split",
    "async_scatter",
    "async_scatter_bidirectional",
    "async_scatter_split",
    "ring_gather_matmul",
    "ring_matmul_scatter",
    "ring_shift",
]


def _shift(tree: PyTree, axis_name: AxisName, n: int, up: bool) -> PyTree:
    offset = 1 if up else -1
    permutation = [(j, (j + offset) % n) for j in range(n)]
    return lax.ppermute(tree, axis_name, permutation)


def ring_shift(x: PyTree, axis_name: AxisName, *, up: bool = True) -> PyTree:
    """One step of the ring: every device sends `x` to its neighbour.

    The building block of the ring collectives, for loops that consume each block as it
    arrives (e.g. inside `lax.scan`).

    **Arguments:**

    - `x`: this device's block (an array or a pytree of arrays).
    - `axis_name`: the mesh axis of the ring.
    - `up`: send to index `d + 1` (so `d` receives from `d - 1`); `False` sends to `d - 1`.

    **Returns:** the block of device `d - 1` (up) or `d + 1` (down).

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import ring_shift

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    out = jax.shard_map(
        lambda x: ring_shift(x, "model"), mesh=mesh, in_specs=P("model"), out_specs=P("model")
    )(jnp.arange(4.0))
    assert out.tolist() == [3.0, 0.0, 1.0, 2.0]
    ```
    """
    return _shift(x, axis_name, axis_size(axis_name, "ring_shift"), up)


def _source_offsets(n: int, shift_up: bool) -> list[int]:
    """Item `i` of a gather comes from device `d + offsets[i]`."""
    sign = -1 if shift_up else 1
    return [(sign * i) % n for i in range(n)]


def _ring_walk(tree: PyTree, axis_name: AxisName, n: int, up: bool, steps: int) -> list[PyTree]:
    """`[tree, shift(tree), shift(shift(tree)), ...]` with `steps` shifts."""
    received = [tree]
    for _ in range(steps):
        received.append(_shift(received[-1], axis_name, n, up))
    return received


def async_gather(x: PyTree, axis_name: AxisName, shift_up: bool = True) -> list[PyTree]:
    """All-gather `x` over `axis_name` as `n - 1` ring steps in one direction.

    **Arguments:**

    - `x`: this device's block (an array or a pytree of arrays).
    - `axis_name`: the mesh axis to gather over (inside `shard_map`).
    - `shift_up`: direction of the ring; see **Returns**.

    **Returns:** a list of `n` items (`n` is the axis size). Item `i` is the block of axis
    index `(d - i) % n` when shifting up and `(d + i) % n` when shifting down, where `d` is this
    device's index; item 0 is `x` itself.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import async_gather

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))

    def f(x):
        return jnp.stack(async_gather(x, "model"))  # [n, 1]

    out = jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(
        jnp.arange(4.0)
    )
    # device 2 received the blocks of devices 2, 1, 0, 3
    assert out.reshape(4, 4)[2].tolist() == [2.0, 1.0, 0.0, 3.0]
    ```
    """
    n = axis_size(axis_name, "async_gather")
    return _ring_walk(x, axis_name, n, shift_up, n - 1)


def async_gather_bidirectional(
    x: PyTree, axis_name: AxisName, shift_up: bool = True
) -> list[PyTree]:
    """Same result as `async_gather`, using both ring directions.

    The nearest `ceil((n - 1) / 2)` blocks on one side travel one way and the rest travel the
    other way, so each direction carries about half of the blocks and the last block arrives
    after about `n / 2` steps instead of `n - 1`.

    **Arguments:**

    - `x`: this device's block (an array or a pytree of arrays).
    - `axis_name`: the mesh axis to gather over.
    - `shift_up`: the item order, exactly as in `async_gather`.

    **Returns:** the same list as `async_gather(x, axis_name, shift_up)`.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import async_gather_bidirectional

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    f = lambda x: jnp.stack(async_gather_bidirectional(x, "model"))
    out = jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(
        jnp.arange(4.0)
    )
    assert out.reshape(4, 4)[2].tolist() == [2.0, 1.0, 0.0, 3.0]
    ```
    """
    n = axis_size(axis_name, "async_gather_bidirectional")
    steps_forward = n // 2  # items 1..n//2 in the requested direction
    steps_backward = n - 1 - steps_forward
    forward = _ring_walk(x, axis_name, n, shift_up, steps_forward)
    backward = _ring_walk(x, axis_name, n, not shift_up, steps_backward)
    # item i (i > n//2) is the block n - i steps the other way
    return forward + [backward[n - i] for i in range(steps_forward + 1, n)]


def _split_last(x: jax.Array, name: str) -> tuple[jax.Array, jax.Array]:
    if x.ndim == 0:
        raise ValueError(
            f"{name} needs arrays with at least one dimension to split in two halves; got a "
            "scalar leaf. Reshape it to shape (1,) or use `async_gather` / `async_scatter`."
        )
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _split_tree(tree: PyTree, name: str) -> tuple[PyTree, PyTree]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    pairs = [_split_last(leaf, name) for leaf in leaves]
    first = jax.tree_util.tree_unflatten(treedef, [p[0] for p in pairs])
    second = jax.tree_util.tree_unflatten(treedef, [p[1] for p in pairs])
    return first, second


def _join_tree(first: PyTree, second: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=-1), first, second)


def async_gather_split(x: PyTree, axis_name: AxisName, shift_up: bool = True) -> list[PyTree]:
    """Same result as `async_gather`, half of each block going each way round the ring.

    Every leaf is cut in two on its last axis; the first half goes around the ring one way
    and the second half the other way, so each direction moves half the bytes of
    `async_gather` in the same `n - 1` steps. An odd last dimension is split unevenly
    (`k // 2` and `k - k // 2`) and works the same.

    **Arguments:**

    - `x`: this device's block (an array or a pytree of arrays, each at least 1-D).
    - `axis_name`: the mesh axis to gather over.
    - `shift_up`: the item order, exactly as in `async_gather`.

    **Returns:** the same list as `async_gather(x, axis_name, shift_up)`.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import async_gather_split

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    f = lambda x: jnp.stack(async_gather_split(x, "model"))
    x = jnp.arange(12.0).reshape(4, 3)  # feature size 3 splits as 1 + 2
    out = jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(x)
    assert out.reshape(4, 4, 3)[1, 1].tolist() == x[0].tolist()
    ```
    """
    n = axis_size(axis_name, "async_gather_split")
    first, second = _split_tree(x, "async_gather_split")
    along = _ring_walk(first, axis_name, n, shift_up, n - 1)
    against = _ring_walk(second, axis_name, n, not shift_up, n - 1)
    # the block i steps one way is n - i steps the other way
    return [_join_tree(along[i], against[(n - i) % n]) for i in range(n)]


def _check_chunks(xs: Sequence[PyTree], n: int, name: str) -> None:
    if not isinstance(xs, Sequence):
        raise TypeError(
            f"{name}: xs must be a list or tuple of n = {n} chunks (one per destination "
            f"device); got {type(xs).__name__}."
        )
    if len(xs) != n:
        raise ValueError(
            f"{name}: len(xs) must equal the size of the mesh axis ({n}), one chunk per "
            f"destination device; got {len(xs)} chunks."
        )
    # The chunks are summed across devices, so every chunk must be the same pytree of the
    # same shapes and dtypes; otherwise broadcasting would add them silently.
    first = jax.tree.structure(xs[0])
    expected = [(jnp.shape(leaf), jnp.result_type(leaf)) for leaf in jax.tree.leaves(xs[0])]
    for index, chunk in enumerate(xs[1:], start=1):
        if jax.tree.structure(chunk) != first:
            raise ValueError(
                f"{name}: chunk {index} has the pytree structure {jax.tree.structure(chunk)} but "
                f"chunk 0 has {first}; every chunk must have the same structure."
            )
        flat = jax.tree_util.tree_flatten_with_path(chunk)[0]
        for (path, leaf), (shape, dtype) in zip(flat, expected):
            got = (jnp.shape(leaf), jnp.result_type(leaf))
            if got != (shape, dtype):
                where = f" at leaf {path_to_str(path)!r}" if path else ""
                raise ValueError(
                    f"{name}: chunk {index}{where} has shape {got[0]} and dtype {got[1]}, but "
                    f"chunk 0 has {shape} and {dtype}; every chunk must have the same shapes "
                    f"and dtypes (split the array into equal pieces, padding the last)."
                )


def _ring_reduce(
    chunk_at_step: Callable[[int], PyTree], axis_name: AxisName, n: int, up: bool, steps: int
) -> PyTree:
    """Pass a running sum `steps` times around the ring, adding `chunk_at_step(t)` after hop t."""
    total = chunk_at_step(0)
    for step in range(1, steps + 1):
        total = jax.tree.map(jnp.add, _shift(total, axis_name, n, up), chunk_at_step(step))
    return total


def async_scatter(xs: Sequence[PyTree], axis_name: AxisName, shift_up: bool = True) -> PyTree:
    """Reduce-scatter over `axis_name` as `n - 1` ring steps passing running sums.

    On every device, `xs[k]` is the partial result that step `k` of the ring adds; the
    running sum moves one device per step. The result on device `d` is the sum over devices
    `j` of `xs[k]` on `j` where `(j - 1 - k) % n == d` when shifting up and
    `(j + 1 + k) % n == d` when shifting down: a `lax.psum_scatter` whose chunks are listed
    in the order the ring consumes them.

    **Arguments:**

    - `xs`: a list of `n` chunks of equal structure and shape (arrays or pytrees).
    - `axis_name`: the mesh axis to reduce over.
    - `shift_up`: direction of the ring.

    **Returns:** one chunk: this device's sum.

    **Raises:** `ValueError` when `len(xs)` differs from the axis size.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import async_scatter

    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("model",))

    def f(block):  # block: [1, n, 2] -- this device's n chunks
        d = lax.axis_index("model")
        chunks = [block[0, i] for i in range(n)]  # chunk i is meant for device i
        # the ring adds, at step k, the chunk meant for device (d - 1 - k) % n
        ordered = [jnp.take(block[0], (d - 1 - k) % n, axis=0) for k in range(n)]
        ring = async_scatter(ordered, "model")
        reference = lax.psum_scatter(jnp.stack(chunks), "model", tiled=False)
        return (ring - reference)[None]

    x = jnp.arange(n * n * 2.0).reshape(n, n, 2)
    err = jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(x)
    assert float(abs(err).max()) == 0.0
    ```
    """
    n = axis_size(axis_name, "async_scatter")
    _check_chunks(xs, n, "async_scatter")
    return _ring_reduce(lambda t: xs[t], axis_name, n, shift_up, n - 1)


def async_scatter_split(xs: Sequence[PyTree], axis_name: AxisName) -> PyTree:
    """Same result as `async_scatter(xs, axis_name)`, half of each chunk per ring direction.

    Every chunk is cut in two on its last axis; the first halves are reduced around the
    ring shifting up, the second halves shifting down (in the chunk order that lands each sum
    on the same device as the one-direction version), so each direction moves half the bytes.
    Odd last dimensions are split unevenly and work the same.

    **Arguments:**

    - `xs`: a list of `n` chunks, ordered as for `async_scatter(xs, axis_name)` (shifting up).
    - `axis_name`: the mesh axis to reduce over.

    **Returns:** the same chunk as `async_scatter(xs, axis_name)`.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import async_scatter, async_scatter_split

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))

    def f(block):  # [1, 4, 3]
        xs = [block[0, k] for k in range(4)]
        return (async_scatter_split(xs, "model") - async_scatter(xs, "model"))[None]

    x = jax.random.normal(jax.random.key(0), (4, 4, 3))
    err = jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(x)
    assert float(abs(err).max()) < 1e-6
    ```
    """
    n = axis_size(axis_name, "async_scatter_split")
    _check_chunks(xs, n, "async_scatter_split")
    halves = [_split_tree(chunk, "async_scatter_split") for chunk in xs]
    up = _ring_reduce(lambda t: halves[t][0], axis_name, n, True, n - 1)
    # Shifting down, step t on device j must add the chunk the upward ring sends to
    # device (j + 1 + t) % n, which is chunk (-2 - t) % n.
    down = _ring_reduce(lambda t: halves[(-2 - t) % n][1], axis_name, n, False, n - 1)
    return _join_tree(up, down)


def async_scatter_bidirectional(xs: Sequence[PyTree], axis_name: AxisName) -> PyTree:
    """Same result as `async_scatter(xs, axis_name)`, each sum gathered from both sides.

    The running sum for device `d` is built in two parts that meet at `d`: one collects the
    devices below `d` while shifting up, the other the devices above `d` while shifting down.
    Each direction carries whole chunks, but only about `n / 2` steps are needed instead of
    `n - 1`, halving the latency of the last arriving sum.

    **Arguments:**

    - `xs`: a list of `n` chunks, ordered as for `async_scatter(xs, axis_name)` (shifting up).
    - `axis_name`: the mesh axis to reduce over.

    **Returns:** the same chunk as `async_scatter(xs, axis_name)`.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import async_scatter, async_scatter_bidirectional

    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))

    def f(block):  # [1, 8, 2]
        xs = [block[0, k] for k in range(8)]
        return (async_scatter_bidirectional(xs, "model") - async_scatter(xs, "model"))[None]

    x = jax.random.normal(jax.random.key(0), (8, 8, 2))
    err = jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(x)
    assert float(abs(err).max()) < 1e-5
    ```
    """
    n = axis_size(axis_name, "async_scatter_bidirectional")
    _check_chunks(xs, n, "async_scatter_bidirectional")
    if n == 1:
        return xs[0]
    # Device j contributes xs[k] to destination (j - 1 - k) % n. The sum for d is built by an
    # upward partial sum over the `hops_up` devices below d and a downward one over the
    # `hops_down` devices above d (hops_up + hops_down = n - 1); d adds its own chunk last.
    hops_up = n // 2
    hops_down = n - 1 - hops_up

    def chunk_for(offset: int) -> PyTree:
        """The chunk this device holds for the device `offset` positions up the ring."""
        return xs[(-1 - offset) % n]

    # Upward ring: at step t (0..hops_up-1) device j handles destination j + hops_up - t.
    up = _ring_reduce(lambda t: chunk_for(hops_up - t), axis_name, n, True, hops_up - 1)
    up = _shift(up, axis_name, n, True)
    total = jax.tree.map(jnp.add, up, chunk_for(0))
    if hops_down:
        down = _ring_reduce(
            lambda t: chunk_for(-(hops_down - t)), axis_name, n, False, hops_down - 1
        )
        down = _shift(down, axis_name, n, False)
        total = jax.tree.map(jnp.add, total, down)
    return total


# --- Ring matmuls (TPAsyncDense, through eqpar.nn.linear's column/row core) -----------------
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

    def index(self, d: Array, offset: PyTree) -> Array:
        """`(d + offset) % n` for `0 <= d < 2n` and `-n <= offset <= n` (int or traced)."""
        return lax.rem(d + offset + 2 * self.n, self.n)

    def shift(self, x: Array, up: bool = True) -> Array:
        return ring_shift(x, self.axis, up=up)


def _loop(
    first: int, last: int, body: Callable[[Any, Any], Any], carry: PyTree, *, unroll: int = 0
) -> PyTree:
    """`body(t, carry)` for `t = first .. last` (no loop when the range is empty), unrolled
    when it has at most `unroll` steps."""
    if last - first + 1 <= unroll:
        for t in range(first, last + 1):
            carry = body(jnp.int32(t), carry)
        return carry
    return lax.fori_loop(first, last + 1, body, carry) if last >= first else carry


# Running sums up to this many steps (rings of up to 4 devices) are unrolled: a loop's state
# is a tuple of pointers that the CPU compiler may place above the peak (40 bytes in the MLP
# block of `benchmarks/tensor_parallel.py`), and each step's sum is held whole before it is
# sent either way, so unrolled steps hold no more than the loop.
_UNROLLED_SUM_STEPS = 3


def _weight_block(w: Array, index: Array, size: int, axis: int) -> Array:
    return lax.dynamic_slice_in_dim(w, index * size, size, axis=axis)


def _dot(x: Array, w: Array) -> Array:
    return jnp.einsum("...i,oi->...o", x, w)


def _ring_fold(
    x: Array,
    consume: Callable[[PyTree, Array, Array], PyTree],
    carry: PyTree,
    ring: _Ring,
    d: Array,
    bidirectional: bool,
) -> PyTree:
    """Fold `consume(carry, block, source)` over the blocks `x` of every device, passing the
    blocks round the ring: the all-gather of `x`, each block consumed as it arrives and
    never all held at once.

    Walking up the ring, step `t` brings the block of device `d - t` (walking down, of `d +
    t`); `source` is that device's index. Each step passes on the block it holds while
    consuming it, so every transfer runs next to the work on a block already at hand. `d` is
    this device's index (`_Ring.device`).
    """
    carry = consume(carry, x, d)
    if ring.n == 1:
        return carry
    if not bidirectional:

        def step(t: PyTree, state: tuple[Array, PyTree, Array]) -> tuple[Array, PyTree, Array]:
            block, carry, _ = state
            return ring.shift(block), consume(carry, block, ring.index(d, -t)), t

        # The own block is consumed while the first block travels; the last block arrives
        # after the loop, whose step count is carried out of it so that what the last block
        # meets (e.g. a weight slice) is not cut before the loop has run.
        block, carry, t = _loop(1, ring.n - 2, step, (ring.shift(x), carry, jnp.int32(0)))
        return consume(carry, block, ring.index(d, -t - 1))
    # Both directions: step t brings the block of d - t one way and of d + t the other; for
    # even n the up side has one block more, so its first step runs alone.
    up, lead = x, 1 - ring.n % 2
    if lead:
        up = ring.shift(up)
        carry = consume(carry, up, ring.index(d, -1))

    def both(t: PyTree, state: tuple[Array, Array, PyTree]) -> tuple[Array, Array, PyTree]:
        up, down = ring.shift(state[0]), ring.shift(state[1], up=False)
        carry = consume(state[2], up, ring.index(d, -t - lead))
        return up, down, consume(carry, down, ring.index(d, t))

    return _loop(1, (ring.n - 1) // 2, both, (up, x, carry))[2]


def _ring_gather(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`all_gather(x, tiled) @ w.T` as ring steps, without holding the gathered input: each
    arriving block meets its device's columns of `w`."""
    k = x.shape[-1]

    def add_product(acc: Array | None, block: Array, source: Array) -> Array:
        product = _dot(block, _weight_block(w, source, k, 1))
        return product if acc is None else acc + product

    return _ring_fold(x, add_product, None, ring, ring.device(x), bidirectional)


def _ring_reduce_blocks(
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
        def step(t: PyTree, total: Array) -> Array:
            return ring.shift(total) + produce(ring.index(d, -1 - t))

        return _loop(1, ring.n - 1, step, produce(ring.index(d, -1)), unroll=_UNROLLED_SUM_STEPS)
    # The sum for d is built from both sides: one running sum collects the devices below d
    # shifting up (the chunks for d + n//2 .. d + 1 on their way), the other the devices
    # above d shifting down; for even n the up side has one device more and starts alone.
    half = (ring.n - 1) // 2
    up = produce(ring.index(d, ring.n // 2))
    if ring.n % 2 == 0:
        up = ring.shift(up) + produce(ring.index(d, half))
    down = produce(ring.index(d, -half))

    def both(t: PyTree, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        up = ring.shift(carry[0]) + produce(ring.index(d, half - t))
        return up, ring.shift(carry[1], up=False) + produce(ring.index(d, t - half))

    up, down = _loop(1, half - 1, both, (up, down), unroll=_UNROLLED_SUM_STEPS)
    return ring.shift(up) + ring.shift(down, up=False) + produce(ring.index(d, 0))


# In a training step each collective of both modes is a ring next to block matmuls wherever
# the ring holds no more memory than the one collective it replaces:
#
# - gather mode: the forward pass walks the input blocks round the ring (`_ring_fold`) and
#   saves only this device's block; the backward pass walks them round again, writing each
#   block's columns of the weight gradient in place as it arrives, and reduce-scatters the
#   input gradient as running sums (`_ring_reduce_blocks`, always a ring).
# - scatter mode: the forward pass reduce-scatters the partial products as running sums
#   (always a ring); the backward pass walks the output-gradient blocks round the ring,
#   writing each block's rows of the weight gradient in place and adding its product with
#   the matching weight rows to the input gradient.
#
# The two walks sum one product per block into an accumulator (the gather forward pass's
# output, the scatter backward pass's input gradient), and without a fused multiply-
# accumulate (XLA:CPU) each product is a second accumulator-sized buffer. Where that buffer
# is at least the `(n - 1) / n` of the gathered array that the all-gather would add (an MLP's
# up projection at n <= 4, its down projection's backward pass at n <= 4), the walk holds
# more than the all-gather and the layer gathers once instead, as `TPDense` does
# (`_walk_holds_less`; figures in `benchmarks/tensor_parallel.py`).


def _walk_holds_less(accumulator: int, gathered: int, n: int) -> bool:
    """Whether a walk that sums an `accumulator`-wide product per block holds less than an
    all-gather to `gathered` features (both per row of the leading axes)."""
    return accumulator * n < gathered * (n - 1)


def _ring_outer_dot(dy: Array, block: Array) -> Array:
    """`dy^T @ block` summed over every leading axis: one block of a weight gradient."""
    return jnp.einsum("...o,...i->oi", dy, block)


def _gather_walks(w: Array, ring: _Ring) -> bool:
    """Whether gather mode's training step walks the input round the ring (`w`: `[out / n,
    in]`) rather than gathering it once."""
    return _walk_holds_less(w.shape[0], w.shape[1], ring.n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gather_matmul_vjp(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`all_gather(x, tiled) @ w.T` (gather mode) around the ring."""
    return _ring_gather(x, w, ring, bidirectional)


def _gather_matmul_fwd(
    x: Array, w: Array, ring: _Ring, bidirectional: bool
) -> tuple[Array, tuple[Array, Array]]:
    if _gather_walks(w, ring):
        return _ring_gather(x, w, ring, bidirectional), (x, w)
    gathered = lax.all_gather(x, ring.axis, axis=x.ndim - 1, tiled=True)
    return _dot(gathered, w), (gathered, w)


def _gather_matmul_bwd(
    ring: _Ring, bidirectional: bool, residuals: tuple[Array, Array], dy: Array
) -> tuple[Array, Array]:
    x, w = residuals  # x: this device's input block, or the gathered input
    k = w.shape[1] // ring.n
    d = ring.device(dy)
    # dx is the reduce-scatter of dy @ w over the input blocks: one chunk per ring step.
    dx = _ring_reduce_blocks(
        lambda dest: jnp.einsum("...o,oi->...i", dy, _weight_block(w, dest, k, 1)),
        ring,
        d,
        bidirectional,
    )
    if not _gather_walks(w, ring):
        return dx.astype(x.dtype), _ring_outer_dot(dy, x).astype(w.dtype)
    # Tied to dy, the second walk of the input blocks waits for the backward pass to reach
    # this layer. (XLA may still share its first step with the forward pass's, keeping that
    # one received block from the forward pass: one block, one transfer fewer.)
    x, _ = lax.optimization_barrier((x, dy))

    # dw's columns of device `source` are dy^T @ (its input block): the input blocks go round
    # the ring again, each written into its columns as it arrives.
    def columns(dw: Array, block: Array, source: Array) -> Array:
        part = _ring_outer_dot(dy, block).astype(w.dtype)
        return lax.dynamic_update_slice_in_dim(dw, part, source * k, axis=1)

    dw = _ring_fold(x, columns, jnp.zeros_like(w), ring, d, bidirectional)
    return dx.astype(x.dtype), dw


_gather_matmul_vjp.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)


def _ring_scatter(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`psum_scatter(x @ w.T, tiled)` as ring steps, one destination's chunk per step."""
    m = w.shape[0] // ring.n

    def produce(dest: Array) -> Array:
        return _dot(x, _weight_block(w, dest, m, 0))

    return _ring_reduce_blocks(produce, ring, ring.device(x), bidirectional)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _scatter_matmul_vjp(x: Array, w: Array, ring: _Ring, bidirectional: bool) -> Array:
    """`psum_scatter(x @ w.T, tiled)` (scatter mode) around the ring."""
    return _ring_scatter(x, w, ring, bidirectional)


def _scatter_matmul_fwd(
    x: Array, w: Array, ring: _Ring, bidirectional: bool
) -> tuple[Array, tuple[Array, Array]]:
    return _ring_scatter(x, w, ring, bidirectional), (x, w)


def _scatter_matmul_bwd(
    ring: _Ring, bidirectional: bool, residuals: tuple[Array, Array], dy: Array
) -> tuple[Array, Array]:
    x, w = residuals
    m = dy.shape[-1]
    if not _walk_holds_less(x.shape[-1], w.shape[0], ring.n):
        full = lax.all_gather(dy, ring.axis, axis=dy.ndim - 1, tiled=True)
        dx = jnp.einsum("...o,oi->...i", full, w)
        return dx.astype(x.dtype), _ring_outer_dot(full, x).astype(w.dtype)

    # The output-gradient block of device `source` meets that device's rows of the weight:
    # its product with them adds to dx, and dy_block^T @ x are its rows of dw.
    def rows(carry: tuple[Array | None, Array], block: Array, source: Array) -> tuple[Array, Array]:
        dx, dw = carry
        product = jnp.einsum("...o,oi->...i", block, _weight_block(w, source, m, 0))
        part = _ring_outer_dot(block, x).astype(w.dtype)
        dw = lax.dynamic_update_slice_in_dim(dw, part, source * m, axis=0)
        return (product if dx is None else dx + product), dw

    dx, dw = _ring_fold(dy, rows, (None, jnp.zeros_like(w)), ring, ring.device(dy), bidirectional)
    return dx.astype(x.dtype), dw


_scatter_matmul_vjp.defvjp(_scatter_matmul_fwd, _scatter_matmul_bwd)


def ring_gather_matmul(
    x: Float[Array, "*batch in_block"],
    weight: Float[Array, "out_block in_features"],
    axis_name: AxisName,
    *,
    bidirectional: bool = False,
) -> Float[Array, "*batch out_block"]:
    """`all_gather(x, axis_name, tiled) @ weight.T` as ring steps, inside `shard_map`.

    Each device holds its block of the input's features (`[..., in / n]`) and its rows of the
    weight (`[out / n, in]`). The input blocks pass around the ring while each is multiplied
    by the matching columns of the weight, so the gathered input is never held and every
    transfer can overlap a matmul. Differentiable in reverse mode (a custom VJP): the forward
    pass saves only the local block; the backward pass walks the input blocks round the ring
    again, writing each block's columns of the weight gradient as it arrives, and
    reduce-scatters the input gradient around the ring. Where summing the products would
    hold more than the gathered input (`out / n >= in (n - 1) / n`, with no fused
    multiply-accumulate each product is a second output-sized buffer), the training step
    gathers the input once instead, as `TPDense` does (see `eqpar.nn.TPAsyncDense`).

    **Arguments:**

    - `x`: this device's block of the input features.
    - `weight`: this device's rows of the weight, all input features.
    - `axis_name`: the mesh axis of the ring.
    - `bidirectional`: walk both directions (about half the steps, two blocks per step).

    **Returns:** `[..., out / n]`, this device's block of the output features.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import ring_gather_matmul

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    x, w = jnp.arange(24.0).reshape(3, 8), jnp.ones((8, 8))
    f = jax.shard_map(
        lambda x, w: ring_gather_matmul(x, w, "model"), mesh=mesh,
        in_specs=(P(None, "model"), P("model")), out_specs=P(None, "model"),
    )
    assert jnp.allclose(f(x, w), x @ w.T)
    ```
    """
    ring = _Ring(axis_name, axis_size(axis_name, "ring_gather_matmul", argument="axis_name"))
    return _gather_matmul_vjp(x, weight, ring, bidirectional)


def ring_matmul_scatter(
    x: Float[Array, "*batch in_block"],
    weight: Float[Array, "out_features in_block"],
    axis_name: AxisName,
    *,
    bidirectional: bool = False,
) -> Float[Array, "*batch out_block"]:
    """`psum_scatter(x @ weight.T, axis_name, tiled)` as ring steps, inside `shard_map`.

    Each device holds its block of the input features (`[..., in / n]`) and the matching
    columns of the weight (`[out, in / n]`). Each ring step computes the partial product for
    one destination's output block and adds it to the running sum passing by, so the whole
    partial product `[..., out]` is never held. Differentiable in reverse mode (a custom
    VJP): the output-gradient blocks walk round the ring, each adding its product with the
    matching weight rows to the input gradient and writing its rows of the weight gradient,
    so the gathered gradient is never held. Where summing those products would hold more
    than the gathered gradient (`in / n >= out (n - 1) / n`), it is gathered once instead.

    **Arguments:**

    - `x`: this device's block of the input features.
    - `weight`: all output features, this device's block of the input features.
    - `axis_name`: the mesh axis of the ring.
    - `bidirectional`: run the running sums both ways round (about half the steps).

    **Returns:** `[..., out / n]`, this device's block of the summed output.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.collectives import ring_matmul_scatter

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    x, w = jnp.arange(24.0).reshape(3, 8), jnp.ones((8, 8))
    f = jax.shard_map(
        lambda x, w: ring_matmul_scatter(x, w, "model"), mesh=mesh,
        in_specs=(P(None, "model"), P(None, "model")), out_specs=P(None, "model"),
    )
    assert jnp.allclose(f(x, w), x @ w.T)
    ```
    """
    ring = _Ring(axis_name, axis_size(axis_name, "ring_matmul_scatter", argument="axis_name"))
    return _scatter_matmul_vjp(x, weight, ring, bidirectional)
