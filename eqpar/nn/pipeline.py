"""`PipelineModule`: pipeline stages stacked over a mesh axis; `ScannedLayers`; and
`stack_layers` / `unstack_layers` between a list of identical layers and one stacked layer.

The stages are stored in model order whatever the schedule (conventions 4 and 7 of the
design): `[S, ...]` for `S` devices, or `[V, S, ...]` with `V` stages per device, which is
the model-order stack `[S * V, ...]` reshaped. The `S` axis is sharded over the pipeline
axis, so device `d` holds stages `d, S + d, 2S + d, ...` with no reordering, and a checkpoint
differs between layouts by a reshape at most. Inside `shard_map` the module runs the GPipe or
circular schedule of `eqpar.pipeline`; outside, `apply_serially` is its one-device twin.
"""

import dataclasses
import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import axis_size
from .._checks import check_int
from .._declare import declared_partition_specs, prefixed, stacked_partition_specs
from .._paths import path_to_str
from .._specs import entry_names, fsdp_dim
from .._typing import AxisName
from ..mesh import DeviceMesh, as_jax_mesh
from ..pipeline import execute_schedule
from ..pipeline._executors import call_stage, call_varying, circular_forward, gpipe_forward
from ..pipeline._microbatch import batch_size, unwrap_microbatched
from ..pipeline._tools import typed_scan
from ..schedule import (
    SCHEDULES,
    CircularSchedule,
    GPipeSchedule,
    OneFOneBSchedule,
    PipelineSchedule,
    ZeroBubbleH1Schedule,
)


def _leading_sizes(tree: Any) -> dict[str, int | None]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        path_to_str(path): (leaf.shape[0] if leaf.ndim else None)
        for path, leaf in flat
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
    }


def _common_leading_size(tree: Any, name: str, owner: str) -> int:
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


def _map_arrays(fn: Callable[[Array], Array], tree: Any) -> Any:
    return jax.tree.map(lambda a: fn(a) if eqx.is_array(a) else a, tree)



# What a layer (or stage) keeps for the backward pass; ScannedLayers' docstring says more.
RematPolicy = Literal["none", "full", "matmuls"]

_REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _remat_policy(remat: object, owner: str) -> RematPolicy:
    """`remat` as one of `_REMAT_POLICIES` (`True` is `"full"`, `False` is `"none"`)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in _REMAT_POLICIES:
        raise ValueError(
            f"{owner}: `remat` must be one of {list(_REMAT_POLICIES)} (or True for 'full', "
            f"False for 'none'); got {remat!r}."
        )
    return cast(RematPolicy, remat)


_GATHERED_PARAMETER = "eqpar_gathered_parameter"

# With parameters gathered per layer, the policy also keeps the gathered copies out of what
# the backward pass saves (they are gathered again instead).
_GATHER_POLICIES: dict[str, Callable] = {
    "none": jax.checkpoint_policies.save_anything_except_these_names(_GATHERED_PARAMETER),
    "full": jax.checkpoint_policies.nothing_saveable,
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _is_array_like(leaf: object) -> bool:
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def _rematerialized(fn: Callable, remat: str) -> Callable:
    """`fn` under `jax.checkpoint` with the policy named `remat` (`fn` itself for "none")."""
    if remat == "none":
        return fn
    return eqx.filter_checkpoint(fn, policy=_REMAT_POLICIES[remat])


# ---------------------------------------------------------------------------------------
# A Python list of identical layers <-> one layer with a leading layer axis.


def _describe_value(value: Any) -> str:
    if eqx.is_array(value):
        return f"an array {jnp.result_type(value).name}{list(value.shape)}"
    if isinstance(value, eqx.Module):
        return f"a {type(value).__name__}"
    name = getattr(value, "__name__", None)
    if callable(value) and isinstance(name, str):
        return f"the {type(value).__name__} `{name}`"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _first_difference(a: Any, b: Any, path: tuple[str, ...] = ()) -> tuple[str, str] | None:
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
    flat_a, def_a = jax.tree_util.tree_flatten_with_path(a, is_leaf=lambda n: n is not a)
    flat_b, def_b = jax.tree_util.tree_flatten_with_path(b, is_leaf=lambda n: n is not b)
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


def stack_layers(layers: Sequence[Any]) -> Any:
    """Stack a list of identical layers into one layer whose arrays carry a leading layer axis.

    This is the form `ScannedLayers`, `PipelineModule.from_layers` and `eqx.filter_vmap`
    use, built from layers that already exist (say the `list` of blocks a model holds). Every
    array leaf is stacked with `jnp.stack`; everything else (the pytree structure, static
    fields, activation functions, ...) must be equal across the layers and is kept once.
    `unstack_layers` is the inverse; the round trip is exact.

    **Arguments:**

    - `layers`: a non-empty list (or tuple) of modules of the same structure, with array
      leaves of equal shapes and dtypes.

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
    first = layers[0]
    for index, layer in enumerate(layers[1:], start=1):
        found = _first_difference(first, layer)
        if found is not None:
            where, what = found
            at = f"at `{where}`" if where else "as a whole"
            raise ValueError(
                f"{owner}: `layers[{index}]` differs from `layers[0]` {at}: it has {what}. "
                f"Only array values may differ between stacked layers; build every layer with "
                f"the same constructor arguments (and share functions such as activations "
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


def unstack_layers(stacked: Any) -> list[Any]:
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
    size = _common_leading_size(stacked, "stacked", "unstack_layers")
    return [_map_arrays(lambda a, i=i: a[i], stacked) for i in range(size)]


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

    def __init__(
        self,
        layers: PyTree,
        *,
        remat: RematPolicy | bool = "none",
        gather_axis: Hashable | None = None,
        gather_dims: Sequence[int | None] | None = None,
    ):
        self.layers = layers
        self.remat = _remat_policy(remat, "ScannedLayers")
        if (gather_axis is None) != (gather_dims is None):
            raise ValueError(
                "ScannedLayers: gather_axis and gather_dims go together; let "
                "`eqpar.nn.gather_layers` set them."
            )
        self.gather_axis = gather_axis
        self.gather_dims = None if gather_dims is None else tuple(gather_dims)

    @property
    def num_layers(self) -> int:
        """The size of the leading layer axis."""
        return _common_leading_size(self.layers, "layers", type(self).__name__)

    def layer(self, index: int) -> Any:
        """Layer `index` as an ordinary module (the stack's array leaves indexed)."""
        return _map_arrays(lambda a: a[index], self.layers)

    def __call__(self, x: PyTree[Array], *args: Any, **kwargs: Any) -> PyTree[Array]:
        """Apply every layer in order: `x -> layers[L-1](... layers[0](x, *args, **kwargs))`."""
        arrays, static = eqx.partition(self.layers, eqx.is_array)
        if self.gather_axis is None:
            # Under a policy each layer casts its parameters to vary like its input inside
            # the checkpoint (recomputed, never kept): a pipeline of one stage then sums each
            # layer's gradient over the data axes in the backward scan (`single_step`).
            call = _rematerialized(
                call_stage if self.remat == "none" else call_varying, self.remat
            )

            def apply(h: Any, layer_arrays: Any) -> tuple[Any, None]:
                h = self._named_input(h)
                return call(eqx.combine(layer_arrays, static), h, *args, **kwargs), None

        else:
            gathered = self._gathered_call(static)

            def apply(h: Any, layer_arrays: Any) -> tuple[Any, None]:
                return gathered(layer_arrays, self._named_input(h), *args, **kwargs), None

        out, _ = typed_scan(apply, x, arrays)
        return out

    def _named_input(self, h: Any) -> Any:
        """A layer's input, named for a checkpoint around the stack (`_AROUND_LAYERS`)."""
        if self.remat == "none":
            return h
        return jax.tree.map(lambda a: checkpoint_name(a, _LAYER_INPUT), h)

    def _gathered_call(self, static: Any) -> Callable:
        """One layer's call that first all-gathers its parameters over `gather_axis`.

        The gather sits inside a `jax.checkpoint` whose policy never saves the gathered
        parameters, so the backward pass gathers the layer again and the transpose of the
        gather reduce-scatters its gradient: at most a layer or two of whole parameters are
        alive at once, whatever the depth.
        """
        axis, dims = self.gather_axis, self.gather_dims
        assert axis is not None and dims is not None

        def run(layer_arrays: Any, h: Any, *args: Any, **kwargs: Any) -> Any:
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

        return eqx.filter_checkpoint(run, policy=_GATHER_POLICIES[self.remat])

    def __partition_specs__(self) -> Mapping[str, PartitionSpec]:
        specs = stacked_partition_specs(self.layers, None)
        if self.gather_axis is None or self.gather_dims is None:
            return prefixed("layers", specs)
        paths = [path_to_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(
            self.layers)[0] if _is_array_like(leaf)]  # fmt: skip
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
_AROUND_LAYERS: dict[str, Callable] = {
    "full": jax.checkpoint_policies.save_only_these_names(_LAYER_INPUT),
    "matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(_LAYER_INPUT),
    ),
}


def _layers_remat(stages: Any) -> RematPolicy:
    """The remat policy of the first `ScannedLayers` inside `stages` ("none" if none)."""
    is_layers = lambda node: isinstance(node, ScannedLayers)
    for node in jax.tree.leaves(stages, is_leaf=is_layers):
        if is_layers(node) and node.remat != "none":
            return node.remat
    return "none"


class _StageCall(eqx.Module):
    """A stage (or a stack of stages) called directly or under `jax.checkpoint`."""

    stage: Any
    remat: RematPolicy = eqx.field(static=True)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return _rematerialized(call_stage, self.remat)(self.stage, x, *args, **kwargs)


def _leading_shapes(tree: Any, ndim: int) -> dict[str, tuple[int, ...]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        path_to_str(path): tuple(leaf.shape[:ndim])
        for path, leaf in flat
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
    }


class PipelineModule(eqx.Module):
    """Pipeline stages stacked in model order, their stage axis sharded over a mesh axis.

    The model is `S * V` stages applied in order, where `S = num_stages` is the size of the
    pipeline mesh axis and `V = num_repeats` the stages each device holds. Every stage must
    return the shape and dtype it takes (keep embeddings and output heads outside, before and
    after the pipeline). Called inside `shard_map` it runs GPipe (`V == 1`) or the circular
    schedule (`V > 1`); `value_and_grad` gives a whole training step in the order of a
    training schedule: 1F1B, zero-bubble ZB-H1, or GPipe / circular.

    **Storage.** `stages` is always in model order: `[S, ...]` (row `s` is stage `s`) with
    `V == 1`, and `[V, S, ...]` with `V > 1`, which is the model-order stack `[S * V, ...]`
    reshaped, so element `[r, d]` is stage `r * S + d`. The module declares its layout
    (`__partition_specs__`): `P(axis_name, *inner)`, or `P(None, axis_name, *inner)` with
    `V > 1`, where `inner` is whatever the stage's own modules declare (e.g. tensor-parallel
    layers). Device `d` thus holds stages `d, S + d, 2S + d, ...` without any reordering.
    `serial_stages()`, `stage(i)` and (for `from_layers`) `to_layers()` are reshapes and
    indexing, and a checkpoint written under one `(S, V)` restores under another by a
    reshape (`eqpar.checkpoint.Checkpointer.restore(..., reshape=True)`).

    **Inside a model.** The module can be a field of your own model, between an embedding
    and a head: `eqpar.partition_specs(model)` collects its layout, and the model's
    `__call__` runs inside `eqpar.shard_map` with the pipeline as one line of it. Per-example
    extra arguments (an attention mask) go in `eqpar.pipeline.Microbatched` so each stage
    call gets the rows of its microbatch.

    **Arguments:**

    - `stages`: the `S * V` stages in model order, stacked on a leading axis (e.g.
      `eqx.filter_vmap(make_stage)(keys)` or `stack_layers(list_of_stages)`); each slice
      must be callable as `stage(x, *args, **kwargs)`. See also `from_stage_fn` and
      `from_layers`.
    - `num_stages`: `S`, which must equal the size of the mesh axis `axis_name`.
    - `num_microbatches`: how many microbatches each batch is cut into (must divide the
      per-device batch).
    - `axis_name`: the pipeline mesh axis.
    - `num_repeats`: `V`, stages per device (`> 1` selects the circular schedule).
    - `remat`: recompute each stage's activations in the backward pass instead of storing
      them: `"none"` (default), `"full"` (`True`) or `"matmuls"` (as for `ScannedLayers`), a
      `jax.checkpoint` with that policy around every stage call of `__call__`. For
      `from_layers` the policy applies to each layer inside the stage instead
      (`ScannedLayers.remat`), so a stage of many layers keeps one layer's worth at a time.
      `value_and_grad` applies it per stage and microbatch: `"none"` stores each
      stage's residuals until its backward step, `"full"` keeps only the stage input and
      recomputes the forward there, `"matmuls"` stores the matmul outputs.
    - `broadcast_output`: return the pipeline's result on every device of the axis instead
      of only on the last (zeros elsewhere); costs one `psum` of the output.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.layout import partition_specs
    from eqpar.nn.pipeline import PipelineModule
    from eqpar.spmd import shard_map

    class Batched(eqx.Module):  # a stage that takes a batch [rows, 4]
        mlp: eqx.nn.MLP
        def __call__(self, x):
            return jax.vmap(self.mlp)(x)

    model = PipelineModule.from_stage_fn(
        lambda k: Batched(eqx.nn.MLP(4, 4, 8, 1, key=k)), num_stages=2, num_repeats=2,
        key=jax.random.key(0), num_microbatches=2, broadcast_output=True,
    )
    assert model.stages.mlp.layers[0].weight.shape == (2, 2, 8, 4)  # [V, S, out, in]
    specs = partition_specs(model)
    assert specs.stages.mlp.layers[0].weight == P(None, "pipe")

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))
    f = eqx.filter_jit(
        shard_map(lambda m, x: m(x), mesh=mesh, in_specs=(specs, P()), out_specs=P())
    )
    x = jnp.ones((6, 4))
    assert jnp.allclose(f(model, x), model.apply_serially(x), rtol=1e-5, atol=1e-6)
    ```
    """

    stages: PyTree
    num_stages: int = eqx.field(static=True)
    num_microbatches: int = eqx.field(static=True)
    axis_name: AxisName = eqx.field(static=True)
    num_repeats: int = eqx.field(static=True)
    remat: RematPolicy = eqx.field(static=True)
    broadcast_output: bool = eqx.field(static=True)

    def __init__(
        self,
        stages: PyTree,
        *,
        num_stages: int,
        num_microbatches: int,
        axis_name: AxisName = "pipe",
        num_repeats: int = 1,
        remat: RematPolicy | bool = "none",
        broadcast_output: bool = False,
    ):
        owner = "PipelineModule"
        self.num_stages = check_int(num_stages, name="num_stages", owner=owner)
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        self.num_repeats = check_int(num_repeats, name="num_repeats", owner=owner)
        self.axis_name = axis_name
        self.remat = _remat_policy(remat, owner)
        self.broadcast_output = bool(broadcast_output)
        s, v = self.num_stages, self.num_repeats
        size = _common_leading_size(stages, "stages", owner)
        if size != s * v:
            raise ValueError(
                f"{owner}: `stages` is stacked {size} deep but num_stages * num_repeats = "
                f"{s} * {v} = {s * v}; stack one stage per (device, repeat), in model order."
            )
        if v > 1:
            stages = _map_arrays(lambda a: a.reshape(v, s, *a.shape[1:]), stages)
        self.stages = stages

    @classmethod
    def from_stage_fn(
        cls,
        stage_fn: Callable[[PRNGKeyArray], Any],
        *,
        num_stages: int,
        key: PRNGKeyArray,
        num_microbatches: int,
        num_repeats: int = 1,
        **options: Any,
    ) -> "PipelineModule":
        """Build `num_stages * num_repeats` independent stages, one `stage_fn(key)` each.

        **Arguments:**

        - `stage_fn`: maps a PRNG key to one stage module.
        - `num_stages`, `num_microbatches`, `num_repeats`: as in the constructor.
        - `key`: split into one key per stage (in model order).
        - `**options`: the other keyword arguments of the constructor (`axis_name`, `remat`,
          `broadcast_output`).

        **Returns:** a `PipelineModule`.

        ```python
        import equinox as eqx, jax
        from eqpar.nn.pipeline import PipelineModule
        model = PipelineModule.from_stage_fn(
            lambda k: eqx.nn.Linear(3, 3, key=k), num_stages=2, key=jax.random.key(0),
            num_microbatches=1, num_repeats=2,
        )
        assert model.stages.weight.shape == (2, 2, 3, 3)  # [V, S, out, in]
        assert model.serial_stages().weight.shape == (4, 3, 3)  # model order
        ```
        """
        total = check_int(num_stages, name="num_stages", owner="PipelineModule.from_stage_fn")
        total *= check_int(num_repeats, name="num_repeats", owner="PipelineModule.from_stage_fn")
        stages = eqx.filter_vmap(stage_fn)(jax.random.split(key, total))
        return cls(
            stages,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            num_repeats=num_repeats,
            **options,
        )

    @classmethod
    def from_layers(
        cls,
        layers: PyTree,
        *,
        num_stages: int,
        num_microbatches: int,
        num_repeats: int = 1,
        **options: Any,
    ) -> "PipelineModule":
        """Cut a scanned stack of `L` identical layers into `num_stages * num_repeats` stages.

        `layers` is one layer module whose array leaves carry a leading layer axis of size
        `L` (`[L, ...]`). It is reshaped, never reordered: to `[S, L / S, ...]` for GPipe and
        to `[V, S, L / (S * V), ...]` for the circular schedule; every stage runs its layers
        with `lax.scan` (`ScannedLayers`). `to_layers()` reshapes back to `[L, ...]`.

        **Arguments:**

        - `layers`: the stacked layers (e.g. `eqx.filter_vmap(make_layer)(keys)`, or
          `stack_layers(list_of_layers)`).
        - `num_stages`, `num_microbatches`, `num_repeats`: as in the constructor; `L` must
          divide by `num_stages * num_repeats`.
        - `**options`: `axis_name`, `remat`, `broadcast_output`.

        **Returns:** a `PipelineModule` whose stages are `ScannedLayers`.

        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        from eqpar.nn.pipeline import PipelineModule
        layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(
            jax.random.split(jax.random.key(0), 8))
        model = PipelineModule.from_layers(layers, num_stages=4, num_microbatches=2)
        assert model.stages.layers.weight.shape == (4, 2, 3, 3)  # [S, L/S, out, in]
        circular = PipelineModule.from_layers(
            layers, num_stages=2, num_repeats=2, num_microbatches=2)
        assert circular.stages.layers.weight.shape == (2, 2, 2, 3, 3)  # [V, S, L/(SV), ...]
        assert jnp.array_equal(circular.to_layers().weight, layers.weight)
        ```
        """
        owner = "PipelineModule.from_layers"
        s = check_int(num_stages, name="num_stages", owner=owner)
        v = check_int(num_repeats, name="num_repeats", owner=owner)
        num_layers = _common_leading_size(layers, "layers", owner)
        total = s * v
        if num_layers % total:
            raise ValueError(
                f"{owner}: {num_layers} layers do not divide into num_stages * num_repeats = "
                f"{s} * {v} = {total} stages of equal depth. Choose a stage count that divides "
                f"{num_layers}, or add layers."
            )
        per_stage = num_layers // total
        stacked = _map_arrays(lambda a: a.reshape(total, per_stage, *a.shape[1:]), layers)
        # The policy goes to each layer; a checkpoint around the whole stage on top of it
        # would only recompute the per-layer checkpoints once more.
        remat = _remat_policy(options.pop("remat", "none"), owner)
        return cls(
            ScannedLayers(stacked, remat=remat),
            num_stages=s,
            num_microbatches=num_microbatches,
            num_repeats=v,
            **options,
        )

    # ----------------------------------------------------------------------------------
    # Views in model order (outside shard_map): reshapes and indexing only.

    def _stacked_dims(self) -> int:
        return 1 if self.num_repeats == 1 else 2

    def serial_stages(self) -> PyTree:
        """The stages in model order, `[S * V, ...]` (row `s` is stage `s`): `stages` itself
        with `V == 1`, its `[V, S, ...]` arrays reshaped otherwise."""
        if self.num_repeats == 1:
            return self.stages
        total = self.num_stages * self.num_repeats
        return _map_arrays(lambda a: a.reshape(total, *a.shape[2:]), self.stages)

    def stage(self, index: int) -> Any:
        """Stage `index` (model order) as an ordinary module."""
        total = self.num_stages * self.num_repeats
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < total:
            raise ValueError(f"PipelineModule.stage: `index` must be in [0, {total}), got {index}.")
        if self.num_repeats == 1:
            return _map_arrays(lambda a: a[index], self.stages)
        repeat, device = divmod(index, self.num_stages)
        return _map_arrays(lambda a: a[repeat, device], self.stages)

    def to_layers(self) -> PyTree:
        """The layers of a module built by `from_layers`, back as one stack `[L, ...]` in model
        order (a reshape of `stages.layers`): the inverse of `from_layers`.

        **Returns:** the stacked layer module, `[L, ...]` on every array leaf.

        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        from eqpar.nn.pipeline import PipelineModule
        layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(
            jax.random.split(jax.random.key(0), 6))
        model = PipelineModule.from_layers(layers, num_stages=3, num_microbatches=1)
        assert jnp.array_equal(model.to_layers().bias, layers.bias)
        ```
        """
        if not isinstance(self.stages, ScannedLayers):
            raise TypeError(
                f"PipelineModule.to_layers: the stages are {type(self.stages).__name__}, not "
                f"ScannedLayers, so there is no layer axis inside them; use `serial_stages()` "
                f"for the model-order stack of stages (or build the module with `from_layers`)."
            )
        dims = self._stacked_dims()

        def flatten(a: Array) -> Array:
            return a.reshape(math.prod(a.shape[: dims + 1]), *a.shape[dims + 1 :])

        return _map_arrays(flatten, self.stages.layers)

    def apply_serially(self, x: PyTree[Array], *args: Any, **kwargs: Any) -> PyTree[Array]:
        """The serial twin: every stage in model order on the whole batch, on one device.

        **Arguments:**

        - `x`: the batch (what `__call__` takes).
        - `*args`, `**kwargs`: passed to every stage; a `Microbatched` value is passed whole
          (its rows are checked against the batch).

        **Returns:** what the pipeline returns on its last device.
        """
        caller = "PipelineModule.apply_serially"
        args, kwargs = unwrap_microbatched(args, kwargs, batch_size(x, "x", caller), caller)
        arrays, static = eqx.partition(self.serial_stages(), eqx.is_array)

        def apply(h: Any, stage_arrays: Any) -> tuple[Any, None]:
            return eqx.combine(stage_arrays, static)(h, *args, **kwargs), None

        out, _ = typed_scan(apply, x, arrays)
        return out

    def schedule(
        self, name: str | None = None, *, include_backward: bool = False
    ) -> PipelineSchedule:
        """The schedule this module runs, by the names every API of eqpar uses.

        **Arguments:**

        - `name`: `None` for what `__call__` runs (`"gpipe"`, or `"circular"` when
          `num_repeats > 1`); `"gpipe"` / `"circular"` (the one that fits `num_repeats`),
          `"1f1b"` or `"zb-h1"`: the schedules of `value_and_grad`. (`"forward"` and
          `"training"`, the names of earlier releases, still work with a
          `DeprecationWarning`.)
        - `include_backward`: for `"gpipe"` / `"circular"`, add the backward half that
          differentiating `__call__` (or `value_and_grad(schedule="gpipe")`) runs.

        **Returns:** a `PipelineSchedule` (a table, its bubble and its picture).
        """
        owner = "PipelineModule.schedule"
        if name in ("forward", "training"):
            warnings.warn(
                f"{owner}: {name!r} is deprecated; write schedule() or "
                f"schedule(include_backward=True) (names: {sorted(SCHEDULES)}).",
                DeprecationWarning,
                stacklevel=2,
            )
            name, include_backward = None, name == "training"
        s, m, v = self.num_stages, self.num_microbatches, self.num_repeats
        name = _schedule_name(name, v, owner)
        if name == "gpipe":
            return GPipeSchedule(s, m, include_backward=include_backward)
        if name == "circular":
            return CircularSchedule(s, m, v, include_backward=include_backward)
        return OneFOneBSchedule(s, m) if name == "1f1b" else ZeroBubbleH1Schedule(s, m)

    def __partition_specs__(self) -> Mapping[str, PartitionSpec]:
        before = self._stacked_dims() - 1
        specs = stacked_partition_specs(self.stages, self.axis_name, unsharded_before=before)
        return prefixed("stages", specs)

    # ----------------------------------------------------------------------------------
    # Inside shard_map.

    def _local_stages(self, caller: str) -> Any:
        """This device's stage (`V == 1`) or its `[V, ...]` stack of stages `d, S + d, ...`."""
        size = axis_size(self.axis_name, caller)
        if size != self.num_stages:
            raise ValueError(
                f"{caller}: the module has num_stages={self.num_stages} but the mesh axis "
                f"{self.axis_name!r} has {size} devices. Build the module with "
                f"num_stages={size} (with num_repeats stages per device for more stages), or "
                f"use a mesh whose {self.axis_name!r} axis has {self.num_stages} devices."
            )
        fix = (
            "Pass the module with its declared layout (`eqpar.partition_specs(module)`) as "
            "shard_map's in_specs."
        )
        if self.num_repeats == 1:
            local = _common_leading_size(self.stages, "stages", caller)
            if local != 1:
                raise ValueError(
                    f"{caller}: each device sees {local} stacked stages but should see "
                    f"num_repeats=1: the leading axis of `stages` must be sharded over "
                    f"{self.axis_name!r}. {fix}"
                )
            return _map_arrays(lambda a: a[0], self.stages)
        shapes = _leading_shapes(self.stages, 2)
        wrong = {path: shape for path, shape in shapes.items() if shape != (self.num_repeats, 1)}
        if wrong:
            path, shape = next(iter(wrong.items()))
            raise ValueError(
                f"{caller}: each device should see a [num_repeats, 1] = [{self.num_repeats}, 1] "
                f"block of the [V, S, ...] stage stack, but `stages/{path}` arrives with "
                f"leading dimensions {list(shape)}: the second axis of `stages` must be sharded "
                f"over {self.axis_name!r} (spec P(None, {self.axis_name!r}, ...)). {fix}"
            )
        return _map_arrays(lambda a: a[:, 0], self.stages)

    def __call__(self, x: PyTree[Array], *args: Any, **kwargs: Any) -> PyTree[Array]:
        """Run the pipeline inside `shard_map` (over `axis_name`).

        **Arguments:**

        - `x`: the batch, a pytree of arrays with a leading batch axis, the same on every
          device of the pipeline axis.
        - `*args`, `**kwargs`: passed to every stage call; a value wrapped in
          `eqpar.pipeline.Microbatched` (say a padding mask `[batch, seq]`) is split into
          microbatches with `x`, each stage call getting the rows of its microbatch.

        **Returns:** the outputs in batch order on the last device of the axis and zeros on
        the others (on every device with `broadcast_output=True`).
        """
        stages = self._local_stages("PipelineModule")
        # The executor checkpoints each stage call itself, under the policy of `remat`, or
        # else that of the layers inside the stage (a policy around an inner
        # `jax.checkpoint` overrides it): it then skips the stage in each device's idle
        # steps, and takes a circular stage's slice of the stacked weights inside. With one
        # device and one microbatch the stage is called once, and layers that checkpoint
        # themselves sum their gradients over the data axes layer by layer (`single_step`).
        layers_remat = _layers_remat(self.stages)
        if self.remat != "none":  # the stage's own policy, around the whole stage
            policy = _REMAT_POLICIES[self.remat]
        elif layers_remat != "none":  # the layers' policies, kept as they are
            policy = _AROUND_LAYERS[layers_remat]
        else:  # none: the stage is called as it is (a skip would cost memory here)
            policy = None
        if self.num_repeats > 1:
            return circular_forward(
                stages, x, args, kwargs, num_microbatches=self.num_microbatches,
                model_axis_name=self.axis_name, broadcast_output=self.broadcast_output,
                stage_policy=policy,
            )  # fmt: skip
        return gpipe_forward(
            stages, x, args, kwargs, num_microbatches=self.num_microbatches,
            model_axis_name=self.axis_name, broadcast_output=self.broadcast_output,
            stage_policy=policy, reduce_in_layers=layers_remat != "none",
        )  # fmt: skip

    def value_and_grad(
        self,
        loss_fn: Callable,
        x: PyTree[Array],
        targets: PyTree[Array],
        *args: Any,
        schedule: str = "1f1b",
        return_all_grads: bool = False,
        **kwargs: Any,
    ) -> tuple[Array, Any]:
        """Loss and gradients of a pipelined training step (inside `shard_map`), in the
        order of a training schedule run by `eqpar.pipeline.execute_schedule`.

        Equivalent to differentiating `mean over microbatches of loss_fn(self(x_m), t_m)`.
        The schedules (`self.schedule(name)` gives each one's table and picture):

        - `"1f1b"`: each device holds the activations of at most `num_stages` microbatches;
        - `"zb-h1"`: 1F1B with each backward split into its input and weight gradients and
          the weight gradients moved into 1F1B's idle steps (`ZeroBubbleH1Schedule`);
        - `"gpipe"` (`"circular"` when `num_repeats > 1`): all forwards, then all backwards,
          as autodiff of `self(x)` runs them, holding all microbatches' residuals.

        The model's `remat` policy says what a forward keeps for its backward: `"none"` its
        stage's residuals, `"full"` only the stage input (the backward recomputes the
        forward), `"matmuls"` the matmul outputs of each layer. The loss is the same on every
        device of the pipeline axis.

        Over a data-parallel axis the loss is each shard's own, while the gradients of
        parameters replicated over that axis arrive summed over it (as `jax.grad` inside
        `shard_map` gives them): `lax.pmean` the loss and divide the gradients by the axis
        size for the global mean. To continue the backward pass into an embedding before
        the pipeline, take `return_all_grads=True` and feed the returned input gradients to
        the embedding's pullback (`eqx.filter_vjp`); they are this shard's, so the embedding
        gradients come out summed over the data axis too.

        **Arguments:**

        - `loss_fn`: `loss_fn(outputs, targets) -> scalar` for one microbatch (a callable
          pytree, e.g. a module holding an output head). A head whose parameters are split
          over the pipeline axis too (its vocabulary, say) runs on every device of it (see
          `eqpar.pipeline.execute_schedule`).
        - `x`, `targets`: the batch and its targets (leading batch axis); `targets` may be a
          pytree, e.g. `(labels, mask)`, and is split into microbatches with `x`.
        - `*args`, `**kwargs`: passed to every stage call; `Microbatched` values are split
          with `x`.
        - `schedule`: `"1f1b"` (default), `"zb-h1"`, `"gpipe"` or `"circular"` (the names
          of `eqpar.schedule.SCHEDULES`).
        - `return_all_grads`: also return the gradients of `loss_fn`'s array leaves and of
          `x`.

        **Returns:** `(loss, grads)` where `grads` is a `PipelineModule` of gradients (this
        device's block, `None` for leaves that are not inexact arrays), or
        `(loss, (grads, loss_fn_grads, x_grads))` with `return_all_grads=True`.
        """
        caller = "PipelineModule.value_and_grad"
        schedule = _schedule_name(schedule, self.num_repeats, caller)
        # "full" keeps only each stage's input, which is what `recompute` does by itself
        recompute = self.remat == "full"
        local = _StageCall(self._local_stages(caller), "none" if recompute else self.remat)
        loss, result = execute_schedule(
            self.schedule(schedule, include_backward=True),
            local,
            loss_fn,
            x,
            targets,
            *args,
            model_axis_name=self.axis_name,
            return_all_grads=return_all_grads,
            recompute=recompute,
            **kwargs,
        )
        stage_grads = (result[0] if return_all_grads else result).stage
        # back to this device's block of the stored stack: [1, ...], or [V, 1, ...]
        axis = 0 if self.num_repeats == 1 else 1
        stacked = jax.tree.map(lambda g: jnp.expand_dims(g, axis), stage_grads)
        grads = eqx.tree_at(lambda m: m.stages, self, stacked, is_leaf=lambda n: n is None)
        if return_all_grads:
            return loss, (grads, result[1], result[2])
        return loss, grads

    def value_and_grad_1f1b(
        self,
        loss_fn: Callable,
        x: PyTree[Array],
        targets: PyTree[Array],
        *args: Any,
        return_all_grads: bool = False,
        **kwargs: Any,
    ) -> tuple[Array, Any]:
        """Deprecated: `value_and_grad(..., schedule="1f1b")`, which it calls (with a
        `DeprecationWarning`).

        **Arguments:** as for `value_and_grad`, without `schedule`.

        **Returns:** as for `value_and_grad`.
        """
        warnings.warn(
            "PipelineModule.value_and_grad_1f1b is deprecated: write "
            "value_and_grad(loss_fn, x, targets, ..., schedule='1f1b'), the one entry point "
            "for every training schedule.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.value_and_grad(
            loss_fn, x, targets, *args, schedule="1f1b", return_all_grads=return_all_grads, **kwargs
        )


def _schedule_name(name: str | None, num_repeats: int, owner: str) -> str:
    """`name` checked against `num_repeats` (`None`: GPipe, or circular with repeats)."""
    forward = "gpipe" if num_repeats == 1 else "circular"
    if name is None:
        return forward
    if name == "gpipe" and num_repeats > 1:
        warnings.warn(
            f"{owner}: with num_repeats={num_repeats} the schedule is 'circular'; 'gpipe' for "
            "it is deprecated.",
            DeprecationWarning,
            stacklevel=3,
        )
        return "circular"
    if name not in SCHEDULES:
        raise ValueError(f"{owner}: `schedule` must be one of {sorted(SCHEDULES)}, got {name!r}.")
    if name == "circular" and num_repeats == 1:
        raise ValueError(
            f"{owner}: the module has num_repeats=1, so its all-forward schedule is 'gpipe', "
            "not 'circular' (build it with num_repeats > 1 for the circular schedule)."
        )
    if name in ("1f1b", "zb-h1") and num_repeats != 1:
        raise ValueError(
            f"{owner}: the {name!r} schedule runs one stage per device but this module has "
            f"num_repeats={num_repeats}. Use num_repeats=1, or schedule='circular'."
        )
    return name


def _with_gathered_layers(
    stack: ScannedLayers, axis: Hashable, axis_size: int, leading: int, min_size_bytes: int
) -> ScannedLayers:
    """`stack` with `gather_dims` chosen leaf by leaf, as FSDP would choose them for one layer
    (`leading`: the stacked dimensions in front of one layer's shape)."""
    declared = declared_partition_specs(stack.layers)
    dims: list[int | None] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(stack.layers)[0]:
        if not _is_array_like(leaf):
            continue
        base = declared.get(path_to_str(path), PartitionSpec())
        shape = tuple(leaf.shape[leading:])
        nbytes = math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
        uses_axis = any(axis in entry_names(entry) for entry in base)
        dims.append(None if uses_axis else fsdp_dim(shape, nbytes, base, axis_size, min_size_bytes))
    if all(dim is None for dim in dims):
        return ScannedLayers(stack.layers, remat=stack.remat)
    return ScannedLayers(stack.layers, remat=stack.remat, gather_axis=axis, gather_dims=dims)


def gather_layers(
    model: PyTree,
    mesh: DeviceMesh | Mesh,
    *,
    axis: Hashable = "data",
    min_size_bytes: int = 16 * 1024,
) -> PyTree:
    """FSDP layer by layer: store every stacked layer's parameters split over `axis`, and
    gather each layer's parameters only when the layer runs.

    Under `eqpar.FSDP` alone, `jax.jit` (or the `shard_map` boundary) gathers every parameter
    of the model before the first layer, so a device briefly holds the whole model. After
    `gather_layers`, each `ScannedLayers` (on its own, or as the stages of a
    `PipelineModule.from_layers`) declares its layers' parameters split over `axis` too, on
    the dimension `eqpar.fsdp_spec` would choose for one layer, and inside `eqpar.shard_map`
    all-gathers one layer's parameters at each step of its scan. The gathered copies are kept
    out of what the backward pass saves (with `remat="full"` or `"matmuls"` the backward pass
    gathers each layer again), and the transpose of the gather reduce-scatters the layer's
    gradient into the same split, where FSDP at the boundary all-reduces the whole gradient.
    Parameters outside the stacks (embeddings, heads) are left to the distribution:
    `eqpar.FSDP(...)` splits them and they are gathered at the `shard_map` boundary as before.

    Inside a pipeline the stage's layers are gathered at every microbatch step of the
    schedule, which multiplies the gather traffic by the number of steps; per-layer FSDP pays
    off most without a pipeline axis, or with few microbatches.

    **Arguments:**

    - `model`: a model holding `ScannedLayers` or `PipelineModule.from_layers` stacks.
    - `mesh`: the mesh; `axis` must be one of its axes.
    - `axis`: the mesh axis to split the parameters over (the data axis).
    - `min_size_bytes`: parameters of one layer smaller than this stay whole.

    **Returns:** the model with its stacks set to gather per layer (same parameters).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import eqpar
    from eqpar.nn import ScannedLayers, gather_layers

    mesh = eqpar.DeviceMesh((4,), ("data",), devices=jax.devices()[:4])
    stack = ScannedLayers(eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(
        jax.random.split(jax.random.key(0), 3)))
    gathered = gather_layers(stack, mesh, min_size_bytes=0)
    specs = eqpar.partition_specs(gathered)
    assert specs.layers.weight == P(None, "data")  # [L, out, in]: in split over data
    x = jnp.ones((8, 16))
    loss = eqpar.shard_map(
        lambda m, x: jax.lax.pmean(jnp.mean(jax.vmap(m)(x) ** 2), "data"),
        mesh=mesh, in_specs=(specs, P("data")), out_specs=P(),
    )
    serial = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(gathered, x)
    assert jnp.allclose(grads.layers.weight, eqx.filter_grad(serial)(stack, x).layers.weight,
                        atol=1e-6)
    ```
    """
    jax_mesh = as_jax_mesh(mesh)
    if axis not in jax_mesh.shape:
        raise ValueError(
            f"gather_layers: axis={axis!r} is not an axis of the mesh {tuple(jax_mesh.shape)}."
        )
    check_int(min_size_bytes, name="min_size_bytes", owner="gather_layers", minimum=0)
    size = int(jax_mesh.shape[axis])
    found = []

    def convert(node: Any) -> Any:
        if isinstance(node, PipelineModule) and isinstance(node.stages, ScannedLayers):
            found.append(node)
            stages = _with_gathered_layers(
                node.stages, axis, size, node._stacked_dims() + 1, min_size_bytes
            )
            return eqx.tree_at(lambda m: m.stages, node, stages)
        if isinstance(node, ScannedLayers):
            found.append(node)
            return _with_gathered_layers(node, axis, size, 1, min_size_bytes)
        return node

    converted = jax.tree.map(
        convert, model, is_leaf=lambda n: isinstance(n, PipelineModule | ScannedLayers)
    )
    if not found:
        raise ValueError(
            "gather_layers: the model holds no ScannedLayers (nor PipelineModule.from_layers "
            "stages) to gather layer by layer. Stack a list of layers with "
            "`eqpar.nn.stack_layers` and wrap it in `ScannedLayers`."
        )
    return converted


__all__ = ["PipelineModule", "ScannedLayers", "gather_layers", "stack_layers", "unstack_layers"]
