"""Equinox-aware `shard_map` and sharded-at-birth construction of models."""

__all__ = ["build_sharded", "gather_stored", "shard_map"]

import dataclasses
import functools
from collections.abc import Callable, Hashable, Set

import equinox as eqx
import jax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from . import _current
from ._axis_types import context_mesh, enter_shard_map
from ._paths import path_to_str
from ._specs import check_spec, entry_names, is_spec_leaf, show_spec
from ._splits import fresh_record
from ._typing import PyTree, Specs
from ._vma import varying_axes
from .layout import (
    expand_specs,
    is_array_like,
    named_shardings,
    partition_specs,
)
from .mesh import DeviceMesh, as_jax_mesh
from .nn.stateful import (
    check_batch_stats,
    manual_stateful_layers,
    serial_stateful_layers,
    stateful_layer_kinds,
)


def shard_map(
    fn: Callable | None = None,
    /,
    *,
    mesh: DeviceMesh | Mesh | jax.sharding.AbstractMesh | None,
    in_specs: PyTree,
    out_specs: PyTree,
    check_vma: bool = True,
    axis_names: Set[Hashable] | None = None,
    stored_specs: PyTree | None = None,
    batch_stats: str | tuple[Hashable, ...] = "global",
) -> Callable:
    """`jax.shard_map` for functions that take and return Equinox modules.

    Only array leaves cross the `jax.shard_map` boundary; everything else (activation
    functions, ints, strings) passes through untouched, so modules and other pytrees can be
    arguments and results. Inside, `fn` sees the local blocks of each array.

    **Arguments:**

    - `fn`: the per-device function. Omit it to use `shard_map(...)` as a decorator.
    - `mesh`: a `DeviceMesh` or `jax.sharding.Mesh` (`None`: the mesh JAX has in context).
    - `in_specs`: one entry per positional argument (a tuple), a single `PartitionSpec`
      for all, or (for a one-argument function) that argument's entry. An entry is a
      `PartitionSpec` for every array of that argument, `None` for an argument without
      arrays, or a pytree prefix of the argument with `PartitionSpec`s at array leaves and
      `None` elsewhere (what `eqpar.partition_specs` returns).
    - `out_specs`: the same for the result (a prefix of the result's array leaves).
    - `check_vma`: passed to `jax.shard_map`.
    - `axis_names`: the mesh axes that are manual inside `fn` (default: all). The others
      are left to the compiler: `fn` sees whole arrays along them and the specs may still
      name them (they are dropped from what `jax.shard_map` is given; the arrays' own
      shardings carry them), so `eqpar.partition_specs(model)` serves as in_specs when, say,
      `Sharded` keys split the weights over `model` and a pipeline runs over `pipe`.
    - `stored_specs`: how the arguments are stored where that splits them further than
      `in_specs` (default: as `in_specs`), in the same forms as `in_specs`; e.g.
      `eqpar.FSDP.partition_specs(model)` with `in_specs` its `compute_specs`. An array
      enters split as stored and is all-gathered (tiled) over the mesh axes its stored spec
      adds at the end of an entry, so `fn` sees the block `in_specs` gives. Differentiated
      from outside, its gradient leaves by the gather's transpose, a reduce-scatter into the
      stored split (FSDP's gradient reduction); with the array entering whole instead, the
      compiler all-reduces the whole gradient and slices it. Inside `fn` a gathered array
      counts as varying over those axes (its gradient there is each device's share): reduce
      a result computed from it over them (`lax.pmean` of one that is the same on each
      device), as a loss over a split batch is; a gradient that `fn` takes itself is that
      share, and an out_spec that leaves the axis out refuses it.
    - `batch_stats`: what batch statistics the model's `eqx.nn.BatchNorm` layers compute
      (they, and `eqx.nn.SpectralNorm`, run as their twins `eqpar.nn.ParallelBatchNorm` /
      `ParallelSpectralNorm` inside `fn`, the original classes back in the results; the
      `eqx.nn.State` enters and leaves replicated, `P()`). `"global"` (the default): over the
      whole batch, as on one device: the mean over the vmap axis and every mesh axis the
      norm's input is split over (the data axes; a sequence split). `"per_shard"`: over
      each device's examples, with the running statistics averaged over the devices. A tuple
      of mesh axes: over those (the form `check_vma=False` needs, where JAX does not say how
      the input is split).

    **Returns:** the mapped function (or a decorator when `fn` is omitted).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P
    mesh = eqpar.DeviceMesh((8,), ("data",))
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))

    @eqpar.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    def apply(model, x):
        return jax.vmap(model)(x)

    x = jnp.ones((16, 4))
    assert jnp.allclose(apply(mlp, x), jax.vmap(mlp)(x))

    # Stored split over data (FSDP), seen whole: the gradient is reduce-scattered.
    fsdp = eqpar.FSDP(mesh, min_size_bytes=0)
    stored = eqx.filter_shard(mlp, eqpar.named_shardings(fsdp.partition_specs(mlp), mesh))
    loss = eqpar.shard_map(
        lambda m, x: jax.lax.pmean(jnp.mean(jax.vmap(m)(x) ** 2), "data"), mesh=mesh,
        in_specs=(fsdp.compute_specs(mlp), P("data")), out_specs=P(),
        stored_specs=(fsdp.partition_specs(mlp), P("data")),
    )
    grads = eqx.filter_jit(eqx.filter_grad(loss))(stored, x)
    assert grads.layers[0].weight.sharding.spec == P("data", None)

    # A stateful model, unchanged: BatchNorm's statistics are the whole batch's.
    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="batch")
    forward = lambda norm, state, x: jax.vmap(
        norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    out, new_state = eqpar.shard_map(
        forward, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P("data"), P())
    )(norm, state, x + jnp.arange(16.0)[:, None])
    assert jnp.allclose(out.mean(axis=0), 0.0, atol=1e-5)  # normalised over all 16 rows
    ```
    """
    if fn is None:
        return functools.partial(
            shard_map,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=check_vma,
            axis_names=axis_names,
            stored_specs=stored_specs,
            batch_stats=batch_stats,
        )
    if not callable(fn):
        raise TypeError(f"shard_map: fn must be callable; got {type(fn).__name__}.")
    # An `AbstractMesh` (axis sizes, no devices) traces as a mesh does: `eqpar.estimate`
    # reads such a program for a mesh larger than the machine.
    abstract = isinstance(mesh, jax.sharding.AbstractMesh)
    jax_mesh = mesh if abstract else as_jax_mesh(mesh) if mesh is not None else None
    batch_stats = check_batch_stats(batch_stats, "shard_map")
    if isinstance(batch_stats, tuple) and jax_mesh is not None:
        manual = set(jax_mesh.axis_names if axis_names is None else axis_names)
        unknown = [name for name in batch_stats if name not in manual]
        if unknown:
            raise ValueError(
                f"shard_map: batch_stats names {unknown[0]!r}, which is not a manual axis here "
                f"({sorted(manual, key=str)}); name the mesh axes the batch is split over."
            )
    extra = {} if axis_names is None else {"axis_names": frozenset(axis_names)}

    @functools.wraps(fn)
    def mapped(*args, **kwargs):
        if kwargs:
            raise TypeError(
                f"shard_map: {getattr(fn, '__name__', 'fn')} got keyword arguments "
                f"{sorted(kwargs)}; pass them positionally (each with its spec) or close over "
                f"them."
            )
        name = getattr(fn, "__name__", "fn")
        dynamic, static = eqx.partition(args, eqx.is_array)
        axes = None if jax_mesh is None else dict(jax_mesh.shape)
        specs = _argument_specs(in_specs, "in_specs", args, name, axes)
        stored = specs
        if stored_specs is not None:
            stored = _argument_specs(stored_specs, "stored_specs", args, name, axes)
        if axis_names is not None:
            specs = _manual_only(specs, frozenset(axis_names))
            stored = _manual_only(stored, frozenset(axis_names))
        gathers = [
            _gathers(arg, arg_stored, arg_specs, f"shard_map: argument {i} of {name}")
            for i, (arg, arg_stored, arg_specs) in enumerate(zip(args, stored, specs))
        ]
        static_out: list = []

        # The specs go to JAX as they are (no wrapping), so its own errors, such as a result
        # that differs over an axis its spec leaves out, read as they should.
        @functools.wraps(fn)
        def local(*local_dynamic):
            local_dynamic = tuple(
                _gathered(arg, plans) for arg, plans in zip(local_dynamic, gathers)
            )
            local_args = eqx.combine(local_dynamic, static)
            stateful = stateful_layer_kinds(local_args)
            if stateful:
                if eqx.nn.BatchNorm in stateful:
                    _check_batch_stats(batch_stats, check_vma, name)
                local_args = manual_stateful_layers(local_args, batch_stats=batch_stats)
            with fresh_record():
                try:
                    out = fn(*local_args)
                except ValueError as error:
                    if _STATE_SET_ERROR not in str(error):
                        raise
                    raise ValueError(_state_set_fix(name, error)) from error
            if stateful:
                out = serial_stateful_layers(out)
            out_dynamic, out_static = eqx.partition(out, eqx.is_array)
            static_out.append(out_static)
            if check_vma:
                _check_result_replication(out_dynamic, out_specs, name)
            return out_dynamic

        inner = jax.shard_map(
            local,
            mesh=jax_mesh,
            in_specs=stored,
            out_specs=out_specs
            if axis_names is None
            else _manual_only(out_specs, frozenset(axis_names)),
            check_vma=check_vma,
            **extra,
        )
        # Over Explicit mesh axes JAX takes only arguments typed as their in_specs say.
        manual = None if axis_names is None else frozenset(axis_names)
        entered_mesh = jax_mesh if jax_mesh is not None else context_mesh()
        dynamic = enter_shard_map(dynamic, tuple(stored), entered_mesh, manual=manual)
        out_dynamic = inner(*dynamic)
        return eqx.combine(out_dynamic, static_out[-1])

    return mapped


# The start of `eqx.nn.State.set`'s refusal of a value of another type than the old one's.
_STATE_SET_ERROR = "Old and new values have different structures/shapes/dtypes"


def _check_batch_stats(batch_stats: str | tuple, check_vma: bool, name: str) -> None:
    if not check_vma and not isinstance(batch_stats, tuple):
        raise ValueError(
            f"shard_map: {name} gets an eqx.nn.BatchNorm with check_vma=False, "
            f"where JAX does not say which mesh axes split the batch, so batch_stats="
            f"{batch_stats!r} cannot find them. Name them, e.g. batch_stats=('data',), or "
            f"leave check_vma=True."
        )


def _state_set_fix(name: str, error: ValueError) -> str:
    return (
        f"shard_map: a stateful layer in {name} stored a new value of another type than its "
        f"old one ({error}). Where the shapes and dtypes agree, the two differ in how JAX "
        f"types them inside shard_map: the eqx.nn.State enters replicated (in_specs P()) and "
        f"typed with the mesh, and the new value must match. Either it was computed from "
        f"values that differ between devices (a statistic of this device's share of a split "
        f"batch): average it over the axes the batch is split over "
        f"(`jax.lax.pmean(value, 'data')`) before `state.set`; or it is a fresh constant "
        f"(`jnp.array(False)`): build it from the old value (`jnp.zeros_like(old)`, "
        f"`old + 1`). eqpar runs eqx.nn.BatchNorm and eqx.nn.SpectralNorm as twins that do "
        f"this (see `batch_stats`)."
    )


def _argument_specs(
    given: PyTree, what: str, args: tuple, name: str, axes: dict | None
) -> tuple[PyTree, ...]:
    """`given` (`in_specs` or `stored_specs`) as one full specs pytree per argument, each
    checked against its argument's arrays and the mesh."""
    if is_spec_leaf(given):
        prefixes = (given,) * len(args)
    elif isinstance(given, tuple):
        if len(given) != len(args):
            raise ValueError(
                f"shard_map: {what} has {len(given)} entries but {name} got "
                f"{len(args)} positional arguments; give one spec (or spec pytree) per "
                f"argument."
            )
        prefixes = given
    elif len(args) == 1:
        prefixes = (given,)
    else:
        raise TypeError(
            f"shard_map: {what} is a {type(given).__name__} but {name} got {len(args)} "
            f"positional arguments; give a tuple with one spec (or spec pytree) per argument."
        )
    specs = tuple(
        expand_specs(prefix, arg, where=f"argument {i}", caller="shard_map", is_array=eqx.is_array)
        for i, (prefix, arg) in enumerate(zip(prefixes, args))
    )
    for i, (arg, arg_specs) in enumerate(zip(args, specs)):
        _check_argument_specs(arg, arg_specs, axes, f"shard_map: {what} for argument {i}")
    return specs


# One array's gathers: (dimension, the mesh axes to all-gather it over), in dimension order.
_Gathers = tuple[tuple[int, tuple[Hashable, ...]], ...]


def _gathers(arg: PyTree, stored: PyTree, specs: PyTree, source: str) -> list[_Gathers]:
    """For each array of `arg` (in leaf order), what turns its stored block into the block
    its in_spec gives: on each dimension, the axes the stored entry names after the in_spec
    entry's. An in_spec that is not the stored spec with axes left off the end of entries
    raises, naming the leaf."""
    by_path = {path: spec for path, _, spec in _arrays_with_specs(arg, stored)}
    plans = []
    for path, leaf, spec in _arrays_with_specs(arg, specs):
        rank = len(leaf.shape)
        kept = (*spec, *([None] * (rank - len(spec))))
        stored_spec = by_path.get(path, spec)
        held = (*stored_spec, *([None] * (rank - len(stored_spec))))
        plan = []
        for dim, (inside, outside) in enumerate(zip(kept, held)):
            if entry_names(outside)[: len(entry_names(inside))] != entry_names(inside):
                where = f"leaf {path_to_str(path)!r}" if path else "the array"
                raise ValueError(
                    f"{source}, {where}: stored as {show_spec(stored_spec)} but in_specs gives "
                    f"{show_spec(spec)}; dimension {dim} is split over {inside!r} inside and "
                    f"over {outside!r} as stored. An in_spec must be its stored spec with mesh "
                    f"axes left off the end of entries (what FSDP.compute_specs is to "
                    f"FSDP.partition_specs); reshard the array first otherwise."
                )
            inside, outside = entry_names(inside), entry_names(outside)
            if len(outside) > len(inside):
                plan.append((dim, outside[len(inside) :]))
        plans.append(tuple(plan))
    return plans


def _gathered(arg: PyTree, plans: list[_Gathers]) -> PyTree:
    """The local blocks of `arg` all-gathered as `plans` say (`_gathers`: one plan per array
    leaf, in leaf order)."""
    leaves, treedef = jax.tree.flatten(arg)
    arrays = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]
    for i, plan in zip(arrays, plans, strict=True):
        for dim, names in plan:
            leaves[i] = lax.all_gather(leaves[i], tuple(names), axis=dim, tiled=True)
    return jax.tree.unflatten(treedef, leaves)


def gather_stored(tree: PyTree, *, stored_specs: PyTree, in_specs: PyTree) -> PyTree:
    """Inside `shard_map`: all-gather the local blocks of `tree`, split as `stored_specs`
    say, into the blocks `in_specs` gives; what `eqpar.shard_map(stored_specs=...)` does as
    its arguments enter, for a function that takes gradients itself (a schedule's own
    backward pass, `PipelineModule.value_and_grad`). Differentiate through it
    (`eqx.filter_vjp`): the gradient of the stored blocks is the reduce-scatter of the
    gathered ones' (each device's share, as a gathered array counts as varying over the
    axes it was gathered over).

    **Arguments:**

    - `tree`: a pytree (an Equinox module) of local blocks.
    - `stored_specs`: how `tree` is stored: a `PartitionSpec` for every array, or a pytree
      prefix of `tree` (e.g. its part of `eqpar.FSDP.partition_specs(model)`).
    - `in_specs`: the blocks wanted, in the same forms (e.g. `compute_specs`): each entry the
      stored one with mesh axes left off its end. Name only the manual axes in both.

    **Returns:** `tree` with every array gathered to its `in_specs` block.

    ```python
    import jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.spmd import gather_stored

    mesh = eqpar.DeviceMesh((8,), ("data",))
    w, x = jnp.arange(32.0).reshape(4, 8) / 32, jnp.ones((16, 8))

    def loss(w, x):  # w: [4, 8] whole
        return jnp.mean((x @ w.T) ** 2)

    @eqpar.shard_map(mesh=mesh, in_specs=(P(None, "data"), P("data")),
                     out_specs=(P(), P(None, "data")))
    def loss_and_grad(block, x):  # block: [4, 1], this device's column of w
        def local(block):
            whole = gather_stored(block, stored_specs=P(None, "data"), in_specs=P())
            return jax.lax.pmean(loss(whole, x), "data")
        return jax.value_and_grad(local)(block)  # the gradient: reduce-scattered

    value, grad = jax.jit(loss_and_grad)(w, x)
    assert jnp.allclose(grad, jax.grad(loss)(w, x), rtol=1e-5)
    ```
    """
    expand = functools.partial(
        expand_specs, where="tree", caller="gather_stored", is_array=eqx.is_array
    )
    stored, inside = expand(stored_specs, tree), expand(in_specs, tree)
    return _gathered(tree, _gathers(tree, stored, inside, "gather_stored"))


def _manual_only(specs: PyTree, manual: frozenset) -> PyTree:
    """`specs` with the mesh axes that are not manual left out of every `PartitionSpec`."""

    def keep(entry: object) -> object:
        names: tuple = entry if isinstance(entry, tuple) else (entry,)
        kept = [name for name in names if name is not None and name in manual]
        if not kept:
            return None
        return tuple(kept) if len(kept) > 1 else kept[0]

    return jax.tree.map(
        lambda spec: PartitionSpec(*map(keep, spec)) if isinstance(spec, PartitionSpec) else spec,
        specs,
        is_leaf=lambda node: isinstance(node, PartitionSpec),
    )


def _check_result_replication(out: PyTree, out_specs: PyTree, name: str) -> None:
    """Each result array against its out_spec: one that differs over a mesh axis its spec
    leaves out is refused here, naming the leaf and the likely causes."""
    try:
        full = expand_specs(
            out_specs, out, where="result", caller="shard_map", is_array=eqx.is_array
        )
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"shard_map: out_specs does not fit what {name} returns: {error}"
        ) from error
    for path, leaf, spec in _arrays_with_specs(out, full):
        named = {axis for entry in spec for axis in entry_names(entry)}
        extra = sorted((varying_axes(leaf) - named), key=str)
        if extra:
            what = f"the result's leaf {path_to_str(path)!r}" if path else "the result"
            raise ValueError(
                f"shard_map: {what} returned by {name} differs between the devices of "
                f"axis {extra[0]!r} (it was computed from values split over it), but its "
                f"out_spec {spec} says it is the same on each. Average or sum it over the "
                f"axis inside {name} (`jax.lax.pmean(x, {extra[0]!r})`: a loss over a batch or "
                f"sequence split over it), or name the axis in its out_spec. A split parameter "
                f"read directly gives this too, e.g. a tied unembedding `embedding.weight` "
                f"after VocabParallel holds this device's rows of the vocabulary only: take "
                f"the loss of those logits with `eqpar.nn.vocab_parallel_cross_entropy`."
            )


def _check_argument_specs(
    arg: PyTree,
    specs: PyTree,
    axes: dict | None,
    source: str,
    *,
    is_array: Callable[[object], bool] = eqx.is_array,
) -> None:
    """Every array of `arg` against its spec, through the one spec checker."""
    for path, leaf, spec in _arrays_with_specs(arg, specs, is_array=is_array):
        check_spec(path_to_str(path), spec, tuple(leaf.shape), axes, source=source)


def _arrays_with_specs(
    tree: PyTree, specs: PyTree, *, is_array: Callable[[object], bool] = eqx.is_array
) -> list[tuple[tuple, PyTree, PyTree]]:
    """`(path, array, spec)` for each array leaf of `tree` (as `is_array` says) with a spec
    in `specs` (the full specs `expand_specs` gives for it); none where the structures
    differ, which JAX reports itself."""
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec_leaf)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    if len(flat_specs) != len(flat):
        return []
    return [
        (path, leaf, spec)
        for (path, leaf), spec in zip(flat, flat_specs)
        if is_array(leaf) and spec is not None
    ]


def build_sharded(
    constructor: Callable[..., PyTree],
    *args: PyTree,
    mesh: DeviceMesh | Mesh | None = None,
    specs: Specs | Callable[[PyTree], Specs] | None = None,
) -> PyTree:
    """Call `constructor(*args)` so that each device only ever materialises its own shards.

    The structure comes from `eqx.filter_eval_shape` (nothing is allocated); the arrays are then
    created by one `jax.jit` with `out_shardings`, so the compiler writes every parameter
    straight into its shards. The values equal those of `constructor(*args)` run eagerly.

    **Arguments:**

    - `constructor`: builds the model, e.g. `lambda key: eqx.nn.MLP(..., key=key)`.
    - `*args`: its positional arguments (arrays, such as a PRNG key, are traced; other
      values are passed as they are).
    - `mesh`: a `DeviceMesh` or `jax.sharding.Mesh`. `None`: the mesh of the current
      distribution (`eqpar.distribution()`), whose `partition_specs` then also stand in for
      `specs` when that is `None`; with no current distribution either, `ValueError`.
    - `specs`: the layout as a specs pytree, or a function from the abstract model to one
      (e.g. `distribution.partition_specs`); default `eqpar.partition_specs` (what modules
      declare, the rest replicated) when `mesh` is given.

    **Returns:** the model with every array placed by its spec.

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    mesh = eqpar.DeviceMesh((8,), ("data",))
    make = lambda key: eqx.nn.Linear(16, 8, key=key)
    specs = lambda model: eqx.tree_at(lambda m: (m.weight, m.bias), model, (P("data"), P()))
    layer = eqpar.build_sharded(make, jax.random.key(0), mesh=mesh, specs=specs)
    assert layer.weight.sharding.spec == P("data")
    assert (layer.weight == make(jax.random.key(0)).weight).all()

    with eqpar.FSDP(min_size_bytes=0).scope():  # no mesh: the current distribution's
        layer = eqpar.build_sharded(make, jax.random.key(0))
    assert layer.weight.sharding.spec == P(None, "data")  # [8, 16]: the larger dimension
    ```
    """
    if mesh is None:
        current: PyTree = _current.current()  # a Distribution (distributions.py sets it)
        if current is None:
            raise ValueError(
                "build_sharded: mesh is None and no distribution is current: pass mesh=... "
                "(and specs=...), or call eqpar.set_distribution(...) / use `with d.scope():`."
            )
        mesh = current.device_mesh
        if specs is None:
            specs = current.partition_specs
    assert mesh is not None
    abstract = eqx.filter_eval_shape(constructor, *args)
    static_arrays = _static_array_paths(abstract)
    if static_arrays:
        raise ValueError(
            f"build_sharded (and build_model): the model holds JAX arrays in static fields at "
            f"{static_arrays}: JAX "
            f"cannot build them on the devices (a static field is part of the model's "
            f"structure, not data). Make the field a plain one (drop `static=True`; eqpar "
            f"then places it like any parameter, and `eqx.filter` / `jax.lax.stop_gradient` "
            f"keep it out of training), or hold a tuple of Python numbers there instead."
        )
    if specs is None:
        spec_tree = partition_specs(abstract, mesh=mesh)
    elif callable(specs) and not isinstance(specs, eqx.Module):
        spec_tree = specs(abstract)
    else:
        spec_tree = specs
    spec_tree = expand_specs(spec_tree, abstract, where="model", caller="build_sharded")
    # Every spec against the mesh before anything compiles, naming the leaf (JAX's own error
    # names neither the leaf nor the spec that came with it).
    _check_argument_specs(
        abstract,
        spec_tree,
        dict(as_jax_mesh(mesh).shape),
        "build_sharded: specs",
        is_array=is_array_like,
    )
    shardings = named_shardings(spec_tree, mesh)
    _, static_model = eqx.partition(abstract, is_array_like)
    dynamic_args, static_args = eqx.partition(args, eqx.is_array)

    def make(dynamic):
        model = constructor(*eqx.combine(dynamic, static_args))
        return eqx.filter(model, eqx.is_array)

    arrays = jax.jit(make, out_shardings=shardings)(dynamic_args)
    return eqx.combine(arrays, static_model)


def _static_array_paths(tree: PyTree) -> list[str]:
    """The `/`-joined paths of the static fields of `tree`'s modules that hold JAX arrays."""
    found: list[str] = []

    def visit(node: PyTree, path: tuple) -> None:
        if isinstance(node, eqx.Module):
            for field in dataclasses.fields(node):
                value = getattr(node, field.name, None)
                where = (*path, jax.tree_util.GetAttrKey(field.name))
                if field.metadata.get("static", False):
                    if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(value)):
                        found.append(path_to_str(where))
                else:
                    visit(value, where)
            return
        children = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module)
        )[0]
        for child_path, child in children:
            if isinstance(child, eqx.Module):
                visit(child, (*path, *child_path))

    visit(tree, ())
    return found
