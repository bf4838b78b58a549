"""The one spec checker: does a `PartitionSpec` fit an array on a mesh?

`partition_specs`, `shard_map` and `with_sharding_constraint` all take specs from the user;
each asks this function, so a spec with too many entries, an unknown or repeated mesh axis,
or a dimension that does not divide gets the same message wherever it comes in. It takes the
mesh as `{axis name: size}` so that the low-level modules can use it without importing the
mesh module.
"""

from collections.abc import Hashable, Mapping

from jax.sharding import PartitionSpec


def entry_names(entry: object) -> tuple[Hashable, ...]:
    """The mesh axes one spec entry names: `None` -> `()`, `"a"` -> `("a",)`."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, tuple):
        return entry
    return (entry,)


def show_spec(spec: PartitionSpec) -> str:
    """`spec` as messages write it, `P('data', None)`, on every JAX (before 0.10 its repr
    spells out `PartitionSpec(...)`)."""
    return repr(spec).replace("PartitionSpec(", "P(", 1)


def check_spec(
    path: str,
    spec: PartitionSpec,
    shape: tuple[int, ...],
    axes: Mapping[Hashable, int] | None,
    *,
    source: str,
    exact_rank: bool = False,
) -> None:
    """Raise a `ValueError` naming `source` and the leaf `path` if `spec` cannot shard an
    array of `shape` over a mesh with `axes` (`None`: check the rank only)."""
    entries = tuple(spec)
    where = f"leaf {path!r}" if path else "the array"
    shown = show_spec(spec)
    if exact_rank and entries and len(entries) != len(shape):
        raise ValueError(
            f"{source} gives {shown} for {where} of shape {shape}: {len(entries)} entries for "
            f"{len(shape)} dimensions; give one entry per dimension."
        )
    if len(entries) > len(shape):
        raise ValueError(
            f"{source} gives {shown} for {where} of shape {shape}: {len(entries)} entries but "
            f"only {len(shape)} dimensions. Drop the extra entries (a spec may be shorter than "
            f"the rank; missing entries are not split)."
        )
    if axes is None:
        return
    names = [name for entry in entries for name in entry_names(entry)]
    unknown = [name for name in names if name not in axes]
    if unknown:
        raise ValueError(
            f"{source} gives {shown} for {where}, naming mesh axes {unknown} that the mesh does "
            f"not have; its axes are {tuple(axes)}. Use those names, or build the mesh with "
            f"the axis."
        )
    repeated = sorted({repr(name) for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"{source} gives {shown} for {where}, using the mesh axes {', '.join(repeated)} more "
            f"than once; each mesh axis can split one dimension."
        )
    for dim, entry in enumerate(entries):
        split = 1
        for name in entry_names(entry):
            split *= axes[name]
        if shape[dim] % split:
            sizes = ", ".join(f"{name!r} of size {axes[name]}" for name in entry_names(entry))
            raise ValueError(
                f"{source} gives {shown} for {where} of shape {shape}: dimension {dim} (size "
                f"{shape[dim]}) does not divide by {split} (mesh axes {entry_names(entry)}: "
                f"{sizes}); leave that dimension whole (None), split another one, or change "
                f"the size."
            )


def is_spec_leaf(node: object) -> bool:
    """Where a tree of specs stops: a `PartitionSpec`, or `None` (replicated / not an array)."""
    return node is None or isinstance(node, PartitionSpec)
