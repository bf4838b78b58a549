"""Schedule tables: bubble fractions equal the formulas, orders respect data dependencies."""

import itertools

import pytest

from eqpar.schedule import (
    Action,
    CircularSchedule,
    GPipeSchedule,
    OneFOneBSchedule,
    PipelineSchedule,
)

SIZES = [(s, m) for s in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16, 33)]


def _when(schedule: PipelineSchedule) -> dict[tuple[str, int | None, int | None], int]:
    """(kind, microbatch, stage) -> step, checking each happens once on its own device."""
    seen: dict[tuple[str, int | None, int | None], int] = {}
    for step, row in enumerate(schedule.actions):
        assert len(row) == schedule.num_devices
        for device, action in enumerate(row):
            if action.kind == "idle":
                assert action.microbatch is None and action.stage is None
                continue
            assert action.stage is not None
            assert action.stage % schedule.num_stages == device
            key = (action.kind, action.microbatch, action.stage)
            assert key not in seen, f"{key} scheduled twice"
            seen[key] = step
    return seen


@pytest.mark.parametrize(("s", "m"), SIZES)
def test_gpipe_bubble_and_order(s, m):
    schedule = GPipeSchedule(s, m)
    assert schedule.num_steps == m + s - 1
    assert schedule.bubble_fraction == (s - 1) / (m + s - 1)
    when = _when(schedule)
    assert len(when) == s * m
    for mb, stage in itertools.product(range(m), range(1, s)):
        assert when[("forward", mb, stage)] == when[("forward", mb, stage - 1)] + 1

    training = GPipeSchedule(s, m, include_backward=True)
    assert training.num_steps == 2 * (m + s - 1)
    assert training.bubble_fraction == (s - 1) / (m + s - 1)
    when = _when(training)
    for mb, stage in itertools.product(range(m), range(s)):
        assert when[("backward", mb, stage)] > when[("forward", mb, s - 1)]
        if stage < s - 1:
            assert when[("backward", mb, stage)] > when[("backward", mb, stage + 1)]
    assert training.max_stored_inputs() == m


@pytest.mark.parametrize(("s", "m"), SIZES)
@pytest.mark.parametrize("v", [1, 2, 3])
def test_circular_bubble_and_order(s, m, v):
    schedule = CircularSchedule(s, m, v)
    if m >= s:
        assert schedule.num_steps == v * m + s - 1
        assert schedule.bubble_fraction == (s - 1) / (v * m + s - 1)
    else:
        # Fewer microbatches than devices: each trip round the ring still takes s steps.
        steps = (v - 1) * s + m + s - 1
        assert schedule.num_steps == steps
        assert schedule.bubble_fraction == (steps - v * m) / steps
    when = _when(schedule)
    assert len(when) == s * v * m
    for mb, stage in itertools.product(range(m), range(1, s * v)):
        assert when[("forward", mb, stage)] > when[("forward", mb, stage - 1)]


def test_circular_beats_gpipe_bubble():
    assert CircularSchedule(4, 8, 4).bubble_fraction < GPipeSchedule(4, 8).bubble_fraction


@pytest.mark.parametrize(("s", "m"), SIZES)
def test_one_f_one_b_bubble_order_and_memory(s, m):
    schedule = OneFOneBSchedule(s, m)
    assert schedule.num_steps == 2 * (m + s - 1)
    assert schedule.bubble_fraction == (s - 1) / (m + s - 1)
    when = _when(schedule)
    assert len(when) == 2 * s * m
    for mb, stage in itertools.product(range(m), range(s)):
        forward, backward = when[("forward", mb, stage)], when[("backward", mb, stage)]
        assert backward > forward
        if stage > 0:
            assert forward > when[("forward", mb, stage - 1)]
        if stage < s - 1:
            assert backward == when[("backward", mb, stage + 1)] + 1
    # Device d holds at most s - d inputs; GPipe with autodiff holds all m.
    for device in range(s):
        held, most = set(), 0
        for row in schedule.actions:
            a = row[device]
            if a.kind == "forward":
                held.add(a.microbatch)
            elif a.kind == "backward":
                held.discard(a.microbatch)
            most = max(most, len(held))
        assert most <= s - device
    assert schedule.max_stored_inputs() == min(s, m)


def test_actions_and_text():
    schedule = OneFOneBSchedule(2, 2)
    assert schedule.action(0, 0) == Action("forward", microbatch=0, stage=0)
    assert schedule.action(0, 1) == Action("idle")
    assert schedule.action(2, 1) == Action("backward", microbatch=0, stage=1)
    text = str(schedule)
    assert text.splitlines()[1].split(":")[1].split() == ["F0", "F1", ".", "B0", ".", "B1"]
    with pytest.raises(ValueError, match=r"`step` must be in \[0, 6\), got 6"):
        schedule.action(6, 0)
    with pytest.raises(ValueError, match=r"`device` must be in \[0, 2\), got -1"):
        schedule.action(0, -1)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: GPipeSchedule(0, 4), ValueError, "`num_stages` must be at least 1, got 0"),
        (lambda: OneFOneBSchedule(2, 0), ValueError, "`num_microbatches` must be at least 1"),
        (lambda: CircularSchedule(2, 2, 0), ValueError, "`num_repeats` must be at least 1"),
        (lambda: CircularSchedule(2.0, 2), TypeError, "num_stages"),
        (
            lambda: OneFOneBSchedule(2, True),
            TypeError,
            "`num_microbatches` must be an int, got bool",
        ),
    ],
)
def test_schedule_validation(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize(
    "schedule",
    [GPipeSchedule(4, 4, include_backward=True), CircularSchedule(4, 4, 2), OneFOneBSchedule(4, 6)],
    ids=["gpipe", "circular", "1f1b"],
)
def test_plot_writes_png(schedule, tmp_path):
    path = schedule.plot(tmp_path / "schedule.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width > 300 and height > 100


@pytest.mark.parametrize(("s", "m", "v"), [(1, 1, 2), (2, 4, 2), (4, 8, 2), (4, 3, 3), (3, 5, 1)])
def test_circular_training_step_runs_the_forward_backwards(s, m, v):
    forward = CircularSchedule(s, m, v)
    training = CircularSchedule(s, m, v, include_backward=True)
    assert training.include_backward and not forward.include_backward
    assert training.has_backward and not forward.has_backward
    assert training.num_steps == 2 * forward.num_steps
    assert training.busy_steps == 2 * forward.busy_steps
    # The same definition of the bubble as GPipe's and 1F1B's training tables.
    assert training.bubble_fraction == forward.bubble_fraction
    assert training.actions[: forward.num_steps] == forward.actions
    when = _when(training)
    assert len(when) == 2 * s * v * m
    last = s * v - 1
    for mb, stage in itertools.product(range(m), range(s * v)):
        assert when[("backward", mb, stage)] > when[("forward", mb, last)]
        if stage < last:
            assert when[("backward", mb, stage)] > when[("backward", mb, stage + 1)]
    assert training.max_stored_inputs() == v * m
    if v == 1:  # one stage per device: GPipe
        assert training.actions == GPipeSchedule(s, m, include_backward=True).actions


def test_stages_on_and_default_titles():
    assert CircularSchedule(4, 8, 2).stages_on(0) == (0, 4)
    assert CircularSchedule(2, 2, 3, include_backward=True).stages_on(1) == (1, 3, 5)
    assert GPipeSchedule(4, 2).stages_on(2) == (2,)
    assert OneFOneBSchedule(3, 4).stages_on(1) == (1,)
    with pytest.raises(ValueError, match=r"`device` must be in \[0, 4\), got 4"):
        GPipeSchedule(4, 2).stages_on(4)
    assert CircularSchedule(4, 8, 2, include_backward=True).default_title() == (
        "circular schedule, training step: 4 devices x 2 stages, 8 microbatches, bubble 15.8%"
    )
    assert GPipeSchedule(4, 4).default_title().startswith("GPipe schedule, forward pass only")
    assert OneFOneBSchedule(4, 8).default_title() == (
        "1F1B schedule, training step: 4 devices, 8 microbatches, bubble 27.3%"
    )


def _chart_parts(schedule: PipelineSchedule):
    fig = schedule.figure()
    (ax,) = fig.axes
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # pyright: ignore[reportAttributeAccessIssue]
    return fig, ax, renderer


@pytest.mark.parametrize(
    ("schedule", "rows"),
    [
        (GPipeSchedule(2, 4, include_backward=True), ["device 0 (stage 0)", "device 1 (stage 1)"]),
        (
            CircularSchedule(2, 4, 2, include_backward=True),
            ["device 0 (stages 0, 2)", "device 1 (stages 1, 3)"],
        ),
        (OneFOneBSchedule(2, 3), ["device 0 (stage 0)", "device 1 (stage 1)"]),
        (
            CircularSchedule(3, 2, 3, include_backward=True),
            [f"device {d} (stages {d}, {d + 3}, {d + 6})" for d in range(3)],
        ),
    ],
    ids=["gpipe-2", "circular-2", "1f1b-2", "circular-3x3"],
)
def test_chart_rows_cells_caption_and_legend(schedule, rows):
    fig, ax, renderer = _chart_parts(schedule)
    assert [label.get_text() for label in ax.get_yticklabels()] == rows
    # Every forward and backward cell carries its microbatch index.
    numbers = sorted(int(t.get_text()) for t in ax.texts)
    busy = [a.microbatch for row in schedule.actions for a in row if a.kind != "idle"]
    assert numbers == sorted(busy)
    assert len(ax.patches) == schedule.num_steps * schedule.num_devices
    assert "cell number = microbatch index" in ax.get_title()
    assert f"{schedule.bubble_fraction:.1%}" in fig.get_suptitle()
    # The legend names forward and backward and sits outside the axes, their labels included.
    (legend,) = fig.legends
    entries = [t.get_text() for t in legend.get_texts()]
    assert any(e.startswith("forward") for e in entries)
    assert any(e.startswith("backward") for e in entries)
    assert entries[-1] == "idle (bubble)"
    legend_box = legend.get_window_extent(renderer)
    assert not legend_box.overlaps(ax.get_tightbbox(renderer))
    assert not legend_box.overlaps(ax.xaxis.label.get_window_extent(renderer))
    assert fig.bbox.contains(legend_box.x0, legend_box.y0)
    assert fig.bbox.contains(legend_box.x1, legend_box.y1)


def test_circular_chart_legend_names_each_devices_stages():
    fig = CircularSchedule(4, 8, 2, include_backward=True).figure()
    entries = [t.get_text() for t in fig.legends[0].get_texts()]
    assert entries == [
        "forward, stages 0–3",
        "forward, stages 4–7",
        "backward, stages 0–3",
        "backward, stages 4–7",
        "idle (bubble)",
    ]
    forward_only = CircularSchedule(4, 8, 2).figure()
    assert "forward pass only" in forward_only.get_suptitle()
    assert [t.get_text() for t in forward_only.legends[0].get_texts()][-1] == "idle (bubble)"
