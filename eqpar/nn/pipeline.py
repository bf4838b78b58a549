"""`PipelineModule`: pipeline stages stacked over a mesh axis, and `ScannedLayers`.

The stages live on one leading axis of every parameter (`[S * V, ...]` for `S` devices and `V`
stages per device), sharded over the pipeline axis so that each device holds its own `V` rows
(convention 4 of the design). Inside `shard_map` the module runs the GPipe or circular
schedule of `eqpar.pipeline`; outside, `apply_serially` is its one-device twin.
"""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._declare import prefixed, stacked_partition_specs
from .._paths import path_to_str
from .._typing import AxisName
from ..pipeline import (
    _axis_size,
    _scan,
    execute_1f1b,
    execute_circular_pipeline,
    execute_pipeline,
)
from ..schedule import CircularSchedule, GPipeSchedule, OneFOneBSchedule, PipelineSchedule


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


def _positive_int(name: str, value: object, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: `{name}` must be an int, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"{owner}: `{name}` must be at least 1, got {value}.")
    return value


class ScannedLayers(eqx.Module):
    """A stack of identical layers applied one after the other with `lax.scan`.

    `layers` is one layer module whose array leaves carry a leading layer axis (build it with
    `eqx.filter_vmap` over one key per layer). Each layer is called as `layer(x, *args,
    **kwargs)` and must return the shape and dtype it takes. The compiled program holds one
    layer body whatever the depth. Layers that declare a sharding (`__partition_specs__`) keep
    it, shifted right by the layer axis.

    **Arguments:**

    - `layers`: the stacked layer module.

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

        def apply(h: Any, layer_arrays: Any) -> tuple[Any, None]:
            return eqx.combine(layer_arrays, static)(h, *args, **kwargs), None

        out, _ = _scan(apply, x, arrays)
        return out

    def __partition_specs__(self) -> Mapping[str, PartitionSpec]:
        return prefixed("layers", stacked_partition_specs(self.layers, None))


def _call_stage(stage: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    return stage(x, *args, **kwargs)


class _StageCall(eqx.Module):
    """A stage (or a stack of stages) called directly or under `jax.checkpoint`."""

    stage: Any
    remat: bool = eqx.field(static=True)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.remat:
            return eqx.filter_checkpoint(_call_stage)(self.stage, x, *args, **kwargs)
        return self.stage(x, *args, **kwargs)


def _device_major_order(num_stages: int, num_repeats: int) -> np.ndarray:
    """Row `d * V + r` of the stored stack holds model stage `r * S + d`."""
    rows = np.arange(num_stages * num_repeats).reshape(num_repeats, num_stages)
    return rows.T.reshape(-1)


class PipelineModule(eqx.Module):
    """Pipeline stages stacked on a leading axis sharded over a mesh axis.

    The model is `S * V` stages applied in order, where `S = num_stages` is the size of the
    pipeline mesh axis and `V = num_repeats` the stages each device holds. Every stage must
    return the shape and dtype it takes (keep embeddings and output heads outside). Called
    inside `shard_map` it runs GPipe (`V == 1`) or the circular schedule (`V > 1`), and
    `value_and_grad_1f1b` gives a training step in the 1F1B order. The module declares its
    layout (`__partition_specs__`): every stage leaf is `P(axis_name, *inner)`, where `inner`
    is whatever the stage's own modules declare (e.g. tensor-parallel layers).

    Stage `s` lives on device `s % S`. The stored stack `stages` is therefore in
    *device-major* order (row `d * V + r` is stage `r * S + d`); with `V == 1` that is simply
    stage order. `serial_stages()` and `stage(i)` give the model order back.

    **Arguments:**

    - `stages`: the `S * V` stages in model order, stacked on a leading axis (e.g.
      `eqx.filter_vmap(make_stage)(keys)`); each slice must be callable as
      `stage(x, *args, **kwargs)`. See also `from_stage_fn` and `from_layers`.
    - `num_stages`: `S`, which must equal the size of the mesh axis `axis_name`.
    - `num_microbatches`: how many microbatches each batch is cut into (must divide the
      per-device batch).
    - `axis_name`: the pipeline mesh axis.
    - `num_repeats`: `V`, stages per device (`> 1` selects the circular schedule).
    - `remat`: recompute each stage's activations in the backward pass instead of storing
      them (`jax.checkpoint` around every stage call).
    - `broadcast_output`: return the pipeline's result on every device of the axis instead
      of only on the last (zeros elsewhere); costs one `psum` of the output.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.nn.pipeline import PipelineModule

    def make_stage(key):
        return eqx.nn.MLP(4, 4, 8, 1, key=key)  # maps [4] -> [4]

    class Batched(eqx.Module):  # a stage that takes a batch [rows, 4]
        mlp: eqx.nn.MLP
        def __call__(self, x):
            return jax.vmap(self.mlp)(x)

    model = PipelineModule.from_stage_fn(
        lambda k: Batched(make_stage(k)), num_stages=4, key=jax.random.key(0),
        num_microbatches=2, broadcast_output=True,
    )
    specs = model.__partition_specs__()
    assert specs["stages/mlp/layers/0/weight"] == P("pipe")  # stage axis over "pipe"

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    arrays, static = eqx.partition(model, eqx.is_array)
    in_specs = jax.tree.map(lambda _: P("pipe"), arrays)

    def forward(arrays, x):
        return eqx.combine(arrays, static)(x)

    f = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=(in_specs, P()), out_specs=P()))
    x = jnp.ones((6, 4))
    assert jnp.allclose(f(arrays, x), model.apply_serially(x), rtol=1e-5, atol=1e-6)
    ```
    """

    stages: PyTree
    num_stages: int = eqx.field(static=True)
    num_microbatches: int = eqx.field(static=True)
    axis_name: AxisName = eqx.field(static=True)
    num_repeats: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)
    broadcast_output: bool = eqx.field(static=True)

    def __init__(
        self,
        stages: PyTree,
        *,
        num_stages: int,
        num_microbatches: int,
        axis_name: AxisName = "pipe",
        num_repeats: int = 1,
        remat: bool = False,
        broadcast_output: bool = False,
    ):
        owner = "PipelineModule"
        self.num_stages = _positive_int("num_stages", num_stages, owner)
        self.num_microbatches = _positive_int("num_microbatches", num_microbatches, owner)
        self.num_repeats = _positive_int("num_repeats", num_repeats, owner)
        self.axis_name = axis_name
        self.remat = bool(remat)
        self.broadcast_output = bool(broadcast_output)
        total = self.num_stages * self.num_repeats
        size = _common_leading_size(stages, "stages", owner)
        if size != total:
            raise ValueError(
                f"{owner}: `stages` is stacked {size} deep but num_stages * num_repeats = "
                f"{self.num_stages} * {self.num_repeats} = {total}; stack one stage per "
                f"(device, repeat)."
            )
        order = _device_major_order(self.num_stages, self.num_repeats)
        self.stages = stages if self.num_repeats == 1 else _map_arrays(lambda a: a[order], stages)

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
        assert model.stages.weight.shape == (4, 3, 3)
        ```
        """
        total = _positive_int("num_stages", num_stages, "PipelineModule.from_stage_fn")
        total *= _positive_int("num_repeats", num_repeats, "PipelineModule.from_stage_fn")
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
        `L` (`[L, ...]`); it becomes `[S * V, L / (S * V), ...]` and every stage runs its
        layers with `lax.scan` (`ScannedLayers`).

        **Arguments:**

        - `layers`: the stacked layers (e.g. `eqx.filter_vmap(make_layer)(keys)`).
        - `num_stages`, `num_microbatches`, `num_repeats`: as in the constructor; `L` must
          divide by `num_stages * num_repeats`.
        - `**options`: `axis_name`, `remat`, `broadcast_output`.

        **Returns:** a `PipelineModule` whose stages are `ScannedLayers`.

        ```python
        import equinox as eqx, jax
        from eqpar.nn.pipeline import PipelineModule
        layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(
            jax.random.split(jax.random.key(0), 8))
        model = PipelineModule.from_layers(layers, num_stages=4, num_microbatches=2)
        assert model.stages.layers.weight.shape == (4, 2, 3, 3)
        ```
        """
        owner = "PipelineModule.from_layers"
        s = _positive_int("num_stages", num_stages, owner)
        v = _positive_int("num_repeats", num_repeats, owner)
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
        return cls(
            ScannedLayers(stacked),
            num_stages=s,
            num_microbatches=num_microbatches,
            num_repeats=v,
            **options,
        )

    # ----------------------------------------------------------------------------------
    # Views in model order (outside shard_map).

    def serial_stages(self) -> PyTree:
        """The stage stack in model order (row `s` is stage `s`)."""
        if self.num_repeats == 1:
            return self.stages
        inverse = np.argsort(_device_major_order(self.num_stages, self.num_repeats))
        return _map_arrays(lambda a: a[inverse], self.stages)

    def stage(self, index: int) -> Any:
        """Stage `index` (model order) as an ordinary module."""
        total = self.num_stages * self.num_repeats
        if not 0 <= index < total:
            raise ValueError(f"PipelineModule.stage: `index` must be in [0, {total}), got {index}.")
        return _map_arrays(lambda a: a[index], self.serial_stages())

    def apply_serially(self, x: PyTree[Array], *args: Any, **kwargs: Any) -> PyTree[Array]:
        """The serial twin: every stage in model order on the whole batch, on one device.

        **Arguments:**

        - `x`: the batch (what `__call__` takes).
        - `*args`, `**kwargs`: passed to every stage.

        **Returns:** what the pipeline returns on its last device.
        """
        arrays, static = eqx.partition(self.serial_stages(), eqx.is_array)

        def apply(h: Any, stage_arrays: Any) -> tuple[Any, None]:
            return eqx.combine(stage_arrays, static)(h, *args, **kwargs), None

        out, _ = _scan(apply, x, arrays)
        return out

    def schedule(self, kind: str = "forward") -> PipelineSchedule:
        """The schedule this module runs: `"forward"` is GPipe or circular (as configured),
        `"1f1b"` the schedule of `value_and_grad_1f1b`."""
        if kind == "forward":
            if self.num_repeats == 1:
                return GPipeSchedule(self.num_stages, self.num_microbatches)
            return CircularSchedule(self.num_stages, self.num_microbatches, self.num_repeats)
        if kind == "1f1b":
            return OneFOneBSchedule(self.num_stages, self.num_microbatches)
        raise ValueError(
            f"PipelineModule.schedule: `kind` must be 'forward' or '1f1b', got {kind!r}."
        )

    def __partition_specs__(self) -> Mapping[str, PartitionSpec]:
        return prefixed("stages", stacked_partition_specs(self.stages, self.axis_name))

    # ----------------------------------------------------------------------------------
    # Inside shard_map.

    def _local_stages(self, caller: str) -> Any:
        size = _axis_size(self.axis_name, caller)
        if size != self.num_stages:
            raise ValueError(
                f"{caller}: the module has num_stages={self.num_stages} but the mesh axis "
                f"{self.axis_name!r} has {size} devices. Build the module with "
                f"num_stages={size} (with num_repeats stages per device for more stages), or "
                f"use a mesh whose {self.axis_name!r} axis has {self.num_stages} devices."
            )
        local = _common_leading_size(self.stages, "stages", caller)
        if local != self.num_repeats:
            raise ValueError(
                f"{caller}: each device sees {local} stacked stages but should see "
                f"num_repeats={self.num_repeats}: the leading axis of `stages` must be sharded "
                f"over {self.axis_name!r}. Pass the module with its declared layout "
                f"(`eqpar.partition_specs(module)`) as shard_map's in_specs."
            )
        return self.stages

    def __call__(self, x: PyTree[Array], *args: Any, **kwargs: Any) -> PyTree[Array]:
        """Run the pipeline inside `shard_map` (over `axis_name`).

        **Arguments:**

        - `x`: the batch, a pytree of arrays with a leading batch axis, the same on every
          device of the pipeline axis.
        - `*args`, `**kwargs`: passed to every stage call.

        **Returns:** the outputs in batch order on the last device of the axis and zeros on
        the others (on every device with `broadcast_output=True`).
        """
        local = _StageCall(self._local_stages("PipelineModule"), self.remat)
        options = dict(
            num_microbatches=self.num_microbatches,
            model_axis_name=self.axis_name,
            broadcast_output=self.broadcast_output,
        )
        if self.num_repeats == 1:
            stage = _map_arrays(lambda a: a[0], local)
            return execute_pipeline(stage, x, *args, **options, **kwargs)
        return execute_circular_pipeline(local, x, *args, **options, **kwargs)

    def value_and_grad_1f1b(
        self,
        loss_fn: Callable,
        x: PyTree[Array],
        targets: PyTree[Array],
        *args: Any,
        return_all_grads: bool = False,
        **kwargs: Any,
    ) -> tuple[Array, Any]:
        """Loss and gradients of a training step in the 1F1B order (inside `shard_map`).

        Equivalent to differentiating `mean over microbatches of loss_fn(self(x_m), t_m)`
        but each device holds at most `num_stages` microbatch inputs (see
        `eqpar.pipeline.execute_1f1b`). Needs `num_repeats == 1`. The loss is the same on
        every device of the pipeline axis. Over a data-parallel axis the loss is each shard's
        own, while the stage gradients arrive summed over it (as `jax.grad` inside
        `shard_map` gives them for replicated parameters): `lax.pmean` the loss and divide
        the gradients by the axis size for the mean.

        **Arguments:**

        - `loss_fn`: `loss_fn(outputs, targets) -> scalar` for one microbatch.
        - `x`, `targets`: the batch and its targets (leading batch axis).
        - `*args`, `**kwargs`: passed to every stage call.
        - `return_all_grads`: also return the gradients of `loss_fn`'s array leaves and of
          `x` (to continue the backward pass into an embedding before the pipeline).

        **Returns:** `(loss, grads)` where `grads` is a `PipelineModule` of gradients (this
        device's block, `None` for leaves that are not inexact arrays), or
        `(loss, (grads, loss_fn_grads, x_grads))` with `return_all_grads=True`.
        """
        caller = "PipelineModule.value_and_grad_1f1b"
        if self.num_repeats != 1:
            raise ValueError(
                f"{caller}: the 1F1B step runs one stage per device but this module has "
                f"num_repeats={self.num_repeats}. Use num_repeats=1, or train the circular "
                f"schedule by differentiating `module(x)`."
            )
        stage = _map_arrays(lambda a: a[0], self._local_stages(caller))
        loss, result = execute_1f1b(
            stage,
            loss_fn,
            x,
            targets,
            *args,
            num_microbatches=self.num_microbatches,
            model_axis_name=self.axis_name,
            return_all_grads=return_all_grads,
            **kwargs,
        )
        stage_grads = result[0] if return_all_grads else result
        stacked = jax.tree.map(lambda g: jnp.expand_dims(g, 0), stage_grads)
        grads = eqx.tree_at(lambda m: m.stages, self, stacked, is_leaf=lambda n: n is None)
        if return_all_grads:
            return loss, (grads, result[1], result[2])
        return loss, grads


__all__ = ["PipelineModule", "ScannedLayers"]
