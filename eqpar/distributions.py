"""Distributions: how a model and its inputs are spread over a mesh.

`DataParallel` replicates parameters and splits the batch; `ModelParallel` places parameters
by a `LayoutMap`; `FSDP` splits every parameter over the data axis (ZeRO-3). Each produces
layouts (`partition_specs`) and places arrays; `jax.jit` / `eqx.filter_jit` then partitions the
computation (GSPMD), inserting the gathers and reductions the layouts imply.
"""

__all__ = [
    "DEFAULT_AXIS_NAME",
    "DEFAULT_FSDP_MIN_SIZE_BYTES",
    "FSDP",
    "DataParallel",
    "Distribution",
    "ModelParallel",
    "distribution",
    "fsdp_spec",
    "match_param_specs",
    "set_distribution",
]

import contextlib
import itertools
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, PRNGKeyArray

from ._paths import path_to_str
from ._typing import PyTree, Specs
from .layout import LayoutMap, is_array_like, named_shardings, partition_specs
from .mesh import DeviceMesh, as_jax_mesh
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
    batch dimension of inputs is split over).

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
    batch_dim_name: str

    def partition_specs(self, model: PyTree) -> Specs:
        """The layout of `model` as a specs pytree.

        **Arguments:**

        - `model`: an Equinox module or pytree, concrete or abstract (`eqx.filter_eval_shape`).

        **Returns:** a pytree like `model` with a `PartitionSpec` at every array leaf and
        `None` elsewhere; see `eqpar.partition_specs`.
        """
        raise NotImplementedError

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
        self, constructor: Callable[..., PyTree], key: PRNGKeyArray, *args: Any
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

        **Returns:** a `NamedSharding` splitting dimension 0 over `batch_dim_name`.
        """
        spec = PartitionSpec(self.batch_dim_name, *([None] * (ndim - 1)))
        return self.device_mesh.sharding(spec)

    def distribute_input(
        self, batch: PyTree, *, pad: bool = False
    ) -> PyTree | tuple[PyTree, Bool[Array, " padded_batch"]]:
        """Split dimension 0 of every array in `batch` over the batch axis.

        In a single process `batch` is the global batch; with several processes each passes
        its own rows and they are joined into one global array
        (`jax.make_array_from_process_local_data`).

        **Arguments:**

        - `batch`: an array or a pytree of arrays (NumPy or JAX) sharing dimension 0.
        - `pad`: when the batch does not divide by the number of batch shards, pad it with
          zero rows and also return a mask (`True` for real rows). Without `pad` such a batch
          raises `ValueError`.

        **Returns:** the placed batch, or `(batch, mask)` when `pad=True`.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
        if not flat:
            raise ValueError("distribute_input: batch has no array leaves.")
        sizes = {}
        for path, leaf in flat:
            where = path_to_str(path) or "batch"
            if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
                raise ValueError(
                    f"distribute_input: leaf {where!r} has no batch dimension (shape "
                    f"{getattr(leaf, 'shape', type(leaf).__name__)}); every leaf needs "
                    f"dimension 0 to split."
                )
            sizes[where] = leaf.shape[0]
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"distribute_input: leaves disagree on the batch size (dimension 0): {sizes}."
            )
        rows = next(iter(sizes.values()))
        shards = self.device_mesh.axis_size(self.batch_dim_name)
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
        leaves = []
        for _, leaf in flat:
            leaf = np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
            if padding:
                widths = [(0, padding)] + [(0, 0)] * (leaf.ndim - 1)
                leaf = (jnp if isinstance(leaf, jax.Array) else np).pad(leaf, widths)
            leaves.append(self._place_rows(leaf))
        placed = jax.tree_util.tree_unflatten(treedef, leaves)
        if not pad:
            return placed
        mask = np.arange(rows + padding) < rows
        return placed, self._place_rows(mask)

    def _place_rows(self, leaf):
        sharding = self.batch_sharding(leaf.ndim)
        if jax.process_count() > 1:
            return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))
        return jax.device_put(leaf, sharding)

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
        """Pin the layout of `tree` inside a jitted function (`with_sharding_constraint`).

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
        constrained = jax.lax.with_sharding_constraint(
            arrays, named_shardings(specs, self.device_mesh)
        )
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
        token = _push(self)
        try:
            yield self
        finally:
            _pop(token)


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
      warns: the others only replicate). Modules that declare a layout keep it.
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
    mesh axis.

    **Arguments:**

    - `layout_map`: the `LayoutMap`; its mesh is the distribution's mesh.
    - `batch_dim_name`: the mesh axis for dimension 0 of inputs (default: the first axis).

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
    ```
    """

    def __init__(self, *, layout_map: LayoutMap, batch_dim_name: str | None = None, **kwargs):
        if kwargs:
            raise TypeError(
                f"ModelParallel got unexpected keyword arguments {sorted(kwargs)}; it takes "
                f"layout_map and batch_dim_name (the mesh comes from layout_map.device_mesh)."
            )
        if not isinstance(layout_map, LayoutMap):
            raise TypeError(
                f"ModelParallel: layout_map must be an eqpar.LayoutMap; got "
                f"{type(layout_map).__name__}."
            )
        self.layout_map = layout_map
        self.device_mesh = _to_device_mesh(layout_map.device_mesh, "ModelParallel")
        names = self.device_mesh.axis_names
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
        return f"ModelParallel({self.layout_map!r}, batch_dim_name={self.batch_dim_name!r})"


def fsdp_spec(
    shape: Sequence[int],
    dtype: Any,
    *,
    axis: str,
    axis_size: int,
    min_size_bytes: int = DEFAULT_FSDP_MIN_SIZE_BYTES,
) -> PartitionSpec:
    """The FSDP spec of one leaf: its largest dimension that divides by `axis_size`, split
    over `axis` (the first such dimension on ties); `P()` for leaves under `min_size_bytes`
    or without a dividing dimension.

    **Arguments:**

    - `shape`, `dtype`: the leaf's.
    - `axis`: the mesh axis to split over; `axis_size`: its number of devices.
    - `min_size_bytes`: leaves with fewer bytes stay replicated.

    **Returns:** a `PartitionSpec`.

    ```python
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from eqpar import fsdp_spec
    assert fsdp_spec((12, 64), jnp.float32, axis="data", axis_size=8) == P()  # 3 KiB
    assert fsdp_spec((12, 64), jnp.float32, axis="data", axis_size=8, min_size_bytes=0) == P(
        None, "data"
    )
    ```
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < min_size_bytes or axis_size == 1:
        return PartitionSpec()
    candidates = [(size, -dim) for dim, size in enumerate(shape) if size % axis_size == 0]
    if not candidates:
        return PartitionSpec()
    _, neg_dim = max(candidates)
    dim = -neg_dim
    return PartitionSpec(*([None] * dim), axis, *([None] * (len(shape) - dim - 1)))


class FSDP(Distribution):
    """Fully sharded data parallel (ZeRO-3): split the batch *and* every parameter over one
    mesh axis. The compiler brings together what each layer needs (gathering a parameter, or
    exchanging activations when cheaper) and reduces gradients back into the same layout.
    Shard the optimizer state the same way with `distribute_opt_state`.

    Each parameter is split on its largest dimension that divides by the axis size
    (`fsdp_spec`); leaves under `min_size_bytes` (default 16 KiB), and leaves without a
    dividing dimension, stay replicated. What modules declare and what `layout_map` says
    (e.g. tensor parallelism over another mesh axis) are kept as they are; FSDP only splits
    the leaves nothing else speaks for.

    **Arguments:**

    - `device_mesh`: the mesh (default: `layout_map`'s, or a 1-D `"data"` mesh over
      `devices` or all devices).
    - `devices`: devices for the 1-D mesh; not together with `device_mesh`.
    - `axis`: the mesh axis for parameters and batch (default: the first axis).
    - `layout_map`: optional `LayoutMap` for leaves laid out explicitly.
    - `min_size_bytes`: leaves smaller than this stay replicated.

    ```python
    import equinox as eqx, jax, optax, eqpar
    from jax.sharding import PartitionSpec as P
    fsdp = eqpar.FSDP(min_size_bytes=0)
    mlp = fsdp.build_model(lambda key: eqx.nn.MLP(8, 8, 64, 1, key=key), jax.random.key(0))
    assert mlp.layers[0].weight.sharding.spec == P("data", None)
    state = optax.adam(1e-3).init(eqx.filter(mlp, eqx.is_array))
    state = fsdp.distribute_opt_state(state, mlp)
    assert state[0].mu.layers[0].weight.sharding.spec == P("data", None)
    ```
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

    def partition_specs(self, model: PyTree) -> Specs:
        size = self.device_mesh.axis_size(self.axis)

        def default(path: str, leaf: jax.ShapeDtypeStruct) -> PartitionSpec:
            return fsdp_spec(
                leaf.shape,
                leaf.dtype,
                axis=self.axis,
                axis_size=size,
                min_size_bytes=self.min_size_bytes,
            )

        return partition_specs(model, self.layout_map, mesh=self.device_mesh, default=default)

    def __repr__(self) -> str:
        return (
            f"FSDP({self.device_mesh!r}, axis={self.axis!r}, min_size_bytes={self.min_size_bytes})"
        )


# ---------------------------------------------------------------------------------------------
# The current distribution: one process-wide stack, so every thread sees the same one.

_lock = threading.Lock()
_base: Distribution | None = None
_scopes: list[tuple[int, Distribution | None]] = []
_tokens = itertools.count()


def _push(d: Distribution) -> int:
    token = next(_tokens)
    with _lock:
        _scopes.append((token, d))
    return token


def _pop(token: int) -> None:
    with _lock:
        for i in range(len(_scopes) - 1, -1, -1):
            if _scopes[i][0] == token:
                del _scopes[i]
                return


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
    global _base
    if value is not None and not isinstance(value, Distribution):
        raise TypeError(
            f"set_distribution: expected a Distribution (DataParallel, ModelParallel, FSDP) or "
            f"None; got {type(value).__name__}."
        )
    with _lock:
        if _scopes:
            _scopes[-1] = (_scopes[-1][0], value)
        else:
            _base = value


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
    with _lock:
        return _scopes[-1][1] if _scopes else _base
