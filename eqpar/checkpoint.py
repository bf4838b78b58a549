"""Sharded checkpoints of Equinox/Optax training state: a thin, checked layer over orbax.

`Checkpointer` saves any pytree that mixes Equinox modules, Optax optimizer states and small
metadata (step counters, the data position, PRNG keys) as sharded arrays, and restores it
onto whatever mesh and layout the caller asks for.

**What orbax does.** Everything that is checkpoint mechanics is orbax-checkpoint's own,
configured through its documented options: `ocp.CheckpointManager` with
`ocp.args.StandardSave` / `StandardRestore` writes and reads the arrays (each process writes
the blocks on its own devices into its own `ocdbt.process_<i>` directory, each device reads
exactly the block its target sharding asks for, so a checkpoint restores onto any other mesh
or layout); atomic commit (a step is written into `<step>.orbax-checkpoint-tmp` and renamed
to `<step>` once complete); `save_decision_policy` (every `save_every` steps, and at a
preemption notice); `preservation_policy` (keep the newest `keep` steps); `todelete_subdir`
(an old step is removed by one rename out of the listing, so a kill midway never leaves a
half-deleted step listed); async writes; and the shapes and dtypes of what a step holds
(`item_metadata`).

**What eqpar adds, because orbax lacks it:**

- *Data checksums computed without gathering.* TensorStore notices missing and truncated
  files, not bytes altered in place. Each leaf gets a 32-bit checksum: every element's bits
  mixed with its position by a bijective hash, summed; computed under `jax.jit` where the data
  lives and independent of the sharding. Changing one element of up to 4 bytes always
  changes it. Steps of format version 2 (before eqpar's checksum rule 3) keep verifying by
  their own rule.
- *Fallback to the newest intact step, and quarantine.* orbax restores the step it is asked
  for or raises. `restore()` without a step tries the newest step, and on damage warns and
  falls back to older ones; the damaged steps it passed over are renamed aside to
  `<step>.damaged-<time>` (not a step name orbax lists), so saving goes on past them.
- *A mismatch report naming every differing leaf*, built from orbax's `item_metadata`
  (shapes, dtypes) and a small entry in the step's `custom_metadata` (`eqpar`: each leaf's
  `/`-joined path, kind, PRNG implementation, checksum and stacking depth, and the step
  number, which `restore` checks so that a step directory renamed or copied over another is
  refused). A leaf's recorded kind that contradicts its stored array is reported as such.
- *Failed saves cleaned up and reported once.* A save that fails (a full disk) removes the
  unfinished directory it created; an async save's error is raised once, by the next call
  that waits, and a retry starts afresh.
- *Never overwrite, and one writer.* A step that exists is never written again. The first
  `save` of a `Checkpointer` takes an exclusive `flock` on `<directory>/eqpar-writer.lock`
  (which records the writer's pid and host); a second writer is refused with a message naming
  the holder. The kernel releases the lock when the writer's process ends, even by SIGKILL,
  so a crashed writer never blocks the next one. Only the lock holder deletes unfinished
  `*.orbax-checkpoint-tmp` saves, so a reader (an eval job) never disturbs a save in progress.
  On object stores (`gs://...`), which have no locks, the single-writer rule is yours to keep.
- *A bounded barrier.* With several processes, `save` and `restore` first meet at a barrier
  with a timeout, so a call made on only some processes fails with a message, not a hang.

Nothing is pickled and loading never executes code from the checkpoint: metadata is JSON,
array bytes are decoded by TensorStore, and the Python structure is taken from `target`.

**Logging.** eqpar touches no logger and no interpreter hook. orbax logs through `absl`; to
quiet it, use absl's documented setting in your program:
`absl.logging.set_verbosity(absl.logging.WARNING)`.

Tested with orbax-checkpoint 0.12.8.
"""

import contextlib
import dataclasses
import functools
import math
import operator
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, SupportsIndex

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import GetAttrKey

from ._checksums import CHECKSUM_RULE, digest
from ._paths import key_to_str, path_to_str
from ._specs import show_spec
from ._typing import PyTree

__all__ = [
    "CheckpointMismatchError",
    "Checkpointer",
    "CorruptCheckpointError",
]

_FORMAT_KEY = "eqpar"  # our entry in the step's `custom_metadata`
# 2: shapes and dtypes come from orbax's metadata; the step is recorded. 3: checksum rule 3
# (see "Checksums"; version 2 steps still verify by rule 2) and each leaf's stacking depth.
_FORMAT_VERSION = CHECKSUM_RULE  # a format version writes the checksums of its rule
_ITEM_ROOT = "state"  # the saved nested dict is `{"state": {...}}`, so a root leaf has a name
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step file, named in messages only
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step directory being written
_TRASH = "eqpar-deleting"  # orbax's `todelete_subdir`: old steps are renamed here, then purged
_LOCK = "eqpar-writer.lock"
_MAX_LISTED = 10  # differences listed in a mismatch report

_PYTHON_KINDS: dict[type, tuple[str, np.dtype]] = {
    bool: ("bool", np.dtype(np.bool_)),
    int: ("int", np.dtype(np.int64)),
    float: ("float", np.dtype(np.float64)),
    complex: ("complex", np.dtype(np.complex128)),
}
_ARRAY_KINDS = ("array", "numpy")  # interchangeable: device array <-> host array


class _StepError(ValueError):
    def __init__(self, message: str, *, step: int | None = None, path: str | None = None):
        super().__init__(message)
        self.step, self.path = step, path


def _damaged(step: int, step_dir: PyTree, why: str) -> "CorruptCheckpointError":
    message = f"Checkpoint step {step} at {step_dir} is damaged: {why}."
    return CorruptCheckpointError(message, step=step, path=str(step_dir))


class CorruptCheckpointError(_StepError):
    """A checkpoint step exists but cannot be read back intact.

    Raised by `Checkpointer.restore` for missing, unreadable or malformed metadata files,
    missing or truncated array files, checksum mismatches and a step directory that holds
    another step.

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


class CheckpointMismatchError(_StepError):
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


# ---------------------------------------------------------------------------------------------
# orbax, imported lazily (an optional dependency, and slow to import)


def _orbax() -> PyTree:
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "eqpar.checkpoint needs orbax: `pip install eqpar[checkpoint]` (from a checkout: "
            "`pip install -e '.[checkpoint]'`)."
        ) from error
    return ocp


# ---------------------------------------------------------------------------------------------
# Leaves: what is saved, and what each target leaf becomes


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One saved (or to-be-restored) leaf: where it sits and how it is stored."""

    index: int  # position among the flattened leaves of the whole tree
    path: str  # `/`-joined, for messages and the JSON record
    names: tuple[str, ...]  # keys of the nested dict handed to orbax
    kind: str  # "array" | "numpy" | "prng_key" | "bool" | "int" | "float" | "complex"
    shape: tuple[int, ...]  # as stored (PRNG keys: the shape of their key data)
    dtype: str  # as stored, `np.dtype(...).name`
    impl: str | None  # PRNG implementation (in a target: its key dtype as text)
    value: PyTree  # the state's or target's own leaf
    stacked: int = 0  # leading stacking dimensions (`_stacking_depths`); the rest is one layer


def _display(path: str) -> str:
    return f"`{path}`" if path else "the root leaf"


def _describe(kind: str, impl: str | None = None) -> str:
    if kind == "prng_key":
        return f"a PRNG key array (impl {impl})"
    return {"array": "a jax array", "numpy": "a NumPy array"}.get(kind, f"a Python {kind}")


def _stacking_depths(tree: PyTree) -> dict[str, int]:
    """For each leaf inside eqpar's layer stacks, how many of its leading dimensions stack
    layers: one for the `layers` of a `ScannedLayers`, one (`[S, ...]`) or two
    (`[V, S, ...]`) for the `stages` of a `PipelineModule`, added up where they nest. The
    dimensions after them are one layer's; `restore(reshape=True)` may change only the
    stacking ones. Leaves outside any stack are left out (depth 0)."""
    from .nn.pipeline import PipelineModule
    from .nn.stacks import ScannedLayers

    stacks = (ScannedLayers, PipelineModule)
    depths: dict[str, int] = {}

    def walk(node: PyTree, prefix: tuple, depth: int) -> None:
        if isinstance(node, ScannedLayers):
            walk(node.layers, (*prefix, GetAttrKey("layers")), depth + 1)
        elif isinstance(node, PipelineModule):
            inner = 1 if node.num_repeats == 1 else 2
            walk(node.stages, (*prefix, GetAttrKey("stages")), depth + inner)
        else:
            is_stack = lambda x: x is not node and isinstance(x, stacks)
            for path, child in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_stack)[0]:
                if isinstance(child, stacks):
                    walk(child, (*prefix, *path), depth)
                elif depth:
                    depths[path_to_str((*prefix, *path))] = depth

    walk(tree, (), 0)
    return depths


def _leaves(tree: PyTree, argument: str) -> tuple[list[_Leaf], list, Any]:
    """The data leaves of `tree` (arrays, PRNG keys, Python scalars), all its leaves and its
    structure. Two leaves must not land on the same name, neither as `/`-joined paths (keys
    `"a/b"` and `"a"` -> `"b"`) nor as orbax's `.`-joined parameter names (`"a.b"`)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, seen, depths = [], {}, _stacking_depths(tree)
    for index, (path, value) in enumerate(flat):
        where, names = path_to_str(path), (_ITEM_ROOT, *(key_to_str(k) for k in path))
        impl, host = None, isinstance(value, np.ndarray | np.generic)
        if host or isinstance(value, jax.Array | jax.ShapeDtypeStruct):
            kind, shape, dtype = "numpy" if host else "array", tuple(value.shape), value.dtype
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                data = jax.eval_shape(jax.random.key_data, value)
                kind, shape, dtype, impl = "prng_key", data.shape, data.dtype, str(value.dtype)
        elif type(value) in _PYTHON_KINDS:
            (kind, dtype), shape = _PYTHON_KINDS[type(value)], ()
        else:
            continue  # structure (functions, strings, ...): comes back from the target
        stacked = depths.get(where, 0) if kind in _ARRAY_KINDS else 0
        dtype = np.dtype(dtype).name
        leaves.append(_Leaf(index, where, names, kind, shape, dtype, impl, value, stacked))
        for key in ("/" + where, "." + ".".join(names)):
            if key in seen:
                raise ValueError(
                    f"`{argument}` has two leaves that would be stored under the same name "
                    f"{key[1:]!r}: {_display(seen[key])} and {_display(where)}. Rename one."
                )
            seen[key] = where
    return leaves, [value for _, value in flat], treedef


def _saved_value(leaf: _Leaf) -> PyTree:
    """What orbax stores for a leaf of `state`, after checking it can be stored."""
    value, where = leaf.value, _display(leaf.path)
    wrong_type = (
        "a jax.ShapeDtypeStruct, which has no data (abstract leaves go in `restore(target=...)`)"
        if isinstance(value, jax.ShapeDtypeStruct)
        else "a NumPy array of Python objects, which cannot be saved without pickle"
        if leaf.dtype == "object"
        else "a PRNG key of an unregistered impl"
        if leaf.kind == "prng_key" and not isinstance(jax.random.key_impl(value), str)
        else None
    )
    if wrong_type:
        raise TypeError(f"`state` leaf {where} is {wrong_type}.")
    if leaf.kind in _ARRAY_KINDS and (fix := _unstorable(np.dtype(value.dtype))):
        raise TypeError(
            f"`state` leaf {where} has dtype {leaf.dtype}, which orbax's array storage "
            f"(TensorStore) cannot write. Save it as {fix}, and convert it back after "
            "restoring. Nothing was written."
        )
    wrong_value = (
        "is a deleted jax.Array (donated to a jitted function, or `.delete()`d). Save the arrays "
        "the step returned instead"
        if isinstance(value, jax.Array) and value.is_deleted()
        else f"has shape {leaf.shape}, with no elements, which orbax cannot save. Leave it out"
        if 0 in leaf.shape
        else None
    )
    if wrong_value:
        raise ValueError(f"`state` leaf {where} {wrong_value}.")
    if leaf.kind in ("array", "prng_key"):
        return jax.random.key_data(leaf.value) if leaf.kind == "prng_key" else value
    try:
        return np.asarray(value, dtype=leaf.dtype)
    except OverflowError:
        raise ValueError(f"`state` leaf {where}: the int {value} does not fit in int64.") from None


def _unstorable(dtype: np.dtype) -> str | None:
    """`None` if TensorStore, which writes orbax's arrays, has `dtype`; else what to save
    instead. (Asked up front: orbax's own error comes from the write and names no leaf.)"""
    import tensorstore  # orbax's storage library, installed with it

    try:
        tensorstore.dtype(dtype.name)
        return None
    except ValueError:
        pass
    for family, instead in ((jnp.unsignedinteger, "uint8"), (jnp.integer, "int8")):
        if jnp.issubdtype(dtype, family):
            return f"{instead} (`x.astype(jnp.{instead})`: every {dtype.name} value fits)"
    if jnp.issubdtype(dtype, jnp.floating):
        return f"float32 (`x.astype(jnp.float32)`: every {dtype.name} value is exact in it)"
    if dtype.kind in "mM":
        return "int64 (`x.view(np.int64)`; keep the unit yourself)"
    return "a numeric array, e.g. its bytes as uint8 (`np.frombuffer(x.tobytes(), np.uint8)`)"


def _record(leaf: _Leaf, checksum: int | None) -> dict:
    record: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind, "checksum": checksum}
    if leaf.kind == "prng_key":
        record["impl"] = jax.random.key_impl(leaf.value)
    record["stacked"] = leaf.stacked or None
    return {key: value for key, value in record.items() if value is not None}


def _shardings(shardings: PyTree, leaves: Sequence[_Leaf]) -> dict[str, Any]:
    """`restore(shardings=...)`: the sharding it gives each array leaf path."""
    arrays = [leaf.path for leaf in leaves if leaf.kind in ("array", "prng_key")]
    if shardings is None or isinstance(shardings, Sharding):
        return dict.fromkeys(arrays, shardings)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda node: node is None or isinstance(node, Sharding)
    )
    given = {path_to_str(path): value for path, value in flat if value is not None}
    for where, value in given.items():
        if not isinstance(value, Sharding) or where not in arrays:
            shown = show_spec(value) if isinstance(value, P) else repr(value)
            raise (ValueError if isinstance(value, Sharding) else TypeError)(
                f"`shardings` leaf {_display(where)} is {shown}, but expected a Sharding (or "
                "None) at an array leaf of `target`: give `shardings` the structure of `target`."
            )
    return given


def _placement(leaf: _Leaf, given: dict[str, Any]) -> PyTree:
    """What orbax is asked for: a ShapeDtypeStruct with the target's sharding (key data: the
    same sharding, whose spec leaves the extra dimension whole), or a NumPy array."""
    if leaf.kind not in ("array", "prng_key"):
        return np.empty(leaf.shape, leaf.dtype)
    where, shape = _display(leaf.path), tuple(leaf.value.shape)
    sharding = given.get(leaf.path) or getattr(leaf.value, "sharding", None)
    if sharding is None and jax.process_count() > 1:
        raise ValueError(
            f"`target` leaf {where} has no sharding. With several processes every array leaf "
            "needs one: build the ShapeDtypeStruct with `sharding=...`, or pass `shardings=`."
        )
    sharding = sharding or SingleDeviceSharding(jax.devices()[0])
    try:
        sharding.shard_shape(shape)
        sharding.shard_shape(leaf.shape)
    except Exception as error:
        raise ValueError(
            f"`target` leaf {where} of shape {shape} cannot be placed with {sharding}: {error}"
        ) from None
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _finish(leaf: _Leaf, stored: PyTree, record: dict) -> PyTree:
    """The restored leaf, of the type the target holds at this position."""
    if leaf.kind in ("array", "prng_key"):
        impl = record.get("impl")
        return jax.random.wrap_key_data(stored, impl=impl) if impl else stored
    if leaf.kind == "numpy":
        return np.asarray(stored)[()] if isinstance(leaf.value, np.generic) else np.asarray(stored)
    return type(leaf.value)(np.asarray(stored).item())


# ---------------------------------------------------------------------------------------------
# Reading and checking what a step holds

_KNOWN_KINDS = ("array", "numpy", "prng_key", *(kind for kind, _ in _PYTHON_KINDS.values()))


def _valid_record(record: object) -> bool:
    return (
        isinstance(record, dict)
        and isinstance(record.get("path"), str)
        and record.get("kind") in _KNOWN_KINDS
        and isinstance(record.get("checksum", 0), int)
        and isinstance(record.get("stacked", 0), int)
        and not isinstance(record.get("stacked", 0), bool)
        and record.get("stacked", 0) >= 0
        and (record.get("kind") != "prng_key" or isinstance(record.get("impl"), str))
    )


def _reshapable(record: dict, leaf: _Leaf) -> bool:
    """A saved array that `restore(..., reshape=True)` reads and reshapes into `leaf`: same
    dtype and number of elements, another shape, and the same shape of one layer
    (`_reshape_conflict`)."""
    return _same_size(record, leaf) and _reshape_conflict(record, leaf) is None


def _same_size(record: dict, leaf: _Leaf) -> bool:
    """Arrays of the same dtype and number of elements but another shape."""
    saved = record["shape"]
    return (
        {record["kind"], leaf.kind} <= set(_ARRAY_KINDS)
        and record["dtype"] == leaf.dtype
        and saved != leaf.shape
        and math.prod(saved) == math.prod(leaf.shape)
    )


def _reshape_conflict(record: dict, leaf: _Leaf) -> str | None:
    """Why `reshape=True` does not apply to a saved array of the target's size, or `None`.
    It is for a stack of the same layers under another stacking (pipeline stages and
    repeats): only the leading stacking dimensions may differ, and one layer's shape (the
    dimensions after them) must be the same. The target says where its layers start (its
    `ScannedLayers` / `PipelineModule`), and so does the checkpoint where it recorded it."""
    if not leaf.stacked:
        return (
            "`reshape=True` changes only the stacking dimensions of layers in a ScannedLayers "
            "or PipelineModule, and this target leaf is not in one"
        )
    saved, layer = record["shape"], leaf.shape[leaf.stacked :]
    if "stacked" in record:
        saved_layer = saved[record["stacked"] :]
    else:  # saved outside eqpar's stacks, or by a version that did not record it
        saved_layer = saved[len(saved) - len(layer) :] if len(saved) >= len(layer) else saved
    if saved_layer == layer:
        return None
    return (
        f"one layer is {saved_layer} in the checkpoint but {layer} in the target, and "
        "`reshape=True` changes only the stacking dimensions: these are other layers"
    )


def _replicated(abstract: PyTree, shape: tuple[int, ...]) -> PyTree:
    """What orbax is asked for to read a leaf that is reshaped afterwards: the saved shape,
    replicated over the devices of the target's sharding (or a NumPy array)."""
    if not isinstance(abstract, jax.ShapeDtypeStruct):
        return np.empty(shape, abstract.dtype)
    sharding = abstract.sharding
    devices = np.array(sorted(sharding.device_set, key=lambda device: device.id))
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else Mesh(devices, ("d",))
    return jax.ShapeDtypeStruct(shape, abstract.dtype, sharding=NamedSharding(mesh, P()))


def _reshaped(abstract: PyTree, stored: PyTree) -> PyTree:
    """A leaf read in its saved shape, reshaped (row-major) and placed like the target."""
    if not isinstance(abstract, jax.ShapeDtypeStruct):
        return np.asarray(stored).reshape(abstract.shape)
    return jax.jit(lambda a: a.reshape(abstract.shape), out_shardings=abstract.sharding)(stored)


def _mismatches(saved: dict[str, dict], plan: Sequence[_Leaf], reshape: bool) -> list[str]:
    """Every difference between the saved leaves and the target's, target order first (with
    `reshape`, the same layers stacked another way are no difference: `_reshapable`)."""
    problems = []
    for leaf in plan:
        record = saved.get(leaf.path)
        if record is None:
            problem = f"(missing leaf): the target has {_describe(leaf.kind)}, the checkpoint none"
        elif record["kind"] != leaf.kind and {record["kind"], leaf.kind} - set(_ARRAY_KINDS):
            problem = (
                f"(kind): the checkpoint holds {_describe(record['kind'], record.get('impl'))}, "
                f"the target {_describe(leaf.kind, leaf.impl)}"
            )
        elif leaf.kind == "prng_key" and _key_dtype(record["impl"]) != leaf.value.dtype:
            problem = f"(PRNG impl): the checkpoint holds {record['impl']}, the target {leaf.impl}"
        elif record["shape"] != leaf.shape and not (reshape and _reshapable(record, leaf)):
            what = "key data shape" if leaf.kind == "prng_key" else "shape"
            problem = f"({what}): {record['shape']} in the checkpoint, {leaf.shape} in the target"
            if reshape and _same_size(record, leaf):
                problem += f"; {_reshape_conflict(record, leaf)}"
        elif record["dtype"] != leaf.dtype:
            problem = f"(dtype): {record['dtype']} in the checkpoint, {leaf.dtype} in the target"
        else:
            continue
        problems.append(f"{_display(leaf.path)} {problem}")
    in_target = {leaf.path for leaf in plan}
    return problems + [
        f"{_display(path)} (extra leaf): the checkpoint has {_describe(r['kind'], r.get('impl'))} "
        f"of shape {r['shape']} there, the target has no data leaf"
        for path, r in saved.items()
        if path not in in_target
    ]


# Where eqpar keeps a list of blocks stacked (`PipelinedBlocks`, `PipelineModule`): the leaf
# paths of a parallelized model that its plain twin does not have.
_STACKED = ("pipeline/stages/", "stages/layers/")


def _structure_fix(saved: dict[str, dict], plan: Sequence[_Leaf]) -> str:
    """The fix a mismatch message ends with; where the leaves differ by path between a model
    parallelized by a plan and its plain twin, which structure to restore into."""
    in_target = {leaf.path for leaf in plan}
    only_saved = [path for path in saved if path not in in_target]
    only_target = [path for path in in_target if path not in saved]
    stacked = lambda paths: any(marker in path for path in paths for marker in _STACKED)
    if only_saved and only_target and (stacked(only_saved) or stacked(only_target)):
        if stacked(only_saved):
            return (
                "The checkpoint holds a parallelized model (its pipelined blocks stored "
                "stacked) and `target` a plain one: restore into the parallelized structure, "
                "`eqpar.parallelize(eqx.filter_eval_shape(Model, ...), plan)` with the plan it "
                "was saved under (pass `shardings=` or give its ShapeDtypeStructs a sharding; "
                "`eqpar.unparallelize` the result for the plain model), or save "
                "`eqpar.unparallelize(model)` instead, which plain targets restore."
            )
        return (
            "`target` is a parallelized model (its pipelined blocks stored stacked) but the "
            "checkpoint holds a plain one: restore into the plain structure "
            "(`eqx.filter_eval_shape(Model, ...)`) and `eqpar.parallelize` the result, or "
            "save the parallelized model."
        )
    return "Build `target` like the state that was saved (same constructors)."


def _kind_contradiction(record: dict) -> str | None:
    """How a saved leaf's recorded kind contradicts the array orbax stored for it, or `None`.
    A Python scalar is stored as a 0-d array of its NumPy dtype, a PRNG key as its key data;
    an array can be anything."""
    kind, shape, dtype = record["kind"], record["shape"], record["dtype"]
    stored = f"but its stored array is {dtype} of shape {shape}"
    scalars = {name: np.dtype(storage).name for name, storage in _PYTHON_KINDS.values()}
    if kind in scalars and (shape, dtype) != ((), scalars[kind]):
        return f"is {_describe(kind)} (stored as a 0-d {scalars[kind]} array), {stored}"
    if kind == "prng_key":
        try:
            data = jax.eval_shape(
                lambda: jax.random.key_data(jax.random.key(0, impl=record["impl"]))
            )
        except Exception:
            return None  # an implementation unknown here: the target comparison reports it
        rank, key = len(data.shape), np.dtype(data.dtype).name
        if dtype != key or len(shape) < rank or shape[len(shape) - rank :] != data.shape:
            return (
                f"is {_describe(kind, record['impl'])}, whose key data is {key} ending in "
                f"{data.shape}, {stored}"
            )
    return None


def _key_dtype(impl: str) -> PyTree:
    try:
        return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    except Exception:
        return None


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The innermost cause of `error` (TensorStore's own account), on one line; the whole
    chain stays attached as `__cause__`."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(f"{type(error).__name__}: {error}".split()).split(" [tensorstore_spec")[0]
    return text if len(text) <= limit else text[:limit] + " [...]"


def _warn_caller(message: str) -> None:
    """`warnings.warn` attributed to the first frame outside this module and outside the
    runtime type-checking wrappers around it (jaxtyping, beartype)."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith((__name__, "jaxtyping", "beartype"))
        or frame.f_code.co_filename.startswith("<@beartype")
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


# ---------------------------------------------------------------------------------------------
# Arguments, the writer lock


def _as_step(value: PyTree, argument: str = "step", minimum: int = 0, hint: str = "") -> int:
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None:
        raise TypeError(
            f"`{argument}` must be an integer (a Python int or an integer scalar array){hint}, "
            f"got {type(value).__name__} {value!r}."
        )
    if number < minimum:
        rule = "a positive int" if minimum else ">= 0"
        raise ValueError(f"`{argument}` must be {rule}{hint}, got {number}.")
    return number


def _take_lock(lock: str) -> PyTree:
    """Hold `lock` with an exclusive `flock` and record this process's pid and host in it.
    The kernel releases the lock when its holder exits, however it exits, so a dead writer
    leaves no stale lock; a live holder is refused. Returns the open file: closing it releases
    the lock (the file itself stays, so no second writer can lock a file about to vanish)."""
    import fcntl  # POSIX only, like the multi-process runs it guards

    file = open(lock, "a+")  # held open for as long as this writer lives
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        file.seek(0)
        holder = file.read().strip() or "a process that has not yet written its name"
        file.close()
        raise RuntimeError(
            f"Another Checkpointer writes to {os.path.dirname(lock)}: its lock {lock} is held "
            f"by {holder}. One directory has one writer; readers need no lock."
        ) from None
    file.truncate(0)
    file.write(f"pid {os.getpid()} on host {socket.gethostname()}")
    file.flush()
    return file


# ---------------------------------------------------------------------------------------------
# The public class


class Checkpointer:
    """Save and restore sharded training state in a directory of numbered steps.

    A thin layer over `orbax.checkpoint.CheckpointManager` for Equinox and Optax: `state` is
    any pytree (modules, optimizer states, dicts, tuples) and only its data is written: array
    leaves (`jax.Array`s, NumPy arrays, PRNG keys made with `jax.random.key`) and Python
    `bool`/`int`/`float`/`complex` leaves. Functions, strings and the static fields of modules
    are structure; `restore` takes them from its `target`. The module docstring of
    `eqpar.checkpoint` says what orbax does and what eqpar adds (checksums, the fallback to an
    intact step and quarantine, the mismatch report, never-overwrite and the writer lock).

    Every process of a multi-process job must create the `Checkpointer` with the same arguments
    and call `save`, `restore` and `close` together; each writes and reads only the blocks
    that live on its own devices. One `Checkpointer` is used by one thread at a time; a
    second thread calling in meanwhile gets a `RuntimeError`.

    **Arguments:**

    - `directory`: where the steps go (`<directory>/<step>/`); created if missing.
    - `save_every`: `save` writes step `s` only when `s % save_every == 0` (and `s` is newer
      than the latest saved step); `force=True` overrides that, but an existing step is never
      overwritten. On clusters with JAX's preemption service, a step at which a preemption
      notice arrived is saved too.
    - `keep`: how many of the newest steps to keep; older ones are removed after each
      successful save. `None` keeps every step.
    - `async_save`: write in a background thread after the device-to-host copy, so `save`
      returns sooner. `wait_until_finished`, `restore`, `close` and the next `save` wait for
      it (and raise its error, once).
    - `checksums`: store a checksum of every leaf and verify it on restore (see the module
      docstring). Sub-byte dtypes (int4, ...) are not checksummed.
    - `timeout`: seconds `save` and `restore` wait at their barrier for the other processes
      of a multi-process job before failing. Orbax's own barriers inside a save or restore
      (of JAX's coordination service here, not collectives) wait at most 300 s, which orbax
      does not let us set.

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
        timeout: float | int = 300.0,
    ):
        self._save_every = _as_step(save_every, "save_every", 1)
        hint = " (or None to keep every step)"
        self._keep = None if keep is None else _as_step(keep, "keep", 1, hint)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout!r}.")
        self._ocp = _orbax()
        from etils import epath  # orbax's path library: local paths, gs://, ...

        text = os.fspath(directory)
        self._directory = epath.Path(text if "://" in text else os.path.abspath(text))
        if self._directory.exists() and not self._directory.is_dir():
            raise ValueError(f"`directory` {str(self._directory)!r} exists and is not a directory.")
        self._async_save, self._checksums, self._timeout = async_save, checksums, timeout
        self._restored_step: int | None = None
        self._unlock: PyTree = None  # set once this Checkpointer holds the writer lock
        self._busy, self._barriers, self._closed = threading.Lock(), 0, False
        # The step a background save is writing, and the unfinished directories of that step
        # that were there before it began (which are not its own).
        self._pending: tuple[int, frozenset[str]] | None = None
        if jax.process_count() > 1:
            # Orbax creates the directory only alone (see `_open_manager`): every process
            # makes it if missing, with no barrier, so that opening a Checkpointer never waits
            # for the others (a process may open one more, e.g. to list the steps of a
            # directory that another process has just created).
            self._directory.mkdir(parents=True, exist_ok=True)
        self._manager = self._open_manager()

    def _open_manager(self) -> PyTree:
        ocp, policies = self._ocp, self._ocp.checkpoint_managers
        every = policies.FixedIntervalPolicy(self._save_every)
        preempted = policies.save_decision_policy.PreemptionCheckpointingPolicy()
        processes: dict[str, Any] = {}
        if jax.process_count() > 1:
            # Orbax's own barriers are collectives (a psum over every device) unless told the
            # processes: with 2 CPU cores and 4 devices a process, one process was measured
            # still waiting in that psum 49 s after its peer had left it, which then failed
            # the peer's first training step at Gloo's 30 s start-up limit. Naming every
            # process makes each of them a barrier of JAX's coordination service instead (no
            # device work, and a timeout of orbax's own, 300 s); orbax then leaves creating
            # the directory to us (`__init__`). Orbax opens a manager with no barrier then.
            every_process = set(range(jax.process_count()))
            processes = dict(
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    active_processes=every_process
                ),
                create=False,
            )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy([every, preempted]),
            preservation_policy=policies.LatestN(self._keep),
            enable_async_checkpointing=self._async_save,
            todelete_subdir=_TRASH,
            lightweight_initialize=True,  # a step with damaged metadata must not stop opening
            cleanup_tmp_directories=False,  # only the lock holder removes unfinished saves
            **processes,
        )
        handler = ocp.StandardCheckpointHandler()
        return ocp.CheckpointManager(self._directory, item_handlers=handler, options=options)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        self._check_open()
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{self!r} is in use by another thread. A Checkpointer is used by one thread at "
                "a time: serialize the calls, or give each thread its own reader."
            )
        try:
            yield
        finally:
            self._busy.release()

    def _barrier(self, name: str) -> None:
        """Meet the other processes, or fail after `timeout` seconds (a no-op alone)."""
        if jax.process_count() == 1:
            return
        self._barriers += 1
        key = f"eqpar:{self._directory}:{name}:{self._barriers}"
        try:
            self._ocp.multihost.get_barrier_sync_fn()(key=key, timeout_ms=int(self._timeout * 1e3))
        except Exception as error:
            raise RuntimeError(
                f"`{name}` waited {self._timeout} s for the other processes and not all of "
                f"them came (process {jax.process_index()} of {jax.process_count()}). Every "
                f"process must call `{name}` with the same step, together. ({_first_line(error)})"
            ) from error

    def _become_writer(self) -> None:
        """Take the writer lock (primary process), then remove what dead writers left."""
        if self._unlock is not None or jax.process_index() != 0:
            return
        lock = os.fspath(self._directory / _LOCK)
        file = _take_lock(lock) if "://" not in lock else None
        self._unlock = weakref.finalize(self, file.close if file else lambda: None)
        self._purge(unfinished=True)

    def _unfinished(self, step: int) -> frozenset[str]:
        """The names of the unfinished (`*.orbax-checkpoint-tmp`) directories of `step`."""
        prefix = f"{step}{_TMP_SUFFIX}"
        return frozenset(c.name for c in self._directory.iterdir() if c.name.startswith(prefix))

    def _save_failed(
        self, step: int, before: frozenset[str], error: BaseException, background: bool
    ) -> None:
        """After a failed save of `step`: remove the unfinished directories that save created
        (the writer only; not those that were there before it began) and say so in a note
        on `error`, which the caller raises."""
        removed = sorted(self._unfinished(step) - before) if self._unlock is not None else []
        for name in removed:
            (self._directory / name).rmtree(missing_ok=True)
        what = "The background save" if background else "Saving"
        cleaned = f"; its unfinished directory {', '.join(removed)} was removed" if removed else ""
        error.add_note(
            f"eqpar.checkpoint: {what} of step {step} to {self._directory} failed with this "
            f"error, so step {step} was not committed{cleaned}. The steps saved before it are "
            "intact. This error is reported once: fix its cause (e.g. free disk space) and "
            "save again."
        )

    def _settle(self) -> None:
        """Wait for a background save. If it failed, clean up after it and raise its error,
        once: orbax's manager keeps a failed background save and raises its error again in
        every other thread that waits, so a fresh manager replaces it."""
        pending, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            if pending is not None:
                self._save_failed(*pending, error, background=True)
            with contextlib.suppress(Exception):
                self._manager.close()  # the thread that saw the error: it is not raised again
            self._manager = self._open_manager()
            raise

    def _purge(self, unfinished: bool = False) -> None:
        """Delete the steps orbax moved to the trash (and unfinished saves): they are no
        longer listed, so a kill midway leaves nothing half-deleted in the listing."""
        if self._unlock is None:
            return
        for child in self._directory.iterdir():
            if child.name == _TRASH or (unfinished and _TMP_SUFFIX in child.name):
                child.rmtree(missing_ok=True)

    # -- properties -----------------------------------------------------------------------

    @property
    def directory(self) -> PyTree:
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
        """The committed steps in the directory, oldest first, read from disk.

        **Arguments:** none.

        **Returns:** a sorted list of ints. Steps whose save died midway (or is still being
        written) never appear; a committed step damaged afterwards does until a `restore()`
        passes over it and moves it aside.

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
        return sorted(self._ocp.utils.checkpoint_steps(self._directory))

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
        return max(self.all_steps(), default=None)

    def should_save(self, step: SupportsIndex) -> bool:
        """Whether `save(step, ...)` would write without `force` (orbax's save policy).

        **Arguments:**

        - `step`: the training step.

        **Returns:** `True` when `step` is a multiple of `save_every` (or a preemption notice
        arrived at this step) and is newer than the latest step.

        ```python
        import tempfile

        from eqpar.checkpoint import Checkpointer

        with tempfile.TemporaryDirectory() as directory:
            with Checkpointer(directory, save_every=10) as checkpointer:
                assert [s for s in range(25) if checkpointer.should_save(s)] == [0, 10, 20]
        ```
        """
        self._check_open()
        return bool(self._manager.should_save(_as_step(step)))

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: SupportsIndex, state: PyTree, *, force: bool = False) -> bool:
        """Write `state` as step `step`, if `should_save(step)` or `force`.

        Each process writes the blocks of the arrays on its own devices; nothing is gathered.
        The step appears in `all_steps()` only once every process has finished writing, and
        older steps beyond `keep` are removed only after that. The first save takes the
        directory's writer lock (see the module docstring).

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

        Raises `ValueError` if two leaves of `state` would be stored under the same name, or
        for a zero-size or deleted (donated) array leaf, naming its path; `TypeError` for
        leaves that cannot be saved without pickle (object arrays), abstract ones
        (`jax.ShapeDtypeStruct`) or of a dtype orbax's storage cannot write (`uint4`,
        strings, ...; the message says what to save instead), all before anything is written;
        `RuntimeError` if another writer holds the directory's lock or, with several
        processes, not every process calls `save` within `timeout`. If writing fails (a full
        disk), the error is raised as it came, with a note saying which step was not
        committed; the unfinished directory this save created is removed, and the steps
        before it are intact. With `async_save`, the error of a background write is raised
        once, by the next `save`, `wait_until_finished`, `restore` or `close` (that `save`
        then writes nothing: call it again).

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
        with self._exclusive():
            step = _as_step(step)
            exists = step in self._manager.all_steps() or (self._directory / str(step)).exists()
            if exists or not (force or self._manager.should_save(step)):
                return False  # an existing step is never overwritten, forced or not
            leaves, _, _ = _leaves(state, "state")
            values = [_saved_value(leaf) for leaf in leaves]
            if not leaves:
                raise ValueError("`state` has no leaves to save: no arrays, no Python scalars.")
            self._become_writer()
            self._barrier("save")
            try:
                self._settle()
            except Exception as error:
                error.add_note(f"eqpar.checkpoint: so this call did not save step {step}.")
                raise
            self._purge()
            checksums = [digest(v) if self._checksums else None for v in values]
            records = [_record(leaf, checksum) for leaf, checksum in zip(leaves, checksums)]
            args = self._ocp.args.StandardSave(self._nested(leaves, values))
            metadata = {_FORMAT_KEY: {"version": _FORMAT_VERSION, "step": step, "leaves": records}}
            before = self._unfinished(step)
            try:
                saved = self._manager.save(step, args=args, custom_metadata=metadata, force=True)
            except Exception as error:
                self._save_failed(step, before, error, background=False)
                raise
            self._pending = (step, before) if self._async_save else None
            if not self._async_save:
                self._purge()
            return bool(saved)

    def wait_until_finished(self) -> None:
        """Block until a background (`async_save=True`) write has finished and is committed.

        **Arguments:** none. **Returns:** `None`. Raises the error of a failed background
        write, once (see `save`); a later save starts afresh.

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
        with self._exclusive():
            self._settle()

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

        - `step`: the step to read; the data comes from that step or `restore` raises (the
          step number recorded inside the step is checked). `None` reads `latest_step()`, and
          if that step is damaged warns and falls back to the newest step that restores
          cleanly, moving the damaged steps it passed over aside to `<step>.damaged-<time>`
          (they are kept for inspection; saving goes on past them).
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
        - `reshape`: restore the same layers stacked another way: an array leaf inside a
          `ScannedLayers` or `PipelineModule` of the target whose saved shape differs from the
          target's only in the leading stacking dimensions (one layer's shape, the dimensions
          after them, and the dtype are the same) is read in its saved shape and reshaped
          row-major into the target's shape and sharding. This is what lets a stack of layers
          saved as `[S, L / S, ...]` by one pipeline layout load as `[V, S', L / (S' V), ...]`
          or `[L, ...]` (eqpar stores stacked layers in model order whatever the layout, so a
          reshape is the whole conversion). Layers of another shape (two `Linear(4, 8)` into
          four `Linear(4, 4)`, as many numbers) and leaves outside a stack stay a shape
          mismatch, whose message says why; so does every such leaf without `reshape`.

        **Returns:** a pytree with the structure of `target`. `restored_step` says which step
        it came from.

        Raises `FileNotFoundError` if the step (or any step) does not exist,
        `CheckpointMismatchError` naming the first mismatching leaf path if the checkpoint
        holds another structure (missing or extra leaves, kinds, shapes, dtypes, PRNG
        implementations; shapes and dtypes as orbax's `item_metadata` reports them),
        `CorruptCheckpointError` naming the step and its path if the step is damaged (for
        `step=None`: if every step is; a leaf whose recorded kind contradicts its stored array
        is damage unless the stored array fits the target there exactly, which is restored
        with a warning), and `RuntimeError` if another thread is inside this
        `Checkpointer` or, with several processes, not every process calls `restore` within
        `timeout`.

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
        with self._exclusive():
            self._settle()
            plan, target_leaves, treedef = _leaves(target, "target")
            given = _shardings(shardings, plan)
            abstracts = [_placement(leaf, given) for leaf in plan]
            self._barrier("restore")
            steps = self.all_steps()
            candidates = steps if step is None else [_as_step(step)]
            if not candidates or not set(candidates) <= set(steps):
                raise FileNotFoundError(
                    ("" if step is None else f"`step` {candidates[0]}: ")
                    + f"there is no committed checkpoint in {self._directory} to restore; "
                    f"committed steps: {steps or 'none'}. (Start from scratch when "
                    "`latest_step()` is None.)"
                )
            failures: list[CorruptCheckpointError] = []
            for candidate in reversed(candidates):
                try:
                    values = self._restore_step(candidate, plan, abstracts, reshape)
                except CorruptCheckpointError as error:
                    if step is not None:
                        error.args = (
                            f"{error} Restore another step (`all_steps()` lists them) or call "
                            "`restore()` without `step` to fall back to the newest intact one.",
                        )
                        raise
                    failures.append(error)
                    _warn_caller(f"{error} Falling back to an older step.")
                    continue
                if failures:
                    moved = self._quarantine([f.step for f in failures if f.step is not None])
                    _warn_caller(
                        f"Restored step {candidate} from {self._directory}, not the newest step "
                        f"{steps[-1]}: damaged steps were moved aside for inspection ({moved}), "
                        "so saving goes on past them."
                    )
                self._restored_step = candidate
                by_index = {leaf.index: value for leaf, value in zip(plan, values)}
                return treedef.unflatten([by_index.get(i, v) for i, v in enumerate(target_leaves)])
            details = "\n".join(f"- {failure}" for failure in failures)
            raise CorruptCheckpointError(
                f"Every checkpoint in {self._directory} is damaged ({len(failures)} steps), "
                f"left in place:\n{details}",
                path=str(self._directory),
            )

    def _quarantine(self, steps: list[int]) -> str:
        """Rename damaged steps to names orbax does not list, then reopen orbax's manager (it
        caches the list of steps). Only the primary process renames."""
        moved = []
        for step in steps:
            destination = self._directory / f"{step}.damaged-{time.time_ns()}"
            if jax.process_index() == 0:
                (self._directory / str(step)).rename(destination)
            moved.append(f"{step} -> {destination.name}")
        self._barrier("quarantine")
        self._manager.close()
        self._manager = self._open_manager()
        return ", ".join(moved)

    def _nested(self, leaves: Sequence[_Leaf], values: Sequence[Any]) -> dict:
        """The nested dict orbax reads and writes: one level per path entry."""
        return self._ocp.tree.from_flat_dict({leaf.names: v for leaf, v in zip(leaves, values)})

    def _restore_step(self, step: int, plan: list[_Leaf], abstracts: list, reshape: bool) -> list:
        """The data leaves of `plan` as read from step `step`, checked and finished."""
        step_dir = self._directory / str(step)
        damaged = functools.partial(_damaged, step, step_dir)
        saved = self._reconcile(step, step_dir, self._read_metadata(step, step_dir), plan, reshape)
        problems = _mismatches(saved, plan, reshape)
        if problems:
            listed = "\n".join(f"- {problem}" for problem in problems[:_MAX_LISTED])
            if len(problems) > _MAX_LISTED:
                listed += f"\n- ... and {len(problems) - _MAX_LISTED} more"
            raise CheckpointMismatchError(
                f"Checkpoint step {step} at {step_dir} does not have the structure of `target`; "
                f"first mismatching leaf: {problems[0]}.\nAll {len(problems)} differences:\n"
                f"{listed}\n{_structure_fix(saved, plan)}",
                step=step,
                path=str(step_dir),
            )
        reshaped = [reshape and _reshapable(saved[leaf.path], leaf) for leaf in plan]
        asked = [
            _replicated(abstract, saved[leaf.path]["shape"]) if again else abstract
            for leaf, abstract, again in zip(plan, abstracts, reshaped)
        ]
        try:
            args = self._ocp.args.StandardRestore(self._nested(plan, asked))
            flat = self._ocp.tree.to_flat_dict(self._manager.restore(step, args=args))
            stored = [flat[leaf.names] for leaf in plan]
        except Exception as error:
            raise damaged(f"reading its arrays failed ({_first_line(error)})") from error
        leaves = []
        for leaf, abstract, value, again in zip(plan, abstracts, stored, reshaped):
            record = saved[leaf.path]
            expected = record.get("checksum")
            read = None if expected is None else digest(value, record["version"])
            if expected is not None and read not in (None, expected):
                raise damaged(
                    f"leaf {_display(leaf.path)} does not match its checksum (saved {expected}, "
                    f"read {read}), so its array files were altered after the save"
                )
            value = _reshaped(abstract, value) if again else value
            leaves.append(_finish(leaf, value, record))
        return leaves

    def _reconcile(
        self, step: int, step_dir: PyTree, saved: dict[str, dict], plan: list[_Leaf], reshape: bool
    ) -> dict[str, dict]:
        """`saved`, where a leaf's recorded kind contradicts its stored array, going by the
        stored array when that fits the target leaf there exactly (with a warning); otherwise
        the step's metadata is inconsistent, which is damage. (Not a mismatch with `target`:
        the checkpoint disagrees with itself.) A PRNG key is never guessed: its record is
        what names its implementation."""
        by_path = {leaf.path: leaf for leaf in plan}
        for path, record in saved.items():
            why = _kind_contradiction(record)
            if why is None:
                continue
            leaf, fixed = by_path.get(path), None
            said = (
                f"its leaf record ({step_dir / _STEP_METADATA_FILE}, `custom_metadata."
                f"{_FORMAT_KEY}`) says {_display(path)} {why}: the checkpoint's metadata is "
                "inconsistent with its stored array"
            )
            if leaf is not None and leaf.kind != "prng_key":
                fixed = {k: v for k, v in record.items() if k != "impl"} | {"kind": leaf.kind}
                fixed = None if _mismatches({path: fixed}, [leaf], reshape) else fixed
            if leaf is None or fixed is None:
                wanted = "no data leaf" if leaf is None else _describe(leaf.kind, leaf.impl)
                raise _damaged(
                    step,
                    step_dir,
                    f"{said}, and the stored array alone cannot be restored safely into the "
                    f"target, which has {wanted} there",
                )
            _warn_caller(
                f"Checkpoint step {step} at {step_dir}: {said}. Restored the stored array, "
                f"which fits the target there ({_describe(leaf.kind)}); check how this step "
                "was written."
            )
            saved = {**saved, path: fixed}
        return saved

    def _read_metadata(self, step: int, step_dir: PyTree) -> dict[str, dict]:
        """Each saved leaf by path: eqpar's record (kind, impl, checksum, stacking depth) with
        the format version and the shape and dtype from orbax's `item_metadata`, both read
        through the manager's public `metadata(step)`. Anything malformed is damage."""
        damaged = functools.partial(_damaged, step, step_dir)
        file = step_dir / _STEP_METADATA_FILE
        try:
            metadata = self._manager.metadata(step)
            custom, items = metadata.custom_metadata, metadata.item_metadata
        except Exception as error:
            # It reads the arrays' metadata too: say which part failed.
            try:
                self._manager.item_metadata(step)
            except Exception as array_error:
                reason = f"reading its arrays failed ({_first_line(array_error)})"
                raise damaged(reason) from array_error
            reason = f"its step metadata {file} is malformed ({_first_line(error)})"
            raise damaged(reason) from error
        try:
            arrays = getattr(items.get("default") if items else None, "tree", None)
            if arrays is None:  # a lightweight manager leaves item metadata to this call
                arrays = getattr(self._manager.item_metadata(step), "tree", None)
        except Exception as error:
            raise damaged(f"reading its arrays failed ({_first_line(error)})") from error
        raw = custom.get(_FORMAT_KEY) if isinstance(custom, dict) else None
        entry: dict = raw if isinstance(raw, dict) else {}
        ours = isinstance(arrays, dict) and _ITEM_ROOT in arrays
        version, records = entry.get("version"), entry.get("leaves")
        if (raw is None and not ours) or (isinstance(version, int) and version > _FORMAT_VERSION):
            why = "an eqpar newer than this one" if raw else "another program (no eqpar entry)"
            raise CheckpointMismatchError(
                f"Checkpoint step {step} at {step_dir} was not written by eqpar.checkpoint but "
                f"by {why}: upgrade eqpar, or read it with orbax directly.",
                step=step,
                path=str(step_dir),
            )
        if raw is None:  # orbax reads a missing or unparsable file as no custom metadata
            raise damaged(
                f"its step metadata {file} is missing, unreadable or has no "
                f"`custom_metadata.{_FORMAT_KEY}` entry"
            )
        if not (isinstance(version, int) and isinstance(records, list)) or not all(
            map(_valid_record, records)
        ):
            raise damaged(f"its `custom_metadata.{_FORMAT_KEY}` entry in {file} is malformed")
        if entry.get("step", step) != step:
            raise damaged(f"it holds step {entry.get('step')!r}, not {step} (renamed or copied?)")
        if not ours:
            raise damaged(f"its array metadata file {step_dir / 'default/_METADATA'} is missing")
        shapes = {"/".join(k[1:]): m for k, m in self._ocp.tree.to_flat_dict(arrays).items()}
        listed = [record["path"] for record in records]
        if sorted(listed) != sorted(shapes):
            differ = sorted(set(listed) ^ set(shapes)) or "a repeated path"
            raise damaged(f"its leaf list and orbax's array metadata disagree on {differ}")
        try:
            return {
                r["path"]: {
                    **r,
                    "shape": tuple(m.shape),
                    "dtype": np.dtype(m.dtype).name,
                    "version": version,  # which checksum rule verifies it
                }
                for r, m in ((r, shapes[r["path"]]) for r in records)
            }
        except (AttributeError, TypeError) as error:
            raise damaged(f"its array metadata is malformed ({_first_line(error)})") from error

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for a background save to finish, release orbax's resources and the writer lock.
        Idempotent.

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
        with self._exclusive():
            try:
                self._settle()
                self._purge()
            finally:
                self._manager.close()
                self._closed = True
                if self._unlock is not None:
                    self._unlock()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; create a new Checkpointer to use it again.")
