"""A pipeline schedule compiled into the per-device program that `eqpar.pipeline` runs.

A schedule (`eqpar.schedule`) says what every device does at every step. To run it, each
device also needs to know where the values it works on wait between steps: the stage inputs
it received, the cotangents coming back, what a forward stores for its backward. This module
reads that off the table once, with NumPy, as integer tables indexed `[step, device]`, so
that the executor's `lax.scan` body is the same for every schedule and only looks things up.
A value occupies a buffer slot from the step it arrives (or is made) to the step of its last
use; slots are handed out first-free per device, so a buffer holds as many values as the
schedule keeps alive at once, and no more. Row `num_slots` of each buffer is a spare that
takes the writes of steps with nothing to keep (an unconditional write is cheaper than a
select). The same tables give the device pairs each step's sends really need.
"""

from typing import NamedTuple

import numpy as np

from ..schedule import _BACKWARD_KINDS, Action, PipelineSchedule

# What a device does at a step: the executor's branch index.
IDLE = 0
FORWARD = 1  # a stage that is not the model's last: its output goes to the next stage
FORWARD_LAST = 2  # the model's last stage: its output stays for the loss
BACKWARD = 3  # input and weight gradients together
BACKWARD_LAST = 4  # the same for the last stage, with the loss
BACKWARD_INPUT = 5  # the input gradient only (zero-bubble schedules); weights later
BACKWARD_INPUT_LAST = 6
BACKWARD_WEIGHT = 7  # the weight gradient left over by a BACKWARD_INPUT
NUM_KINDS = 8

_KINDS = {
    ("forward", False): FORWARD,
    ("forward", True): FORWARD_LAST,
    ("backward", False): BACKWARD,
    ("backward", True): BACKWARD_LAST,
    ("backward_input", False): BACKWARD_INPUT,
    ("backward_input", True): BACKWARD_INPUT_LAST,
    ("backward_weight", False): BACKWARD_WEIGHT,
    ("backward_weight", True): BACKWARD_WEIGHT,
}


class Program(NamedTuple):
    """Integer tables `[num_steps, num_devices]` (except where noted) for the executor."""

    kind: np.ndarray  # branch index (IDLE, FORWARD, ...)
    microbatch: np.ndarray  # the microbatch of the action (0 when idle)
    repeat: np.ndarray  # which of the device's stages: stage // num_devices
    input_slot: np.ndarray  # where the action's stage input waits (-1: read from the batch)
    cotangent_slot: np.ndarray  # where its cotangent (or the last stage's output) waits
    residual_slot: np.ndarray  # where a forward stores / a backward finds the residuals
    received_input_slot: np.ndarray  # where the activation received this step goes
    received_cotangent_slot: np.ndarray  # where the cotangent received this step goes
    forward_sends: np.ndarray  # [num_steps]: index into forward_pairs
    backward_sends: np.ndarray  # [num_steps]: index into backward_pairs
    forward_pairs: tuple[tuple[tuple[int, int], ...], ...]  # distinct (source, target) sets
    backward_pairs: tuple[tuple[tuple[int, int], ...], ...]
    num_input_slots: int
    num_cotangent_slots: int
    num_residual_slots: int
    num_repeats: int


def _allocate(intervals: list[list[tuple[int, int, tuple]]]) -> tuple[dict, int]:
    """First-free slots for `[first, last]` step intervals, per device: `{(device, key):
    slot}` and the number of slots the busiest device needs."""
    slots: dict = {}
    most = 0
    for device, spans in enumerate(intervals):
        free_after: list[int] = []  # per slot: the last step it is taken
        for first, last, key in sorted(spans):
            slot = next((i for i, end in enumerate(free_after) if end < first), len(free_after))
            if slot == len(free_after):
                free_after.append(last)
            free_after[slot] = last
            slots[(device, key)] = slot
        most = max(most, len(free_after))
    return slots, most


def _send_patterns(sends: list[set]) -> tuple[np.ndarray, tuple]:
    patterns: list[tuple] = []
    index = np.zeros(len(sends), np.int32)
    for step, pairs in enumerate(sends):
        pattern = tuple(sorted(pairs))
        if pattern not in patterns:
            patterns.append(pattern)
        index[step] = patterns.index(pattern)
    return index, tuple(patterns)


def _acted_on(schedule: PipelineSchedule) -> dict[tuple[str, int, int], int]:
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
            if action.stage % num_devices != d:
                problem = "not on its stage's device (stage % num_devices)."
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


def _check_order(schedule: PipelineSchedule, when: dict[tuple[str, int, int], int]) -> None:
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


def check_table(schedule: PipelineSchedule) -> dict[tuple[str, int, int], int]:
    """Raise unless `schedule`'s table is complete and in order (see `_acted_on` and
    `_check_order`); return the step of every action by `(kind, microbatch, stage)`."""
    when = _acted_on(schedule)
    _check_order(schedule, when)
    return when


def compile_schedule(schedule: PipelineSchedule, *, store_residuals: bool) -> Program:
    """The executor's tables for `schedule` (see `Program`).

    With `store_residuals`, a forward keeps its stage's residuals until the last backward
    action of that microbatch and stage, and the last stage's forward keeps its output (in
    the cotangent buffer, where its backward looks for the loss input); without, backward
    actions recompute the forward from the stored stage input, and the last stage's forward
    is left to its backward.
    """
    table = schedule.actions
    num_steps, num_devices = len(table), schedule.num_devices
    num_repeats = schedule._num_trips()
    last_stage = num_devices * num_repeats - 1
    shape = (num_steps, num_devices)
    kind = np.zeros(shape, np.int32)
    microbatch = np.zeros(shape, np.int32)
    repeat = np.zeros(shape, np.int32)

    # When each (microbatch, stage) is acted on: forward, (input) backward, last use.
    when = check_table(schedule)
    forward_at: dict[tuple[int, int], int] = {}
    backward_at: dict[tuple[int, int], int] = {}
    last_use: dict[tuple[int, int], int] = {}
    for (action_kind, m, stage), t in when.items():
        key, d = (m, stage), stage % num_devices
        kind[t, d] = _KINDS[(action_kind, stage == last_stage)]
        microbatch[t, d] = m
        repeat[t, d] = stage // num_devices
        if action_kind == "forward":
            forward_at[key] = t
        elif action_kind in ("backward", "backward_input"):
            backward_at[key] = t
        last_use[key] = max(last_use.get(key, t), t)
    training = bool(backward_at)
    if training and not store_residuals:  # the last stage's forward happens in its backward
        kind[kind == FORWARD_LAST] = IDLE

    # Intervals per device: stage inputs from arrival to last use, cotangents likewise,
    # residuals from the forward to the last backward action.
    inputs: list[list] = [[] for _ in range(num_devices)]
    cotangents: list[list] = [[] for _ in range(num_devices)]
    residuals: list[list] = [[] for _ in range(num_devices)]
    forward_sends: list[set] = [set() for _ in range(num_steps)]
    backward_sends: list[set] = [set() for _ in range(num_steps)]
    for (m, stage), t in forward_at.items():
        d = stage % num_devices
        end = last_use[(m, stage)] if training else t
        if stage > 0:  # stage 0 reads its input from the batch itself
            inputs[d].append((forward_at[(m, stage - 1)] + 1, end, (m, stage)))
        if stage < last_stage:
            forward_sends[t].add((d, (d + 1) % num_devices))
        if training and store_residuals:
            residuals[d].append((t, end, (m, stage)))
            if stage == last_stage:  # its output waits for the loss in the cotangent buffer
                cotangents[d].append((t, end, (m, stage)))
    for (m, stage), t in backward_at.items():
        d = stage % num_devices
        if stage < last_stage:
            cotangents[d].append(
                (backward_at[(m, stage + 1)] + 1, last_use[(m, stage)], (m, stage))
            )
        elif not store_residuals and last_use[(m, stage)] > t:  # d(output) waits for its W
            cotangents[d].append((t, last_use[(m, stage)], (m, stage)))
        if stage > 0:
            backward_sends[t].add((d, (d - 1) % num_devices))
    input_slots, num_input_slots = _allocate(inputs)
    cotangent_slots, num_cotangent_slots = _allocate(cotangents)
    residual_slots, num_residual_slots = _allocate(residuals)

    def filled(spare: int) -> np.ndarray:
        return np.full(shape, spare, np.int32)

    input_slot = filled(-1)
    cotangent_slot = filled(num_cotangent_slots)
    residual_slot = filled(num_residual_slots)
    received_input_slot = filled(num_input_slots)
    received_cotangent_slot = filled(num_cotangent_slots)
    for t, row in enumerate(table):
        for d, action in enumerate(row):
            if action.kind == "idle":
                continue
            key = (action.microbatch, action.stage)
            input_slot[t, d] = input_slots.get((d, key), -1)
            cotangent_slot[t, d] = cotangent_slots.get((d, key), num_cotangent_slots)
            residual_slot[t, d] = residual_slots.get((d, key), num_residual_slots)
    for m, stage in forward_at:
        if stage > 0:
            d = stage % num_devices
            received_input_slot[forward_at[(m, stage - 1)] + 1, d] = input_slots[(d, (m, stage))]
    for m, stage in backward_at:
        if stage < last_stage:
            d = stage % num_devices
            arrival = backward_at[(m, stage + 1)] + 1
            received_cotangent_slot[arrival, d] = cotangent_slots[(d, (m, stage))]
    forward_index, forward_pairs = _send_patterns(forward_sends)
    backward_index, backward_pairs = _send_patterns(backward_sends)
    return Program(
        kind=kind,
        microbatch=microbatch,
        repeat=repeat,
        input_slot=input_slot,
        cotangent_slot=cotangent_slot,
        residual_slot=residual_slot,
        received_input_slot=received_input_slot,
        received_cotangent_slot=received_cotangent_slot,
        forward_sends=forward_index,
        backward_sends=backward_index,
        forward_pairs=forward_pairs,
        backward_pairs=backward_pairs,
        num_input_slots=num_input_slots,
        num_cotangent_slots=num_cotangent_slots,
        num_residual_slots=num_residual_slots,
        num_repeats=num_repeats,
    )
