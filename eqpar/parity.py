"""`eqpar.check`: the same numbers as one device, for any model, in one line.

A parallel run can be wrong without failing: a head count kept in an `int` field, a dropout
whose mask repeats across devices, a position table read at local positions. `check` runs one
gradient step of the author's loss both ways — the parallel model on the mesh, and its serial
form (`unparallelize`) on one device, with the same parameters and batch — and compares the
loss and every gradient leaf by path. On a mismatch it runs the forward pass again with
probes on the model's modules and names the first module (in the order the model calls them)
whose output differs, with the likely causes for its kind.

JAX and Equinox have no such check: `jax.experimental.checkify` finds NaNs and out-of-bounds
indexing, not a parallel program that computes other numbers than its serial twin.
"""

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from ._axis_types import constrain as constrain_on_any_axes
from ._paths import path_to_str
from ._typing import PyTree
from .layout import named_shardings, partition_specs
from .mesh import DeviceMesh, as_jax_mesh
from .nn._plan_blocks import block_options
from .nn.pipelined import PipelinedBlocks
from .nn.pipelined import value_and_grad as eqpar_value_and_grad
from .nn.stacks import ScannedLayers
from .plan import Pipeline, Style, parallelize, unparallelize
from .spmd import shard_map

__all__ = ["CheckReport", "LeafDifference", "ParityError", "check"]

# The largest relative difference, per dtype, that rounding explains: float32's 1e-5 is about
# 84 epsilons of the leaf's scale (a reduction reordered across devices moves a few); the
# others are scaled to their precision.
_RTOL = {
    jnp.dtype(jnp.float64): 1e-10,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 5e-3,
    jnp.dtype(jnp.bfloat16): 4e-2,
}
# A leaf whose values are under this fraction of the largest leaf's is compared relative to
# that fraction: such a gradient is zero in exact arithmetic (e.g. a key bias under softmax),
# and its rounding is that of the terms that cancelled, not of its own size.
_FLOOR = 1e-3


class ParityError(AssertionError):
    """The parallel step's numbers differ from the serial step's: `check` raises it, with
    the report as its message.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    mlp = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    mesh = eqpar.DeviceMesh((2,), ("data",), devices=jax.devices()[:2])
    wrong = lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)  # a sum: each shard's differs
    try:
        eqpar.check(wrong, mlp, jnp.ones((4, 4)), mesh=mesh)
    except eqpar.ParityError as error:
        assert "FAIL" in str(error)
    else:
        raise AssertionError("a sum over a split batch is not the serial sum")
    ```
    """


class LeafDifference(eqx.Module):
    """One compared leaf: its path, the largest difference relative to its scale, the
    tolerance it had, and whether it passed.

    ```python
    import eqpar
    leaf = eqpar.parity.LeafDifference("layers/0/weight", 2e-6, 1e-5)
    assert leaf.ok
    ```
    """

    path: str
    difference: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What `check` found.

    - `loss`, `serial_loss`: the parallel and the serial step's loss.
    - `leaves`: a `LeafDifference` per gradient leaf (and one for the loss, path `"loss"`).
    - `first_difference`: the path of the first module whose output differs in the probed
      forward pass (`None` when all agree or nothing could be probed), its class name in
      `first_kind`, and `causes`: what usually makes that kind of module differ.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    mlp = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    mesh = eqpar.DeviceMesh((2,), ("data",), devices=jax.devices()[:2])
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
    report = eqpar.check(loss, mlp, jnp.ones((4, 4)), mesh=mesh)
    assert report.ok and not report.mismatches and report.leaves[0].path == "loss"
    print(report)  # eqpar.check: PASS: loss ... ; 5 of 5 leaves within tolerance.
    ```
    """

    loss: float
    serial_loss: float
    leaves: tuple[LeafDifference, ...]
    first_difference: str | None = None
    first_kind: str | None = None
    causes: tuple[str, ...] = ()
    probe_note: str | None = None

    @property
    def ok(self) -> bool:
        return all(leaf.ok for leaf in self.leaves)

    @property
    def mismatches(self) -> tuple[LeafDifference, ...]:
        return tuple(leaf for leaf in self.leaves if not leaf.ok)

    def __str__(self) -> str:
        status = "PASS" if self.ok else "FAIL"
        lines = [
            f"eqpar.check: {status}: loss {self.loss:.8g} (one device: {self.serial_loss:.8g}); "
            f"{len(self.leaves) - len(self.mismatches)} of {len(self.leaves)} leaves within "
            f"tolerance."
        ]
        worst = sorted(self.mismatches, key=lambda leaf: -leaf.difference)
        for leaf in worst[:10]:
            lines.append(
                f"  {leaf.path}: relative difference {leaf.difference:.3g} > {leaf.tolerance:.3g}"
            )
        if len(worst) > 10:
            lines.append(f"  ... and {len(worst) - 10} more leaves")
        if self.first_difference is not None:
            lines.append(
                f"  first module whose output differs: {self.first_difference!r} "
                f"({self.first_kind}). Likely causes:"
            )
            lines.extend(f"   - {cause}" for cause in self.causes)
        elif self.probe_note:
            lines.append(f"  {self.probe_note}")
        return "\n".join(lines)


def check(
    loss_fn: Callable,
    model: PyTree,
    *batch: PyTree,
    mesh: DeviceMesh | jax.sharding.Mesh,
    plan: Mapping[str, Style] | None = None,
    batch_specs: PartitionSpec | tuple | None = None,
    step: Callable | None = None,
    serial: PyTree | None = None,
    serial_step: Callable | None = None,
    rtol: float | None = None,
    raise_on_mismatch: bool = True,
) -> CheckReport:
    """Run one gradient step of `loss_fn` on the mesh and on one device, and compare.

    The serial step is `eqx.filter_value_and_grad(loss_fn)` on `unparallelize(model)`, every
    array on one device. The parallel step is, unless `step` is given, the route the model
    needs: `eqpar.shard_map(eqpar.value_and_grad(loss_fn))` over the mesh with the model's
    `partition_specs` and `batch_specs` (every mode, 1F1B and ZB-H1 pipelines included),
    with the axes that `Sharded` keys split left to the compiler; a model with only
    `Sharded` leaves runs under `jax.jit` on placed arrays. The loss and each gradient leaf
    are compared relative to the leaf's scale (its largest magnitude, at least a thousandth
    of the largest leaf's), within a tolerance from the dtype (float32: 1e-5; bfloat16:
    4e-2, also for float32 leaves of a step whose matrix products run in bfloat16). On a
    mismatch, the forward pass runs again on a batch of the first example repeated, with
    probes on the model's modules, and the report names the first module whose whole output
    differs and the likely causes for its kind.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *batch) -> scalar`, the author's loss for one device (a
      mean over the batch).
    - `model`: the serial model with `plan`, or the model `parallelize` returned.
    - `*batch`: a small batch; every leaf has the batch as its leading axis.
    - `mesh`: the mesh the parallel step runs on.
    - `plan`: the plan to apply to `model` (omit it when `model` is already parallelized).
    - `batch_specs`: the `PartitionSpec` of the batch (one for all, or one per argument);
      default: the batch split over the mesh axes that no plan style names.
    - `serial`, `serial_step`: the one-device model and step, where `unparallelize(model)`
      and `eqx.filter_value_and_grad(loss_fn)` are not (a model built for one device by
      your own code); leaves are matched by path, and a leaf of stacked layers by reshape
      (stacked layers are stored in model order, whatever the stage count).
    - `step`: your own parallel step, `step(model, *batch) -> (loss, grads)`, where the
      default route is not the one you train with.
    - `rtol`: the tolerance for every leaf (default: from each leaf's dtype).
    - `raise_on_mismatch`: raise `eqpar.ParityError` with the report (default), or return it.

    **Returns:** a `CheckReport` (`report.ok`, `print(report)`).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    mlp = eqx.nn.MLP(8, 8, 32, 1, key=jax.random.key(0))
    plan = {"layers/0": eqpar.ColumnParallel(), "layers/1": eqpar.RowParallel()}
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
    report = eqpar.check(loss, mlp, jnp.ones((4, 8)), mesh=mesh, plan=plan)
    assert report.ok
    ```
    """
    if not callable(loss_fn):
        raise TypeError(f"check: `loss_fn` must be callable, got {type(loss_fn).__name__}.")
    if not batch:
        raise ValueError("check: pass a small batch after the model: check(loss, model, *batch).")
    for name, fn in (("step", step), ("serial_step", serial_step)):
        if fn is not None and not callable(fn):
            raise TypeError(f"check: `{name}` must be callable, got {type(fn).__name__}.")
    if step is not None and not callable(step):
        raise TypeError(f"check: `step` must be callable, got {type(step).__name__}.")
    jax_mesh = as_jax_mesh(mesh)
    parallel = model if plan is None else parallelize(model, plan, mesh=jax_mesh)
    serial = unparallelize(parallel) if serial is None else serial
    specs = _batch_specs(batch_specs, batch, parallel, plan, jax_mesh)
    parallel_step = step or _parallel_step(loss_fn, parallel, specs, jax_mesh)

    # A `SingleDeviceSharding`, not the device: `device_put` onto a device keeps an array's
    # type of a mesh with Explicit axes, which a program on one device then refuses.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    arrays, rest = eqx.partition(serial, eqx.is_array)
    serial = eqx.combine(jax.device_put(arrays, one), rest)
    serial_batch = jax.device_put(batch, one)
    serial_value, serial_grads = (
        serial_step or eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    )(serial, *serial_batch)
    placed_batch = tuple(
        jax.device_put(arg, jax.sharding.NamedSharding(jax_mesh, spec))
        for arg, spec in zip(batch, specs, strict=True)
    )
    value, grads = parallel_step(_placed(parallel, jax_mesh), *placed_batch)
    grads = unparallelize(grads)

    if rtol is None:  # a program that multiplies in bfloat16 rounds as bfloat16 does
        floor = _compute_rtol(loss_fn, serial, serial_batch)
        rtol_of = lambda dtype: max(_RTOL.get(jnp.dtype(dtype), 1e-5), floor)
    else:
        rtol_of = lambda dtype: rtol
    leaves = [_compare("loss", value, serial_value, rtol_of, None)]
    leaves.extend(_compare_trees(grads, serial_grads, rtol_of))
    report = CheckReport(loss=float(value), serial_loss=float(serial_value), leaves=tuple(leaves))
    if not report.ok:
        report = _with_first_difference(
            report, loss_fn, parallel, serial, batch, specs, jax_mesh, step is not None
        )
        if raise_on_mismatch:
            raise ParityError(str(report))
    return report


def _batch_specs(
    given: PartitionSpec | tuple | None,
    batch: tuple,
    parallel: PyTree,
    plan: Mapping | None,
    mesh: jax.sharding.Mesh,
) -> tuple[PartitionSpec, ...]:
    if isinstance(given, PartitionSpec):
        return (given,) * len(batch)
    if given is not None:
        if not isinstance(given, tuple) or len(given) != len(batch):
            raise ValueError(
                f"check: `batch_specs` must be one PartitionSpec or a tuple of one per batch "
                f"argument ({len(batch)}); got {given!r}."
            )
        return given
    named = set(_named_axes(parallel, plan))
    data: list[Hashable] = [axis for axis in mesh.axis_names if axis not in named]
    if not data:
        return (PartitionSpec(),) * len(batch)
    spec = PartitionSpec(tuple(data) if len(data) > 1 else data[0])
    return (spec,) * len(batch)


def _named_axes(parallel: PyTree, plan: Mapping | None) -> list[Hashable]:
    """The mesh axes the model's layout or plan splits other than the batch."""
    axes: list[Hashable] = []
    if plan is not None:
        for style in plan.values():
            if isinstance(style, Pipeline):
                axes.append(style.axis_name)
            for name in ("axis_name", "head_axis_name", "model_axis_name"):
                axis = getattr(style, name, None)
                if name == "axis_name" and type(style).__name__ == "ExpertParallel":
                    continue  # tokens are split over the expert axis as over a data axis
                axes.extend(axis if isinstance(axis, tuple) else (axis,))
            spec = getattr(style, "spec", None)
            if isinstance(spec, PartitionSpec):
                axes.extend(_spec_axes(spec))
    for spec in jax.tree.leaves(
        partition_specs(parallel), is_leaf=lambda x: isinstance(x, PartitionSpec)
    ):
        if isinstance(spec, PartitionSpec):
            axes.extend(_spec_axes(spec))
    return [axis for axis in axes if axis is not None]


def _spec_axes(spec: PartitionSpec) -> list[Hashable]:
    found: list[Hashable] = []
    for entry in spec:
        found.extend(entry if isinstance(entry, tuple) else (entry,))
    return found


def _sharded_axes(model: PyTree) -> set[Hashable]:
    """The axes that `Sharded` keys lay raw arrays out over (left to the compiler)."""
    axes: set[Hashable] = set()
    is_block = lambda node: block_options(node) is not None
    for node in jax.tree.leaves(model, is_leaf=is_block):
        options = block_options(node)
        if options is not None:
            for _, spec in options.specs:
                axes.update(a for a in _spec_axes(spec) if a is not None)
    return axes


def _parallel_step(
    loss_fn: Callable, parallel: PyTree, specs: tuple, mesh: jax.sharding.Mesh
) -> Callable:
    compiled = _sharded_axes(parallel)
    manual = [axis for axis in mesh.axis_names if axis not in compiled]
    if compiled and not manual:
        return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    grad_specs = partition_specs(eqx.filter(parallel, eqx.is_inexact_array))
    return eqx.filter_jit(
        shard_map(
            eqpar_value_and_grad(loss_fn),
            mesh=mesh,
            in_specs=(partition_specs(parallel), *specs),
            out_specs=(PartitionSpec(), grad_specs),
            axis_names=set(manual) if compiled else None,
        )
    )


def _placed(model: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    shardings = named_shardings(partition_specs(model), mesh)
    arrays, static = eqx.partition(model, eqx.is_array)
    placed = jax.tree.map(constrain_on_any_axes, arrays, shardings)  # either axis type
    return eqx.combine(placed, static)


def _compute_rtol(loss_fn: Callable, model: PyTree, batch: tuple) -> float:
    """The tolerance of the least precise dtype the serial step multiplies in (its matrix
    products' operands, read off its jaxpr), or 0."""
    jaxpr, _, _ = eqx.filter_make_jaxpr(eqx.filter_value_and_grad(loss_fn))(model, *batch)
    found = 0.0

    def visit(inner: Any) -> None:
        nonlocal found
        for eqn in inner.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                for var in eqn.invars:
                    dtype = getattr(getattr(var, "aval", None), "dtype", None)
                    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                        found = max(found, _RTOL.get(jnp.dtype(dtype), 0.0))
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        visit(sub)

    visit(jaxpr.jaxpr)
    return found


def _compare_trees(actual: PyTree, expected: PyTree, rtol_of: Callable) -> list[LeafDifference]:
    got = dict(_float_leaves(actual))
    want = dict(_float_leaves(expected))
    if set(got) != set(want):
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        raise ValueError(
            f"check: the parallel gradients hold other leaves than the serial ones "
            f"(missing: {missing[:5]}, extra: {extra[:5]}); pass a `step` that returns "
            f"gradients shaped as the model's inexact arrays."
        )
    scales = {
        path: float(np.max(np.abs(leaf))) if leaf.size else 0.0 for path, leaf in want.items()
    }
    # The floor grows with the rounding of the step's least precise dtype (bfloat16: 1e-2).
    fraction = max(_FLOOR, rtol_of(jnp.float32) / 4)
    floor = fraction * max(scales.values(), default=0.0)
    return [
        _compare(path, got[path], want[path], rtol_of, max(scales[path], floor)) for path in want
    ]


def _float_leaves(tree: PyTree) -> list[tuple[str, np.ndarray]]:
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if eqx.is_inexact_array(leaf):
            found.append((path_to_str(path), np.asarray(leaf)))
    return found


def _compare(
    path: str, actual: Any, expected: Any, rtol_of: Callable, scale: float | None
) -> LeafDifference:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    tolerance = rtol_of(jnp.asarray(expected).dtype)
    if a.shape != e.shape and a.size == e.size:
        a = a.reshape(e.shape)  # stacked layers, in model order whatever the stage count
    if a.shape != e.shape:
        return LeafDifference(path, math.inf, tolerance)
    finite = np.isfinite(e)
    if not np.array_equal(finite, np.isfinite(a)):
        return LeafDifference(path, math.inf, tolerance)
    if scale is None:
        scale = float(np.max(np.abs(e[finite]))) if finite.any() else 0.0
    diff = float(np.max(np.abs(a[finite] - e[finite]))) if finite.any() else 0.0
    difference = diff / max(scale, np.finfo(np.float32).tiny)
    return LeafDifference(path, float(difference), float(tolerance))


# --- Localization: the first module whose output differs ------------------------------------

_CAUSES = {
    "RowParallelLinear": (
        "the author's code between a ColumnParallel and this RowParallel layer mixes "
        "devices' features: a reshape into heads by a head count kept in an int field (add "
        "HeadParallel(fields=('n_heads',)) keyed by the block), a norm or softmax over the "
        "split features, or a dropout given per-device keys",
    ),
    "ColumnParallelLinear": (
        "its input differs between devices (it needs the whole input): a preceding layer "
        "left its output split",
    ),
    "ParallelDropout": (
        "the key differs from the serial model's (keys split per device instead of per "
        "example), or the dropout is applied to a reshaped split activation",
    ),
    "Dropout": (
        "a plain dropout on a split activation repeats one mask on every device's block: "
        "drop its Replicated() key so that parallelize makes it a ParallelDropout",
    ),
    "RotaryPositionalEmbedding": (
        "rotations by local positions on a split sequence: drop its Replicated() key so "
        "that parallelize makes it a ParallelRotaryEmbedding",
    ),
    "Embedding": (
        "positions taken as local indices on a split sequence (a learned table sliced by "
        "[:seq_len] inside a context-parallel region)",
    ),
}
_GENERIC = (
    "a layer the plan converts inside this module computes differently from its serial "
    "twin: check the plan's keys for it (Column/Row pairs, head counts in int fields, "
    "HeadParallel(fields=...))",
    "statistics over the batch or the sequence (a batch norm, a mean) taken over this "
    "device's shard only",
)


def _with_first_difference(
    report: CheckReport,
    loss_fn: Callable,
    parallel: PyTree,
    serial: PyTree,
    batch: tuple,
    specs: tuple,
    mesh: jax.sharding.Mesh,
    own_step: bool,
) -> CheckReport:
    # One example per device of the batch's axes, the first one on each: the serial and the
    # parallel records then hold the same values wherever the outputs are whole.
    shards = max(
        math.prod(mesh.shape[a] for a in _spec_axes(spec) if a is not None) for spec in specs
    )
    repeated = jax.tree.map(
        lambda leaf: jnp.repeat(leaf[:1], shards, axis=0) if jnp.ndim(leaf) else leaf, batch
    )
    try:
        serial_records = _probe_run(
            lambda m, *b: eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(m, *b),
            serial,
            jax.device_put(repeated, jax.devices()[0]),
        )
        placed = tuple(
            jax.device_put(arg, jax.sharding.NamedSharding(mesh, spec))
            for arg, spec in zip(repeated, specs, strict=True)
        )
        parallel_records = _probe_run(
            lambda m, *b: _parallel_step(loss_fn, m, specs, mesh)(_placed(m, mesh), *b),
            parallel,
            placed,
        )
    except Exception as error:
        note = f"(the probed forward pass could not run: {type(error).__name__}: {error})"
        return dataclasses.replace(report, probe_note=note[:3000])
    order, serial_out, _ = serial_records
    _, parallel_out, kinds = parallel_records
    for path in order:
        want = serial_out.get(path)
        got = parallel_out.get(path)
        if not want or not got:
            continue
        if _differs(got, want):
            kind = kinds.get(path, "?")
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            plain = tuple(
                f"{where!r} is a plain eqx.nn.{kinds[where]} (a Replicated() key keeps it so) "
                f"and ran before it: " + _CAUSES[kinds[where]][0]
                for where in order[: order.index(path)]
                if kinds.get(where) in ("Dropout", "RotaryPositionalEmbedding")
                and where.startswith(parent)
            )
            causes = plain + _CAUSES.get(kind, ()) + _GENERIC
            return dataclasses.replace(
                report, first_difference=path, first_kind=kind, causes=causes
            )
    note = (
        "no module's whole output differs on a batch of one example repeated: the "
        "difference arises across examples (statistics over the batch, a loss that is not "
        "a mean over examples, per-example keys) or in outputs split between devices"
        + (" (or in your own `step`)" if own_step else "")
        + "."
    )
    return dataclasses.replace(report, probe_note=note)


def _differs(got: list, want: list) -> bool:
    """Whether some recorded parallel output (any device, any call) matches none of the
    serial ones, where their shapes allow the comparison. Calls are matched by value, not
    by order: under `jax.vmap` each element is one call, in an order JAX does not promise."""
    for outputs in got:
        for i, a in enumerate(outputs):
            candidates = [_distance(a, record[i]) for record in want if i < len(record)]
            candidates = [d for d in candidates if d is not None]
            if candidates and min(candidates) > 10 * _RTOL.get(jnp.dtype(a.dtype), 1e-5):
                return True
    return False


def _distance(a: np.ndarray, e: np.ndarray) -> float | None:
    """How far `a` is from `e` relative to `e`'s scale; where `a` is a block of `e` along some
    dimensions (this device's examples, features, heads or tokens), from the nearest such
    block; `None` where the shapes do not compare."""
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    scale = max(float(np.max(np.abs(e))) if e.size else 0.0, 1e-30)
    if not a.size or not e.size:
        return 0.0 if a.shape == e.shape else None
    if a.ndim != e.ndim:
        return None
    differ = [k for k in range(a.ndim) if a.shape[k] != e.shape[k]]
    if any(e.shape[k] % a.shape[k] for k in differ):
        return None
    counts = [e.shape[k] // a.shape[k] for k in differ]
    if math.prod(counts) > 4096:
        return None
    best = math.inf
    for corner in itertools.product(*(range(c) for c in counts)):
        index = [slice(None)] * e.ndim
        for k, i in zip(differ, corner, strict=True):
            index[k] = slice(i * a.shape[k], (i + 1) * a.shape[k])
        best = min(best, float(np.max(np.abs(a - e[tuple(index)]))))
    return best / scale


def _probe_run(run: Callable, model: PyTree, batch: tuple) -> tuple[list, dict, dict]:
    order: list[str] = []
    outputs: dict[str, list] = {}
    kinds: dict[str, str] = {}
    probed = _with_probes(model, (), order, outputs, kinds)
    jax.block_until_ready(run(probed, *batch))
    return order, outputs, kinds


_PROBE_CLASSES: dict[tuple[type, str], type] = {}


def _with_probes(node: PyTree, path: tuple, order: list, outputs: dict, kinds: dict) -> PyTree:
    if isinstance(node, PipelinedBlocks | ScannedLayers):
        return node  # stacked blocks: one call runs many; not probed one by one
    if isinstance(node, eqx.Module):
        fields = {
            f.name: _with_probes(
                getattr(node, f.name),
                (*path, jax.tree_util.GetAttrKey(f.name)),
                order,
                outputs,
                kinds,
            )
            for f in dataclasses.fields(node)
        }
        cls = type(node)
        if callable(node):
            cls = _probe_class(cls, path_to_str(path), order, outputs, kinds)
        new = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(new, name, value)
        return new
    if isinstance(node, list | tuple) and not hasattr(node, "_fields"):
        return type(node)(
            _with_probes(item, (*path, jax.tree_util.SequenceKey(i)), order, outputs, kinds)
            for i, item in enumerate(node)
        )
    if isinstance(node, dict):
        return type(node)(
            {
                k: _with_probes(v, (*path, jax.tree_util.DictKey(k)), order, outputs, kinds)
                for k, v in node.items()
            }
        )
    return node


def _probe_class(base: type, where: str, order: list, outputs: dict, kinds: dict) -> type:
    def record(rank: int, *values: Any) -> np.ndarray:
        outputs.setdefault(where, []).append([np.asarray(v) for v in values])
        batched = np.shape(values[0])[: np.ndim(values[0]) - rank]  # the vmaps' dimensions
        return np.zeros(batched, np.float32)

    def __call__(self: PyTree, *args: Any, **kwargs: Any) -> Any:
        out = base.__call__(self, *args, **kwargs)
        if where not in kinds:
            order.append(where)  # trace order: the order the model calls its modules
            kinds[where] = _kind(base)
        leaves, treedef = jax.tree.flatten(out)
        floats = [i for i, leaf in enumerate(leaves) if eqx.is_inexact_array(leaf)]
        if floats:
            # A pure callback, called once per batch under `jax.vmap` (a debug callback runs
            # once per element), kept alive by adding its zero to the output; no gradient
            # flows through it.
            zero = jax.pure_callback(
                functools.partial(record, leaves[floats[0]].ndim),
                jax.ShapeDtypeStruct((), jnp.float32),
                *(lax.stop_gradient(leaves[i]) for i in floats),
                vmap_method="broadcast_all",
            )
            first = floats[0]
            leaves[first] = leaves[first] + lax.stop_gradient(zero).astype(leaves[first].dtype)
            out = jax.tree.unflatten(treedef, leaves)
        return out

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})


def _kind(cls: type) -> str:
    for klass in cls.__mro__:
        if klass.__name__ in _CAUSES:
            return klass.__name__
    return cls.__name__
