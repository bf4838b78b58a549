"""Leaf paths of pytrees as `/`-joined strings, e.g. `layers/0/weight`."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey


def key_to_str(key: object) -> str:
    """One path entry as text: an attribute name, a sequence index or a dict key."""
    # jax's stubs type these key classes loosely, so read the one field each has by name.
    for field in ("name", "idx", "key"):
        if isinstance(key, GetAttrKey | SequenceKey | DictKey | FlattenedIndexKey) and hasattr(
            key, field
        ):
            return str(getattr(key, field))
    return str(key)


def path_to_str(path: tuple) -> str:
    """`(GetAttrKey('layers'), SequenceKey(0), GetAttrKey('weight'))` -> `'layers/0/weight'`."""
    return "/".join(key_to_str(k) for k in path)


def leaf_paths(
    tree: object, *, is_leaf: Callable[[object], bool] | None = None, arrays_only: bool = True
) -> list[str]:
    """The `/`-joined paths of the leaves of `tree`, in flattening order.

    **Arguments:**

    - `tree`: any pytree, usually an Equinox module.
    - `is_leaf`: passed to `jax.tree_util.tree_flatten_with_path`.
    - `arrays_only`: keep only array leaves (what gets a sharding).

    **Returns:** a list of strings such as `"layers/0/weight"`.

    ```python
    import equinox as eqx, jax
    from eqpar import leaf_paths
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    assert leaf_paths(mlp)[:2] == ["layers/0/weight", "layers/0/bias"]
    ```
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [
        path_to_str(path)
        for path, leaf in flat
        if not arrays_only or eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
    ]


def children(node: object) -> tuple[list[tuple[tuple, Any]], Any]:
    """The direct children of `node`, one pytree level down, each with its key path, and the
    treedef that puts them back; for a leaf, the treedef is a leaf's."""
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)


def map_children(node: object, path: tuple, fn: Callable[[object, tuple], object]) -> object:
    """`node` with each direct child `c` (one pytree level down, at `path + key`) replaced by
    `fn(c, path + key)`; a leaf comes back as it is. Static fields of modules stay."""
    flat, treedef = children(node)
    if jax.tree_util.treedef_is_leaf(treedef):
        return node
    return jax.tree_util.tree_unflatten(treedef, [fn(child, (*path, *key)) for key, child in flat])
