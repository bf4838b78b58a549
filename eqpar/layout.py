"""Layouts as filtered pytrees: `TensorLayout`, `LayoutMap` and `partition_specs`.

The layout of a model is a pytree of the model's own structure whose array leaves are
`PartitionSpec`s and whose other leaves are `None`. Modules that need a particular sharding
declare it (`eqpar.DeclaresPartitionSpecs`); a `LayoutMap` of regular expressions over leaf
paths (`layers/0/weight`) fills in the rest.
"""

__all__ = [
    "LayoutMap",
    "TensorLayout",
    "expand_specs",
    "named_shardings",
    "partition_specs",
]

import re
import warnings
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import keystr

from ._declare import declared_partition_specs
from ._matching import compile_key, matching_keys, single_match, unused_key_hints
from ._paths import path_to_str
from ._specs import check_spec, entry_names, is_spec_leaf
from ._typing import PyTree, Specs
from .mesh import DeviceMesh, as_jax_mesh

AxisEntry = str | tuple[str, ...] | None
"""One dimension of a layout: a mesh axis name, several names, or `None` (not sharded)."""


def is_array_like(leaf: object) -> bool:
    """An array leaf of a concrete or an abstract (`filter_eval_shape`) model."""
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def _extended(declared: PartitionSpec, mapped: PartitionSpec, rank: int) -> PartitionSpec | None:
    """`declared` with `mapped`'s axes added on the dimensions it leaves open, or `None` when
    they disagree on a dimension both split, or an axis would split two dimensions."""
    entries = []
    for mine, theirs in zip(_normalized(declared, rank), _normalized(mapped, rank)):
        if mine is not None and theirs is not None and mine != theirs:
            return None
        entries.append(mine if mine is not None else theirs)
    names = [name for entry in entries for name in entry_names(entry)]
    if len(names) != len(set(names)):
        return None
    if entries == list(_normalized(declared, rank)):
        return declared
    return PartitionSpec(*entries)


def _normalized(spec: PartitionSpec | Sequence[AxisEntry], rank: int) -> tuple:
    """Spec entries padded to `rank`, with `("a",)` written as `"a"` and `()` as `None`."""
    entries = []
    for entry in tuple(spec):
        names = entry_names(entry)
        entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return tuple(entries) + (None,) * (rank - len(entries))


def _mesh_axes(mesh: DeviceMesh | Mesh) -> dict[Hashable, int]:
    jax_mesh = as_jax_mesh(mesh)
    return dict(jax_mesh.shape)


class TensorLayout:
    """How one array is spread over a mesh: one entry per dimension.

    **Arguments:**

    - `axes`: one entry per array dimension: a mesh axis name, a tuple of names (the dimension
      is split over all of them, major to minor), or `None` (not split).
    - `device_mesh`: optional `DeviceMesh` / `jax.sharding.Mesh`; when given, every axis name
      must be one of its axes. `LayoutMap` attaches its own mesh.

    **Attributes:** `axes`, `device_mesh`, `spec` (a `PartitionSpec`) and `sharding` (a
    `NamedSharding`, needs a mesh).

    ```python
    import eqpar
    from jax.sharding import PartitionSpec as P
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    layout = eqpar.TensorLayout(("model", None), mesh)
    assert layout.spec == P("model", None)
    assert layout.sharding.spec == P("model", None)
    ```
    """

    def __init__(
        self,
        axes: Sequence[AxisEntry] | PartitionSpec,
        device_mesh: DeviceMesh | Mesh | None = None,
    ):
        if isinstance(axes, str):
            raise TypeError(
                f"TensorLayout: axes must be a sequence with one entry per dimension; got the "
                f"string {axes!r}. Write ({axes!r},) for a 1-D layout."
            )
        entries: list[AxisEntry] = []
        seen: list[str] = []
        for dim, entry in enumerate(tuple(axes)):
            if isinstance(entry, list):
                entry = tuple(entry)
            names = entry_names(entry)
            for name in names:
                if not isinstance(name, str):
                    raise TypeError(
                        f"TensorLayout: axes[{dim}] must be a mesh axis name (str), a tuple of "
                        f"names or None; got {entry!r}."
                    )
                if name in seen:
                    raise ValueError(
                        f"TensorLayout: mesh axis {name!r} is used by two dimensions of "
                        f"{tuple(axes)!r}; an axis can split at most one dimension."
                    )
                seen.append(name)
            entries.append(entry)
        self._axes = tuple(entries)
        self._device_mesh = device_mesh
        if device_mesh is not None:
            known = _mesh_axes(device_mesh)
            unknown = [n for n in seen if n not in known]
            if unknown:
                raise ValueError(
                    f"TensorLayout: axes {self._axes!r} name {unknown}, which the mesh does not "
                    f"have; its axes are {tuple(known)}."
                )

    @property
    def axes(self) -> tuple[AxisEntry, ...]:
        return self._axes

    @property
    def device_mesh(self) -> DeviceMesh | Mesh | None:
        return self._device_mesh

    @property
    def spec(self) -> PartitionSpec:
        return PartitionSpec(*self._axes)

    @property
    def sharding(self) -> NamedSharding:
        if self._device_mesh is None:
            raise ValueError(
                f"TensorLayout{self._axes!r} has no device_mesh, so it has no NamedSharding; "
                f"build it with TensorLayout(axes, device_mesh) or .with_mesh(mesh)."
            )
        return NamedSharding(as_jax_mesh(self._device_mesh), self.spec)

    def with_mesh(self, device_mesh: DeviceMesh | Mesh) -> "TensorLayout":
        """The same axes on `device_mesh` (checked against its axis names)."""
        return TensorLayout(self._axes, device_mesh)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorLayout):
            return NotImplemented
        return _normalized(self._axes, 0) == _normalized(other._axes, 0) and (
            self._device_mesh == other._device_mesh
        )

    def __hash__(self) -> int:
        return hash(_normalized(self._axes, 0))

    def __repr__(self) -> str:
        return f"TensorLayout({self._axes!r})"


LayoutLike = TensorLayout | PartitionSpec | tuple | list | None
"""What a `LayoutMap` accepts as a value: a layout, a spec, a tuple/list of axes or `None`."""


class LayoutMap(MutableMapping[str, TensorLayout]):
    """Layouts for the leaves of a model, keyed by leaf path or regular expression.

    Keys are matched against `/`-joined leaf paths (`"layers/0/weight"`, see
    `eqpar.leaf_paths`): a key equal to the path wins; otherwise every key is tried as a
    regular expression with `re.fullmatch`, and exactly one may match. A leaf that no key
    matches is replicated, unless `strict=True`, where `partition_specs` raises for it and for
    keys that match no leaf.

    Values may be a `TensorLayout`, a `PartitionSpec`, a tuple/list of axes (one per
    dimension) or `None` (replicated). A non-empty layout must have one entry per dimension of
    the leaves it matches.

    The map is a real mapping of its keys: `len`, iteration, `keys()`, `del` and `==` see the
    keys as written. `layout_map[path]`, `path in layout_map` and `layout_map.get(path,
    default)` resolve a leaf path through the matching rules above (`KeyError` / `False` /
    `default` when nothing matches).

    **Arguments:**

    - `device_mesh`: the `DeviceMesh` (or `jax.sharding.Mesh`) the layouts refer to.
    - `strict`: raise instead of replicating leaves that no key matches.

    ```python
    import eqpar
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    layout_map = eqpar.LayoutMap(mesh)
    layout_map["layers/0/weight"] = ("model", None)
    layout_map["layers/.*/bias"] = (None,)
    assert layout_map["layers/0/weight"].axes == ("model", None)
    assert "layers/3/bias" in layout_map and layout_map.get("head/weight") is None
    assert list(layout_map) == ["layers/0/weight", "layers/.*/bias"]
    ```
    """

    def __init__(self, device_mesh: DeviceMesh | Mesh, *, strict: bool = False):
        as_jax_mesh(device_mesh)
        self._device_mesh = device_mesh
        self.strict = strict
        self._layouts: dict[str, TensorLayout] = {}
        self._patterns: dict[str, re.Pattern] = {}

    @property
    def device_mesh(self) -> DeviceMesh | Mesh:
        return self._device_mesh

    def _as_layout(self, key: str, value: object) -> TensorLayout:
        if value is None:
            return TensorLayout((), self._device_mesh)
        if isinstance(value, TensorLayout):
            if value.device_mesh is not None and as_jax_mesh(value.device_mesh) != as_jax_mesh(
                self._device_mesh
            ):
                raise ValueError(
                    f"LayoutMap[{key!r}]: the TensorLayout is bound to another mesh than the "
                    f"map's; build it without device_mesh and the map attaches its own."
                )
            return value.with_mesh(self._device_mesh)
        if isinstance(value, PartitionSpec | tuple | list):
            try:
                return TensorLayout(tuple(value), self._device_mesh)
            except (TypeError, ValueError) as error:
                raise type(error)(f"LayoutMap[{key!r}]: {error}") from None
        raise TypeError(
            f"LayoutMap[{key!r}]: a layout must be a TensorLayout, a PartitionSpec, a tuple/list "
            f"of mesh axis names or None; got {type(value).__name__}."
        )

    def __setitem__(self, key: str, value: LayoutLike) -> None:
        pattern = compile_key(key, "LayoutMap")
        layout = self._as_layout(key, value)
        self._layouts[key] = layout
        self._patterns[key] = pattern

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]
        del self._patterns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def matching_keys(self, path: str) -> list[str]:
        """The keys that select `path`: the key equal to it if there is one, else every key
        whose regular expression matches the whole path."""
        return matching_keys(self._patterns, path)

    def _match(self, path: str) -> tuple[str, TensorLayout] | None:
        key = single_match(self._patterns, path, "LayoutMap")
        return None if key is None else (key, self._layouts[key])

    def __getitem__(self, path: str) -> TensorLayout:
        found = self._match(path)
        if found is None:
            raise KeyError(
                f"LayoutMap: no key matches {path!r}; use .get(path) for None (replicated)."
            )
        return found[1]

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and self._match(path) is not None

    def lookup(self, path: str) -> TensorLayout | None:
        """The layout for leaf `path`; `None` (replicated) when no key matches, or a
        `ValueError` then if the map is strict."""
        found = self._match(path)
        if found is None:
            if self.strict:
                raise ValueError(
                    f"LayoutMap(strict=True): no key matches leaf path {path!r}; add a key for "
                    f"it (None to replicate) or use strict=False."
                )
            return None
        return found[1]

    def unused_keys(self, tree: PyTree) -> list[str]:
        """The keys that match no array leaf path of `tree`."""
        used: set[str] = set()
        for path in _array_paths(tree):
            used.update(self.matching_keys(path))
        return [key for key in self._layouts if key not in used]

    def unmatched_paths(self, tree: PyTree) -> list[str]:
        """The array leaf paths of `tree` that no key matches."""
        return [path for path in _array_paths(tree) if not self.matching_keys(path)]

    def __repr__(self) -> str:
        items = ", ".join(f"{k!r}: {v.axes!r}" for k, v in self._layouts.items())
        return f"LayoutMap({{{items}}}, strict={self.strict})"


def _array_paths(tree: PyTree) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [path_to_str(path) for path, leaf in flat if is_array_like(leaf)]


def partition_specs(
    module: PyTree,
    layout_map: LayoutMap | None = None,
    *,
    mesh: DeviceMesh | Mesh | None = None,
    default: Callable[[str, jax.ShapeDtypeStruct], PartitionSpec] | None = None,
) -> Specs:
    """The layout of `module` as a filtered pytree: its structure, a `PartitionSpec` at every
    array leaf, `None` at every other leaf.

    What modules declare (`eqpar.DeclaresPartitionSpecs`) comes first; `layout_map` fills in
    the leaves they leave open, and extends a declared spec on the dimensions it leaves open
    (say `model` on a pipeline stack's per-layer dimensions, as FSDP adds `data`); the rest
    is replicated (`P()`). Where a declaration and the layout map split the same dimension
    differently (or would use one axis twice), it raises. With a mesh (the layout map's, or
    `mesh`), every spec is checked against it: known axes, dimensions divisible.

    The result works as `jax.jit` shardings
    (`jax.tree.map(lambda s: NamedSharding(mesh, s), specs)`) and as the `in_specs` /
    `out_specs` of `eqpar.shard_map` for this module.

    **Arguments:**

    - `module`: an Equinox module or any pytree; array leaves may be abstract
      (`jax.ShapeDtypeStruct`, e.g. from `eqx.filter_eval_shape`).
    - `layout_map`: an optional `LayoutMap`.
    - `mesh`: the mesh to check against when there is no layout map.
    - `default`: optional `(path, leaf) -> PartitionSpec` for leaves nothing else speaks for
      (instead of `P()`); used by `FSDP`.

    **Returns:** a pytree like `module` with `PartitionSpec` / `None` leaves.

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    mlp = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    layout_map = eqpar.LayoutMap(mesh)
    layout_map["layers/0/weight"] = ("model", None)
    layout_map["layers/0/bias"] = eqpar.TensorLayout(("model",))
    specs = eqpar.partition_specs(mlp, layout_map)
    assert specs.layers[0].weight == P("model", None) and specs.layers[1].weight == P()
    ```
    """
    if layout_map is not None and mesh is None:
        mesh = layout_map.device_mesh
    axes = None if mesh is None else _mesh_axes(mesh)
    declared = declared_partition_specs(module)
    flat, treedef = jax.tree_util.tree_flatten_with_path(module)
    specs: list[PartitionSpec | None] = []
    array_paths: dict[str, str] = {}  # joined path -> the leaf's key path, to name collisions
    unmatched: list[str] = []
    for key_path, leaf in flat:
        if not is_array_like(leaf):
            specs.append(None)
            continue
        path = path_to_str(key_path)
        if path in array_paths:
            raise ValueError(
                f"partition_specs: two leaves have the path {path!r} once joined with '/' "
                f"({array_paths[path]} and {keystr(key_path)}), so a layout key or a declared "
                f"spec could not tell them apart. Rename the dict key that contains '/'."
            )
        array_paths[path] = keystr(key_path)
        shape = tuple(leaf.shape)
        declared_spec = declared.get(path)
        if declared_spec is not None:
            check_spec(path, declared_spec, shape, axes, source="the module's __partition_specs__")
        mapped = layout_map._match(path) if layout_map is not None else None
        mapped_spec = None
        if mapped is not None:
            map_key, layout = mapped
            mapped_spec = layout.spec
            check_spec(
                path, mapped_spec, shape, axes, source=f"LayoutMap[{map_key!r}]", exact_rank=True
            )
            if declared_spec is not None:
                extended = _extended(declared_spec, mapped_spec, len(shape))
                if extended is None:
                    raise ValueError(
                        f"partition_specs: leaf {path!r} is declared {declared_spec} by its "
                        f"module but LayoutMap[{map_key!r}] gives {mapped_spec}; a layout map "
                        f"may only add axes on the dimensions a declaration leaves open (as "
                        f"FSDP does). Remove or narrow that key, or make it agree."
                    )
                declared_spec = extended
        if declared_spec is not None:
            specs.append(declared_spec)
        elif mapped_spec is not None:
            specs.append(mapped_spec)
        else:
            if layout_map is not None and layout_map.strict:
                unmatched.append(path)
            if default is not None:
                spec = default(path, jax.ShapeDtypeStruct(shape, leaf.dtype))
                check_spec(path, spec, shape, axes, source="the default layout")
                specs.append(spec)
            else:
                specs.append(PartitionSpec())
    stray = sorted(set(declared) - set(array_paths))
    if stray:
        raise ValueError(
            f"partition_specs: modules declare specs for {stray}, which are not array leaves of "
            f"the model; fix the module's __partition_specs__ keys."
        )
    unused = [] if layout_map is None else layout_map.unused_keys(module)
    if layout_map is not None and layout_map.strict:
        if unmatched or unused:
            raise ValueError(
                f"partition_specs with LayoutMap(strict=True): leaf paths no key matches: "
                f"{unmatched}; keys that match no leaf: "
                f"{unused_key_hints(unused, list(array_paths))}. Add or fix keys (None "
                f"replicates a leaf), or use strict=False."
            )
    elif unused:
        warnings.warn(
            f"partition_specs: LayoutMap keys that match no array leaf: "
            f"{unused_key_hints(unused, list(array_paths))}; the leaves they were meant for are "
            f"replicated. Fix the keys (`eqpar.leaf_paths(model)` lists the paths).",
            stacklevel=2,
        )
    return jax.tree_util.tree_unflatten(treedef, specs)


def named_shardings(specs: Specs, mesh: DeviceMesh | Mesh | jax.sharding.AbstractMesh) -> PyTree:
    """Turn a specs pytree into `NamedSharding`s of `mesh` (`None` leaves stay `None`).

    **Arguments:**

    - `specs`: a pytree with `PartitionSpec` leaves, e.g. from `partition_specs`.
    - `mesh`: a `DeviceMesh` or `jax.sharding.Mesh`; or a `jax.sharding.AbstractMesh`
      (axis sizes, no devices), whose shardings lay out `jax.ShapeDtypeStruct`s for
      `eqpar.estimate`.

    **Returns:** the same pytree with `NamedSharding` leaves, ready for `jax.jit` or
    `jax.device_put`.

    ```python
    import equinox as eqx, jax, eqpar
    mesh = eqpar.DeviceMesh((8,), ("data",))
    mlp = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    shardings = eqpar.named_shardings(eqpar.partition_specs(mlp), mesh)
    params, static = eqx.partition(mlp, eqx.is_array)
    placed = eqx.combine(jax.device_put(params, shardings), static)
    ```
    """
    jax_mesh = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else as_jax_mesh(mesh)
    return jax.tree.map(
        lambda spec: NamedSharding(jax_mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def expand_specs(
    specs: Specs,
    tree: PyTree,
    *,
    where: str = "tree",
    caller: str = "expand_specs",
    is_array: Callable[[object], bool] = is_array_like,
) -> Specs:
    """Broadcast a specs prefix over `tree`: the result has the structure of
    `eqx.filter(tree, is_array)`, with a `PartitionSpec` at every array leaf.

    `specs` is a `PartitionSpec` (for every array below it), `None` (for a subtree without
    arrays), or a pytree prefix of `tree` with those at its leaves (what `partition_specs`
    returns). A `None` over arrays, or a structure that does not fit, raises.

    **Arguments:**

    - `specs`: the specs prefix.
    - `tree`: the pytree the specs describe.
    - `where`, `caller`: how error messages name the tree and the calling function.
    - `is_array`: which leaves are arrays (default: arrays and `jax.ShapeDtypeStruct`s).

    **Returns:** the full specs pytree.

    ```python
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from eqpar.layout import expand_specs
    tree = {"w": jnp.ones((8, 2)), "b": jnp.ones(2), "name": "layer"}
    full = expand_specs({"w": P("data"), "b": P(), "name": None}, tree)
    assert full == {"w": P("data"), "b": P(), "name": None}
    assert expand_specs(P(), tree) == {"w": P(), "b": P(), "name": None}
    ```
    """

    def expand(prefix: object, subtree: object, here: str) -> PyTree:
        if isinstance(prefix, PartitionSpec):
            return jax.tree.map(lambda leaf: prefix if is_array(leaf) else None, subtree)
        if prefix is None:
            flat = jax.tree_util.tree_flatten_with_path(subtree)[0]
            arrays = [path for path, leaf in flat if is_array(leaf)]
            if arrays:
                raise ValueError(
                    f"{caller}: {here}{keystr(arrays[0])} is an array but its spec is None; "
                    f"give P() to replicate it or a PartitionSpec to split it."
                )
            return jax.tree.map(lambda _: None, subtree)
        try:
            return jax.tree_util.tree_map_with_path(
                lambda path, pre, sub: expand(pre, sub, here + keystr(path)),
                prefix,
                subtree,
                is_leaf=is_spec_leaf,
            )
        except ValueError as error:
            if str(error).startswith(f"{caller}:"):
                raise
            raise ValueError(
                f"{caller}: the specs for {here} do not fit its structure: give a "
                f"PartitionSpec, or a pytree of its structure with PartitionSpec at array "
                f"leaves and None elsewhere (e.g. from eqpar.partition_specs). JAX said: {error}"
            ) from None

    return expand(specs, tree, where)
