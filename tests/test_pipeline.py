"""Pipeline executors and PipelineModule against their serial twins (float32, within 1e-5 of
each leaf's scale)."""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqpar._declare import declared_partition_specs
from eqpar._paths import path_to_str
from eqpar.nn.pipeline import PipelineModule, ScannedLayers
from eqpar.pipeline import (
    Microbatched,
    execute_1f1b,
    execute_pipeline,
    execute_pipeline_step,
)
from eqpar.schedule import CircularSchedule, GPipeSchedule, OneFOneBSchedule

FEATURES = 4
ROWS_PER_MICROBATCH = 2
SCALE = 0.5
RTOL = 1e-5


class Block(eqx.Module):
    """A residual stage that uses an extra positional and a keyword argument."""

    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(FEATURES, FEATURES, key=key)

    def __call__(self, x, shift, *, scale):
        return x + scale * jnp.tanh(jax.vmap(self.linear)(x) + shift)


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def layout(module):
    """shard_map in_specs for `module`'s arrays from what its modules declare."""
    declared = declared_partition_specs(module)
    arrays, static = eqx.partition(module, eqx.is_array)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: declared.get(path_to_str(path), P()), arrays
    )
    return arrays, static, specs


def assert_tree_close(actual, expected):
    """Same structure, float32 leaves, each within RTOL of the expected leaf's largest
    magnitude (`numerics.assert_tree_close`)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for leaf in jax.tree.leaves((actual, expected)):
        assert np.asarray(leaf).dtype == np.float32
    numerics.assert_tree_close(actual, expected, rtol=RTOL)


def pipe_mesh(size):
    return Mesh(np.array(jax.devices()[:size]), ("pipe",))


def batch(num_microbatches, key=1):
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    rows = num_microbatches * ROWS_PER_MICROBATCH
    x = jax.random.normal(k1, (rows, FEATURES))
    t = jax.random.normal(k2, (rows, FEATURES))
    shift = 0.1 * jax.random.normal(k3, (FEATURES,))
    return x, t, shift


def make_module(schedule, num_stages, num_microbatches, **options):
    return PipelineModule.from_stage_fn(
        Block,
        num_stages=num_stages,
        key=jax.random.key(0),
        num_microbatches=num_microbatches,
        num_repeats=2 if schedule == "circular" else 1,
        **options,
    )


def serial_twin(module, x, t, shift):
    arrays, static = eqx.partition(module, eqx.is_array)

    def loss(arrays, x):
        return mse(eqx.combine(arrays, static).apply_serially(x, shift, scale=SCALE), t)

    y = module.apply_serially(x, shift, scale=SCALE)
    value, (grads, x_grads) = jax.value_and_grad(loss, argnums=(0, 1))(arrays, x)
    return y, value, grads, x_grads


def forward_and_grad(module, mesh, axes=("pipe",)):
    """jit(shard_map(...)) returning (loss, per-device outputs [S, ...], grads)."""
    arrays, static, specs = layout(module)
    last = module.num_stages - 1

    def step(arrays, x, t, shift):
        def loss(arrays):
            y = eqx.combine(arrays, static)(x, shift, scale=SCALE)
            mask = lax.axis_index("pipe") == last
            return lax.psum(jnp.where(mask, mse(y, t), 0.0), "pipe"), y

        (value, y), grads = jax.value_and_grad(loss, has_aux=True)(arrays)
        return value, y[None], grads

    fn = jax.shard_map(
        step, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=(P(), P(axes), specs)
    )
    return arrays, jax.jit(fn)


def one_f_one_b(module, mesh):
    arrays, static, specs = layout(module)

    def step(arrays, x, t, shift):
        model = eqx.combine(arrays, static)
        value, (grads, _, x_grads) = model.value_and_grad(
            mse, x, t, shift, scale=SCALE, schedule="1f1b", return_all_grads=True
        )
        return value, eqx.filter(grads, eqx.is_array), x_grads

    fn = jax.shard_map(
        step, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=(P(), specs, P())
    )
    return arrays, jax.jit(fn)


MATRIX = [
    (schedule, s, m)
    for schedule in ("gpipe", "circular", "1f1b")
    for s in (2, 4, 8)
    for m in sorted({1, s, 4 * s})
]


@pytest.mark.parametrize(("schedule", "num_stages", "num_microbatches"), MATRIX)
def test_matches_serial_twin(schedule, num_stages, num_microbatches):
    """Forward outputs, loss and gradients (with *args and **kwargs) equal the serial run."""
    module = make_module(schedule, num_stages, num_microbatches)
    x, t, shift = batch(num_microbatches)
    y_ref, loss_ref, grads_ref, x_grads_ref = serial_twin(module, x, t, shift)
    mesh = pipe_mesh(num_stages)
    if schedule == "1f1b":
        arrays, fn = one_f_one_b(module, mesh)
        loss, grads, x_grads = fn(arrays, x, t, shift)
        assert_tree_close(x_grads, x_grads_ref)
    else:
        arrays, fn = forward_and_grad(module, mesh)
        loss, y, grads = fn(arrays, x, t, shift)
        assert_tree_close(y[-1], y_ref)
        assert not np.any(np.asarray(y[:-1])), "non-last stages must return zeros"
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)


def test_value_and_grad_1f1b_is_deprecated_for_value_and_grad_with_schedule():
    # One name per schedule: the old spelling warns and gives what `schedule="1f1b"` gives.
    module = make_module("1f1b", 2, 2)
    x, t, shift = batch(2)
    arrays, static, specs = layout(module)

    def old(arrays, x, t, shift):
        with pytest.warns(DeprecationWarning, match=r"value_and_grad_1f1b is deprecated.*'1f1b'"):
            value, grads = eqx.combine(arrays, static).value_and_grad_1f1b(
                mse, x, t, shift, scale=SCALE
            )
        return value, eqx.filter(grads, eqx.is_array)

    fn = jax.jit(
        jax.shard_map(
            old, mesh=pipe_mesh(2), in_specs=(specs, P(), P(), P()), out_specs=(P(), specs)
        )
    )
    loss, grads = fn(arrays, x, t, shift)
    expected_loss, expected_grads, _ = one_f_one_b(module, pipe_mesh(2))[1](arrays, x, t, shift)
    assert_tree_close(loss, expected_loss)
    assert_tree_close(grads, expected_grads)


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_broadcast_output(schedule):
    module = make_module(schedule, 4, 4, broadcast_output=True)
    x, _, shift = batch(4)
    arrays, static, specs = layout(module)
    fn = jax.jit(
        jax.shard_map(
            lambda a, x, s: eqx.combine(a, static)(x, s, scale=SCALE)[None],
            mesh=pipe_mesh(4),
            in_specs=(specs, P(), P()),
            out_specs=P("pipe"),
        )
    )
    y = fn(arrays, x, shift)
    expected = module.apply_serially(x, shift, scale=SCALE)
    for device in range(4):
        assert_tree_close(y[device], expected)


def _scanned_module(schedule, remat):
    layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(3), 8))
    return PipelineModule.from_layers(
        layers,
        num_stages=2,
        num_microbatches=4,
        num_repeats=2 if schedule == "circular" else 1,
        remat=remat,
    )


@pytest.mark.parametrize(
    ("schedule", "remat"), [("gpipe", True), ("circular", "matmuls"), ("1f1b", "full")]
)
def test_scanned_layers_with_remat(schedule, remat):
    """8 scanned layers cut into stages of 2 (or 4), rematerialised layer by layer, against
    the serial twin and against running the 8 layers one by one."""
    module = _scanned_module(schedule, remat=remat)
    assert module.stages.remat == ("full" if remat is True else remat)
    # [S, L/S, ...] for GPipe and 1F1B; [V, S, L/(S V), ...] for the circular schedule.
    assert module.stages.layers.linear.weight.shape == (
        (2, 2, 2, FEATURES, FEATURES) if schedule == "circular" else (2, 4, FEATURES, FEATURES)
    )
    x, t, shift = batch(4)
    y_ref, loss_ref, grads_ref, _ = serial_twin(module, x, t, shift)
    layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(3), 8))
    h = x
    for i in range(8):
        h = ScannedLayers(layers).layer(i)(h, shift, scale=SCALE)
    assert_tree_close(y_ref, h)
    if schedule == "1f1b":
        arrays, fn = one_f_one_b(module, pipe_mesh(2))
        loss, grads, _ = fn(arrays, x, t, shift)
    else:
        arrays, fn = forward_and_grad(module, pipe_mesh(2))
        loss, y, grads = fn(arrays, x, t, shift)
        assert_tree_close(y[-1], y_ref)
        jaxpr = str(jax.make_jaxpr(fn)(arrays, x, t, shift))
        assert "checkpoint" in jaxpr or "remat" in jaxpr
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)


def test_remat_off_has_no_checkpoint():
    module = _scanned_module("gpipe", remat=False)
    arrays, fn = forward_and_grad(module, pipe_mesh(2))
    jaxpr = str(jax.make_jaxpr(fn)(arrays, *batch(4)))
    assert "checkpoint" not in jaxpr and "remat" not in jaxpr


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_data_by_pipe_mesh(schedule):
    """Batch split over `data`, stages over `pipe`: equals the serial run on the whole batch."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "pipe"))
    module = make_module(schedule, 4, 4, broadcast_output=True)
    x, t, shift = batch(8)  # 16 rows: 8 per data shard, 4 microbatches of 2
    y_ref, loss_ref, grads_ref, _ = serial_twin(module, x, t, shift)
    arrays, static, specs = layout(module)

    def step(arrays, x, t, shift):
        model = eqx.combine(arrays, static)
        if schedule == "1f1b":
            value, grads = model.value_and_grad(mse, x, t, shift, scale=SCALE, schedule="1f1b")
            # The loss of the whole batch (the mean over the `data` shards) and its
            # gradients, as `jax.grad` of a `pmean` of the loss gives (the one gradient rule).
            return value, jnp.zeros_like(x), eqx.filter(grads, eqx.is_array)

        def loss(arrays):
            y = eqx.combine(arrays, static)(x, shift, scale=SCALE)
            return lax.pmean(mse(y, t), "data"), y

        (value, y), grads = jax.value_and_grad(loss, has_aux=True)(arrays)
        return value, y, grads

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, P("data"), P("data"), P()),
            out_specs=(P(), P("data"), specs),
        )
    )
    loss, y, grads = fn(arrays, x, t, shift)
    if schedule != "1f1b":
        assert_tree_close(y, y_ref)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)


# --------------------------------------------------------------------------------------
# pipe x model: tensor-parallel layers inside every stage.


class TPBlock(eqx.Module):
    """Column-parallel up projection, row-parallel down projection, residual."""

    up: Any  # TPDense
    down: Any

    def __init__(self, key):
        from eqpar.nn.tensor_parallel import TPDense

        k1, k2 = jax.random.split(key)
        self.up = TPDense(FEATURES, 2 * FEATURES, model_axis_name="model", tp_mode="gather", key=k1)
        self.down = TPDense(
            2 * FEATURES, FEATURES, model_axis_name="model", tp_mode="scatter", key=k2
        )

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))

    def serial(self, x):
        up, down = self.up.to_linear(), self.down.to_linear()  # type: ignore[attr-defined]
        return x + jax.vmap(down)(jnp.tanh(jax.vmap(up)(x)))


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_pipe_by_model_mesh_with_tpdense(schedule):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("pipe", "model"))
    module = PipelineModule.from_stage_fn(
        TPBlock,
        num_stages=4,
        key=jax.random.key(5),
        num_microbatches=4,
        num_repeats=2 if schedule == "circular" else 1,
    )
    arrays, static, specs = layout(module)
    lead = (None,) if schedule == "circular" else ()
    assert specs.stages.up.weight == P(*lead, "pipe", "model", None)
    assert specs.stages.down.weight == P(*lead, "pipe", None, "model")
    x, t, _ = batch(4)

    def serial_loss(arrays):
        model = eqx.combine(arrays, static)
        h = x
        for s in range(4 * model.num_repeats):
            h = model.stage(s).serial(h)
        return mse(h, t), h

    serial = jax.jit(jax.value_and_grad(serial_loss, has_aux=True))
    (loss_ref, y_ref), grads_ref = serial(arrays)
    features = P(None, "model")

    def step(arrays, x, t):
        model = eqx.combine(arrays, static)
        if schedule == "1f1b":

            def loss_fn(y, t):
                return lax.pmean(mse(y, t), "model")

            value, grads = model.value_and_grad(loss_fn, x, t, schedule="1f1b")
            return value, jnp.zeros_like(x)[None], eqx.filter(grads, eqx.is_array)

        def loss(arrays):
            y = eqx.combine(arrays, static)(x)
            last = lax.axis_index("pipe") == 3
            value = lax.pmean(jnp.where(last, mse(y, t), 0.0), "model")
            return lax.psum(value, "pipe"), y

        (value, y), grads = jax.value_and_grad(loss, has_aux=True)(arrays)
        return value, y[None], grads

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, features, features),
            out_specs=(P(), P("pipe", None, "model"), specs),
        )
    )
    loss, y, grads = fn(arrays, x, t)
    if schedule != "1f1b":
        assert_tree_close(y[-1], y_ref)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)


# --------------------------------------------------------------------------------------
# The primitives on their own.


def test_execute_pipeline_step_passes_state_to_the_next_device():
    def run(scale, x, state):
        stage = lambda h, bias, *, power: (h * scale[0] + bias) ** power
        new_state, out = execute_pipeline_step(
            stage, state[0], x, jnp.float32(1.0), model_axis_name="pipe", power=1
        )
        return new_state[None], out[None]

    fn = jax.shard_map(
        run, mesh=pipe_mesh(4), in_specs=(P("pipe"), P(), P("pipe")), out_specs=P("pipe")
    )
    scales = jnp.array([2.0, 3.0, 4.0, 5.0])
    state = jnp.arange(4.0)[:, None] * jnp.ones((4, 3))
    x = jnp.full((3,), 10.0)
    new_state, out = fn(scales, x, state)
    # Device 0 computes from x, device d > 0 from its state; results move one device on, and
    # the last device's goes nowhere (device 0 reads x, so nothing crosses the wrap-around).
    results = np.stack([10 * 2 + 1, 1 * 3 + 1, 2 * 4 + 1, 3 * 5 + 1]).astype(np.float32)
    np.testing.assert_array_equal(new_state[:, 0], [0, *results[:3]])
    np.testing.assert_array_equal(out[:, 0], [0, 0, 0, results[3]])


def test_pytree_activations_with_integer_leaves():
    """A stage may carry a dict with an integer leaf; it passes through, untouched by grads."""

    class Masked(eqx.Module):
        weight: jax.Array

        def __call__(self, h):
            return {"x": h["x"] * self.weight + h["count"][:, None], "count": h["count"] + 1}

    weights = jnp.array([[1.5], [0.5], [2.0]]) * jnp.ones((3, 2))
    x = {"x": jnp.arange(12.0).reshape(6, 2), "count": jnp.zeros(6, jnp.int32)}
    t = jnp.ones((6, 2))
    loss_fn = lambda y, t: mse(y["x"], t) + 0.0 * jnp.sum(y["count"])

    def serial(w):
        h = x
        for i in range(3):
            h = Masked(w[i])(h)
        return loss_fn(h, t), h

    (loss_ref, y_ref), grads_ref = jax.value_and_grad(serial, has_aux=True)(weights)

    def run(w, x, t):
        stage = Masked(w[0])
        y = execute_pipeline(
            stage, x, num_microbatches=3, model_axis_name="pipe", broadcast_output=True
        )
        loss, grads = execute_1f1b(stage, loss_fn, x, t, num_microbatches=3, model_axis_name="pipe")

        def forward_loss(w):  # differentiated by the training table's backward half
            out = execute_pipeline(Masked(w[0]), x, num_microbatches=3, model_axis_name="pipe")
            return lax.psum(jnp.where(lax.axis_index("pipe") == 2, loss_fn(out, t), 0.0), "pipe")

        return y, loss, grads.weight[None], jax.grad(forward_loss)(w)

    fn = jax.jit(
        jax.shard_map(
            run,
            mesh=pipe_mesh(3),
            in_specs=(P("pipe"), P(), P()),
            out_specs=(P(), P(), P("pipe"), P("pipe")),
        )
    )
    y, loss, grads, autodiff_grads = fn(weights, x, t)
    assert_tree_close(y["x"], y_ref["x"])
    np.testing.assert_array_equal(y["count"], np.full(6, 3))
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)
    assert_tree_close(autodiff_grads, grads_ref)


def test_1f1b_loss_fn_parameters_get_gradients():
    """An output head inside `loss_fn` and the pipeline input both get gradients."""

    class Head(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, y, t):
            return mse(jax.vmap(self.linear)(y), t)

    module = make_module("1f1b", 2, 4)
    head = Head(eqx.nn.Linear(FEATURES, 3, key=jax.random.key(9)))
    x, _, shift = batch(4)
    t = jax.random.normal(jax.random.key(4), (x.shape[0], 3))
    arrays, static, specs = layout(module)

    def serial(arrays, head, x):
        return head(eqx.combine(arrays, static).apply_serially(x, shift, scale=SCALE), t)

    loss_ref, refs = jax.value_and_grad(serial, argnums=(0, 1, 2))(arrays, head, x)

    def step(arrays, head, x, t, shift):
        model = eqx.combine(arrays, static)
        value, (grads, head_grads, x_grads) = model.value_and_grad(
            head, x, t, shift, scale=SCALE, schedule="1f1b", return_all_grads=True
        )
        return value, (eqx.filter(grads, eqx.is_array), head_grads, x_grads)

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=pipe_mesh(2),
            in_specs=(specs, P(), P(), P(), P()),
            out_specs=(P(), (specs, P(), P())),
        )
    )
    loss, grads = fn(arrays, head, x, t, shift)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, refs)


# --------------------------------------------------------------------------------------
# Compile size and schedule length do not grow with the number of microbatches.


def _compiled_size(module, mesh, schedule):
    x, t, shift = batch(module.num_microbatches)
    arrays, fn = (one_f_one_b if schedule == "1f1b" else forward_and_grad)(module, mesh)
    return len(fn.lower(arrays, x, t, shift).compile().as_text() or "")


@pytest.mark.parametrize(
    ("schedule", "few", "many"), [("gpipe", 4, 32), ("circular", 8, 32), ("1f1b", 4, 32)]
)
def test_compiled_program_is_flat_in_microbatches(schedule, few, many):
    mesh = pipe_mesh(4)
    small = _compiled_size(make_module(schedule, 4, few), mesh, schedule)
    large = _compiled_size(make_module(schedule, 4, many), mesh, schedule)
    assert abs(large - small) / small < 0.05, (small, large)


def _scan_lengths(fn, *args):
    return [int(n) for n in re.findall(r"\blength=(\d+)", str(jax.make_jaxpr(fn)(*args)))]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("gpipe", GPipeSchedule(4, 6)),
        ("circular", CircularSchedule(4, 6, 2)),
        ("1f1b", OneFOneBSchedule(4, 6)),
    ],
)
def test_one_scan_with_the_schedule_length(schedule, expected):
    module = make_module(schedule, 4, 6)
    assert module.schedule("1f1b" if schedule == "1f1b" else "forward").actions == expected.actions
    x, t, shift = batch(6)
    arrays, fn = (one_f_one_b if schedule == "1f1b" else forward_and_grad)(module, pipe_mesh(4))
    lengths = _scan_lengths(fn, arrays, x, t, shift)
    assert expected.num_steps in lengths
    assert len([n for n in lengths if n > 1]) <= 2  # forward scan and, for autodiff, its transpose


# --------------------------------------------------------------------------------------
# Model order: from_layers / to_layers and stack_layers / unstack_layers.


@pytest.mark.parametrize(("num_stages", "num_repeats"), [(8, 1), (4, 1), (4, 2), (2, 2), (1, 1)])
def test_layers_round_trip_through_stages_by_reshape(num_stages, num_repeats):
    layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 8))
    module = PipelineModule.from_layers(
        layers, num_stages=num_stages, num_repeats=num_repeats, num_microbatches=1
    )
    per_stage = 8 // (num_stages * num_repeats)
    lead = (num_stages,) if num_repeats == 1 else (num_repeats, num_stages)
    weight = module.stages.layers.linear.weight
    assert weight.shape == (*lead, per_stage, FEATURES, FEATURES)
    # Storage is the model-order stack reshaped, nothing permuted.
    np.testing.assert_array_equal(weight, layers.linear.weight.reshape(weight.shape))
    back = module.to_layers()
    assert jax.tree.structure(back) == jax.tree.structure(layers)
    for a, e in zip(jax.tree.leaves(back), jax.tree.leaves(layers)):
        np.testing.assert_array_equal(a, e)
    stages = module.serial_stages().layers.linear.weight
    assert stages.shape == (num_stages * num_repeats, per_stage, FEATURES, FEATURES)
    for s in range(num_stages * num_repeats):
        np.testing.assert_array_equal(
            module.stage(s).layers.linear.weight,
            layers.linear.weight[s * per_stage : (s + 1) * per_stage],
        )


def test_to_layers_needs_scanned_stages():
    with pytest.raises(TypeError, match=r"stages are Block, not ScannedLayers.*serial_stages"):
        make_module("gpipe", 2, 1).to_layers()


def assert_exact(actual, expected):
    """Same structure, bitwise-equal arrays of the same dtype, equal other leaves."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        if eqx.is_array(e):
            assert a.dtype == e.dtype and a.shape == e.shape
            np.testing.assert_array_equal(a, e)
        else:
            assert a == e


def test_stack_and_unstack_layers_round_trip_exactly():
    from eqpar.nn import stack_layers, unstack_layers

    keys = jax.random.split(jax.random.key(0), 5)
    make = lambda k: eqx.nn.MLP(3, 3, 4, 2, activation=jax.nn.gelu, key=k)
    blocks = [make(k) for k in keys]
    stacked = stack_layers(blocks)
    assert stacked.layers[1].weight.shape == (5, 4, 4)
    # The same as building the stack with eqx.filter_vmap over the same keys.
    assert_exact(stacked, eqx.filter_vmap(make)(keys))
    back = unstack_layers(stacked)
    assert len(back) == 5
    for layer, original in zip(back, blocks):
        assert_exact(layer, original)
    assert_exact(stack_layers(back), stacked)
    one = jax.tree.map(lambda a: a[None] if eqx.is_array(a) else a, blocks[0])
    assert_exact(stack_layers(tuple(blocks[:1])), one)
    # A stacked list of layers feeds a pipeline like any scanned stack.
    module = PipelineModule.from_layers(stacked, num_stages=5, num_microbatches=1)
    assert module.stages.layers.layers[0].weight.shape == (5, 1, 4, 3)
    assert_exact(module.to_layers(), stacked)


def test_stack_layers_errors_name_the_layer_and_the_leaf():
    from eqpar.nn import stack_layers, unstack_layers

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    mlp = lambda key, **kw: eqx.nn.MLP(3, 3, 4, 1, key=key, **kw)
    with pytest.raises(
        ValueError,
        match=r"`layers\[2\]` differs from `layers\[0\]` at `activation`: it has .*gelu.* where "
        r"the first layer has .*relu",
    ):
        stack_layers([mlp(k1), mlp(k2), mlp(k3, activation=jax.nn.gelu)])
    with pytest.raises(
        ValueError,
        match=r"`layers\[1\]` differs from `layers\[0\]` at `layers/0/weight`: it has an array "
        r"float32\[4, 2\] where the first layer has an array float32\[4, 3\]",
    ):
        stack_layers([mlp(k1), eqx.nn.MLP(2, 3, 4, 1, key=k2)])
    with pytest.raises(ValueError, match=r"`layers\[1\]` differs .* at `eps`: it has 1e-06 where"):
        stack_layers([eqx.nn.LayerNorm(3, eps=1e-5), eqx.nn.LayerNorm(3, eps=1e-6)])
    with pytest.raises(ValueError, match=r"at `bias`: it has None where .* float32\[3\]"):
        stack_layers([eqx.nn.Linear(3, 3, key=k1), eqx.nn.Linear(3, 3, use_bias=False, key=k2)])
    with pytest.raises(ValueError, match=r"`layers\[1\]` differs .* as a whole: it has a Linear"):
        stack_layers([mlp(k1), eqx.nn.Linear(3, 3, key=k2)])
    with pytest.raises(ValueError, match=r"`layers` is empty"):
        stack_layers([])
    with pytest.raises(TypeError, match=r"layers"):  # beartype, or stack_layers itself
        stack_layers(mlp(k1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"same leading stacking axis"):
        unstack_layers({"a": jnp.ones((2, 3)), "b": jnp.ones((3,))})


def _in_pipe(fn, size=4, in_specs=None, out_specs=None):
    in_specs = P() if in_specs is None else in_specs
    out_specs = P() if out_specs is None else out_specs
    return jax.shard_map(fn, mesh=pipe_mesh(size), in_specs=in_specs, out_specs=out_specs)


# --------------------------------------------------------------------------------------
# Per-example extra arguments (Microbatched).


class MaskedBlock(eqx.Module):
    """A stage with a per-example boolean mask (positional) and float weight (keyword)."""

    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(FEATURES, FEATURES, key=key)

    def __call__(self, x, mask, *, weight, scale):
        y = weight[:, None] * jnp.tanh(jax.vmap(self.linear)(x))
        return x + scale * jnp.where(mask[:, None], y, 0.0)


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_microbatched_arguments_follow_their_rows(schedule):

    num_stages, num_microbatches = (2, 4) if schedule == "circular" else (4, 4)
    module = PipelineModule.from_stage_fn(
        MaskedBlock,
        num_stages=num_stages,
        num_repeats=2 if schedule == "circular" else 1,
        key=jax.random.key(7),
        num_microbatches=num_microbatches,
        broadcast_output=True,
    )
    x, t, _ = batch(num_microbatches)
    rows = x.shape[0]
    mask = jax.random.bernoulli(jax.random.key(8), 0.6, (rows,))
    weight = jax.random.uniform(jax.random.key(9), (rows,), minval=0.5, maxval=2.0)
    arrays, static, specs = layout(module)

    def serial_loss(arrays, x):
        y = eqx.combine(arrays, static).apply_serially(
            x, Microbatched(mask), weight=Microbatched(weight), scale=SCALE
        )
        return mse(y, t), y

    (loss_ref, y_ref), (grads_ref, x_grads_ref) = jax.value_and_grad(
        serial_loss, argnums=(0, 1), has_aux=True
    )(arrays, x)
    # The rows matter: the same call with the mask reversed gives another result.
    flipped = eqx.combine(arrays, static).apply_serially(
        x, Microbatched(mask[::-1]), weight=Microbatched(weight), scale=SCALE
    )
    assert not np.allclose(flipped, y_ref)

    def step(arrays, x, t, mask, weight):
        model = eqx.combine(arrays, static)
        extra = dict(weight=Microbatched(weight), scale=SCALE)
        if schedule == "1f1b":
            value, (grads, _, x_grads) = model.value_and_grad(
                mse, x, t, Microbatched(mask), schedule="1f1b", return_all_grads=True, **extra
            )
            return value, jnp.zeros_like(x), eqx.filter(grads, eqx.is_array), x_grads

        def loss(arrays, x):
            y = eqx.combine(arrays, static)(x, Microbatched(mask), **extra)
            return mse(y, t), y

        (value, y), (grads, x_grads) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            arrays, x
        )
        return value, y, grads, x_grads

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=pipe_mesh(num_stages),
            in_specs=(specs, P(), P(), P(), P()),
            out_specs=(P(), P(), specs, P()),
        )
    )
    loss, y, grads, x_grads = fn(arrays, x, t, mask, weight)
    if schedule != "1f1b":
        assert_tree_close(y, y_ref)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)
    assert_tree_close(x_grads, x_grads_ref)


def test_microbatched_argument_errors():

    stage = lambda h, m: h * m[:, None]
    run = lambda x, m: execute_pipeline(
        stage, x, Microbatched(m), num_microbatches=2, model_axis_name="pipe"
    )
    fn = _in_pipe(run, size=2, in_specs=(P(), P()))
    with pytest.raises(
        ValueError,
        match=r"`args\[0\]` \(a `Microbatched` argument\) has 3 rows but the batch `x` has 4",
    ):
        fn(jnp.ones((4, 3)), jnp.ones(3))
    fn = _in_pipe(
        lambda x, m: execute_1f1b(
            lambda h, *, m: h * m[:, None],
            mse,
            x,
            x,
            m=Microbatched(m),
            num_microbatches=2,
            model_axis_name="pipe",
        )[0],
        size=2,
        in_specs=(P(), P("pipe")),
    )
    with pytest.raises(ValueError, match=r"`kwargs\['m'\]` varies over the pipeline axis"):
        fn(jnp.ones((4, 3)), jnp.ones(8))
    step = lambda x, m: execute_pipeline_step(stage, x, x, Microbatched(m), model_axis_name="pipe")[
        1
    ]
    with pytest.raises(TypeError, match=r"execute_pipeline_step: a `Microbatched` argument"):
        _in_pipe(step, size=2, in_specs=(P(), P()))(jnp.ones((4, 3)), jnp.ones(4))
    module = make_module("gpipe", 2, 2)
    x, _, shift = batch(2)
    with pytest.raises(ValueError, match=r"apply_serially: `kwargs\['scale'\]` \(a `Micro"):
        module.apply_serially(x, shift, scale=Microbatched(jnp.ones(3)))


# --------------------------------------------------------------------------------------
# A PipelineModule as one field of a user's model, between an embedding and a head.

VOCAB, SEQ, WIDTH = 11, 3, 8
LEARNING_RATE = 0.5


class TokenLayer(eqx.Module):
    """A layer as Equinox's docs write one: an MLP applied per token, per example (vmap),
    here with a residual and a padding mask."""

    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 2 * WIDTH, 1, key=key)

    def __call__(self, h, mask):  # h [microbatch, seq, width], mask [microbatch, seq]
        def example(h_i, mask_i):
            return h_i + jnp.where(mask_i[:, None], jax.vmap(self.mlp)(h_i), 0.0)

        return jax.vmap(example)(h, mask)


def token_loss(logits, labels, mask):
    """Mean over every token of the masked cross-entropy (equal-sized shards average exactly)."""
    log_p = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jnp.where(mask, nll, 0.0))


class Net(eqx.Module):
    embed: eqx.nn.Embedding
    body: PipelineModule
    head: eqx.nn.Linear

    def __init__(self, key, *, num_stages, num_repeats, num_microbatches):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k1)
        self.body = PipelineModule.from_stage_fn(
            TokenLayer,
            num_stages=num_stages,
            num_repeats=num_repeats,
            key=k2,
            num_microbatches=num_microbatches,
            broadcast_output=True,  # every pipe device computes the head and the loss
        )
        self.head = eqx.nn.Linear(WIDTH, VOCAB, key=k3)

    def __call__(self, tokens, mask, *, serial=False):

        h = jax.vmap(jax.vmap(self.embed))(tokens)
        body = self.body.apply_serially if serial else self.body
        h = body(h, Microbatched(mask))
        return jax.vmap(jax.vmap(self.head))(h)


class HeadLoss(eqx.Module):
    """The 1F1B `loss_fn`: the output head and the loss of one microbatch."""

    head: eqx.nn.Linear

    def __call__(self, h, targets):
        labels, mask = targets
        return token_loss(jax.vmap(jax.vmap(self.head))(h), labels, mask)


def sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LEARNING_RATE * g, grads))


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_pipeline_inside_a_user_model_trains_like_the_serial_model(schedule):
    """Embedding -> PipelineModule (stages take a Microbatched mask) -> head, one SGD step on a
    ("data", "pipe") mesh, against the same model on one device.

    Gradient rule: the per-shard loss is averaged over `data` with `lax.pmean` before
    differentiating (GPipe, circular), so the gradients of parameters replicated over `data`
    are the global-mean gradients. 1F1B returns that same global loss and its gradients (the
    embedding's too, through `eqx.filter_vjp` of the input gradients): nothing is divided by
    hand.
    """
    from eqpar.layout import partition_specs
    from eqpar.spmd import shard_map

    num_stages, num_repeats = (2, 2) if schedule == "circular" else (4, 1)
    mesh = Mesh(np.array(jax.devices()[: 2 * num_stages]).reshape(2, num_stages), ("data", "pipe"))
    net = Net(jax.random.key(0), num_stages=num_stages, num_repeats=num_repeats, num_microbatches=2)
    rows = 8  # 4 per data shard, 2 microbatches of 2
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    tokens = jax.random.randint(k1, (rows, SEQ), 0, VOCAB)
    labels = jax.random.randint(k2, (rows, SEQ), 0, VOCAB)
    mask = jax.random.bernoulli(k3, 0.7, (rows, SEQ))

    def serial_loss(net):
        logits = net(tokens, mask, serial=True)
        return token_loss(logits, labels, mask), logits

    (loss_ref, logits_ref), grads_ref = eqx.filter_value_and_grad(serial_loss, has_aux=True)(net)
    updated_ref = sgd(net, grads_ref)

    specs = partition_specs(net)
    data = P("data")

    if schedule == "1f1b":

        def one_f_one_b_step(net, tokens, mask, labels):
            h, embed_pullback = eqx.filter_vjp(lambda e: jax.vmap(jax.vmap(e))(tokens), net.embed)
            loss, (body_grads, head_grads, h_grads) = net.body.value_and_grad(
                HeadLoss(net.head),
                h,
                (labels, mask),
                Microbatched(mask),
                schedule="1f1b",
                return_all_grads=True,
            )
            (embed_grads,) = embed_pullback(h_grads)
            grads = eqx.tree_at(
                lambda n: (n.embed, n.body, n.head),
                net,
                (embed_grads, body_grads, head_grads.head),
                is_leaf=lambda x: x is None,
            )
            grads = eqx.filter(grads, eqx.is_inexact_array)
            return loss, jnp.zeros(logits_shape(tokens)), grads, sgd(net, grads)

    else:

        def autodiff_step(net, tokens, mask, labels):
            def loss(net):
                logits = net(tokens, mask)
                return lax.pmean(token_loss(logits, labels, mask), "data"), logits

            (value, logits), grads = eqx.filter_value_and_grad(loss, has_aux=True)(net)
            return value, logits, grads, sgd(net, grads)

    fn = eqx.filter_jit(
        shard_map(
            one_f_one_b_step if schedule == "1f1b" else autodiff_step,
            mesh=mesh,
            in_specs=(specs, data, data, data),
            out_specs=(P(), data, specs, specs),
        )
    )
    loss, logits, grads, updated = fn(net, tokens, mask, labels)
    assert_tree_close(loss, loss_ref)
    if schedule != "1f1b":
        assert_tree_close(logits, logits_ref)
    assert_tree_close(eqx.filter(grads, eqx.is_array), eqx.filter(grads_ref, eqx.is_array))
    assert_tree_close(eqx.filter(updated, eqx.is_array), eqx.filter(updated_ref, eqx.is_array))
    assert updated.body.stages.mlp.layers[0].weight.shape == (
        net.body.stages.mlp.layers[0].weight.shape
    )


def logits_shape(tokens):
    return (*tokens.shape, VOCAB)
