"""Layer stacks and their remat policies: `stack_layers` / `unstack_layers` between a list of
identical layers and one layer with a leading layer axis, and `ScannedLayers`, which runs such
a stack as one `lax.scan` under a remat policy.

Plain layer scans and pipeline stages both use this room (`PipelineModule.from_layers` cuts a
`ScannedLayers` into stages). Every remat table of eqpar is here: the policy names
(`RematPolicy`), what each keeps (`REMAT_POLICIES`), the policies with parameters gathered per
layer, and the policy of a checkpoint around layers that checkpoint themselves
(`AROUND_LAYERS`).
"""

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec
from jaxtyping import Array, PyTree

from .._declare import prefixed, stacked_partition_specs
from .._paths import children, key_to_str, map_children, path_to_str
from ..pipeline._executors import call_stage, call_varying
from ..pipeline._layered import LayerStack
from ..pipeline._tools import typed_scan
from ._twins import instance_with

__all__ = ["RematPolicy", "ScannedLayers", "stack_layers", "unstack_layers"]


def _leading_sizes(tree: PyTree) -> dict[str, int | None]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        path_to_str(path): (leaf.shape[0] if leaf.ndim else None)
        for path, leaf in flat
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
    }


def common_leading_size(tree: PyTree, name: str, owner: str) -> int:
    sizes = _leading_sizes(tree)
    if not sizes:
        raise ValueError(f"{owner}: `{name}` has no array leaves to stack.")
    distinct = set(sizes.values())
    if len(distinct) != 1 or None in distinct:
        raise ValueError(
            f"{owner}: every array leaf of `{name}` must carry the same leading stacking axis; "
            f"found leading sizes {sizes} (None = scalar). Build the stack with "
            f"`eqx.filter_vmap` over one key per copy."
        )
    size = distinct.pop()
    assert size is not None
    return size


def map_arrays(fn: Callable[[Array], Array], tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: fn(a) if eqx.is_array(a) else a, tree)


# What a layer (or stage) keeps for the backward pass; ScannedLayers' docstring says more.
RematPolicy = Literal["none", "full", "matmuls"]

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy(remat: object, owner: str) -> RematPolicy:
    """`remat` as one of `REMAT_POLICIES` (`True` is `"full"`, `False` is `"none"`)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(
            f"{owner}: `remat` must be one of {list(REMAT_POLICIES)} (or True for 'full', "
            f"False for 'none'); got {remat!r}."
        )
    return cast(RematPolicy, remat)


_GATHERED_PARAMETER = "eqpar_gathered_parameter"


def _is_parameter_gather(prim: Any, params: Mapping[str, Any], axis: Hashable) -> bool:
    """Whether an equation is the all-gather of a parameter over the FSDP axis, or the name
    it is given (`_GATHERED_PARAMETER`).

    A checkpoint policy sees every equation's output, the all-gather's own before the name
    is put on it: excluding the name alone (`save_anything_except_these_names`) leaves the
    all-gather's output saveable, and the backward pass then reads every layer's gathered
    copy from the residuals instead of gathering it again."""
    if prim.name == "name":
        return params.get("name") == _GATHERED_PARAMETER
    if not prim.name.startswith("all_gather"):
        return False
    names = params.get("axis_name", ())
    return axis in (names if isinstance(names, tuple) else (names,))


def gather_policy(remat: RematPolicy, axis: Hashable, *, keep_gathered: bool) -> Callable:
    """The checkpoint policy of a layer that gathers its parameters over `axis`: `remat`'s,
    and the gathered copies never saved (the backward pass gathers the layer again), or with
    `keep_gathered` always saved (no second gather; every layer's gathered parameters held
    from its forward to its backward)."""
    base = REMAT_POLICIES[remat]

    def policy(prim: Any, *avals: Any, **params: Any) -> bool:
        if _is_parameter_gather(prim, params, axis):
            return keep_gathered
        return True if base is None else bool(base(prim, *avals, **params))

    return policy


def is_array_like_leaf(leaf: object) -> bool:
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def rematerialized(fn: Callable, remat: str) -> Callable:
    """`fn` under `jax.checkpoint` with the policy named `remat` (`fn` itself for "none")."""
    if remat == "none":
        return fn
    return eqx.filter_checkpoint(fn, policy=REMAT_POLICIES[remat])


# ---------------------------------------------------------------------------------------
# A Python list of identical layers <-> one layer with a leading layer axis.


def _describe_value(value: PyTree) -> str:
    if eqx.is_array(value):
        return f"an array {jnp.result_type(value).name}{list(value.shape)}"
    if isinstance(value, eqx.Module):
        return f"a {type(value).__name__}"
    name = getattr(value, "__name__", None)
    if callable(value) and isinstance(name, str):
        return f"the {type(value).__name__} `{name}`"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _first_difference(a: PyTree, b: PyTree, path: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """Where `b` first differs from `a` in anything that stacking cannot hold: the pytree
    structure, a static field or non-array leaf, or an array's shape or dtype. Returns
    `(path, what)` or `None` when `b` stacks with `a`."""
    where = "/".join(path)
    if type(a) is not type(b):
        return where, f"{_describe_value(b)} where the first layer has {_describe_value(a)}"
    if eqx.is_array(a):
        if a.shape != b.shape or jnp.result_type(a) != jnp.result_type(b):
            return where, f"{_describe_value(b)} where the first layer has {_describe_value(a)}"
        return None
    if isinstance(a, eqx.Module):
        for field in dataclasses.fields(a):
            found = _first_difference(
                getattr(a, field.name, None), getattr(b, field.name, None), (*path, field.name)
            )
            if found is not None:
                return found
        return None
    flat_a, def_a = children(a)
    flat_b, def_b = children(b)
    if jax.tree_util.treedef_is_leaf(def_a):  # an opaque leaf (function, int, ...) or None
        try:
            same = a is b or bool(a == b)
        except Exception:
            same = False
        if same:
            return None
        return where, f"{_describe_value(b)} where the first layer has {_describe_value(a)}"
    if def_a != def_b:
        keys_a = [path_to_str(p) for p, _ in flat_a]
        keys_b = [path_to_str(p) for p, _ in flat_b]
        return where, f"entries {keys_b} where the first layer has {keys_a}"
    for (key, child_a), (_, child_b) in zip(flat_a, flat_b):
        found = _first_difference(child_a, child_b, (*path, path_to_str(key)))
        if found is not None:
            return found
    return None


def stack_layers(layers: Sequence[Any]) -> PyTree:
    """Stack a list of identical layers into one layer whose arrays carry a leading layer axis.

    This is the form `ScannedLayers`, `PipelineModule.from_layers` and `eqx.filter_vmap`
    use, built from layers that already exist (say the `list` of blocks a model holds). Every
    array leaf is stacked with `jnp.stack`; everything else (the pytree structure, static
    fields, activation functions, ...) must be equal across the layers and is kept once.
    `unstack_layers` is the inverse; the round trip is exact.

    **Arguments:**

    - `layers`: a non-empty list (or tuple) of modules of the same structure, with array
      leaves of equal shapes and dtypes. Integer or boolean static fields may differ (a
      layer's index): they are stacked as arrays, so inside `ScannedLayers` or a pipeline
      the layer reads a scalar array there (fine for arithmetic and `fold_in`, not for
      Python control flow), and `unstack_layers` gives the Python values back.

    **Returns:** one module like `layers[0]`, each array leaf of shape `[len(layers), ...]`.

    Raises `ValueError` naming the first layer and the leaf path where it differs from
    `layers[0]`.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from eqpar.nn import stack_layers, unstack_layers

    keys = jax.random.split(jax.random.key(0), 3)
    blocks = [eqx.nn.Linear(4, 4, key=k) for k in keys]
    stacked = stack_layers(blocks)
    assert stacked.weight.shape == (3, 4, 4)
    assert jnp.array_equal(unstack_layers(stacked)[2].weight, blocks[2].weight)
    ```
    """
    owner = "stack_layers"
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
        raise TypeError(
            f"{owner}: `layers` must be a list or tuple of modules, got {type(layers).__name__}."
        )
    if not layers:
        raise ValueError(f"{owner}: `layers` is empty; give at least one layer to stack.")
    varying = _varying_static_fields(list(layers))
    if varying:
        layers = [_with_dynamic_fields(layer, varying) for layer in layers]
    first = layers[0]
    for index, layer in enumerate(layers[1:], start=1):
        found = _first_difference(first, layer)
        if found is not None:
            where, what = found
            at = f"at `{where}`" if where else "as a whole"
            raise ValueError(
                f"{owner}: `layers[{index}]` differs from `layers[0]` {at}: it has {what}. "
                f"Only array values, and integer or boolean static fields (such as a layer's "
                f"index), may differ between stacked layers; build every layer with the same "
                f"other constructor arguments (and share functions such as activations "
                f"instead of creating one per layer)."
            )
    arrays = [eqx.filter(layer, eqx.is_array) for layer in layers]
    if not jax.tree.leaves(arrays[0]):
        raise ValueError(
            f"{owner}: the layers have no array leaves, so there is nothing to stack; a stack "
            f"of them would not know its depth."
        )
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *arrays)
    return eqx.combine(stacked, eqx.filter(first, eqx.is_array, inverse=True))


def unstack_layers(stacked: PyTree) -> list[Any]:
    """Split a layer whose array leaves carry a leading layer axis into a list of layers.

    The inverse of `stack_layers` (and of `eqx.filter_vmap` over one key per layer): item `i`
    is `stacked` with every array leaf indexed at `i`.

    **Arguments:**

    - `stacked`: a module (or any pytree) whose array leaves all have the same leading size.

    **Returns:** a `list` of that many modules.

    ```python
    import equinox as eqx, jax
    from eqpar.nn import stack_layers, unstack_layers

    stacked = eqx.filter_vmap(lambda k: eqx.nn.MLP(2, 2, 4, 1, key=k))(
        jax.random.split(jax.random.key(0), 4))
    layers = unstack_layers(stacked)
    assert len(layers) == 4 and layers[0].layers[0].weight.shape == (4, 2)
    restacked = stack_layers(layers)
    assert (restacked.layers[1].bias == stacked.layers[1].bias).all()
    ```
    """
    size = common_leading_size(stacked, "stacked", "unstack_layers")
    return [_with_static_fields(map_arrays(lambda a, i=i: a[i], stacked)) for i in range(size)]


# Integer and boolean static fields that differ per layer (a layer's index, say) are stacked
# as arrays: the layer's class is swapped for a subclass in which those fields are ordinary
# fields, one per combination (cached). Inside a scan the layer then reads a scalar array;
# `unstack_layers` puts the Python values and the author's class back. Floats are left
# static: as arrays they would be trained.
_DYNAMIC = "__eqpar_dynamic_static_fields__"
_DYNAMIC_CLASSES: dict[tuple[type, frozenset], type] = {}


def _varying_static_fields(layers: list) -> dict[tuple, frozenset]:
    """`{module path: field names}` of the integer/boolean static fields that differ."""
    found: dict[tuple, frozenset] = {}

    def walk(nodes: list, path: tuple) -> None:
        first = nodes[0]
        if any(type(node) is not type(first) for node in nodes):
            return
        if isinstance(first, eqx.Module):
            names = []
            for field in dataclasses.fields(first):
                values = [getattr(node, field.name, None) for node in nodes]
                if field.metadata.get("static", False):
                    kinds = {type(v) for v in values}
                    if len(kinds) == 1 and kinds <= {int, bool} and len(set(values)) > 1:
                        names.append(field.name)
                else:
                    walk(values, (*path, field.name))
            if names:
                found[path] = frozenset(names)
            return
        flats = [children(node) for node in nodes]
        if jax.tree_util.treedef_is_leaf(flats[0][1]) or any(f[1] != flats[0][1] for f in flats):
            return
        for i, (key, _) in enumerate(flats[0][0]):
            walk([f[0][i][1] for f in flats], (*path, path_to_str(key)))

    walk(layers, ())
    return found


def _dynamic_class(base: type, names: frozenset) -> type:
    cached = _DYNAMIC_CLASSES.get((base, names))
    if cached is None:
        namespace: dict[str, Any] = {
            "__annotations__": dict.fromkeys(sorted(names), Any),
            "__module__": base.__module__,
            # An `__init__` of its own keeps the dataclass from writing one, which would
            # refuse a redeclared field ahead of fields with defaults; eqpar never calls it.
            "__init__": base.__init__,
            _DYNAMIC: base,
        }
        namespace.update({name: eqx.field() for name in names})

        def __reduce__(self: PyTree) -> tuple:
            # The class has the author's name but is not the author's: pickle rebuilds it.
            fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            return _restore_dynamic, (base, names, fields)

        namespace["__reduce__"] = __reduce__
        cached = type(base.__name__, (base,), namespace)
        _DYNAMIC_CLASSES[(base, names)] = cached
    return cached


def _restore_dynamic(base: type, names: frozenset, fields: dict) -> PyTree:
    return instance_with(_dynamic_class(base, names), fields)


def _rebuilt_as(module: PyTree, cls: type, values: dict) -> PyTree:
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)}
    return instance_with(cls, {**fields, **values})


def _with_dynamic_fields(layer: PyTree, varying: dict[tuple, frozenset]) -> PyTree:
    def convert(node: PyTree, path: tuple) -> PyTree:
        node = map_children(node, path, convert)
        names = varying.get(tuple(key_to_str(k) for k in path))
        if names is None or not isinstance(node, eqx.Module):
            return node
        values = {name: jnp.asarray(getattr(node, name)) for name in names}
        return _rebuilt_as(node, _dynamic_class(type(node), names), values)

    return convert(layer, ())


def _with_static_fields(layer: PyTree) -> PyTree:
    """The inverse of `_with_dynamic_fields` for one (unstacked, concrete) layer."""

    def convert(node: PyTree, path: tuple) -> PyTree:
        node = map_children(node, path, convert)
        base = getattr(type(node), _DYNAMIC, None)
        if base is None or type(node) is base:
            return node
        values = {}
        for field in dataclasses.fields(base):
            value = getattr(node, field.name)
            if field.metadata.get("static", False) and eqx.is_array(value):
                try:
                    value = value.item()
                except Exception:  # a traced layer keeps its arrays (and this class)
                    return node
            values[field.name] = value
        return _rebuilt_as(node, base, values)

    return convert(layer, ())


class ScannedLayers(eqx.Module):
    """A stack of identical layers applied one after the other with `lax.scan`.

    `layers` is one layer module whose array leaves carry a leading layer axis (build it with
    `eqx.filter_vmap` over one key per layer). Each layer is called as `layer(x, *args,
    **kwargs)` and must return the shape and dtype it takes. The compiled program holds one
    layer body whatever the depth. Layers that declare a sharding (`__partition_specs__`) keep
    it, shifted right by the layer axis.

    With `remat`, each layer's activations are recomputed in the backward pass instead of
    stored: the scan then keeps, per layer, only what the policy saves (the layer's input for
    `"full"`), so the memory for activations grows by one layer's input per layer rather
    than by everything the layer computes.

    **Arguments:**

    - `layers`: the stacked layer module.
    - `remat`: what each layer keeps for the backward pass: `"none"` (default) everything;
      `"full"` (or `True`) only its input, everything else recomputed; `"matmuls"` its input
      and the outputs of its matrix products without batch dimensions (projections, MLP
      matmuls), so attention scores and elementwise work are recomputed but no matmul is.
    - `gather_axis`, `gather_dims`, `keep_gathered`: FSDP layer by layer; set them with
      `eqpar.nn.gather_layers` (which documents them).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from eqpar.nn.pipeline import ScannedLayers

    keys = jax.random.split(jax.random.key(0), 3)
    stack = ScannedLayers(eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(keys))
    x = jnp.ones(4)
    expected = x
    for i in range(3):
        expected = stack.layer(i)(expected)
    assert jnp.allclose(stack(x), expected, rtol=1e-6)
    ```
    """

    layers: PyTree
    remat: RematPolicy = eqx.field(static=True)
    gather_axis: Hashable | None = eqx.field(static=True)
    gather_dims: tuple[int | None, ...] | None = eqx.field(static=True)
    keep_gathered: bool = eqx.field(static=True)

    def __init__(
        self,
        layers: PyTree,
        *,
        remat: RematPolicy | bool = "none",
        gather_axis: Hashable | None = None,
        gather_dims: Sequence[int | None] | None = None,
        keep_gathered: bool = False,
    ):
        self.layers = layers
        self.remat = remat_policy(remat, "ScannedLayers")
        if (gather_axis is None) != (gather_dims is None):
            raise ValueError(
                "ScannedLayers: gather_axis and gather_dims go together; let "
                "`eqpar.nn.gather_layers` set them."
            )
        self.gather_axis = gather_axis
        self.gather_dims = None if gather_dims is None else tuple(gather_dims)
        self.keep_gathered = bool(keep_gathered)

    @property
    def num_layers(self) -> int:
        """The size of the leading layer axis."""
        return common_leading_size(self.layers, "layers", type(self).__name__)

    def layer(self, index: int) -> PyTree:
        """Layer `index` as an ordinary module (the stack's array leaves indexed)."""
        return map_arrays(lambda a: a[index], self.layers)

    def __call__(self, x: PyTree[Array], *args: PyTree, **kwargs: Any) -> PyTree[Array]:
        """Apply every layer in order: `x -> layers[L-1](... layers[0](x, *args, **kwargs))`."""
        arrays, static = eqx.partition(self.layers, eqx.is_array)
        if self.gather_axis is None:
            # Under a policy each layer casts its parameters to vary like its input inside
            # the checkpoint (recomputed, never kept): a pipeline of one stage then sums each
            # layer's gradient over the data axes in the backward scan (`single_step`).
            call = rematerialized(call_stage if self.remat == "none" else call_varying, self.remat)

            def apply(h: PyTree, layer_arrays: PyTree) -> tuple[Any, None]:
                h = self._named_input(h)
                return call(eqx.combine(layer_arrays, static), h, *args, **kwargs), None

        else:
            gathered = self._gathered_call(static)

            def apply(h: PyTree, layer_arrays: PyTree) -> tuple[Any, None]:
                return gathered(layer_arrays, self._named_input(h), *args, **kwargs), None

        out, _ = typed_scan(apply, x, arrays)
        return out

    def __pipeline_layers__(self) -> LayerStack | None:
        """How a training schedule runs this stack layer by layer (`None` when the layers
        gather their parameters themselves)."""
        if self.gather_axis is not None:
            return None
        return LayerStack(lambda stack: stack.layers, rematerialized(call_stage, self.remat))

    def _named_input(self, h: PyTree) -> PyTree:
        """A layer's input, named for a checkpoint around the stack (`AROUND_LAYERS`)."""
        if self.remat == "none":
            return h
        return jax.tree.map(lambda a: checkpoint_name(a, _LAYER_INPUT), h)

    def _gathered_call(self, static: PyTree) -> Callable:
        """One layer's call that first all-gathers its parameters over `gather_axis`.

        The gather sits inside a `jax.checkpoint` whose policy (`gather_policy`) never
        saves the gathered parameters (unless `keep_gathered`), so the backward pass gathers
        the layer again and the transpose of the gather reduce-scatters its gradient: at most
        a layer or two of whole parameters are alive at once, whatever the depth. A value
        the layer derives from a gathered parameter (a cast, a transpose) is saved as the
        layer's `remat` says.
        """
        axis, dims = self.gather_axis, self.gather_dims
        assert axis is not None and dims is not None

        def run(layer_arrays: PyTree, h: PyTree, *args: PyTree, **kwargs: Any) -> PyTree:
            leaves, treedef = jax.tree.flatten(layer_arrays)
            if len(leaves) != len(dims):
                raise ValueError(
                    f"ScannedLayers: gather_dims has {len(dims)} entries but a layer has "
                    f"{len(leaves)} arrays; apply `eqpar.nn.gather_layers` to the model as it is."
                )
            leaves = [
                leaf
                if dim is None
                else checkpoint_name(
                    lax.all_gather(leaf, axis, axis=dim, tiled=True), _GATHERED_PARAMETER
                )
                for leaf, dim in zip(leaves, dims)
            ]
            layer = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
            return layer(h, *args, **kwargs)

        policy = gather_policy(self.remat, axis, keep_gathered=self.keep_gathered)
        return eqx.filter_checkpoint(run, policy=policy)

    def __partition_specs__(self) -> Mapping[str, PartitionSpec]:
        specs = stacked_partition_specs(self.layers, None)
        if self.gather_axis is None or self.gather_dims is None:
            return prefixed("layers", specs)
        paths = [path_to_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(
            self.layers)[0] if is_array_like_leaf(leaf)]  # fmt: skip
        for path, dim in zip(paths, self.gather_dims):
            if dim is not None:
                entries = list(specs[path])
                entries += [None] * (2 + dim - len(entries))
                entries[1 + dim] = self.gather_axis
                specs[path] = PartitionSpec(*entries)
        return prefixed("layers", specs)


_LAYER_INPUT = "eqpar_layer_input"

# The policy of a `jax.checkpoint` around `ScannedLayers` whose layers have their own: an
# outer policy decides for the checkpoints inside it too, so it keeps what theirs keep (each
# layer's input, named `_LAYER_INPUT`, and with "matmuls" the matmul outputs) and no more.
AROUND_LAYERS: dict[str, Callable] = {
    "full": jax.checkpoint_policies.save_only_these_names(_LAYER_INPUT),
    "matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(_LAYER_INPUT),
    ),
}


def remat_of_layers(stages: PyTree) -> RematPolicy:
    """The remat policy of the first `ScannedLayers` inside `stages` ("none" if none)."""
    is_layers = lambda node: isinstance(node, ScannedLayers)
    for node in jax.tree.leaves(stages, is_leaf=is_layers):
        if is_layers(node) and node.remat != "none":
            return node.remat
    return "none"
