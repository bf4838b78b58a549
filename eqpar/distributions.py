"""Distributions: how a model and its inputs are spread over a mesh.

`DataParallel` replicates parameters and splits the batch; `ModelParallel` places parameters
by a `LayoutMap`; `FSDP` also splits every large parameter over the data axis (ZeRO-3), on top
of any tensor-parallel split. Each produces layouts (`partition_specs`) and places arrays;
`jax.jit` / `eqx.filter_jit` then partitions the computation (GSPMD), inserting the gathers and
reductions the layouts imply.

The current distribution (`set_distribution`, `Distribution.scope`) is what the module-level
`build_model`, `distribute_model`, `distribute_input`, `distribute_opt_state` and
`eqpar.build_sharded` use when they are given none, as Keras layers read theirs.
"""

__all__ = [
    "DEFAULT_AXIS_NAME",
    "DEFAULT_FSDP_MIN_SIZE_BYTES",
    "FSDP",
    "DataParallel",
    "Distribution",
    "ModelParallel",
    "build_model",
    "distribute_input",
    "distribute_model",
    "distribute_opt_state",
    "distribution",
    "fsdp_spec",
    "gather_layers",
    "match_param_specs",
    "set_distribution",
]

import contextlib
import math
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, PRNGKeyArray

from . import _current
from ._axis_types import constrain as constrain_on_any_axes
from ._checks import check_int
from ._declare import declared_partition_specs
from ._paths import path_to_str
from ._specs import entry_names
from ._typing import PyTree, Specs
from .layout import LayoutMap, is_array_like, named_shardings, partition_specs
from .mesh import DeviceMesh, as_jax_mesh
from .nn.pipeline import PipelineModule
from .nn.stacks import ScannedLayers
from .placement import checked_local_leaves
from .spmd import build_sharded

DEFAULT_AXIS_NAME = "data"
"""The axis name of the 1-D mesh `DataParallel` and `FSDP` build when given no mesh."""

DEFAULT_FSDP_MIN_SIZE_BYTES = 16 * 1024
"""`FSDP` keeps leaves smaller than this replicated (biases, norms): gathering them would cost
a collective each while saving almost no memory."""


def _to_device_mesh(mesh: DeviceMesh | Mesh, where: str) -> DeviceMesh:
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, Mesh):
        # Auto axes whatever the mesh's types: a distribution leaves the model's own code to
        # the compiler, which under Explicit axes would refuse it (a batch split over `data`
        # times weights FSDP splits over `data` has no legal typed result). Inputs go
        # through `distribute_input`, onto this mesh.
        return DeviceMesh(mesh.devices.shape, tuple(mesh.axis_names), mesh.devices)
    raise TypeError(
        f"{where}: device_mesh must be an eqpar.DeviceMesh or jax.sharding.Mesh; got "
        f"{type(mesh).__name__}."
    )


def _mesh_from(
    where: str, device_mesh: DeviceMesh | Mesh | None, devices: Sequence[Any] | None
) -> DeviceMesh:
    if device_mesh is not None and devices is not None:
        raise ValueError(
            f"{where}: give device_mesh or devices, not both (a mesh already lists its devices)."
        )
    if device_mesh is not None:
        return _to_device_mesh(device_mesh, where)
    found = list(jax.devices()) if devices is None else list(devices)
    if not found:
        raise ValueError(f"{where}: devices is empty; give at least one device.")
    return DeviceMesh((len(found),), (DEFAULT_AXIS_NAME,), found)


class Distribution:
    """What every distribution offers; use `DataParallel`, `ModelParallel` or `FSDP`.

    A distribution produces layouts and places arrays; `jax.jit` / `eqx.filter_jit` partition
    the computation over the mesh from the shardings of their inputs.

    **Attributes:** `device_mesh` (a `DeviceMesh`) and `batch_dim_name` (the mesh axis the
    batch dimension of inputs is split over; `None` when inputs are replicated, see
    `ModelParallel(split_batch=False)`).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax, eqpar

    d = eqpar.FSDP()  # or eqpar.DataParallel(), eqpar.ModelParallel(layout_map=...)
    model = d.build_model(lambda key: eqx.nn.MLP(16, 16, 128, 1, key=key), jax.random.key(0))
    optimizer = optax.adam(1e-3)
    opt_state = d.distribute_opt_state(optimizer.init(eqx.filter(model, eqx.is_array)), model)

    @eqx.filter_jit
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
        )(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return d.constrain(model), d.constrain(opt_state, model), loss

    x = d.distribute_input(jnp.ones((32, 16)))
    model, opt_state, loss = step(model, opt_state, x)
    ```
    """

    device_mesh: DeviceMesh
    batch_dim_name: str | None

    def partition_specs(self, model: PyTree) -> Specs:
        """The layout of `model` as a specs pytree: where each parameter is stored.

        **Arguments:**

        - `model`: an Equinox module or pytree, concrete or abstract (`eqx.filter_eval_shape`).

        **Returns:** a pytree like `model` with a `PartitionSpec` at every array leaf and
        `None` elsewhere; see `eqpar.partition_specs`.
        """
        raise NotImplementedError

    def compute_specs(self, model: PyTree) -> Specs:
        """The layout the layers compute with: the `in_specs` for `model` in `eqpar.shard_map`.

        Inside `shard_map` a layer sees the blocks its own layout asks for (e.g. `TPDense`
        expects its weight split over `model` only). Where the storage layout
        (`partition_specs`) splits parameters further, as `FSDP` does over the data axis, pass
        the model stored by `partition_specs` to a `jax.jit`-ed step and give `shard_map` these
        specs: `jax.jit` gathers the extra split at the `shard_map` boundary and reduces the
        gradients back into storage. For `DataParallel` and `ModelParallel` the two layouts are
        the same.

        **Arguments:**

        - `model`: an Equinox module or pytree, concrete or abstract.

        **Returns:** a specs pytree like `partition_specs`' result.

        ```python
        import equinox as eqx, jax, eqpar
        from jax.sharding import PartitionSpec as P
        from eqpar.nn import TPDense

        mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
        layer = TPDense(64, 256, tp_mode="gather", key=jax.random.key(0))
        fsdp = eqpar.FSDP(mesh, axis="data")
        assert fsdp.partition_specs(layer).weight == P("model", "data")  # stored
        assert fsdp.compute_specs(layer).weight == P("model", None)  # seen in shard_map
        ```
        """
        return self.partition_specs(model)

    def shardings(self, model: PyTree) -> PyTree:
        """The layout of `model` as `NamedSharding`s of this distribution's mesh.

        **Arguments:**

        - `model`: an Equinox module or pytree.

        **Returns:** a pytree like `model` with `NamedSharding` at array leaves and `None`
        elsewhere, for `jax.jit`'s `in_shardings` / `out_shardings` or `jax.device_put` (on
        `eqx.filter(model, eqx.is_array)`).
        """
        return named_shardings(self.partition_specs(model), self.device_mesh)

    def distribute_model(self, model: PyTree) -> PyTree:
        """Place an existing model by its layout.

        **Arguments:**

        - `model`: an Equinox module or pytree (its arrays anywhere, e.g. on one device).

        **Returns:** the same model with every array placed by `partition_specs`; non-array
        leaves untouched. To avoid ever holding the whole model on one device, build it with
        `build_model` instead.
        """
        arrays, static = eqx.partition(model, eqx.is_array)
        return eqx.combine(jax.device_put(arrays, self.shardings(model)), static)

    def build_model(
        self, constructor: Callable[..., PyTree], key: PRNGKeyArray, *args: PyTree
    ) -> PyTree:
        """Build a model directly sharded (see `eqpar.build_sharded`).

        The structure comes from `eqx.filter_eval_shape` without allocating; one jit with
        output shardings then writes each shard on its own device, so the whole model never
        sits on one device. The values equal those of an eager `constructor(key, *args)`.

        **Arguments:**

        - `constructor`: called as `constructor(key, *args)`, e.g. `lambda key:
          eqx.nn.MLP(..., key=key)`.
        - `key`: a JAX PRNG key.
        - `*args`: more positional arguments for `constructor`.

        **Returns:** the model, every array placed by `partition_specs`.
        """
        return build_sharded(
            constructor, key, *args, mesh=self.device_mesh, specs=self.partition_specs
        )

    # --- inputs -------------------------------------------------------------------------------

    def batch_sharding(self, ndim: int = 1) -> NamedSharding:
        """The sharding of an input batch.

        **Arguments:**

        - `ndim`: the rank of the input.

        **Returns:** a `NamedSharding` splitting dimension 0 over `batch_dim_name`, or
        replicated (`P()`) when `batch_dim_name` is `None`.
        """
        if self.batch_dim_name is None:
            return self.device_mesh.sharding(PartitionSpec())
        spec = PartitionSpec(self.batch_dim_name, *([None] * (ndim - 1)))
        return self.device_mesh.sharding(spec)

    def distribute_input(
        self, batch: PyTree, *, pad: bool = False
    ) -> PyTree | tuple[PyTree, Bool[Array, " padded_batch"]]:
        """Split dimension 0 of every array in `batch` over the batch axis (or replicate it
        when `batch_dim_name` is `None`).

        In a single process `batch` is the global batch; with several processes each passes
        its own rows and they are joined into one global array
        (`jax.make_array_from_process_local_data`). The leaves are checked by the same code as
        `eqpar.placement.host_to_global_device_array` (`checked_local_leaves`): array data only,
        values that fit the dtype JAX uses (no silent `int64` -> `int32` wrap), and, with
        several processes, the same shapes and dtypes on every process (and the same values
        for a replicated batch), or a `ValueError` naming the leaf and the processes.

        **Arguments:**

        - `batch`: an array or a pytree of arrays (NumPy or JAX) sharing dimension 0.
        - `pad`: when the batch does not divide by the number of batch shards, pad it with
          zero rows and also return a mask (`True` for real rows). Without `pad` such a batch
          raises `ValueError`. A replicated batch always fits.

        With several processes and a replicated batch, every process passes the whole batch.

        **Returns:** the placed batch, or `(batch, mask)` when `pad=True`.
        """
        # The checks and the exchange that every process's data agrees are placement's own
        # (shared with `host_to_global_device_array`), before any shape-dependent decision.
        mesh = self.device_mesh.jax_mesh
        replicated = self.batch_dim_name is None
        paths, leaves, treedef = checked_local_leaves(
            batch, mesh, "distribute_input", same_values=replicated
        )
        if not leaves:
            raise ValueError("distribute_input: batch has no array leaves.")
        sizes = {}
        for path, leaf in zip(paths, leaves):
            where = "batch" if path == "<root>" else path
            if leaf.ndim == 0:
                raise ValueError(
                    f"distribute_input: leaf {where!r} has no batch dimension (shape "
                    f"{leaf.shape}); every leaf needs dimension 0 to split."
                )
            sizes[where] = leaf.shape[0]
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"distribute_input: leaves disagree on the batch size (dimension 0): {sizes}."
            )
        rows = next(iter(sizes.values()))
        axis = self.batch_dim_name
        shards = 1 if axis is None else self.device_mesh.axis_size(axis)
        processes = jax.process_count()
        multiple = shards // processes if processes > 1 and shards % processes == 0 else shards
        remainder = rows % multiple
        if remainder and not pad:
            raise ValueError(
                f"distribute_input: batch size {rows} does not divide by {multiple} (the "
                f"{self.batch_dim_name!r} mesh axis{' per process' if processes > 1 else ''}); "
                f"use a batch size that is a multiple of {multiple}, drop the last "
                f"{remainder} rows, or pass pad=True to get zero-padded rows and a mask."
            )
        padding = (multiple - remainder) % multiple if pad else 0
        if padding:
            leaves = [
                (jnp if isinstance(leaf, jax.Array) else np).pad(
                    leaf, [(0, padding)] + [(0, 0)] * (leaf.ndim - 1)
                )
                for leaf in leaves
            ]
        shardings = [self.batch_sharding(leaf.ndim) for leaf in leaves]
        placed = jax.make_array_from_process_local_data(
            treedef.unflatten(shardings), treedef.unflatten(leaves)
        )
        if not pad:
            return placed
        mask = np.arange(rows + padding) < rows
        return placed, jax.make_array_from_process_local_data(self.batch_sharding(1), mask)

    # --- optimizer state ----------------------------------------------------------------------

    def opt_state_specs(self, opt_state: PyTree, model: PyTree) -> Specs:
        """Specs for an optimizer state (e.g. optax's) laid out like the parameters.

        Every subtree of `opt_state` with the structure of `eqx.filter(model, eqx.is_array)`
        (Adam's `mu` and `nu`, momentum traces, ...) gets the parameters' specs, leaf by leaf
        where the shapes agree; everything else (step counts, factored statistics) is
        replicated. See `match_param_specs`.

        **Arguments:**

        - `opt_state`: the optimizer state, e.g. `optimizer.init(eqx.filter(model,
          eqx.is_array))`.
        - `model`: the model whose parameters the state mirrors.

        **Returns:** a specs pytree shaped like `eqx.filter(opt_state, eqx.is_array)`.
        """
        return match_param_specs(opt_state, model, self.partition_specs(model))

    def distribute_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """Place an optimizer state like the parameters it mirrors.

        **Arguments:**

        - `opt_state`: the optimizer state.
        - `model`: the model whose parameters the state mirrors.

        **Returns:** `opt_state` placed by `opt_state_specs` (under `FSDP`: sharded like the
        parameters; under `DataParallel`: replicated).
        """
        specs = self.opt_state_specs(opt_state, model)
        arrays, static = eqx.partition(opt_state, eqx.is_array)
        shardings = named_shardings(specs, self.device_mesh)
        return eqx.combine(jax.device_put(arrays, shardings), static)

    def constrain(self, tree: PyTree, model: PyTree | None = None) -> PyTree:
        """Pin the layout of `tree` inside a jitted function: `with_sharding_constraint` over
        the mesh's Auto axes, `jax.sharding.reshard` over its Explicit ones (outside `jit`,
        the arrays are placed with `jax.device_put`).

        The compiler picks the shardings of a jitted function's results by itself, and they
        need not be the layout (e.g. it may split a replicated bias). Pass the updated model
        (and optimizer state) through `constrain` before returning them from a train step,
        or give `jax.jit` `out_shardings`, to keep every parameter where its layout says.

        **Arguments:**

        - `tree`: a model, or (with `model`) a pytree that mirrors its parameters, such as an
          optax state.
        - `model`: the model `tree` mirrors; `None` when `tree` is the model.

        **Returns:** `tree` with its arrays constrained (non-array leaves untouched).
        """
        specs = self.partition_specs(tree) if model is None else self.opt_state_specs(tree, model)
        arrays, static = eqx.partition(tree, eqx.is_array)
        shardings = named_shardings(specs, self.device_mesh)
        constrained = jax.tree.map(constrain_on_any_axes, arrays, shardings)  # either axis type
        return eqx.combine(constrained, static)

    # --- current distribution -----------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator["Distribution"]:
        """Make this the current distribution (`eqpar.distribution()`) inside a `with` block.

        The setting is process-wide (every thread sees it); scopes nest, and on exit the
        previous distribution returns, also when the block raises.

        **Returns:** a context manager yielding this distribution.

        ```python
        import eqpar
        outer, inner = eqpar.DataParallel(), eqpar.FSDP()
        with outer.scope():
            with inner.scope():
                assert eqpar.distribution() is inner
            assert eqpar.distribution() is outer
        ```
        """
        with _current.scoped(self):
            yield self


def match_param_specs(tree: PyTree, model: PyTree, param_specs: Specs) -> Specs:
    """Give the subtrees of `tree` that mirror the parameters of `model` the parameters' specs.

    **Arguments:**

    - `tree`: e.g. an optax state.
    - `model`: the model (or its array part) whose parameters `tree` mirrors.
    - `param_specs`: the specs of `model`, as from `partition_specs`.

    **Returns:** specs shaped like `eqx.filter(tree, eqx.is_array)`: a parameter's spec where
    a leaf mirrors it with the same shape, `P()` at other arrays.

    ```python
    import equinox as eqx, jax, optax, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.distributions import match_param_specs
    mlp = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    specs = eqpar.FSDP(min_size_bytes=0).partition_specs(mlp)
    state = optax.adam(1e-3).init(eqx.filter(mlp, eqx.is_array))
    state_specs = match_param_specs(state, mlp, specs)
    assert state_specs[0].mu.layers[0].weight == specs.layers[0].weight == P("data", None)
    assert state_specs[0].count == P()
    ```
    """
    params = eqx.filter(model, is_array_like)
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    spec_leaves = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(spec_leaves) != len(flat_params):
        raise ValueError(
            f"match_param_specs: param_specs has {len(spec_leaves)} specs for "
            f"{len(flat_params)} array leaves of the model; pass the specs of this model."
        )
    by_path = {
        path_to_str(path): (tuple(leaf.shape), spec)
        for (path, leaf), spec in zip(flat_params, spec_leaves)
    }
    # Optimizers are initialised on the array part of a model filtered one way or another
    # (`eqx.is_array`, `eqx.is_inexact_array`); a subtree shaped like either mirrors it.
    mirrored_defs = {
        jax.tree.structure(eqx.filter(model, keep))
        for keep in (is_array_like, eqx.is_array, eqx.is_inexact_array)
    }

    def mirrors_params(node: object) -> bool:
        if is_array_like(node) or node is None:
            return False
        return jax.tree.structure(node) in mirrored_defs

    def assign(node: object):
        if mirrors_params(node):
            flat, treedef = jax.tree_util.tree_flatten_with_path(node)
            specs = []
            for path, leaf in flat:
                shape, spec = by_path.get(path_to_str(path), (None, PartitionSpec()))
                same_shape = is_array_like(leaf) and tuple(leaf.shape) == shape
                specs.append(spec if same_shape else PartitionSpec())
            return jax.tree.unflatten(treedef, specs)
        return PartitionSpec() if is_array_like(node) else None

    return jax.tree.map(assign, tree, is_leaf=mirrors_params)


class DataParallel(Distribution):
    """Replicate the parameters, split the batch (dimension 0 of inputs) over the devices.

    **Arguments:**

    - `device_mesh`: the mesh; its first axis carries the batch (a mesh of several axes
      warns: the others only replicate). Modules that declare a layout keep it. A
      `jax.sharding.Mesh` is used with Auto axes whatever its axis types (`device_mesh`
      says so): the compiler partitions the model's own code; place inputs with
      `distribute_input`.
    - `devices`: build a 1-D mesh (axis `"data"`) over these devices instead.

    Neither given: a 1-D mesh over all devices. Both given: `ValueError`.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P
    dp = eqpar.DataParallel()
    mlp = dp.build_model(lambda key: eqx.nn.MLP(4, 2, 8, 1, key=key), jax.random.key(0))
    x = dp.distribute_input(jnp.ones((16, 4)))
    assert x.sharding.spec == P("data", None) and mlp.layers[0].weight.sharding.spec == P()
    y = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))(mlp, x)
    assert y.shape == (16, 2)
    ```
    """

    def __init__(
        self, device_mesh: DeviceMesh | Mesh | None = None, devices: Sequence[Any] | None = None
    ):
        self.device_mesh = _mesh_from("DataParallel", device_mesh, devices)
        self.batch_dim_name = self.device_mesh.axis_names[0]
        if len(self.device_mesh.shape) > 1:
            warnings.warn(
                f"DataParallel: the mesh has axes {self.device_mesh.axis_names}; the batch is "
                f"split over the first, {self.batch_dim_name!r}, and replicated over the others.",
                stacklevel=2,
            )

    def partition_specs(self, model: PyTree) -> Specs:
        return partition_specs(model, mesh=self.device_mesh)

    def __repr__(self) -> str:
        return f"DataParallel({self.device_mesh!r})"


class ModelParallel(Distribution):
    """Place parameters by a `LayoutMap` (and what modules declare); split the batch over one
    mesh axis, or replicate it.

    **Arguments:**

    - `layout_map`: the `LayoutMap`; its mesh is the distribution's mesh.
    - `batch_dim_name`: the mesh axis for dimension 0 of inputs (default: the first axis).
    - `split_batch`: `False` leaves the batch unsplit: every device gets the whole batch
      (`batch_sharding` is `P()`, `distribute_input` replicates, `batch_dim_name` is `None`),
      e.g. for pure tensor parallelism where every mesh axis splits parameters. Do not give
      `batch_dim_name` with it.

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    layout_map = eqpar.LayoutMap(mesh)
    layout_map["layers/0/weight"] = ("model", None)   # column-parallel
    layout_map["layers/0/bias"] = ("model",)
    layout_map["layers/1/weight"] = (None, "model")   # row-parallel
    mp = eqpar.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    mlp = mp.build_model(lambda key: eqx.nn.MLP(8, 8, 16, 1, key=key), jax.random.key(0))
    assert mlp.layers[1].weight.sharding.spec == P(None, "model")

    tp_only = eqpar.ModelParallel(layout_map=layout_map, split_batch=False)
    assert tp_only.batch_sharding(2).spec == P()  # every device sees the whole batch
    ```
    """

    def __init__(
        self,
        *,
        layout_map: LayoutMap,
        batch_dim_name: str | None = None,
        split_batch: bool = True,
        **kwargs,
    ):
        if kwargs:
            raise TypeError(
                f"ModelParallel got unexpected keyword arguments {sorted(kwargs)}; it takes "
                f"layout_map, batch_dim_name and split_batch (the mesh comes from "
                f"layout_map.device_mesh)."
            )
        if not isinstance(layout_map, LayoutMap):
            raise TypeError(
                f"ModelParallel: layout_map must be an eqpar.LayoutMap; got "
                f"{type(layout_map).__name__}."
            )
        self.layout_map = layout_map
        self.device_mesh = _to_device_mesh(layout_map.device_mesh, "ModelParallel")
        self.split_batch = split_batch
        names = self.device_mesh.axis_names
        if not split_batch:
            if batch_dim_name is not None:
                raise ValueError(
                    f"ModelParallel: split_batch=False replicates the batch, so "
                    f"batch_dim_name={batch_dim_name!r} names no axis to split it over; drop "
                    f"batch_dim_name, or drop split_batch=False to split over that axis."
                )
            self.batch_dim_name = None
            return
        if batch_dim_name is None:
            batch_dim_name = names[0]
        if batch_dim_name not in names:
            raise ValueError(
                f"ModelParallel: batch_dim_name={batch_dim_name!r} is not an axis of the mesh "
                f"{names}; pick one of them."
            )
        self.batch_dim_name = batch_dim_name

    def partition_specs(self, model: PyTree) -> Specs:
        return partition_specs(model, self.layout_map, mesh=self.device_mesh)

    def __repr__(self) -> str:
        if not self.split_batch:
            return f"ModelParallel({self.layout_map!r}, split_batch=False)"
        return f"ModelParallel({self.layout_map!r}, batch_dim_name={self.batch_dim_name!r})"


def _fsdp_dim(
    shape: tuple[int, ...], nbytes: int, base: PartitionSpec, axis_size: int, min_size_bytes: int
) -> int | None:
    """The dimension FSDP splits: the largest one `base` leaves unsplit that divides by
    `axis_size` (the first on ties), or `None` for a leaf under `min_size_bytes`, a trivial
    axis, or no such dimension. Shared by `fsdp_spec` and the per-layer gathering of
    `gather_layers`, so both pick the same dimension."""
    if nbytes < min_size_bytes or axis_size == 1:
        return None
    entries = (*tuple(base), *([None] * (len(shape) - len(tuple(base)))))
    free = [
        d for d in range(len(shape)) if not entry_names(entries[d]) and shape[d] % axis_size == 0
    ]
    return max(free, key=lambda d: shape[d]) if free else None  # max keeps the first on ties


def fsdp_spec(
    shape: Sequence[int],
    dtype: Any,
    *,
    axis: str,
    axis_size: int,
    min_size_bytes: int = DEFAULT_FSDP_MIN_SIZE_BYTES,
    base: PartitionSpec | None = None,
) -> PartitionSpec:
    """The FSDP spec of one leaf: `base` (default `P()`, e.g. a tensor-parallel split) plus
    `axis` on the largest dimension that `base` leaves unsplit and that divides by
    `axis_size` (the first such dimension on ties).

    `base` comes back unchanged for leaves under `min_size_bytes` (measured on the whole
    leaf), for leaves without such a dimension, when `axis_size` is 1, and when `base`
    already uses `axis`.

    **Arguments:**

    - `shape`, `dtype`: the leaf's.
    - `axis`: the mesh axis to split over; `axis_size`: its number of devices.
    - `min_size_bytes`: leaves with fewer bytes are not split over `axis`.
    - `base`: the spec the leaf has without FSDP (at most one entry per dimension).

    **Returns:** a `PartitionSpec`.

    ```python
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from eqpar import fsdp_spec
    assert fsdp_spec((12, 64), jnp.float32, axis="data", axis_size=8) == P()  # 3 KiB
    assert fsdp_spec((12, 64), jnp.float32, axis="data", axis_size=8, min_size_bytes=0) == P(
        None, "data"
    )
    # A tensor-parallel weight [out, in] split on `out` gets the data axis on `in`.
    tp = P("model", None)
    assert fsdp_spec((1024, 256), jnp.float32, axis="data", axis_size=2, base=tp) == P(
        "model", "data"
    )
    ```
    """
    rank = len(shape)
    entries = tuple(base) if base is not None else ()
    if len(entries) > rank:
        raise ValueError(
            f"fsdp_spec: base={base} has {len(entries)} entries for a leaf of shape "
            f"{tuple(shape)}; give at most one entry per dimension."
        )
    unchanged = PartitionSpec() if base is None else base
    if any(axis in entry_names(entry) for entry in entries):
        return unchanged
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    dim = _fsdp_dim(tuple(shape), nbytes, unchanged, axis_size, min_size_bytes)
    if dim is None:
        return unchanged
    padded: list[Any] = [*entries, *([None] * (rank - len(entries)))]
    padded[dim] = axis
    return PartitionSpec(*padded)


class FSDP(Distribution):
    """Fully sharded data parallel (ZeRO-3): split the batch *and* every large parameter over
    one mesh axis, on top of whatever tensor-parallel split the parameter already has. The
    compiler brings together what each layer needs (gathering a parameter, or exchanging
    activations when cheaper) and reduces gradients back into the same layout. Shard the
    optimizer state the same way with `distribute_opt_state`.

    Each parameter starts from the layout that modules declare (`__partition_specs__`, e.g.
    `eqpar.nn.TPDense`) or `layout_map` gives (else `P()`), and is further split over `axis`
    on its largest dimension that this layout leaves unsplit and that divides by the axis size
    (`fsdp_spec` with `base=`). Leaves under `min_size_bytes` (default 16 KiB, the whole leaf),
    leaves without such a dimension, and leaves whose layout already uses `axis` keep their
    layout as it is. `compute_specs` gives the layout without the FSDP split.

    **Arguments:**

    - `device_mesh`: the mesh (default: `layout_map`'s, or a 1-D `"data"` mesh over
      `devices` or all devices); a `jax.sharding.Mesh` is used with Auto axes whatever its
      axis types, as for `DataParallel`.
    - `devices`: devices for the 1-D mesh; not together with `device_mesh`.
    - `axis`: the mesh axis for parameters and batch (default: the first axis).
    - `layout_map`: optional `LayoutMap` for leaves laid out explicitly.
    - `min_size_bytes`: leaves smaller than this are not split over `axis`.

    **With `shard_map` (tensor-parallel layers).** Layers such as `TPDense` expect, inside
    `shard_map`, blocks split over `model` only, while FSDP stores them split over `data` too.
    Store the model and optimizer state by `partition_specs` (what `build_model` and
    `distribute_opt_state` do), give `eqpar.shard_map` the model's `compute_specs` as
    `in_specs` and its `partition_specs` as `stored_specs`, and call it inside `jax.jit` /
    `eqx.filter_jit`: each parameter enters split over `data` and is all-gathered inside,
    and its gradient leaves by reduce-scatter (the gather's transpose), the embeddings' and
    the output head's as much as any layer's. (Given `compute_specs` alone, the compiler
    gathers the parameters before `shard_map` and all-reduces their whole gradients, 2x the
    bytes of a reduce-scatter.) A function that takes its gradients itself inside
    `shard_map` (a pipeline schedule's own backward pass) gathers with
    `eqpar.spmd.gather_stored` instead. Pin the results to the storage layout with
    `constrain`. `eqpar.nn.gather_layers` goes further for layer stacks: one layer gathered
    at a time.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.nn import TPDense

    mesh = eqpar.DeviceMesh((2, 4), ("data", "model"))
    fsdp = eqpar.FSDP(mesh, axis="data")

    class MLP(eqx.Module):
        up: TPDense
        down: TPDense

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up = TPDense(64, 256, tp_mode="gather", key=k1)  # weight P("model", None)
            self.down = TPDense(256, 64, tp_mode="scatter", key=k2)  # weight P(None, "model")

        def __call__(self, x):  # x: [rows, 64 / model] inside shard_map
            return self.down(jax.nn.relu(self.up(x)))

    model = fsdp.build_model(MLP, jax.random.key(0))
    assert model.up.weight.sharding.spec == P("model", "data")
    assert model.down.weight.sharding.spec == P("data", "model")
    optimizer = optax.adam(1e-3)
    opt_state = fsdp.distribute_opt_state(optimizer.init(eqx.filter(model, eqx.is_array)), model)

    rows = P("data", "model")  # batch over data, features over model
    forward = eqpar.shard_map(
        lambda m, x: m(x), mesh=mesh, in_specs=(fsdp.compute_specs(model), rows), out_specs=rows,
        stored_specs=(fsdp.partition_specs(model), rows),
    )

    @eqx.filter_jit
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(forward(m, x) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return fsdp.constrain(model), fsdp.constrain(opt_state, model), loss

    model, opt_state, loss = step(model, opt_state, fsdp.distribute_input(jnp.ones((8, 64))))
    assert opt_state[0].mu.up.weight.sharding.spec == P("model", "data")
    ```

    On a 1-D mesh with an ordinary Equinox model the same holds with nothing declared: every
    large parameter is split over `data`, and a plain `eqx.filter_jit` step (no `shard_map`)
    works as for any distribution (see `Distribution`).
    """

    def __init__(
        self,
        device_mesh: DeviceMesh | Mesh | None = None,
        *,
        devices: Sequence[Any] | None = None,
        axis: str | None = None,
        layout_map: LayoutMap | None = None,
        min_size_bytes: int = DEFAULT_FSDP_MIN_SIZE_BYTES,
    ):
        if layout_map is not None and device_mesh is None and devices is None:
            device_mesh = layout_map.device_mesh
        self.device_mesh = _mesh_from("FSDP", device_mesh, devices)
        if layout_map is not None and as_jax_mesh(layout_map.device_mesh) != (
            self.device_mesh.jax_mesh
        ):
            raise ValueError(
                "FSDP: layout_map is defined on another mesh than device_mesh; build the "
                "LayoutMap on the same DeviceMesh (or omit device_mesh)."
            )
        names = self.device_mesh.axis_names
        axis = names[0] if axis is None else axis
        if axis not in names:
            raise ValueError(f"FSDP: axis={axis!r} is not an axis of the mesh {names}.")
        if min_size_bytes < 0:
            raise ValueError(f"FSDP: min_size_bytes must be >= 0; got {min_size_bytes}.")
        self.axis = axis
        self.batch_dim_name = axis
        self.layout_map = layout_map
        self.min_size_bytes = min_size_bytes

    def compute_specs(self, model: PyTree) -> Specs:
        return partition_specs(model, self.layout_map, mesh=self.device_mesh)

    def partition_specs(self, model: PyTree) -> Specs:
        base = self.compute_specs(model)
        size = self.device_mesh.axis_size(self.axis)
        spec_leaves, treedef = jax.tree.flatten(base, is_leaf=_is_spec_or_none)
        leaves = treedef.flatten_up_to(model)
        specs = [
            fsdp_spec(
                leaf.shape,
                leaf.dtype,
                axis=self.axis,
                axis_size=size,
                min_size_bytes=self.min_size_bytes,
                base=spec,
            )
            if isinstance(spec, PartitionSpec) and is_array_like(leaf)
            else spec
            for spec, leaf in zip(spec_leaves, leaves)
        ]
        return jax.tree.unflatten(treedef, specs)

    def __repr__(self) -> str:
        return (
            f"FSDP({self.device_mesh!r}, axis={self.axis!r}, min_size_bytes={self.min_size_bytes})"
        )


def _is_spec_or_none(node: object) -> bool:
    return node is None or isinstance(node, PartitionSpec)


# ---------------------------------------------------------------------------------------------
# The current distribution (held in `_current`, which `spmd.build_sharded` reads too).


def set_distribution(value: Distribution | None) -> None:
    """Set the current distribution for the whole process (every thread); `None` clears it.

    Inside a `scope()`, this replaces the scope's distribution until the scope ends.

    **Arguments:**

    - `value`: a `DataParallel`, `ModelParallel`, `FSDP` or `None`.

    **Returns:** nothing.

    ```python
    import eqpar
    eqpar.set_distribution(eqpar.DataParallel())
    assert isinstance(eqpar.distribution(), eqpar.DataParallel)
    eqpar.set_distribution(None)
    ```
    """
    if value is not None and not isinstance(value, Distribution):
        raise TypeError(
            f"set_distribution: expected a Distribution (DataParallel, ModelParallel, FSDP) or "
            f"None; got {type(value).__name__}."
        )
    _current.set_current(value)


def distribution() -> Distribution | None:
    """The current distribution: the innermost active `scope()`, else what `set_distribution`
    set, else `None`.

    **Returns:** a `Distribution` or `None`.

    ```python
    import eqpar
    fsdp = eqpar.FSDP()
    with fsdp.scope():
        assert eqpar.distribution() is fsdp
    ```
    """
    value = _current.current()
    assert value is None or isinstance(value, Distribution)
    return value


def _resolve(given: Distribution | None, caller: str) -> Distribution:
    """`given`, else the current distribution, else a `ValueError` saying how to set one.

    (The public functions below take `distribution=`, which hides `distribution()` there.)
    """
    if given is not None:
        return given
    current = distribution()
    if current is None:
        raise ValueError(
            f"{caller}: no distribution given and none is current: pass distribution=... or "
            f"call eqpar.set_distribution(...) / use `with d.scope():`."
        )
    return current


def build_model(
    constructor: Callable[..., PyTree],
    key: PRNGKeyArray,
    *args: PyTree,
    distribution: Distribution | None = None,
) -> PyTree:
    """Build a model sharded at birth by `distribution`, or by the current one.

    The same as `distribution.build_model(constructor, key, *args)`; with no `distribution`
    it uses `eqpar.distribution()`, as a Keras layer reads the current distribution.

    **Arguments:**

    - `constructor`: called as `constructor(key, *args)`.
    - `key`: a JAX PRNG key.
    - `*args`: more positional arguments for `constructor`.
    - `distribution`: the distribution to use (default: the current one; `ValueError` if
      there is none).

    **Returns:** the model, every array placed by the distribution's `partition_specs`.

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.distributions import build_model

    with eqpar.FSDP(min_size_bytes=0).scope():
        mlp = build_model(lambda key: eqx.nn.MLP(8, 8, 64, 1, key=key), jax.random.key(0))
    assert mlp.layers[0].weight.sharding.spec == P("data", None)
    ```
    """
    d = _resolve(distribution, "build_model")
    return d.build_model(constructor, key, *args)


def distribute_model(model: PyTree, *, distribution: Distribution | None = None) -> PyTree:
    """Place an existing model by `distribution`'s layout, or by the current one's.

    **Arguments:**

    - `model`: an Equinox module or pytree.
    - `distribution`: the distribution to use (default: the current one; `ValueError` if
      there is none).

    **Returns:** the model placed as `distribution.distribute_model(model)` places it.

    ```python
    import equinox as eqx, jax, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.distributions import distribute_model

    eqpar.set_distribution(eqpar.DataParallel())
    mlp = distribute_model(eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0)))
    assert mlp.layers[0].weight.sharding.spec == P()
    eqpar.set_distribution(None)
    ```
    """
    return _resolve(distribution, "distribute_model").distribute_model(model)


def distribute_input(
    batch: PyTree, *, pad: bool = False, distribution: Distribution | None = None
) -> PyTree | tuple[PyTree, Bool[Array, " padded_batch"]]:
    """Place an input batch by `distribution`, or by the current one (see
    `Distribution.distribute_input`).

    **Arguments:**

    - `batch`: an array or a pytree of arrays sharing dimension 0.
    - `pad`: pad a batch that does not divide and also return a mask of the real rows.
    - `distribution`: the distribution to use (default: the current one; `ValueError` if
      there is none).

    **Returns:** the placed batch, or `(batch, mask)` when `pad=True`.

    ```python
    import jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.distributions import distribute_input

    with eqpar.DataParallel().scope():
        x = distribute_input(jnp.ones((16, 3)))
    assert x.sharding.spec == P("data", None)
    ```
    """
    return _resolve(distribution, "distribute_input").distribute_input(batch, pad=pad)


def distribute_opt_state(
    opt_state: PyTree, model: PyTree, *, distribution: Distribution | None = None
) -> PyTree:
    """Place an optimizer state like the parameters it mirrors, by `distribution` or by the
    current one (see `Distribution.distribute_opt_state`).

    **Arguments:**

    - `opt_state`: the optimizer state, e.g. `optimizer.init(eqx.filter(model,
      eqx.is_array))`.
    - `model`: the model whose parameters the state mirrors.
    - `distribution`: the distribution to use (default: the current one; `ValueError` if
      there is none).

    **Returns:** `opt_state` placed by the distribution's `opt_state_specs`.

    ```python
    import equinox as eqx, jax, optax, eqpar
    from jax.sharding import PartitionSpec as P
    from eqpar.distributions import build_model, distribute_opt_state

    with eqpar.FSDP(min_size_bytes=0).scope():
        mlp = build_model(lambda key: eqx.nn.MLP(8, 8, 64, 1, key=key), jax.random.key(0))
        state = distribute_opt_state(optax.adam(1e-3).init(eqx.filter(mlp, eqx.is_array)), mlp)
    assert state[0].mu.layers[0].weight.sharding.spec == P("data", None)
    ```
    """
    d = _resolve(distribution, "distribute_opt_state")
    return d.distribute_opt_state(opt_state, model)


# ---------------------------------------------------------------------------------------------
# FSDP layer by layer: the stacks of a model gather one layer's parameters at a time.


def _with_gathered_layers(
    stack: ScannedLayers,
    axis: Hashable,
    axis_size: int,
    leading: int,
    min_size_bytes: int,
    keep_gathered: bool,
) -> ScannedLayers:
    """`stack` with `gather_dims` chosen leaf by leaf, as FSDP would choose them for one layer
    (`leading`: the stacked dimensions in front of one layer's shape)."""
    declared = declared_partition_specs(stack.layers)
    dims: list[int | None] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(stack.layers)[0]:
        if not is_array_like(leaf):
            continue
        base = declared.get(path_to_str(path), PartitionSpec())
        shape = tuple(leaf.shape[leading:])
        nbytes = math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
        uses_axis = any(axis in entry_names(entry) for entry in base)
        dims.append(
            None if uses_axis else _fsdp_dim(shape, nbytes, base, axis_size, min_size_bytes)
        )
    if all(dim is None for dim in dims):
        return ScannedLayers(stack.layers, remat=stack.remat)
    return ScannedLayers(
        stack.layers,
        remat=stack.remat,
        gather_axis=axis,
        gather_dims=dims,
        keep_gathered=keep_gathered,
    )


def gather_layers(
    model: PyTree,
    mesh: DeviceMesh | Mesh,
    *,
    axis: Hashable = "data",
    min_size_bytes: int = 16 * 1024,
    keep_gathered: bool = False,
) -> PyTree:
    """FSDP layer by layer: store every stacked layer's parameters split over `axis`, and
    gather each layer's parameters only when the layer runs.

    Under `eqpar.FSDP` alone, `jax.jit` (or the `shard_map` boundary) gathers every parameter
    of the model before the first layer, so a device briefly holds the whole model. After
    `gather_layers`, each `ScannedLayers` (on its own, or as the stages of a
    `PipelineModule.from_layers`) declares its layers' parameters split over `axis` too, on
    the dimension `eqpar.fsdp_spec` would choose for one layer, and inside `eqpar.shard_map`
    all-gathers one layer's parameters at each step of its scan. Under every `remat` policy
    of the stack the gathered copies are kept out of what the backward pass saves: the
    backward pass gathers each layer again, and the transpose of the gather reduce-scatters
    the layer's gradient into the same split. A step then moves ZeRO-3's `3 (n-1)/n P` bytes
    per device over `axis` (`P` the stacks' parameter bytes, `n` the axis size: a gather in
    the forward pass, one in the backward pass, a reduce-scatter of the gradients), and
    holds at most a layer or two of whole parameters at a time. With `keep_gathered=True`
    each layer's gathered parameters are kept from its forward to its backward pass instead:
    no second gather (`2 (n-1)/n P`), at the cost of holding every stacked layer's whole
    parameters (`(n-1)/n P` more than the stored split) at the turn of the step.

    Parameters outside the stacks (embeddings, heads) are left to the distribution:
    `eqpar.FSDP(...)` splits them, and given as `stored_specs` to `eqpar.shard_map`
    (`FSDP.partition_specs`) they are gathered as they enter and their gradients
    reduce-scattered too (given only `in_specs`, the compiler gathers them before `shard_map`
    and all-reduces their whole gradients).

    Inside a pipeline the stage's layers are gathered at every microbatch step of the
    schedule, which multiplies the gather traffic by the number of steps; per-layer FSDP pays
    off most without a pipeline axis, or with few microbatches.

    **Arguments:**

    - `model`: a model holding `ScannedLayers` or `PipelineModule.from_layers` stacks.
    - `mesh`: the mesh; `axis` must be one of its axes.
    - `axis`: the mesh axis to split the parameters over (the data axis).
    - `min_size_bytes`: parameters of one layer smaller than this stay whole.
    - `keep_gathered`: keep each layer's gathered parameters for its backward pass instead
      of gathering them again (less traffic, more memory; see above).

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
    if not isinstance(keep_gathered, bool):
        raise TypeError(
            f"gather_layers: keep_gathered must be True or False; got {keep_gathered!r}."
        )
    size = int(jax_mesh.shape[axis])
    found = []

    def convert(node: PyTree) -> PyTree:
        if isinstance(node, PipelineModule) and isinstance(node.stages, ScannedLayers):
            found.append(node)
            stages = _with_gathered_layers(
                node.stages, axis, size, node._stacked_dims() + 1, min_size_bytes, keep_gathered
            )
            return eqx.tree_at(lambda m: m.stages, node, stages)
        if isinstance(node, ScannedLayers):
            found.append(node)
            return _with_gathered_layers(node, axis, size, 1, min_size_bytes, keep_gathered)
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
