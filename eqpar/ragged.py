"""Splitting a ragged batch of sequences over devices by row offsets.

A ragged batch stores `B` sequences of different lengths back to back in one `input` array of
shape `[tokens, *features]`, with `input_row_offsets` of length `B + 1` saying where each
sequence starts: sequence `b` is `input[input_row_offsets[b] : input_row_offsets[b + 1]]`.
Data parallelism over such a batch gives each device a contiguous run of whole sequences,
described by `data_parallel_splits` (length `num_devices + 1`, in units of sequences): device
`i` gets sequences `data_parallel_splits[i] : data_parallel_splits[i + 1]`.

Two forms are provided:

- host side, exact shapes: `split_batch` / `split_batch_replicated` return one array per
  device (its tokens and its row offsets rebased to 0), each placed on its device;
  `balanced_splits` chooses splits that even out the token counts.
- jittable, fixed shapes: `pack_splits` packs every device's tokens into a
  `[num_devices, capacity, *features]` array with padded offsets, a validity mask and an
  overflow flag (a `PackedBatch`), and `unpack_splits` undoes it. Offsets and splits may be
  traced values here.
"""

import functools
from collections.abc import Sequence
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, Bool, Int, Int64, Integer, Shaped

from ._checks import check_int

__all__ = [
    "PackedBatch",
    "RaggedSplit",
    "balanced_splits",
    "pack_splits",
    "split_batch",
    "split_batch_replicated",
    "unpack_splits",
]

_ArrayOrHost = Array | np.ndarray
_IntegerValues = Integer[_ArrayOrHost, " _"] | Sequence[int | np.integer]
_SHOWN_ENTRIES = 12


class RaggedSplit(NamedTuple):
    """What `split_batch` and `split_batch_replicated` return: one entry per device.

    It is a tuple, so `tokens, row_offsets = split_batch(...)` works.

    - `tokens`: `tokens[i]` is device `i`'s slice of the input, shape `[n_i, *features]`
      (`n_i` may be 0), placed on `devices[i]`.
    - `row_offsets`: `row_offsets[i]` has one more entry than device `i` has sequences,
      starts at 0 and ends at `n_i`; placed on `devices[i]`.

    ```python
    import jax
    import numpy as np
    from eqpar.ragged import RaggedSplit, split_batch

    split = split_batch(jax.devices()[:2], np.arange(5.0), [0, 2, 5], [0, 1, 2])
    assert isinstance(split, RaggedSplit)
    tokens, row_offsets = split  # a tuple of two lists, one entry per device
    assert split.tokens is tokens and [t.shape for t in tokens] == [(2,), (3,)]
    assert [o.tolist() for o in split.row_offsets] == [[0, 2], [0, 3]]
    ```
    """

    tokens: list[Array]
    row_offsets: list[Array]


# ---------------------------------------------------------------------------------------------
# Validation shared by every entry point.


def _show(values: np.ndarray) -> str:
    """A short printable form of a 1-D integer array for error messages."""
    items = [str(int(v)) for v in values[:_SHOWN_ENTRIES]]
    if values.shape[0] > _SHOWN_ENTRIES:
        items.append(f"... ({values.shape[0]} entries)")
    return "[" + ", ".join(items) + "]"


def _is_traced(value: object) -> bool:
    if isinstance(value, Tracer):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, Tracer) for item in value)
    return False


def _reject_traced(name: str, value: object, function: str) -> None:
    if _is_traced(value):
        raise TypeError(
            f"{function}: `{name}` is a traced value (the call happens inside `jax.jit`, "
            "`vmap`, `grad` or `shard_map`), but this function slices with concrete host-side "
            "numbers and returns arrays whose shapes depend on them. Call it outside the "
            "transformation with concrete values, or use `eqpar.ragged.pack_splits`, which "
            "works on traced offsets and splits with a fixed capacity."
        )


def _host_integers(name: str, value: object) -> np.ndarray:
    """`value` as a 1-D int64 numpy array, or a TypeError/ValueError naming `name`."""
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(
            f"`{name}` must be one-dimensional, got shape {array.shape}. Pass a flat list or "
            "array of integers."
        )
    if array.size == 0 and array.dtype.kind == "f":
        # `np.asarray([])` is float64; an empty list is still a list of integers.
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"`{name}` must hold integers, got dtype {array.dtype}. Cast it, e.g. "
            f"`np.asarray({name}, dtype=np.int64)`."
        )
    return array.astype(np.int64)


def _check_row_offsets(name: str, offsets: np.ndarray, num_tokens: int | None) -> None:
    if offsets.shape[0] == 0:
        raise ValueError(
            f"`{name}` must have at least one entry (a batch of B sequences has B + 1 row "
            "offsets; an empty batch has the single offset [0]), got an empty array."
        )
    if offsets[0] != 0:
        raise ValueError(
            f"`{name}` must start at 0 (the first sequence starts at the first token), got "
            f"{int(offsets[0])}: {_show(offsets)}."
        )
    steps = np.diff(offsets)
    if np.any(steps < 0):
        bad = int(np.argmax(steps < 0)) + 1
        raise ValueError(
            f"`{name}` must be non-decreasing (a sequence cannot end before it starts), but "
            f"entry {bad} ({int(offsets[bad])}) is smaller than entry {bad - 1} "
            f"({int(offsets[bad - 1])}): {_show(offsets)}."
        )
    if num_tokens is not None and offsets[-1] != num_tokens:
        consequence = (
            f"tokens {int(offsets[-1])}..{num_tokens - 1} would be dropped"
            if offsets[-1] < num_tokens
            else "the last sequences would point past the end of `input`"
        )
        raise ValueError(
            f"`{name}` must end at the number of tokens, input.shape[0] = {num_tokens}, got "
            f"{int(offsets[-1])} ({consequence}): {_show(offsets)}. Offsets and input must "
            "describe the same batch."
        )


def _check_splits(name: str, splits: np.ndarray, num_sequences: int, num_devices: int) -> None:
    if splits.shape[0] != num_devices + 1:
        raise ValueError(
            f"`{name}` must have len(devices) + 1 = {num_devices + 1} entries (the first "
            f"sequence of each of the {num_devices} devices, then the end of the batch), got "
            f"{splits.shape[0]}: {_show(splits)}."
        )
    if splits[0] != 0:
        raise ValueError(
            f"`{name}` must start at 0 (device 0 starts with the first sequence), got "
            f"{int(splits[0])}: {_show(splits)}; sequences before it would be dropped."
        )
    steps = np.diff(splits)
    if np.any(steps < 0):
        bad = int(np.argmax(steps < 0)) + 1
        raise ValueError(
            f"`{name}` must be non-decreasing (device {bad - 1} cannot end before it starts), "
            f"but entry {bad} ({int(splits[bad])}) is smaller than entry {bad - 1} "
            f"({int(splits[bad - 1])}): {_show(splits)}."
        )
    if splits[-1] != num_sequences:
        consequence = (
            "the last sequences would be dropped"
            if splits[-1] < num_sequences
            else "the last device would read sequences that do not exist"
        )
        raise ValueError(
            f"`{name}` must end at the number of sequences, len(input_row_offsets) - 1 = "
            f"{num_sequences}, got {int(splits[-1])} ({consequence}): {_show(splits)}."
        )


def _check_devices(devices: object, function: str) -> list[jax.Device]:  # pyright: ignore[reportInvalidTypeForm]
    if not isinstance(devices, Sequence) or isinstance(devices, str):
        raise TypeError(
            f"{function}: `devices` must be a list of `jax.Device`s (e.g. `jax.devices()[:4]`), "
            f"got {type(devices).__name__}."
        )
    devices = list(devices)
    if not devices:
        raise ValueError(f"{function}: `devices` is empty; pass at least one `jax.Device`.")
    for index, device in enumerate(devices):
        if not isinstance(device, jax.Device):
            raise TypeError(
                f"{function}: devices[{index}] must be a `jax.Device`, got "
                f"{type(device).__name__}. Take devices from `jax.devices()` or "
                "`list(mesh.devices.flat)`."
            )
    return devices


def _input_shape(input: object, function: str) -> tuple[int, ...]:
    """The shape of `input`, which must be an array with a leading token axis."""
    if not isinstance(input, jax.Array | np.ndarray):
        raise TypeError(
            f"{function}: `input` must be a jax.Array or numpy array of shape [tokens, "
            f"*features]; got a {type(input).__name__}. Convert it first, e.g. "
            f"`np.asarray(input)`, so its dtype is explicit."
        )
    _feature_check(tuple(input.shape))
    return tuple(input.shape)


def _feature_check(input_shape: tuple[int, ...]) -> None:
    if len(input_shape) == 0:
        raise ValueError(
            "`input` must have a leading token axis, shape [tokens, *features], got a scalar."
        )


# ---------------------------------------------------------------------------------------------
# Host-side split with exact per-device shapes.


def split_batch(
    devices: Sequence[jax.Device],  # pyright: ignore[reportInvalidTypeForm]
    input: Shaped[_ArrayOrHost, " tokens *features"],
    input_row_offsets: _IntegerValues,
    data_parallel_splits: _IntegerValues,
) -> RaggedSplit:
    """Split a ragged batch into contiguous runs of whole sequences, one run per device.

    Device `i` gets sequences `data_parallel_splits[i]` up to (not including)
    `data_parallel_splits[i + 1]`: their tokens, and their row offsets shifted so they start at
    0. Each piece is placed on `devices[i]` with `jax.device_put`. The slicing arithmetic runs
    on the host, so `input_row_offsets` and `data_parallel_splits` must be concrete (not traced
    inside `jax.jit`); inside `jit`, use [`pack_splits`][eqpar.ragged.pack_splits].

    Nothing is dropped or padded: the pieces concatenated in order give back `input`, and the
    rebased offsets shifted back and joined give back `input_row_offsets`. A device whose split
    is empty gets zero tokens (shape `[0, *features]`) and the offsets `[0]`.

    **Arguments:**

    - `devices`: the `jax.Device`s to place the pieces on, one per split.
    - `input`: the tokens of all sequences back to back, shape `[tokens, *features]`, as a
      numpy array (copied straight to each device) or a `jax.Array` (sliced where it lives,
      then moved).
    - `input_row_offsets`: `B + 1` non-decreasing integers from 0 to `tokens`; sequence `b`
      is `input[input_row_offsets[b]:input_row_offsets[b + 1]]`.
    - `data_parallel_splits`: `len(devices) + 1` non-decreasing integers from 0 to `B`, in
      units of sequences. [`balanced_splits`][eqpar.ragged.balanced_splits] computes even
      ones.

    **Returns:** a [`RaggedSplit`][eqpar.ragged.RaggedSplit] `(tokens, row_offsets)`: two lists
    with one array per device. `row_offsets[i]` has the integer dtype of
    `input_row_offsets` (as JAX stores it: `int32` unless 64-bit mode is on).

    Raises `ValueError` when the splits or offsets do not describe the batch exactly (wrong
    length, not starting at 0, decreasing, not ending at the number of sequences / tokens) and
    `TypeError` when offsets or splits are traced values.

    ```python
    import jax
    import numpy as np
    from eqpar.ragged import split_batch

    # 4 sequences of lengths 2, 3, 1, 2 (8 tokens of 3 features), split 2 + 2 over 2 devices.
    tokens = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    offsets = [0, 2, 5, 6, 8]
    devices = jax.devices()[:2]
    pieces, piece_offsets = split_batch(devices, tokens, offsets, [0, 2, 4])
    assert pieces[0].shape == (5, 3) and pieces[1].shape == (3, 3)
    assert piece_offsets[0].tolist() == [0, 2, 5] and piece_offsets[1].tolist() == [0, 1, 3]
    assert pieces[1].devices() == {devices[1]}
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in pieces]), tokens)
    ```
    """
    function = "split_batch"
    devices = _check_devices(devices, function)
    _reject_traced("input", input, function)
    _reject_traced("input_row_offsets", input_row_offsets, function)
    _reject_traced("data_parallel_splits", data_parallel_splits, function)
    _input_shape(input, function)
    offsets = _host_integers("input_row_offsets", input_row_offsets)
    splits = _host_integers("data_parallel_splits", data_parallel_splits)
    _check_row_offsets("input_row_offsets", offsets, int(input.shape[0]))
    _check_splits("data_parallel_splits", splits, offsets.shape[0] - 1, len(devices))

    source_dtype = getattr(input_row_offsets, "dtype", None)
    if source_dtype is None:  # a list of Python ints
        source_dtype = np.asarray(input_row_offsets).dtype
    offsets_dtype = _stored_dtype(source_dtype, offsets)
    token_pieces = []
    offset_pieces = []
    for device_index in range(len(devices)):
        first, end = int(splits[device_index]), int(splits[device_index + 1])
        begin_token, end_token = int(offsets[first]), int(offsets[end])
        if isinstance(input, jax.Array):
            token_pieces.append(_take_rows(input, begin_token, size=end_token - begin_token))
        else:
            token_pieces.append(input[begin_token:end_token])
        offset_pieces.append((offsets[first : end + 1] - begin_token).astype(offsets_dtype))
    placed_tokens = jax.device_put(token_pieces, devices)
    placed_offsets = jax.device_put(offset_pieces, devices)
    return RaggedSplit(tokens=list(placed_tokens), row_offsets=list(placed_offsets))


def _stored_dtype(source_dtype: object, offsets: np.ndarray) -> np.dtype:
    """The dtype JAX stores `source_dtype` integers in, checked to hold every offset."""
    stored = np.dtype(jax.dtypes.canonicalize_dtype(source_dtype))  # type: ignore[arg-type]
    if offsets.shape[0] and int(offsets.max()) > np.iinfo(stored).max:
        raise ValueError(
            f"`input_row_offsets` reaches {int(offsets.max())}, more than {stored} holds. "
            "Enable 64-bit mode (`jax.config.update('jax_enable_x64', True)`) or split the "
            "batch into smaller ones."
        )
    return stored


# ---------------------------------------------------------------------------------------------
# Host-side split of data that every device already holds.


def _per_device_copies(
    name: str,
    value: object,
    devices: list[jax.Device],  # pyright: ignore[reportInvalidTypeForm]
    function: str,
) -> list[Array]:
    """Each device's own copy of `value`, checked to live on that device and nowhere else."""
    if isinstance(value, jax.Array):
        if not value.is_fully_replicated:
            raise ValueError(
                f"{function}: `{name}` is one jax.Array with sharding {value.sharding}, which "
                "is not fully replicated, so not every device holds the whole batch. Pass a "
                "replicated array (e.g. `NamedSharding(mesh, PartitionSpec())`) or a list with "
                "one copy per device."
            )
        by_device = {shard.device: shard.data for shard in value.addressable_shards}
        copies = []
        for index, device in enumerate(devices):
            if device not in by_device:
                raise ValueError(
                    f"{function}: devices[{index}] = {device!r} holds no copy of `{name}` (its "
                    f"copies live on {sorted(by_device, key=lambda d: d.id)}). Replicate it "
                    "onto every device in `devices`, or use `split_batch` to copy host data."
                )
            copies.append(by_device[device])
        return copies
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(
            f"{function}: `{name}` must be a list with one jax.Array per device (each already "
            f"on its device), or one fully replicated jax.Array; got {type(value).__name__}."
        )
    copies = list(value)
    if len(copies) != len(devices):
        raise ValueError(
            f"{function}: `{name}` must hold one copy per device, len(devices) = {len(devices)}, "
            f"got {len(copies)} copies."
        )
    for index, (copy, device) in enumerate(zip(copies, devices)):
        if not isinstance(copy, jax.Array):
            raise TypeError(
                f"{function}: {name}[{index}] must be a jax.Array already on devices[{index}] "
                f"= {device!r}, got {type(copy).__name__}. This variant never moves data; put "
                f"it there first (`jax.device_put(x, devices[{index}])`) or use `split_batch`."
            )
        if copy.devices() != {device}:
            raise ValueError(
                f"{function}: {name}[{index}] lives on {sorted(copy.devices(), key=lambda d: d.id)}"
                f" but must live on devices[{index}] = {device!r} only. This variant slices each "
                "device's own copy and moves nothing between devices; put the copy there "
                f"(`jax.device_put(x, devices[{index}])`) or use `split_batch`."
            )
    return copies


def split_batch_replicated(
    devices: Sequence[jax.Device],  # pyright: ignore[reportInvalidTypeForm]
    input: Sequence[Shaped[Array, " tokens *features"]] | Shaped[Array, " tokens *features"],
    input_row_offsets: Sequence[Integer[Array, " offsets"]] | Integer[Array, " offsets"],
    input_row_offsets_int64: Integer[np.ndarray, " host_offsets"] | Sequence[int | np.integer],
    data_parallel_splits: _IntegerValues,
    *,
    check_replicas: bool = True,
) -> RaggedSplit:
    """Split a ragged batch that every device already holds, slicing each device's own copy.

    Same result as [`split_batch`][eqpar.ragged.split_batch], for the case where the whole
    batch is already on every device (for example after a replicated `device_put` or a
    broadcast). Device `i` slices its own copy of `input` and `input_row_offsets`, so no
    tokens move between devices and nothing travels through the host.

    **Arguments:**

    - `devices`: the `jax.Device`s, one per split.
    - `input`: the tokens, `[tokens, *features]`, either as a list whose item `i` is a
      `jax.Array` on `devices[i]` only, or as one fully replicated `jax.Array` with a copy on
      every device in `devices`.
    - `input_row_offsets`: the row offsets in the same two forms (item `i` on `devices[i]`).
      The rebased offsets are computed from these device copies and keep their dtype.
    - `input_row_offsets_int64`: a host copy of the same offsets (a numpy integer array or a
      list, read as int64). The host needs the numbers to choose where to slice; taking them
      from this copy avoids reading each device's offsets back to the host. It is validated
      like `split_batch`'s offsets.
    - `data_parallel_splits`: `len(devices) + 1` non-decreasing integers from 0 to `B`.
    - `check_replicas`: compare every device's offsets with the host copy first (one small
      device-to-host read per device) and raise on any difference; a wrong host copy would
      otherwise cut the batch in the wrong places. Switch it off in a hot loop once the input
      pipeline is trusted.

    **Returns:** a [`RaggedSplit`][eqpar.ragged.RaggedSplit] `(tokens, row_offsets)`, one
    array per device, item `i` on `devices[i]`.

    ```python
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from eqpar.ragged import split_batch_replicated

    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("data",))
    everywhere = NamedSharding(mesh, PartitionSpec())
    offsets = np.array([0, 2, 5, 6, 8], dtype=np.int64)
    tokens = jax.device_put(np.arange(8, dtype=np.int32), everywhere)
    pieces, piece_offsets = split_batch_replicated(
        devices, tokens, jax.device_put(offsets.astype(np.int32), everywhere), offsets, [0, 2, 4]
    )
    assert pieces[0].tolist() == [0, 1, 2, 3, 4] and pieces[1].tolist() == [5, 6, 7]
    assert piece_offsets[1].tolist() == [0, 1, 3] and pieces[1].devices() == {devices[1]}
    ```
    """
    function = "split_batch_replicated"
    devices = _check_devices(devices, function)
    _reject_traced("input", input, function)
    _reject_traced("input_row_offsets", input_row_offsets, function)
    _reject_traced("input_row_offsets_int64", input_row_offsets_int64, function)
    _reject_traced("data_parallel_splits", data_parallel_splits, function)
    if isinstance(input_row_offsets_int64, jax.Array):
        raise TypeError(
            f"{function}: `input_row_offsets_int64` must be the host copy of the offsets (a "
            "numpy array or a list), got a jax.Array; reading it would wait for the device. "
            "Keep the numpy offsets your input pipeline produced, or pass "
            "`np.asarray(offsets, dtype=np.int64)`."
        )
    token_copies = _per_device_copies("input", input, devices, function)
    offset_copies = _per_device_copies("input_row_offsets", input_row_offsets, devices, function)

    reference = token_copies[0]
    _feature_check(tuple(reference.shape))
    for index, copy in enumerate(token_copies):
        if copy.shape != reference.shape or copy.dtype != reference.dtype:
            raise ValueError(
                f"{function}: input[{index}] has shape {copy.shape} and dtype {copy.dtype}, but "
                f"input[0] has shape {reference.shape} and dtype {reference.dtype}; every "
                "device must hold a copy of the same batch."
            )
    host_offsets = _host_integers("input_row_offsets_int64", input_row_offsets_int64)
    _check_row_offsets("input_row_offsets_int64", host_offsets, int(reference.shape[0]))
    for index, copy in enumerate(offset_copies):
        if copy.ndim != 1 or copy.shape[0] != host_offsets.shape[0]:
            raise ValueError(
                f"{function}: input_row_offsets[{index}] has shape {copy.shape}, but the host "
                f"copy `input_row_offsets_int64` has {host_offsets.shape[0]} entries; they must "
                "be copies of the same offsets."
            )
        if not jnp.issubdtype(copy.dtype, jnp.integer):
            raise TypeError(
                f"{function}: input_row_offsets[{index}] must hold integers, got {copy.dtype}."
            )
    if check_replicas:
        for index, copy in enumerate(offset_copies):
            on_device = np.asarray(copy).astype(np.int64)
            if not np.array_equal(on_device, host_offsets):
                raise ValueError(
                    f"{function}: input_row_offsets[{index}] (on {devices[index]!r}) is "
                    f"{_show(on_device)} but the host copy `input_row_offsets_int64` is "
                    f"{_show(host_offsets)}; they must be the same offsets. Rebuild the host "
                    "copy from the batch you placed on the devices."
                )
    splits = _host_integers("data_parallel_splits", data_parallel_splits)
    _check_splits("data_parallel_splits", splits, host_offsets.shape[0] - 1, len(devices))

    token_pieces = []
    offset_pieces = []
    for device_index, (tokens, offsets) in enumerate(zip(token_copies, offset_copies)):
        first, end = int(splits[device_index]), int(splits[device_index + 1])
        begin_token, end_token = int(host_offsets[first]), int(host_offsets[end])
        # A computation on a committed single-device array runs on that device.
        token_pieces.append(_take_rows(tokens, begin_token, size=end_token - begin_token))
        offset_pieces.append(_rebased_rows(offsets, first, size=end - first + 1))
    return RaggedSplit(tokens=token_pieces, row_offsets=offset_pieces)


# The start is a traced argument so that a new batch with the same piece sizes reuses the
# compiled slice; a static slice would compile once per start position.
@functools.partial(jax.jit, static_argnames=("size",))
def _take_rows(array: Array, start: Int[Array, ""], *, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(array, start, size)


@functools.partial(jax.jit, static_argnames=("size",))
def _rebased_rows(offsets: Array, start: Int[Array, ""], *, size: int) -> Array:
    rows = jax.lax.dynamic_slice_in_dim(offsets, start, size)
    return rows - rows[0]


# ---------------------------------------------------------------------------------------------
# Choosing splits.


def _fits_with_capacity(offsets: np.ndarray, num_parts: int, capacity: int) -> bool:
    """Whether the sequences fit in `num_parts` contiguous runs of at most `capacity` tokens.

    Filling each run as far as it goes is optimal for this question. `capacity` must be at
    least the longest sequence so that every run makes progress.
    """
    position = 0
    last = offsets.shape[0] - 1
    for _ in range(num_parts):
        position = int(np.searchsorted(offsets, offsets[position] + capacity, side="right")) - 1
        if position == last:
            return True
    return position == last


def _completable(offsets: np.ndarray, num_parts: int, lower: int, upper: int) -> list[np.ndarray]:
    """`result[k][p]`: sequences `p..B` can be cut into `num_parts - k` contiguous runs, each
    holding between `lower` and `upper` tokens (both inclusive)."""
    num_positions = offsets.shape[0]
    positions = np.arange(num_positions)
    # From position p the next boundary q lies in [nearest[p], farthest[p]] (and q >= p).
    nearest = np.maximum(np.searchsorted(offsets, offsets + lower, side="left"), positions)
    farthest = np.searchsorted(offsets, offsets + upper, side="right") - 1
    result = [np.zeros(num_positions, dtype=bool) for _ in range(num_parts + 1)]
    result[num_parts][-1] = True
    for k in range(num_parts - 1, -1, -1):
        running = np.concatenate([[0], np.cumsum(result[k + 1], dtype=np.int64)])
        reachable = running[np.maximum(farthest, nearest - 1) + 1] - running[nearest]
        result[k] = (farthest >= nearest) & (reachable > 0)
    return result


def balanced_splits(
    input_row_offsets: _IntegerValues, num_devices: int
) -> Int64[np.ndarray, " splits"]:
    """Contiguous splits of a ragged batch whose per-device token counts are as even as possible.

    The returned splits minimise the largest device's token count over all ways of cutting the
    `B` sequences into `num_devices` contiguous runs (whole sequences only, empty runs
    allowed). Among the splits that reach that minimum, they maximise the smallest device's
    token count, and among those they are the lexicographically smallest, so the answer is
    deterministic. Runs on the host with NumPy: about `2 * log2(tokens)` passes over the
    offsets (a few milliseconds for 4096 sequences on 8 devices).

    **Arguments:**

    - `input_row_offsets`: `B + 1` non-decreasing integers starting at 0 (concrete values).
    - `num_devices`: how many runs to cut, at least 1.

    **Returns:** an int64 numpy array of `num_devices + 1` splits from 0 to `B`, ready for
    `split_batch` or `pack_splits`.

    ```python
    import numpy as np
    from eqpar.ragged import balanced_splits

    # Lengths 10, 1, 1, 1 on 4 devices: nothing beats 10 tokens on the busiest device, and
    # then one sequence per device keeps the others busy too.
    splits = balanced_splits([0, 10, 11, 12, 13], 4)
    assert splits.tolist() == [0, 1, 2, 3, 4]
    lengths = np.diff(np.array([0, 3, 4, 9, 11, 12])[balanced_splits([0, 3, 4, 9, 11, 12], 2)])
    assert lengths.tolist() == [4, 8]
    ```
    """
    _reject_traced("input_row_offsets", input_row_offsets, "balanced_splits")
    num_devices = check_int(num_devices, name="num_devices", owner="balanced_splits")
    offsets = _host_integers("input_row_offsets", input_row_offsets)
    _check_row_offsets("input_row_offsets", offsets, None)
    num_sequences = offsets.shape[0] - 1
    total = int(offsets[-1])
    longest = int(np.diff(offsets).max()) if num_sequences else 0

    # Smallest feasible largest run: every run holds at least the longest sequence and
    # the mean share; everything fits in one run.
    low, high = max(longest, -(-total // num_devices)), total
    while low < high:
        middle = (low + high) // 2
        if _fits_with_capacity(offsets, num_devices, middle):
            high = middle
        else:
            low = middle + 1
    largest = low

    # Largest feasible smallest run, with the largest run held at its minimum.
    low, high = 0, min(largest, total // num_devices)
    while low < high:
        middle = (low + high + 1) // 2
        if _completable(offsets, num_devices, middle, largest)[0][0]:
            low = middle
        else:
            high = middle - 1
    smallest = low

    completable = _completable(offsets, num_devices, smallest, largest)
    splits = np.zeros(num_devices + 1, dtype=np.int64)
    splits[-1] = num_sequences
    for k in range(1, num_devices):
        previous = splits[k - 1]
        run = offsets - offsets[previous]
        allowed = (
            (np.arange(num_sequences + 1) >= previous)
            & (run >= smallest)
            & (run <= largest)
            & completable[k]
        )
        splits[k] = int(np.argmax(allowed))
    return splits


# ---------------------------------------------------------------------------------------------
# Jittable fixed-capacity form.


class PackedBatch(eqx.Module):
    """A ragged batch packed per device into fixed shapes, as `pack_splits` returns it.

    Every array field has the device axis first, so the whole module can be sharded over a
    mesh axis with one `NamedSharding(mesh, PartitionSpec(axis))`.

    - `tokens`: `[num_devices, capacity, *features]`; row `i` holds device `i`'s tokens
      followed by zeros.
    - `row_offsets`: `[num_devices, max_sequences + 1]`; device `i`'s row offsets rebased
      to 0, then its last offset repeated (padding entries read as empty sequences).
    - `mask`: `[num_devices, capacity]`, `True` exactly where `tokens` holds real tokens.
    - `num_tokens`, `num_sequences`: `[num_devices]`, what each split needs, also when it
      overflowed.
    - `overflow`: `[num_devices]`, `True` where the split needs more than `capacity` tokens
      or more than `max_sequences` sequences. Such a device's `tokens`, `mask` and
      `row_offsets` are all zero / `False`: nothing truncated ever looks valid.
    - `total_tokens`, `total_sequences`: static sizes of the original batch, used by
      `unpack_splits`.

    ```python
    import numpy as np
    from eqpar.ragged import PackedBatch, pack_splits

    # 3 sequences (2, 1 and 3 tokens) on 2 devices: the first two, then the last.
    packed = pack_splits(np.arange(6.0), [0, 2, 3, 6], [0, 2, 3], capacity=4)
    assert isinstance(packed, PackedBatch)
    assert packed.tokens.shape == (2, 4)  # [num_devices, capacity]
    assert packed.tokens[1].tolist() == [3.0, 4.0, 5.0, 0.0]  # zeros after the real tokens
    assert packed.mask[1].tolist() == [True, True, True, False]
    assert packed.num_tokens.tolist() == [3, 3] and not packed.overflow.any()
    ```
    """

    tokens: Shaped[Array, " devices capacity *features"]
    row_offsets: Int[Array, " devices offsets"]
    mask: Bool[Array, " devices capacity"]
    num_tokens: Int[Array, " devices"]
    num_sequences: Int[Array, " devices"]
    overflow: Bool[Array, " devices"]
    total_tokens: int = eqx.field(static=True)
    total_sequences: int = eqx.field(static=True)


def _index_dtype() -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(np.int64))


def _static_size(name: str, value: object, minimum: int) -> int:
    if isinstance(value, Tracer):
        raise TypeError(
            f"`{name}` must be a static Python int (it sets an array shape), got a traced "
            f"value. Mark it static (`jax.jit(..., static_argnames=['{name}'])`) or close over "
            "it."
        )
    return check_int(value, name=name, owner="pack_splits", minimum=minimum)


def _runtime_check(failed: Bool[Array, ""], message: str, dtype: np.dtype) -> Int[Array, ""]:
    """A zero that raises `message` when the program runs and `failed` is true.

    Adding it into every output keeps the check from being pruned. Guarding one scalar rather
    than the arrays themselves matters under sharding: `equinox.error_if` pins what it guards
    to one device, which would force sharded outputs to be gathered.
    """
    return eqx.error_if(jnp.zeros((), dtype=dtype), failed, message)


def _overflow_message(capacity: int, max_sequences: int) -> str:
    return (
        f"pack_splits: a device's split holds more than capacity={capacity} tokens or more "
        f"than max_sequences={max_sequences} sequences. Raise `capacity` (it must be at least "
        "the largest split's token count), even out the splits with `balanced_splits`, or pass "
        "on_overflow='flag' and check `PackedBatch.overflow`."
    )


@functools.partial(
    jax.jit, static_argnames=("capacity", "max_sequences", "raise_on_overflow", "check_inputs")
)
def _pack(
    input: Array,
    offsets: Array,
    splits: Array,
    *,
    capacity: int,
    max_sequences: int,
    raise_on_overflow: bool,
    check_inputs: bool,
) -> PackedBatch:
    total_tokens = input.shape[0]
    total_sequences = offsets.shape[0] - 1
    first_sequence = splits[:-1]
    end_sequence = splits[1:]
    begin_token = offsets[first_sequence]
    num_tokens = offsets[end_sequence] - begin_token
    num_sequences = end_sequence - first_sequence
    overflow = (num_tokens > capacity) | (num_sequences > max_sequences)

    check = jnp.zeros((), dtype=offsets.dtype)
    if check_inputs:
        # Traced offsets and splits cannot be inspected while tracing; check them when run.
        check += _runtime_check(
            (offsets[0] != 0) | (offsets[-1] != total_tokens) | jnp.any(jnp.diff(offsets) < 0),
            f"pack_splits: `input_row_offsets` must start at 0, never decrease and end at "
            f"input.shape[0] = {total_tokens}.",
            offsets.dtype,
        )
        check += _runtime_check(
            (splits[0] != 0) | (splits[-1] != total_sequences) | jnp.any(jnp.diff(splits) < 0),
            f"pack_splits: `data_parallel_splits` must start at 0, never decrease and end at "
            f"the number of sequences, len(input_row_offsets) - 1 = {total_sequences}.",
            offsets.dtype,
        )
    if raise_on_overflow:
        check += _runtime_check(
            jnp.any(overflow), _overflow_message(capacity, max_sequences), offsets.dtype
        )
    fits = ~overflow & (check == 0)

    slot = jnp.arange(capacity, dtype=offsets.dtype)
    mask = (slot[None, :] < num_tokens[:, None]) & fits[:, None]
    features = input.shape[1:]
    if total_tokens == 0:
        tokens = jnp.zeros((splits.shape[0] - 1, capacity, *features), dtype=input.dtype)
    else:
        source = jnp.clip(begin_token[:, None] + slot[None, :], 0, total_tokens - 1)
        gathered = input[source]
        wide_mask = mask.reshape(mask.shape + (1,) * len(features))
        tokens = jnp.where(wide_mask, gathered, jnp.zeros((), dtype=input.dtype))

    entry = jnp.arange(max_sequences + 1, dtype=offsets.dtype)
    sequence = jnp.minimum(first_sequence[:, None] + entry[None, :], end_sequence[:, None])
    row_offsets = offsets[sequence] - begin_token[:, None]
    row_offsets = jnp.where(fits[:, None], row_offsets, 0)
    num_tokens = num_tokens + check
    num_sequences = num_sequences + check
    overflow = overflow | (check != 0)
    return PackedBatch(
        tokens=tokens,
        row_offsets=row_offsets,
        mask=mask,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        overflow=overflow,
        total_tokens=total_tokens,
        total_sequences=total_sequences,
    )


def pack_splits(
    input: Shaped[_ArrayOrHost, " tokens *features"],
    input_row_offsets: _IntegerValues,
    data_parallel_splits: _IntegerValues,
    *,
    capacity: int,
    max_sequences: int | None = None,
    on_overflow: Literal["raise", "flag"] = "raise",
) -> PackedBatch:
    """Pack each device's split of a ragged batch into fixed-size rows; usable inside `jit`.

    The jittable twin of [`split_batch`][eqpar.ragged.split_batch]: instead of one
    exact-size array per device it returns a [`PackedBatch`][eqpar.ragged.PackedBatch] whose
    arrays all start with a `num_devices` axis: tokens padded to `capacity`, row offsets padded
    to `max_sequences + 1`, and a mask of the real tokens. `input_row_offsets` and
    `data_parallel_splits` may be traced. Which devices hold which row is up to you: shard the
    leading axis over a mesh axis (see the example) and each device sees its own split.

    If a split needs more than `capacity` tokens (or `max_sequences` sequences):

    - with concrete offsets and splits, a `ValueError` names the device and its counts
      (with `on_overflow="raise"`);
    - inside `jit` with `on_overflow="raise"`, running the program raises an error
      (`equinox.error_if`) instead of returning data;
    - with `on_overflow="flag"`, `PackedBatch.overflow[i]` is `True` and device `i`'s row is
      left empty (zero tokens, mask all `False`), never silently truncated.

    Malformed traced offsets or splits (not starting at 0, decreasing, or not matching the
    batch) raise when the program runs, whatever `on_overflow` says.

    **Arguments:**

    - `input`: the tokens, `[tokens, *features]`.
    - `input_row_offsets`: `B + 1` non-decreasing integers from 0 to `tokens`.
    - `data_parallel_splits`: `num_devices + 1` non-decreasing integers from 0 to `B`; its
      length sets `num_devices`.
    - `capacity`: tokens per device row (static int, at least 1).
    - `max_sequences`: sequences per device row (static int); defaults to `B`, which always
      suffices.
    - `on_overflow`: `"raise"` (default) or `"flag"`, see above.

    **Returns:** a `PackedBatch`. [`unpack_splits`][eqpar.ragged.unpack_splits] turns it back
    into `(input, input_row_offsets)`.

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from eqpar.ragged import pack_splits, unpack_splits

    tokens = jnp.arange(8 * 2, dtype=jnp.float32).reshape(8, 2)
    offsets = jnp.array([0, 2, 5, 6, 8])

    @jax.jit
    def pack(tokens, offsets, splits):
        return pack_splits(tokens, offsets, splits, capacity=6)

    packed = pack(tokens, offsets, jnp.array([0, 2, 4]))
    assert packed.tokens.shape == (2, 6, 2) and not packed.overflow.any()
    assert packed.mask.sum(axis=1).tolist() == [5, 3]
    assert packed.row_offsets[1].tolist() == [0, 1, 3, 3, 3]

    # One row per device: shard the leading axis over a mesh axis.
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    packed = jax.device_put(packed, NamedSharding(mesh, PartitionSpec("data")))
    assert packed.tokens.addressable_shards[1].data.shape == (1, 6, 2)

    back_tokens, back_offsets = jax.jit(unpack_splits)(packed)
    assert (back_tokens == tokens).all() and back_offsets.tolist() == offsets.tolist()
    ```
    """
    capacity = _static_size("capacity", capacity, 1)
    if on_overflow not in ("raise", "flag"):
        raise ValueError(f"`on_overflow` must be 'raise' or 'flag', got {on_overflow!r}.")
    _input_shape(input, "pack_splits")
    traced = _is_traced(input_row_offsets) or _is_traced(data_parallel_splits)
    index_dtype = _index_dtype()

    if traced:
        offsets = jnp.asarray(input_row_offsets)
        splits = jnp.asarray(data_parallel_splits)
        for name, value in (
            ("input_row_offsets", offsets),
            ("data_parallel_splits", splits),
        ):
            if value.ndim != 1 or not jnp.issubdtype(value.dtype, jnp.integer):
                raise TypeError(
                    f"`{name}` must be a one-dimensional integer array, got shape "
                    f"{value.shape} and dtype {value.dtype}."
                )
            if value.shape[0] == 0:
                raise ValueError(f"`{name}` must have at least one entry, got none.")
        if splits.shape[0] < 2:
            raise ValueError(
                "`data_parallel_splits` must have num_devices + 1 >= 2 entries, got "
                f"{splits.shape[0]}."
            )
        num_sequences = offsets.shape[0] - 1
    else:
        host_offsets = _host_integers("input_row_offsets", input_row_offsets)
        host_splits = _host_integers("data_parallel_splits", data_parallel_splits)
        _check_row_offsets("input_row_offsets", host_offsets, int(input.shape[0]))
        num_sequences = host_offsets.shape[0] - 1
        if host_splits.shape[0] < 2:
            raise ValueError(
                "`data_parallel_splits` must have num_devices + 1 >= 2 entries (one device "
                f"at least), got {host_splits.shape[0]}: {_show(host_splits)}."
            )
        _check_splits("data_parallel_splits", host_splits, num_sequences, host_splits.shape[0] - 1)
        _stored_dtype(index_dtype, host_offsets)
        offsets, splits = host_offsets, host_splits

    if max_sequences is None:
        max_sequences = num_sequences
    max_sequences = _static_size("max_sequences", max_sequences, 0)

    if not traced and on_overflow == "raise":
        token_counts = np.diff(host_offsets[host_splits])
        sequence_counts = np.diff(host_splits)
        too_big = [
            f"device {i} needs {int(t)} tokens and {int(s)} sequences"
            for i, (t, s) in enumerate(zip(token_counts, sequence_counts))
            if t > capacity or s > max_sequences
        ]
        if too_big:
            raise ValueError(
                f"pack_splits: {'; '.join(too_big)}, but capacity={capacity} tokens and "
                f"max_sequences={max_sequences} sequences per device. Raise `capacity` to at "
                f"least {int(token_counts.max())} (and `max_sequences` to at least "
                f"{int(sequence_counts.max())}), even out the splits with `balanced_splits`, "
                "or pass on_overflow='flag' and check `PackedBatch.overflow`."
            )

    return _pack(
        jnp.asarray(input),
        jnp.asarray(offsets, dtype=index_dtype),
        jnp.asarray(splits, dtype=index_dtype),
        capacity=capacity,
        max_sequences=max_sequences,
        raise_on_overflow=traced and on_overflow == "raise",
        check_inputs=traced,
    )


def unpack_splits(
    packed: PackedBatch,
) -> tuple[Shaped[Array, " tokens *features"], Int[Array, " offsets"]]:
    """Undo `pack_splits`: the original `(input, input_row_offsets)`; usable inside `jit`.

    Works on a `PackedBatch` from `pack_splits` whatever its sharding; the output shapes come
    from the static sizes stored in it. A batch in which any device overflowed cannot be
    restored (its tokens were never packed): with concrete values that is a `ValueError`,
    inside `jit` running the program raises an error.

    **Arguments:**

    - `packed`: the `PackedBatch` to unpack.

    **Returns:** `(tokens, row_offsets)` with shapes `[total_tokens, *features]` and
    `[total_sequences + 1]`, equal to what was packed.

    ```python
    import numpy as np
    from eqpar.ragged import pack_splits, unpack_splits

    tokens = np.arange(5, dtype=np.int32)
    packed = pack_splits(tokens, [0, 1, 3, 5], [0, 1, 1, 3], capacity=4)
    back_tokens, back_offsets = unpack_splits(packed)
    assert back_tokens.tolist() == [0, 1, 2, 3, 4] and back_offsets.tolist() == [0, 1, 3, 5]
    ```
    """
    if not isinstance(packed, PackedBatch):
        raise TypeError(
            f"`packed` must be a PackedBatch from `pack_splits`, got {type(packed).__name__}."
        )
    overflow = packed.overflow
    if not isinstance(overflow, Tracer) and bool(np.any(np.asarray(overflow))):
        devices = np.flatnonzero(np.asarray(overflow)).tolist()
        raise ValueError(
            f"unpack_splits: devices {devices} overflowed when packing, so their tokens are not "
            "in the PackedBatch and the batch cannot be restored. Pack again with a larger "
            "`capacity` / `max_sequences`."
        )
    return _unpack(packed, check_overflow=isinstance(overflow, Tracer))


@functools.partial(jax.jit, static_argnames=("check_overflow",))
def _unpack(packed: PackedBatch, *, check_overflow: bool) -> tuple[Array, Array]:
    tokens = packed.tokens
    num_devices, capacity = packed.mask.shape
    features = tokens.shape[2:]
    total_tokens, total_sequences = packed.total_tokens, packed.total_sequences
    num_tokens = packed.num_tokens
    index_dtype = num_tokens.dtype
    if check_overflow:
        num_tokens = num_tokens + _runtime_check(
            jnp.any(packed.overflow),
            "unpack_splits: a device overflowed when packing, so its tokens are not in the "
            "PackedBatch and the batch cannot be restored. Pack again with a larger `capacity` "
            "/ `max_sequences`.",
            index_dtype,
        )
    token_start = jnp.cumsum(num_tokens) - num_tokens
    sequence_start = jnp.cumsum(packed.num_sequences) - packed.num_sequences

    slot = jnp.arange(capacity, dtype=index_dtype)
    # Padding slots aim past the end and are dropped by the scatter.
    target = jnp.where(packed.mask, token_start[:, None] + slot[None, :], total_tokens)
    flat_tokens = tokens.reshape((num_devices * capacity, *features))
    restored_tokens = (
        jnp.zeros((total_tokens, *features), dtype=tokens.dtype)
        .at[target.reshape(-1)]
        .set(flat_tokens, mode="drop")
    )

    entry = jnp.arange(packed.row_offsets.shape[1], dtype=index_dtype)
    owned = entry[None, :] < packed.num_sequences[:, None]
    sequence_target = jnp.where(
        owned, sequence_start[:, None] + entry[None, :], total_sequences + 1
    )
    restored_offsets = (
        jnp.full((total_sequences + 1,), total_tokens, dtype=index_dtype)
        .at[sequence_target.reshape(-1)]
        .set((packed.row_offsets + token_start[:, None]).reshape(-1), mode="drop")
    )
    return restored_tokens, restored_offsets
