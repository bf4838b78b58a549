"""One executor for every schedule table: `execute_schedule` against the serial twin, the
zero-bubble (ZB-H1) table, and the per-device program compiled from a table."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from numerics import assert_tree_close

from eqpar.pipeline import Microbatched, _program, execute_schedule
from eqpar.schedule import (
    Action,
    CircularSchedule,
    CustomSchedule,
    DualPipeVSchedule,
    GPipeSchedule,
    OneFOneBSchedule,
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
)

FEATURES = 4
ROWS = 2  # per microbatch


class Stage(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, h, keep):
        return h + jnp.tanh(jax.vmap(self.linear)(h)) * keep[:, None]


class Head(eqx.Module):
    weight: jax.Array

    def __call__(self, h, t):
        return jnp.mean((h @ self.weight - t) ** 2)


# --------------------------------------------------------------------------------------
# The ZB-H1 table.


@pytest.mark.parametrize(("s", "m"), list(itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 16))))
def test_zero_bubble_h1_table(s, m):
    schedule = ZeroBubbleH1Schedule(s, m)
    when = {}
    for step, row in enumerate(schedule.actions):
        for device, a in enumerate(row):
            if a.kind != "idle":
                assert a.stage == device
                key = (a.kind, a.microbatch, a.stage)
                assert key not in when
                when[key] = step
    assert len(when) == 3 * s * m  # every microbatch and stage: F, B (input), W
    for mb, d in itertools.product(range(m), range(s)):
        f, b, w = (when[(k, mb, d)] for k in ("forward", "backward_input", "backward_weight"))
        assert f < b < w
        if d > 0:
            assert f > when[("forward", mb, d - 1)]
        if d < s - 1:
            assert b > when[("backward_input", mb, d + 1)]
    for d in range(s):  # at most S - d between F and B, at most S waiting for their W
        steps = range(schedule.num_steps)
        before_b = max(
            sum(when[("forward", mb, d)] <= t < when[("backward_input", mb, d)] for mb in range(m))
            for t in steps
        )
        before_w = max(
            sum(
                when[("backward_input", mb, d)] <= t < when[("backward_weight", mb, d)]
                for mb in range(m)
            )
            for t in steps
        )
        assert before_b <= s - d and before_w <= s
    if m >= s:
        assert schedule.num_steps == 3 * m + s - 1
    if s > 1:
        assert schedule.bubble_fraction < OneFOneBSchedule(s, m).bubble_fraction
    assert {a.label()[0] for row in schedule.actions for a in row} <= {"F", "B", "W", "."}


def test_zero_bubble_chart_has_a_weight_gradient_legend():
    fig = ZeroBubbleH1Schedule(2, 3).figure()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["forward", "backward (input gradient)", "weight gradient", "idle (bubble)"]


# --------------------------------------------------------------------------------------
# The V-shaped tables (ZB-V, DualPipeV).


def _check_v_placement(schedule):
    s = schedule.num_devices
    for row in schedule.actions:
        for device, a in enumerate(row):
            if a.kind != "idle":
                assert device == (a.stage if a.stage < s else 2 * s - 1 - a.stage)
    for d in range(s):
        assert schedule.stages_on(d) == (d, 2 * s - 1 - d)


@pytest.mark.parametrize(("s", "m"), list(itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 16))))
def test_zero_bubble_v_table(s, m):
    """Every (microbatch, stage) once as F, B and W, in order, on its V device; at most 2S
    stage inputs held (1F1B's activation memory, in stages half as long); with M >= 2S the
    table is 6M + S - 1 steps long, so its bubble is (S - 1) / (6M + S - 1)."""
    schedule = ZeroBubbleVSchedule(s, m)
    schedule.check()
    _check_v_placement(schedule)
    kinds = [a.kind for row in schedule.actions for a in row if a.kind != "idle"]
    assert len(kinds) == 3 * 2 * s * m and set(kinds) <= {
        "forward", "backward_input", "backward_weight"
    }  # fmt: skip
    assert schedule.max_stored_inputs() <= 2 * s
    if m >= 2 * s:
        assert schedule.max_stored_inputs() == 2 * s
        assert schedule.num_steps == 6 * m + s - 1
        assert schedule.bubble_fraction == pytest.approx((s - 1) / (6 * m + s - 1))
        if s > 1:  # in steps half as long as ZB-H1's, for the same model
            assert schedule.bubble_fraction < ZeroBubbleH1Schedule(s, m).bubble_fraction


@pytest.mark.parametrize(("s", "m"), [(1, 2), (2, 4), (2, 7), (4, 8), (4, 12), (8, 16)])
def test_dualpipe_v_table(s, m):
    """DualPipeV's published order, each action at the first step its inputs are there:
    complete and in order, on the V devices, holding 2S + 1 stage inputs at most; fewer
    than 2S microbatches are refused."""
    schedule = DualPipeVSchedule(s, m)
    schedule.check()
    _check_v_placement(schedule)
    assert schedule.max_stored_inputs() == 2 * s + 1
    kinds = {a.kind for row in schedule.actions for a in row}
    assert {"forward", "backward", "backward_input", "backward_weight"} <= kinds | {"backward"}
    with pytest.raises(ValueError, match=f"at least 2 \\* num_stages = {2 * s} microbatches"):
        DualPipeVSchedule(s, 2 * s - 1)


def test_v_placement_in_custom_tables_and_charts():
    """A table of one's own can be V-shaped (`placement="v"`); a V action on a ring device
    is refused, naming the device it belongs on; the chart labels each device's two
    stages."""
    schedule = ZeroBubbleVSchedule(2, 4)
    custom = CustomSchedule(schedule.actions, num_microbatches=4, placement="v")
    assert custom.actions == schedule.actions and custom.device_of(3) == 0
    with pytest.raises(ValueError, match=r"device \(0 with the 'ring' placement\)\. For a V"):
        CustomSchedule(schedule.actions, num_microbatches=4)
    one_trip = ZeroBubbleH1Schedule(2, 4).actions  # stages 0..S-1 only: not a V
    with pytest.raises(ValueError, match=r"placement='v'\) runs 2 x 2 stages.*this one runs 2"):
        CustomSchedule(one_trip, num_microbatches=4, placement="v")
    beyond = [[Action("forward", microbatch=0, stage=4), Action("idle")]]
    with pytest.raises(ValueError, match="a stage a V-shaped table does not have"):
        CustomSchedule(beyond, num_microbatches=1, placement="v")
    with pytest.raises(ValueError, match="`placement` must be 'ring'"):  # without beartype
        unchecked = getattr(CustomSchedule.__init__, "__wrapped__", CustomSchedule.__init__)
        table = schedule.actions
        unchecked(object.__new__(CustomSchedule), table, num_microbatches=4, placement="w")
    rows = [label.get_text() for label in schedule.figure().axes[0].get_yticklabels()]
    assert rows == ["device 0 (stages 0, 3)", "device 1 (stages 1, 2)"]
    assert "ZB-V schedule, training step: 2 devices x 2 stages" in schedule.default_title()


@pytest.mark.parametrize("schedule", [ZeroBubbleVSchedule(4, 8), DualPipeVSchedule(4, 8)])
def test_v_program_sends_each_boundary_once_each_way(schedule):
    """Down the devices in the main lane, back up in the other, and the turn at the last
    device without a collective: every microbatch crosses each of the 2S - 1 stage
    boundaries once each way, and the loss is on device 0."""
    s, m = schedule.num_devices, schedule.num_microbatches
    program = _program.compile_schedule(schedule, store_residuals=True)
    assert program.loss_device == 0
    down = _sends(program, program.forward_pairs, program.forward_sends)
    up_back = _sends(program, program.backward_pairs, program.backward_sends)
    assert down == up_back == m * (s - 1)
    assert set().union(*program.forward_pairs) == {(d, d + 1) for d in range(s - 1)}
    lanes = {(lane.forward, lane.local): lane for lane in program.other_lanes}
    assert set(lanes) == {(True, False), (False, False), (True, True), (False, True)}
    for (forward, local), lane in lanes.items():
        pairs = {(d, d) for d in [s - 1]} if local else (
            {(d + 1, d) for d in range(s - 1)} if forward else {(d, d + 1) for d in range(s - 1)}
        )  # fmt: skip
        assert set().union(*lane.pairs) == pairs
        assert _sends(program, lane.pairs, lane.sends) == m * len(pairs)


# --------------------------------------------------------------------------------------
# The compiled program.


def _sends(program, pairs_of, index_of):
    return sum(len(pairs_of[i]) for i in index_of)


@pytest.mark.parametrize(("s", "m"), [(2, 3), (4, 4), (4, 8)])
def test_program_sends_only_what_the_table_needs(s, m):
    """Every microbatch crosses each of the S - 1 stage boundaries once each way; nothing
    moves in idle steps or round the ring's wrap (GPipe and 1F1B have none)."""
    forward = _program.compile_schedule(GPipeSchedule(s, m), store_residuals=False)
    assert _sends(forward, forward.forward_pairs, forward.forward_sends) == m * (s - 1)
    for schedule in (OneFOneBSchedule(s, m), ZeroBubbleH1Schedule(s, m)):
        program = _program.compile_schedule(schedule, store_residuals=True)
        assert _sends(program, program.forward_pairs, program.forward_sends) == m * (s - 1)
        assert _sends(program, program.backward_pairs, program.backward_sends) == m * (s - 1)
        assert set().union(*program.forward_pairs) == {(d, d + 1) for d in range(s - 1)}
        assert set().union(*program.backward_pairs) == {(d + 1, d) for d in range(s - 1)}
    circular = _program.compile_schedule(CircularSchedule(s, m, 2), store_residuals=False)
    assert _sends(circular, circular.forward_pairs, circular.forward_sends) == m * (2 * s - 1)


@pytest.mark.parametrize("m", [4, 8, 16])
def test_program_buffers_hold_what_the_table_keeps_alive(m):
    s = 4
    one_f_one_b = _program.compile_schedule(OneFOneBSchedule(s, m), store_residuals=True)
    assert one_f_one_b.num_residual_slots == s  # flat in M
    assert one_f_one_b.num_input_slots <= s
    gpipe = _program.compile_schedule(
        GPipeSchedule(s, m, include_backward=True), store_residuals=True
    )
    assert gpipe.num_residual_slots == m
    forward = _program.compile_schedule(CircularSchedule(s, m, 2), store_residuals=False)
    assert forward.num_input_slots == max(m, s) - s + 1  # a finished trip waiting for device 0
    zero_bubble = _program.compile_schedule(ZeroBubbleH1Schedule(s, m), store_residuals=True)
    assert zero_bubble.num_residual_slots == ZeroBubbleH1Schedule(s, m).max_stored_inputs()


# --------------------------------------------------------------------------------------
# execute_schedule against the serial twin.


def _model(num_model_stages, key=0):
    keys = jax.random.split(jax.random.key(key), num_model_stages + 1)
    stages = eqx.filter_vmap(lambda k: Stage(eqx.nn.Linear(FEATURES, FEATURES, key=k)))(keys[1:])
    head = Head(jax.random.normal(keys[0], (FEATURES, FEATURES)) / 2)
    return stages, head


def _batch(m, key=1):
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    x = jax.random.normal(k1, (m * ROWS, FEATURES))
    t = jax.random.normal(k2, (m * ROWS, FEATURES))
    keep = jax.random.bernoulli(k3, 0.7, (m * ROWS,)).astype(jnp.float32)
    return x, t, keep


def _serial(stages, head, x, t, keep, num_model_stages):
    params, static = eqx.partition(stages, eqx.is_array)
    h = x
    for i in range(num_model_stages):
        h = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)(h, keep)
    return head(h, t)


def _run(schedule, stages, head, x, t, keep, *, recompute):
    s, v = schedule.num_devices, schedule._num_trips()
    # model order [V * S, ...] -> [V, S, ...]: device d holds stages d, d + S, ...
    params, static = eqx.partition(stages, eqx.is_array)
    params = jax.tree.map(lambda a: a.reshape(v, s, *a.shape[1:]), params)

    def step(params, head, x, t, keep):
        local = jax.tree.map(lambda a: a[:, 0], params)
        if v == 1:
            local = jax.tree.map(lambda a: a[0], local)
        loss, (grads, head_grads, x_grads) = execute_schedule(
            schedule,
            eqx.combine(local, static),
            head,
            x,
            t,
            Microbatched(keep),
            model_axis_name="pipe",
            return_all_grads=True,
            recompute=recompute,
        )
        grads = eqx.filter(grads, eqx.is_array)
        grads = jax.tree.map(lambda g: (g if v > 1 else g[None])[:, None], grads)
        return loss, grads, head_grads, x_grads

    mesh = Mesh(np.array(jax.devices()[:s]), ("pipe",))
    specs = dict(
        in_specs=(P(None, "pipe"), P(), P(), P(), P()),
        out_specs=(P(), P(None, "pipe"), P(), P()),
    )
    loss, grads, head_grads, x_grads = jax.jit(jax.shard_map(step, mesh=mesh, **specs))(
        params, head, x, t, keep
    )
    grads = jax.tree.map(lambda g: g.reshape(v * s, *g.shape[2:]), grads)
    return loss, grads, head_grads, x_grads


CASES = [
    ("zb-h1 S=2", ZeroBubbleH1Schedule(2, 3), False),
    ("zb-h1 S=4", ZeroBubbleH1Schedule(4, 4), False),
    ("zb-h1 S=8", ZeroBubbleH1Schedule(8, 8), False),
    ("zb-h1 recompute", ZeroBubbleH1Schedule(4, 4), True),
    ("gpipe", GPipeSchedule(4, 4, include_backward=True), False),
    ("circular", CircularSchedule(2, 3, 2, include_backward=True), False),
    ("circular recompute", CircularSchedule(2, 4, 2, include_backward=True), True),
    ("1f1b", OneFOneBSchedule(4, 6), False),
    ("zb-v S=2", ZeroBubbleVSchedule(2, 4), False),
    ("zb-v S=4", ZeroBubbleVSchedule(4, 8), False),
    ("zb-v S=8", ZeroBubbleVSchedule(8, 16), False),
    ("zb-v S=4 recompute", ZeroBubbleVSchedule(4, 3), True),
    ("zb-v S=1", ZeroBubbleVSchedule(1, 2), False),
    ("dualpipe-v S=4", DualPipeVSchedule(4, 8), False),
    ("dualpipe-v S=2 recompute", DualPipeVSchedule(2, 5), True),
]


@pytest.mark.parametrize(("name", "schedule", "recompute"), CASES, ids=[c[0] for c in CASES])
def test_execute_schedule_matches_serial_twin(name, schedule, recompute):
    del name
    num_model_stages = schedule.num_devices * schedule._num_trips()
    stages, head = _model(num_model_stages)
    x, t, keep = _batch(schedule.num_microbatches)

    def serial(stages, head, x):
        return _serial(stages, head, x, t, keep, num_model_stages)

    loss_ref, (grads_ref, head_ref, x_ref) = jax.value_and_grad(serial, argnums=(0, 1, 2))(
        stages, head, x
    )
    loss, grads, head_grads, x_grads = _run(schedule, stages, head, x, t, keep, recompute=recompute)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, eqx.filter(grads_ref, eqx.is_array))
    assert_tree_close(head_grads, head_ref)
    assert_tree_close(x_grads, x_ref)


def test_execute_schedule_sgd_update_matches_serial():
    """One plain-SGD step through ZB-H1 lands where the serial model's step lands."""
    schedule = ZeroBubbleH1Schedule(4, 4)
    stages, head = _model(4, key=5)
    x, t, keep = _batch(4, key=6)
    _, grads_ref = jax.value_and_grad(lambda st: _serial(st, head, x, t, keep, 4))(stages)
    _, grads, _, _ = _run(schedule, stages, head, x, t, keep, recompute=False)
    params = eqx.filter(stages, eqx.is_array)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, eqx.filter(grads_ref, eqx.is_array))
    assert_tree_close(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), expected)


def test_execute_schedule_errors():
    stages, head = _model(2)
    stage = eqx.combine(jax.tree.map(lambda a: a[0], eqx.filter(stages, eqx.is_array)), stages)
    x, t, keep = _batch(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))

    def call(schedule):
        def run(x, t):
            return execute_schedule(schedule, stage, head, x, t, keep, model_axis_name="pipe")[0]

        jax.shard_map(run, mesh=mesh, in_specs=(P(), P()), out_specs=P())(x, t)

    with pytest.raises(TypeError, match="must be a training schedule"):
        call(GPipeSchedule(2, 2))
    with pytest.raises(ValueError, match="is for 4 devices but the pipeline axis 'pipe' has 2"):
        call(OneFOneBSchedule(4, 2))
    with pytest.raises(ValueError, match="stack that many"):
        call(CircularSchedule(2, 2, 2, include_backward=True))


# --------------------------------------------------------------------------------------
# PipelineModule.value_and_grad.


@pytest.mark.parametrize(
    ("schedule", "num_repeats", "remat"),
    [
        ("zb-h1", 1, "none"),
        ("gpipe", 2, "none"),
        ("gpipe", 1, "full"),
        ("1f1b", 1, "matmuls"),
        ("zb-v", 2, "none"),
        ("dualpipe-v", 2, "full"),
    ],
)
def test_pipeline_module_value_and_grad(schedule, num_repeats, remat):
    from eqpar.nn import PipelineModule

    s, m = 2, 4
    stages, head = _model(s * num_repeats, key=7)
    x, t, keep = _batch(m, key=8)
    module = PipelineModule(
        stages, num_stages=s, num_microbatches=m, num_repeats=num_repeats, remat=remat
    )
    arrays, static = eqx.partition(module, eqx.is_array)
    specs = jax.tree.map(lambda _: P("pipe") if num_repeats == 1 else P(None, "pipe"), arrays)

    def step(arrays, x, t, keep):
        model = eqx.combine(arrays, static)
        loss, grads = model.value_and_grad(head, x, t, Microbatched(keep), schedule=schedule)
        return loss, eqx.filter(grads, eqx.is_array)

    mesh = Mesh(np.array(jax.devices()[:s]), ("pipe",))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=(P(), specs))
    loss, grads = jax.jit(fn)(arrays, x, t, keep)

    def serial(arrays):
        return head(eqx.combine(arrays, static).apply_serially(x, Microbatched(keep)), t)

    loss_ref, grads_ref = jax.value_and_grad(serial)(arrays)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)
    assert module.schedule("zb-h1").bubble_fraction < module.schedule("1f1b").bubble_fraction
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        jax.jit(jax.shard_map(
            lambda a, x, t: eqx.combine(a, static).value_and_grad(head, x, t, schedule="zb")[0],
            mesh=mesh, in_specs=(specs, P(), P()), out_specs=P(),
        ))(arrays, x, t)  # fmt: skip


def test_zero_bubble_branches_compute_only_their_half():
    """B keeps the input gradient and W the weight gradients of the same pullback: the
    compiler drops the rest. A stage of two linear layers: 1F1B's backward is 4 matmuls; ZB's
    B is 2 and W 3 (the cotangent goes back through the second layer again for the first's
    weight gradient); forwards 2 each, for the last stage as for the others."""

    class TwoLayers(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __call__(self, h):
            return h + jax.vmap(self.down)(jnp.tanh(jax.vmap(self.up)(h)))

    keys = jax.random.split(jax.random.key(0), 8)
    make = lambda k1, k2: TwoLayers(eqx.nn.Linear(8, 8, key=k1), eqx.nn.Linear(8, 8, key=k2))
    stages = eqx.filter_vmap(make)(keys[:4], keys[4:])
    params, static = eqx.partition(stages, eqx.is_array)
    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    x, t = jnp.ones((16, 8)), jnp.zeros((16, 8))
    dots = {}
    for schedule in (OneFOneBSchedule(4, 8), ZeroBubbleH1Schedule(4, 8)):

        def step(params, x, t, schedule=schedule):
            stage = eqx.combine(jax.tree.map(lambda a: a[0], params), static)
            loss_fn = lambda y, t: jnp.mean((y - t) ** 2)
            loss, grads = execute_schedule(schedule, stage, loss_fn, x, t, model_axis_name="pipe")
            return loss, jax.tree.map(lambda g: g[None], grads)

        specs = dict(in_specs=(P("pipe"), P(), P()), out_specs=(P(), P("pipe")))
        fn = jax.jit(jax.shard_map(step, mesh=mesh, **specs))
        dots[type(schedule).__name__] = fn.lower(params, x, t).compile().as_text().count(" dot(")
    # forward, last forward, backward, last backward
    assert dots["OneFOneBSchedule"] == 2 + 2 + 4 + 4
    # forward, last forward, input gradient, last input gradient, weight gradient
    assert dots["ZeroBubbleH1Schedule"] == 2 + 2 + 2 + 2 + 3


class RingStage(eqx.Module):
    """A stage with a ring collective over another mesh axis (features split over `ctx`)."""

    w: jax.Array

    def __call__(self, h):
        other = jax.lax.ppermute(h, "ctx", [(0, 1), (1, 0)])
        return jnp.tanh(h * self.w + 0.5 * other)


def test_ring_collectives_inside_stages():
    """A forward run computes every stage on every device, so a `ppermute` over another axis
    inside a stage is right; a training schedule runs stages in per-device branches, where
    it would not be, and refuses such a stage."""
    from eqpar.pipeline import execute_1f1b, execute_pipeline

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "ctx"))
    ws = jnp.array([1.5, -0.7])
    x = jax.random.normal(jax.random.key(0), (4, 6))

    def serial(ws):
        h = x
        for i in range(2):
            h = jnp.tanh(h * ws[i] + 0.5 * jnp.concatenate([h[:, 3:], h[:, :3]], 1))
        return h

    def forward(ws, x):
        return execute_pipeline(
            RingStage(ws[0]), x, num_microbatches=2, model_axis_name="pipe", broadcast_output=True
        )

    specs = dict(in_specs=(P("pipe"), P(None, "ctx")), out_specs=P(None, "ctx"))
    run = jax.jit(jax.shard_map(forward, mesh=mesh, **specs))
    assert_tree_close(run(ws, x), serial(ws))
    grads = jax.grad(lambda ws: jnp.sum(run(ws, x) ** 2))(ws)
    assert_tree_close(grads, jax.grad(lambda ws: jnp.sum(serial(ws) ** 2))(ws))

    def train(ws, x):
        loss_fn = lambda y, t: jnp.mean((y - t) ** 2)
        return execute_1f1b(
            RingStage(ws[0]), loss_fn, x, x, num_microbatches=2, model_axis_name="pipe"
        )[0]

    with pytest.raises(ValueError, match=r"the stage uses `lax\.ppermute`"):
        jax.shard_map(train, mesh=mesh, in_specs=(P("pipe"), P(None, "ctx")), out_specs=P())(ws, x)


def _cells(schedule, kind):
    return [
        (t, d, a) for t, row in enumerate(schedule.actions) for d, a in enumerate(row)
        if a.kind == kind
    ]  # fmt: skip


def _with_cell(schedule, step, device, action):
    rows = [list(row) for row in schedule.actions]
    rows[step][device] = action
    schedule._table = tuple(tuple(row) for row in rows)
    return schedule


def test_a_table_out_of_order_is_refused():
    """A table whose actions come before what they use would run on values not there yet."""
    from eqpar.schedule import Action

    swapped = GPipeSchedule(2, 2)  # stage 1 runs microbatch 0 before stage 0 has
    rows = [list(row) for row in swapped.actions]
    rows[0][1], rows[1][1] = rows[1][1], Action("idle")
    swapped._table = tuple(tuple(row) for row in rows)
    with pytest.raises(ValueError, match="does not come after the previous stage's"):
        _program.compile_schedule(swapped, store_residuals=False)
    missing = _with_cell(GPipeSchedule(2, 2), 0, 0, Action("idle"))
    with pytest.raises(ValueError, match="microbatch 0, stage 0: no forward"):
        _program.compile_schedule(missing, store_residuals=False)
    elsewhere = _with_cell(GPipeSchedule(2, 2), 0, 1, Action("forward", microbatch=1, stage=0))
    with pytest.raises(ValueError, match="not on its stage's device"):
        _program.compile_schedule(elsewhere, store_residuals=False)
    zero_bubble = ZeroBubbleH1Schedule(2, 2)
    t, d, w = _cells(zero_bubble, "backward_weight")[0]
    early = _with_cell(_with_cell(zero_bubble, t, d, Action("idle")), 0, d, w)
    with pytest.raises(ValueError, match="its backward_weight comes before its backward_input"):
        _program.compile_schedule(early, store_residuals=True)


def test_a_table_missing_or_repeating_a_gradient_is_refused():
    """Each of these tables ran before and gave wrong gradients or a wrong loss."""
    from eqpar.schedule import Action

    # A weight-gradient action replaced by idle: that microbatch's weight gradient was lost.
    t, d, _ = _cells(ZeroBubbleH1Schedule(2, 2), "backward_weight")[-1]
    no_weight = _with_cell(ZeroBubbleH1Schedule(2, 2), t, d, Action("idle"))
    with pytest.raises(ValueError, match="backward_input but no backward_weight"):
        _program.compile_schedule(no_weight, store_residuals=True)
    # A full backward plus a weight-gradient action: the weight gradient counted twice.
    one_f_one_b = OneFOneBSchedule(2, 2)
    t, d, b = _cells(one_f_one_b, "backward")[-1]
    rows = [list(row) for row in one_f_one_b.actions] + [[Action("idle")] * 2]
    rows[-1][d] = Action("backward_weight", microbatch=b.microbatch, stage=b.stage)
    one_f_one_b._table = tuple(tuple(row) for row in rows)
    with pytest.raises(ValueError, match="as well as a full backward"):
        _program.compile_schedule(one_f_one_b, store_residuals=True)
    # A 1F1B table built for 3 microbatches declared as 2: microbatch 2 ran microbatch 1 again.
    three_as_two = OneFOneBSchedule(2, 2)
    three_as_two._table = OneFOneBSchedule(2, 3).actions
    with pytest.raises(ValueError, match="declares num_microbatches=2"):
        _program.compile_schedule(three_as_two, store_residuals=True)
    # A table with fewer microbatches than declared.
    two_as_three = OneFOneBSchedule(2, 3)
    two_as_three._table = OneFOneBSchedule(2, 2).actions
    with pytest.raises(ValueError, match="microbatch 2, stage 0: no forward; no backward"):
        _program.compile_schedule(two_as_three, store_residuals=True)


def test_a_malformed_action_is_refused_where_it_is_made():
    import inspect

    from eqpar.schedule import Action

    def unchecked(*args, **kwargs):  # as a user without the suite's beartype hook calls it
        action = object.__new__(Action)
        inspect.unwrap(Action.__init__)(action, *args, **kwargs)
        return action

    with pytest.raises(ValueError, match="`kind` must be one of 'forward', "):
        unchecked("Forward", microbatch=0, stage=0)
    with pytest.raises(ValueError, match="needs a `stage`"):
        Action("forward", microbatch=0)
    with pytest.raises(ValueError, match="an idle action has no microbatch"):
        Action("idle", microbatch=0, stage=0)
    with pytest.raises(ValueError, match="`microbatch` must be at least 0, got -1"):
        Action("backward", microbatch=-1, stage=0)
    with pytest.raises(TypeError, match="`stage` must be an int, got float"):
        unchecked("backward", microbatch=0, stage=1.0)
    short = GPipeSchedule(2, 2)
    short._table = tuple(row[:1] for row in short.actions)
    with pytest.raises(ValueError, match="step 0 of the table has 1 actions, but the sched"):
        _program.compile_schedule(short, store_residuals=False)
    not_actions = GPipeSchedule(2, 2)
    not_actions._table = tuple(tuple(("forward", 0, d) for d in range(2)) for _ in range(3))
    with pytest.raises(TypeError, match="Action"):  # the suite's beartype hook, else ours
        _program.compile_schedule(not_actions, store_residuals=False)


# --------------------------------------------------------------------------------------
# A loss function split over the pipeline axis (a vocabulary-parallel head).

VOCAB = 16


class VocabHead(eqx.Module):
    """An optional replicated LayerNorm, the unembedding and the mean cross entropy; with a
    `ColumnParallelLinear` unembedding the vocabulary is split and so is the loss."""

    norm: eqx.nn.LayerNorm | None
    unembed: eqx.nn.Linear

    def __call__(self, h, t):
        from eqpar.nn import ColumnParallelLinear, vocab_parallel_cross_entropy

        if self.norm is not None:
            h = jax.vmap(self.norm)(h)
        logits = jax.vmap(self.unembed)(h)
        if isinstance(self.unembed, ColumnParallelLinear):
            axis = self.unembed.axis_name
            return jnp.mean(vocab_parallel_cross_entropy(logits, t, axis_name=axis))
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, t[:, None], axis=-1))


def _vocab_model(num_stages, *, norm, key=0):
    stages, _ = _model(num_stages, key=key)
    k1, k2, k3 = jax.random.split(jax.random.key(key + 100), 3)
    layer_norm = None
    if norm:  # not the identity, so that its gradient is not the default's
        layer_norm = eqx.nn.LayerNorm(FEATURES)
        layer_norm = eqx.tree_at(
            lambda n: (n.weight, n.bias),
            layer_norm,
            (1 + jax.random.normal(k1, (FEATURES,)) / 4, jax.random.normal(k2, (FEATURES,)) / 4),
        )
    head = VocabHead(layer_norm, eqx.nn.Linear(FEATURES, VOCAB, key=k3))
    return stages, head


def _vocab_batch(m, key=1):
    x, _, keep = _batch(m, key=key)
    t = jax.random.randint(jax.random.key(key + 100), (m * ROWS,), 0, VOCAB)
    return x, t, keep


def _run_vocab(schedule, stages, head, x, t, keep, *, axis, model, recompute):
    """Train through `schedule` on a `pipe` (x `model`) mesh with the head's unembedding
    split over `axis`. Every device's copy of the head's gradient comes back, stacked in the
    order of the mesh's devices (pipe major)."""
    import eqpar

    s, v = schedule.num_devices, schedule._num_trips()
    parallel = eqpar.parallelize(head, {"unembed": eqpar.ColumnParallel(axis)})
    head_specs = eqpar.partition_specs(parallel)
    params, static = eqx.partition(stages, eqx.is_array)
    # model order [V * S, ...] -> [V, S, ...] (device d holds stages d, S + d, ...)
    params = jax.tree.map(lambda a: a.reshape(v, s, *a.shape[1:]), params)
    head_params, head_static = eqx.partition(parallel, eqx.is_array)
    names = ("pipe", "model") if model > 1 else ("pipe",)
    every_device = P(names)

    def step(params, head_params, x, t, keep):
        local = jax.tree.map(lambda a: a[:, 0] if v > 1 else a[0, 0], params)
        loss, (grads, head_grads, x_grads) = execute_schedule(
            schedule,
            eqx.combine(local, static),
            eqx.combine(head_params, head_static),
            x,
            t,
            Microbatched(keep),
            model_axis_name="pipe",
            return_all_grads=True,
            recompute=recompute,
        )
        grads = eqx.filter(grads, eqx.is_array)
        grads = jax.tree.map(lambda g: (g if v > 1 else g[None])[:, None], grads)
        head_grads = jax.tree.map(lambda g: g[None], eqx.filter(head_grads, eqx.is_array))
        return loss, grads, head_grads, x_grads

    shape = (s, model) if model > 1 else (s,)
    mesh = Mesh(np.array(jax.devices()[: s * model]).reshape(shape), names)
    fn = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(None, "pipe"), head_specs, P(), P(), P()),
        out_specs=(P(), P(None, "pipe"), every_device, P()),
    )
    loss, grads, head_grads, x_grads = jax.jit(fn)(params, head_params, x, t, keep)
    grads = jax.tree.map(lambda g: g.reshape(v * s, *g.shape[2:]), grads)
    return loss, grads, head_grads, x_grads


def _block(axis, pipe, model, s):
    """The vocabulary block that the device at (pipe, model) holds."""
    return model * s + pipe if isinstance(axis, tuple) else pipe


def _check_head_grads(head_grads, head_ref, *, axis, s, model):
    n = s * model if isinstance(axis, tuple) else s
    block = VOCAB // n
    for pipe, m in itertools.product(range(s), range(model)):
        got = jax.tree.map(lambda g, i=pipe * model + m: g[i], head_grads)
        b = _block(axis, pipe, m, s)
        rows = slice(b * block, (b + 1) * block)
        assert_tree_close(got.unembed.weight, head_ref.unembed.weight[rows])
        assert_tree_close(got.unembed.bias, head_ref.unembed.bias[rows])
        if head_ref.norm is not None:  # replicated: whole and right on every device
            assert_tree_close(
                (got.norm.weight, got.norm.bias), (head_ref.norm.weight, head_ref.norm.bias)
            )


MP = ("model", "pipe")
VOCAB_CASES = [  # schedule, axis of the head, size of `model`, a LayerNorm first, recompute
    pytest.param(OneFOneBSchedule(4, 4), "pipe", 1, False, False, id="1f1b pipe"),
    pytest.param(ZeroBubbleH1Schedule(2, 3), MP, 2, True, False, id="zb-h1 model-pipe norm"),
    pytest.param(
        GPipeSchedule(4, 4, include_backward=True), MP, 2, True, False, id="gpipe model-pipe norm"
    ),
    pytest.param(OneFOneBSchedule(2, 3), MP, 2, True, True, id="1f1b model-pipe recompute"),
    pytest.param(ZeroBubbleH1Schedule(2, 3), MP, 2, False, True, id="zb-h1 model-pipe recompute"),
    # V-shaped: the last stage and the loss on device 0
    pytest.param(ZeroBubbleVSchedule(2, 4), MP, 2, True, False, id="zb-v model-pipe norm"),
    pytest.param(DualPipeVSchedule(2, 4), "pipe", 1, False, True, id="dualpipe-v pipe recompute"),
]


@pytest.mark.parametrize(("schedule", "axis", "model", "norm", "recompute"), VOCAB_CASES)
def test_loss_split_over_the_pipeline_axis_matches_serial_twin(
    schedule, axis, model, norm, recompute
):
    """The loss runs on every device of the pipeline axis: its value, the stages' and the
    input's gradients are the serial model's; each device's block of the head's gradient is
    the matching rows of the serial gradient, and the replicated norm's is whole."""
    s, num_model_stages = schedule.num_devices, schedule.num_devices * schedule._num_trips()
    stages, head = _vocab_model(num_model_stages, norm=norm)
    x, t, keep = _vocab_batch(schedule.num_microbatches)

    def serial(stages, head, x):
        return _serial(stages, head, x, t, keep, num_model_stages)

    loss_ref, (grads_ref, head_ref, x_ref) = jax.value_and_grad(serial, argnums=(0, 1, 2))(
        stages, head, x
    )
    loss, grads, head_grads, x_grads = _run_vocab(
        schedule, stages, head, x, t, keep, axis=axis, model=model, recompute=recompute
    )
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, eqx.filter(grads_ref, eqx.is_array))
    assert_tree_close(x_grads, x_ref)
    _check_head_grads(head_grads, head_ref, axis=axis, s=s, model=model)


def test_loss_split_over_the_pipeline_axis_sgd_update_matches_serial():
    """One plain-SGD step through 1F1B with a vocabulary-parallel head over (model, pipe)
    lands where the serial model's step lands, stages and head alike."""
    s, model, axis, lr = 2, 2, ("model", "pipe"), 0.1
    schedule = OneFOneBSchedule(s, 4)
    stages, head = _vocab_model(s, norm=True, key=5)
    x, t, keep = _vocab_batch(4, key=6)
    _, (grads_ref, head_ref) = jax.value_and_grad(
        lambda st, hd: _serial(st, hd, x, t, keep, s), argnums=(0, 1)
    )(stages, head)
    _, grads, head_grads, _ = _run_vocab(
        schedule, stages, head, x, t, keep, axis=axis, model=model, recompute=False
    )
    sgd = lambda p, g: p - lr * g
    params = eqx.filter(stages, eqx.is_array)
    expected = jax.tree.map(sgd, params, eqx.filter(grads_ref, eqx.is_array))
    assert_tree_close(jax.tree.map(sgd, params, grads), expected)
    # The head: each device updates its block; the blocks, put back, are the serial update.
    order = sorted(itertools.product(range(s), range(model)), key=lambda pm: _block(axis, *pm, s))
    unembed = jax.tree.map(
        lambda g: jnp.concatenate([g[p * model + m] for p, m in order]), head_grads.unembed
    )
    _check_head_grads(head_grads, head_ref, axis=axis, s=s, model=model)
    norm = jax.tree.map(lambda g: g[0], head_grads.norm)  # the same on every device
    assert head.norm is not None and head_ref.norm is not None
    got = [
        sgd(head.unembed.weight, unembed.weight),
        sgd(head.unembed.bias, unembed.bias),
        sgd(head.norm.weight, norm.weight),
        sgd(head.norm.bias, norm.bias),
    ]
    expected = [
        sgd(head.unembed.weight, head_ref.unembed.weight),
        sgd(head.unembed.bias, head_ref.unembed.bias),
        sgd(head.norm.weight, head_ref.norm.weight),
        sgd(head.norm.bias, head_ref.norm.bias),
    ]
    assert_tree_close(got, expected)


class PipeSumHead(eqx.Module):
    """A loss with a collective over the pipeline axis but its parameters replicated."""

    weight: jax.Array

    def __call__(self, h, t):
        return jax.lax.psum(jnp.mean((h @ self.weight - t) ** 2), "pipe") / 2


def test_loss_with_a_pipe_collective_but_no_pipe_split_parameters_is_refused():
    """It would run on the last stage's device alone, where a collective over `pipe` cannot
    run: a ValueError naming the axis and the fix, not an abort in the compiler."""
    stages, head = _model(2)
    stage = eqx.combine(jax.tree.map(lambda a: a[0], eqx.filter(stages, eqx.is_array)), stages)
    x, t, keep = _batch(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))
    match = (
        r"`loss_fn` uses a collective over the pipeline axis 'pipe', but none of its "
        r"parameters is split over that axis.*Split its parameters over 'pipe'"
    )
    for loss_fn in (PipeSumHead(head.weight), lambda y, t: jax.lax.pmean(jnp.mean(y - t), "pipe")):

        def run(x, t, loss_fn=loss_fn):
            schedule = OneFOneBSchedule(2, 2)
            return execute_schedule(
                schedule, stage, loss_fn, x, t, Microbatched(keep), model_axis_name="pipe"
            )[0]

        with pytest.raises(ValueError, match=match):
            jax.shard_map(run, mesh=mesh, in_specs=(P(), P()), out_specs=P())(x, t)


# --------------------------------------------------------------------------------------
# Integer leaves of the activations: the loss sees what the last stage returns.


class CountingStage(eqx.Module):
    """A stage whose activation carries an integer leaf it changes: the count of stages."""

    weight: jax.Array

    def __call__(self, h):
        y, n, flip = h
        return jnp.tanh(y @ self.weight), n + 1, ~flip


class CountLoss(eqx.Module):
    """A loss that reads the count; with `scale` split over `pipe` it runs on every device."""

    scale: jax.Array | None

    def __call__(self, out, t):
        y, n, flip = out
        loss = jnp.mean((y * jnp.where(flip, -n, n)[:, None] - t) ** 2)
        if self.scale is None:
            return loss
        return jax.lax.psum(jnp.sum(self.scale), "pipe") * loss


COUNT_CASES = [
    pytest.param(schedule, recompute, split, id=f"{schedule._name} recompute={recompute} {split=}")
    for schedule in (
        OneFOneBSchedule(2, 2),
        ZeroBubbleH1Schedule(2, 2),
        GPipeSchedule(2, 2, include_backward=True),
    )
    for recompute in (False, True)
    for split in (False, True)
    if not split or schedule._name == "ZB-H1"
]


@pytest.mark.parametrize(("schedule", "recompute", "split"), COUNT_CASES)
def test_the_loss_sees_the_integer_leaves_the_last_stage_returns(schedule, recompute, split):
    """Before, training schedules handed the loss the last stage's input integer leaves (or
    the batch's): a count of stages read 1 (or 0) instead of 2, and a flipped bool the wrong
    way round."""
    s, m = schedule.num_devices, schedule.num_microbatches
    weights = jax.random.normal(jax.random.key(0), (s, FEATURES, FEATURES)) / 2
    y = jax.random.normal(jax.random.key(1), (m * ROWS, FEATURES))
    t = jax.random.normal(jax.random.key(2), (m * ROWS, FEATURES))
    n = jnp.zeros((m * ROWS,), jnp.int32)
    scale = jnp.array([0.5, 1.5]) if split else None

    def serial(weights):
        h = (y, n, n == 0)  # a bool leaf the stages flip
        for i in range(s):
            h = CountingStage(weights[i])(h)
        return (1.0 if scale is None else jnp.sum(scale)) * CountLoss(None)(h, t)

    loss_ref, grads_ref = jax.value_and_grad(serial)(weights)

    def step(weights, scale, y, n, t):
        loss_fn = CountLoss(scale if split else None)
        loss, grads = execute_schedule(
            schedule, CountingStage(weights[0]), loss_fn, (y, n, n == 0), t,
            model_axis_name="pipe", recompute=recompute,
        )  # fmt: skip
        return loss, grads.weight[None]

    mesh = Mesh(np.array(jax.devices()[:s]), ("pipe",))
    run = jax.shard_map(
        step, mesh=mesh, in_specs=(P("pipe"), P("pipe"), P(), P(), P()),
        out_specs=(P(), P("pipe")),
    )  # fmt: skip
    loss, grads = jax.jit(run)(weights, jnp.ones((s,)) if scale is None else scale, y, n, t)
    assert_tree_close(loss, loss_ref)
    assert_tree_close(grads, grads_ref)


def test_a_loss_split_over_the_pipeline_axis_that_differs_by_device_is_refused():
    """A loss with parameters split over `pipe` runs on every device of it; before, one whose
    value differed by device (its parts not summed) trained on a wrong gradient."""

    class UnsummedLoss(eqx.Module):
        scale: jax.Array

        def __call__(self, out, t):
            return jnp.sum(self.scale) * jnp.mean((out[0] - t) ** 2)  # no psum over "pipe"

    weights = jnp.ones((2, FEATURES, FEATURES)) / 4
    y = jnp.ones((2 * ROWS, FEATURES))
    n = jnp.zeros((2 * ROWS,), jnp.int32)

    def step(weights, scale, y, n):
        return execute_schedule(
            OneFOneBSchedule(2, 2), CountingStage(weights[0]), UnsummedLoss(scale),
            (y, n, n == 0), y, model_axis_name="pipe",
        )[0]  # fmt: skip

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))
    run = jax.shard_map(step, mesh=mesh, in_specs=(P("pipe"),) * 2 + (P(),) * 2, out_specs=P())
    with pytest.raises(ValueError, match=r"must give the same loss on each.*lax\.psum"):
        run(weights, jnp.ones((2,)), y, n)


def test_a_pipeline_under_check_vma_false_is_refused():
    """Before, a batch split over `pipe` under check_vma=False came back with 2 of 8 rows."""
    from eqpar.pipeline import execute_pipeline

    weights = jnp.ones((4, FEATURES, FEATURES)) / 4
    y = jnp.ones((8, FEATURES))
    n = jnp.zeros((8,), jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))

    def forward(weights, y, n):
        return execute_pipeline(
            CountingStage(weights[0]), (y, n, n == 0), num_microbatches=2, model_axis_name="pipe"
        )[0]

    def train(weights, y, n):
        return execute_schedule(
            OneFOneBSchedule(4, 2), CountingStage(weights[0]), CountLoss(None), (y, n, n == 0), y,
            model_axis_name="pipe",
        )[0]  # fmt: skip

    for fn, out_specs in ((forward, P("pipe")), (train, P())):
        run = jax.shard_map(
            fn, mesh=mesh, in_specs=(P("pipe"), P("pipe"), P("pipe")), out_specs=out_specs,
            check_vma=False,
        )  # fmt: skip
        with pytest.raises(ValueError, match="needs `shard_map`'s replication types"):
            run(weights, y, n)
    # One device on the pipeline axis loses nothing: check_vma=False is fine there.
    one = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("pipe", "data"))
    run = jax.shard_map(
        forward, mesh=one, in_specs=(P("pipe"), P("data"), P("data")), out_specs=P("data"),
        check_vma=False,
    )  # fmt: skip
    assert_tree_close(run(weights[:1], y, n), jnp.tanh(y @ weights[0]))


def test_a_custom_table_trains_like_the_serial_model_and_is_checked_when_made():
    """A table of one's own (here ZB-H1's with every weight gradient moved to the end, one
    per step) trains like the serial model; an incomplete one is refused when made."""
    from eqpar.schedule import Action, CustomSchedule

    def weights_last(schedule):
        rows = [[a if a.kind != "backward_weight" else Action("idle") for a in row]
                for row in schedule.actions]  # fmt: skip
        for _, d, w in _cells(schedule, "backward_weight"):
            rows.append([w if e == d else Action("idle") for e in range(schedule.num_devices)])
        return rows

    stages, head = _model(2)
    x, t, keep = _batch(3)
    ref = jax.value_and_grad(_serial, argnums=(0, 1))(stages, head, x, t, keep, 2)
    schedule = CustomSchedule(
        weights_last(ZeroBubbleH1Schedule(2, 3)), num_microbatches=3, name="late W"
    )
    loss, grads, head_grads, _ = _run(schedule, stages, head, x, t, keep, recompute=False)
    assert_tree_close(
        (loss, grads, head_grads), (ref[0], eqx.filter(ref[1][0], eqx.is_array), ref[1][1])
    )
    with pytest.raises(ValueError, match="microbatch 2, stage 1: a backward_input but no"):
        CustomSchedule(weights_last(ZeroBubbleH1Schedule(2, 3))[:-1], num_microbatches=3)
    with pytest.raises(ValueError, match="at least one step"):
        CustomSchedule([], num_microbatches=1)
