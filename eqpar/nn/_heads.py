"""Head counts kept in a block's fields, under tensor parallelism.

Hand-written attention often keeps its head count in a plain `int` field and reshapes a
projection's output with it: `q.reshape(seq, self.n_heads, -1)`. Under a `ColumnParallel`
plan each device holds `d / n` of the projection's `d` features, i.e. `n_heads / n` whole
heads, so the same line splits them into `n_heads` pieces of `d / (n * n_heads)` features:
every head now mixes features of several heads, and nothing fails. Two things here make such
a block right by construction or refuse it:

- **Local counts.** `HeadParallel(fields=("n_heads",))` on the block makes it see
  `n_heads / n` inside a region that is manual over the axis (and the global count
  everywhere else: `unparallelize`, checkpoints, the serial model). `localized` gives the
  block with those fields divided.
- **The refusal.** A block that holds column-parallel linears and int fields is traced once
  more, abstractly, when it runs inside such a region: the outputs of its column-parallel
  linears are followed through elementwise ops and transposes to the first reshape that
  splits their (local) feature axis. A split whose leading factor equals the *global*
  value of one of the block's int fields (and cannot be that field's local value) is a head
  count read from a field that still holds the global count: refused, naming the field and
  the style. JAX offers no hook on a reshape, so the trace is read as a jaxpr.
"""

import contextlib
import dataclasses
import math
import threading
from collections.abc import Hashable, Iterator
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._axes import bound_axis_size
from .._splits import Split, close_split, kept_record, open_split

_state = threading.local()
_MARKER = "eqpar_column_output"


def eqpar_column_output(y: jax.Array) -> jax.Array:
    """The identity: under `marking_columns`, the output of a column-parallel linear passes
    through it so that the jaxpr shows where such an output goes."""
    return y


_marked = jax.jit(eqpar_column_output)


def mark_column_output(y: jax.Array) -> jax.Array:
    """`y` itself; inside the abstract trace of `check_head_reshapes`, marked."""
    return _marked(y) if getattr(_state, "marking", False) else y


@contextlib.contextmanager
def _marking() -> Iterator[None]:
    before = getattr(_state, "marking", False)
    _state.marking = True
    try:
        yield
    finally:
        _state.marking = before


def int_fields(block: PyTree) -> dict[str, int]:
    """The block's own int fields (not bools), by name."""
    found = {}
    for field in dataclasses.fields(block):
        value = getattr(block, field.name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found[field.name] = value
    return found


def localized(block: PyTree, base: type, local_fields: tuple[tuple[str, Hashable], ...]) -> PyTree:
    """`block` with each `(field, axis)` of `local_fields` divided by the size of `axis`
    where that axis is manual here (the block unchanged elsewhere)."""
    changes = {}
    for name, axis in local_fields:
        n = bound_axis_size(axis)
        if n is None or n == 1:
            continue
        value = getattr(block, name)
        if value % n:
            raise ValueError(
                f"{base.__name__}: HeadParallel(fields=...) divides the field `{name}` "
                f"({value}) by the size of axis {axis!r} ({n}), which does not divide it. "
                f"Choose a head count that divides by {n}, or a smaller axis."
            )
        changes[name] = value // n
    if not changes:
        return block
    new = object.__new__(type(block))
    for field in dataclasses.fields(block):
        object.__setattr__(new, field.name, changes.get(field.name, getattr(block, field.name)))
    return new


@contextlib.contextmanager
def head_splits(block: PyTree, local_fields: tuple[tuple[str, Hashable], ...]) -> Iterator[None]:
    """While the localized `block` runs: its activations with a dimension of its local head
    count hold this device's heads (for the serial dropout mask, `eqpar._splits`)."""
    opened = []
    for name, axis in local_fields:
        n = bound_axis_size(axis)
        if n is not None and n > 1:
            open_split(Split(axis, "heads", 0, getattr(block, name)))
            opened.append(axis)
    try:
        yield
    finally:
        for axis in opened:
            close_split(axis, ("heads",))


def check_head_reshapes(
    base: type,
    block: PyTree,
    call: Any,
    args: tuple,
    kwargs: dict,
    *,
    axes: tuple[Hashable, ...],
    local_fields: tuple[str, ...],
) -> None:
    """Refuse, at trace time, a reshape of a column-parallel output into a number of groups
    that equals the global value of one of `block`'s int fields (see the module docstring).
    `block` is what the author's code sees (local fields already divided)."""
    if getattr(_state, "marking", False):
        return  # already inside such a trace (a block within a block)
    sizes = [bound_axis_size(axis) for axis in axes]
    n = math.prod(size for size in sizes if size is not None)
    if n == 1:
        return
    fields = int_fields(block)
    wrong = {value: name for name, value in fields.items() if name not in local_fields}
    right = {value for name, value in fields.items() if name in local_fields}
    right |= {value // n for value in wrong if value % n == 0}
    wrong = {value: name for value, name in wrong.items() if value > 1 and value not in right}
    if not wrong:
        return
    dynamic, static = eqx.partition((block, args, kwargs), eqx.is_array)

    def traced(dynamic: PyTree) -> PyTree:
        b, a, k = eqx.combine(dynamic, static)
        return call(b, *a, **k)

    with _marking(), kept_record():
        try:
            jaxpr = jax.make_jaxpr(traced)(dynamic)
        except Exception:
            return
    found = _first_head_split(jaxpr.jaxpr, {}, wrong)
    if found is None:
        return
    groups, width = found
    name = wrong[groups]
    raise ValueError(
        f"{base.__name__}: a column-parallel layer's output, of which this device holds "
        f"{groups * width} features (1/{n} of them, split over {_axes_text(axes)}), is "
        f"reshaped into {groups} groups: the value of the int field `{name}` ({groups}), "
        f"which counts the groups (heads) of the whole output. Each device holds "
        f"{groups}/{n} of them, so every group would mix features of several heads. Add "
        f"`eqpar.HeadParallel(fields=({name!r},), axis_name={axes[0]!r})` to the plan, keyed by "
        f"this block's path, so that it sees {name}={groups // n if groups % n == 0 else '?'} "
        f"inside the parallel region (and {groups} outside it); or reshape by the head "
        f"size (`x.reshape(seq, -1, head_dim)`)."
    )


def _axes_text(axes: tuple[Hashable, ...]) -> str:
    return " x ".join(repr(axis) for axis in axes)


_SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _first_head_split(jaxpr: Any, marks: dict, wrong: dict[int, str]) -> tuple[int, int] | None:
    """Follow marked feature axes (`var -> axis`) through `jaxpr`; the `(groups, width)` of
    the first reshape that splits one into `groups` in `wrong`, else `None`. `marks` gains
    the marks of `jaxpr`'s variables."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("pjit", "jit") and eqn.params.get("name") == _MARKER:
            marks[eqn.outvars[0]] = len(eqn.outvars[0].aval.shape) - 1
            continue
        inputs = [(var, marks[var]) for var in eqn.invars if _hashable(var) and var in marks]
        if not inputs:
            continue
        inner = next((eqn.params[p] for p in _SUBJAXPR_PARAMS if p in eqn.params), None)
        if inner is not None:
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_marks = {
                inner_var: marks[var]
                for var, inner_var in zip(eqn.invars, inner_jaxpr.invars, strict=False)
                if _hashable(var) and var in marks
            }
            found = _first_head_split(inner_jaxpr, inner_marks, wrong)
            if found is not None:
                return found
            for inner_var, var in zip(inner_jaxpr.outvars, eqn.outvars, strict=False):
                if _hashable(inner_var) and inner_var in inner_marks:
                    marks[var] = inner_marks[inner_var]
            continue
        var, axis = inputs[0]
        shape = tuple(var.aval.shape)
        out = eqn.outvars[0]
        out_shape = tuple(getattr(out.aval, "shape", ()))
        if name == "reshape":
            split = _split_of(shape, axis, out_shape)
            if split is None:
                continue
            first, last = split
            if last == first:
                marks[out] = first
            elif out_shape[first] in wrong:
                return out_shape[first], math.prod(out_shape[first + 1 : last + 1])
        elif name == "transpose":
            marks[out] = tuple(eqn.params["permutation"]).index(axis)
        elif name == "broadcast_in_dim":
            marks[out] = tuple(eqn.params["broadcast_dimensions"])[axis]
        elif len(eqn.outvars) == 1 and out_shape == shape:
            marks[out] = axis  # elementwise (unary, binary, casts, selects)
    return None


def _hashable(var: Any) -> bool:
    return not hasattr(var, "val")  # literals hold values; variables are hashable by identity


def _split_of(shape: tuple, axis: int, out_shape: tuple) -> tuple[int, int] | None:
    """The output dims `first..last` that axis `axis` of `shape` becomes under a reshape to
    `out_shape`, when it maps onto whole output dims; else `None`."""
    before = math.prod(shape[:axis])
    size = shape[axis]
    running = 1
    first = None
    for i, dim in enumerate(out_shape):
        if first is None and running == before and dim != 1:
            first = i
        running *= dim
        if first is not None and running == before * size:
            return first, i
        if first is not None and running > before * size:
            return None
    return None
