"""The tables of the schedules built by rules rather than closed forms (`eqpar.schedule`).

Each builder returns `cells[step][device]`: `(kind, microbatch, stage)` or `None` for an idle
step; `eqpar.schedule` turns them into `Action`s. Every action lasts one step, and a value
made at step `t` (an activation, a cotangent) can be used from step `t + 1` on, by its own
device or a neighbour.
"""

from collections.abc import Sequence
from typing import Literal

Kind = Literal["forward", "backward", "backward_input", "backward_weight"]
Cell = tuple[Kind, int, int] | None
Cells = list[list[Cell]]


def check_stages_per_device(
    name: str, wanted: int | None, num_repeats: int, owner: str, *, argument: str
) -> None:
    """Refuse schedule `name` for a pipeline of `num_repeats` stages per device when the
    schedule fixes another number, `wanted` (its `stages_per_device`: 1 for GPipe, 1F1B and
    ZB-H1, 2 for the V-shaped ones, `None` for any)."""
    if wanted is not None and num_repeats != wanted:
        other = (
            "'circular' for any number, 'zb-v' or 'dualpipe-v' for two"
            if wanted == 1
            else "'1f1b' or 'zb-h1' for one, 'circular' for any number"
        )
        raise ValueError(
            f"{owner}: schedule={name!r} runs {wanted} stage{'s' if wanted > 1 else ''} per "
            f"device, but {argument}={num_repeats}; pass {argument}={wanted} ({other})."
        )


def zero_bubble_h1(s: int, m_count: int) -> Cells:
    """ZB-H1 by the rules of `ZeroBubbleH1Schedule`, one step at a time."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, device) -> step

    def ready(kind: str, m: int, d: int, t: int) -> bool:
        return done.get((kind, m, d), t) < t

    table: Cells = []
    next_f, next_b, next_w = [0] * s, [0] * s, [0] * s
    while min(next_w) < m_count:
        t = len(table)
        row: list[Cell] = []
        for d in range(s):
            f, b, w = next_f[d], next_b[d], next_w[d]
            can_b = b < f and ready("F", b, d, t) and (d == s - 1 or ready("B", b, d + 1, t))
            can_f = f < m_count and f - b < s - d and (d == 0 or ready("F", f, d - 1, t))
            can_w = w < b and ready("B", w, d, t)
            if can_w and b - w >= s:
                kind = "backward_weight"
            elif can_b:
                kind = "backward_input"
            elif can_f:
                kind = "forward"
            elif can_w:
                kind = "backward_weight"
            else:
                row.append(None)
                continue
            m = {"forward": f, "backward_input": b, "backward_weight": w}[kind]
            done[({"forward": "F", "backward_input": "B"}.get(kind, "W"), m, d)] = t
            next_f[d] += kind == "forward"
            next_b[d] += kind == "backward_input"
            next_w[d] += kind == "backward_weight"
            row.append((kind, m, d))
        table.append(row)
    return table


class _VDevice:
    """What one device of a V-shaped schedule has done: per chunk (0: stage `d` going down,
    1: stage `2S - 1 - d` coming back up) the next forward and backward microbatch, the
    weight gradients left for later (oldest first) and the chunks it holds activations of."""

    def __init__(self, d: int, s: int):
        self.stages = (d, 2 * s - 1 - d)
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.pending_weights: list[tuple[int, int]] = []  # (microbatch, stage)
        self.held = 0  # forwards whose last backward action has not run


class _VTable:
    """The bookkeeping shared by the V-shaped builders: which actions have run when, and
    whether an action's inputs are there at a step."""

    def __init__(self, s: int, m_count: int):
        self.s, self.m_count = s, m_count
        self.devices = [_VDevice(d, s) for d in range(s)]
        self.done: dict[tuple[str, int, int], int] = {}  # (F or B, microbatch, stage) -> step

    def _ready(self, kind: str, m: int, stage: int, t: int) -> bool:
        return self.done.get((kind, m, stage), t) < t

    def can_forward(self, d: int, chunk: int, t: int) -> bool:
        device = self.devices[d]
        m, stage = device.next_forward[chunk], device.stages[chunk]
        return m < self.m_count and (stage == 0 or self._ready("F", m, stage - 1, t))

    def can_backward(self, d: int, chunk: int, t: int) -> bool:
        device = self.devices[d]
        m, stage = device.next_backward[chunk], device.stages[chunk]
        after_next = stage == 2 * self.s - 1 or self._ready("B", m, stage + 1, t)
        return m < device.next_forward[chunk] and self._ready("F", m, stage, t) and after_next

    def forward(self, d: int, chunk: int, t: int) -> Cell:
        device = self.devices[d]
        m, stage = device.next_forward[chunk], device.stages[chunk]
        device.next_forward[chunk] += 1
        device.held += 1
        self.done[("F", m, stage)] = t
        return ("forward", m, stage)

    def backward(self, d: int, chunk: int, t: int, *, split: bool) -> Cell:
        device = self.devices[d]
        m, stage = device.next_backward[chunk], device.stages[chunk]
        device.next_backward[chunk] += 1
        self.done[("B", m, stage)] = t
        if split:
            device.pending_weights.append((m, stage))
            return ("backward_input", m, stage)
        device.held -= 1
        return ("backward", m, stage)

    def weight(self, d: int) -> Cell:
        device = self.devices[d]
        m, stage = device.pending_weights.pop(0)
        device.held -= 1
        return ("backward_weight", m, stage)


def zero_bubble_v(s: int, m_count: int) -> Cells:
    """ZB-V by the rules of `ZeroBubbleVSchedule`, one step at a time."""
    state = _VTable(s, m_count)
    table: Cells = []
    total = 2 * s * m_count  # weight gradients: one per microbatch and stage
    finished = 0
    while finished < total:
        t = len(table)
        row: list[Cell] = []
        for d, device in enumerate(state.devices):
            backward = next((c for c in (0, 1) if state.can_backward(d, c, t)), None)
            forward = next((c for c in (1, 0) if state.can_forward(d, c, t)), None)
            if len(device.pending_weights) >= 2 * s:
                cell = state.weight(d)
            elif backward is not None:
                cell = state.backward(d, backward, t, split=True)
            elif forward is not None and device.held < 2 * s:
                cell = state.forward(d, forward, t)
            elif device.pending_weights:
                cell = state.weight(d)
            else:
                cell = None
            finished += cell is not None and cell[0] == "backward_weight"
            row.append(cell)
        table.append(row)
    return table


def _dualpipe_v_order(rank: int, s: int, m_count: int) -> list[tuple[str, int]]:
    """Device `rank`'s actions in DualPipeV's published order: `(kind, chunk)` with kinds
    `F` (forward), `B` (whole backward), `I` (input gradient, its weight gradient left for
    later) and `W` (the oldest weight gradient left, chunk ignored). An overlapped pair
    (one chunk's forward beside the other chunk's backward) is its two actions in turn."""
    order: list[tuple[str, int]] = [("F", 0)] * (2 * (s - rank - 1))  # 1: forwards down
    order += [("F", 0), ("F", 1)] * (rank + 1)  # 2: both chunks
    order += [("I", 1), ("W", 1), ("F", 1)] * (s - rank - 1)  # 3: first backwards, split
    order += [("F", 0), ("B", 1), ("F", 1), ("B", 0)] * (m_count - 2 * s + rank + 1)  # 4
    order += [("B", 1), ("F", 1), ("B", 0)] * (s - rank - 1)  # 5: the last forwards
    split = False
    for i in range(rank + 1):  # 6: both chunks' backwards, the later half split
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        order.append(("I" if split else "B", 1))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        order.append(("I" if split else "B", 0))
    order += [("W", 0), ("I", 0)] * (s - rank - 1)  # 7: the last backwards, split
    order += [("W", 0)] * (rank + 1)  # 8: the weight gradients left
    return order


def in_order(s: int, m_count: int, orders: Sequence[Sequence[tuple[str, int]]]) -> Cells:
    """The table of devices that each run a fixed list of actions in order, each action at
    the first step at which its inputs are there (see `_dualpipe_v_order` for the kinds)."""
    state = _VTable(s, m_count)
    position = [0] * s
    table: Cells = []
    while any(p < len(order) for p, order in zip(position, orders)):
        t = len(table)
        row: list[Cell] = []
        for d, order in enumerate(orders):
            cell = None
            if position[d] < len(order):
                kind, chunk = order[position[d]]
                if kind == "W":
                    cell = state.weight(d)
                elif kind == "F" and state.can_forward(d, chunk, t):
                    cell = state.forward(d, chunk, t)
                elif kind in ("B", "I") and state.can_backward(d, chunk, t):
                    cell = state.backward(d, chunk, t, split=kind == "I")
            position[d] += cell is not None
            row.append(cell)
        if all(cell is None for cell in row):  # nothing ran, so nothing ever will
            raise AssertionError("the per-device orders wait on each other")  # pragma: no cover
        table.append(row)
    return table


def dualpipe_v(s: int, m_count: int) -> Cells:
    """DualPipeV's table (see `DualPipeVSchedule`)."""
    return in_order(s, m_count, [_dualpipe_v_order(r, s, m_count) for r in range(s)])
