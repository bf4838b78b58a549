"""The size of a mesh axis inside `shard_map`, or an error that says how to bind it.

Shared by every module whose functions or layers run over a named mesh axis, so that calling
one outside `shard_map` (or with a misspelt axis) gives one message with the fix.
"""

from jax import lax

from ._typing import AxisName


def axis_size(axis_name: AxisName, owner: str, *, argument: str = "axis_name") -> int:
    """The size of mesh axis `axis_name` (a tuple of axes: the product of their sizes) where
    it is bound; where it is not, a `ValueError` that names `owner`, the `argument` that
    named the axis, and how to bind it."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError as error:
        raise ValueError(
            f"{owner}: `{argument}={axis_name!r}` is not a mesh axis bound here. Call it inside "
            f"`eqpar.shard_map` (or `jax.shard_map`) over a mesh with that axis, passing a "
            f"model with the specs of `eqpar.partition_specs(model)` as in_specs; outside "
            f"shard_map, `eqpar.unparallelize` gives a converted model's serial form."
        ) from error


def bound_axis_size(axis_name: AxisName) -> int | None:
    """The size of mesh axis `axis_name` where it is bound (inside `shard_map` over it), else
    `None`: for layers that act only where an axis splits their input."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        return None


def axis_names(axis_name: AxisName) -> tuple:
    """The mesh axis names in `axis_name` (one name, or a tuple or list of them)."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
