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
