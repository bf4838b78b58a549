"""Pipeline schedules: which device does what at every step, the bubble, and a Gantt chart.

A schedule is a table with one row per clock step and one column per device of the pipeline
axis. Each cell is an `Action`: a forward or a backward pass of one microbatch through one
stage, or nothing (a bubble). Every action lasts one step; real backward passes cost about
twice a forward pass, which shifts the wall time but not the order or the bubble count.

The table is also the program: `eqpar.pipeline.execute_schedule` (and the forward executors)
compile it into per-device lookup tables and run it as one `lax.scan`, so what the chart shows
is what runs. The GPipe/circular and 1F1B timings are closed-form rules (`_circular_slot`,
`_one_f_one_b_slot`); ZB-H1's table comes from priority rules applied step by step. A
backward half that autodiff of a forward `lax.scan` runs is the forward table read backwards
(`_mirrored_backward`).
"""

import dataclasses
import pathlib
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from . import _schedule_tables
from ._checks import check_int

if TYPE_CHECKING:
    from matplotlib.figure import Figure as _Figure
else:  # matplotlib is optional: imported only when a chart is drawn
    _Figure = Any

Placement = Literal["ring", "v"]
ActionKind = Literal["forward", "backward", "backward_input", "backward_weight", "idle"]
_ACTION_KINDS: tuple[str, ...] = typing.get_args(ActionKind)
_BACKWARD_KINDS = ("backward", "backward_input", "backward_weight")

_NO_MICROBATCH = -1


def _device_of(stage: int, num_devices: int, placement: str) -> int:
    """The device of `stage` under `placement` (see `PipelineSchedule.device_of`)."""
    if placement == "v":
        return stage if stage < num_devices else 2 * num_devices - 1 - stage
    return stage % num_devices


def _circular_slot(
    step: Any, device: Any, *, num_stages: int, num_microbatches: int, num_repeats: int, xp: Any
) -> tuple[Any, Any]:
    """`(microbatch, repeat)` of the forward pass run by `device` at `step`, `-1` when idle.

    Microbatch `m` on its `r`-th trip around the ring reaches device `d` at step
    `r * period + m + d`, with `period = max(num_microbatches, num_stages)`: a microbatch
    leaving the last device may have to wait for the ring to come round before device 0 is
    free for it again. With `num_repeats == 1` this is GPipe.
    """
    period = max(num_microbatches, num_stages)
    k = step - device
    repeat = k // period
    microbatch = k % period
    valid = (k >= 0) & (repeat < num_repeats) & (microbatch < num_microbatches)
    return (
        xp.where(valid, microbatch, _NO_MICROBATCH),
        xp.where(valid, repeat, _NO_MICROBATCH),
    )


def _one_f_one_b_slot(
    step: Any, device: Any, *, num_stages: int, num_microbatches: int, xp: Any
) -> tuple[Any, Any]:
    """`(forward microbatch, backward microbatch)` of `device` at `step`; `-1` when none.

    The classic one-forward-one-backward order on unit steps: device `d` runs forwards as
    early as it can until it holds `num_stages - d` microbatches (steps `m + d`), then
    alternates, with forward `m` at step `2m + d` and backward `m` at `2 * num_stages - 1 - d
    + 2m`. At most one of the two is not `-1`.
    """
    s, m_count = num_stages, num_microbatches
    k = step - device
    warmup = (step < s) & (k >= 0) & (k < m_count)
    steady = (step >= 2 * s - device) & (k % 2 == 0) & (k // 2 < m_count)
    forward = xp.where(warmup, k, xp.where(steady, k // 2, _NO_MICROBATCH))
    u = step - (2 * s - 1 - device)
    has_backward = (u >= 0) & (u % 2 == 0) & (u // 2 < m_count)
    backward = xp.where(has_backward, u // 2, _NO_MICROBATCH)
    return forward, backward


@dataclasses.dataclass(frozen=True)
class Action:
    """What one device does during one step of a pipeline schedule.

    **Arguments:**

    - `kind`: `"forward"`, `"backward"` (the gradients of the stage input and of its
      weights), `"backward_input"` (the input gradient alone), `"backward_weight"` (the
      weight gradient a `"backward_input"` left for later) or `"idle"`.
    - `microbatch`: the microbatch index (`None` when idle).
    - `stage`: the pipeline stage index in model order (`None` when idle); with a circular
      schedule a device runs several stages.

    ```python
    from eqpar.schedule import Action, GPipeSchedule
    schedule = GPipeSchedule(num_stages=2, num_microbatches=2)
    assert schedule.action(step=1, device=1) == Action("forward", microbatch=0, stage=1)
    assert schedule.action(step=0, device=1) == Action("idle")
    ```
    """

    kind: ActionKind
    microbatch: int | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _ACTION_KINDS:
            raise ValueError(
                f"Action: `kind` must be one of {', '.join(map(repr, _ACTION_KINDS))}; got "
                f"{self.kind!r}."
            )
        if self.kind == "idle":
            if self.microbatch is not None or self.stage is not None:
                raise ValueError(
                    f"Action: an idle action has no microbatch or stage; got microbatch="
                    f'{self.microbatch!r}, stage={self.stage!r}. Write `Action("idle")`.'
                )
            return
        for name in ("microbatch", "stage"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(
                    f"Action: a {self.kind!r} action needs a `{name}` (an int from 0); got None."
                )
            # Stored as a plain int, so that tables built from NumPy integers compare equal.
            object.__setattr__(self, name, check_int(value, name=name, owner="Action", minimum=0))

    def label(self) -> str:
        """A short text such as `F3`, `B0` or `W2` (`.` for idle)."""
        if self.kind == "idle":
            return "."
        letter = "W" if self.kind == "backward_weight" else self.kind[0].upper()
        return f"{letter}{self.microbatch}"


_IDLE = Action("idle")


def _mirrored_backward(
    forward: tuple[tuple[Action, ...], ...],
) -> tuple[tuple[Action, ...], ...]:
    """The backward half that autodiff of a forward scan runs: the same steps in reverse, each
    forward turned into the backward of the same microbatch and stage."""
    return tuple(
        tuple(a if a.kind == "idle" else dataclasses.replace(a, kind="backward") for a in row)
        for row in reversed(forward)
    )


def _acted_on(schedule: "PipelineSchedule") -> dict[tuple[str, int, int], int]:
    """The step of every action of the table, by `(kind, microbatch, stage)`, after checking
    each cell on its own: an `Action`, on its stage's device, for a declared microbatch, and
    the only one of its kind for that microbatch and stage."""
    owner = type(schedule).__name__
    num_devices, num_microbatches = schedule.num_devices, schedule.num_microbatches
    when: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(schedule.actions):
        if len(row) != num_devices:
            raise ValueError(
                f"{owner}: step {t} of the table has {len(row)} actions, but the schedule has "
                f'{num_devices} devices; give every step one action per device (`Action("idle")` '
                f"where a device does nothing)."
            )
        for d, action in enumerate(row):
            if not isinstance(action, Action):
                raise TypeError(
                    f"{owner}: step {t}, device {d}: a table cell must be an "
                    f"`eqpar.schedule.Action`; got {type(action).__name__} {action!r}."
                )
            if action.kind == "idle":
                continue
            assert action.microbatch is not None and action.stage is not None
            problem = None
            if schedule.placement == "v" and action.stage >= 2 * num_devices:
                problem = (
                    f"for a stage a V-shaped table does not have: it has 2 x {num_devices} "
                    f"stages, one down and one back up per device."
                )
            elif schedule.device_of(action.stage) != d:
                problem = (
                    f"not on its stage's device ({schedule.device_of(action.stage)} with the "
                    f"{schedule.placement!r} placement)."
                )
                if schedule.placement == "ring" and _device_of(action.stage, num_devices, "v") == d:
                    problem += " For a V-shaped table pass placement='v'."
            elif action.microbatch >= num_microbatches:
                problem = (
                    f"for a microbatch the schedule does not have: it declares "
                    f"num_microbatches={num_microbatches}, so a table built for more "
                    f"microbatches would run some twice. Build the table for "
                    f"{num_microbatches} microbatches, or declare as many as it has."
                )
            elif (action.kind, action.microbatch, action.stage) in when:
                problem = "the second of its kind for that microbatch and stage."
            if problem:
                raise ValueError(f"{owner}: step {t}, device {d}: {action} is {problem}")
            when[(action.kind, action.microbatch, action.stage)] = t
    return when


def _check_order(schedule: "PipelineSchedule", when: dict[tuple[str, int, int], int]) -> None:
    """Every microbatch passes every stage exactly once each way, each action after what it
    needs: a table that breaks this would run, but on values that are not there yet, or
    leave a gradient out, or count one twice."""
    owner = type(schedule).__name__
    num_stages = schedule.num_devices * schedule._num_trips()
    training = any(kind in _BACKWARD_KINDS for kind, _, _ in when)
    for m in range(schedule.num_microbatches):
        for stage in range(num_stages):
            forward = when.get(("forward", m, stage))
            previous = when.get(("forward", m, stage - 1))
            full = when.get(("backward", m, stage))
            split = when.get(("backward_input", m, stage))
            weight = when.get(("backward_weight", m, stage))
            backward = full if split is None else split
            later = when.get(("backward", m, stage + 1), when.get(("backward_input", m, stage + 1)))
            needs = []
            if forward is None:
                needs.append("no forward")
            elif previous is not None and forward <= previous:
                needs.append("its forward does not come after the previous stage's")
            if training:
                if full is not None and split is not None:
                    needs.append("both a backward and a backward_input")
                if backward is None:
                    needs.append("no backward")
                else:
                    if forward is not None and backward <= forward:
                        needs.append("its backward does not come after its forward")
                    if later is not None and backward <= later:
                        needs.append("its backward does not come after the next stage's")
                if split is not None and weight is None:
                    needs.append(
                        "a backward_input but no backward_weight, so its weight gradient "
                        "would be left out"
                    )
                if full is not None and weight is not None:
                    needs.append(
                        "a backward_weight as well as a full backward (which already computes "
                        "the weight gradient), so it would be counted twice"
                    )
                if weight is not None and split is not None and weight <= split:
                    needs.append("its backward_weight comes before its backward_input")
                if weight is not None and backward is None:
                    needs.append("a backward_weight without a backward_input before it")
            if needs:
                raise ValueError(
                    f"{owner}: microbatch {m}, stage {stage}: {'; '.join(needs)}. A schedule "
                    f"table must give every microbatch one forward on every stage and, for "
                    f"training, one backward (or one backward_input followed by one "
                    f"backward_weight), each after the action whose result it uses."
                )


class PipelineSchedule:
    """What every device of a pipeline does at every step: the common interface of
    `GPipeSchedule`, `CircularSchedule` and `OneFOneBSchedule`.

    A schedule is a table `actions[step][device]` of `Action`s, with the bubble fraction, the
    most microbatch inputs a device holds, a text rendering (`str(schedule)`) and a Gantt
    chart (`figure`, `plot`). Subclasses fill `self._table`.

    ```python
    from eqpar.schedule import GPipeSchedule, OneFOneBSchedule
    gpipe = GPipeSchedule(num_stages=4, num_microbatches=8, include_backward=True)
    one_f_one_b = OneFOneBSchedule(num_stages=4, num_microbatches=8)
    assert gpipe.bubble_fraction == one_f_one_b.bubble_fraction == 3 / 11
    assert gpipe.max_stored_inputs() == 8 and one_f_one_b.max_stored_inputs() == 4
    print(one_f_one_b)
    ```
    """

    num_stages: int
    num_microbatches: int
    _table: tuple[tuple[Action, ...], ...]
    _name: str = "pipeline"  # the label of its text rendering and pictures
    # The schedule's name in every API of eqpar (`PipelineModule.schedule(name)`,
    # `value_and_grad(schedule=name)`, the example's `--schedule`); "custom" for a table of
    # one's own.
    name: ClassVar[str] = "custom"
    # Which device runs which stage (`device_of`): "ring" or "v".
    placement: Placement = "ring"
    # How many stages each device runs, for the schedules that fix it (None: any).
    stages_per_device: ClassVar[int | None] = None

    def device_of(self, stage: int) -> int:
        """The device of the pipeline axis that runs `stage` (in model order).

        With the `"ring"` placement (GPipe, 1F1B, ZB-H1, circular) stage `s` runs on device
        `s % num_devices`, so a model of `V S` stages goes round the devices `V` times. With
        the `"v"` placement (`ZeroBubbleVSchedule`, `DualPipeVSchedule`) a model of `2 S`
        stages goes down the devices and back up: stage `s < S` on device `s`, stage
        `s >= S` on device `2 S - 1 - s`, so device 0 holds the first and the last stage.

        **Arguments:**

        - `stage`: a stage index from 0.

        **Returns:** a device index in `[0, num_devices)`.

        ```python
        from eqpar.schedule import OneFOneBSchedule, ZeroBubbleVSchedule
        assert OneFOneBSchedule(4, 8).device_of(2) == 2
        assert [ZeroBubbleVSchedule(4, 8).device_of(s) for s in range(8)] == [
            0, 1, 2, 3, 3, 2, 1, 0
        ]
        ```
        """
        return _device_of(stage, self.num_devices, self.placement)

    @property
    def num_devices(self) -> int:
        """The size of the pipeline axis."""
        return self.num_stages

    @property
    def num_steps(self) -> int:
        """The number of clock steps from the first action to the last."""
        return len(self._table)

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """The table: `actions[step][device]` is an `Action`."""
        return self._table

    def action(self, step: int, device: int) -> Action:
        """The action of `device` at `step`.

        **Arguments:**

        - `step`: a clock step in `[0, num_steps)`.
        - `device`: a position on the pipeline axis in `[0, num_devices)`.

        **Returns:** an `Action`.
        """
        if not 0 <= step < self.num_steps:
            raise ValueError(f"`step` must be in [0, {self.num_steps}), got {step}.")
        if not 0 <= device < self.num_devices:
            raise ValueError(f"`device` must be in [0, {self.num_devices}), got {device}.")
        return self._table[step][device]

    @property
    def busy_steps(self) -> int:
        """How many (step, device) cells hold a forward or backward action."""
        return sum(a.kind != "idle" for row in self._table for a in row)

    @property
    def bubble_fraction(self) -> float:
        """The idle share of all (step, device) cells: `1 - busy / (num_steps * num_devices)`."""
        total = self.num_steps * self.num_devices
        return (total - self.busy_steps) / total

    def max_stored_inputs(self) -> int:
        """The most microbatch stage inputs any device holds at once, counting from a
        microbatch's forward on that device up to its last backward action there (its weight
        gradient, where that comes later; forward-only schedules count up to the forward)."""
        most = 0
        for device in range(self.num_devices):
            held: set[tuple[int | None, int | None]] = set()
            actions = [row[device] for row in self._table]
            last_use = {(a.microbatch, a.stage): a for a in actions if a.kind != "idle"}
            for a in actions:
                if a.kind == "forward":
                    held.add((a.microbatch, a.stage))
                    most = max(most, len(held))
                if a.kind != "idle" and last_use[(a.microbatch, a.stage)] is a:
                    held.discard((a.microbatch, a.stage))
        return most

    def check(self) -> None:
        """Raise unless the table is complete and in order, as every executor requires.

        Every row has one `Action` per device; every action runs on its stage's device
        (`device_of(stage)`) for a microbatch in `[0, num_microbatches)`; every
        microbatch has exactly one forward on every stage, after the previous stage's; and
        where the table trains, exactly one `"backward"`, or one `"backward_input"`
        followed by one `"backward_weight"`, each backward after its own forward and after
        the next stage's backward. A table
        that broke this would still run, on values not there yet, leaving a gradient out or
        counting one twice; the executors call this before they compile a table.

        **Raises:** `ValueError` (`TypeError` for a cell that is not an `Action`) naming the
        step and device, or the microbatch and stage, at fault.

        ```python
        from eqpar.schedule import ZeroBubbleH1Schedule
        ZeroBubbleH1Schedule(num_stages=4, num_microbatches=8).check()
        ```
        """
        self._checked_steps()

    def _checked_steps(self) -> dict[tuple[str, int, int], int]:
        """`check()`, returning the step of every action by `(kind, microbatch, stage)` (for
        the executors' compiler)."""
        when = _acted_on(self)
        _check_order(self, when)
        return when

    @property
    def has_backward(self) -> bool:
        """Whether the table holds backward passes (a training step), not only forwards."""
        return any(a.kind in _BACKWARD_KINDS for row in self._table for a in row)

    def stages_on(self, device: int) -> tuple[int, ...]:
        """The pipeline stages (in model order) that `device` runs, smallest first.

        One stage per device for GPipe and 1F1B (stage `d` on device `d`); `num_repeats`
        stages `d, d + S, d + 2S, ...` on device `d` for the circular schedule; stages `d`
        and `2S - 1 - d` for the V-shaped ones (see `device_of`).

        **Arguments:**

        - `device`: a position on the pipeline axis in `[0, num_devices)`.

        **Returns:** a tuple of stage indices.

        ```python
        from eqpar.schedule import CircularSchedule, OneFOneBSchedule
        assert CircularSchedule(4, 8, num_repeats=2).stages_on(1) == (1, 5)
        assert OneFOneBSchedule(4, 8).stages_on(3) == (3,)
        ```
        """
        if not 0 <= device < self.num_devices:
            raise ValueError(f"`device` must be in [0, {self.num_devices}), got {device}.")
        stages = {row[device].stage for row in self._table}
        return tuple(sorted(stage for stage in stages if stage is not None))

    def _num_trips(self) -> int:
        """How many stages each device runs (trips round the ring, or 2 down and up a V)."""
        stages = [a.stage for row in self._table for a in row if a.stage is not None]
        return 1 + max(stages) // self.num_stages if stages else 1

    def __str__(self) -> str:
        width = max(3, *(len(a.label()) + 1 for row in self._table for a in row))
        lines = [f"{self._name}: {self.num_devices} devices, {self.num_steps} steps"]
        for device in range(self.num_devices):
            cells = "".join(row[device].label().rjust(width) for row in self._table)
            lines.append(f"device {device}:{cells}")
        return "\n".join(lines)

    def default_title(self) -> str:
        """The chart title `figure` and `plot` use when given none: what the table covers, its
        size and its bubble fraction.

        ```python
        from eqpar.schedule import GPipeSchedule
        title = GPipeSchedule(4, 8, include_backward=True).default_title()
        assert title == "GPipe schedule, training step: 4 devices, 8 microbatches, bubble 27.3%"
        ```
        """
        what = "training step" if self.has_backward else "forward pass only"
        trips = self._num_trips()
        devices = f"{self.num_devices} device{'s' if self.num_devices > 1 else ''}"
        devices += f" x {trips} stages" if trips > 1 else ""
        return (
            f"{self._name} schedule, {what}: {devices}, {self.num_microbatches} microbatch"
            f"{'es' if self.num_microbatches > 1 else ''}, bubble {self.bubble_fraction:.1%}"
        )

    def figure(self, *, title: str | None = None) -> _Figure:
        """The schedule as a Gantt chart: a matplotlib `Figure`, not written anywhere.

        One row per device of the pipeline axis (device 0 on top), labelled with the stages
        it runs (`device 0 (stage 0)`; `device 0 (stages 0, 4)` for a circular schedule), one
        column per step. Forward cells are blue, backward cells orange (weight-gradient cells
        of a zero-bubble schedule green), in one shade per stage
        of a device when it runs several; idle cells (the bubble) are grey. The number in a
        cell is the microbatch index, as the line under the title says. The legend sits
        outside the axes, below them. Needs matplotlib (`pip install eqpar[plot]`).

        **Arguments:**

        - `title`: the chart title; by default `default_title()`.

        **Returns:** a `matplotlib.figure.Figure` with an Agg canvas (not registered with
        pyplot): `fig.savefig(...)` writes it, a notebook displays it.

        ```python
        from eqpar.schedule import CircularSchedule
        schedule = CircularSchedule(2, 4, num_repeats=2, include_backward=True)
        fig = schedule.figure()
        rows = [label.get_text() for label in fig.axes[0].get_yticklabels()]
        assert rows == ["device 0 (stages 0, 2)", "device 1 (stages 1, 3)"]
        ```
        """
        from .inspect import schedule_figure  # every picture of eqpar is drawn there

        return schedule_figure(self, title=title)

    def plot(self, path: str | pathlib.Path, *, title: str | None = None) -> pathlib.Path:
        """Draw the schedule as a Gantt chart (see `figure`) and write it to a PNG file.

        Needs matplotlib (`pip install eqpar[plot]`).

        **Arguments:**

        - `path`: the PNG file to write (its folder must exist).
        - `title`: the chart title; by default `default_title()`.

        **Returns:** `path` as a `pathlib.Path`.

        ```python
        import pathlib, tempfile
        from eqpar.schedule import OneFOneBSchedule
        out = pathlib.Path(tempfile.mkdtemp()) / "1f1b.png"
        OneFOneBSchedule(num_stages=4, num_microbatches=8).plot(out)
        assert out.read_bytes()[:4] == b"\\x89PNG"
        ```
        """
        path = pathlib.Path(path)
        self.figure(title=title).savefig(path, format="png", dpi=110)
        return path


class CircularSchedule(PipelineSchedule):
    """The circular (interleaved) schedule: each device holds `num_repeats` stages.

    Stage `s` lives on device `s % num_stages`, so microbatches go round the ring
    `num_repeats` times. With `num_microbatches >= num_stages` the bubble is
    `(S - 1) / (V * M + S - 1)` for `S` devices, `V` repeats and `M` microbatches; with fewer
    microbatches than devices each trip still takes `S` steps and the bubble is larger.

    With `include_backward=True` the table adds the backward pass that autodiff of the forward
    scan runs (the same steps in reverse), as for `GPipeSchedule`: twice the steps, the same
    bubble fraction, and all `V * M` (microbatch, stage) inputs held on each device until
    their backward.

    **Arguments:**

    - `num_stages`: `S`, the size of the pipeline axis (devices).
    - `num_microbatches`: `M`.
    - `num_repeats`: `V`, the stages per device (the model has `S * V` stages).
    - `include_backward`: add the backward half of a training step.

    ```python
    from eqpar.schedule import CircularSchedule
    schedule = CircularSchedule(num_stages=4, num_microbatches=8, num_repeats=2)
    assert schedule.num_steps == 2 * 8 + 4 - 1
    assert schedule.bubble_fraction == (4 - 1) / (2 * 8 + 4 - 1)
    training = CircularSchedule(4, 8, 2, include_backward=True)
    assert training.num_steps == 2 * schedule.num_steps
    assert training.bubble_fraction == schedule.bubble_fraction
    ```
    """

    name: ClassVar[str] = "circular"  # the name every API of eqpar uses for it

    _name = "circular"

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        num_repeats: int = 1,
        *,
        include_backward: bool = False,
    ):
        owner = type(self).__name__
        self.num_stages = check_int(num_stages, name="num_stages", owner=owner)
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        self.num_repeats = check_int(num_repeats, name="num_repeats", owner=owner)
        self.include_backward = bool(include_backward)
        s, m, v = self.num_stages, self.num_microbatches, self.num_repeats
        period = max(m, s)
        num_steps = (v - 1) * period + m + s - 1
        steps = np.arange(num_steps)[:, None]
        devices = np.arange(s)[None, :]
        mb, rep = _circular_slot(
            steps, devices, num_stages=s, num_microbatches=m, num_repeats=v, xp=np
        )
        table = tuple(
            tuple(
                _IDLE
                if mb[t, d] < 0
                else Action("forward", microbatch=int(mb[t, d]), stage=int(rep[t, d]) * s + d)
                for d in range(s)
            )
            for t in range(num_steps)
        )
        if self.include_backward:
            table = table + _mirrored_backward(table)
        self._table = table


class GPipeSchedule(PipelineSchedule):
    """The GPipe schedule: every microbatch passes each device once, forward then backward.

    Forward only it takes `M + S - 1` steps with bubble `(S - 1) / (M + S - 1)`. With
    `include_backward=True` the table adds the backward pass that autodiff of the forward scan
    runs (the steps in reverse), which doubles the steps and keeps the bubble fraction; it
    stores all `M` microbatches' activations on each device until their backward.

    **Arguments:**

    - `num_stages`: `S`, the size of the pipeline axis.
    - `num_microbatches`: `M`.
    - `include_backward`: add the backward half of a training step.

    ```python
    from eqpar.schedule import GPipeSchedule
    schedule = GPipeSchedule(num_stages=4, num_microbatches=4)
    assert schedule.num_steps == 7
    assert schedule.bubble_fraction == 3 / 7
    print(schedule)
    ```
    """

    name: ClassVar[str] = "gpipe"  # the name every API of eqpar uses for it
    stages_per_device: ClassVar[int | None] = 1

    _name = "GPipe"

    def __init__(self, num_stages: int, num_microbatches: int, *, include_backward: bool = False):
        forward = CircularSchedule(num_stages, num_microbatches, 1)
        self.num_stages = forward.num_stages
        self.num_microbatches = forward.num_microbatches
        self.include_backward = bool(include_backward)
        table = forward.actions
        if self.include_backward:
            table = table + _mirrored_backward(table)
        self._table = table


class OneFOneBSchedule(PipelineSchedule):
    """The one-forward-one-backward (1F1B) training schedule.

    Device `d` runs `S - d` forwards, then alternates one backward and one forward, then
    drains the remaining backwards. It takes `2 * (M + S - 1)` steps with the GPipe bubble
    `(S - 1) / (M + S - 1)`, but device `d` never holds more than `S - d` microbatch inputs
    (GPipe holds all `M`).

    **Arguments:**

    - `num_stages`: `S`, the size of the pipeline axis.
    - `num_microbatches`: `M`.

    ```python
    from eqpar.schedule import OneFOneBSchedule
    schedule = OneFOneBSchedule(num_stages=4, num_microbatches=16)
    assert schedule.num_steps == 2 * (16 + 4 - 1)
    assert schedule.bubble_fraction == 3 / 19
    assert schedule.max_stored_inputs() == 4
    ```
    """

    name: ClassVar[str] = "1f1b"  # the name every API of eqpar uses for it
    stages_per_device: ClassVar[int | None] = 1

    _name = "1F1B"

    def __init__(self, num_stages: int, num_microbatches: int):
        owner = type(self).__name__
        self.num_stages = check_int(num_stages, name="num_stages", owner=owner)
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        s, m = self.num_stages, self.num_microbatches
        num_steps = 2 * (m + s - 1)
        steps = np.arange(num_steps)[:, None]
        devices = np.arange(s)[None, :]
        fwd, bwd = _one_f_one_b_slot(steps, devices, num_stages=s, num_microbatches=m, xp=np)
        if np.any((fwd >= 0) & (bwd >= 0)):  # pragma: no cover - guarded by the schedule tests
            raise AssertionError("1F1B timing put a forward and a backward on one step.")

        def cell(t: int, d: int) -> Action:
            if fwd[t, d] >= 0:
                return Action("forward", microbatch=int(fwd[t, d]), stage=d)
            if bwd[t, d] >= 0:
                return Action("backward", microbatch=int(bwd[t, d]), stage=d)
            return _IDLE

        self._table = tuple(tuple(cell(t, d) for d in range(s)) for t in range(num_steps))


class ZeroBubbleH1Schedule(PipelineSchedule):
    """The ZB-H1 zero-bubble training schedule: 1F1B with each backward split in two.

    A stage's backward is two separate actions: `"backward_input"` (B, the gradient of the
    stage input, which the previous stage is waiting for) and `"backward_weight"` (W, the
    gradient of the stage's weights, which nothing waits for). Each device runs, at every
    step, the first action it can in this order: a W when it already has `S` of them pending;
    else the next B once its cotangent has arrived; else the next F once its input has
    arrived, while fewer than `S - d` microbatches are between their F and their B on device
    `d` (1F1B's limit); else the oldest pending W; else nothing. The Ws so fill the steps in
    which 1F1B waits. With one step per action and `M >= S` the table takes `3M + S - 1`
    steps, a bubble of `(S - 1) / (3M + S - 1)`, where 1F1B with its backward split the
    same way would take `3 (M + S - 1)` (a bubble of `(S - 1) / (M + S - 1)`, as
    `OneFOneBSchedule` states).

    Memory: device `d` holds the stage inputs and residuals of at most `S - d` microbatches
    between F and B, as 1F1B does, plus at most `S` whose W is pending (their residuals and
    output cotangent): `max_stored_inputs()` is the total.

    **Arguments:**

    - `num_stages`: `S`, the size of the pipeline axis.
    - `num_microbatches`: `M`.

    ```python
    from eqpar.schedule import OneFOneBSchedule, ZeroBubbleH1Schedule
    schedule = ZeroBubbleH1Schedule(num_stages=4, num_microbatches=8)
    assert schedule.num_steps == 3 * 8 + 4 - 1
    assert schedule.bubble_fraction < OneFOneBSchedule(4, 8).bubble_fraction
    print(schedule)
    ```
    """

    name: ClassVar[str] = "zb-h1"  # the name every API of eqpar uses for it
    stages_per_device: ClassVar[int | None] = 1

    _name = "ZB-H1"

    def __init__(self, num_stages: int, num_microbatches: int):
        owner = type(self).__name__
        self.num_stages = check_int(num_stages, name="num_stages", owner=owner)
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        self._table = _as_actions(
            _schedule_tables.zero_bubble_h1(self.num_stages, self.num_microbatches)
        )


class ZeroBubbleVSchedule(PipelineSchedule):
    """The ZB-V zero-bubble training schedule: two stages per device in a V, each backward
    split in two.

    The model has `2 S` stages: stage `s < S` on device `s` (going down) and stage `s >= S`
    on device `2 S - 1 - s` (coming back up), so device 0 runs the first stage and the last,
    where the loss is (`device_of`). Each backward is split into `"backward_input"` (B)
    and `"backward_weight"` (W), as in `ZeroBubbleH1Schedule`. Each device runs, at every
    step, the first action it can in this order: a W when `2 S` are pending; else a B whose
    cotangent has arrived (the down stage's first); else an F whose input has arrived (the
    up stage's first) while it holds fewer than `2 S` stage inputs; else the oldest pending
    W; else nothing.

    With one step per action and `M >= 2 S` the table takes `6 M + S - 1` steps at
    `S = 1, 2, 3, 4, 8` (tested for `M` up to `4 S`; at most 2 more at `S = 5, 6, 7`, and
    more with fewer microbatches): a bubble of `(S - 1) / (6 M + S - 1)`, against ZB-H1's
    `(S - 1) / (3 M + S - 1)` for the same model in `S` stages twice as long. A device
    holds at most `2 S` stage inputs and residuals (`max_stored_inputs()`), each of a stage
    half as long as 1F1B's: the activation memory of 1F1B, whose first device holds `S`.

    Parameters are stored as for the circular schedule with two stages per device (stages
    `d` and `S + d` on device `d`, model order); the executor hands each device its up stage
    (one `ppermute` of that stage's parameters, and one of its gradients back, stated in
    `eqpar.pipeline.execute_schedule`), so checkpoints are those of every other schedule.

    **Arguments:**

    - `num_stages`: `S`, the size of the pipeline axis (the model has `2 S` stages).
    - `num_microbatches`: `M`.

    ```python
    from eqpar.schedule import ZeroBubbleVSchedule
    schedule = ZeroBubbleVSchedule(num_stages=4, num_microbatches=8)
    assert schedule.num_steps == 6 * 8 + 4 - 1
    assert schedule.bubble_fraction == (4 - 1) / (6 * 8 + 4 - 1)
    assert schedule.max_stored_inputs() == 2 * 4
    assert schedule.stages_on(0) == (0, 7)
    print(schedule)
    ```
    """

    name: ClassVar[str] = "zb-v"  # the name every API of eqpar uses for it
    stages_per_device: ClassVar[int | None] = 2
    placement: Placement = "v"

    _name = "ZB-V"

    def __init__(self, num_stages: int, num_microbatches: int):
        owner = type(self).__name__
        self.num_stages = check_int(num_stages, name="num_stages", owner=owner)
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        self._table = _as_actions(
            _schedule_tables.zero_bubble_v(self.num_stages, self.num_microbatches)
        )


class DualPipeVSchedule(PipelineSchedule):
    """DualPipeV: the V-shaped schedule of DeepSeek's DualPipe cut in half, in its published
    order.

    Placement as `ZeroBubbleVSchedule` (stage `s < S` on device `s`, stage `s >= S` on
    device `2 S - 1 - s`, the loss on device 0). Each device runs a fixed list of actions:
    `2 (S - 1 - d)` forwards of its down stage; `d + 1` pairs of forwards of both stages;
    `S - 1 - d` rounds of (up stage's input gradient, its weight gradient, up forward);
    `M - 2 S + d + 1` rounds of the main phase (down forward with up backward, up forward
    with down backward); `S - 1 - d` rounds of (up backward, up forward, down backward);
    `d + 1` pairs of backwards of both stages, split into input and weight gradients from
    the middle on; `S - 1 - d` pairs of (weight gradient, down input gradient); and the
    `d + 1` weight gradients left. Each action runs at the first step its inputs are
    there.

    DualPipeV overlaps the forward of one stage with the backward of the other in the main
    phase, so that one's compute hides the other's communication. A table cell holds one
    action, so here such a pair is its two actions on consecutive steps, and a whole
    backward (`"backward"`) takes one step like any other action: its bubble is not
    comparable to ZB-V's in wall time, and the overlap of compute with communication is
    left to the compiler. A device holds at most `2 S + 1` stage inputs (tested at
    `S = 2, 4, 8`), one more than ZB-V.

    **Arguments:**

    - `num_stages`: `S`, the size of the pipeline axis (the model has `2 S` stages).
    - `num_microbatches`: `M`, at least `2 S`.

    ```python
    from eqpar.schedule import DualPipeVSchedule
    schedule = DualPipeVSchedule(num_stages=4, num_microbatches=8)
    schedule.check()
    assert schedule.max_stored_inputs() == 2 * 4 + 1
    assert schedule.stages_on(3) == (3, 4)
    ```
    """

    name: ClassVar[str] = "dualpipe-v"  # the name every API of eqpar uses for it
    stages_per_device: ClassVar[int | None] = 2
    placement: Placement = "v"

    _name = "DualPipeV"

    def __init__(self, num_stages: int, num_microbatches: int):
        owner = type(self).__name__
        self.num_stages = check_int(num_stages, name="num_stages", owner=owner)
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        if self.num_microbatches < 2 * self.num_stages:
            raise ValueError(
                f"{owner}: DualPipeV needs at least 2 * num_stages = {2 * self.num_stages} "
                f"microbatches (its main phase pairs one stage's forward with the other's "
                f"backward); got num_microbatches={self.num_microbatches}. Use more "
                f"microbatches, or ZeroBubbleVSchedule, which takes any number."
            )
        self._table = _as_actions(
            _schedule_tables.dualpipe_v(self.num_stages, self.num_microbatches)
        )


class CustomSchedule(PipelineSchedule):
    """A schedule from a table of one's own: `actions[step][device]`, checked when made.

    The executors run any table (`eqpar.pipeline.execute_schedule` a training one,
    `execute_pipeline` the forward ones eqpar builds), so a new order of work is a new table.
    This class takes one written by hand or by a program and refuses it unless it is
    complete and in order: every row has one `Action` per device; every microbatch in
    `[0, num_microbatches)` has exactly one forward on every stage, after the previous
    stage's; and, where the table trains, exactly one `"backward"` or one `"backward_input"`
    followed by one `"backward_weight"`, each backward after the next stage's. Stage `s` runs
    on device `s % num_devices`; a table that uses stages `0 .. V S - 1` is circular with `V`
    stages per device. With `placement="v"` the table is V-shaped: `2 S` stages, stage `s`
    on device `s` going down and on device `2 S - 1 - s` coming back up (see
    `PipelineSchedule.device_of`). The error names the step, device, microbatch and stage at
    fault.

    **Arguments:**

    - `actions`: the table, a sequence of rows (steps), each a sequence of `Action`s (one per
      device of the pipeline axis).
    - `num_microbatches`: how many microbatches the table runs; the batch is cut into as many.
    - `name`: the label of its text rendering and pictures.
    - `placement`: `"ring"` (default) or `"v"`: which device runs which stage.

    ```python
    from eqpar.schedule import Action, CustomSchedule, OneFOneBSchedule

    F = lambda m, s: Action("forward", microbatch=m, stage=s)
    B = lambda m, s: Action("backward", microbatch=m, stage=s)
    idle = Action("idle")
    # Two stages, two microbatches: the last stage runs each backward right after its forward.
    table = [
        [F(0, 0), idle],
        [F(1, 0), F(0, 1)],
        [idle, B(0, 1)],
        [B(0, 0), F(1, 1)],
        [idle, B(1, 1)],
        [B(1, 0), idle],
    ]
    schedule = CustomSchedule(table, num_microbatches=2)
    assert schedule.actions == OneFOneBSchedule(2, 2).actions
    try:
        CustomSchedule(table[:-1], num_microbatches=2)  # microbatch 1 never reaches stage 0 back
    except ValueError as error:
        print(error)
    ```
    """

    def __init__(
        self,
        actions: Sequence[Sequence[Action]],
        *,
        num_microbatches: int,
        name: str = "custom",
        placement: Placement = "ring",
    ):
        owner = type(self).__name__
        self.num_microbatches = check_int(num_microbatches, name="num_microbatches", owner=owner)
        if placement not in typing.get_args(Placement):
            raise ValueError(
                f"{owner}: `placement` must be 'ring' (stage s on device s % S) or 'v' (down "
                f"the devices and back up); got {placement!r}."
            )
        self.placement = placement
        table = tuple(tuple(row) for row in actions)
        if not table or not table[0]:
            raise ValueError(
                f"{owner}: `actions` must have at least one step of at least one device; got "
                f"{len(table)} steps."
            )
        self.num_stages = len(table[0])
        self._table = table
        self._name = str(name)
        self.check()
        if placement == "v" and self._num_trips() != 2:
            raise ValueError(
                f"{owner}: a V-shaped table (placement='v') runs 2 x {self.num_stages} stages, "
                f"stage d and stage {2 * self.num_stages - 1} - d on device d; this one runs "
                f"{self.num_stages * self._num_trips()}. Use placement='ring' for one stage "
                f"per device."
            )


def _as_actions(cells: _schedule_tables.Cells) -> tuple[tuple[Action, ...], ...]:
    return tuple(
        tuple(_IDLE if c is None else Action(c[0], microbatch=c[1], stage=c[2]) for c in row)
        for row in cells
    )


__all__ = [
    "Action",
    "CircularSchedule",
    "CustomSchedule",
    "DualPipeVSchedule",
    "GPipeSchedule",
    "OneFOneBSchedule",
    "PipelineSchedule",
    "ZeroBubbleH1Schedule",
    "ZeroBubbleVSchedule",
]


# Each schedule by its name (`PipelineSchedule.name`), as `PipelineModule` and the examples
# take it.
SCHEDULES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls
    for cls in (
        GPipeSchedule,
        CircularSchedule,
        OneFOneBSchedule,
        ZeroBubbleH1Schedule,
        ZeroBubbleVSchedule,
        DualPipeVSchedule,
    )
}
