"""Tests of eqpar.ragged: host-side splits, balanced splits and the jittable packed form."""

import itertools

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from numerics import assert_tree_close

from eqpar import ragged
from eqpar.ragged import (
    PackedBatch,
    balanced_splits,
    pack_splits,
    split_batch,
    split_batch_replicated,
    unpack_splits,
)

FAST = settings(max_examples=30, deadline=None)
# Every new batch shape compiles new `pack_splits` / `unpack_splits` programs; fewer examples
# keep these tests quick.
COMPILE_BOUND = settings(max_examples=15, deadline=None)
DTYPES = [np.dtype(np.int32), np.dtype(np.float32), np.dtype(jnp.bfloat16)]
FEATURE_SHAPES = [(), (2,), (2, 3)]
# An error raised by `equinox.error_if` while a program runs reaches Python as one of these,
# depending on the dispatch path (a cached program reports it as a ValueError); each test also
# matches the message.
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, eqx.EquinoxRuntimeError, ValueError)


# ---------------------------------------------------------------------------------------------
# Random ragged batches.


def _make_tokens(num_tokens: int, features: tuple[int, ...], dtype: np.dtype, seed: int):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(num_tokens, *features)) * 100
    if dtype.kind in "iu":
        values = np.round(values)
    return values.astype(dtype)


@st.composite
def ragged_batches(draw, max_devices: int = 8):
    """(tokens, row offsets, splits, num_devices) for a small random ragged batch."""
    lengths = draw(st.lists(st.integers(0, 4), min_size=0, max_size=7))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    num_devices = draw(st.integers(1, max_devices))
    inner = sorted(
        draw(
            st.lists(
                st.integers(0, len(lengths)), min_size=num_devices - 1, max_size=num_devices - 1
            )
        )
    )
    splits = np.array([0, *inner, len(lengths)], dtype=np.int64)
    features = draw(st.sampled_from(FEATURE_SHAPES))
    dtype = draw(st.sampled_from(DTYPES))
    tokens = _make_tokens(int(offsets[-1]), features, dtype, draw(st.integers(0, 2**16)))
    return tokens, offsets, splits, num_devices


def _assert_identical(actual, expected):
    actual = np.asarray(actual)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


def _check_pieces(result, devices, tokens, offsets, splits):
    """The pieces sit on their devices, rebase to 0 and join back into the batch exactly."""
    pieces, piece_offsets = result
    assert len(pieces) == len(piece_offsets) == len(devices)
    restored_offsets = [np.zeros(1, dtype=np.int64)]
    tokens_before = 0
    for index, (piece, piece_offset, device) in enumerate(zip(pieces, piece_offsets, devices)):
        assert piece.devices() == {device}
        assert piece_offset.devices() == {device}
        assert jnp.issubdtype(piece_offset.dtype, jnp.integer)
        # Host copies: indexing device arrays would compile a slice per shape.
        piece, piece_offset = np.asarray(piece), np.asarray(piece_offset)
        sequences = splits[index + 1] - splits[index]
        assert piece_offset.shape == (sequences + 1,)
        assert int(piece_offset[0]) == 0 and int(piece_offset[-1]) == piece.shape[0]
        restored_offsets.append(np.asarray(piece_offset[1:], dtype=np.int64) + tokens_before)
        tokens_before += piece.shape[0]
    _assert_identical(np.concatenate([np.asarray(p) for p in pieces]), tokens)
    np.testing.assert_array_equal(np.concatenate(restored_offsets), offsets)


# ---------------------------------------------------------------------------------------------
# split_batch


def test_split_batch_issue_example():
    """4 sequences, splits [0, 2, 4], 2 devices -> [seq_1, seq_2], [seq_3, seq_4]."""
    devices = jax.devices()[:2]
    tokens = np.arange(8, dtype=np.float32)
    offsets = np.array([0, 2, 5, 6, 8], dtype=np.int32)
    pieces, piece_offsets = split_batch(devices, tokens, offsets, [0, 2, 4])
    assert pieces[0].tolist() == [0, 1, 2, 3, 4]
    assert pieces[1].tolist() == [5, 6, 7]
    assert piece_offsets[0].tolist() == [0, 2, 5]
    assert piece_offsets[1].tolist() == [0, 1, 3]
    assert piece_offsets[0].dtype == jnp.int32
    assert [p.devices() for p in pieces] == [{devices[0]}, {devices[1]}]
    assert [o.devices() for o in piece_offsets] == [{devices[0]}, {devices[1]}]


def test_split_batch_result_is_a_named_tuple():
    devices = jax.devices()[:1]
    result = split_batch(devices, np.ones((3, 2), np.float32), [0, 3], [0, 1])
    assert isinstance(result, ragged.RaggedSplit)
    assert result.tokens[0].shape == (3, 2) and result.row_offsets[0].tolist() == [0, 3]


def test_split_batch_empty_split_gets_no_tokens_and_offsets_zero():
    devices = jax.devices()[:4]
    tokens = np.arange(12, dtype=np.float32).reshape(6, 2)
    pieces, piece_offsets = split_batch(devices, tokens, [0, 2, 6], [0, 0, 1, 1, 2])
    for index in (0, 2):
        assert pieces[index].shape == (0, 2)
        assert pieces[index].dtype == jnp.float32
        assert piece_offsets[index].tolist() == [0]
        assert pieces[index].devices() == {devices[index]}
    assert piece_offsets[1].tolist() == [0, 2] and piece_offsets[3].tolist() == [0, 4]


def test_split_batch_of_an_empty_batch():
    devices = jax.devices()[:3]
    pieces, piece_offsets = split_batch(devices, np.zeros((0, 5), np.int32), [0], [0, 0, 0, 0])
    assert [p.shape for p in pieces] == [(0, 5)] * 3
    assert [o.tolist() for o in piece_offsets] == [[0]] * 3


def test_split_batch_takes_a_device_array_and_moves_each_piece():
    devices = jax.devices()
    tokens = jax.device_put(jnp.arange(20, dtype=jnp.float32).reshape(10, 2), devices[5])
    offsets = jnp.array([0, 1, 4, 4, 10])
    splits = np.array([0, 1, 1, 2, 2, 3, 3, 4, 4])
    result = split_batch(devices, tokens, offsets, splits)
    _check_pieces(result, devices, np.asarray(tokens), np.asarray(offsets), splits)


@FAST
@given(ragged_batches())
def test_split_batch_pieces_join_back_exactly(batch):
    tokens, offsets, splits, num_devices = batch
    devices = jax.devices()[:num_devices]
    result = split_batch(devices, tokens, offsets, splits)
    _check_pieces(result, devices, tokens, offsets, splits)


def test_split_batch_offsets_keep_their_integer_dtype():
    devices = jax.devices()[:2]
    for dtype in (np.int32, np.int16, np.uint8):
        offsets = np.array([0, 1, 3], dtype=dtype)
        _, piece_offsets = split_batch(devices, np.zeros(3, np.float32), offsets, [0, 1, 2])
        assert piece_offsets[1].dtype == dtype
        assert piece_offsets[1].tolist() == [0, 2]


# Each case: (input tokens, row offsets, splits, number of devices, error type, message regex).
SPLIT_BATCH_ERRORS = {
    "too_many_splits": (4, [0, 1, 4], [0, 1, 2, 2], 2, ValueError, r"len\(devices\) \+ 1 = 3"),
    "too_few_splits": (4, [0, 1, 4], [0, 2], 2, ValueError, r"3 entries.*got 2"),
    "splits_not_from_0": (4, [0, 1, 4], [1, 1, 2], 2, ValueError, r"must start at 0.*got 1"),
    "splits_decreasing": (
        4,
        [0, 1, 2, 4],
        [0, 2, 1, 3],
        3,
        ValueError,
        r"non-decreasing.*entry 2 \(1\)",
    ),
    "splits_short_of_batch": (
        4,
        [0, 1, 2, 4],
        [0, 1, 2],
        2,
        ValueError,
        r"end at the number of sequences.*= 3.*dropped",
    ),
    "splits_past_batch": (
        4,
        [0, 1, 4],
        [0, 1, 3],
        2,
        ValueError,
        r"= 2, got 3.*do not exist",
    ),
    "offsets_not_from_0": (
        4,
        [1, 2, 4],
        [0, 1, 2],
        2,
        ValueError,
        r"input_row_offsets.*start at 0",
    ),
    "offsets_decreasing": (
        4,
        [0, 3, 2, 4],
        [0, 1, 3],
        2,
        ValueError,
        r"input_row_offsets.*non-decreasing",
    ),
    "offsets_short_of_tokens": (
        5,
        [0, 1, 4],
        [0, 1, 2],
        2,
        ValueError,
        r"input.shape\[0\] = 5, got 4.*tokens 4..4 would",
    ),
    "offsets_past_tokens": (
        3,
        [0, 1, 4],
        [0, 1, 2],
        2,
        ValueError,
        r"input.shape\[0\] = 3, got 4.*past the end",
    ),
    "offsets_empty": (0, np.zeros(0, np.int32), [0, 0], 1, ValueError, r"at least one entry"),
    "no_devices": (4, [0, 4], [0, 1], 0, ValueError, r"`devices` is empty"),
}


@pytest.mark.parametrize("case", sorted(SPLIT_BATCH_ERRORS))
def test_split_batch_rejects_bad_batches(case):
    num_tokens, offsets, splits, num_devices, error, message = SPLIT_BATCH_ERRORS[case]
    devices = jax.devices()[:num_devices]
    with pytest.raises(error, match=message):
        split_batch(devices, np.zeros((num_tokens, 2), np.float32), offsets, splits)


def test_split_batch_rejects_scalar_input():
    with pytest.raises(TypeError):
        split_batch(jax.devices()[:1], np.float32(1.0), [0], [0, 0])  # pyright: ignore


def test_split_batch_rejects_non_devices():
    # The annotation `Sequence[jax.Device]` catches these first under runtime type checking;
    # eqpar's own messages (checked below) cover runs without it.
    with pytest.raises(TypeError):
        split_batch([jax.devices()[0], "cpu:1"], np.zeros(2, np.float32), [0, 2], [0, 1, 1])
    with pytest.raises(TypeError, match=r"f: devices\[1\] must be a `jax.Device`, got str"):
        ragged._check_devices([jax.devices()[0], "cpu:1"], "f")
    with pytest.raises(TypeError, match=r"must be a list of `jax\.Device`s"):
        ragged._check_devices(jax.devices()[0], "f")


@pytest.mark.parametrize("traced", ["data_parallel_splits", "input_row_offsets", "input"])
def test_split_batch_rejects_traced_values(traced):
    devices = jax.devices()[:2]
    arguments = {
        "input": jnp.zeros((4, 2)),
        "input_row_offsets": jnp.array([0, 1, 4]),
        "data_parallel_splits": jnp.array([0, 1, 2]),
    }

    def call(value):
        given = dict(arguments, **{traced: value})
        return split_batch(
            devices, given["input"], given["input_row_offsets"], given["data_parallel_splits"]
        )

    with pytest.raises(TypeError, match=rf"`{traced}` is a traced value.*pack_splits"):
        jax.jit(call)(arguments[traced])


def test_host_integers_reports_dtype_and_rank():
    # Through the public functions these are caught by the jaxtyping annotations first; the
    # messages still matter where eqpar runs without runtime type checking.
    with pytest.raises(TypeError, match=r"`input_row_offsets` must hold integers, got dtype float"):
        ragged._host_integers("input_row_offsets", np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"one-dimensional, got shape \(1, 2\)"):
        ragged._host_integers("input_row_offsets", np.array([[0, 1]]))
    assert ragged._host_integers("x", []).dtype == np.int64
    with pytest.raises(TypeError):
        split_batch(jax.devices()[:1], np.zeros(1, np.float32), np.array([0.0, 1.0]), [0, 1])


def test_long_offsets_are_shortened_in_messages():
    offsets = np.arange(40)
    offsets[30] = 0
    with pytest.raises(ValueError, match=r"\.\.\. \(40 entries\)"):
        balanced_splits(offsets, 2)


# ---------------------------------------------------------------------------------------------
# split_batch_replicated


def _replicated_lists(devices, tokens, offsets):
    token_copies = [jax.device_put(tokens, device) for device in devices]
    offset_copies = [jax.device_put(offsets.astype(np.int32), device) for device in devices]
    return token_copies, offset_copies


@FAST
@given(ragged_batches())
def test_split_batch_replicated_pieces_join_back_exactly(batch):
    tokens, offsets, splits, num_devices = batch
    devices = jax.devices()[:num_devices]
    token_copies, offset_copies = _replicated_lists(devices, tokens, offsets)
    result = split_batch_replicated(devices, token_copies, offset_copies, offsets, splits)
    _check_pieces(result, devices, tokens, offsets, splits)
    expected = split_batch(devices, tokens, offsets, splits)
    for got, want in zip(result.row_offsets, expected.row_offsets):
        assert got.tolist() == want.tolist()


def test_split_batch_replicated_takes_one_replicated_array():
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    everywhere = NamedSharding(mesh, PartitionSpec())
    tokens = np.arange(2 * 11, dtype=np.float32).reshape(11, 2)
    offsets = np.array([0, 3, 3, 4, 8, 9, 11])
    splits = np.array([0, 1, 2, 2, 3, 4, 5, 6, 6])
    result = split_batch_replicated(
        devices,
        jax.device_put(tokens, everywhere),
        jax.device_put(offsets.astype(np.int32), everywhere),
        offsets.tolist(),
        splits,
    )
    _check_pieces(result, devices, tokens, offsets, splits)


def test_split_batch_replicated_slices_where_the_copies_live():
    """The devices may come in any order; each piece is cut from the copy on its device."""
    devices = jax.devices()[::-1][:3]
    tokens = np.arange(6, dtype=np.int32)
    offsets = np.array([0, 2, 3, 6])
    token_copies, offset_copies = _replicated_lists(devices, tokens, offsets)
    pieces, piece_offsets = split_batch_replicated(
        devices, token_copies, offset_copies, offsets, [0, 1, 2, 3]
    )
    assert [p.tolist() for p in pieces] == [[0, 1], [2], [3, 4, 5]]
    assert [p.devices() for p in pieces] == [{d} for d in devices]
    assert [o.devices() for o in piece_offsets] == [{d} for d in devices]


def test_split_batch_replicated_without_replica_check_trusts_the_host_copy():
    devices = jax.devices()[:2]
    tokens = np.arange(4, dtype=np.int32)
    token_copies, offset_copies = _replicated_lists(devices, tokens, np.array([0, 1, 4]))
    pieces, _ = split_batch_replicated(
        devices,
        token_copies,
        offset_copies,
        np.array([0, 3, 4]),
        [0, 1, 2],
        check_replicas=False,
    )
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3]]


def _replicated_case(name):
    """Arguments of `split_batch_replicated` broken in one way, with the expected error."""
    devices = jax.devices()[:2]
    tokens = np.arange(8, dtype=np.float32).reshape(4, 2)
    offsets = np.array([0, 1, 4])
    token_copies, offset_copies = _replicated_lists(devices, tokens, offsets)
    arguments = [devices, token_copies, offset_copies, offsets, [0, 1, 2]]
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    if name == "too_few_token_copies":
        arguments[1] = token_copies[:1]
        return arguments, ValueError, r"`input` must hold one copy per device.*= 2, got 1"
    if name == "too_many_offset_copies":
        arguments[2] = [*offset_copies, offset_copies[0]]
        return arguments, ValueError, r"`input_row_offsets` must hold one copy.*got 3"
    if name == "copy_on_wrong_device":
        arguments[1] = [token_copies[0], jax.device_put(tokens, jax.devices()[0])]
        return arguments, ValueError, r"input\[1\] lives on \[CpuDevice\(id=0\)\].*devices\[1\]"
    if name == "copy_on_several_devices":
        spread = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec()))
        arguments[1] = [token_copies[0], spread]
        return arguments, ValueError, r"input\[1\] lives on .*id=3.*moves nothing"
    if name == "sharded_array":
        arguments[1] = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("data")))
        return arguments, ValueError, r"not fully replicated"
    if name == "replicated_elsewhere":
        elsewhere = Mesh(np.array(jax.devices()[4:]), ("data",))
        arguments[1] = jax.device_put(tokens, NamedSharding(elsewhere, PartitionSpec()))
        return arguments, ValueError, r"devices\[0\] = .*id=0.* holds no copy of `input`"
    if name == "copies_differ_in_shape":
        arguments[1] = [token_copies[0], jax.device_put(tokens[:, :1], devices[1])]
        return arguments, ValueError, r"input\[1\] has shape \(4, 1\).*same batch"
    if name == "host_copy_disagrees":
        arguments[3] = np.array([0, 3, 4])
        return arguments, ValueError, r"input_row_offsets\[0\].*\[0, 1, 4\].*host copy.*\[0, 3, 4\]"
    if name == "host_copy_wrong_length":
        arguments[3] = np.array([0, 1, 2, 4])
        return arguments, ValueError, r"input_row_offsets\[0\] has shape \(3,\).*4 entries"
    if name == "host_copy_not_matching_tokens":
        arguments[3] = np.array([0, 1, 5])
        return arguments, ValueError, r"input.shape\[0\] = 4, got 5"
    if name == "wrong_number_of_splits":
        arguments[4] = [0, 2]
        return arguments, ValueError, r"len\(devices\) \+ 1 = 3"
    if name == "splits_decreasing":
        arguments[4] = [0, 2, 1]
        return arguments, ValueError, r"non-decreasing"
    raise AssertionError(name)


REPLICATED_ERRORS = [
    "too_few_token_copies",
    "too_many_offset_copies",
    "copy_on_wrong_device",
    "copy_on_several_devices",
    "sharded_array",
    "replicated_elsewhere",
    "copies_differ_in_shape",
    "host_copy_disagrees",
    "host_copy_wrong_length",
    "host_copy_not_matching_tokens",
    "wrong_number_of_splits",
    "splits_decreasing",
]


@pytest.mark.parametrize("case", REPLICATED_ERRORS)
def test_split_batch_replicated_rejects_bad_arguments(case):
    arguments, error, message = _replicated_case(case)
    with pytest.raises(error, match=message):
        split_batch_replicated(*arguments)


def test_split_batch_replicated_rejects_host_data_and_traced_splits():
    devices = jax.devices()[:2]
    tokens = np.arange(4, dtype=np.float32)
    offsets = np.array([0, 1, 4])
    token_copies, offset_copies = _replicated_lists(devices, tokens, offsets)
    # The annotations reject a list of numpy copies or a device copy of the host offsets
    # before eqpar's own checks run; both are type errors either way.
    with pytest.raises(TypeError):
        split_batch_replicated(devices, [tokens, tokens], offset_copies, offsets, [0, 1, 2])
    with pytest.raises(TypeError):
        split_batch_replicated(
            devices, token_copies, offset_copies, jnp.asarray(offsets), [0, 1, 2]
        )  # pyright: ignore

    def with_traced_splits(splits):
        return split_batch_replicated(devices, token_copies, offset_copies, offsets, splits)

    with pytest.raises(TypeError, match=r"`data_parallel_splits` is a traced value"):
        jax.jit(with_traced_splits)(jnp.array([0, 1, 2]))


def test_per_device_copies_explains_host_copies():
    devices = jax.devices()[:2]
    copy = jax.device_put(np.zeros(2, np.float32), devices[0])
    with pytest.raises(TypeError, match=r"input\[1\] must be a jax.Array already on devices\[1\]"):
        ragged._per_device_copies("input", [copy, np.zeros(2)], devices, "f")
    with pytest.raises(TypeError, match=r"one jax.Array per device.*got dict"):
        ragged._per_device_copies("input", {}, devices, "f")


# ---------------------------------------------------------------------------------------------
# balanced_splits


def _loads(offsets, splits):
    return np.diff(np.asarray(offsets)[np.asarray(splits)])


def _brute_force_best(offsets, num_devices):
    """Best splits by (largest load, -smallest load, splits), over every contiguous split."""
    num_sequences = len(offsets) - 1
    best = None
    for inner in itertools.combinations_with_replacement(range(num_sequences + 1), num_devices - 1):
        splits = (0, *inner, num_sequences)
        loads = _loads(offsets, splits)
        key = (int(loads.max()), -int(loads.min()), splits)
        if best is None or key < best:
            best = key
    assert best is not None
    return best


@FAST
@given(
    lengths=st.lists(st.integers(0, 9), min_size=0, max_size=7),
    num_devices=st.integers(1, 4),
)
def test_balanced_splits_match_brute_force_optimum(lengths, num_devices):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    splits = balanced_splits(offsets, num_devices)
    assert splits.dtype == np.int64 and splits.shape == (num_devices + 1,)
    largest, negated_smallest, best_splits = _brute_force_best(offsets, num_devices)
    loads = _loads(offsets, splits)
    assert int(loads.max()) == largest
    assert int(loads.min()) == -negated_smallest
    assert tuple(splits.tolist()) == best_splits
    # The result is valid input for split_batch.
    split_batch(jax.devices()[:num_devices], np.zeros(int(offsets[-1]), np.int32), offsets, splits)


def test_balanced_splits_examples():
    assert balanced_splits([0, 10, 11, 12, 13], 4).tolist() == [0, 1, 2, 3, 4]
    assert balanced_splits([0, 1, 2, 3, 4], 3).tolist() == [0, 1, 2, 4]
    assert balanced_splits([0, 4, 8, 12, 16], 2).tolist() == [0, 2, 4]
    assert balanced_splits([0], 3).tolist() == [0, 0, 0, 0]
    assert balanced_splits([0, 0, 0], 2).tolist() == [0, 0, 2]
    assert balanced_splits(np.array([0, 5], np.int32), 1).tolist() == [0, 1]


def test_balanced_splits_scale_to_large_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2048, size=4096)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    splits = balanced_splits(offsets, 8)
    loads = _loads(offsets, splits)
    # A contiguous split is within one sequence of the mean share.
    assert loads.max() <= offsets[-1] / 8 + lengths.max()
    assert loads.sum() == offsets[-1]


def test_balanced_splits_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"`num_devices` must be at least 1, got 0"):
        balanced_splits([0, 1], 0)
    with pytest.raises(ValueError, match=r"input_row_offsets.*non-decreasing"):
        balanced_splits([0, 2, 1], 2)
    with pytest.raises(ValueError, match=r"input_row_offsets.*start at 0"):
        balanced_splits([3, 4], 2)
    with pytest.raises(TypeError, match=r"`input_row_offsets` is a traced value"):
        jax.jit(lambda offsets: balanced_splits(offsets, 2))(jnp.array([0, 1]))


# ---------------------------------------------------------------------------------------------
# pack_splits / unpack_splits


def _check_packed(packed, tokens, offsets, splits, capacity, max_sequences):
    """Row i of the packed batch is exactly split_batch's piece i, padded."""
    num_devices = len(splits) - 1
    features = tokens.shape[1:]
    assert isinstance(packed, PackedBatch)
    packed = jax.tree.map(np.asarray, packed)
    assert packed.tokens.shape == (num_devices, capacity, *features)
    assert packed.tokens.dtype == tokens.dtype
    assert packed.row_offsets.shape == (num_devices, max_sequences + 1)
    assert packed.mask.shape == (num_devices, capacity)
    assert not packed.overflow.any()
    pieces = split_batch(jax.devices()[:num_devices], tokens, offsets, splits)
    for index, (piece, piece_offsets) in enumerate(zip(*pieces)):
        piece, piece_offsets = np.asarray(piece), np.asarray(piece_offsets)
        count = piece.shape[0]
        assert int(packed.num_tokens[index]) == count
        assert int(packed.num_sequences[index]) == piece_offsets.shape[0] - 1
        mask = np.asarray(packed.mask[index])
        assert mask[:count].all() and not mask[count:].any()
        row = np.asarray(packed.tokens[index])
        _assert_identical(row[:count], np.asarray(piece))
        _assert_identical(row[count:], np.zeros((capacity - count, *features), tokens.dtype))
        padded = np.full(max_sequences + 1, count)
        padded[: piece_offsets.shape[0]] = np.asarray(piece_offsets)
        np.testing.assert_array_equal(np.asarray(packed.row_offsets[index]), padded)


@COMPILE_BOUND
@given(ragged_batches(), st.integers(0, 3))
def test_pack_splits_rows_are_the_padded_pieces_and_unpack_restores(batch, spare):
    tokens, offsets, splits, _ = batch
    capacity = max(1, int(_loads(offsets, splits).max())) + spare
    packed = pack_splits(tokens, offsets, splits, capacity=capacity)
    _check_packed(packed, tokens, offsets, splits, capacity, len(offsets) - 1)
    restored_tokens, restored_offsets = unpack_splits(packed)
    _assert_identical(np.asarray(restored_tokens), tokens)
    np.testing.assert_array_equal(np.asarray(restored_offsets), offsets)


@COMPILE_BOUND
@given(ragged_batches())
def test_pack_splits_inside_jit_with_traced_offsets_and_splits(batch):
    tokens, offsets, splits, _ = batch
    capacity = max(1, int(_loads(offsets, splits).max()))
    max_sequences = max(1, int(np.diff(splits).max()))

    @jax.jit
    def round_trip(tokens, offsets, splits):
        packed = pack_splits(
            tokens, offsets, splits, capacity=capacity, max_sequences=max_sequences
        )
        return packed, unpack_splits(packed)

    packed, (restored_tokens, restored_offsets) = round_trip(
        jnp.asarray(tokens), jnp.asarray(offsets, jnp.int32), jnp.asarray(splits, jnp.int32)
    )
    _check_packed(packed, tokens, offsets, splits, capacity, max_sequences)
    _assert_identical(np.asarray(restored_tokens), tokens)
    np.testing.assert_array_equal(np.asarray(restored_offsets), offsets)


def test_pack_splits_sharded_over_a_mesh_matches_the_serial_split():
    """Per-device masked sums inside shard_map equal the sums of split_batch's pieces."""
    devices = jax.devices()
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 6, size=13)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.normal(size=(int(offsets[-1]), 3)).astype(np.float32)
    splits = balanced_splits(offsets, len(devices))
    capacity = int(_loads(offsets, splits).max())
    mesh = Mesh(np.array(devices), ("data",))
    packed = jax.device_put(
        pack_splits(tokens, offsets, splits, capacity=capacity),
        NamedSharding(mesh, PartitionSpec("data")),
    )
    assert packed.tokens.sharding.spec == PartitionSpec("data")

    def local_sums(tokens, mask, row_offsets):
        # One row per device: the sum of its real tokens and its last offset (= token count).
        weights = mask[..., None].astype(tokens.dtype)
        return (tokens * weights).sum(axis=1), row_offsets[:, -1]

    sums, counts = jax.jit(
        jax.shard_map(
            local_sums,
            mesh=mesh,
            in_specs=PartitionSpec("data"),
            out_specs=PartitionSpec("data"),
        )
    )(packed.tokens, packed.mask, packed.row_offsets)

    pieces, piece_offsets = split_batch(devices, tokens, offsets, splits)
    serial_sums = np.stack([np.asarray(p).sum(axis=0) for p in pieces])
    assert_tree_close(np.asarray(sums), serial_sums)
    assert np.asarray(counts).tolist() == [int(o[-1]) for o in piece_offsets]


def test_pack_splits_overflow_on_the_host_raises():
    tokens = np.zeros((7, 2), np.float32)
    with pytest.raises(ValueError, match=r"device 1 needs 5 tokens.*capacity=4.*at least 5"):
        pack_splits(tokens, [0, 2, 4, 7], [0, 1, 3], capacity=4)
    with pytest.raises(ValueError, match=r"device 0 needs 2 tokens and 2 sequences.*max_seq"):
        pack_splits(tokens, [0, 1, 2, 7], [0, 2, 3], capacity=5, max_sequences=1)


def _overflowing_batch():
    tokens = np.arange(14, dtype=np.float32).reshape(7, 2)
    return tokens, np.array([0, 2, 4, 7]), np.array([0, 1, 3])


def _check_flagged(packed, tokens):
    assert np.asarray(packed.overflow).tolist() == [False, True]
    assert np.asarray(packed.num_tokens).tolist() == [2, 5]
    assert np.asarray(packed.num_sequences).tolist() == [1, 2]
    # The overflowing row holds nothing that could pass for data.
    assert not np.asarray(packed.mask[1]).any()
    assert not np.asarray(packed.tokens[1]).any()
    assert not np.asarray(packed.row_offsets[1]).any()
    # The row that fits is intact.
    np.testing.assert_array_equal(np.asarray(packed.tokens[0, :2]), tokens[:2])
    assert np.asarray(packed.mask[0]).tolist() == [True, True, False, False]


def test_pack_splits_overflow_flag_on_the_host():
    tokens, offsets, splits = _overflowing_batch()
    packed = pack_splits(tokens, offsets, splits, capacity=4, on_overflow="flag")
    _check_flagged(packed, tokens)
    with pytest.raises(ValueError, match=r"devices \[1\] overflowed.*cannot be restored"):
        unpack_splits(packed)


def test_pack_splits_overflow_flag_inside_jit():
    tokens, offsets, splits = _overflowing_batch()
    pack = jax.jit(lambda o, s: pack_splits(tokens, o, s, capacity=4, on_overflow="flag"))
    packed = pack(jnp.asarray(offsets), jnp.asarray(splits))
    _check_flagged(packed, tokens)
    with pytest.raises(RUNTIME_ERRORS, match="cannot be restored"):
        jax.block_until_ready(jax.jit(unpack_splits)(packed))


def test_pack_splits_overflow_inside_jit_raises_when_run():
    tokens, offsets, splits = _overflowing_batch()
    pack = jax.jit(lambda o, s: pack_splits(tokens, o, s, capacity=4))
    # The same program runs fine when the splits fit.
    packed = pack(jnp.asarray(offsets), jnp.array([0, 2, 3]))
    assert not np.asarray(packed.overflow).any()
    with pytest.raises(RUNTIME_ERRORS, match=r"more than capacity=4 tokens"):
        jax.block_until_ready(pack(jnp.asarray(offsets), jnp.asarray(splits)))


def test_pack_splits_checks_survive_when_only_the_tokens_are_used():
    """The run-time checks feed every output, so using one field cannot prune them."""
    tokens, offsets, splits = _overflowing_batch()
    only_tokens = jax.jit(lambda o, s: pack_splits(tokens, o, s, capacity=4).tokens)
    with pytest.raises(RUNTIME_ERRORS, match=r"more than capacity=4 tokens"):
        jax.block_until_ready(only_tokens(jnp.asarray(offsets), jnp.asarray(splits)))
    only_mask = jax.jit(lambda o, s: pack_splits(tokens, o, s, capacity=7).mask)
    with pytest.raises(RUNTIME_ERRORS, match=r"data_parallel_splits` must start at 0"):
        jax.block_until_ready(only_mask(jnp.asarray(offsets), jnp.array([0, 3, 1])))


@pytest.mark.parametrize(
    ("offsets", "splits", "message"),
    [
        ([0, 2, 4, 7], [1, 1, 3], "data_parallel_splits` must start at 0"),
        ([0, 2, 4, 7], [0, 2, 1], "data_parallel_splits` must start at 0, never decrease"),
        ([0, 2, 4, 7], [0, 1, 2], "end at the number of sequences"),
        ([0, 4, 2, 7], [0, 1, 3], "input_row_offsets` must start at 0, never decrease"),
        ([0, 2, 4, 6], [0, 1, 3], r"input.shape\[0\] = 7"),
        ([1, 2, 4, 7], [0, 1, 3], "input_row_offsets` must start at 0"),
    ],
)
def test_pack_splits_checks_traced_offsets_and_splits_when_run(offsets, splits, message):
    tokens = np.zeros((7, 2), np.float32)
    pack = jax.jit(lambda o, s: pack_splits(tokens, o, s, capacity=7, on_overflow="flag"))
    with pytest.raises(RUNTIME_ERRORS, match=message):
        jax.block_until_ready(pack(jnp.array(offsets), jnp.array(splits)))


@pytest.mark.parametrize(
    ("offsets", "splits", "error", "message"),
    [
        ([0, 2, 7], [0, 2, 1], ValueError, "non-decreasing"),
        ([0, 2, 6], [0, 1, 2], ValueError, r"input.shape\[0\] = 7"),
        ([0, 2, 7], [0], ValueError, r"num_devices \+ 1 >= 2 entries"),
        ([0, 2, 7], [0, 1, 3], ValueError, r"number of sequences.*= 2, got 3"),
    ],
)
def test_pack_splits_checks_concrete_offsets_and_splits(offsets, splits, error, message):
    with pytest.raises(error, match=message):
        pack_splits(np.zeros((7, 2), np.float32), offsets, splits, capacity=7)


def test_pack_splits_checks_traced_shapes_while_tracing():
    tokens = np.zeros((7, 2), np.float32)
    with pytest.raises(ValueError, match=r"num_devices \+ 1 >= 2 entries, got 1"):
        jax.jit(lambda s: pack_splits(tokens, [0, 7], s, capacity=7))(jnp.array([0]))


def test_pack_splits_rejects_bad_capacity():
    tokens = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match=r"`capacity` must be at least 1, got 0"):
        pack_splits(tokens, [0, 2], [0, 1], capacity=0)
    with pytest.raises(ValueError, match=r"`max_sequences` must be at least 0, got -1"):
        pack_splits(tokens, [0, 2], [0, 1], capacity=2, max_sequences=-1)
    with pytest.raises(TypeError):
        pack_splits(tokens, [0, 2], [0, 1], capacity=2.0)  # pyright: ignore
    with pytest.raises(TypeError):
        pack_splits(tokens, [0, 2], [0, 1], capacity=2, on_overflow="ignore")  # pyright: ignore


def test_static_size_explains_traced_and_non_int_values():
    def traced_capacity(capacity):
        ragged._static_size("capacity", capacity, 1)
        return capacity

    with pytest.raises(TypeError, match=r"`capacity` must be a static Python int.*static_arg"):
        jax.jit(traced_capacity)(3)
    with pytest.raises(TypeError, match=r"`capacity` must be an int, got float"):
        ragged._static_size("capacity", 2.0, 1)


def test_unpack_splits_rejects_other_types():
    with pytest.raises(TypeError):
        unpack_splits((jnp.zeros(2), jnp.zeros(2)))  # pyright: ignore


def test_pack_splits_of_an_empty_batch():
    packed = pack_splits(np.zeros((0, 3), np.int32), [0], [0, 0, 0], capacity=2)
    assert packed.tokens.shape == (2, 2, 3) and not np.asarray(packed.mask).any()
    assert packed.row_offsets.shape == (2, 1)
    restored_tokens, restored_offsets = unpack_splits(packed)
    assert restored_tokens.shape == (0, 3) and restored_offsets.tolist() == [0]


def test_pack_splits_checks_traced_argument_shapes_while_tracing():
    tokens = np.zeros((0, 2), np.float32)
    with pytest.raises(ValueError, match=r"`input_row_offsets` must have at least one entry"):
        jax.jit(lambda o: pack_splits(tokens, o, [0, 0], capacity=1))(jnp.zeros(0, jnp.int32))
    # Float or two-dimensional offsets are type errors (caught by the annotations first).
    with pytest.raises(TypeError):
        jax.jit(lambda o: pack_splits(tokens, o, [0, 0], capacity=1))(jnp.zeros(1))
    with pytest.raises(TypeError):
        jax.jit(lambda o: pack_splits(tokens, o, [0, 0], capacity=1))(jnp.zeros((1, 1), int))


def test_checks_that_the_annotations_shadow_still_explain_themselves():
    # Under runtime type checking the annotations reject these inputs before eqpar's own
    # checks; the messages below are what users see without it.
    with pytest.raises(ValueError, match=r"`input` must have a leading token axis"):
        ragged._feature_check(())
    with pytest.raises(ValueError, match=r"reaches 2147483648, more than int32 holds.*x64"):
        ragged._stored_dtype(np.int32, np.array([0, 2**31], dtype=np.int64))
    assert ragged._stored_dtype(np.uint8, np.array([0, 255])) == np.uint8
    devices = jax.devices()[:1]
    float_offsets = [jax.device_put(jnp.zeros(2), devices[0])]
    with pytest.raises(TypeError):
        split_batch_replicated(devices, [jnp.zeros(1)], float_offsets, [0, 1], [0, 1])
