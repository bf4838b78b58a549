"""Moving batches between each process's host memory and global `jax.Array`s.

In JAX's multi-controller model every process runs the same program and owns a few devices
(its *local* devices). A global `jax.Array` spans the devices of all processes; each process
can only read or write the blocks that live on its own devices. Data loaders, on the other
hand, produce one ordinary NumPy batch per process. This module converts between the two:

- `host_to_global_device_array` turns each process's local batch into one global array;
- `global_to_host_array` is its inverse and gives each process its own rows back;
- `with_sharding_constraint` is `jax.lax.with_sharding_constraint` that also runs, as a checked
  no-op, on a single device.

**Which mesh.** The functions take `mesh=` explicitly or read the mesh of the surrounding
context. The context mesh is the one set by `jax.set_mesh(mesh)` (as a context manager or a
global setter), read through the public `jax.sharding.get_mesh()` (outside `jax.jit`) and
`jax.sharding.get_abstract_mesh()` (inside). The legacy `with mesh:` context has no public
reader in recent JAX (it is deprecated since JAX 0.8.2); while JAX still provides
`jax.interpreters.pxla.thread_resources` it is read from there as a fallback, so `with mesh:`
keeps working, but new code should use `jax.set_mesh`.
"""

import enum
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import Array, ArrayLike, PyTree

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


_NO_MESH_HELP = (
    "Pass one explicitly (`mesh=jax.sharding.Mesh(devices, axis_names)`) or set it for the "
    "surrounding code with `jax.set_mesh(mesh)` (as a context manager, `with jax.set_mesh(mesh):`, "
    "or once, globally)."
)


def _legacy_context_mesh() -> Mesh | None:
    """The mesh of a legacy `with mesh:` block, while JAX still exposes it.

    JAX deprecated `with mesh:` in favour of `jax.set_mesh` and offers no public reader for
    it; `jax.interpreters.pxla.thread_resources` (itself deprecated) is the only place it is
    recorded. Reading it is best effort: once JAX removes it, `with mesh:` is simply not seen.
    """
    try:
        from jax.interpreters import pxla
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        resources = getattr(pxla, "thread_resources", None)
    env = getattr(resources, "env", None)
    mesh = getattr(env, "physical_mesh", None)
    if isinstance(mesh, Mesh) and not mesh.empty:
        return mesh
    return None


def _context_mesh() -> Mesh | None:
    """The concrete mesh set by `jax.set_mesh` or `with mesh:`; only valid outside `jax.jit`."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    if get_mesh is not None:
        mesh = get_mesh()
        if isinstance(mesh, Mesh) and not mesh.empty:
            return mesh
    return _legacy_context_mesh()


def _context_abstract_mesh() -> jax.sharding.AbstractMesh | Mesh | None:
    """Axis names and sizes of the context mesh; also valid inside `jax.jit`."""
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_abstract_mesh is not None:
        mesh = get_abstract_mesh()
        if not mesh.empty:
            return mesh
    return _legacy_context_mesh()


def _resolve_mesh(mesh: object, function: str) -> Mesh:
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"`{function}`: `mesh` must be a concrete `jax.sharding.Mesh` (placement needs "
                f"actual devices), got {type(mesh).__name__}: {mesh!r}."
            )
        return mesh
    try:
        found = _context_mesh()
    except ValueError as error:  # `jax.sharding.get_mesh` refuses to run under a trace
        raise ValueError(
            f"`{function}` moves data between hosts and devices and must be called outside "
            "`jax.jit` / `jax.grad` / `shard_map`."
        ) from error
    if found is None:
        raise ValueError(f"`{function}`: no device mesh given and none is set. {_NO_MESH_HELP}")
    return found


# ---------------------------------------------------------------------------------------------
# Host -> global


def _check_partition(partition: object, function: str) -> DataPartitionType:
    if not isinstance(partition, DataPartitionType):
        raise TypeError(
            f"`{function}`: `partition` must be a `DataPartitionType` (`DataPartitionType.FULL` "
            f"or `DataPartitionType.REPLICATED`), got {partition!r}."
        )
    return partition


def _local_mesh_devices(mesh: Mesh, function: str) -> list[Any]:
    process = jax.process_index()
    local = [device for device in mesh.devices.flat if device.process_index == process]
    if not local:
        raise ValueError(
            f"`{function}`: the mesh has no device of this process (process {process}); "
            f"mesh devices: {[device.id for device in mesh.devices.flat]}, this process's "
            f"devices: {[device.id for device in jax.local_devices()]}. Build the mesh from "
            "`jax.devices()` so that every process contributes devices."
        )
    return local


def _full_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def _replicated_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _host_leaf_to_numpy(path: str, leaf: object) -> np.ndarray:
    if isinstance(leaf, Tracer):
        raise TypeError(
            f"`host_to_global_device_array`: leaf {path} is a traced value; host batches are "
            "placed outside `jax.jit`."
        )
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        raise TypeError(
            f"`host_to_global_device_array`: leaf {path} is already a global array spanning "
            f"several processes (shape {leaf.shape}); pass each process's local NumPy batch, "
            "or use the global array as it is."
        )
    if not isinstance(leaf, np.ndarray | np.generic | jax.Array | bool | int | float | complex):
        raise TypeError(
            f"`host_to_global_device_array`: leaf {path} must be a NumPy array, a JAX array or "
            f"a Python number, got {type(leaf).__name__}."
        )
    array = np.asarray(leaf)
    if array.dtype.kind in "OUS" or array.dtype.names is not None:
        raise TypeError(
            f"`host_to_global_device_array`: leaf {path} has dtype {array.dtype}, which cannot "
            "live on a device; convert it to a numeric dtype first."
        )
    return array


def _place_full(path: str, array: np.ndarray, mesh: Mesh, local: Sequence[Any]) -> Array:
    if array.ndim == 0:
        raise ValueError(
            f"`host_to_global_device_array`: leaf {path} is a scalar, but "
            "`DataPartitionType.FULL` splits the leading (batch) axis. Give it a batch axis, or "
            "place it with `DataPartitionType.REPLICATED`."
        )
    local_batch = array.shape[0]
    if local_batch % len(local) != 0:
        raise ValueError(
            f"`host_to_global_device_array`: leaf {path} has a local batch of {local_batch} "
            f"rows (shape {array.shape}), which does not divide over this process's "
            f"{len(local)} devices of the mesh. Make the per-process batch a multiple of "
            f"{len(local)} (rows are never dropped or padded)."
        )
    block = local_batch // len(local)
    global_shape = (block * mesh.size, *array.shape[1:])
    sharding = _full_sharding(mesh)
    # A process's devices need not hold consecutive global rows (e.g. when processes
    # interleave in the mesh); its own rows go, in order, to its devices sorted by the global
    # block each holds, which `global_to_host_array` undoes with the same ordering.
    index_map = sharding.addressable_devices_indices_map(global_shape)
    devices = sorted(local, key=lambda device: _start(index_map[device], global_shape[0]))
    blocks = [array[i * block : (i + 1) * block] for i in range(len(devices))]
    buffers = jax.device_put(blocks, devices)
    return jax.make_array_from_single_device_arrays(global_shape, sharding, buffers)


def _place_replicated(array: np.ndarray, mesh: Mesh, local: Sequence[Any]) -> Array:
    buffers = jax.device_put([array] * len(local), list(local))
    return jax.make_array_from_single_device_arrays(
        array.shape, _replicated_sharding(mesh), buffers
    )


def _start(index: tuple[slice, ...] | None, size: int) -> int:
    """Where a shard's block starts along the leading axis."""
    assert index is not None, "addressable shards always have an index"
    return index[0].indices(size)[0]


def host_to_global_device_array(
    host_arrays: PyTree,
    partition: DataPartitionType = DataPartitionType.FULL,
    *,
    mesh: Mesh | None = None,
) -> PyTree[Array]:
    """Build global `jax.Array`s from each process's local batch.

    Every process calls this with its own local batch (a pytree of NumPy arrays of the same
    structure, shapes and dtypes on every process).

    - With `DataPartitionType.FULL` the leading axis of every leaf is split over all mesh axes
      (the sharding is `PartitionSpec(mesh.axis_names)`, one distinct block of rows per device).
      The global batch is the concatenation of all processes' local batches: its length is the
      local batch times the number of processes (when every process has the same number of
      devices in the mesh). Each process's rows land, in order, on its own devices, so no data
      crosses processes.
    - With `DataPartitionType.REPLICATED` every device holds the whole array; every process
      must pass identical data (this is not checked, as checking would need communication).

    Dtypes follow JAX's usual canonicalization (e.g. `float64` becomes `float32` unless
    `jax_enable_x64` is on).

    **Arguments:**

    - `host_arrays`: a pytree of NumPy arrays (JAX arrays on local devices and Python numbers
      are accepted too).
    - `partition`: a `DataPartitionType`.
    - `mesh`: the `jax.sharding.Mesh` to place on; defaults to the mesh set with
      `jax.set_mesh` (or a legacy `with mesh:` block).

    **Returns:** a pytree of the same structure whose leaves are global `jax.Array`s sharded on
    `mesh`.

    **Raises:** `ValueError` when no mesh is available, when a `FULL` leaf is a scalar or its
    local batch does not divide over this process's devices in the mesh (the message names the
    leaf path); `TypeError` for a leaf that is not array data.

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
    partition = _check_partition(partition, function)
    mesh = _resolve_mesh(mesh, function)
    local = _local_mesh_devices(mesh, function)

    def place(key_path: tuple, leaf: object) -> Array:
        path = jax.tree_util.keystr(key_path) or "<root>"
        array = _host_leaf_to_numpy(path, leaf)
        if partition is DataPartitionType.FULL:
            return _place_full(path, array, mesh, local)
        return _place_replicated(array, mesh, local)

    return jax.tree_util.tree_map_with_path(place, host_arrays)


# ---------------------------------------------------------------------------------------------
# Global -> host


def _identity(tree: PyTree) -> PyTree:
    return tree


def _check_global_leaf(
    path: str, leaf: object, partition: DataPartitionType, mesh: Mesh
) -> jax.Array:
    function = "global_to_host_array"
    if isinstance(leaf, Tracer):
        raise TypeError(
            f"`{function}`: leaf {path} is a traced value; copying to the host happens outside "
            "`jax.jit`."
        )
    if not isinstance(leaf, jax.Array):
        raise TypeError(
            f"`{function}`: leaf {path} must be a `jax.Array` (as `host_to_global_device_array` "
            f"returns), got {type(leaf).__name__}."
        )
    if leaf.sharding.device_set != set(mesh.devices.flat):
        raise ValueError(
            f"`{function}`: leaf {path} lives on devices "
            f"{sorted(device.id for device in leaf.sharding.device_set)}, not on the mesh's "
            f"devices {sorted(device.id for device in mesh.devices.flat)}. Pass the mesh it "
            "was placed on as `mesh=`."
        )
    if partition is DataPartitionType.FULL:
        if leaf.ndim == 0:
            raise ValueError(
                f"`{function}`: leaf {path} is a scalar, but `DataPartitionType.FULL` splits "
                "the leading (batch) axis; use `DataPartitionType.REPLICATED` for it."
            )
        if leaf.shape[0] % mesh.size != 0:
            raise ValueError(
                f"`{function}`: leaf {path} has a global batch of {leaf.shape[0]} rows (shape "
                f"{leaf.shape}), which does not divide over the mesh's {mesh.size} devices, so "
                "it cannot be split into per-process rows with `DataPartitionType.FULL`."
            )
    return leaf


def _local_rows(array: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded array, each distinct block once, in order."""
    size = array.shape[0]
    blocks: dict[int, jax.Array] = {}
    for shard in array.addressable_shards:
        blocks.setdefault(_start(shard.index, size), shard.data)
    return np.concatenate([np.asarray(blocks[start]) for start in sorted(blocks)], axis=0)


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
    on the devices, so every process must make this call together, as with any operation on
    global arrays. Blocks that several local devices hold are copied to the host once.

    **Arguments:**

    - `global_arrays`: a pytree of `jax.Array`s placed on `mesh`.
    - `partition`: a `DataPartitionType`; the one that was used to place the data.
    - `mesh`: the `jax.sharding.Mesh` of the arrays; defaults to the mesh set with
      `jax.set_mesh` (or a legacy `with mesh:` block).

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
    partition = _check_partition(partition, function)
    mesh = _resolve_mesh(mesh, function)
    _local_mesh_devices(mesh, function)
    if partition is DataPartitionType.FULL:
        target = _full_sharding(mesh)
    else:
        target = _replicated_sharding(mesh)

    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(global_arrays)
    leaves = [
        _check_global_leaf(jax.tree_util.keystr(key_path) or "<root>", leaf, partition, mesh)
        for key_path, leaf in paths_and_leaves
    ]
    # All leaves that need another layout move in one compiled program: it involves every
    # process, and one collective program is cheaper than one per leaf.
    to_move = [
        i for i, leaf in enumerate(leaves) if not leaf.sharding.is_equivalent_to(target, leaf.ndim)
    ]
    if to_move:
        moved = jax.jit(_identity, out_shardings=[target] * len(to_move))(
            [leaves[i] for i in to_move]
        )
        for i, leaf in zip(to_move, moved):
            leaves[i] = leaf

    if partition is DataPartitionType.FULL:
        host = [_local_rows(leaf) for leaf in leaves]
    else:
        host = [np.array(leaf.addressable_shards[0].data) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, host)


# ---------------------------------------------------------------------------------------------
# with_sharding_constraint


def _is_sharding_leaf(node: object) -> bool:
    return node is None or isinstance(node, PartitionSpec | Sharding)


def _spec_axis_names(spec: PartitionSpec) -> list[object]:
    names: list[object] = []
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        names.extend(entry if isinstance(entry, tuple) else (entry,))
    return names


def _check_spec(path: str, spec: PartitionSpec, axis_names: Sequence[object], leaf: object) -> None:
    function = "with_sharding_constraint"
    names = _spec_axis_names(spec)
    unknown = [name for name in names if name not in axis_names]
    if unknown:
        raise ValueError(
            f"`{function}`: the sharding at {path} is {spec}, which names "
            f"{', '.join(repr(name) for name in unknown)}, but the mesh only has the axes "
            f"{tuple(axis_names)}. Use the mesh's axis names (or fix the mesh)."
        )
    repeated = sorted({repr(name) for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"`{function}`: the sharding at {path} is {spec}, which uses the mesh axes "
            f"{', '.join(repeated)} more than once; each mesh axis can shard one dimension."
        )
    ndim = np.ndim(leaf)  # type: ignore[arg-type]
    if len(spec) > ndim:
        raise ValueError(
            f"`{function}`: the sharding at {path} is {spec}, with {len(spec)} entries, but the "
            f"array there has only {ndim} dimensions (shape {np.shape(leaf)})."  # type: ignore[arg-type]
        )


def with_sharding_constraint(x: PyTree[ArrayLike], shardings: PyTree) -> PyTree[ArrayLike]:
    """`jax.lax.with_sharding_constraint` that is a checked no-op on a single device.

    On a mesh of more than one device this is `jax.lax.with_sharding_constraint(x,
    shardings)`. On a one-device mesh it returns `x` unchanged, so the same model code runs
    on a laptop without a mesh of many devices. The shardings are checked in both cases:
    an axis name the mesh does not have, an axis used twice, or more spec entries than the
    array has dimensions is a `ValueError` even on one device, so code that runs on one
    device does not fail only once it meets a bigger mesh.

    **Arguments:**

    - `x`: an array or a pytree of arrays (usually traced values inside `jax.jit`).
    - `shardings`: a `PartitionSpec` or `jax.sharding.Sharding` (e.g. `NamedSharding`) for all
      of `x`, or a pytree of them that is a prefix of `x`'s structure; a `None` entry leaves
      that part of `x` unconstrained. A bare `PartitionSpec` refers to the mesh set with
      `jax.set_mesh` (or a legacy `with mesh:`); a `NamedSharding` carries its own mesh.

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
    context: list[jax.sharding.AbstractMesh | Mesh | None] = []

    def context_mesh(path: str) -> jax.sharding.AbstractMesh | Mesh:
        if not context:
            try:
                # Outside a trace the concrete mesh turns a bare spec into a `NamedSharding`,
                # which `lax.with_sharding_constraint` needs for concrete arrays.
                context.append(_context_mesh() or _context_abstract_mesh())
            except ValueError:  # inside a trace only the abstract mesh can be read
                context.append(_context_abstract_mesh())
        mesh = context[0]
        if mesh is None:
            raise ValueError(
                f"`{function}`: the sharding at {path} is a bare `PartitionSpec`, which needs a "
                "mesh, and none is set. Set one with `jax.set_mesh(mesh)` around the call (or "
                "the `jax.jit` call that traces it), or pass `NamedSharding(mesh, spec)`."
            )
        return mesh

    def constrain(key_path: tuple, sharding: object, subtree: PyTree) -> PyTree:
        path = jax.tree_util.keystr(key_path) or "<root>"
        if sharding is None:
            return subtree
        if isinstance(sharding, PartitionSpec):
            mesh = context_mesh(path)
            axis_names, size = mesh.axis_names, mesh.size
            spec: PartitionSpec | None = sharding
            concrete = mesh if isinstance(mesh, Mesh) else None
        elif isinstance(sharding, NamedSharding):
            axis_names, size = sharding.mesh.axis_names, sharding.mesh.size
            spec, concrete = sharding.spec, None
        elif isinstance(sharding, Sharding):
            axis_names, size, spec, concrete = (), len(sharding.device_set), None, None
        else:
            raise TypeError(
                f"`{function}`: `shardings` at {path} must be a `PartitionSpec`, a "
                f"`jax.sharding.Sharding` or None, got {type(sharding).__name__}: {sharding!r}."
            )

        def apply(leaf_path: tuple, leaf: ArrayLike) -> ArrayLike:
            if spec is not None:
                leaf_path_str = jax.tree_util.keystr(key_path + leaf_path) or "<root>"
                _check_spec(leaf_path_str, spec, axis_names, leaf)
            if size <= 1:
                return leaf
            if concrete is not None and spec is not None:
                return jax.lax.with_sharding_constraint(leaf, NamedSharding(concrete, spec))
            return jax.lax.with_sharding_constraint(leaf, sharding)

        return jax.tree_util.tree_map_with_path(apply, subtree)

    paths_and_shardings, treedef = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=_is_sharding_leaf
    )
    try:
        subtrees = treedef.flatten_up_to(x)
    except ValueError as error:
        raise ValueError(
            f"`{function}`: `shardings` must be one sharding or a pytree whose structure is a "
            f"prefix of the structure of `x`; `shardings` has structure {treedef} and `x` has "
            f"structure {jax.tree_util.tree_structure(x)} ({error})."
        ) from error
    constrained = [
        constrain(key_path, sharding, subtree)
        for (key_path, sharding), subtree in zip(paths_and_shardings, subtrees)
    ]
    return jax.tree_util.tree_unflatten(treedef, constrained)
