"""Moving batches between each process's host memory and global `jax.Array`s.

In JAX's multi-controller model every process runs the same program and owns a few devices
(its *local* devices). A global `jax.Array` spans the devices of all processes; each process
can only read or write the blocks that live on its own devices. Data loaders, on the other
hand, produce one ordinary NumPy batch per process. This module converts between the two:

- `host_to_global_device_array` turns each process's local batch into one global array;
- `global_to_host_array` is its inverse and gives each process its own rows back;
- `with_sharding_constraint` is `jax.lax.with_sharding_constraint` that also runs, as a checked
  no-op, on a single device.

**What JAX does and what eqpar adds.** Placement itself is JAX's
`jax.make_array_from_process_local_data` (which also puts each process's rows, in order, on
its own devices, however the processes interleave in the mesh), and resharding for the way back
is a `jax.jit` with `out_shardings`. eqpar owns only what JAX leaves unchecked: before a
global array is built, the processes agree on every leaf's shape and dtype (and, for
replicated data, its values), so a process that feeds other rows or another dtype is an error
naming the leaf and the processes instead of a global array that silently differs between
processes; host values that do not fit the dtype JAX will use (`int64` beyond `int32`,
`float64` beyond `float32`, while `jax_enable_x64` is off) are an error instead of a wrap; and
every error names the leaf path (`/`-joined, as `LayoutMap` keys) and the fix.

**Which mesh.** The functions take `mesh=` explicitly or read the mesh of the surrounding
context. The context mesh is the one set by `jax.set_mesh(mesh)` (as a context manager or a
global setter), read through the public `jax.sharding.get_mesh()` (outside `jax.jit`) and
`jax.sharding.get_abstract_mesh()` (inside). The legacy `with mesh:` context (deprecated since
JAX 0.8.2) has no public reader, so it is not read: under it the functions say that no mesh is
set and name `jax.set_mesh` as the fix.
"""

import enum
import functools
import json
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from jax.tree_util import tree_flatten_with_path, tree_map_with_path
from jaxtyping import Array, ArrayLike, PyTree

from ._axis_types import constrain as constrain_on_any_axes
from ._axis_types import context_mesh
from ._paths import path_to_str
from ._specs import check_spec

__all__ = [
    "DataPartitionType",
    "global_to_host_array",
    "host_to_global_device_array",
    "with_sharding_constraint",
]


class DataPartitionType(enum.Enum):
    """How a per-process host batch maps onto a global array.

    - `FULL`: the leading (batch) axis is split over *all* mesh axes, so every device holds a
      distinct block of rows. Each process contributes its own rows; the global batch is the
      concatenation of all processes' rows.
    - `REPLICATED`: every device holds the whole array. Every process must pass the same data.

    ```python
    from eqpar.placement import DataPartitionType

    assert DataPartitionType("full") is DataPartitionType.FULL
    assert DataPartitionType.REPLICATED.value == "replicated"
    ```
    """

    FULL = "full"
    REPLICATED = "replicated"


# ---------------------------------------------------------------------------------------------
# Finding the mesh


def _context_mesh(function: str | None = None) -> PyTree:
    """The context mesh, concrete outside a trace and abstract inside one (an error naming
    `function` when given); `None` when none is set."""
    if function:
        try:
            jax.sharding.get_mesh()
        except ValueError:  # `get_mesh` refuses to run under a trace
            raise ValueError(f"`{function}` must be called outside `jax.jit`.") from None
    return context_mesh()


def _resolve(mesh: Any, partition: object, function: str) -> tuple[Mesh, NamedSharding, int]:
    """The mesh, the sharding `partition` means on it and this process's devices in it."""
    if not isinstance(partition, DataPartitionType):
        raise TypeError(f"`{function}`: `partition` must be a `DataPartitionType`: {partition!r}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"`{function}`: `mesh` must be a concrete `jax.sharding.Mesh`: {mesh!r}")
    if (mesh := _context_mesh(function) if mesh is None else mesh) is None:
        raise ValueError(
            f"`{function}`: no device mesh; pass `mesh=` or use `jax.set_mesh(mesh)` (a legacy "
            "`with mesh:` block is not read: JAX has no public reader for it)."
        )
    if not (local := sum(d.process_index == jax.process_index() for d in mesh.devices.flat)):
        raise ValueError(f"`{function}`: the mesh has no device of process {jax.process_index()}.")
    spec = PartitionSpec(*[tuple(mesh.axis_names)] * (partition is DataPartitionType.FULL))
    return mesh, NamedSharding(mesh, spec), local


# ---------------------------------------------------------------------------------------------
# Host -> global (shared with `eqpar.distributions`)


def _gather(mesh: Mesh, row: np.ndarray) -> dict[int, np.ndarray]:
    """`row` (int32) of every process with devices in `mesh`, by process: one tiny collective
    among those processes only (`multihost_utils.process_allgather` involves every process of
    the job, and would hang where the mesh covers only some of them)."""
    owners = [device.process_index for device in mesh.devices.flat]
    local = np.tile(row, (owners.count(jax.process_index()), 1))
    rows = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names))), local, (mesh.size, row.size)
    )
    whole = jax.device_put(rows, NamedSharding(mesh, PartitionSpec()))
    return dict(zip(owners, np.asarray(whole.addressable_data(0))))


_SAME_ERROR = {"TypeError": TypeError, "ValueError": ValueError}
"""The error types a process whose peer failed raises as its own (others: `RuntimeError`)."""


def _check_agreement(
    mesh: Mesh, described: dict[str, str], function: str, failure: Exception | None = None
) -> None:
    """Raise unless every process of `mesh` described its leaves alike: a digest first, and
    the descriptions themselves only when the digests differ, to name the leaf.

    A process whose own checks failed (`failure`) still takes part, sending its error instead
    of a description, so its peers raise too, naming it, instead of waiting for it; and every
    process runs the same collectives, so the next call pairs up as usual. This function then
    returns on the failed process, which raises its own error."""
    sent: dict[str, Any] = {"leaves": described}
    if failure is not None:
        sent = {"failed": type(failure).__name__, "reason": str(failure)}
    text = json.dumps(sent).encode()
    digests = _gather(mesh, np.array([len(text), zlib.crc32(text) & 0x7FFFFFFF], np.int32))
    if len({tuple(row) for row in digests.values()}) == 1:
        return  # all alike (failed alike too: each process then raises its own error)
    padded = text.ljust(max(int(row[0]) for row in digests.values()))
    gathered = _gather(mesh, np.frombuffer(padded, np.uint8).astype(np.int32))
    received = {p: json.loads(bytes(row.astype(np.uint8))) for p, row in gathered.items()}
    if failed := {p: r for p, r in received.items() if "failed" in r}:
        if failure is not None:
            return
        who = ", ".join(map(str, sorted(failed)))
        who = f"process {who}" if len(failed) == 1 else f"processes {who}"
        reasons = " ".join(f"[process {p}] {r['failed']}: {r['reason']}" for p, r in failed.items())
        raise _SAME_ERROR.get(failed[min(failed)]["failed"], RuntimeError)(
            f"`{function}`: {who} refused its own data, so the call fails on every process "
            f"(they stay in step: the next call pairs up as usual). {reasons}"
        )
    tables = {p: r["leaves"] for p, r in received.items()}
    differ = (k for t in tables.values() for k in t if len({u.get(k) for u in tables.values()}) > 1)
    leaf = next(differ, "<order>")
    seen = "; ".join(f"process {p}: {t.get(leaf, 'no such leaf')}" for p, t in tables.items())
    raise ValueError(f"`{function}`: the processes disagree on leaf {leaf!r} ({seen}).")


def _fits(path: str, array: np.ndarray, function: str) -> str | None:
    """Why the values of `array` do not fit the dtype JAX will place them as, if they do not."""
    target = jax.dtypes.canonicalize_dtype(array.dtype)
    if target == array.dtype or array.size == 0 or array.dtype.kind not in "iufc":
        return None
    values = np.stack([np.real(array), np.imag(array)]) if array.dtype.kind == "c" else array
    finite = np.isfinite(values) if values.dtype.kind == "f" else True  # inf stays inf
    low, high = values.min(where=finite, initial=0), values.max(where=finite, initial=0)
    info = np.iinfo(target) if values.dtype.kind in "iu" else np.finfo(target)
    if info.min <= low and high <= info.max:
        return None
    return (
        f"`{function}`: leaf {path!r} holds {array.dtype} values outside [{info.min}, "
        f"{info.max}], the range of {target}, which JAX uses while `jax_enable_x64` is off (they "
        "would wrap or overflow); enable it (`jax.config.update('jax_enable_x64', True)`) or cast."
    )


def _check_rows(function: str, path: str, leaf: PyTree, devices: int, scope: str) -> None:
    """A `FULL` leaf must have a batch axis that splits evenly over `devices`."""
    if leaf.ndim == 0 or leaf.shape[0] % devices:
        rows = "is a scalar" if leaf.ndim == 0 else f"has a {scope} batch of {leaf.shape[0]} rows"
        raise ValueError(
            f"`{function}`: leaf {path!r} {rows} (shape {leaf.shape}), which does not split over "
            f"the {devices} {scope} devices of the mesh; use `DataPartitionType.REPLICATED` for it."
        )


def checked_local_leaves(
    local_data: PyTree,
    mesh: Mesh,
    function: str,
    *,
    same_values: bool = False,
    check_leaf: Callable[[str, Any], None] | None = None,
) -> tuple[list[str], list[Any], Any]:
    """The leaves of a per-process batch, checked before a global array is built from them.

    The one implementation behind `host_to_global_device_array` and
    `eqpar.distributions.Distribution.distribute_input` (which then call
    `jax.make_array_from_process_local_data`). JAX checks none of this itself: every leaf must
    be array data (NumPy, a JAX array on this process's devices, or a Python number); its
    values must fit the dtype JAX will place them as (a NumPy min/max over 64-bit leaves while
    `jax_enable_x64` is off); and with several processes, every process of `mesh` must pass
    the same leaves with the same shapes and dtypes (and, with `same_values`, the same values,
    by CRC-32), checked by one tiny exchange of a digest among the mesh's processes, skipped
    in a single process. Every process of `mesh` must therefore call it together. A process
    whose leaves fail these checks still takes part in the exchange, sending its error: it
    raises that error, and every other process raises one that names it and says why (of the
    same type, `TypeError` or `ValueError`), instead of waiting for it; every process has then
    run the same collectives, so the next call pairs up as usual.

    **Arguments:**

    - `local_data`: this process's pytree of arrays.
    - `mesh`: the mesh the data goes to; its processes take part in the exchange.
    - `function`: the public function to name in errors.
    - `same_values`: also require equal values on every process (replicated data).
    - `check_leaf`: a further check `check_leaf(path, leaf)` of each leaf that raises when
      it fails; it runs before the exchange, so its error reaches every process too.

    **Returns:** `(paths, leaves, treedef)`: the `/`-joined leaf paths, the leaves (NumPy
    arrays, or the local JAX arrays as given) and the tree structure.

    **Raises:** `TypeError` for a leaf that is not array data; `ValueError` for values that
    do not fit their dtype, or processes that disagree, naming the leaf and the processes;
    on the other processes, an error naming the process whose checks failed, and why.

    ```python
    import jax, numpy as np
    from jax.sharding import Mesh
    from eqpar.placement import checked_local_leaves

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    paths, leaves, _ = checked_local_leaves({"x": [np.ones(2), 3]}, mesh, "example")
    assert paths == ["x/0", "x/1"] and leaves[1].dtype == np.int64
    try:
        checked_local_leaves(np.array([2**40]), mesh, "example")
    except ValueError as error:
        assert "jax_enable_x64" in str(error)
    ```
    """
    flat, treedef = tree_flatten_with_path(local_data)
    paths = [path_to_str(key_path) or "<root>" for key_path, _ in flat]
    leaves, described, problems = [], {}, []
    failure: Exception | None = None
    try:  # a failure here still goes through the exchange, for the other processes to see
        for path, (_, leaf) in zip(paths, flat):
            local_jax = isinstance(leaf, jax.Array) and leaf.is_fully_addressable
            host = isinstance(leaf, np.ndarray | np.generic | int | float | complex)
            if isinstance(leaf, Tracer) or not (local_jax or host):
                raise TypeError(
                    f"`{function}`: leaf {path!r} must be a NumPy array or a local `jax.Array` "
                    f"(outside `jax.jit`), not {type(leaf).__name__}."
                )
            array: PyTree = leaf if local_jax else np.asarray(leaf)
            leaves.append(array)
            extended = jax.dtypes.issubdtype(array.dtype, jax.dtypes.extended)  # PRNG keys
            if not extended and (array.dtype.kind in "OUS" or array.dtype.names is not None):
                raise TypeError(
                    f"`{function}`: leaf {path!r} has dtype {array.dtype}, not a number."
                )
            if check_leaf is not None:
                check_leaf(path, array)
            problems.append(None if local_jax else _fits(path, array, function))
            out_of_range = " (values out of range)" if problems[-1] else ""
            described[path] = f"shape {array.shape} {array.dtype}{out_of_range}"
            if same_values and jax.process_count() > 1:
                values = np.ascontiguousarray(jax.random.key_data(array) if extended else array)
                described[path] += f", CRC-32 {zlib.crc32(values.tobytes())}"
    except Exception as error:  # raised below, after the exchange
        failure = error
    if jax.process_count() > 1:
        _check_agreement(mesh, described, function, failure)
    if failure is not None:
        raise failure
    if problem := next((p for p in problems if p), None):
        raise ValueError(problem)
    return paths, leaves, treedef


def host_to_global_device_array(
    host_arrays: PyTree,
    partition: DataPartitionType = DataPartitionType.FULL,
    *,
    mesh: Mesh | None = None,
) -> PyTree[Array]:
    """Build global `jax.Array`s from each process's local batch.

    Every process calls this with its own local batch, a pytree of NumPy arrays of the same
    structure, shapes and dtypes on every process. That is checked: with several processes
    they first exchange a digest of every leaf's shape and dtype, and a difference is a
    `ValueError` naming the leaf and the processes (one tiny collective per call). A process
    that refuses its own batch (a leaf that is not array data, a batch that does not divide
    over its devices) still takes part in that exchange, so the call fails on every process
    at once, the others with an error of the same type naming that process and its reason,
    and the next call pairs up as usual. The arrays themselves are built by
    `jax.make_array_from_process_local_data`.

    - With `DataPartitionType.FULL` the leading axis of every leaf is split over all mesh axes
      (the sharding is `PartitionSpec(mesh.axis_names)`, one distinct block of rows per device).
      The global batch is the concatenation of all processes' local batches: its length is the
      local batch times the number of processes (when every process has the same number of
      devices in the mesh). Each process's rows land, in order, on its own devices, so no data
      crosses processes.
    - With `DataPartitionType.REPLICATED` every device holds the whole array; every process
      must pass identical data (checked, with several processes, through a CRC-32 of each
      leaf's bytes).

    Dtypes follow JAX's usual canonicalization (e.g. `float64` becomes `float32` unless
    `jax_enable_x64` is on); values that would not survive it (`int64` values beyond the
    `int32` range, `float64` values beyond `float32`'s finite range) are a `ValueError`
    rather than a silent wrap. The check is a NumPy min/max over such leaves.

    **Arguments:**

    - `host_arrays`: a pytree of NumPy arrays (JAX arrays on local devices and Python numbers
      are accepted too).
    - `partition`: a `DataPartitionType`.
    - `mesh`: the `jax.sharding.Mesh` to place on; defaults to the mesh set with
      `jax.set_mesh`.

    **Returns:** a pytree of the same structure whose leaves are global `jax.Array`s sharded on
    `mesh`.

    **Raises:** `ValueError` when no mesh is available, when a `FULL` leaf is a scalar or its
    local batch does not divide over this process's devices in the mesh, when values do not fit
    their dtype, or when processes disagree (the message names the leaf path); `TypeError` for
    a leaf that is not array data. On the other processes, such an error of one process is an
    error of the same type naming it.

    ```python
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec
    from eqpar.placement import DataPartitionType, host_to_global_device_array

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    batch = {"x": np.arange(16.0).reshape(8, 2), "mask": np.ones(8, bool)}
    global_batch = host_to_global_device_array(batch, mesh=mesh)
    assert global_batch["x"].shape == (8, 2)  # one process: global batch == local batch
    assert global_batch["x"].sharding.spec == PartitionSpec(("data", "model"))

    with jax.set_mesh(mesh):
        table = host_to_global_device_array(np.eye(3), DataPartitionType.REPLICATED)
    assert table.sharding.is_fully_replicated
    ```
    """
    function = "host_to_global_device_array"
    mesh, sharding, local = _resolve(mesh, partition, function)
    full = partition is DataPartitionType.FULL
    rows = functools.partial(_check_rows, function, devices=local, scope="local")
    _, leaves, treedef = checked_local_leaves(
        host_arrays, mesh, function, same_values=not full, check_leaf=rows if full else None
    )
    return jax.make_array_from_process_local_data(sharding, treedef.unflatten(leaves))


# ---------------------------------------------------------------------------------------------
# Global -> host


def global_to_host_array(
    global_arrays: PyTree,
    partition: DataPartitionType = DataPartitionType.FULL,
    *,
    mesh: Mesh | None = None,
) -> PyTree[np.ndarray]:
    """Give each process its own part of global arrays as NumPy arrays.

    The exact inverse of `host_to_global_device_array`: with `DataPartitionType.FULL` each
    process receives the rows it contributed (in the same order); with
    `DataPartitionType.REPLICATED` each process receives the whole array once. Both return a
    pytree of `np.ndarray`s of the same structure as `global_arrays`.

    Arrays whose sharding differs from the one `partition` implies (for example a model
    output replicated over the mesh, or sharded over one axis only) are first resharded to it
    on the devices by one `jax.jit` with `out_shardings`, so every process must make this call
    together, as with any operation on global arrays. Blocks that several local devices hold
    are copied to the host once.

    **Arguments:**

    - `global_arrays`: a pytree of `jax.Array`s placed on `mesh`.
    - `partition`: a `DataPartitionType`; the one that was used to place the data.
    - `mesh`: the `jax.sharding.Mesh` of the arrays; defaults to the mesh set with
      `jax.set_mesh`.

    **Returns:** a pytree of NumPy arrays: the local rows (`FULL`) or the whole array
    (`REPLICATED`) of every leaf.

    **Raises:** `ValueError` when no mesh is available, a leaf lives on other devices than the
    mesh's, or a `FULL` leaf is a scalar or has a batch that does not divide over the mesh;
    `TypeError` when a leaf is not a `jax.Array`.

    ```python
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from eqpar.placement import (
        DataPartitionType, global_to_host_array, host_to_global_device_array,
    )

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    batch = {"tokens": np.arange(24, dtype=np.int32).reshape(8, 3)}
    global_batch = host_to_global_device_array(batch, mesh=mesh)
    doubled = jax.jit(lambda b: {"tokens": b["tokens"] * 2})(global_batch)
    back = global_to_host_array(doubled, mesh=mesh)
    np.testing.assert_array_equal(back["tokens"], batch["tokens"] * 2)

    total = jax.jit(lambda b: b["tokens"].sum())(global_batch)  # replicated scalar
    assert global_to_host_array(total, DataPartitionType.REPLICATED, mesh=mesh) == 276
    ```
    """
    function = "global_to_host_array"
    mesh, target, _ = _resolve(mesh, partition, function)
    full = partition is DataPartitionType.FULL
    flat, treedef = tree_flatten_with_path(global_arrays)
    mesh_devices = sorted(d.id for d in mesh.devices.flat)
    for key_path, leaf in flat:
        path = path_to_str(key_path) or "<root>"
        if isinstance(leaf, Tracer) or not isinstance(leaf, jax.Array):
            raise TypeError(f"`{function}`: leaf {path!r} must be a `jax.Array` (untraced).")
        if (devices := sorted(d.id for d in leaf.sharding.device_set)) != mesh_devices:
            raise ValueError(
                f"`{function}`: leaf {path!r} lives on devices {devices}, not the mesh."
            )
        if full:
            _check_rows(function, path, leaf, mesh.size, "global")
    leaves = jax.device_put([leaf for _, leaf in flat], target)  # reshards what differs

    def host(a: jax.Array) -> np.ndarray:  # FULL: every device holds a distinct block of rows
        if not full:
            return np.asarray(a.addressable_data(0))
        shards = sorted(a.addressable_shards, key=lambda shard: shard.index[0].start or 0)
        return np.concatenate([np.asarray(shard.data) for shard in shards])

    return treedef.unflatten([host(leaf) for leaf in leaves])


# ---------------------------------------------------------------------------------------------
# with_sharding_constraint


def with_sharding_constraint(x: PyTree[ArrayLike], shardings: PyTree) -> PyTree[ArrayLike]:
    """`jax.lax.with_sharding_constraint` that is a checked no-op on a single device.

    On a mesh of more than one device this is `jax.lax.with_sharding_constraint(x,
    shardings)` over the mesh's Auto axes and `jax.sharding.reshard` over its Explicit ones
    (those of `jax.make_mesh`'s default, where the sharding is part of the array's type), so
    one spec serves meshes of either kind and meshes that mix them; outside `jax.jit` the
    arrays are placed (`jax.device_put`). On a one-device mesh it returns `x` unchanged, so
    the same model code runs on a laptop without a mesh of many devices. The shardings are
    checked in both cases, by JAX's own `NamedSharding` and `Sharding.check_compatible_aval`:
    an axis name the mesh does not have, an axis used twice, or more spec entries than the
    array has dimensions is a `ValueError` naming the leaf even on one device, so code that
    runs on one device does not fail only once it meets a bigger mesh.

    **Arguments:**

    - `x`: an array or a pytree of arrays (usually traced values inside `jax.jit`).
    - `shardings`: a `PartitionSpec` or `jax.sharding.Sharding` (e.g. `NamedSharding`) for all
      of `x`, or a pytree of them that is a prefix of `x`'s structure; a `None` entry leaves
      that part of `x` unconstrained. A bare `PartitionSpec` refers to the mesh set with
      `jax.set_mesh`; a `NamedSharding` carries its own mesh.

    **Returns:** `x`, with the sharding constraint applied when the mesh has several devices.

    **Raises:** `ValueError` for a bad axis name, a repeated axis, a spec longer than the
    array's rank, a bare `PartitionSpec` with no mesh set, or `shardings` whose structure is
    not a prefix of `x`'s; `TypeError` for a leaf of `shardings` that is not a sharding.

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from eqpar.placement import with_sharding_constraint

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    @jax.jit
    def layer(params, x):
        h = x @ params["w"]
        return with_sharding_constraint(h, PartitionSpec("data", "model"))

    params = {"w": jnp.ones((4, 8))}
    with jax.set_mesh(mesh):
        h = layer(params, jnp.ones((6, 4)))
    assert h.sharding.spec == PartitionSpec("data", "model")

    one_device = Mesh(np.array(jax.devices()[:1]), ("data",))
    y = with_sharding_constraint(jnp.ones(3), NamedSharding(one_device, PartitionSpec("data")))
    assert y.shape == (3,)
    ```
    """
    function = "with_sharding_constraint"
    is_sharding = lambda node: node is None or isinstance(node, PartitionSpec | Sharding)
    try:
        jax.tree.structure(shardings, is_leaf=is_sharding).flatten_up_to(x)
    except ValueError as error:
        raise ValueError(
            f"`{function}`: `shardings` must be a prefix of the structure of `x` ({error})."
        ) from None

    def constrain(prefix: tuple, sharding: Any, path: tuple, leaf: ArrayLike) -> ArrayLike:
        where, shape = path_to_str(prefix + path), np.shape(leaf)
        if not isinstance(sharding, PartitionSpec | Sharding):
            raise TypeError(
                f"`{function}`: `shardings` at {where or '<root>'!r} must be a `PartitionSpec`, "
                f"a `Sharding` or None, not {sharding!r}."
            )
        bare = isinstance(sharding, PartitionSpec)
        mesh: Any = _context_mesh() if bare else getattr(sharding, "mesh", None)
        if bare and mesh is None:
            raise ValueError(
                f"`{function}`: the sharding at {where or '<root>'!r} is a bare `PartitionSpec`, "
                "which needs a mesh: `jax.set_mesh(mesh)`, or pass `NamedSharding(mesh, spec)`."
            )
        if isinstance(spec := getattr(sharding, "spec", sharding), PartitionSpec):
            check_spec(where, spec, shape, dict(mesh.shape), source=f"{function}: shardings")
            named: PyTree = NamedSharding(mesh, spec)
        else:  # other kinds of sharding: JAX's own check
            named = sharding
            named.shard_shape(shape)
        if named.num_devices == 1:
            return leaf  # on one device: a checked no-op
        if isinstance(named, NamedSharding):
            return constrain_on_any_axes(leaf, named)  # Explicit axes too
        return jax.lax.with_sharding_constraint(leaf, named)

    def constrain_subtree(prefix: tuple, sharding: Any, subtree: PyTree) -> PyTree:
        apply = functools.partial(constrain, prefix, sharding)
        return subtree if sharding is None else tree_map_with_path(apply, subtree)

    return tree_map_with_path(constrain_subtree, shardings, x, is_leaf=is_sharding)
