"""Collecting the shardings that modules declare through `DeclaresPartitionSpecs`."""

from collections.abc import Hashable, Mapping

import equinox as eqx
import jax
from jax.sharding import PartitionSpec

from ._paths import path_to_str
from ._typing import DeclaresPartitionSpecs


def _declares(node: object) -> bool:
    return isinstance(node, DeclaresPartitionSpecs) and not isinstance(node, type)


def declared_partition_specs(tree: object) -> dict[str, PartitionSpec]:
    """Every leaf sharding that modules inside `tree` declare, keyed by `/`-joined leaf path.

    The outermost declaring module speaks for everything below it: a module that stacks
    declaring modules (one copy per device) folds their declarations into its own.

    **Arguments:**

    - `tree`: an Equinox module or any pytree containing modules.

    **Returns:** a `dict` from leaf path (e.g. `"blocks/0/up/weight"`) to `PartitionSpec`.
    """
    found: dict[str, PartitionSpec] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_declares)
    for path, node in flat:
        if not _declares(node):
            continue
        prefix = path_to_str(path)
        for sub_path, spec in node.__partition_specs__().items():  # type: ignore[attr-defined]
            if not isinstance(spec, PartitionSpec):
                raise TypeError(
                    f"{type(node).__name__}.__partition_specs__() must map leaf paths to "
                    f"PartitionSpec; got {type(spec).__name__} at {sub_path!r}."
                )
            full = f"{prefix}/{sub_path}" if prefix else sub_path
            found[full] = spec
    return found


def stacked_partition_specs(
    stack: object,
    axis_name: Hashable | tuple[Hashable, ...] | None,
    *,
    extra_leading: int = 0,
    unsharded_before: int = 0,
) -> dict[str, PartitionSpec]:
    """Specs for a pytree whose array leaves carry a stacking axis sharded over `axis_name`.

    Whatever modules inside `stack` declare for a single copy is shifted right by one
    dimension (plus `extra_leading` unsharded dimensions after the stacking axis, e.g. layers
    scanned within a pipeline stage, and `unsharded_before` unsharded dimensions in front of
    it, e.g. the repeat axis of a circular pipeline stored `[V, S, ...]`); every other array
    leaf gets just those leading dimensions.
    """
    inner = declared_partition_specs(stack)
    specs: dict[str, PartitionSpec] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(stack)
    for path, leaf in flat:
        # Abstract models (`eqx.filter_eval_shape`, as `build_sharded` makes) hold
        # ShapeDtypeStructs where the arrays will be.
        if not (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
            continue
        key = path_to_str(path)
        inner_spec = tuple(inner.get(key, PartitionSpec()))
        specs[key] = PartitionSpec(
            *([None] * unsharded_before), axis_name, *([None] * extra_leading), *inner_spec
        )
    return specs


def prefixed(prefix: str, specs: Mapping[str, PartitionSpec]) -> dict[str, PartitionSpec]:
    """`specs` with every key moved under `prefix/`."""
    return {f"{prefix}/{k}" if prefix else k: v for k, v in specs.items()}
