"""A converted layer called outside a manual region opens its own.

The twins that `eqpar.parallelize` makes compute on their block of the parameters inside
`shard_map` over their mesh axis. Called anywhere else (the user's one-device step: `jax.jit`
around a per-example `jax.vmap`, on arrays placed on a mesh), a twin opens a `jax.shard_map`
over just its axis, on the mesh its parameters live on, and returns what the serial layer
returns: the global view. The mesh's other axes stay with the compiler. Explicit ones become
Auto for the region's span (`jax.sharding.auto_axes`): a region under the user's per-example
`vmap` cannot carry an explicit batch sharding across its boundary (JAX's batching rule for
`shard_map` gives the batch dimension no axis, so the batch would be gathered), while an Auto
axis lets the compiler keep the batch where it is. Each layer then moves what it moves inside
the `eqpar.shard_map` route (one reduction per row-parallel layer, attention or embedding);
between layers the compiler lays the activations out, which can move less (a head's logits
left split over the vocabulary) and under FSDP gathers a weight where each use needs it.
A layer inside a manual region over other axes (`eqpar.shard_map(..., axis_names=...)`
without its axis) is refused: XLA does not partition a region nested that way.
Where a layer's work cannot leave the other axes to the compiler, the region spans the mesh:
a mixture of experts sorts its tokens (a sort along a compiler-split dimension gathers it
whole), and a pipeline runs its stages' schedule; both split the batch over the data axes
inside (`batch_axes`). So does a block whose sequence `SplitSequence` splits (its tokens
move between devices, and XLA would gather a compiler-split batch around it).

eqpar owns this because no JAX API opens a manual region only where one is not open yet,
nor finds the mesh from the arrays a layer holds.
"""

import dataclasses
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AxisType, PartitionSpec
from jaxtyping import PyTree

from .._axes import bound_axis_size
from .._axis_types import enter_shard_map, keep_axes
from .._declare import declared_partition_specs
from .._paths import path_to_str
from .._splits import fresh_record


def axis_names_of(axis_name: Hashable) -> tuple[Hashable, ...]:
    """The mesh axes that `axis_name` (one axis or a tuple of them) names."""
    return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def needs_own_region(axis_name: Hashable) -> bool:
    """Whether `axis_name` is unbound here (not inside `shard_map` over it), so that a layer
    split over it must open its own region."""
    return bound_axis_size(axis_name) is None


def layer_specs(layer: PyTree) -> PyTree:
    """The `shard_map` specs of one converted layer: what it declares by leaf path
    (`__partition_specs__`), replicated elsewhere, `None` at non-array leaves."""
    declared = dict(layer.__partition_specs__())

    def spec(path: tuple, leaf: Any) -> PartitionSpec | None:
        if not eqx.is_array(leaf):
            return None
        return declared.get(path_to_str(path), PartitionSpec())

    return jax.tree_util.tree_map_with_path(spec, layer)


def _region_mesh(owner: str, layer: PyTree, names: tuple[Hashable, ...]) -> Any:
    """The mesh to open the region on: the one `jax.set_mesh` set, else the mesh the layer's
    placed parameters live on (their type says it, traced or not)."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and all(name in context.axis_names for name in names):
        return context
    mesh = placed_mesh(layer, names)
    if mesh is not None:
        return mesh
    missing = names[0] if len(names) == 1 else names
    where = "no array parameters"
    for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(layer, eqx.is_array)):
        sharding = getattr(leaf, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        where = (
            f"`{path_to_str(path)}` is on a mesh with axes {tuple(mesh.axis_names)}"
            if mesh is not None and not getattr(mesh, "empty", False)
            else f"`{path_to_str(path)}` is on {len(getattr(sharding, 'device_set', ()) or ())} "
            f"device(s), not on a mesh"
        )
        break
    raise ValueError(
        f"{owner}: the mesh axis {missing!r} is not bound here (this is not inside "
        f"`eqpar.shard_map` over it), so the layer opens its own region, on the mesh its "
        f"parameters are placed on; but they are not placed on a mesh with that axis "
        f"({where}). "
        f"Place the model: `eqpar.parallelize(model, plan, mesh=mesh)` places the converted "
        f"model, or `jax.device_put(model, eqpar.named_shardings(eqpar.partition_specs(model), "
        f"mesh))`; or run the step under `with jax.set_mesh(mesh):`, or inside "
        f"`eqpar.shard_map` over {missing!r}. (`eqpar.unparallelize(model)` gives the serial "
        f"model, for one device.)"
    )


def placed_mesh(tree: PyTree, names: tuple[Hashable, ...]) -> Any:
    """The mesh with `names` that `tree`'s arrays are placed on (their type says it, traced
    or not), or `None`."""
    for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and all(n in mesh.axis_names for n in names):
            return mesh
    return None


def axis_is_explicit(owner: str, layer: PyTree, axis_name: Hashable) -> bool:
    """Whether `axis_name` (any of its axes) is Explicit on the mesh the layer's region
    opens on: the arrays' types then carry their sharding over it."""
    names = axis_names_of(axis_name)
    mesh = _region_mesh(owner, layer, names)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return any(types[name] == AxisType.Explicit for name in names)


def call_in_own_region(
    owner: str,
    axis_name: Hashable,
    layer: PyTree,
    call: Callable[..., PyTree],
    args: tuple,
    *,
    arg_specs: tuple,
    out_specs: PyTree,
    specs: PyTree | None = None,
    arg_names: tuple[str, ...] | None = None,
) -> PyTree:
    """`call(layer, *args)` inside `jax.shard_map` over `axis_name` only, on the mesh of
    `layer`'s parameters (see the module docstring).

    **Arguments:**

    - `owner`: the layer's class name, for messages.
    - `axis_name`: the axis (or tuple of axes) the layer splits over.
    - `layer`: the converted layer; its specs come from its `__partition_specs__`.
    - `call`: `(layer, *args) -> output`, run where `axis_name` is bound (it calls the layer
      again, which then takes its ordinary path).
    - `args`: the array arguments (pytrees; non-array leaves are closed over by `call`).
    - `arg_specs`: one spec (prefix) per argument, global view.
    - `out_specs`: the output's specs, global view.
    - `specs`: `layer`'s specs, where its own `__partition_specs__` does not give them (a
      whole model: `manual_specs`).
    - `arg_names`: the arguments' names, for messages.

    **Returns:** the output, global view.
    """
    names = axis_names_of(axis_name)
    manual = frozenset(jax.sharding.get_abstract_mesh().manual_axes)
    if manual:
        left = tuple(name for name in names if name not in manual)
        missing = left[0] if len(left) == 1 else left
        raise ValueError(
            f"{owner}: called inside a manual region over {tuple(sorted(manual, key=str))} "
            f"that leaves {missing!r} to the compiler, where the layer would open a region of "
            f"its own over {missing!r} nested in it, which XLA does not partition. Make "
            f"{missing!r} manual too (`eqpar.shard_map(..., axis_names=...)` with it, or "
            f"without `axis_names`), or call the step outside `shard_map`, where each layer "
            f"opens its own region."
        )
    mesh = _region_mesh(owner, layer, names)
    arg_names = (
        tuple(arg_names)
        if arg_names is not None
        else tuple(f"argument {i + 1}" for i in range(len(args)))
    )
    # An array passed more than once (self-attention's query, key and value) crosses once:
    # inside, one value, whose cotangent is summed over the axis once rather than per use.
    first = {}
    for i, arg in enumerate(args):
        first.setdefault(id(arg), i)
    kept = [i for i, arg in enumerate(args) if first[id(arg)] == i]
    if len(kept) < len(args):
        order = [kept.index(first[id(arg)]) for arg in args]
        inner_call = call
        call = lambda layer, *unique: inner_call(layer, *(unique[j] for j in order))
        args = tuple(args[i] for i in kept)
        arg_specs = tuple(arg_specs[i] for i in kept)
        arg_names = tuple(arg_names[i] for i in kept)
    others = tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types)
        if kind == AxisType.Explicit and name not in names
    )
    in_specs = (layer_specs(layer) if specs is None else specs, *arg_specs)
    _check_divisible(owner, mesh, in_specs, (layer, *args), arg_names)
    # Only arrays cross the boundary; the rest (static fields, floats such as a dropout
    # rate, flags) is closed over.
    dynamic, static = eqx.partition((layer, *args), eqx.is_array)

    def body(*inputs: Any) -> PyTree:
        with fresh_record():  # splits the layer opens end with the region
            return call(*eqx.combine(inputs, static))

    def region(*inputs: Any) -> PyTree:
        inner = jax.sharding.get_abstract_mesh()
        inner = inner if not inner.empty else mesh
        # Over the region's Explicit axes the arguments' types must match in_specs.
        inputs = enter_shard_map(inputs, in_specs, inner, manual=frozenset(names))
        return jax.shard_map(
            body,
            mesh=inner,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(names),
        )(*inputs)

    run = region
    if others:
        # Back from Auto, the output keeps its split over the region's Explicit axes (its
        # type says it); an Auto axis has no place in a type.
        explicit = {
            name
            for name, kind in zip(mesh.axis_names, mesh.axis_types)
            if kind == AxisType.Explicit
        }
        typed = jax.tree.map(
            lambda spec: keep_axes(spec, frozenset(explicit), rank=len(spec)),
            out_specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        run = jax.sharding.auto_axes(region, axes=others, out_sharding=typed)
    # Under an outer `jit` this inlines; called eagerly (under `jax.vmap` alone, say) it is
    # the program that runs the region on the mesh.
    run = jax.jit(run)
    if jax.sharding.get_abstract_mesh().empty:
        with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
            return run(*dynamic)
    return run(*dynamic)


def feature_spec(x: Any, axis_name: Hashable) -> PartitionSpec:
    """`x`'s last dimension (its features) split over `axis_name`, the others whole."""
    return PartitionSpec(*([None] * (jax.numpy.ndim(x) - 1)), axis_name)


def _check_divisible(
    owner: str, mesh: Any, specs: tuple, inputs: tuple, arg_names: tuple[str, ...]
) -> None:
    """Refuse, naming the leaf, an input whose split dimension the axes do not divide
    (rather than `shard_map`'s message about its own arguments)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

    def check(path: tuple, spec: Any, subtree: PyTree) -> None:
        if not isinstance(spec, PartitionSpec):
            return
        for inner, leaf in jax.tree_util.tree_leaves_with_path(subtree):
            if not eqx.is_array(leaf):
                continue
            for dim, entry in enumerate(spec):
                n = 1
                for name in axis_names_of(entry) if entry is not None else ():
                    n *= sizes[name]
                if dim < leaf.ndim and leaf.shape[dim] % n:
                    index, rest = path[0].idx, (*path[1:], *inner)
                    where = path_to_str(rest) if index == 0 else arg_names[index - 1]
                    if index and inner:
                        where += "/" + path_to_str(inner)
                    raise ValueError(
                        f"{owner}: `{where}` has shape {tuple(leaf.shape)}, whose dimension "
                        f"{dim} is split over {entry!r} ({n} devices), which does not divide "
                        f"it. Choose sizes that divide by {n}, or a smaller axis."
                    )

    jax.tree_util.tree_map_with_path(
        check, specs, inputs, is_leaf=lambda s: s is None or isinstance(s, PartitionSpec)
    )


def manual_specs(tree: PyTree, axes: frozenset) -> PyTree:
    """The `shard_map` specs of `tree` over the manual `axes` only: what its modules declare
    (`__partition_specs__`), without the other axes (left to the compiler), replicated where
    nothing is declared; `None` at non-array leaves."""
    declared = declared_partition_specs(tree)

    def spec(path: tuple, leaf: Any) -> PartitionSpec | None:
        if not eqx.is_array(leaf):
            return None
        found = declared.get(path_to_str(path), PartitionSpec())
        return keep_axes(found, axes, rank=len(found))

    return jax.tree_util.tree_map_with_path(spec, tree)


def region_axes(tree: PyTree) -> frozenset:
    """Every mesh axis a converted layer inside `tree` works over (its `axis_name`, an
    attention's `head_axis_name`, a mixture of experts' expert and model axes): what a region
    around all of them must make manual, so that none opens its own nested in it. Axes that
    `Sharded` keys lay raw arrays out over are the compiler's, and not among them."""
    found: set = set()
    for module in modules_in(tree):
        if callable(getattr(module, "to_serial", None)):
            for field in ("axis_name", "head_axis_name"):
                value = getattr(module, field, None)
                if value is not None:
                    found.update(axis_names_of(value))
        for field in ("expert_axis_name", "model_axis_name"):
            value = getattr(module, field, None)
            if value is not None and isinstance(module, eqx.Module):
                found.update(axis_names_of(value))
    return frozenset(found)


def batch_axes(mesh: Any, manual: frozenset, tree: PyTree, pipe: frozenset) -> tuple:
    """The axes a region around `tree` splits the batch over, in mesh order: the `manual`
    axes that neither the pipeline (`pipe`) nor a converted layer works over (the data
    axes), and the expert axes of any mixture of experts in `tree`, whose tokens are split
    over its expert axis as over a data axis."""
    layers = region_axes(tree)
    experts = {
        name
        for module in modules_in(tree)
        if isinstance(module, eqx.Module) and getattr(module, "expert_axis_name", None) is not None
        for name in axis_names_of(module.expert_axis_name)  # pyright: ignore[reportAttributeAccessIssue]
    }
    return tuple(
        name
        for name in mesh.axis_names
        if name in manual and name not in pipe and (name not in layers or name in experts)
    )


def modules_in(node: Any) -> Iterator[eqx.Module]:
    """Every Equinox module in `node`, itself included, through fields, lists and dicts."""
    if isinstance(node, eqx.Module):
        yield node
        for field in dataclasses.fields(node):
            yield from modules_in(getattr(node, field.name, None))
    elif isinstance(node, list | tuple):
        for item in node:
            yield from modules_in(item)
    elif isinstance(node, dict):
        for item in node.values():
            yield from modules_in(item)


def region_mesh(owner: str, tree: PyTree, axis_name: Hashable) -> Any:
    """The mesh a region over `axis_name` opens on for `tree`'s arrays (see `_region_mesh`)."""
    return _region_mesh(owner, tree, axis_names_of(axis_name))
