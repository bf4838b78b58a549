"""Pipeline executors against their serial twins, continued: what the training tables keep
between a stage's forward and its backward (1F1B's residuals, the layer-by-layer backward
of scanned layers) and the autodiff of a forward run, which is the training tables'
backward (float32, within 1e-5 of each leaf's scale). Helpers come from `test_pipeline`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_pipeline import (
    FEATURES,
    SCALE,
    Block,
    assert_tree_close,
    batch,
    forward_and_grad,
    layout,
    make_module,
    mse,
    pipe_mesh,
    serial_twin,
)

from eqpar.nn.pipeline import PipelineModule, ScannedLayers
from eqpar.pipeline import _layered, execute_1f1b, execute_pipeline

# --------------------------------------------------------------------------------------
# 1F1B keeps each stage's residuals instead of recomputing its forward.


class TanhMLP(eqx.Module):
    """A stage as Equinox's docs write one: layers in a list, a per-example vmap."""

    layers: list

    def __init__(self, key, width=FEATURES):
        keys = jax.random.split(key, 2)
        self.layers = [eqx.nn.Linear(width, width, key=k) for k in keys]

    def __call__(self, h):
        def one(row):
            for layer in self.layers:
                row = jnp.tanh(layer(row))
            return row

        return jax.vmap(one)(h)


def test_1f1b_stores_residuals_or_recomputes_with_the_same_gradients():
    width = 8
    keys = jax.random.split(jax.random.key(3), 4)
    stages = eqx.filter_vmap(lambda k: TanhMLP(k, width))(keys)
    params, static = eqx.partition(stages, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (8, width))
    t = jax.random.normal(jax.random.key(2), (8, width))

    def serial(params):
        h = x
        for stage in range(4):
            h = eqx.combine(jax.tree.map(lambda a, i=stage: a[i], params), static)(h)
        return mse(h, t)

    loss_ref, grads_ref = jax.value_and_grad(serial)(params)

    def step(recompute):
        def run(params, x, t):
            stage = eqx.combine(jax.tree.map(lambda a: a[0], params), static)
            loss, grads = execute_1f1b(
                stage, mse, x, t, num_microbatches=8, model_axis_name="pipe", recompute=recompute
            )
            return loss, jax.tree.map(lambda g: g[None], grads)

        specs = dict(in_specs=(P("pipe"), P(), P()), out_specs=(P(), P("pipe")))
        return jax.jit(jax.shard_map(run, mesh=pipe_mesh(4), **specs))

    matmuls = {}
    for recompute in (False, True):
        fn = step(recompute)
        loss, grads = fn(params, x, t)
        assert_tree_close(loss, loss_ref)
        assert_tree_close(grads, grads_ref)
        matmuls[recompute] = fn.lower(params, x, t).compile().as_text().count(" dot(")
    # the stored residuals save the forward (two matmuls) that recomputing runs a second time
    assert matmuls[True] - matmuls[False] == 2


def test_1f1b_does_not_store_what_it_keeps_anyway():
    """A linear stage's residuals are its weight and its input: nothing more is stored."""
    from eqpar.pipeline._loop import _Residuals

    linear = eqx.nn.Linear(FEATURES, FEATURES, key=jax.random.key(0))
    params, static = eqx.partition(linear, eqx.is_inexact_array)

    def stage_vjp(p, h, microbatch):
        out, pullback = jax.vjp(lambda p, h: jax.vmap(eqx.combine(p, static))(h), p, h)
        return pullback, out

    assert _Residuals(stage_vjp, params, jnp.ones((2, FEATURES))).shapes == ()
    mlp = TanhMLP(jax.random.key(1))
    mlp_params, mlp_static = eqx.partition(mlp, eqx.is_inexact_array)

    def mlp_vjp(p, h, microbatch):
        out, pullback = jax.vjp(lambda p, h: eqx.combine(p, mlp_static)(h), p, h)
        return pullback, out

    stored = _Residuals(mlp_vjp, mlp_params, jnp.ones((2, FEATURES))).shapes
    assert stored and all(r.shape != linear.weight.shape for r in stored)  # activations only


def spy_layered_backward(monkeypatch) -> list:
    """The `LayeredStage`s whose layer-by-layer backward runs (one entry per trace)."""
    calls = []
    original = _layered.LayeredStage.backward

    def spy(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_layered.LayeredStage, "backward", spy)
    return calls


@pytest.mark.parametrize(
    ("schedule", "remat", "num_layers"),
    [
        ("gpipe", "none", 8),
        ("circular", "full", 8),
        ("1f1b", "matmuls", 8),
        ("zb-h1", "none", 8),
        ("circular", "none", 4),  # one layer per stage
        ("1f1b", "full", 2),
    ],
)
def test_every_training_schedule_adds_each_layers_gradient_into_the_sum(
    schedule, remat, num_layers, monkeypatch
):
    """A stage of scanned layers is differentiated layer by layer in every training table
    (each layer's gradient added into the sum over microbatches at its rows, `_layered`; a
    layer's input kept once, layer 0's being the stage input), and on data=2 x pipe=2 the
    loss, the parameter gradients and the batch's gradients are the serial twin's, whatever
    the layers' remat policy and however many layers a stage holds."""
    backwards = spy_layered_backward(monkeypatch)
    layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(3), num_layers))
    module = PipelineModule.from_layers(
        layers,
        num_stages=2,
        num_microbatches=4,
        num_repeats=2 if schedule == "circular" else 1,
        remat=remat,
    )
    x, t, shift = batch(8)  # 16 rows: 8 per data shard, 4 microbatches of 2
    _, loss_ref, grads_ref, x_grads_ref = serial_twin(module, x, t, shift)
    arrays, static, specs = layout(module)

    def step(arrays, x, t, shift):
        model = eqx.combine(arrays, static)
        value, (grads, _, x_grads) = model.value_and_grad(
            mse, x, t, shift, scale=SCALE, schedule=schedule, return_all_grads=True
        )
        return value, eqx.filter(grads, eqx.is_array), x_grads

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "pipe"))
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, P("data"), P("data"), P()),
            out_specs=(P(), specs, P("data")),
        )
    )
    loss, grads, x_grads = fn(arrays, x, t, shift)
    assert backwards, "the schedule differentiated the stage whole"
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)
    assert_tree_close(x_grads, x_grads_ref)


@pytest.mark.parametrize(("schedule", "remat"), [("gpipe", "full"), ("circular", "none")])
def test_autodiff_of_a_forward_run_is_the_training_tables_backward(schedule, remat, monkeypatch):
    """`jax.grad` through `PipelineModule.__call__` runs the training table's backward half
    (layer by layer for scanned layers) on data=2 x pipe=2, with the serial twin's loss,
    parameter gradients and batch gradients; and a circular run holds no more temp than
    `value_and_grad(schedule="circular")` (autodiff of the loop kept the stage's weights
    at every clock step), beyond the outputs it returns."""
    backwards = spy_layered_backward(monkeypatch)
    layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(3), 8))
    module = PipelineModule.from_layers(
        layers, num_stages=2, num_microbatches=4,
        num_repeats=2 if schedule == "circular" else 1, remat=remat,
    )  # fmt: skip
    x, t, shift = batch(8)
    _, loss_ref, grads_ref, x_grads_ref = serial_twin(module, x, t, shift)
    arrays, static, specs = layout(module)
    last = module.num_stages - 1

    def autodiff(arrays, x, t, shift):
        def loss(arrays, x):
            y = eqx.combine(arrays, static)(x, shift, scale=SCALE)
            value = lax.psum(jnp.where(lax.axis_index("pipe") == last, mse(y, t), 0.0), "pipe")
            return lax.pmean(value, "data")

        value, (grads, x_grads) = jax.value_and_grad(loss, argnums=(0, 1))(arrays, x)
        return value, grads, x_grads

    def table(arrays, x, t, shift):
        value, (grads, _, x_grads) = eqx.combine(arrays, static).value_and_grad(
            mse, x, t, shift, scale=SCALE, schedule=schedule, return_all_grads=True
        )
        return value, eqx.filter(grads, eqx.is_array), x_grads

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "pipe"))
    compiled = {}
    for name, step in (("autodiff", autodiff), ("table", table)):
        fn = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(specs, P("data"), P("data"), P()),
                out_specs=(P(), specs, P("data")),
            )
        )
        compiled[name] = fn.lower(arrays, x, t, shift).compile()
        if name == "autodiff":
            assert backwards, "autodiff differentiated the stage whole"
            loss, grads, x_grads = fn(arrays, x, t, shift)
            assert_tree_close(loss, loss_ref)
            assert_tree_close(grads, grads_ref)
            assert_tree_close(x_grads, x_grads_ref)
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    # Beyond the table's: the outputs `__call__` returns and their cotangent, a batch each.
    assert temp["autodiff"] <= temp["table"] + 2 * x.nbytes, temp


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_autodiff_of_a_forward_run_with_arguments_computed_from_parameters(schedule):
    """The training table gives extra stage arguments no gradients: a forward run whose
    floating-point argument is computed from what is differentiated is differentiated by
    autodiff of the loop, with the serial twin's gradients (the argument's included)."""
    num_stages = 2
    module = make_module(schedule, num_stages, 4)
    x, t, shift = batch(4)
    arrays, static, specs = layout(module)

    def serial(arrays, shift):
        y = eqx.combine(arrays, static).apply_serially(x, 2.0 * shift, scale=SCALE)
        return mse(y, t)

    loss_ref, (grads_ref, shift_grads_ref) = jax.value_and_grad(serial, argnums=(0, 1))(
        arrays, shift
    )

    def step(arrays, x, t, shift):
        def loss(arrays, shift):
            y = eqx.combine(arrays, static)(x, 2.0 * shift, scale=SCALE)
            return lax.psum(
                jnp.where(lax.axis_index("pipe") == num_stages - 1, mse(y, t), 0.0), "pipe"
            )

        return jax.value_and_grad(loss, argnums=(0, 1))(arrays, shift)

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=pipe_mesh(num_stages),
            in_specs=(specs, P(), P(), P()),
            out_specs=(P(), (specs, P())),
        )
    )
    loss, (grads, shift_grads) = fn(arrays, x, t, shift)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)
    assert_tree_close(shift_grads, shift_grads_ref)


def test_autodiff_of_a_circular_run_keeps_no_weights_per_step():
    """Wide stages, few rows: autodiff of a circular run used to keep the stage's weights
    (and values derived from them) at every clock step, 2.7x the table's temp here; through
    the table's backward it holds the table's temp, plus the outputs `__call__` returns
    (kept, and their cotangent)."""
    width, num_microbatches = 64, 8
    module = PipelineModule.from_stage_fn(
        lambda key: TanhMLP(key, width=width), num_stages=2, num_repeats=2,
        key=jax.random.key(0), num_microbatches=num_microbatches,
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2 * num_microbatches, width))
    arrays, static, specs = layout(module)

    def autodiff(arrays, x):
        def loss(arrays):
            y = eqx.combine(arrays, static)(x)
            return lax.psum(jnp.where(lax.axis_index("pipe") == 1, mse(y, x), 0.0), "pipe")

        return jax.value_and_grad(loss)(arrays)

    def table(arrays, x):
        value, grads = eqx.combine(arrays, static).value_and_grad(mse, x, x, schedule="circular")
        return value, eqx.filter(grads, eqx.is_array)

    temp = {}
    for name, step in (("autodiff", autodiff), ("table", table)):
        fn = jax.jit(
            jax.shard_map(step, mesh=pipe_mesh(2), in_specs=(specs, P()), out_specs=(P(), specs))
        )
        temp[name] = fn.lower(arrays, x).compile().memory_analysis().temp_size_in_bytes
    assert temp["autodiff"] <= temp["table"] + 3 * x.nbytes, temp


def test_autodiff_of_a_forward_run_whose_stage_closes_over_its_weights():
    """A stage written as a function of the weights it closes over (`lambda h: h * scale`,
    as `execute_pipeline`'s docstring writes one) gets their gradients: autodiff of the loop
    differentiates it (a custom VJP would leak the closed-over tracer)."""
    scales = jnp.array([1.0, 2.0, 3.0, 4.0])
    x = jnp.arange(8.0).reshape(4, 2)

    def run(scale, x):
        stage = lambda h: jnp.tanh(h * scale[0])
        return execute_pipeline(
            stage, x, num_microbatches=2, model_axis_name="pipe", broadcast_output=True
        )

    def loss(scales):
        y = jax.shard_map(run, mesh=pipe_mesh(4), in_specs=(P("pipe"), P()), out_specs=P())(
            scales, x
        )
        return jnp.sum(y**2)

    def serial(scales):
        h = x
        for s in scales:
            h = jnp.tanh(h * s)
        return jnp.sum(h**2)

    loss_ref, grads_ref = jax.value_and_grad(serial)(scales)
    value, grads = jax.jit(jax.value_and_grad(loss))(scales)
    assert_tree_close(value, loss_ref)
    assert_tree_close(grads, grads_ref)


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
@pytest.mark.parametrize("layered", [False, True], ids=["stage", "scanned-layers"])
def test_autodiff_of_a_forward_run_with_the_stage_rematerialised_whole(schedule, layered):
    """`remat="full"` on the module (not on its layers): the training table recomputes each
    stage's forward in its backward, and leaves the last stage's forward to it; the forward
    half still runs the last stage, whose outputs the run returns. Serial twin's outputs and
    gradients (the run used to fail on an output the forward half never made)."""
    num_repeats = 2 if schedule == "circular" else 1
    if layered:
        layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(3), 8))
        stages = ScannedLayers(
            jax.tree.map(lambda a: a.reshape(2 * num_repeats, -1, *a.shape[1:]), layers)
        )
        module = PipelineModule(
            stages, num_stages=2, num_microbatches=4, num_repeats=num_repeats, remat="full"
        )
    else:
        module = make_module(schedule, 2, 4, remat="full")
    x, t, shift = batch(4)
    y_ref, loss_ref, grads_ref, _ = serial_twin(module, x, t, shift)
    arrays, fn = forward_and_grad(module, pipe_mesh(2))
    loss, y, grads = fn(arrays, x, t, shift)
    assert_tree_close(y[-1], y_ref)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)


def test_forward_mode_through_a_forward_run_equals_the_serial_twin():
    """`jax.jvp` traced through a GPipe run (whose reverse mode is the training table's
    custom VJP, which forward mode cannot pass) differentiates the step loop: the tangent is
    the serial twin's. (Circular runs take the same path, `_table_grad.forward_outputs`.)
    `jax.linearize` is reverse-mode-like and cannot be told apart while tracing: with
    `backward="autodiff"` it works too."""
    schedule = "gpipe"
    x, _, shift = batch(2)

    def jvp_of_run(module, linearize=False):
        arrays, static, specs = layout(module)
        run = jax.shard_map(
            lambda arrays: eqx.combine(arrays, static)(x, shift, scale=SCALE),
            mesh=pipe_mesh(2), in_specs=(specs,), out_specs=P(),
        )  # fmt: skip
        tangent = jax.tree.map(lambda a: jnp.full_like(a, 0.1), arrays)
        if linearize:
            return jax.jit(lambda a, t: jax.linearize(run, a)[1](t))(arrays, tangent)
        return jax.jit(lambda a, t: jax.jvp(run, (a,), (t,)))(arrays, tangent)

    module = make_module(schedule, 2, 2, broadcast_output=True)
    arrays, static, _ = layout(module)
    serial = lambda arrays: eqx.combine(arrays, static).apply_serially(x, shift, scale=SCALE)
    tangent = jax.tree.map(lambda a: jnp.full_like(a, 0.1), arrays)
    want = jax.jvp(serial, (arrays,), (tangent,))
    assert_tree_close(jvp_of_run(module), want)
    autodiff = make_module(schedule, 2, 2, broadcast_output=True, backward="autodiff")
    assert_tree_close(jvp_of_run(autodiff, linearize=True), want[1])
    with pytest.raises(ValueError, match=r"`backward` is 'table'.*got 'forward'"):
        make_module(schedule, 2, 2, backward="forward")
