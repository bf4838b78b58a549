"""Type aliases shared by every eqpar module."""

from collections.abc import Hashable, Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

from jax.sharding import PartitionSpec
from jaxtyping import PyTree

AxisName: TypeAlias = Hashable
"""A mesh axis name as `jax.shard_map` and `lax.ppermute` accept it (usually a `str`)."""

Specs: TypeAlias = PyTree[PartitionSpec | None]
"""A pytree of `PartitionSpec`s (or `None` for non-array leaves), shaped like another pytree."""

Shape: TypeAlias = tuple[int, ...]


@runtime_checkable
class DeclaresPartitionSpecs(Protocol):
    """The one protocol by which a module states the sharding it requires.

    `__partition_specs__` returns a mapping from leaf paths *relative to the module*
    (`/`-joined field names and indices, as `eqpar.leaf_paths` writes them, e.g.
    `"weight"` or `"stages/layers/0/bias"`) to the `PartitionSpec` that leaf must have.
    Leaves it does not name are left to the layout map (replicated by default).

    A module that stacks copies of other modules (one per device) prepends its own
    axis to whatever the stacked modules declare themselves.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar

    class RowSplit(eqx.Module):
        weight: jax.Array

        def __partition_specs__(self):
            return {"weight": P("model", None)}

    layer = RowSplit(jnp.ones((8, 4)))
    assert isinstance(layer, eqpar.DeclaresPartitionSpecs)
    assert eqpar.partition_specs(layer).weight == P("model", None)
    ```
    """

    def __partition_specs__(self) -> Mapping[str, PartitionSpec]: ...


__all__ = ["Any", "AxisName", "DeclaresPartitionSpecs", "PyTree", "Shape", "Specs"]
