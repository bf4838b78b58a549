"""Pipeline executors and PipelineModule: what they refuse, each with the argument, what came
and the fix (microbatch counts, batches, stages and stacks that do not fit, shapes and dtypes
a stage changes, schedules), and what they declare. Helpers come from `test_pipeline`."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_pipeline import (
    FEATURES,
    SCALE,
    Block,
    TPBlock,
    _in_pipe,
    _scanned_module,
    batch,
    layout,
    make_module,
    mse,
)

from eqpar.nn.pipeline import PipelineModule
from eqpar.pipeline import (
    Microbatched,
    execute_1f1b,
    execute_circular_pipeline,
    execute_pipeline,
)
from eqpar.schedule import CircularSchedule


def test_batch_not_divisible_by_microbatches():
    stage = lambda h: h * 2.0
    fn = _in_pipe(
        lambda x: execute_pipeline(
            stage, x, num_microbatches=4, model_axis_name="pipe", broadcast_output=True
        )
    )
    with pytest.raises(
        ValueError,
        match=r"batch of 6 rows in `x` does not divide into "
        r"num_microbatches=4",
    ):
        fn(jnp.ones((6, 3)))


# One device and one microbatch call the stage directly, outside the schedule loop: the
# same checks hold there.
@pytest.mark.parametrize(("size", "microbatches"), [(4, 2), (1, 1)])
def test_stage_that_changes_shape(size, microbatches):
    stage = lambda h: jnp.concatenate([h, h], axis=-1)
    fn = _in_pipe(
        lambda x: execute_pipeline(
            stage, x, num_microbatches=microbatches, model_axis_name="pipe",
            broadcast_output=True,
        ),
        size=size,
    )  # fmt: skip
    rows = 4 // microbatches
    with pytest.raises(
        ValueError,
        match=r"must return exactly the shape and dtype it takes.*"
        rf"float32\[{rows}, 3\].*float32\[{rows}, 6\].*outside the pipeline",
    ):
        fn(jnp.ones((4, 3)))


@pytest.mark.parametrize("size", [4, 1])
def test_microbatched_argument_must_be_replicated_over_the_pipeline_axis(size):
    stage = lambda h, scale: h * scale
    fn = _in_pipe(
        lambda x, scale: execute_pipeline(
            stage, x, Microbatched(scale), num_microbatches=1, model_axis_name="pipe"
        ),
        size=size,
        in_specs=(P(), P("pipe")),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match=r"varies over the pipeline axis 'pipe'"):
        fn(jnp.ones((4, 3)), jnp.ones((4 * size, 3)))


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b"])
def test_batch_must_be_replicated_over_the_pipeline_axis(schedule):
    stage = lambda h: h * 2.0

    def run(x):
        options: dict[str, Any] = dict(num_microbatches=1, model_axis_name="pipe")
        if schedule == "gpipe":
            return execute_pipeline(stage, x, **options)
        if schedule == "circular":
            return execute_circular_pipeline(jnp.ones((2, 1)), x, **options)
        return execute_1f1b(stage, mse, x, x, **options)[0]

    fn = _in_pipe(run, in_specs=P("pipe"), out_specs=P("pipe"))
    with pytest.raises(ValueError, match=r"`x` varies over the pipeline axis 'pipe'.*replicated"):
        fn(jnp.ones((8, 3)))


@pytest.mark.parametrize("size", [4, 1])
def test_stage_that_changes_dtype(size):
    stage = lambda h: h.astype(jnp.bfloat16)
    fn = _in_pipe(
        lambda x: execute_pipeline(
            stage, x, num_microbatches=1, model_axis_name="pipe", broadcast_output=True
        ),
        size=size,
    )
    with pytest.raises(ValueError, match=r"float32\[1, 3\].*bfloat16\[1, 3\]"):
        fn(jnp.ones((1, 3)))


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [(0, ValueError, "must be at least 1, got 0"), (True, TypeError, "must be an int, got bool")],
)
def test_microbatch_count_must_be_a_positive_int(bad, error, message):
    fn = _in_pipe(
        lambda x: execute_pipeline(
            lambda h: h, x, num_microbatches=bad, model_axis_name="pipe", broadcast_output=True
        )
    )
    with pytest.raises(error, match=f"`num_microbatches` {message}"):
        fn(jnp.ones((2, 3)))


def test_outside_shard_map():
    module = make_module("gpipe", 2, 2)
    x, _, shift = batch(2)
    with pytest.raises(
        ValueError,
        match=r"axis_name='pipe'` is not a mesh axis bound here.*inside `eqpar.shard_map`",
    ):
        module(x, shift, scale=SCALE)


def test_stage_count_differs_from_axis_size():
    module = make_module("gpipe", 2, 2)
    arrays, static, _ = layout(module)
    x, _, shift = batch(2)
    fn = _in_pipe(
        lambda a, x, s: eqx.combine(a, static)(x, s, scale=SCALE),
        size=4,
        in_specs=(P(), P(), P()),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match=r"num_stages=2 but the mesh axis 'pipe' has 4 devices"):
        fn(arrays, x, shift)


def test_stages_not_sharded_over_the_axis():
    module = make_module("gpipe", 4, 2)
    arrays, static, _ = layout(module)
    x, _, shift = batch(2)
    fn = _in_pipe(
        lambda a, x, s: eqx.combine(a, static)(x, s, scale=SCALE),
        in_specs=(P(), P(), P()),
        out_specs=P(),
    )
    with pytest.raises(
        ValueError,
        match=r"each device sees 4 stacked stages but should see "
        r"num_repeats=1.*sharded over 'pipe'",
    ):
        fn(arrays, x, shift)


def test_layers_not_divisible_into_stages():
    layers = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 6))
    with pytest.raises(
        ValueError,
        match=r"6 layers do not divide into num_stages \* num_repeats "
        r"= 4 \* 1 = 4",
    ):
        PipelineModule.from_layers(layers, num_stages=4, num_microbatches=2)


def test_stack_depth_must_match_stage_count():
    stages = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 3))
    with pytest.raises(
        ValueError,
        match=r"stacked 3 deep but num_stages \* num_repeats = "
        r"2 \* 2 = 4",
    ):
        PipelineModule(stages, num_stages=2, num_repeats=2, num_microbatches=1)
    ragged = {"a": jnp.ones((2, 3)), "b": jnp.ones((3,))}
    with pytest.raises(ValueError, match=r"same leading stacking axis.*'a': 2, 'b': 3"):
        PipelineModule(ragged, num_stages=2, num_microbatches=1)


def test_1f1b_rejects_circular_modules_and_bad_losses():
    module = make_module("circular", 2, 2)
    arrays, static, specs = layout(module)
    x, t, shift = batch(2)
    fn = _in_pipe(
        lambda a, x, t, s: eqx.combine(a, static).value_and_grad(
            mse, x, t, s, scale=SCALE, schedule="1f1b"
        )[0],
        size=2,
        in_specs=(specs, P(), P(), P()),
    )
    with pytest.raises(ValueError, match=r"'1f1b' runs 1 stage per device, but num_repeats=2"):
        fn(arrays, x, t, shift)

    stage = lambda h: h * 2.0
    per_row = lambda y, t: jnp.mean((y - t) ** 2, axis=-1)
    fn = _in_pipe(
        lambda x, t: execute_1f1b(stage, per_row, x, t, num_microbatches=2, model_axis_name="pipe")[
            0
        ],
        size=2,
        in_specs=(P(), P()),
    )
    with pytest.raises(ValueError, match=r"must return one scalar per microbatch.*float32\[2\]"):
        fn(x, t)
    fn = _in_pipe(
        lambda x, t: execute_1f1b(stage, mse, x, t, num_microbatches=2, model_axis_name="pipe")[0],
        size=2,
        in_specs=(P(), P()),
    )
    with pytest.raises(ValueError, match=r"`x` has 4 rows but `targets` has 2"):
        fn(x, t[:2])


def test_circular_stack_must_be_uniform():
    fn = _in_pipe(
        lambda x: execute_circular_pipeline(
            {"a": jnp.ones((2, 3)), "b": jnp.ones((3, 3))},
            x,
            num_microbatches=1,
            model_axis_name="pipe",
            broadcast_output=True,
        ),
        size=2,
    )
    with pytest.raises(
        ValueError, match=r"same leading stacking axis.*\"\['a'\]\": 2, \"\['b'\]\": 3"
    ):
        fn(jnp.ones((2, 3)))


def test_schedule_kind():
    module = make_module("circular", 2, 3)
    assert module.schedule().bubble_fraction == CircularSchedule(2, 3, 2).bubble_fraction
    training = module.schedule(include_backward=True)
    assert training.has_backward and training.num_steps == 2 * module.schedule().num_steps
    assert module.schedule("circular", include_backward=True).actions == training.actions
    names = r"\['1f1b', 'circular', 'dualpipe-v', 'gpipe', 'zb-h1', 'zb-v'\]"
    with pytest.raises(ValueError, match=rf"must be one of {names}, got 'zb'"):
        module.schedule("zb")
    with pytest.raises(ValueError, match="all-forward schedule is 'gpipe', not 'circular'"):
        make_module("gpipe", 2, 3).schedule("circular")
    # The kinds of earlier releases still work, with a DeprecationWarning.
    with pytest.warns(DeprecationWarning, match="'training' is deprecated"):
        assert module.schedule("training").actions == training.actions


def test_stage_order_round_trips():
    stages = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 6))
    module = PipelineModule(stages, num_stages=3, num_repeats=2, num_microbatches=1)
    # Stored [V, S, ...] in model order: element [r, d] is stage r * S + d, a plain reshape.
    stored = module.stages.linear.weight
    assert stored.shape == (2, 3, FEATURES, FEATURES)
    np.testing.assert_array_equal(stored, stages.linear.weight.reshape(stored.shape))
    np.testing.assert_array_equal(stored[1, 0], stages.linear.weight[3])
    np.testing.assert_array_equal(module.serial_stages().linear.weight, stages.linear.weight)
    np.testing.assert_array_equal(module.stage(4).linear.weight, stages.linear.weight[4])
    with pytest.raises(ValueError, match=r"`index` must be in \[0, 6\), got 6"):
        module.stage(6)


def test_partition_specs_prepend_the_pipeline_axis():
    module = _scanned_module("gpipe", remat=False)
    specs = module.__partition_specs__()
    assert specs == {
        "stages/layers/linear/weight": P("pipe", None),
        "stages/layers/linear/bias": P("pipe", None),
    }
    assert _scanned_module("circular", remat=False).__partition_specs__() == {
        "stages/layers/linear/weight": P(None, "pipe", None),
        "stages/layers/linear/bias": P(None, "pipe", None),
    }
    tp = PipelineModule.from_stage_fn(
        TPBlock, num_stages=2, key=jax.random.key(0), num_microbatches=1, axis_name="stage"
    )
    assert tp.__partition_specs__()["stages/up/weight"] == P("stage", "model", None)
    assert tp.__partition_specs__()["stages/down/bias"] == P("stage", "model")


def test_circular_stages_not_sharded_over_the_axis():
    module = make_module("circular", 2, 2)
    arrays, static, _ = layout(module)
    x, _, shift = batch(2)
    wrong = jax.tree.map(lambda _: P("pipe"), arrays)  # the V axis instead of the S axis
    fn = _in_pipe(
        lambda a, x, s: eqx.combine(a, static)(x, s, scale=SCALE),
        size=2,
        in_specs=(wrong, P(), P()),
        out_specs=P(),
    )
    with pytest.raises(
        ValueError,
        match=r"\[num_repeats, 1\] = \[2, 1\] block.*leading dimensions \[1, 2\].*"
        r"P\(None, 'pipe', \.\.\.\)",
    ):
        fn(arrays, x, shift)
