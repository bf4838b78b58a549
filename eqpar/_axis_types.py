"""Placing arrays on meshes whose axes are Explicit, Auto or a mix.

JAX constrains an array differently by the type of the mesh axes its spec names: over
`AxisType.Auto` axes, `jax.lax.with_sharding_constraint` asks the compiler; over
`AxisType.Explicit` axes the sharding is part of the array's type, and only
`jax.sharding.reshard` changes it (`with_sharding_constraint` refuses those axes, and
`jax.shard_map` refuses an argument whose type differs from its `in_specs` there).
`jax.make_mesh` makes Explicit axes by default, `eqpar.DeviceMesh` Auto ones. eqpar's
placement (`placement.with_sharding_constraint`, `Distribution.constrain`, `check`) goes
through `constrain`, `eqpar.shard_map` enters `jax.shard_map` through `enter_shard_map`, and
`unparallelize` hands one-device code `gather_explicit`'s whole arrays, so that both kinds of
mesh, and meshes that mix them, take the same specs. (The `jax.shard_map` calls inside
eqpar's layers and executors run within the caller's region, on what it entered.)
"""

from collections.abc import Hashable, Iterable
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._typing import PyTree


def explicit_axes(mesh: Any) -> frozenset[Hashable]:
    """The names of `mesh`'s Explicit axes (a `jax.sharding.Mesh` or `AbstractMesh`)."""
    types = getattr(mesh, "axis_types", None) or ()
    return frozenset(
        name for name, kind in zip(mesh.axis_names, types) if kind == AxisType.Explicit
    )


def _names(entry: Any) -> tuple:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(names: Iterable[Hashable]) -> Any:
    names = tuple(names)
    return None if not names else names[0] if len(names) == 1 else names


def keep_axes(spec: PartitionSpec, axes: frozenset, *, rank: int) -> PartitionSpec:
    """`spec` over `rank` dimensions with only the mesh axes in `axes` (the others dropped;
    an `UNCONSTRAINED` entry kept as it is)."""
    entries = list(spec) + [None] * (rank - len(spec))
    return PartitionSpec(
        *(
            e if e is PartitionSpec.UNCONSTRAINED else _entry(n for n in _names(e) if n in axes)
            for e in entries
        )
    )


def _current_spec(x: Any, rank: int) -> tuple:
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", None) or ())
    return spec + (None,) * (rank - len(spec))


def _explicit_target(
    x: Any, spec: PartitionSpec, explicit: frozenset, keep: frozenset
) -> tuple[PartitionSpec, PartitionSpec]:
    """The spec `x` must have over the Explicit axes, and the one it has: `spec`'s explicit
    names, plus those of `x`'s own type over the axes in `keep` (which `spec` cannot name,
    e.g. axes left to the compiler around a manual region) and where `spec` says
    UNCONSTRAINED."""
    rank = jax.numpy.ndim(x)
    current = _current_spec(x, rank)
    entries = list(spec) + [None] * (rank - len(spec))
    named = {n for e in entries for n in _names(e) if n in explicit}
    target = []
    for wanted, now in zip(entries, current):
        if wanted is PartitionSpec.UNCONSTRAINED:  # as it is, unless `spec` moves that axis
            target.append(_entry(n for n in _names(now) if n in explicit and n not in named))
            continue
        names = [n for n in _names(wanted) if n in explicit]
        names += [n for n in _names(now) if n in explicit and n in keep and n not in named]
        target.append(_entry(names))
    had = (_entry(n for n in _names(now) if n in explicit) for now in current)
    return PartitionSpec(*target), PartitionSpec(*had)


def context_mesh() -> Any:
    """The mesh `jax.set_mesh` set: concrete outside a trace, abstract inside one; `None`
    when none is set."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # `get_mesh` refuses to run under a trace
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _is_traced(x: Any) -> bool:
    return isinstance(x, Tracer)


def constrain(x: Any, sharding: NamedSharding | None) -> Any:
    """Lay `x` out as `sharding` says, on a mesh of any axis types (`None`: as it is).

    On a mesh without Explicit axes this is `jax.lax.with_sharding_constraint`. Otherwise a
    concrete array is placed (`jax.device_put`, which takes every axis type; UNCONSTRAINED
    entries keep the array's own split), and a traced one is resharded over the Explicit
    axes the spec names (`jax.sharding.reshard`, which changes its type) and constrained
    over the Auto ones (`jax.lax.with_sharding_constraint` with the Explicit names left out,
    so the type's own sharding stays)."""
    if sharding is None:
        return x
    mesh, spec = sharding.mesh, sharding.spec
    explicit = explicit_axes(mesh)
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)
    rank = jax.numpy.ndim(x)
    # An abstract mesh: inside a trace (a constant there too goes the traced way).
    if not (_is_traced(x) or isinstance(mesh, jax.sharding.AbstractMesh)):
        if any(e is PartitionSpec.UNCONSTRAINED for e in spec):  # device_put takes no such
            target, _ = _explicit_target(x, spec, frozenset(mesh.axis_names), frozenset())
            sharding = NamedSharding(mesh, target)
        return jax.device_put(x, sharding)
    target, current = _explicit_target(x, spec, explicit, frozenset())
    if target != current:
        x = jax.sharding.reshard(x, NamedSharding(mesh, target))
    auto = frozenset(mesh.axis_names) - explicit
    auto_spec = keep_axes(spec, auto, rank=rank)
    if any(_names(e) or e is PartitionSpec.UNCONSTRAINED for e in auto_spec):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, auto_spec))
    return x


def enter_shard_map(
    args: PyTree, specs: PyTree, mesh: Any, *, manual: frozenset | None = None
) -> PyTree:
    """`args` (array leaves, or `None`) resharded where their type differs from `specs` over
    the Explicit `manual` axes of `mesh` (default: all its axes), as `jax.shard_map` requires
    of its arguments there; unchanged on a mesh without Explicit axes. `specs` is a prefix of
    `args` with a `PartitionSpec` per array (the `in_specs` given to `jax.shard_map`)."""
    if mesh is None:
        return args
    all_explicit = explicit_axes(mesh)
    explicit = all_explicit if manual is None else all_explicit & manual
    if not explicit:
        return args
    keep = frozenset(mesh.axis_names) - explicit

    def enter(spec: Any, subtree: PyTree) -> PyTree:
        def leaf(x: Any) -> Any:
            if not hasattr(x, "shape"):
                return x
            target, current = _explicit_target(x, spec, all_explicit, keep)
            return x if target == current else jax.sharding.reshard(x, NamedSharding(mesh, target))

        return jax.tree.map(leaf, subtree)

    is_spec = lambda node: node is None or isinstance(node, PartitionSpec)
    return jax.tree.map(
        lambda spec, subtree: subtree if spec is None else enter(spec, subtree),
        specs,
        args,
        is_leaf=is_spec,
    )


def gather_explicit(x: Any) -> Any:
    """`x` whole over the Explicit mesh axes its sharding splits it over (kept as it is over
    Auto ones): serial code, written for one device, cannot take an operand whose type is
    split over an Explicit axis (a matmul over such a dimension must name its output's
    sharding). Anything else comes back unchanged."""
    typed = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    mesh = getattr(typed, "mesh", None)
    if typed is None or mesh is None or not explicit_axes(mesh):
        return x
    explicit = explicit_axes(mesh)
    rank = jax.numpy.ndim(x)
    if keep_axes(typed.spec, explicit, rank=rank) == PartitionSpec(*[None] * rank):
        return x  # not split over an Explicit axis
    if _is_traced(x):
        return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))
    placed: Any = x.sharding  # the concrete mesh: the type's is abstract
    auto = frozenset(mesh.axis_names) - explicit
    return jax.device_put(x, NamedSharding(placed.mesh, keep_axes(placed.spec, auto, rank=rank)))
