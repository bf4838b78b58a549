"""Sharded checkpoints of Equinox/Optax training state, through orbax-checkpoint.

`Checkpointer` saves any pytree that mixes Equinox modules, Optax optimizer states and small
metadata (step counters, the data position, PRNG keys) as sharded arrays, and restores it
onto whatever mesh and layout the caller asks for.

**What is written.** Only data goes to disk: the array leaves of the state (`jax.Array`s,
NumPy arrays, new-style PRNG keys through `jax.random.key_data`) and its Python `bool`, `int`,
`float` and `complex` leaves. Everything else in the pytree (activation functions, strings,
the static fields of modules, the tree structure itself) is not written; it comes back from
the `target` the caller passes to `restore`, which is normally built with the same
constructor as the saved model, e.g. with `eqx.filter_eval_shape` so that nothing is
allocated.

**Format.** A checkpoint is orbax's standard PyTree format: JSON metadata files
(`_CHECKPOINT_METADATA`, `default/_METADATA`, `default/_sharding`, ...) and the array bytes
in TensorStore's zarr format inside an OCDBT key-value store (`default/manifest.ocdbt`,
`default/d/...`, and `default/ocdbt.process_<i>/` written by process `i`). Nothing is
pickled and loading never executes code from the checkpoint: JSON is parsed, array bytes are
decoded by TensorStore, and the Python structure is taken from `target`. eqpar adds one JSON
entry to `_CHECKPOINT_METADATA` (`custom_metadata.eqpar`) listing every saved leaf with its
`/`-joined path, kind, shape, dtype and a checksum.

**Sharded I/O.** Each process writes the blocks of the arrays that live on its own devices
into its own `ocdbt.process_<i>` directory, each block once (orbax may split a replicated
block among the devices holding it); nothing is gathered onto one device or one host. On
restore each device reads exactly the block its target sharding asks for, so a checkpoint
saved under one mesh or layout restores under any other (a different mesh shape,
tensor-parallel size, FSDP axis, or one device), bit for bit.

**Atomicity.** orbax writes a step into `<directory>/<step>.orbax-checkpoint-tmp` and, once
every process has finished writing, the primary process writes `commit_success.txt` into it
and renames it to `<directory>/<step>` (one `rename(2)` on a POSIX filesystem; on object
stores such as GCS, where rename is not atomic, the `commit_success.txt` file itself marks
completion). A save that dies midway leaves at most a `*.orbax-checkpoint-tmp` directory,
which is never listed as a step and is deleted the next time a `Checkpointer` opens the
directory; the previous checkpoints are never touched before the new one is complete (old
steps beyond `keep` are deleted only after the new step is committed).

**Corruption.** A step directory that is damaged after the fact (a deleted or truncated array
file, a missing or unreadable metadata file, flipped bytes caught by the checksum) raises
`CorruptCheckpointError` naming the step and its path when that step is asked for
explicitly; `restore()` without a step warns and falls back to the newest step that
restores cleanly.

**Logging.** While a `Checkpointer` is open, orbax's log records below ERROR go to the
`eqpar.checkpoint.orbax` logger at DEBUG level; eqpar reports damage and fallbacks itself.

Tested with orbax-checkpoint 0.12.8. It uses `ocp.CheckpointManager` with
`ocp.args.StandardSave` / `StandardRestore`, the `save_decision_policy` and
`preservation_policy` options (present since orbax-checkpoint 0.11.14) and step
`custom_metadata`.
"""

import dataclasses
import gc
import json
import logging
import operator
import os
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ._paths import key_to_str, path_to_str
from ._typing import PyTree

__all__ = [
    "CheckpointMismatchError",
    "Checkpointer",
    "CorruptCheckpointError",
]

_FORMAT_KEY = "eqpar"  # our entry in the step's `custom_metadata`
_FORMAT_VERSION = 1
_ITEM_ROOT = "state"  # the saved nested dict is `{"state": {...}}`, so a root leaf has a name
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step JSON file
_ITEM_DIR = "default"  # orbax's directory for the single (unnamed) item
_ITEM_METADATA_FILE = "_METADATA"  # orbax's PyTree metadata file inside the item directory
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step directory being written

_PYTHON_KINDS: dict[type, tuple[str, np.dtype]] = {
    bool: ("bool", np.dtype(np.bool_)),
    int: ("int", np.dtype(np.int64)),
    float: ("float", np.dtype(np.float64)),
    complex: ("complex", np.dtype(np.complex128)),
}
_ARRAY_KINDS = ("array", "numpy")  # interchangeable: device array <-> host array

_log = logging.getLogger(__name__)


class CorruptCheckpointError(ValueError):
    """A checkpoint step exists but cannot be read back intact.

    Raised by `Checkpointer.restore` for missing or unreadable metadata files, missing or
    truncated array files and checksum mismatches.

    **Arguments:**

    - `message`: what is wrong and how to go on.
    - `step`, `path`: the damaged step and its directory (`None` when every step is damaged
      and `path` is the checkpoint directory).

    ```python
    import os
    import tempfile

    import jax.numpy as jnp
    from eqpar.checkpoint import Checkpointer, CorruptCheckpointError

    with tempfile.TemporaryDirectory() as directory:
        with Checkpointer(directory) as checkpointer:
            checkpointer.save(0, {"w": jnp.ones(2)})
            os.remove(os.path.join(directory, "0", "_CHECKPOINT_METADATA"))
            try:
                checkpointer.restore(0, target={"w": jnp.zeros(2)})
            except CorruptCheckpointError as error:
                assert error.step == 0 and error.path == os.path.join(directory, "0")
    ```
    """

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None):
        super().__init__(message)
        self.step = step
        self.path = path


class CheckpointMismatchError(ValueError):
    """A readable checkpoint does not have the structure of the `target` it is restored into.

    **Arguments:**

    - `message`: names the first mismatching leaf path (`/`-joined, e.g.
      `model/layers/0/weight`) and what differs (a leaf missing from the checkpoint, an extra
      leaf, its kind, shape, dtype or PRNG implementation), then lists every difference.
    - `step`, `path`: the step and its directory.

    ```python
    import tempfile

    import jax.numpy as jnp
    from eqpar.checkpoint import CheckpointMismatchError, Checkpointer

    with tempfile.TemporaryDirectory() as directory:
        with Checkpointer(directory) as checkpointer:
            checkpointer.save(0, {"w": jnp.ones(2)})
            try:
                checkpointer.restore(target={"w": jnp.zeros(3)})
            except CheckpointMismatchError as error:
                assert "`w` (shape): (2,) in the checkpoint, (3,) in the target" in str(error)
    ```
    """

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None):
        super().__init__(message)
        self.step = step
        self.path = path


# ---------------------------------------------------------------------------------------------
# orbax, imported lazily (it is an optional dependency and slow to import) and kept quiet


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "eqpar.checkpoint needs orbax-checkpoint; install it with "
            "`pip install 'eqpar[checkpoint]'` (or `pip install orbax-checkpoint`)."
        ) from error
    return ocp


_orbax_log = logging.getLogger(__name__ + ".orbax")


_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


def _logged_from_orbax(record: logging.LogRecord) -> bool:
    if _ORBAX_DIR in record.pathname:
        return True
    # absl sometimes names its own file as the caller; the filter runs in the logging call,
    # so the stack still shows who logged
    frame = sys._getframe(1)
    while frame is not None:
        if _ORBAX_DIR in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class _RouteOrbaxRecords(logging.Filter):
    """Move orbax's log records below ERROR from the `absl` logger to `eqpar.checkpoint.orbax`
    at DEBUG level: eqpar reports what matters (a damaged step, a fallback) in its own
    exceptions and warnings, and orbax's own account is one `logging.getLogger(
    "eqpar.checkpoint.orbax").setLevel(logging.DEBUG)` away."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR and _logged_from_orbax(record):
            if _orbax_log.isEnabledFor(logging.DEBUG):
                _orbax_log.debug("[%s] %s", record.levelname, record.getMessage())
            return False
        return True


_route_filter = _RouteOrbaxRecords()
_route_lock = threading.Lock()
_route_users = 0


def _route_orbax_logs() -> None:
    global _route_users
    with _route_lock:
        if _route_users == 0:
            logging.getLogger("absl").addFilter(_route_filter)
        _route_users += 1


def _stop_routing_orbax_logs() -> None:
    global _route_users
    with _route_lock:
        _route_users -= 1
        if _route_users == 0:
            logging.getLogger("absl").removeFilter(_route_filter)


# ---------------------------------------------------------------------------------------------
# Checksums: a position-weighted 32-bit sum of each leaf's bits. orbax/TensorStore detect
# missing and truncated files but not bytes altered in place; this does. It is computed
# where the data lives (one reduction per array under `jax.jit`, no gather) and does not depend
# on the sharding, so a checkpoint saved under one layout verifies under any other.

_MULTIPLIER = 0x9E3779B1
_OFFSET = 0x7F4A7C15


def _digestible(dtype: Any) -> bool:
    """Whether leaves of `dtype` get a checksum: every whole-byte type does; sub-byte types
    (int4, float4, ...) are stored packed and are left unchecked."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype.itemsize in (8, 16)
    if jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    else:
        return False
    return dtype.itemsize in (1, 2, 4, 8) and bits == 8 * dtype.itemsize


def _device_words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words, one per element, same shape (traced)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _device_words(jnp.real(x)) ^ _device_words(jnp.imag(x))
    size = x.dtype.itemsize
    if size == 8:  # two words per element; xor makes the result independent of word order
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return halves[..., 0] ^ halves[..., 1]
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _device_digest(x: jax.Array) -> jax.Array:
    words = _device_words(x)
    # C-order linear index from broadcast iotas: no reshape, so the sharding is kept as is
    index = jnp.zeros((), jnp.uint32)
    stride = 1
    for axis in reversed(range(x.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    weights = (index * jnp.uint32(_MULTIPLIER) + jnp.uint32(_OFFSET)) | jnp.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


_device_digests = jax.jit(lambda arrays: [_device_digest(a) for a in arrays])


def _host_words(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    if x.dtype.kind == "c":
        return _host_words(np.real(x)) ^ _host_words(np.imag(x))
    size = x.dtype.itemsize
    if size == 8:
        halves = x.view(np.uint32).reshape(-1, 2)
        return halves[:, 0] ^ halves[:, 1]
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    return x.view(unsigned).astype(np.uint32)


def _host_digest(x: np.ndarray) -> int:
    words = _host_words(x)
    index = (np.arange(words.size, dtype=np.uint64) % 2**32).astype(np.uint32)
    weights = (index * np.uint32(_MULTIPLIER) + np.uint32(_OFFSET)) | np.uint32(1)
    return int(np.sum(words * weights, dtype=np.uint32))


def _device_order(sharding: Sharding) -> tuple:
    """Arrays that one jit call may take together: jit refuses arrays committed to different
    devices, or to the same devices in another order."""
    devices = (
        getattr(sharding.mesh, "devices", None) if isinstance(sharding, NamedSharding) else None
    )
    if devices is not None:
        return tuple(device.id for device in np.asarray(devices).flat)
    if len(sharding.device_set) == 1:
        return tuple(device.id for device in sharding.device_set)
    return ("alone", id(sharding))


def _digests(values: Sequence[Any]) -> list[int | None]:
    """Checksums of `values` (jax or NumPy arrays); `None` where the dtype has none."""
    result: list[int | None] = [None] * len(values)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, value in enumerate(values):
        if not _digestible(value.dtype):
            continue
        if isinstance(value, jax.Array):
            groups.setdefault(_device_order(value.sharding), []).append(i)
        else:
            result[i] = _host_digest(np.asarray(value))
    for indices in groups.values():
        outputs = _device_digests([values[i] for i in indices])
        for i, output in zip(indices, outputs):
            # replicated scalar: every process reads its own copy
            result[i] = int(np.asarray(output.addressable_data(0)))
    return result


# ---------------------------------------------------------------------------------------------
# Leaves


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One saved (or to-be-restored) leaf: where it sits and how it is stored."""

    index: int  # position among the flattened leaves of the whole tree
    path: str  # `/`-joined, for messages and the JSON record
    names: tuple[str, ...]  # keys of the nested dict handed to orbax
    kind: str  # "array" | "numpy" | "prng_key" | "bool" | "int" | "float" | "complex"
    shape: tuple[int, ...]  # as stored (PRNG keys: the shape of their key data)
    dtype: str  # as stored, `np.dtype(...).name`
    impl: str | None = None  # PRNG implementation name for "prng_key"


def _is_prng_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _describe_kind(kind: str, impl: str | None = None) -> str:
    return {
        "array": "a jax array",
        "numpy": "a NumPy array",
        "prng_key": f"a PRNG key array (impl {impl})",
        "bool": "a Python bool",
        "int": "a Python int",
        "float": "a Python float",
        "complex": "a Python complex",
    }[kind]


def _display(path: str) -> str:
    return f"`{path}`" if path else "the root leaf"


def _flatten(tree: PyTree) -> tuple[list[tuple[tuple, Any]], Any]:
    return jax.tree_util.tree_flatten_with_path(tree)


def _check_unique(leaves: Sequence[_Leaf], argument: str) -> None:
    """Two leaves must not land on the same name, neither as our `/`-joined paths (e.g. the
    keys `"a/b"` and `"a"` -> `"b"`) nor as orbax's `.`-joined parameter names (`"a.b"`)."""
    for name_of in (lambda leaf: leaf.path, lambda leaf: ".".join(leaf.names)):
        seen: dict[str, str] = {}
        for leaf in leaves:
            name = name_of(leaf)
            if name in seen:
                raise ValueError(
                    f"`{argument}` has two leaves that would be stored under the same name "
                    f"{name!r}: {_display(seen[name])} and {_display(leaf.path)} (dict keys that "
                    "print alike, or keys containing '/' or '.'). Rename one of them."
                )
            seen[name] = leaf.path


def _save_plan(state: PyTree) -> tuple[list[_Leaf], list[Any]]:
    """The leaves of `state` that are written, with the values orbax stores for them."""
    flat, _ = _flatten(state)
    leaves: list[_Leaf] = []
    values: list[Any] = []
    for index, (path, value) in enumerate(flat):
        where = path_to_str(path)
        names = (_ITEM_ROOT, *(key_to_str(k) for k in path))
        if isinstance(value, jax.ShapeDtypeStruct):
            raise TypeError(
                f"`state` leaf {_display(where)} is a jax.ShapeDtypeStruct, which has no data to "
                "save. Save the real arrays; abstract leaves belong in `restore(target=...)`."
            )
        if isinstance(value, jax.Array):
            if _is_prng_key_dtype(value.dtype):
                data = jax.random.key_data(value)
                impl = jax.random.key_impl(value)
                if not isinstance(impl, str):  # only registered implementations have a name
                    raise TypeError(
                        f"`state` leaf {_display(where)} is a PRNG key of the unregistered "
                        f"implementation {impl}, which a checkpoint cannot name. Register it "
                        "with jax.random, or save `jax.random.key_data(key)` instead."
                    )
                leaf = _Leaf(
                    index, where, names, "prng_key", data.shape, np.dtype(data.dtype).name, impl
                )
                value = data
            else:
                leaf = _Leaf(index, where, names, "array", value.shape, np.dtype(value.dtype).name)
        elif isinstance(value, np.ndarray | np.generic):
            value = np.asarray(value)
            if value.dtype == object:
                raise TypeError(
                    f"`state` leaf {_display(where)} is a NumPy array of Python objects, which "
                    "cannot be saved without pickle. Convert it to a numeric array."
                )
            leaf = _Leaf(index, where, names, "numpy", value.shape, value.dtype.name)
        elif type(value) in _PYTHON_KINDS:
            kind, dtype = _PYTHON_KINDS[type(value)]
            try:
                value = np.asarray(value, dtype=dtype)
            except OverflowError:
                raise ValueError(
                    f"`state` leaf {_display(where)} is the Python int {value}, which does not "
                    "fit in int64. Store it as a string in static metadata or split it."
                ) from None
            leaf = _Leaf(index, where, names, kind, (), dtype.name)
        else:
            continue  # structure (functions, strings, ...): comes back from the target
        leaves.append(leaf)
        values.append(value)
    _check_unique(leaves, "state")
    return leaves, values


def _nested(leaves: Sequence[_Leaf], values: Sequence[Any]) -> dict:
    """The nested dict orbax saves: one level per path entry, under `_ITEM_ROOT`. The names
    are unique (`_check_unique`) and a pytree leaf has no children, so nothing collides."""
    root: dict = {}
    for leaf, value in zip(leaves, values):
        node = root
        for name in leaf.names[:-1]:
            node = node.setdefault(name, {})
        node[leaf.names[-1]] = value
    return root


def _record(leaf: _Leaf, checksum: int | None) -> dict:
    record: dict[str, Any] = {
        "path": leaf.path,
        "kind": leaf.kind,
        "shape": list(leaf.shape),
        "dtype": leaf.dtype,
    }
    if leaf.impl is not None:
        record["impl"] = leaf.impl
    if checksum is not None:
        record["checksum"] = checksum
    return record


# ---------------------------------------------------------------------------------------------
# Restore plan: what each target leaf becomes


@dataclasses.dataclass(frozen=True)
class _TargetLeaf:
    leaf: _Leaf  # for PRNG keys, `impl` holds the target's key dtype as text, e.g. "key<fry>"
    value: Any  # the target's own leaf: decides the type handed back
    abstract: Any  # what orbax is asked for: a ShapeDtypeStruct with a sharding, or np.ndarray


def _sharding_overrides(shardings: PyTree, array_paths: set[str]) -> dict[str, Sharding]:
    flat, _ = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda node: node is None or isinstance(node, Sharding)
    )
    overrides: dict[str, Sharding] = {}
    for path, value in flat:
        where = path_to_str(path)
        if value is None:
            continue
        if not isinstance(value, Sharding):
            raise TypeError(
                f"`shardings` leaf {_display(where)} is {value!r}; expected a "
                "jax.sharding.Sharding such as NamedSharding(mesh, spec) (or None to keep the "
                "target's own)."
            )
        if where not in array_paths:
            raise ValueError(
                f"`shardings` gives a sharding for {_display(where)}, which is not a "
                "jax.Array or jax.ShapeDtypeStruct leaf of `target`. Give `shardings` the "
                "structure of `target` (None where there is nothing to place), or one Sharding "
                "for every array leaf."
            )
        overrides[where] = value
    return overrides


def _key_data_sharding(sharding: Sharding, where: str, extra_dims: int) -> Sharding:
    """The sharding of `jax.random.key_data(keys)` for keys placed with `sharding`."""
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = PartitionSpec(*sharding.spec, *([None] * extra_dims))
        return NamedSharding(sharding.mesh, spec)
    raise TypeError(
        f"the sharding of PRNG key leaf {_display(where)} is a {type(sharding).__name__}; give "
        "PRNG key leaves a NamedSharding or a SingleDeviceSharding."
    )


def _target_sharding(
    value: Any, where: str, overrides: dict[str, Sharding], common: Sharding | None
) -> Sharding:
    sharding = overrides.get(where) or common or getattr(value, "sharding", None)
    if sharding is None:
        if jax.process_count() > 1:
            raise ValueError(
                f"`target` leaf {_display(where)} has no sharding. With several processes every "
                "array leaf needs one: build the ShapeDtypeStruct with `sharding=...`, or pass "
                "`shardings=` to `restore`."
            )
        sharding = SingleDeviceSharding(jax.devices()[0])
    try:
        sharding.shard_shape(tuple(value.shape))
    except Exception as error:
        raise ValueError(
            f"`target` leaf {_display(where)} of shape {tuple(value.shape)} cannot be placed "
            f"with {sharding}: {error}"
        ) from None
    return sharding


def _restore_plan(target: PyTree, shardings: PyTree) -> tuple[list[_TargetLeaf], list, Any]:
    flat, treedef = _flatten(target)
    paths = [path_to_str(path) for path, _ in flat]
    array_paths = {
        where
        for where, (_, value) in zip(paths, flat)
        if isinstance(value, jax.Array | jax.ShapeDtypeStruct)
    }
    overrides: dict[str, Sharding] = {}
    common: Sharding | None = None
    if isinstance(shardings, Sharding):
        common = shardings
    elif shardings is not None:
        overrides = _sharding_overrides(shardings, array_paths)

    plan: list[_TargetLeaf] = []
    for index, ((path, value), where) in enumerate(zip(flat, paths)):
        names = (_ITEM_ROOT, *(key_to_str(k) for k in path))
        if isinstance(value, jax.Array | jax.ShapeDtypeStruct):
            sharding = _target_sharding(value, where, overrides, common)
            shape = tuple(value.shape)
            if _is_prng_key_dtype(value.dtype):
                data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, value.dtype))
                data_sharding = _key_data_sharding(sharding, where, data.ndim - len(shape))
                dtype = np.dtype(data.dtype).name
                leaf = _Leaf(index, where, names, "prng_key", data.shape, dtype, str(value.dtype))
                abstract = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data_sharding)
            else:
                leaf = _Leaf(index, where, names, "array", shape, np.dtype(value.dtype).name)
                abstract = jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)
        elif isinstance(value, np.ndarray | np.generic):
            array = np.asarray(value)
            leaf = _Leaf(index, where, names, "numpy", array.shape, array.dtype.name)
            abstract = np.empty(array.shape, array.dtype)
        elif type(value) in _PYTHON_KINDS:
            kind, dtype = _PYTHON_KINDS[type(value)]
            leaf = _Leaf(index, where, names, kind, (), dtype.name)
            abstract = np.empty((), dtype)
        else:
            continue
        plan.append(_TargetLeaf(leaf, value, abstract))
    _check_unique([entry.leaf for entry in plan], "target")
    return plan, [value for _, value in flat], treedef


def _key_dtype(impl: str) -> Any:
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def _finish(entry: _TargetLeaf, stored: Any, record: dict) -> Any:
    """The restored leaf, of the type the target holds at this position."""
    kind, value = entry.leaf.kind, entry.value
    if kind == "prng_key":
        return jax.random.wrap_key_data(stored, impl=record["impl"])
    if kind in _ARRAY_KINDS:
        if isinstance(value, np.generic):
            return np.asarray(stored)[()]
        if isinstance(value, np.ndarray):
            return np.asarray(stored)
        return stored
    return type(value)(np.asarray(stored).item())


# ---------------------------------------------------------------------------------------------
# Reading and checking what a step holds

_KNOWN_KINDS = ("array", "numpy", "prng_key", *(kind for kind, _ in _PYTHON_KINDS.values()))


def _valid_record(record: object) -> bool:
    if not isinstance(record, dict):
        return False
    shape = record.get("shape")
    return (
        isinstance(record.get("path"), str)
        and record.get("kind") in _KNOWN_KINDS
        and isinstance(shape, list)
        and all(isinstance(n, int) and n >= 0 for n in shape)
        and isinstance(record.get("dtype"), str)
        and isinstance(record.get("checksum", 0), int)
        and (record.get("kind") != "prng_key" or isinstance(record.get("impl"), str))
    )


def _reshapable(record: dict, leaf: _Leaf) -> bool:
    """A saved array that `restore(..., reshape=True)` reads and reshapes into `leaf`: same
    dtype, number of elements and last dimension, another shape. Stacks cut into pipeline
    stages differ only in their leading dimensions; requiring the same last dimension keeps a
    transposed or otherwise different layer (say `Linear(4, 8)` into `Linear(8, 4)`) a
    mismatch."""
    saved = tuple(record["shape"])
    return (
        record["kind"] in _ARRAY_KINDS
        and leaf.kind in _ARRAY_KINDS
        and record["dtype"] == leaf.dtype
        and saved != leaf.shape
        and int(np.prod(saved)) == int(np.prod(leaf.shape))
        and saved[-1:] == leaf.shape[-1:]
    )


def _read_as_saved(entry: _TargetLeaf, shape: tuple[int, ...]) -> Any:
    """What orbax is asked for to read a leaf that is reshaped afterwards: the saved shape,
    replicated over the devices of the target's sharding (or a NumPy array)."""
    if not isinstance(entry.abstract, jax.ShapeDtypeStruct):
        return np.empty(shape, entry.abstract.dtype)
    sharding = entry.abstract.sharding
    if isinstance(sharding, NamedSharding):
        replicated: Sharding = NamedSharding(sharding.mesh, PartitionSpec())
    else:
        devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
        replicated = NamedSharding(jax.sharding.Mesh(devices, ("devices",)), PartitionSpec())
    return jax.ShapeDtypeStruct(shape, entry.abstract.dtype, sharding=replicated)


def _reshape_to_target(entry: _TargetLeaf, stored: Any) -> Any:
    """A leaf read in its saved shape, reshaped (row-major) and placed like the target."""
    if not isinstance(entry.abstract, jax.ShapeDtypeStruct):
        return np.asarray(stored).reshape(entry.abstract.shape)
    shape, sharding = entry.abstract.shape, entry.abstract.sharding
    return jax.jit(lambda a: a.reshape(shape), out_shardings=sharding)(stored)


def _mismatches(
    records: Sequence[dict], plan: Sequence[_TargetLeaf], *, reshape: bool = False
) -> list[str]:
    """Every difference between the saved leaves and the target's, target order first (with
    `reshape`, an array of another shape but the same size and dtype is no difference)."""
    saved = {record["path"]: record for record in records}
    problems = []
    for entry in plan:
        leaf = entry.leaf
        where = _display(leaf.path)
        record = saved.get(leaf.path)
        if record is None:
            problems.append(
                f"{where} (missing leaf): the target has {_describe_kind(leaf.kind)} "
                f"there, the checkpoint has nothing"
            )
            continue
        kind = record["kind"]
        same_kind = kind == leaf.kind or (kind in _ARRAY_KINDS and leaf.kind in _ARRAY_KINDS)
        if not same_kind:
            problems.append(
                f"{where} (kind): the checkpoint holds {_describe_kind(kind, record.get('impl'))}, "
                f"the target {_describe_kind(leaf.kind, leaf.impl)}"
            )
            continue
        if kind == "prng_key":
            try:
                saved_dtype = _key_dtype(record["impl"])
            except Exception:
                saved_dtype = None
            if saved_dtype != entry.value.dtype:
                problems.append(
                    f"{where} (PRNG impl): the checkpoint holds {record['impl']} keys, the "
                    f"target {entry.value.dtype} keys"
                )
                continue
        if reshape and _reshapable(record, leaf):
            continue
        if tuple(record["shape"]) != leaf.shape:
            what = "key data shape" if kind == "prng_key" else "shape"
            problems.append(
                f"{where} ({what}): {tuple(record['shape'])} in the checkpoint, {leaf.shape} "
                "in the target"
            )
        elif record["dtype"] != leaf.dtype:
            problems.append(
                f"{where} (dtype): {record['dtype']} in the checkpoint, {leaf.dtype} in the target"
            )
    in_target = {entry.leaf.path for entry in plan}
    for record in records:
        if record["path"] not in in_target:
            problems.append(
                f"{_display(record['path'])} (extra leaf): the checkpoint has "
                f"{_describe_kind(record['kind'], record.get('impl'))} of shape "
                f"{tuple(record['shape'])} there, the target has no data leaf"
            )
    return problems


def _lookup(tree: Any, names: Sequence[str]) -> Any:
    for name in names:
        tree = tree[name]
    return tree


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The innermost cause of `error` (TensorStore's own account), on one line; the whole
    chain stays attached as `__cause__`."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(f"{type(error).__name__}: {error}".split())
    text = text.split(" [tensorstore_spec")[0]  # the full TensorStore spec is in the cause
    return text if len(text) <= limit else text[:limit] + " [...]"


_MAX_LISTED = 10


def _is_abandoned_orbax_read(unraisable: Any) -> bool:
    """An orbax read coroutine finalized unfinished, or TensorStore posting the result of an
    abandoned read to orbax's event loop after that loop has closed."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None:
        return _ORBAX_DIR in code.co_filename
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return (
        unraisable.object is None
        and isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed"
        and all(frame.filename.endswith(f"asyncio{os.sep}base_events.py") for frame in frames)
    )


class _QuietAbandonedReads:
    """An unraisable-exception hook that routes orbax's abandoned-read reports to the debug
    log and hands everything else to the hook it wraps."""

    def __init__(self, wrapped: Callable[[Any], object]):
        self.wrapped = wrapped

    def __call__(self, unraisable: Any) -> None:
        if _is_abandoned_orbax_read(unraisable):
            _orbax_log.debug("abandoned orbax read: %s", unraisable.exc_value)
            return
        self.wrapped(unraisable)


class _AbandonedOrbaxTasks(logging.Filter):
    """Route asyncio's "Task exception was never retrieved" records for orbax's abandoned
    read tasks to the `eqpar.checkpoint.orbax` debug log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exception was never retrieved" not in message:
            return True
        frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info else []
        if _ORBAX_DIR in message or any(_ORBAX_DIR in frame.filename for frame in frames):
            _orbax_log.debug("abandoned orbax task: %s", message)
            return False
        return True


_abandoned_task_filter = _AbandonedOrbaxTasks()


def _quiet_abandoned_reads() -> None:
    """Keep the reports of reads orbax abandons after a failed read out of the output.

    When one array read fails, orbax drops its other pending reads unfinished, and each
    reports "Exception ignored in: ..." whenever it is finalized, in whichever thread, often
    after the `CorruptCheckpointError` that already explains the failure; asyncio logs
    "Task exception was never retrieved" for the failed ones. From the first restore on, a
    hook wrapping whatever `sys.unraisablehook` is installed and a filter on the `asyncio`
    logger route exactly those reports (see `_is_abandoned_orbax_read` and
    `_AbandonedOrbaxTasks`) to the `eqpar.checkpoint.orbax` debug log and let everything
    else through unchanged.
    """
    if not isinstance(sys.unraisablehook, _QuietAbandonedReads):
        sys.unraisablehook = _QuietAbandonedReads(sys.unraisablehook)
    asyncio_logger = logging.getLogger("asyncio")
    if _abandoned_task_filter not in asyncio_logger.filters:
        asyncio_logger.addFilter(_abandoned_task_filter)


def _release_failed_reads(error: BaseException) -> None:
    """Finalize now the abandoned reads a failed restore's traceback still holds (their frames
    are cleared; file and line numbers stay)."""
    cause: BaseException | None = error
    while cause is not None:
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
        )
        gc.collect()


_WRAPPER_MODULES = ("jaxtyping", "beartype")


def _warn_caller(message: str) -> None:
    """`warnings.warn` attributed to the first frame outside this module and outside the
    runtime type-checking wrappers around it (jaxtyping, beartype)."""
    level = 1
    frame = sys._getframe(0)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        generated = frame.f_code.co_filename.startswith("<@beartype")
        if not (module == __name__ or module.startswith(_WRAPPER_MODULES) or generated):
            break
        frame = frame.f_back
        level += 1
    warnings.warn(message, UserWarning, stacklevel=level)


# ---------------------------------------------------------------------------------------------
# The public class


def _as_step(step: Any, argument: str = "step") -> int:
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(
            f"`{argument}` must be an integer (a Python int or an integer scalar array), got "
            f"{type(step).__name__}."
        ) from None
    if value < 0:
        raise ValueError(f"`{argument}` must be >= 0, got {value}.")
    return value


class Checkpointer:
    """Save and restore sharded training state in a directory of numbered steps.

    A thin layer over `orbax.checkpoint.CheckpointManager` for Equinox and Optax: `state` is
    any pytree (modules, optimizer states, dicts, tuples) and only its data is written: array
    leaves (`jax.Array`s, NumPy arrays, PRNG keys made with `jax.random.key`) and Python
    `bool`/`int`/`float`/`complex` leaves. Functions, strings and the static fields of modules
    are structure; `restore` takes them from its `target`. The module docstring of
    `eqpar.checkpoint` describes the on-disk format (JSON + TensorStore, no pickle), how a save
    is made atomic, and what counts as a damaged checkpoint.

    Every process of a multi-process job must create the `Checkpointer` with the same arguments
    and call `save`, `restore` and `close` together; each writes and reads only the blocks
    that live on its own devices.

    **Arguments:**

    - `directory`: where the steps go (`<directory>/<step>/`); created if missing.
    - `save_every`: `save` writes step `s` only when `s % save_every == 0` (and `s` is newer
      than the latest saved step); `force=True` overrides that, but an existing step is never
      overwritten. On clusters with JAX's preemption service, a step at which a preemption
      notice arrived is saved too.
    - `keep`: how many of the newest steps to keep; older ones are deleted after each
      successful save. `None` keeps every step.
    - `async_save`: write in a background thread after the device-to-host copy, so `save`
      returns sooner. `wait_until_finished`, `restore` and `close` wait for it; a step is listed
      by `all_steps` as soon as its save starts.
    - `checksums`: store a 32-bit position-weighted checksum of every leaf (computed on the
      devices that hold it, under `jax.jit`) and verify it on restore. It catches bytes altered
      in place, which TensorStore's own decoding does not notice. Sub-byte dtypes (int4, ...)
      are not checksummed.

    ```python
    import tempfile

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from eqpar.checkpoint import Checkpointer

    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    state = {"model": model, "step": 10, "key": jax.random.key(1)}
    with tempfile.TemporaryDirectory() as directory:
        with Checkpointer(directory, save_every=5, keep=2) as checkpointer:
            assert checkpointer.save(10, state)
            assert not checkpointer.save(12, state)  # 12 is not a multiple of 5
            target = {
                "model": eqx.filter_eval_shape(eqx.nn.MLP, 4, 2, 8, 1, key=jax.random.key(0)),
                "step": 0,
                "key": jax.random.key(0),
            }
            restored = checkpointer.restore(target=target)
        assert checkpointer.restored_step == 10 and restored["step"] == 10
        assert jnp.array_equal(restored["model"].layers[0].weight, model.layers[0].weight)
        key_data = jax.random.key_data
        assert jnp.array_equal(key_data(restored["key"]), key_data(state["key"]))
    ```
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int = 1,
        keep: int | None = None,
        async_save: bool = False,
        checksums: bool = True,
    ):
        if isinstance(save_every, bool) or save_every < 1:
            raise ValueError(f"`save_every` must be a positive int, got {save_every!r}.")
        if keep is not None and (isinstance(keep, bool) or keep < 1):
            raise ValueError(
                f"`keep` must be a positive int (or None to keep every step), got {keep!r}."
            )
        # orbax logs from its background threads too (cleanup, async writes): route its
        # records for as long as this Checkpointer is open (or alive, if never closed)
        _route_orbax_logs()
        self._stop_routing = weakref.finalize(self, _stop_routing_orbax_logs)
        self._closed = True  # until the manager exists
        try:
            self._open(directory, save_every, keep, async_save, checksums)
        except BaseException:
            self._stop_routing()
            raise
        self._closed = False

    def _open(
        self,
        directory: str | os.PathLike,
        save_every: int,
        keep: int | None,
        async_save: bool,
        checksums: bool,
    ) -> None:
        ocp = _orbax()
        from etils import epath  # orbax's path library: local paths, gs://, ...

        self._ocp = ocp
        text = os.fspath(directory)
        self._directory = epath.Path(text if "://" in text else os.path.abspath(text))
        if self._directory.exists() and not self._directory.is_dir():
            raise ValueError(f"`directory` {str(self._directory)!r} exists and is not a directory.")
        self._remove_unfinished_saves()
        self._save_every = save_every
        self._keep = keep
        self._async_save = async_save
        self._checksums = checksums
        self._restored_step: int | None = None
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(
                [
                    policies.FixedIntervalPolicy(save_every),
                    policies.save_decision_policy.PreemptionCheckpointingPolicy(),
                ]
            ),
            preservation_policy=policies.LatestN(keep),
            enable_async_checkpointing=async_save,
            # done by `_remove_unfinished_saves`, synchronously (orbax does it in a thread
            # that may still run after `close`)
            cleanup_tmp_directories=False,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self._directory, item_handlers=ocp.StandardCheckpointHandler(), options=options
        )

    def _remove_unfinished_saves(self) -> None:
        """Delete the `<step>.orbax-checkpoint-tmp` directories of saves that died midway.

        They are never listed as steps; this only tidies up (orbax also replaces such a
        directory when the same step is saved again). The primary process does it, before
        any save of this Checkpointer can start (orbax's save begins with a barrier).
        """
        if jax.process_index() != 0 or not self._directory.exists():
            return
        for child in self._directory.iterdir():
            if _TMP_SUFFIX in child.name and child.is_dir():
                child.rmtree()

    # -- properties -----------------------------------------------------------------------

    @property
    def directory(self) -> Any:
        """The absolute directory holding the steps (an `etils.epath.Path`, which behaves like
        a `pathlib.Path` and also reaches object stores such as `gs://...`)."""
        return self._directory

    @property
    def restored_step(self) -> int | None:
        """The step the last successful `restore` read (after any fallback), else `None`."""
        return self._restored_step

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self._directory)!r}, save_every={self._save_every}, "
            f"keep={self._keep}, async_save={self._async_save}, checksums={self._checksums})"
        )

    # -- listing --------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The finished (committed) steps in the directory, oldest first.

        **Arguments:** none.

        **Returns:** a sorted list of ints. Steps whose save died midway never appear; a
        committed step damaged afterwards does (restoring it raises `CorruptCheckpointError`).

        ```python
        import tempfile

        import jax.numpy as jnp
        from eqpar.checkpoint import Checkpointer

        with tempfile.TemporaryDirectory() as directory:
            with Checkpointer(directory, keep=2) as checkpointer:
                for step in range(4):
                    checkpointer.save(step, {"w": jnp.ones(2) * step})
                assert checkpointer.all_steps() == [2, 3]
        ```
        """
        self._check_open()
        return sorted(int(step) for step in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or `None` if there is none.

        **Arguments:** none.

        **Returns:** an int or `None`. `restore()` starts from this step and falls back to
        older ones only if it is damaged; `restored_step` tells which one it used.

        ```python
        import tempfile

        import jax.numpy as jnp
        from eqpar.checkpoint import Checkpointer

        with tempfile.TemporaryDirectory() as directory:
            with Checkpointer(directory) as checkpointer:
                assert checkpointer.latest_step() is None
                checkpointer.save(7, {"w": jnp.zeros(3)})
                assert checkpointer.latest_step() == 7
        ```
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: SupportsIndex) -> bool:
        """Whether `save(step, ...)` would write without `force`.

        **Arguments:**

        - `step`: the training step.

        **Returns:** `True` when `step` is a multiple of `save_every` (or a preemption notice
        arrived at this step) and is newer than `latest_step()`.

        ```python
        import tempfile

        from eqpar.checkpoint import Checkpointer

        with tempfile.TemporaryDirectory() as directory:
            with Checkpointer(directory, save_every=10) as checkpointer:
                assert [s for s in range(25) if checkpointer.should_save(s)] == [0, 10, 20]
        ```
        """
        self._check_open()
        step = _as_step(step)
        return bool(self._manager.should_save(step))

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: SupportsIndex, state: PyTree, *, force: bool = False) -> bool:
        """Write `state` as step `step`, if `should_save(step)` or `force`.

        Each process writes the blocks of the arrays on its own devices; nothing is gathered.
        The step appears in `all_steps()` only once every process has finished writing (in
        async mode: once the background write has started), and older steps beyond `keep` are
        deleted only after that.

        **Arguments:**

        - `step`: the training step (an int or an integer scalar array); becomes the
          directory name.
        - `state`: any pytree. Array leaves (sharded or not, including PRNG keys from
          `jax.random.key`) and Python `bool`/`int`/`float`/`complex` leaves are saved;
          other leaves are structure and are not.
        - `force`: save even if `should_save(step)` is false (e.g. at the end of training).

        **Returns:** whether a checkpoint was written. A step that already has a checkpoint
        is never overwritten, with or without `force`: `save` returns `False` for it (so a
        final `save(last_step, state, force=True)` after a loop that already saved that step
        is harmless).

        Raises `ValueError` if two leaves of `state` would be stored under the same name, and
        `TypeError` for leaves that cannot be saved without pickle (object arrays) or
        abstract ones (`jax.ShapeDtypeStruct`).

        ```python
        import tempfile

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from eqpar.checkpoint import Checkpointer

        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "model"))
        weight = jax.device_put(
            jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, PartitionSpec("pipe", "model"))
        )
        with tempfile.TemporaryDirectory() as directory:
            with Checkpointer(directory, save_every=100) as checkpointer:
                assert not checkpointer.save(7, {"weight": weight})
                assert checkpointer.save(7, {"weight": weight}, force=True)
                assert checkpointer.all_steps() == [7]
        ```
        """
        self._check_open()
        step = _as_step(step)
        if not force and not self.should_save(step):
            return False
        if step in self._manager.all_steps():
            return False  # never overwritten, forced or not
        leaves, values = _save_plan(state)
        if not leaves:
            raise ValueError(
                "`state` has no leaves to save: no arrays and no Python bool/int/float/complex "
                "leaves."
            )
        checksums = _digests(values) if self._checksums else [None] * len(values)
        metadata = {
            _FORMAT_KEY: {
                "version": _FORMAT_VERSION,
                "leaves": [_record(leaf, checksum) for leaf, checksum in zip(leaves, checksums)],
            }
        }
        item = _nested(leaves, values)
        saved = self._manager.save(
            step,
            args=self._ocp.args.StandardSave(item),
            custom_metadata=metadata,
            force=True,
        )
        return bool(saved)

    def wait_until_finished(self) -> None:
        """Block until a background (`async_save=True`) write has finished and is committed.

        **Arguments:** none. **Returns:** `None`. Re-raises an error of the background write.

        ```python
        import tempfile

        import jax.numpy as jnp
        from eqpar.checkpoint import Checkpointer

        with tempfile.TemporaryDirectory() as directory:
            checkpointer = Checkpointer(directory, async_save=True)
            checkpointer.save(0, {"w": jnp.ones(4)})
            checkpointer.wait_until_finished()
            assert checkpointer.all_steps() == [0]
            checkpointer.close()
        ```
        """
        self._check_open()
        self._manager.wait_until_finished()

    # -- restoring ------------------------------------------------------------------------

    def restore(
        self,
        step: SupportsIndex | None = None,
        *,
        target: PyTree,
        shardings: PyTree = None,
        reshape: bool = False,
    ) -> PyTree:
        """Read a step back into the structure and placement of `target`.

        **Arguments:**

        - `step`: the step to read. `None` reads `latest_step()`, and if that step is damaged
          warns and falls back to the newest step that restores cleanly.
        - `target`: a pytree with the structure of the saved state. Its array leaves say where
          the data goes: `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` (e.g. from
          `eqx.filter_eval_shape`, so nothing is allocated) or real arrays whose sharding is
          used; NumPy leaves come back as NumPy arrays; Python scalar leaves come back with
          the saved value and the target's type; every other leaf (functions, static
          fields, ...) is taken from `target` as is. The sharding may differ from the one
          the checkpoint was saved with (another mesh, layout or one device).
        - `shardings`: optional placement that takes precedence over the target's own: one
          `jax.sharding.Sharding` for every array leaf, or a pytree with the structure of
          `target` holding a `Sharding` (or `None`) per array leaf. An array leaf without any
          sharding goes to `jax.devices()[0]` in a single process, and is an error with
          several processes.
        - `reshape`: restore an array leaf whose saved shape differs from the target's but
          holds as many elements of the same dtype: it is read in its saved shape and
          reshaped row-major into the target's shape and sharding. This is what lets a stack
          of layers saved as `[S, L / S, ...]` by one pipeline layout load as
          `[V, S', L / (S' V), ...]` or `[L, ...]` (eqpar stores stacked layers in model order
          whatever the layout, so a reshape is the whole conversion). Without it such a leaf is
          a shape mismatch.

        **Returns:** a pytree with the structure of `target`. `restored_step` says which step
        it came from.

        Raises `FileNotFoundError` if the step (or any step) does not exist,
        `CheckpointMismatchError` naming the first mismatching leaf path if the checkpoint
        holds another structure (missing or extra leaves, kinds, shapes, dtypes, PRNG
        implementations), and `CorruptCheckpointError` naming the step and its path if the
        step is damaged (for `step=None`: if every step is).

        ```python
        import tempfile

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from eqpar.checkpoint import Checkpointer

        saved_mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "model"))
        weight = jax.device_put(
            jnp.arange(64.0).reshape(8, 8), NamedSharding(saved_mesh, P("pipe", "model"))
        )
        with tempfile.TemporaryDirectory() as directory:
            with Checkpointer(directory) as checkpointer:
                checkpointer.save(0, {"weight": weight})
                # restore onto 8 devices, rows sharded over a "data" axis
                new_mesh = Mesh(np.array(jax.devices()), ("data",))
                target = {
                    "weight": jax.ShapeDtypeStruct(
                        (8, 8), jnp.float32, sharding=NamedSharding(new_mesh, P("data"))
                    )
                }
                restored = checkpointer.restore(target=target)
        assert restored["weight"].sharding == NamedSharding(new_mesh, P("data"))
        np.testing.assert_array_equal(np.asarray(restored["weight"]), np.asarray(weight))
        ```
        """
        self._check_open()
        self.wait_until_finished()
        plan, target_leaves, treedef = _restore_plan(target, shardings)
        steps = self.all_steps()
        if step is not None:
            step = _as_step(step)
            if step not in steps:
                raise FileNotFoundError(
                    f"`step` {step}: there is no committed checkpoint for it in "
                    f"{self._directory}; committed steps: {steps or 'none'}."
                )
            try:
                restored = self._restore_step(step, plan, target_leaves, treedef, reshape)
            except CorruptCheckpointError as error:
                error.args = (
                    f"{error} Restore another step (`all_steps()` lists them) or call "
                    "`restore()` without `step` to fall back to the newest intact one.",
                )
                raise
            self._restored_step = step
            return restored
        if not steps:
            raise FileNotFoundError(
                f"There is no committed checkpoint in {self._directory} to restore. Check "
                "`latest_step()` is not None first (e.g. start from scratch when it is)."
            )
        failures: list[CorruptCheckpointError] = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(candidate, plan, target_leaves, treedef, reshape)
            except CorruptCheckpointError as error:
                failures.append(error)
                _warn_caller(f"{error} Falling back to an older step.")
                continue
            if failures:
                _warn_caller(
                    f"Restored step {candidate} from {self._directory}, not the newest step "
                    f"{steps[-1]}: steps {[f.step for f in failures]} are damaged and were "
                    "skipped (they are left on disk for inspection).",
                )
            self._restored_step = candidate
            return restored
        details = "\n".join(f"- {failure}" for failure in failures)
        raise CorruptCheckpointError(
            f"Every checkpoint in {self._directory} is damaged ({len(failures)} steps):\n{details}",
            step=None,
            path=str(self._directory),
        )

    def _restore_step(
        self,
        step: int,
        plan: list[_TargetLeaf],
        target_leaves: list,
        treedef: Any,
        reshape: bool = False,
    ) -> PyTree:
        step_dir = self._directory / str(step)

        def damaged(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"Checkpoint step {step} at {step_dir} is damaged: {why}.",
                step=step,
                path=str(step_dir),
            )

        records = self._read_records(step, step_dir, damaged)
        problems = _mismatches(records, plan, reshape=reshape)
        if problems:
            listed = "\n".join(f"- {problem}" for problem in problems[:_MAX_LISTED])
            more = len(problems) - _MAX_LISTED
            if more > 0:
                listed += f"\n- ... and {more} more"
            raise CheckpointMismatchError(
                f"Checkpoint step {step} at {step_dir} does not have the structure of "
                f"`target`; first mismatching leaf: {problems[0]}.\nAll {len(problems)} "
                f"differences:\n{listed}\nBuild `target` with the same model constructor, "
                "optimizer and metadata as the run that saved it (e.g. with "
                "`eqx.filter_eval_shape`).",
                step=step,
                path=str(step_dir),
            )
        saved = {record["path"]: record for record in records}
        reshaped = {
            entry.leaf.index
            for entry in plan
            if reshape and _reshapable(saved[entry.leaf.path], entry.leaf)
        }
        abstracts = [
            _read_as_saved(entry, tuple(saved[entry.leaf.path]["shape"]))
            if entry.leaf.index in reshaped
            else entry.abstract
            for entry in plan
        ]
        item = _nested([entry.leaf for entry in plan], abstracts)
        _quiet_abandoned_reads()
        try:
            restored = self._manager.restore(step, args=self._ocp.args.StandardRestore(item))
            stored = [_lookup(restored, entry.leaf.names) for entry in plan]
        except Exception as error:
            _release_failed_reads(error)
            raise damaged(f"reading its arrays failed ({_first_line(error)})") from error
        if any("checksum" in record for record in records):
            for entry, digest in zip(plan, _digests(stored)):
                expected = saved[entry.leaf.path].get("checksum")
                if expected is not None and digest is not None and digest != expected:
                    raise damaged(
                        f"leaf {_display(entry.leaf.path)} does not match its checksum "
                        f"(saved {expected}, read {digest}), so its array files were altered "
                        "after the save"
                    )
        leaves = list(target_leaves)
        for entry, value in zip(plan, stored):
            if entry.leaf.index in reshaped:
                value = _reshape_to_target(entry, value)
            leaves[entry.leaf.index] = _finish(entry, value, saved[entry.leaf.path])
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _read_records(
        self, step: int, step_dir: Any, damaged: Callable[[str], CorruptCheckpointError]
    ) -> list[dict]:
        step_file = step_dir / _STEP_METADATA_FILE
        item_file = step_dir / _ITEM_DIR / _ITEM_METADATA_FILE
        contents = {}
        for file in (step_file, item_file):
            if not file.is_file():
                raise damaged(f"its metadata file {file} is missing")
            try:
                contents[file] = json.loads(file.read_text())
            except (OSError, ValueError) as error:
                why = f"its metadata file {file} is unreadable ({_first_line(error)})"
                raise damaged(why) from error
        step_metadata = contents[step_file]
        custom = step_metadata.get("custom_metadata") if isinstance(step_metadata, dict) else None
        entry = custom.get(_FORMAT_KEY) if isinstance(custom, dict) else None
        if entry is None:
            raise CheckpointMismatchError(
                f"Checkpoint step {step} at {step_dir} was not written by eqpar.checkpoint (its "
                f"{step_file.name} has no `custom_metadata.{_FORMAT_KEY}` entry). Read it with "
                "orbax directly.",
                step=step,
                path=str(step_dir),
            )
        if not isinstance(entry, dict) or not isinstance(entry.get("version"), int):
            raise damaged(f"the `custom_metadata.{_FORMAT_KEY}` entry of {step_file} is malformed")
        if entry["version"] > _FORMAT_VERSION:
            raise CheckpointMismatchError(
                f"Checkpoint step {step} at {step_dir} uses eqpar checkpoint format version "
                f"{entry['version']}; this eqpar reads up to version {_FORMAT_VERSION}. Upgrade "
                "eqpar.",
                step=step,
                path=str(step_dir),
            )
        records = entry.get("leaves")
        if not isinstance(records, list) or not all(_valid_record(r) for r in records):
            raise damaged(f"the leaf list in {step_file} is malformed")
        return records

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for a background save to finish, then release orbax's resources. Idempotent.

        **Arguments:** none. **Returns:** `None`.

        ```python
        import tempfile

        import jax.numpy as jnp
        from eqpar.checkpoint import Checkpointer

        with tempfile.TemporaryDirectory() as directory:
            checkpointer = Checkpointer(directory, async_save=True)
            checkpointer.save(0, {"w": jnp.ones(2)})
            checkpointer.close()  # the write is committed when close returns
            checkpointer.close()
            assert Checkpointer(directory).all_steps() == [0]
        ```
        """
        if self._closed:
            return
        try:
            self._manager.wait_until_finished()
        finally:
            self._manager.close()
            self._closed = True
            self._stop_routing()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; create a new Checkpointer to use it again.")
