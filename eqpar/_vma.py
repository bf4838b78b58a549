"""Replication types inside `shard_map` (its `check_vma`), read the same way on every JAX.

With `check_vma=True` JAX types every value inside `shard_map` with the mesh axes over which
it may differ between devices. The pipeline executors use that to cast values once, and the
tensor-parallel layers to tell a sequence-sharded activation from a replicated one.
"""

from collections.abc import Hashable

import jax
from jax import lax
from jaxtyping import PyTree


def varying_axes(x: PyTree) -> frozenset:
    """The mesh axes over which `x` (an array, tracer or ShapeDtypeStruct) may differ."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # older JAX: a ShapeDtypeStruct vma None


def varies_over(x: PyTree, axis_name: Hashable) -> bool | None:
    """Whether `x` differs over the mesh axis `axis_name` (inside `shard_map`); `None` when
    JAX does not track it (`check_vma=False`, where even the device index looks replicated).
    For a tuple of axes: whether it differs over any of them."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if any(name not in varying_axes(jax.lax.axis_index(name)) for name in names):
        return None
    return bool(set(names) & varying_axes(x))


def cast_varying(x: PyTree, axes: frozenset) -> PyTree:
    """`x` typed as varying over `axes` (a no-op for the axes it already varies over). Its
    transpose sums the cotangent over those axes, once, wherever the cast is placed."""
    missing = tuple(sorted(axes - varying_axes(x), key=str))
    if not missing:
        return x
    pcast = getattr(lax, "pcast", None)
    if pcast is not None:
        return pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # type: ignore[attr-defined]  # jax < 0.8.2
