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
select), except in the residual buffer, the largest, which the executor gives no spare row:
a step without a forward writes a slot's rows back unchanged (its `residual_slot` then
points past the end and is not read). The same tables give the device pairs each step's
sends really need, by lane: the main direction, the other way (a V-shaped schedule's way
back up) and a device's own next stage, so that a device can take one value from each at
one step.
"""

from typing import NamedTuple

import numpy as np

from ..schedule import PipelineSchedule

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


class Lane(NamedTuple):
    """Sends beside those of the main direction (a V-shaped schedule's way back up, or a
    stage that hands its output to the next stage on the same device): a device can receive
    in several lanes at one step, one value in each.

    - `forward`: activations (`True`) or cotangents.
    - `sends`: `[num_steps]`, index into `pairs`.
    - `pairs`: the distinct `(source, target)` sets.
    - `received_slot`: `[num_steps, num_devices]`, where the value received goes (the
      buffer's spare row where none comes).
    - `local`: every pair is `(d, d)`: the value stays on its device, no collective.
    """

    forward: bool
    sends: np.ndarray
    pairs: tuple[tuple[tuple[int, int], ...], ...]
    received_slot: np.ndarray
    local: bool


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
    loss_device: int  # the device of the last stage
    # Lanes of sends besides `forward_pairs` / `backward_pairs` (none for ring placements).
    other_lanes: tuple[Lane, ...] = ()


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


def compile_schedule(
    schedule: PipelineSchedule, *, store_residuals: bool, keep_outputs: bool = False
) -> Program:
    """The executor's tables for `schedule` (see `Program`).

    With `store_residuals`, a forward keeps its stage's residuals until the last backward
    action of that microbatch and stage, and the last stage's forward keeps its output (in
    the cotangent buffer, where its backward looks for the loss input); without, backward
    actions recompute the forward from the stored stage input, and the last stage's forward
    is left to its backward, unless `keep_outputs` (a forward run differentiated by the
    table, `_table_grad`, returns the outputs): then it runs as a forward and keeps its
    output as with `store_residuals`.
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
    when = schedule._checked_steps()
    forward_at: dict[tuple[int, int], int] = {}
    backward_at: dict[tuple[int, int], int] = {}
    last_use: dict[tuple[int, int], int] = {}
    device_of = schedule.device_of
    for (action_kind, m, stage), t in when.items():
        key, d = (m, stage), device_of(stage)
        kind[t, d] = _KINDS[(action_kind, stage == last_stage)]
        microbatch[t, d] = m
        repeat[t, d] = stage // num_devices
        if action_kind == "forward":
            forward_at[key] = t
        elif action_kind in ("backward", "backward_input"):
            backward_at[key] = t
        last_use[key] = max(last_use.get(key, t), t)
    training = bool(backward_at)
    keeps_outputs = store_residuals or keep_outputs
    if training and not keeps_outputs:  # the last stage's forward happens in its backward
        kind[kind == FORWARD_LAST] = IDLE

    # Intervals per device: stage inputs from arrival to last use, cotangents likewise,
    # residuals from the forward to the last backward action.
    inputs: list[list] = [[] for _ in range(num_devices)]
    cotangents: list[list] = [[] for _ in range(num_devices)]
    residuals: list[list] = [[] for _ in range(num_devices)]
    # Sends by lane: 0 the main direction (to the next device for activations, the previous
    # one for cotangents, round the ring), 1 the other way, 2 to the same device.
    sends: dict[tuple[bool, int], list[set]] = {
        (forward, lane): [set() for _ in range(num_steps)]
        for forward in (True, False)
        for lane in range(3)
    }

    def lane(source: int, target: int, forward: bool) -> int:
        if target == (source + (1 if forward else -1)) % num_devices:
            return 0
        return 2 if target == source else 1

    def send(t: int, source: int, target: int, forward: bool) -> None:
        sends[(forward, lane(source, target, forward))][t].add((source, target))

    for (m, stage), t in forward_at.items():
        d = device_of(stage)
        end = last_use[(m, stage)] if training else t
        if stage > 0:  # stage 0 reads its input from the batch itself
            inputs[d].append((forward_at[(m, stage - 1)] + 1, end, (m, stage)))
        if stage < last_stage:
            send(t, d, device_of(stage + 1), True)
        if training and store_residuals:
            residuals[d].append((t, end, (m, stage)))
        if training and keeps_outputs and stage == last_stage:
            # its output waits for the loss in the cotangent buffer
            cotangents[d].append((t, end, (m, stage)))
    for (m, stage), t in backward_at.items():
        d = device_of(stage)
        if stage < last_stage:
            cotangents[d].append(
                (backward_at[(m, stage + 1)] + 1, last_use[(m, stage)], (m, stage))
            )
        elif not keeps_outputs and last_use[(m, stage)] > t:  # d(output) waits for its W
            cotangents[d].append((t, last_use[(m, stage)], (m, stage)))
        if stage > 0:
            send(t, d, device_of(stage - 1), False)
    input_slots, num_input_slots = _allocate(inputs)
    cotangent_slots, num_cotangent_slots = _allocate(cotangents)
    residual_slots, num_residual_slots = _allocate(residuals)

    def filled(spare: int) -> np.ndarray:
        return np.full(shape, spare, np.int32)

    input_slot = filled(-1)
    cotangent_slot = filled(num_cotangent_slots)
    residual_slot = filled(num_residual_slots)
    received_slots = {
        (forward, lane): filled(num_input_slots if forward else num_cotangent_slots)
        for forward, lane in sends
    }
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
            d, source = device_of(stage), device_of(stage - 1)
            received = received_slots[(True, lane(source, d, True))]
            received[forward_at[(m, stage - 1)] + 1, d] = input_slots[(d, (m, stage))]
    for m, stage in backward_at:
        if stage < last_stage:
            d, source = device_of(stage), device_of(stage + 1)
            arrival = backward_at[(m, stage + 1)] + 1
            received = received_slots[(False, lane(source, d, False))]
            received[arrival, d] = cotangent_slots[(d, (m, stage))]
    for step_sends in sends.values():  # one value per device and lane at each step
        for pairs in step_sends:
            targets = [target for _, target in pairs]
            if len(set(targets)) != len(targets):
                raise AssertionError(f"one lane of a step sends twice to one device: {pairs}")
    forward_index, forward_pairs = _send_patterns(sends[(True, 0)])
    backward_index, backward_pairs = _send_patterns(sends[(False, 0)])
    other_lanes = []
    for (forward, lane_index), step_sends in sends.items():
        if lane_index == 0 or not any(step_sends):
            continue
        index, pairs = _send_patterns(step_sends)
        other_lanes.append(
            Lane(forward, index, pairs, received_slots[(forward, lane_index)], lane_index == 2)
        )
    return Program(
        kind=kind,
        microbatch=microbatch,
        repeat=repeat,
        input_slot=input_slot,
        cotangent_slot=cotangent_slot,
        residual_slot=residual_slot,
        received_input_slot=received_slots[(True, 0)],
        received_cotangent_slot=received_slots[(False, 0)],
        forward_sends=forward_index,
        backward_sends=backward_index,
        forward_pairs=forward_pairs,
        backward_pairs=backward_pairs,
        num_input_slots=num_input_slots,
        num_cotangent_slots=num_cotangent_slots,
        num_residual_slots=num_residual_slots,
        num_repeats=num_repeats,
        loss_device=device_of(last_stage),
        other_lanes=tuple(other_lanes),
    )
