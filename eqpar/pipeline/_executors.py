"""The public executors: GPipe, circular, 1F1B and any schedule table."""

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PyTree, Scalar

from .._axes import axis_size
from .._checks import check_int
from .._tracing import pipeline_stage
from .._typing import AxisName
from .._vma import varying_axes
from ..schedule import OneFOneBSchedule, PipelineSchedule
from . import _program
from ._jaxpr import collective_axes, uses_primitive
from ._loop import LoopState, run_schedule
from ._microbatch import (
    batch_size,
    check_replicated,
    check_stage_keeps_shape,
    merge_microbatches,
    microbatch_arguments,
    reject_microbatched,
    split_microbatches,
    unwrap_microbatched,
)
from ._table_grad import PLAIN_TABLE, TableBackward, forward_outputs
from ._tools import (
    axes_tree,
    batch_axes,
    cast_tree,
    describe_tree,
    first_of_stack,
    index_tree,
    ring_shift_tree,
    sum_over_cast_axes,
    vary_like_input,
)

# --------------------------------------------------------------------------------------
# GPipe.


def execute_pipeline_step(
    module: Callable,
    state: PyTree[Array],
    input: PyTree[Array],
    *args: PyTree,
    model_axis_name: AxisName,
    **kwargs: Any,
) -> tuple[PyTree[Array], PyTree[Array]]:
    """One clock step of a pipeline over the mesh axis `model_axis_name` (inside `shard_map`).

    The first device of the axis feeds `input` to its stage, every other device the `state` it
    received from its predecessor at the previous step. Each stage's result is sent one device
    further round the ring, where it becomes that device's next `state`.

    **Arguments:**

    - `module`: this device's stage, any callable `module(x, *args, **kwargs)` returning a
      pytree of the same shapes and dtypes as `x`.
    - `state`: what this device received at the previous step (zeros at the first step).
    - `input`: the microbatch entering the pipeline at this step (used on the first device).
    - `*args`, `**kwargs`: passed to `module` unchanged (a `Microbatched` argument is an
      error here: pass the rows of the microbatch this device works on).
    - `model_axis_name`: the pipeline axis of the mesh.

    **Returns:** `(new_state, output)`: `new_state` is the stage result of the previous device
    (to feed back as `state`; zeros on the first device, which reads `input` instead, so
    nothing crosses from the last device to the first); `output` is this stage's result on
    the last device and zeros on the others.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_pipeline_step

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))

    def two_steps(scale, x):  # scale: this device's [1] slice of a [2] stack
        stage = lambda h: h * scale[0]
        state = jnp.zeros_like(x)
        state, _ = execute_pipeline_step(stage, state, x, model_axis_name="pipe")
        _, out = execute_pipeline_step(stage, state, x, model_axis_name="pipe")
        return out[None]

    f = jax.shard_map(two_steps, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P("pipe"))
    out = f(jnp.array([2.0, 3.0]), jnp.ones(3))
    assert jnp.allclose(out[1], 6.0) and jnp.allclose(out[0], 0.0)
    ```
    """
    caller = "execute_pipeline_step"
    reject_microbatched(args, kwargs, caller)
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
    index = lax.axis_index(model_axis_name)
    stage_input = jax.tree.map(lambda i, s: jnp.where(index == 0, i, s), input, state)
    with pipeline_stage(model_axis_name):
        out = module(stage_input, *args, **kwargs)
    new_state = ring_shift_tree(out, model_axis_name, num_stages, +1, wrap=False)
    output = jax.tree.map(lambda o: jnp.where(index == num_stages - 1, o, jnp.zeros_like(o)), out)
    return new_state, output


def _gather_output(outputs: PyTree, model_axis_name: AxisName, broadcast_output: bool) -> PyTree:
    if broadcast_output:
        return jax.tree.map(lambda o: lax.psum(o, model_axis_name), outputs)
    return outputs


def execute_pipeline(
    module: Callable,
    x: PyTree[Array],
    *args: PyTree,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool = False,
    **kwargs: Any,
) -> PyTree[Array]:
    """Run a GPipe pipeline over the mesh axis `model_axis_name` (inside `shard_map`).

    The batch is cut into `num_microbatches` equal microbatches that enter the first device
    one step apart; after `num_microbatches + S - 1` steps of one `lax.scan` (`S` the axis
    size) every microbatch has passed every stage. Differentiate through it for training:
    `jax.grad` runs the backward half of GPipe's training table (each forward
    keeps what its backward reads, scanned layers one at a time), or autodiff of the loop
    where the table cannot (an argument computed from what is differentiated, a stage that
    closes over traced values or uses `ppermute`), and traced under forward mode (`jax.jvp`,
    `jax.jacfwd`); `jax.linearize`, or `jax.jvp` of a function jitted before, is not
    supported here (use `PipelineModule(..., backward="autodiff")`). See
    `execute_schedule` for schedules that hold fewer activations. With one device and one
    microbatch there is no loop: the stage is called once on the batch.

    **Arguments:**

    - `module`: this device's stage: a callable `module(x, *args, **kwargs)` that returns the
      shapes and dtypes it takes (for instance the local slice of stages stacked over the
      pipeline axis).
    - `x`: the batch, a pytree of arrays sharing a leading batch axis; every device passes the
      same batch (only the first device reads it).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x` (the stage working on microbatch
      `m` gets its rows `m`).
    - `num_microbatches`: how many microbatches; must divide the batch size.
    - `model_axis_name`: the pipeline axis of the mesh.
    - `broadcast_output`: return the result on every device (one `psum` over the axis)
      instead of only on the last.

    **Returns:** the stage outputs of all microbatches in batch order, shaped like `x`, on
    the last device and zeros elsewhere (everywhere with `broadcast_output=True`).

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_pipeline

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    scales = jnp.array([1.0, 2.0, 3.0, 4.0])  # stage s multiplies by scales[s]

    def run(scale, x):
        stage = lambda h: h * scale[0]
        return execute_pipeline(
            stage, x, num_microbatches=2, model_axis_name="pipe", broadcast_output=True
        )

    f = jax.shard_map(run, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P())
    x = jnp.arange(8.0).reshape(4, 2)
    assert jnp.allclose(f(scales, x), x * 24.0)
    ```
    """
    return gpipe_forward(
        module, x, args, kwargs, num_microbatches=num_microbatches,
        model_axis_name=model_axis_name, broadcast_output=broadcast_output,
    )  # fmt: skip


def gpipe_forward(
    module: PyTree,
    x: PyTree,
    args: tuple,
    kwargs: dict,
    *,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool,
    stage_policy: Callable | None = None,
    reduce_in_layers: bool = False,
    table: TableBackward | None = PLAIN_TABLE,
) -> PyTree:
    """`execute_pipeline`; `stage_policy` is the `jax.checkpoint` policy of each stage call
    (`None`: the stage is called as it is, at every step); `reduce_in_layers`: see
    `single_step`, which runs a pipeline of one stage and one microbatch; `table`: how the
    training table differentiates the run (`_table_grad`; `None`: autodiff of the loop)."""
    caller = "execute_pipeline"
    num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=caller)
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
    batch = batch_size(x, "x", caller)
    if batch is None:
        raise ValueError(f"{caller}: `x` has no array leaves; pass the batch to pipeline.")
    check_replicated(x, "x", model_axis_name, caller)
    if num_stages == 1 and num_microbatches == 1:
        out = single_step(
            module, x, args, kwargs, batch=batch, axis_name=model_axis_name,
            stage_policy=stage_policy, reduce_in_layers=reduce_in_layers,
        )  # fmt: skip
        return _gather_output(out, model_axis_name, broadcast_output)
    module = vary_like_input(module, x, model_axis_name)
    microbatches = split_microbatches(x, num_microbatches, batch, "x", caller)
    arguments_at = microbatch_arguments(
        args,
        kwargs,
        num_microbatches=num_microbatches,
        batch=batch,
        axis_name=model_axis_name,
        caller=caller,
    )
    check_stage_keeps_shape(module, index_tree(microbatches, 0), *arguments_at(0), caller)
    outputs = forward_outputs(
        module, microbatches, args, kwargs,
        _arguments_for(num_microbatches, batch, model_axis_name, caller),
        axis_name=model_axis_name, num_stages=num_stages, num_repeats=1,
        stage_policy=stage_policy, table=table,
    )  # fmt: skip
    return _gather_output(merge_microbatches(outputs), model_axis_name, broadcast_output)


def single_step(
    stage: PyTree,
    x: PyTree,
    args: tuple,
    kwargs: dict,
    *,
    batch: int,
    axis_name: AxisName,
    stage_policy: Callable | None,
    reduce_in_layers: bool,
) -> PyTree:
    """A one-stage, one-microbatch pipeline: the stage called once on the whole batch.

    The parameters replicated over a data axis are cast to vary over it up front
    (`vary_like_input`, as in the schedule loop), so that autodiff sums their gradients
    once, at the end; unless `reduce_in_layers` (the stage's `ScannedLayers` rematerialise
    each layer and cast that layer's parameters inside it, `call_varying`): each layer's
    gradient is then summed inside the backward scan and the stacked gradients are written
    reduced, instead of held whole and unreduced until that one sum (as much memory again
    as the layers' parameters). Layers that keep everything for the backward pass keep the
    up-front cast: casting inside them would keep each layer's varying copy of its weights,
    which costs more than the unreduced gradients."""
    caller = "execute_pipeline"
    args, kwargs = unwrap_microbatched(args, kwargs, batch, caller, axis_name)
    # One stage could change the shape, but then more stages could not: refuse it alike.
    check_stage_keeps_shape(stage, x, args, kwargs, caller)
    if not reduce_in_layers:
        stage = vary_like_input(stage, x, axis_name)
    call = call_stage
    if stage_policy is not None:
        call = eqx.filter_checkpoint(call_stage, policy=stage_policy)
    return call(stage, x, *args, **kwargs)


def call_stage(stage: PyTree, x: PyTree, *args: PyTree, **kwargs: Any) -> PyTree:
    return stage(x, *args, **kwargs)


def call_varying(stage: PyTree, x: PyTree, *args: PyTree, **kwargs: Any) -> PyTree:
    """`stage(x, ...)` with the stage's parameters first cast to vary over every mesh axis
    `x` varies over: autodiff then sums each parameter's gradient over those axes once, at
    this call, however often the stage uses the parameter."""
    return vary_like_input(stage, x, None)(x, *args, **kwargs)


def _arguments_for(
    num_microbatches: int, batch: int, axis_name: AxisName, caller: str
) -> Callable[[tuple, dict], Callable]:
    """`microbatch_arguments` for given `(args, kwargs)` (`forward_outputs` builds it for the
    values of each of its passes)."""
    return lambda args, kwargs: microbatch_arguments(
        args, kwargs, num_microbatches=num_microbatches, batch=batch, axis_name=axis_name,
        caller=caller,
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# Circular (interleaved).


def _stack_size(stages: PyTree, caller: str) -> int:
    sizes: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stages)[0]:
        if eqx.is_array(leaf):
            sizes[jax.tree_util.keystr(path)] = leaf.shape[0] if leaf.ndim else 0
    if len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise ValueError(
            f"{caller}: `stages` must be a pytree whose array leaves all carry the same leading "
            f"stacking axis (one entry per stage held by this device); found leading sizes "
            f"{sizes} (0 = scalar)."
        )
    return next(iter(sizes.values()))


def execute_circular_pipeline(
    stages: PyTree,
    x: PyTree[Array],
    *args: PyTree,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool = False,
    **kwargs: Any,
) -> PyTree[Array]:
    """Run a circular (interleaved) pipeline over `model_axis_name` (inside `shard_map`).

    The model has `S * V` stages for an axis of size `S`; stage `s` lives on device `s % S`,
    so each device holds `V` non-adjacent stages and every microbatch goes round the ring `V`
    times. With `M >= S` microbatches this takes `V * M + S - 1` steps, a bubble of
    `(S - 1) / (V * M + S - 1)` instead of GPipe's `(S - 1) / (M + S - 1)` for the same model
    cut into `S` stages. Differentiated, it runs the backward half of the circular
    training table, as `execute_pipeline` does GPipe's (never keeping a stage's weights per
    step). A microbatch that completes a trip waits in a buffer of
    `max(M, S) - S + 1` microbatches on the first device until it is its turn again.

    **Arguments:**

    - `stages`: this device's `V` stages stacked on a leading axis: a pytree whose array
      leaves have leading size `V` and whose slice `i` (taken leaf by leaf) is a callable
      stage, entry `i` being model stage `i * S + d` on device `d`. Stages stored in model
      order as `[V, S, ...]` and sharded `P(None, axis)` give exactly this block (drop the
      unit second axis), which is how `eqpar.nn.PipelineModule` stores them.
    - `x`: the batch, a pytree of arrays with a leading batch axis (same on every device).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x`.
    - `num_microbatches`: `M`; must divide the batch size.
    - `model_axis_name`: the pipeline axis.
    - `broadcast_output`: return the result on every device instead of only the last.

    **Returns:** the outputs in batch order on the last device, zeros elsewhere (or
    everywhere with `broadcast_output=True`).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_circular_pipeline

    class Scale(eqx.Module):
        factor: jax.Array
        def __call__(self, h):
            return h * self.factor

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))
    # 4 stages in model order, stored [V, S] = [2, 2]; sharding the second axis over "pipe"
    # gives device d the column [stage d, stage 2 + d], no reordering needed.
    factors = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(2, 2)

    def run(factors, x):  # factors: this device's [2, 1] block
        return execute_circular_pipeline(
            Scale(factors[:, 0]), x, num_microbatches=2, model_axis_name="pipe",
            broadcast_output=True,
        )

    f = jax.shard_map(run, mesh=mesh, in_specs=(P(None, "pipe"), P()), out_specs=P())
    assert jnp.allclose(f(factors, jnp.ones((4, 2))), 24.0)
    ```
    """
    return circular_forward(
        stages, x, args, kwargs, num_microbatches=num_microbatches,
        model_axis_name=model_axis_name, broadcast_output=broadcast_output,
    )  # fmt: skip


def circular_forward(
    stages: PyTree,
    x: PyTree,
    args: tuple,
    kwargs: dict,
    *,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool,
    stage_policy: Callable | None = None,
    table: TableBackward | None = PLAIN_TABLE,
) -> PyTree:
    """`execute_circular_pipeline`; `stage_policy` is the `jax.checkpoint` policy of each
    stage call (`None`: keep everything), which never keeps the stage's slice of the stacked
    weights; `table` as for `gpipe_forward`."""
    caller = "execute_circular_pipeline"
    num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=caller)
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
    num_repeats = _stack_size(stages, caller)
    batch = batch_size(x, "x", caller)
    if batch is None:
        raise ValueError(f"{caller}: `x` has no array leaves; pass the batch to pipeline.")
    check_replicated(x, "x", model_axis_name, caller)
    stages = vary_like_input(stages, x, model_axis_name)
    microbatches = split_microbatches(x, num_microbatches, batch, "x", caller)
    arguments_at = microbatch_arguments(
        args,
        kwargs,
        num_microbatches=num_microbatches,
        batch=batch,
        axis_name=model_axis_name,
        caller=caller,
    )
    arrays, static = eqx.partition(stages, eqx.is_array)

    def stage_at(repeat: PyTree) -> Callable:
        return eqx.combine(index_tree(arrays, repeat), static)

    first = index_tree(microbatches, 0)
    check_stage_keeps_shape(stage_at(0), first, *arguments_at(0), caller)

    outputs = forward_outputs(
        stages, microbatches, args, kwargs,
        _arguments_for(num_microbatches, batch, model_axis_name, caller),
        axis_name=model_axis_name, num_stages=num_stages, num_repeats=num_repeats,
        stage_policy=stage_policy, table=table,
    )  # fmt: skip
    return _gather_output(merge_microbatches(outputs), model_axis_name, broadcast_output)


# --------------------------------------------------------------------------------------
# 1F1B.


def execute_1f1b(
    module: Callable,
    loss_fn: Callable,
    x: PyTree[Array],
    targets: PyTree[Array],
    *args: PyTree,
    num_microbatches: int,
    model_axis_name: AxisName,
    return_all_grads: bool = False,
    recompute: bool = False,
    **kwargs: Any,
) -> tuple[Float[Scalar, ""], Any]:
    """Deprecated (a `DeprecationWarning`): `execute_schedule(OneFOneBSchedule(S, M), ...)`.

    A pipelined training step in the one-forward-one-backward (1F1B) order (inside
    `shard_map`): the mean loss over microbatches (and over the shards of a batch split over
    other axes) and its gradients.

    Each device runs its stage's forward for a microbatch, then, as soon as the cotangent of
    the oldest microbatch comes back from the next device, that microbatch's backward; so it
    never holds the activations of more than `S` microbatches (`S` the axis size), where
    autodiff through `execute_pipeline` holds all `M`. By default a stage's forward keeps
    what its backward needs (the residuals of `jax.vjp`, in a ring of `S` slots, without the
    copies of the parameters and the stage input that are stored anyway), so no stage runs
    its forward twice; `recompute=True` keeps only the stage input and recomputes the forward
    in the backward step (less memory, one more forward per microbatch). Wrap the stage in
    `jax.checkpoint` with a policy for anything in between. The loss is computed on the last
    device inside its backward step (its forward is never run separately).
    Steps follow `eqpar.schedule.OneFOneBSchedule`: `2 * (M + S - 1)` of them, each device
    running only the branch (forward, backward or nothing) its schedule names.

    **Arguments:**

    - `module`: this device's stage, a callable pytree (e.g. an Equinox module)
      `module(x, *args, **kwargs)` returning the shapes and dtypes it takes. Gradients are
      taken with respect to its inexact array leaves.
    - `loss_fn`: `loss_fn(outputs, targets) -> scalar` for one microbatch, e.g. a mean over
      its rows; a callable pytree whose array leaves (say an output head) get gradients with
      `return_all_grads=True`. It runs on the last stage's device (device 0 for a
      V-shaped schedule), and cannot use
      collectives over `model_axis_name` there, unless some of its parameters are split over
      that axis (a vocabulary-parallel head, `eqpar.ColumnParallel(("model", axis))` with
      `eqpar.nn.vocab_parallel_cross_entropy`): it then runs on every device of the axis on
      the last stage's output, and each device gets the gradient of its own part.
    - `x`: the batch entering the first stage, a pytree with a leading batch axis.
    - `targets`: the matching targets (a pytree with the same leading batch size, or `None`).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x` (forward and backward of
      microbatch `m` both get rows `m`). They get no gradients.
    - `num_microbatches`: `M`; must divide the batch size.
    - `model_axis_name`: the pipeline axis.
    - `return_all_grads`: also return the gradients of `loss_fn`'s array leaves and of `x`.
    - `recompute`: recompute each stage's forward in its backward step instead of storing
      its residuals.

    **Returns:** `(loss, grads)`, with `loss = mean over microbatches of loss_fn` on every
    device and `grads` the gradient of `loss` with respect to this device's `module` (same
    structure, `None` for leaves that are not inexact arrays). With `return_all_grads=True`,
    `(loss, (grads, loss_fn_grads, x_grads))`; `loss_fn_grads` and `x_grads` are the same on
    every device of the pipeline axis. Where the batch is split over other mesh axes (say
    `data`, each shard with its own rows; the axes `x` varies over), `loss` is the loss of the
    whole batch, the mean of the shards' losses, and every gradient is its gradient, as
    `jax.grad` of a `lax.pmean` of the loss gives (the one gradient rule: nothing to divide
    by hand; `x_grads` are this shard's part of it). `grads` is this device's stage
    only; a parameter shared by several stages needs its gradients summed over the pipeline
    axis.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_1f1b

    class Stage(eqx.Module):
        linear: eqx.nn.Linear
        def __call__(self, h):
            return jax.vmap(self.linear)(h)

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    keys = jax.random.split(jax.random.key(0), 4)
    stages = eqx.filter_vmap(lambda k: Stage(eqx.nn.Linear(3, 3, key=k)))(keys)
    params, static = eqx.partition(stages, eqx.is_array)
    loss_fn = lambda y, t: jnp.mean((y - t) ** 2)

    def step(params, x, t):
        stage = eqx.combine(jax.tree.map(lambda a: a[0], params), static)
        loss, grads = execute_1f1b(
            stage, loss_fn, x, t, num_microbatches=4, model_axis_name="pipe"
        )
        return loss, jax.tree.map(lambda g: g[None], grads)

    f = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P("pipe"), P(), P()), out_specs=(P(), P("pipe"))
    ))
    x, t = jnp.ones((8, 3)), jnp.zeros((8, 3))
    loss, grads = f(params, x, t)

    def serial_loss(params):
        h = x
        for i in range(4):
            h = eqx.combine(jax.tree.map(lambda a: a[i], params), static)(h)
        return loss_fn(h, t)

    expected = jax.grad(serial_loss)(params)
    assert jnp.allclose(loss, serial_loss(params), rtol=1e-5)
    assert jnp.allclose(grads.linear.weight, expected.linear.weight, rtol=1e-5, atol=1e-7)
    ```
    """
    caller = "execute_1f1b"
    warnings.warn(
        "execute_1f1b is deprecated: write execute_schedule(OneFOneBSchedule(S, M), module, "
        "loss_fn, x, targets, ...), the one executor of every training schedule.",
        DeprecationWarning,
        stacklevel=2,
    )
    num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=caller)
    schedule = OneFOneBSchedule(
        axis_size(model_axis_name, caller, argument="model_axis_name"), num_microbatches
    )
    options = dict(return_all_grads=return_all_grads, recompute=recompute)
    return _execute_schedule(
        caller, schedule, module, loss_fn, x, targets, args, kwargs, model_axis_name, **options
    )


def execute_schedule(
    schedule: PipelineSchedule,
    stages: Callable,
    loss_fn: Callable,
    x: PyTree[Array],
    targets: PyTree[Array],
    *args: PyTree,
    model_axis_name: AxisName,
    return_all_grads: bool = False,
    recompute: bool = False,
    **kwargs: Any,
) -> tuple[Float[Scalar, ""], Any]:
    """A pipelined training step in the order of any training `schedule` (inside
    `shard_map`): the mean loss over microbatches (and over the shards of a batch split over
    other axes) and its gradients.

    The schedule's table (`eqpar.schedule`) is the program: at every step each device runs
    the action its cell names: a stage's forward, its backward, or (zero-bubble schedules)
    the input half or the weight half of its backward, or nothing; stage inputs, cotangents
    and stored residuals wait in buffers sized to what the table keeps alive at once, and
    each step sends only what its actions made, to the devices that need it. One
    `lax.scan` runs the whole table, so a new schedule is a new table, not a new executor.
    `OneFOneBSchedule`, `ZeroBubbleH1Schedule`, the V-shaped `ZeroBubbleVSchedule` and
    `DualPipeVSchedule`, and `GPipeSchedule` / `CircularSchedule` with
    `include_backward=True` all run this way (it is the one training executor; the
    deprecated `execute_1f1b` calls it with `OneFOneBSchedule`).

    By default a forward keeps what its backward needs (the residuals of `jax.vjp`, without
    the parameters and the stage input, which are kept anyway), so no stage runs its
    forward twice; `recompute=True` keeps only the stage input and recomputes the forward
    in each backward action. A stage that is a stack of scanned layers (`ScannedLayers`,
    unless it gathers its parameters itself or has no inexact ones) is differentiated one
    layer at a time: the forward keeps each layer's residuals (values that are the same in
    every layer, such as a mask, once), and the backward adds each layer's parameter
    gradient into the sum over microbatches in place as soon as it is made. The last
    stage's forward also keeps its output, from which its backward computes the loss (with
    `recompute=True` its forward waits for its backward).

    Each device runs the branch of its own action, so a stage's collectives over other mesh
    axes run inside branches that differ between devices: `psum`, all-gather and
    reduce-scatter (tensor parallelism: `TPDense`, plan-converted layers) give the right
    values there, `lax.ppermute` does not, and a stage that uses it (ring attention,
    `TPAsyncDense`) is refused with a `ValueError`. The forward executors (`execute_pipeline`,
    `execute_circular_pipeline`) run every stage on every device at every step and take it.

    **Arguments:**

    - `schedule`: a training schedule (`schedule.has_backward`) whose `num_devices` is the
      size of the pipeline axis; its `num_microbatches` must divide the batch.
    - `stages`: this device's stage, a callable pytree `stages(x, *args, **kwargs)` that
      returns the shapes and dtypes it takes; for a circular schedule of `V` stages per
      device, those `V` stages stacked on a leading axis, entry `i` being model stage
      `i * S + d` (as for `execute_circular_pipeline`). A V-shaped schedule
      (`ZeroBubbleVSchedule`, `DualPipeVSchedule`) takes the same two-stage stack, stages
      `d` and `S + d` in model order: the executor gives device `d` the stage `2 S - 1 - d`
      it runs on the way back up (one `ppermute` of that stage's parameters over the
      pipeline axis, and one of its gradients back, per call) and returns the gradients
      stacked as `stages` came. Gradients are taken with respect to its inexact array
      leaves.
    - `loss_fn`: `loss_fn(outputs, targets) -> scalar` for one microbatch, e.g. a mean over
      its rows; a callable pytree whose array leaves (say an output head) get gradients with
      `return_all_grads=True`. It runs on the last stage's device (device 0 for a
      V-shaped schedule), and cannot use
      collectives over `model_axis_name` there, unless some of its parameters are split over
      that axis (a vocabulary-parallel head, `eqpar.ColumnParallel(("model", axis))` with
      `eqpar.nn.vocab_parallel_cross_entropy`): it then runs on every device of the axis on
      the last stage's output, and each device gets the gradient of its own part.
    - `x`: the batch entering the first stage, a pytree with a leading batch axis, the same
      on every device of the pipeline axis.
    - `targets`: the matching targets (a pytree with the same leading batch size, or `None`).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x`. They get no gradients.
    - `model_axis_name`: the pipeline axis.
    - `return_all_grads`: also return the gradients of `loss_fn`'s array leaves and of `x`.
    - `recompute`: recompute each stage's forward in its backward actions instead of
      storing its residuals.

    **Returns:** `(loss, grads)` as for `execute_1f1b` (`grads` stacked like `stages` for a
    circular schedule); with `return_all_grads=True`, `(loss, (grads, loss_fn_grads,
    x_grads))`.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_schedule
    from eqpar.schedule import ZeroBubbleH1Schedule

    class Stage(eqx.Module):
        linear: eqx.nn.Linear
        def __call__(self, h):
            return jnp.tanh(jax.vmap(self.linear)(h))

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    keys = jax.random.split(jax.random.key(0), 4)
    stages = eqx.filter_vmap(lambda k: Stage(eqx.nn.Linear(3, 3, key=k)))(keys)
    params, static = eqx.partition(stages, eqx.is_array)
    loss_fn = lambda y, t: jnp.mean((y - t) ** 2)
    schedule = ZeroBubbleH1Schedule(num_stages=4, num_microbatches=4)

    def step(params, x, t):
        stage = eqx.combine(jax.tree.map(lambda a: a[0], params), static)
        loss, grads = execute_schedule(schedule, stage, loss_fn, x, t, model_axis_name="pipe")
        return loss, jax.tree.map(lambda g: g[None], grads)

    f = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P("pipe"), P(), P()), out_specs=(P(), P("pipe"))
    ))
    x, t = jnp.ones((8, 3)), jnp.zeros((8, 3))
    loss, grads = f(params, x, t)

    def serial_loss(params):
        h = x
        for i in range(4):
            h = eqx.combine(jax.tree.map(lambda a: a[i], params), static)(h)
        return loss_fn(h, t)

    assert jnp.allclose(loss, serial_loss(params), rtol=1e-5)
    expected = jax.grad(serial_loss)(params)
    assert jnp.allclose(grads.linear.weight, expected.linear.weight, rtol=1e-5, atol=1e-7)
    ```
    """
    options = dict(return_all_grads=return_all_grads, recompute=recompute)
    return _execute_schedule(
        "execute_schedule", schedule, stages, loss_fn, x, targets, args, kwargs, model_axis_name,
        **options,
    )  # fmt: skip


def _execute_schedule(
    caller: str,
    schedule: PipelineSchedule,
    stages: PyTree,
    loss_fn: Callable,
    x: PyTree,
    targets: PyTree,
    args: tuple,
    kwargs: dict,
    model_axis_name: AxisName,
    *,
    return_all_grads: bool,
    recompute: bool,
) -> tuple[PyTree, PyTree]:
    if not isinstance(schedule, PipelineSchedule) or not schedule.has_backward:
        raise TypeError(
            f"{caller}: `schedule` must be a training schedule from `eqpar.schedule` (with "
            f"backward actions), such as `OneFOneBSchedule(S, M)`, "
            f"`ZeroBubbleH1Schedule(S, M)`, `ZeroBubbleVSchedule(S, M)` or "
            f"`GPipeSchedule(S, M, include_backward=True)`; "
            f"got {schedule!r}. For a forward pass use `execute_pipeline`."
        )
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
    if schedule.num_devices != num_stages:
        raise ValueError(
            f"{caller}: the schedule is for {schedule.num_devices} devices but the pipeline "
            f"axis {model_axis_name!r} has {num_stages}. Build the schedule with "
            f"num_stages={num_stages}."
        )
    num_microbatches = schedule.num_microbatches
    num_repeats = schedule._num_trips()
    batch = batch_size(x, "x", caller)
    if batch is None:
        raise ValueError(f"{caller}: `x` has no array leaves; pass the batch to pipeline.")
    target_batch = batch_size(targets, "targets", caller)
    if target_batch not in (None, batch):
        raise ValueError(
            f"{caller}: `x` has {batch} rows but `targets` has {target_batch}; give both the "
            f"same batch size."
        )
    check_replicated(x, "x", model_axis_name, caller)
    check_replicated(targets, "targets", model_axis_name, caller)
    # A batch split over an axis may reach the pipeline only through its targets or extra
    # arguments (`x` made from parameters alone): `x` is then typed as varying over that axis
    # too, so that the shards' parameter gradients are summed once and the loss averaged
    # over it, and its own gradient comes back summed over it (the transpose of the cast).
    x_axes = axes_tree(x)
    split_axes = batch_axes((x, targets, args, kwargs), model_axis_name)
    x = cast_tree(x, split_axes)
    microbatches = split_microbatches(x, num_microbatches, batch, "x", caller)
    target_microbatches = split_microbatches(targets, num_microbatches, batch, "targets", caller)
    arguments_at = microbatch_arguments(
        args,
        kwargs,
        num_microbatches=num_microbatches,
        batch=batch,
        axis_name=model_axis_name,
        caller=caller,
        cast=frozenset({model_axis_name}),
    )
    if num_repeats > 1 and _stack_size(stages, caller) != num_repeats:
        raise ValueError(
            f"{caller}: the schedule runs {num_repeats} stages per device, so `stages` must "
            f"stack that many on the leading axis of its array leaves; it stacks "
            f"{_stack_size(stages, caller)}."
        )
    replicated_axes = (
        axes_tree(eqx.filter(stages, eqx.is_inexact_array)),
        axes_tree(eqx.filter(loss_fn, eqx.is_inexact_array)),
    )
    stages = vary_like_input(stages, x, model_axis_name)
    loss_fn = vary_like_input(loss_fn, x, model_axis_name)
    # A loss function with parameters split over the pipeline axis (a vocabulary-parallel
    # head) runs on every device of it, outside the per-device branches, on the last
    # stage's output handed to every device (a `psum`); otherwise on the last stage's device
    # alone, where it cannot use that axis.
    loss_on_every_device = any(
        model_axis_name in axes for axes in jax.tree.leaves(replicated_axes[1])
    )
    first = index_tree(microbatches, 0)
    stage = stages if num_repeats == 1 else first_of_stack(stages)
    check_stage_keeps_shape(stage, first, *arguments_at(0), caller)

    target = index_tree(target_microbatches, 0)
    loss_shape = _loss_shape(caller, stage, loss_fn, first, target, arguments_at, model_axis_name,
                             loss_on_every_device)  # fmt: skip
    loss_dtype = loss_shape.dtype
    # The axes over which each device's loss is its own shard's (a batch split over `data`):
    # the loss of the whole batch is the mean over them.
    shard_axes = varying_axes(loss_shape) & batch_axes(x, model_axis_name)
    _check_collectives(
        caller, stage, loss_fn, first, target, arguments_at, model_axis_name, loss_on_every_device
    )
    program = _program.compile_schedule(schedule, store_residuals=not recompute)
    v_shaped = schedule.placement == "v"
    if v_shaped:  # each device's up stage, from the device that stores it
        stages = _up_stages_swapped(stages, model_axis_name, num_stages)
    carry = run_schedule(
        program,
        stages,
        loss_fn,
        microbatches,
        target_microbatches,
        arguments_at,
        axis_name=model_axis_name,
        loss_dtype=loss_dtype,
        return_all_grads=return_all_grads,
        loss_on_every_device=loss_on_every_device,
        shards=lax.axis_size(tuple(sorted(shard_axes, key=str))) if shard_axes else 1,
    )
    if v_shaped:  # the up stages' gradients back to the devices that store them
        carry = carry._replace(grads=_up_stages_swapped(carry.grads, model_axis_name, num_stages))
    return _results(
        carry, x, replicated_axes, model_axis_name, program.loss_device, num_microbatches,
        return_all_grads=return_all_grads, loss_on_every_device=loss_on_every_device,
        shard_axes=shard_axes, x_axes=x_axes,
    )  # fmt: skip


def _up_stages_swapped(stacked: PyTree, axis_name: AxisName, num_stages: int) -> PyTree:
    """`stacked` (`[2, ...]` per device: stages `d` and `S + d`, model order) with its second
    entry exchanged between devices `d` and `S - 1 - d`: then device `d` holds stage
    `2 S - 1 - d`, its stage on the way back up in a V-shaped schedule. Its own inverse, so it
    also takes those stages' gradients home. Storing the stages in model order keeps the
    model and its checkpoints those of every other schedule, for one stage's parameters
    over the pipeline axis each way per step (the whole step moves `M` microbatches'
    activations each way per stage boundary besides)."""
    if num_stages == 1:
        return stacked
    pairs = [(d, num_stages - 1 - d) for d in range(num_stages)]

    def swap(a: Array) -> Array:
        a = jnp.asarray(a)  # a NumPy leaf (the same on every device) too
        return a.at[1].set(lax.ppermute(a[1], axis_name, pairs))

    return jax.tree.map(lambda a: swap(a) if eqx.is_array(a) else a, stacked)


def _results(
    carry: LoopState,
    x: PyTree,
    replicated_axes: tuple[PyTree, PyTree],
    model_axis_name: AxisName,
    loss_device: int,
    num_microbatches: int,
    *,
    return_all_grads: bool,
    loss_on_every_device: bool,
    shard_axes: frozenset,
    x_axes: PyTree,
) -> tuple[PyTree, PyTree]:
    """The loss and gradients of a training run, reduced to what every device returns."""
    device = lax.axis_index(model_axis_name)
    is_first, is_last = device == 0, device == loss_device
    # Parameters replicated over the batch's axes were cast to varying before the loop: sum
    # their gradients over those axes once, as autodiff through the replication would.
    grads = sum_over_cast_axes(carry.grads, replicated_axes[0], x, model_axis_name)
    loss_grads = sum_over_cast_axes(carry.loss_grads, replicated_axes[1], x, model_axis_name)
    assert carry.loss is not None  # a training run keeps its loss
    loss = lax.psum(jnp.where(is_last, carry.loss, jnp.zeros_like(carry.loss)), model_axis_name)
    # The one gradient rule: the loss of the whole batch, split over the devices of the
    # batch's axes (`shard_axes`), is the mean of their losses, and its gradients are the
    # shards' summed gradients divided by their number, as differentiating a `pmean` of the
    # loss would give. The loop seeded its cotangents with that division already.
    axes = tuple(sorted(shard_axes, key=str))
    if axes:
        loss = lax.pmean(loss, axes)
    if not return_all_grads:
        return loss, grads
    if not loss_on_every_device:  # they are on the last stage's device: copy them to all
        loss_grads = jax.tree.map(
            lambda g: lax.psum(jnp.where(is_last, g, jnp.zeros_like(g)), model_axis_name),
            loss_grads,
        )
    x_grads = jax.tree.map(
        lambda g: lax.psum(jnp.where(is_first, g[:num_microbatches], 0), model_axis_name),
        carry.x_grads,
    )
    x_grads = merge_microbatches(x_grads)
    x_grads = jax.tree.map(  # typed as `x` came: summed over the axes it was cast to
        lambda g, original: sum_over_cast_axes(g, original, x, model_axis_name)
        if eqx.is_inexact_array(g) else g,
        x_grads, x_axes, is_leaf=lambda node: node is None,
    )  # fmt: skip
    return loss, (grads, loss_grads, x_grads)


def _loss_shape(
    caller: str,
    stage: Callable,
    loss_fn: Callable,
    first: PyTree,
    target: PyTree,
    arguments_at: Callable,
    model_axis_name: AxisName,
    loss_on_every_device: bool,
) -> jax.ShapeDtypeStruct:
    """The shape of `loss_fn` on the first microbatch's output (with the mesh axes it varies
    over), after checking that it gives one floating-point scalar."""

    def first_loss(h: PyTree, t: PyTree) -> PyTree:
        out = stage(h, *arguments_at(0)[0], **arguments_at(0)[1])
        if loss_on_every_device:  # as the run hands it over: the same on every device
            out = jax.tree.map(
                lambda a: lax.psum(a, model_axis_name) if eqx.is_inexact_array(a) else a, out
            )
        return loss_fn(out, t)

    loss_shape = jax.eval_shape(first_loss, first, target)
    if not isinstance(loss_shape, jax.ShapeDtypeStruct) or loss_shape.shape != ():
        raise ValueError(
            f"{caller}: `loss_fn(outputs, targets)` must return one scalar per microbatch "
            f"(e.g. a mean over rows); it returned {describe_tree(loss_shape)}."
        )
    if not jnp.issubdtype(loss_shape.dtype, jnp.inexact):
        raise TypeError(
            f"{caller}: `loss_fn` must return a floating-point scalar, got {loss_shape.dtype.name}."
        )
    return loss_shape


def _check_collectives(
    caller: str,
    stage: Callable,
    loss_fn: Callable,
    first: PyTree,
    target: PyTree,
    arguments_at: Callable,
    model_axis_name: AxisName,
    loss_on_every_device: bool,
) -> None:
    """Refuse the collectives a training schedule cannot run: a `ppermute` in the stage, and
    a collective over the pipeline axis in a loss that runs on one device."""
    call_args, call_kwargs = arguments_at(0)
    if uses_primitive(
        jax.make_jaxpr(lambda h: stage(h, *call_args, **call_kwargs))(first), "ppermute"
    ):
        # Each device runs the loop of its own action (`StepLoop.act`, on a per-device
        # kind); a `ppermute` inside such a loop (or a branch), over any mesh axis, gives
        # wrong values (seen on CPU), where psum, all-gather and reduce-scatter give the
        # right ones.
        raise ValueError(
            f"{caller}: the stage uses `lax.ppermute` (a ring collective: ring attention, "
            f"`TPAsyncDense`, `eqpar.collectives`), which cannot run inside the per-device "
            f"branches of a training schedule. Train through the forward pass instead "
            f"(`jax.grad` of `execute_pipeline` / `PipelineModule.__call__`, the GPipe or "
            f"circular schedule), or use a collective without `ppermute` in the stage "
            f"(`strategy='all_gather'` attention, `TPDense`)."
        )
    loss_axes = collective_axes(jax.make_jaxpr(lambda h, t: loss_fn(h, t))(first, target))
    if model_axis_name in loss_axes and not loss_on_every_device:
        raise ValueError(
            f"{caller}: `loss_fn` uses a collective over the pipeline axis "
            f"{model_axis_name!r}, but none of its parameters is split over that axis, so it "
            f"runs on the last stage's device alone, where such a collective cannot run. "
            f"Split its parameters over {model_axis_name!r} too (e.g. "
            f"`eqpar.ColumnParallel(('model', {model_axis_name!r}))` on the output head with "
            f"`eqpar.nn.vocab_parallel_cross_entropy`): it then runs on every device of the "
            f"axis; or remove the collective."
        )
