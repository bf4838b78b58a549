"""`PipelineModule`: pipeline stages stacked over a mesh axis (layer stacks and their remat
policies are in `eqpar.nn.stacks`, per-layer FSDP gathering with FSDP in `eqpar.distributions`;
both stay importable from here).

The stages are stored in model order whatever the schedule (conventions 4 and 7 of the
design): `[S, ...]` for `S` devices, or `[V, S, ...]` with `V` stages per device, which is
the model-order stack `[S * V, ...]` reshaped. The `S` axis is sharded over the pipeline
axis, so device `d` holds stages `d, S + d, 2S + d, ...` with no reordering, and a checkpoint
differs between layouts by a reshape at most. Inside `shard_map` the module runs the GPipe or
circular schedule of `eqpar.pipeline`; outside, `apply_serially` is its one-device twin.
"""

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import axis_size
from .._checks import check_int
from .._declare import prefixed, stacked_partition_specs
from .._paths import path_to_str
from .._schedule_tables import check_stages_per_device
from .._typing import AxisName
from ..pipeline import execute_schedule
from ..pipeline._executors import call_stage, circular_forward, gpipe_forward
from ..pipeline._layered import LayerStack, stack_of
from ..pipeline._microbatch import batch_size, unwrap_microbatched
from ..pipeline._table_grad import TableBackward
from ..pipeline._tools import typed_scan
from ..schedule import (
    SCHEDULES,
    CircularSchedule,
    DualPipeVSchedule,
    GPipeSchedule,
    OneFOneBSchedule,
    PipelineSchedule,
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
)
from .stacks import (
    AROUND_LAYERS,
    REMAT_POLICIES,
    RematPolicy,
    ScannedLayers,
    common_leading_size,
    map_arrays,
    remat_of_layers,
    remat_policy,
    rematerialized,
)


class _StageCall(eqx.Module):
    """A stage (or a stack of stages) called directly or under `jax.checkpoint`."""

    stage: PyTree
    remat: RematPolicy = eqx.field(static=True)

    def __call__(self, x: PyTree, *args: PyTree, **kwargs: Any) -> PyTree:
        return rematerialized(call_stage, self.remat)(self.stage, x, *args, **kwargs)

    def __pipeline_layers__(self) -> LayerStack | None:
        """The stage's layers, when the stage is a stack of them called as it is."""
        inner = stack_of(self.stage) if self.remat == "none" else None
        if inner is None:
            return None
        return LayerStack(lambda call: inner.where(call.stage), inner.call)


def _leading_shapes(tree: PyTree, ndim: int) -> dict[str, tuple[int, ...]]:
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
    training schedule: 1F1B, zero-bubble ZB-H1, GPipe / circular, or (`V == 2`) the
    V-shaped ZB-V and DualPipeV.

    **Storage.** `stages` is always in model order: `[S, ...]` (row `s` is stage `s`) with
    `V == 1`, and `[V, S, ...]` with `V > 1`, which is the model-order stack `[S * V, ...]`
    reshaped, so element `[r, d]` is stage `r * S + d`. The module declares its layout
    (`__partition_specs__`): `P(axis_name, *inner)`, or `P(None, axis_name, *inner)` with
    `V > 1`, where `inner` is whatever the stage's own modules declare (e.g. tensor-parallel
    layers). Device `d` thus holds stages `d, S + d, 2S + d, ...` without any reordering.
    `serial_stages()`, `stage(i)` and (for `from_layers`) `to_layers()` are reshapes and
    indexing, and a checkpoint written under one `(S, V)` restores under another by a
    reshape (`eqpar.checkpoint.Checkpointer.restore(..., reshape=True)`): of the stacking
    dimensions only, so layers a stage stacks on its own (rather than through `from_layers`
    or `ScannedLayers`) must keep their shape.

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
    - `backward`: how a differentiated `__call__` is differentiated: `"table"` (the default)
      runs the backward half of the schedule's training table in reverse mode (a custom
      VJP, keeping what each backward reads); `jax.jvp` and `jax.jacfwd` traced through the
      run differentiate the step loop instead. `"autodiff"` always differentiates the step
      loop, which keeps each step's residuals (more memory) but supports every transform,
      `jax.linearize` and a `jax.jvp` of an already-jitted function included.

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
    backward: str = eqx.field(static=True)

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
        backward: str = "table",
    ):
        owner = "PipelineModule"
        if backward not in ("table", "autodiff"):
            raise ValueError(
                f"{owner}: `backward` is 'table' (reverse mode through the training table's "
                f"backward, the default) or 'autodiff' (autodiff of the step loop: forward "
                f"mode too, more memory); got {backward!r}."
            )
        self.backward = backward
        self.num_stages = check_int(num_stages, name="num_stages", owner=owner)
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        self.num_repeats = check_int(num_repeats, name="num_repeats", owner=owner)
        self.axis_name = axis_name
        self.remat = remat_policy(remat, owner)
        self.broadcast_output = bool(broadcast_output)
        s, v = self.num_stages, self.num_repeats
        size = common_leading_size(stages, "stages", owner)
        if size != s * v:
            raise ValueError(
                f"{owner}: `stages` is stacked {size} deep but num_stages * num_repeats = "
                f"{s} * {v} = {s * v}; stack one stage per (device, repeat), in model order."
            )
        if v > 1:
            stages = map_arrays(lambda a: a.reshape(v, s, *a.shape[1:]), stages)
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
          `broadcast_output`, `backward`).

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
        - `**options`: `axis_name`, `remat`, `broadcast_output`, `backward`.

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
        if isinstance(layers, list | tuple):
            raise TypeError(
                f"{owner}: `layers` is a {type(layers).__name__} of {len(layers)} layers; it "
                f"takes one layer module whose arrays are stacked on a leading axis. Stack the "
                f"list with `eqpar.nn.stack_layers(layers)` first (or put "
                f"`eqpar.Pipeline(...)` on the list in a plan, which keeps the model's own "
                f"forward)."
            )
        num_layers = common_leading_size(layers, "layers", owner)
        total = s * v
        if num_layers % total:
            raise ValueError(
                f"{owner}: {num_layers} layers do not divide into num_stages * num_repeats = "
                f"{s} * {v} = {total} stages of equal depth. Choose a stage count that divides "
                f"{num_layers}, or add layers."
            )
        per_stage = num_layers // total
        stacked = map_arrays(lambda a: a.reshape(total, per_stage, *a.shape[1:]), layers)
        # The policy goes to each layer; a checkpoint around the whole stage on top of it
        # would only recompute the per-layer checkpoints once more.
        remat = remat_policy(options.pop("remat", "none"), owner)
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
        return map_arrays(lambda a: a.reshape(total, *a.shape[2:]), self.stages)

    def stage(self, index: int) -> PyTree:
        """Stage `index` (model order) as an ordinary module."""
        total = self.num_stages * self.num_repeats
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < total:
            raise ValueError(f"PipelineModule.stage: `index` must be in [0, {total}), got {index}.")
        if self.num_repeats == 1:
            return map_arrays(lambda a: a[index], self.stages)
        repeat, device = divmod(index, self.num_stages)
        return map_arrays(lambda a: a[repeat, device], self.stages)

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

        return map_arrays(flatten, self.stages.layers)

    def apply_serially(self, x: PyTree[Array], *args: PyTree, **kwargs: Any) -> PyTree[Array]:
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

        def apply(h: PyTree, stage_arrays: PyTree) -> tuple[Any, None]:
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
          `"1f1b"`, `"zb-h1"`, `"zb-v"` or `"dualpipe-v"`: the schedules of
          `value_and_grad`. (`"forward"` and
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
        tables: dict[str, Callable[[int, int], PipelineSchedule]] = {
            "1f1b": OneFOneBSchedule,
            "zb-h1": ZeroBubbleH1Schedule,
            "zb-v": ZeroBubbleVSchedule,
            "dualpipe-v": DualPipeVSchedule,
        }
        return tables[name](s, m)

    def __partition_specs__(self) -> Mapping[str, PartitionSpec]:
        before = self._stacked_dims() - 1
        specs = stacked_partition_specs(self.stages, self.axis_name, unsharded_before=before)
        return prefixed("stages", specs)

    # ----------------------------------------------------------------------------------
    # Inside shard_map.

    def _local_stages(self, caller: str) -> PyTree:
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
            local = common_leading_size(self.stages, "stages", caller)
            if local != 1:
                raise ValueError(
                    f"{caller}: each device sees {local} stacked stages but should see "
                    f"num_repeats=1: the leading axis of `stages` must be sharded over "
                    f"{self.axis_name!r}. {fix}"
                )
            return map_arrays(lambda a: a[0], self.stages)
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
        return map_arrays(lambda a: a[:, 0], self.stages)

    def __call__(self, x: PyTree[Array], *args: PyTree, **kwargs: Any) -> PyTree[Array]:
        """Run the pipeline inside `shard_map` (over `axis_name`).

        **Arguments:**

        - `x`: the batch, a pytree of arrays with a leading batch axis, the same on every
          device of the pipeline axis.
        - `*args`, `**kwargs`: passed to every stage call; a value wrapped in
          `eqpar.pipeline.Microbatched` (say a padding mask `[batch, seq]`) is split into
          microbatches with `x`, each stage call getting the rows of its microbatch.

        **Returns:** the outputs in batch order on the last device of the axis and zeros on
        the others (on every device with `broadcast_output=True`).

        Differentiated (`jax.grad` of a loss of the outputs), the run's backward pass is the
        backward half of the schedule's training table, as `value_and_grad(schedule=
        "gpipe")` (or `"circular"`) runs it under the same `remat`: each forward keeps what
        its backward reads (scanned layers one layer at a time, each layer's gradient added
        into the sum in place), and a circular stage's weights are not kept per step. A
        floating-point argument computed from what is differentiated (the table gives extra
        arguments no gradients), a stage with a `ppermute`, and `check_vma=False` are
        differentiated by autodiff of the step loop instead, as is a run traced under
        forward mode (`jax.jvp`, `jax.jacfwd`); `jax.linearize`, or `jax.jvp` of a function
        jitted before, needs `backward="autodiff"`.
        """
        stages = self._local_stages("PipelineModule")
        # The executor checkpoints each stage call itself, under the policy of `remat`, or
        # else that of the layers inside the stage (a policy around an inner
        # `jax.checkpoint` overrides it): it then skips the stage in each device's idle
        # steps, and takes a circular stage's slice of the stacked weights inside. With one
        # device and one microbatch the stage is called once, and layers that checkpoint
        # themselves sum their gradients over the data axes layer by layer (`single_step`).
        layers_remat = remat_of_layers(self.stages)
        if self.remat != "none":  # the stage's own policy, around the whole stage
            policy = REMAT_POLICIES[self.remat]
        elif layers_remat != "none":  # the layers' policies, kept as they are
            policy = AROUND_LAYERS[layers_remat]
        else:  # none: the stage is called as it is (a skip would cost memory here)
            policy = None
        # Differentiated, the run's backward is the training table's (`_table_grad`), which
        # keeps what `value_and_grad` keeps under the same `remat`; or autodiff of the loop.
        table = None if self.backward == "autodiff" else _training_table(self.remat)
        if self.num_repeats > 1:
            return circular_forward(
                stages, x, args, kwargs, num_microbatches=self.num_microbatches,
                model_axis_name=self.axis_name, broadcast_output=self.broadcast_output,
                stage_policy=policy, table=table,
            )  # fmt: skip
        return gpipe_forward(
            stages, x, args, kwargs, num_microbatches=self.num_microbatches,
            model_axis_name=self.axis_name, broadcast_output=self.broadcast_output,
            stage_policy=policy, reduce_in_layers=layers_remat != "none", table=table,
        )  # fmt: skip

    def value_and_grad(
        self,
        loss_fn: Callable,
        x: PyTree[Array],
        targets: PyTree[Array],
        *args: PyTree,
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
          holding all microbatches' residuals; autodiff of `self(x)` runs this table too.
        - `"zb-v"` and `"dualpipe-v"` (`num_repeats=2`): V-shaped, stage `d` and stage
          `2 S - 1 - d` on device `d`, the loss on device 0 (`ZeroBubbleVSchedule`,
          `DualPipeVSchedule`); the stages stay stored as for the circular schedule.

        Stages of scanned layers (`from_layers`) are differentiated one layer at a time, each
        layer's gradient added into the sum over microbatches in place. `jax.grad` through
        `self(x)` gives the same gradients with the same table's backward, holding besides
        the outputs it returns and their cotangent (see `__call__`).

        The model's `remat` policy says what a forward keeps for its backward: `"none"` its
        stage's residuals, `"full"` only the stage input (the backward recomputes the
        forward), `"matmuls"` the matmul outputs of each layer. The loss is the same on every
        device of the pipeline axis.

        Over a data-parallel axis (any axis the batch `x` is split over) the loss is that of
        the whole batch, the mean of the shards' losses, and the gradients are its gradients,
        as `jax.grad` of a `lax.pmean` of the loss gives: nothing to divide by hand. To
        continue the backward pass into an embedding before the pipeline, take
        `return_all_grads=True` and feed the returned input gradients (this shard's part of
        the global loss's) to the embedding's pullback (`eqx.filter_vjp`).

        **Arguments:**

        - `loss_fn`: `loss_fn(outputs, targets) -> scalar` for one microbatch (a callable
          pytree, e.g. a module holding an output head). A head whose parameters are split
          over the pipeline axis too (its vocabulary, say) runs on every device of it (see
          `eqpar.pipeline.execute_schedule`).
        - `x`, `targets`: the batch and its targets (leading batch axis); `targets` may be a
          pytree, e.g. `(labels, mask)`, and is split into microbatches with `x`.
        - `*args`, `**kwargs`: passed to every stage call; `Microbatched` values are split
          with `x`.
        - `schedule`: `"1f1b"` (default), `"zb-h1"`, `"gpipe"`, `"circular"`, `"zb-v"` or
          `"dualpipe-v"` (the names of `eqpar.schedule.SCHEDULES`).
        - `return_all_grads`: also return the gradients of `loss_fn`'s array leaves and of
          `x`.

        **Returns:** `(loss, grads)` where `grads` is a `PipelineModule` of gradients (this
        device's block, `None` for leaves that are not inexact arrays), or
        `(loss, (grads, loss_fn_grads, x_grads))` with `return_all_grads=True`.
        """
        caller = "PipelineModule.value_and_grad"
        schedule = _schedule_name(schedule, self.num_repeats, caller)
        table = _training_table(self.remat)
        local, recompute = table.stage(self._local_stages(caller)), table.recompute
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
        *args: PyTree,
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


def _training_table(remat: RematPolicy) -> TableBackward:
    """How a training table runs the stages of a model with `remat`: `"full"` keeps only
    each stage's input, which is what `recompute` does by itself; the other policies run
    each stage under its checkpoint."""
    recompute = remat == "full"
    return TableBackward(
        stage=lambda stages: _StageCall(stages, "none" if recompute else remat),
        recompute=recompute,
    )


def _schedule_name(name: str | None, num_repeats: int, owner: str) -> str:
    """`name` checked against `num_repeats` (`None`: GPipe, or circular with repeats). The
    tables of 1F1B and ZB-H1 can be drawn for any module; only `value_and_grad` needs one stage
    per device to run them."""
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
    if owner.endswith("value_and_grad"):
        check_stages_per_device(
            name, SCHEDULES[name].stages_per_device, num_repeats, owner, argument="num_repeats"
        )
    return name


__all__ = ["PipelineModule"]


def __getattr__(name: str) -> object:
    # Moved names stay importable from here (see `eqpar.nn.__getattr__`).
    if name == "gather_layers":
        from ..distributions import gather_layers

        return gather_layers
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
