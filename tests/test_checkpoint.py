"""Sharded checkpoints (`eqpar.checkpoint`): round trips, restoring onto other meshes, keep-K
and save-every-N, damaged and interrupted checkpoints, structure mismatches, checksums and
argument errors (across layouts and processes: `test_checkpoint_layouts.py`; under faults:
`test_checkpoint_faults.py`).

The functions starting with `_child` run in processes started by `multiprocess_util`; they
configure JAX in their bodies, before it starts a backend. (Importing this module imports
JAX and eqpar.checkpoint, which configures nothing, so the children use eqpar without the
jaxtyping/beartype instrumentation of the pytest process.)
"""

import errno
import json
import logging
import os
import pickle
import signal
import sys
import threading
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from multiprocess_util import run_processes

from eqpar._checksums import digest
from eqpar.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CorruptCheckpointError,
    _as_step,
)

TIMEOUT = 120.0
ENV_DIRECTORY = "EQPAR_TEST_CHECKPOINT_DIR"


# ---------------------------------------------------------------------------------------------
# Helpers


def make_model(width: int = 16, key: int = 0) -> eqx.nn.MLP:
    return eqx.nn.MLP(8, 8, width, 2, key=jax.random.key(key))


def abstract_model(width: int = 16) -> eqx.nn.MLP:
    return eqx.filter_eval_shape(make_model, width)


def is_shape_dtype(leaf: object) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def is_data(leaf: object) -> bool:
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)


def place(tree, sharding_of):
    """Put every array leaf of `tree` where `sharding_of(leaf)` says (arrays stay arrays,
    ShapeDtypeStructs get the sharding)."""

    def one(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding_of(leaf))
        if isinstance(leaf, jax.Array):
            return jax.device_put(leaf, sharding_of(leaf))
        return leaf

    return jax.tree.map(one, tree)


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names)


def pipe_model_layout(leaf) -> NamedSharding:
    """Saved layout: a 2x2 (pipe, model) mesh, matrices sharded on both axes."""
    mesh = mesh_of((2, 2), ("pipe", "model"))
    return NamedSharding(mesh, {2: P("pipe", "model"), 1: P("model"), 0: P()}[leaf.ndim])


def model4_layout(leaf) -> NamedSharding:
    """Tensor parallel over 4 devices: output features sharded."""
    mesh = mesh_of((4,), ("model",))
    return NamedSharding(mesh, P("model") if leaf.ndim else P())


def fsdp8_layout(leaf) -> NamedSharding:
    """FSDP-like over 8 devices: the leading axis of every parameter sharded over `data`."""
    mesh = mesh_of((8,), ("data",))
    return NamedSharding(mesh, P("data") if leaf.ndim else P())


def one_device_layout(leaf) -> SingleDeviceSharding:
    return SingleDeviceSharding(jax.devices()[5])


def assert_bitwise_equal(actual, expected) -> None:
    actual_leaves = jax.tree.leaves(eqx.filter(actual, is_data))
    expected_leaves = jax.tree.leaves(eqx.filter(expected, is_data))
    assert len(actual_leaves) == len(expected_leaves) > 0
    for a, e in zip(actual_leaves, expected_leaves):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _replace_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


# ---------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_keeps_values_types_and_static_leaves(tmp_path):
    model = make_model()
    state = {
        "model": model,
        "step": 12,
        "learning_rate": 3e-4,
        "finished": False,
        "position": np.int64(4096),
        "mask": np.array([True, False, True]),
        "tokens_seen": jnp.array(123456, jnp.int32),
        "name": "run-7",  # not data: comes back from the target
    }
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.save(12, state)
        target = {
            "model": abstract_model(),
            "step": 0,
            "learning_rate": 0.0,
            "finished": True,
            "position": np.int64(0),
            "mask": np.zeros(3, bool),
            "tokens_seen": jax.ShapeDtypeStruct((), jnp.int32),
            "name": "from-target",
        }
        restored = checkpointer.restore(target=target)
    assert checkpointer.restored_step == 12
    assert_bitwise_equal(restored["model"], model)
    assert restored["model"].activation is model.activation  # static leaf, from the target
    assert restored["step"] == 12 and type(restored["step"]) is int
    assert restored["learning_rate"] == 3e-4 and type(restored["learning_rate"]) is float
    assert restored["finished"] is False
    assert restored["position"] == 4096 and isinstance(restored["position"], np.int64)
    assert isinstance(restored["mask"], np.ndarray)
    np.testing.assert_array_equal(restored["mask"], [True, False, True])
    assert int(restored["tokens_seen"]) == 123456 and restored["tokens_seen"].dtype == jnp.int32
    assert restored["name"] == "from-target"
    # the restored model runs like the saved one
    x = jnp.linspace(-1.0, 1.0, 8)
    np.testing.assert_array_equal(restored["model"](x), model(x))


def test_prng_keys_and_int_metadata_round_trip(tmp_path):
    state = {
        "key": jax.random.key(42),
        "keys": jax.random.split(jax.random.key(7), 4),
        "rbg_key": jax.random.key(3, impl="rbg"),
        "raw_key": jax.random.PRNGKey(9),  # old style: a plain uint32 array
        "data_position": 1_000_003,
        "epoch": jnp.array(2, jnp.int32),
    }
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(5, state)
        target = {
            "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype),
            "keys": jax.random.split(jax.random.key(0), 4),  # real arrays work as targets too
            "rbg_key": jax.random.key(0, impl="rbg"),
            "raw_key": jax.ShapeDtypeStruct((2,), jnp.uint32),
            "data_position": 0,
            "epoch": jax.ShapeDtypeStruct((), jnp.int32),
        }
        restored = checkpointer.restore(5, target=target)
    for name in ("key", "keys", "rbg_key"):
        assert restored[name].dtype == state[name].dtype
        np.testing.assert_array_equal(
            jax.random.key_data(restored[name]), jax.random.key_data(state[name])
        )
    # the random stream continues exactly where it stopped
    np.testing.assert_array_equal(
        jax.random.normal(restored["key"], (5,)), jax.random.normal(state["key"], (5,))
    )
    np.testing.assert_array_equal(restored["raw_key"], state["raw_key"])
    assert restored["data_position"] == 1_000_003
    assert int(restored["epoch"]) == 2


LAYOUTS = {
    "model=4": model4_layout,
    "fsdp data=8": fsdp8_layout,
    "one device": one_device_layout,
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_restore_onto_another_mesh_is_bitwise_equal(tmp_path, layout):
    model = place(make_model(), pipe_model_layout)
    assert model.layers[1].weight.sharding.spec == P("pipe", "model")
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, {"model": model, "step": 0})
        target = {"model": place(abstract_model(), LAYOUTS[layout]), "step": 0}
        restored = checkpointer.restore(target=target)
    assert_bitwise_equal(restored["model"], model)
    for got, wanted in zip(
        jax.tree.leaves(eqx.filter(restored["model"], is_data)),
        jax.tree.leaves(eqx.filter(target["model"], is_data)),
    ):
        assert got.sharding == wanted.sharding


def test_shardings_argument_places_an_unsharded_target(tmp_path):
    model = place(make_model(), pipe_model_layout)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, model)
        # one Sharding for every array leaf
        replicated = NamedSharding(mesh_of((8,), ("data",)), P())
        restored = checkpointer.restore(target=abstract_model(), shardings=replicated)
        assert all(
            leaf.sharding == replicated for leaf in jax.tree.leaves(eqx.filter(restored, is_data))
        )
        # a pytree of shardings; None keeps the target's own (here: none, so device 0)
        shardings = jax.tree.map(
            lambda leaf: fsdp8_layout(leaf) if leaf.ndim == 2 else None,
            eqx.filter(abstract_model(), is_shape_dtype),
        )
        restored = checkpointer.restore(target=abstract_model(), shardings=shardings)
    assert restored.layers[0].weight.sharding == fsdp8_layout(restored.layers[0].weight)
    assert restored.layers[0].bias.sharding == SingleDeviceSharding(jax.devices()[0])
    assert_bitwise_equal(restored, model)


def opt_state_target(optimizer, params_target):
    """The abstract optimizer state, each leaf placed like the parameter it mirrors (matched by
    path suffix); the rest (Adam's step count) replicated on the parameters' mesh."""
    abstract = jax.eval_shape(optimizer.init, params_target)
    param_shardings = {
        jax.tree_util.keystr(path): leaf.sharding
        for path, leaf in jax.tree_util.tree_flatten_with_path(params_target)[0]
    }
    mesh = next(iter(param_shardings.values())).mesh

    def place_leaf(path, leaf):
        text = jax.tree_util.keystr(path)
        for param_path, sharding in param_shardings.items():
            if text.endswith(param_path):
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, P()))

    return jax.tree_util.tree_map_with_path(place_leaf, abstract)


def test_adam_state_round_trip_with_shardings_matching_params(tmp_path):
    optimizer = optax.adam(1e-2)
    params = eqx.filter(place(make_model(), pipe_model_layout), eqx.is_array)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    update = jax.jit(optimizer.update)
    _, opt_state = update(grads, opt_state, params)  # non-trivial moments and count
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"params": params, "opt_state": opt_state})
        params_target = eqx.filter(place(abstract_model(), model4_layout), is_shape_dtype)
        target = {
            "params": params_target,
            "opt_state": opt_state_target(optimizer, params_target),
        }
        restored = checkpointer.restore(target=target)
    assert_bitwise_equal(restored, {"params": params, "opt_state": opt_state})
    adam = restored["opt_state"][0]
    assert int(adam.count) == 1
    for moments in (adam.mu, adam.nu):
        for moment, param in zip(jax.tree.leaves(moments), jax.tree.leaves(restored["params"])):
            assert moment.sharding == param.sharding == model4_layout(param)
    # one more optimizer step from the restored state equals one from the original
    updates, _ = update(grads, opt_state, params)
    restored_grads = jax.tree.map(
        lambda g, p: jax.device_put(g, p.sharding), grads, restored["params"]
    )
    restored_updates, _ = update(restored_grads, restored["opt_state"], restored["params"])
    assert_bitwise_equal(restored_updates, updates)


def test_async_save_round_trip_and_close_waits(tmp_path):
    model = place(make_model(), pipe_model_layout)
    checkpointer = Checkpointer(tmp_path, async_save=True, keep=1)
    assert checkpointer.save(0, model)
    assert checkpointer.save(1, model)
    checkpointer.close()
    checkpointer.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        checkpointer.save(2, model)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["1"]
    with Checkpointer(tmp_path) as reader:
        assert reader.all_steps() == [1]
        assert_bitwise_equal(reader.restore(target=abstract_model()), model)


class _DiskFull:
    """A commit future of orbax's that fails as a full disk does."""

    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, "No space left on device")


def _fail_next_write(monkeypatch) -> None:
    """The next save's write fails with ENOSPC after writing its files (in the background
    thread for an async save); later writes succeed."""
    import orbax.checkpoint as ocp

    write, failures = ocp.StandardCheckpointHandler.async_save, [_DiskFull()]

    async def async_save(self, *args, **kwargs):
        futures = list(await write(self, *args, **kwargs) or [])
        return [*futures, failures.pop()] if failures else futures

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", async_save)


def _in_new_thread(call):
    """`call()` in a thread of its own: its result, or the exception it raised."""
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_outcome(call)))
    thread.start()
    thread.join(TIMEOUT)
    return outcome[0]


def _outcome(call):
    try:
        return call()
    except Exception as error:
        return error


def test_failed_async_save_is_reported_once_and_cleaned_up(tmp_path, monkeypatch):
    state = {"w": jnp.ones(4)}
    with Checkpointer(tmp_path, async_save=True) as checkpointer:
        assert checkpointer.save(1, state)
        _fail_next_write(monkeypatch)
        assert checkpointer.save(2, state)  # fails in the background
        # The next call that waits reports it, with what happened; each call runs in a thread
        # of its own, as in a trainer that saves from a worker thread.
        error = _in_new_thread(lambda: checkpointer.save(3, state))
        assert isinstance(error, OSError) and error.errno == errno.ENOSPC
        notes = "\n".join(error.__notes__)
        assert "The background save of step 2" in notes and "not committed" in notes
        assert "2.orbax-checkpoint-tmp was removed" in notes
        assert "this call did not save step 3" in notes
        assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "eqpar-writer.lock"]
        # Reported once: the retry and everything after it succeed, in any thread.
        assert _in_new_thread(lambda: checkpointer.save(3, state)) is True
        assert _in_new_thread(checkpointer.wait_until_finished) is None
        assert checkpointer.all_steps() == [1, 3]
    with Checkpointer(tmp_path) as reader:
        np.testing.assert_array_equal(reader.restore(target=state)["w"], np.ones(4))


def test_failed_save_removes_only_the_directory_it_created(tmp_path, monkeypatch):
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.save(1, {"w": jnp.ones(4)})  # now the writer
        (tmp_path / "5.orbax-checkpoint-tmp").mkdir()  # not this save's
        _fail_next_write(monkeypatch)
        with pytest.raises(OSError, match="No space left on device") as caught:
            checkpointer.save(2, {"w": jnp.ones(4)})
        assert "Saving of step 2" in "\n".join(caught.value.__notes__)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "1",
            "5.orbax-checkpoint-tmp",
            "eqpar-writer.lock",
        ]
        assert checkpointer.save(2, {"w": jnp.ones(4)})
        assert checkpointer.all_steps() == [1, 2]


# ---------------------------------------------------------------------------------------------
# Keep-last-K and save-every-N


def test_keep_last_k(tmp_path):
    with Checkpointer(tmp_path, keep=2) as checkpointer:
        for step in range(5):
            assert checkpointer.save(step, {"w": jnp.full(4, float(step))})
        assert checkpointer.all_steps() == [3, 4]
        assert checkpointer.latest_step() == 4
        restored = checkpointer.restore(3, target={"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    np.testing.assert_array_equal(restored["w"], np.full(4, 3.0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]
    # a new Checkpointer sees the same steps and keeps trimming
    with Checkpointer(tmp_path, keep=2) as checkpointer:
        assert checkpointer.all_steps() == [3, 4]
        checkpointer.save(5, {"w": jnp.zeros(4)})
        assert checkpointer.all_steps() == [4, 5]


def test_save_every_n(tmp_path):
    state = {"w": jnp.ones(3)}
    with Checkpointer(tmp_path, save_every=3) as checkpointer:
        assert [s for s in range(10) if checkpointer.should_save(s)] == [0, 3, 6, 9]
        saved = [step for step in range(1, 10) if checkpointer.save(step, state)]
        assert saved == [3, 6, 9]
        assert checkpointer.all_steps() == [3, 6, 9]
        # older or equal steps are not saved again, even when they are multiples
        assert not checkpointer.should_save(6) and not checkpointer.save(9, state)
        # `force` saves off the schedule (e.g. the end of training)
        assert checkpointer.save(10, state, force=True)
        assert checkpointer.all_steps() == [3, 6, 9, 10]
        # an existing step is never overwritten, even when forced
        assert not checkpointer.save(9, {"w": jnp.zeros(3)}, force=True)
        restored = checkpointer.restore(9, target={"w": jnp.zeros(3)})
        np.testing.assert_array_equal(restored["w"], np.ones(3))
        # integer scalar arrays are accepted as steps
        assert checkpointer.save(jnp.array(12), state)


# ---------------------------------------------------------------------------------------------
# Interrupted saves and damaged checkpoints


def corruption_state(step: int) -> dict:
    key = jax.random.key(step)
    weight = jax.random.normal(key, (64, 64), jnp.float32)  # big enough for its own data file
    return {
        "weight": place(weight, pipe_model_layout),
        "bias": jnp.full(8, float(step)),
        "step": step,
    }


def corruption_target() -> dict:
    return {
        "weight": place(jax.ShapeDtypeStruct((64, 64), jnp.float32), model4_layout),
        "bias": jax.ShapeDtypeStruct((8,), jnp.float32),
        "step": 0,
    }


def _delete_array_files(step_dir: Path) -> None:
    for path in (step_dir / "default").glob("ocdbt.process_*/d/*"):
        path.unlink()


def _truncate_array_file(step_dir: Path) -> None:
    path = largest_file(step_dir)
    assert "ocdbt.process_0" in str(path)
    os.truncate(path, path.stat().st_size // 2)


def _flip_array_bytes(step_dir: Path) -> None:
    path = largest_file(step_dir)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    path.write_bytes(bytes(data))


DAMAGE = {
    "array files deleted": (_delete_array_files, "reading its arrays failed"),
    "array file truncated": (_truncate_array_file, "reading its arrays failed"),
    "array bytes flipped": (_flip_array_bytes, "does not match its checksum"),
    "step metadata missing": (
        lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
        "_CHECKPOINT_METADATA is missing, unreadable",
    ),
    "array metadata missing": (
        lambda d: (d / "default" / "_METADATA").unlink(),
        "_METADATA is missing",
    ),
    "step metadata truncated": (
        lambda d: os.truncate(d / "_CHECKPOINT_METADATA", 40),
        "_CHECKPOINT_METADATA is missing, unreadable",
    ),
    "manifest deleted": (
        lambda d: (d / "default" / "manifest.ocdbt").unlink(),
        "reading its arrays failed",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_checkpoint_errors_and_falls_back(tmp_path, damage):
    damage_fn, reason = DAMAGE[damage]
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, corruption_state(1))
        checkpointer.save(2, corruption_state(2))
    damage_fn(tmp_path / "2")

    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [1, 2]
        # asked for explicitly: a clear error naming the step and its path
        with pytest.raises(CorruptCheckpointError) as caught:
            checkpointer.restore(2, target=corruption_target())
        message = str(caught.value)
        assert f"step 2 at {tmp_path / '2'} is damaged" in message
        assert reason in message
        assert "Restore another step (`all_steps()` lists them)" in message
        assert caught.value.step == 2 and caught.value.path == str(tmp_path / "2")
        # latest: warns and falls back to the previous good step
        with pytest.warns(UserWarning) as record:
            restored = checkpointer.restore(target=corruption_target())
        # Only eqpar's own warnings: orbax's abandoned reads may surface here as pytest's
        # PytestUnraisableExceptionWarning (also a UserWarning) when they are collected.
        messages = [
            str(w.message)
            for w in record
            if not isinstance(w.message, pytest.PytestUnraisableExceptionWarning)
        ]
        assert len(messages) == 2, messages
        assert f"step 2 at {tmp_path / '2'} is damaged" in messages[0]
        assert messages[0].endswith("Falling back to an older step.")
        assert messages[1].startswith(f"Restored step 1 from {tmp_path}, not the newest step 2")
        assert all(w.filename == __file__ for w in record)  # attributed to the caller
        assert checkpointer.restored_step == 1
    assert_bitwise_equal(restored, corruption_state(1))
    assert restored["step"] == 1
    assert restored["weight"].sharding == model4_layout(restored["weight"])


def test_every_step_damaged_is_an_error_listing_them(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, corruption_state(1))
        checkpointer.save(2, corruption_state(2))
    (tmp_path / "1" / "_CHECKPOINT_METADATA").unlink()
    _delete_array_files(tmp_path / "2")
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError) as caught:
            checkpointer.restore(target=corruption_target())
    message = str(caught.value)
    assert f"Every checkpoint in {tmp_path} is damaged (2 steps)" in message
    assert "step 2 at" in message and "step 1 at" in message


def test_missing_steps_are_file_not_found(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(FileNotFoundError, match="no committed checkpoint in"):
            checkpointer.restore(target={"w": 0})
        checkpointer.save(3, {"w": 1})
        with pytest.raises(FileNotFoundError, match=r"`step` 4: .* committed steps: \[3\]"):
            checkpointer.restore(4, target={"w": 0})


def _child_dies_while_committing():
    """Save step 1, then die by SIGKILL at the moment orbax commits step 2 (the rename of
    its temporary directory), after every array of step 2 has been written."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp

    real_rename = os.rename

    def rename(source, destination, *args, **kwargs):
        if Path(source).name.startswith("2.orbax-checkpoint-tmp"):
            print("killing myself while committing step 2", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(source, destination, *args, **kwargs)

    checkpointer = Checkpointer(os.environ[ENV_DIRECTORY])
    checkpointer.save(1, {"w": jnp.full((64, 64), 1.0), "step": 1})
    os.rename = rename
    checkpointer.save(2, {"w": jnp.full((64, 64), 2.0), "step": 2})
    print("unreachable", flush=True)


def _run_child_until_it_kills_itself(child, directory) -> None:
    """Run `child` in its own process on `directory`; it must end by SIGKILL midway."""
    (result,) = run_processes(
        child, num_processes=1, timeout=TIMEOUT, env={ENV_DIRECTORY: str(directory)}, check=False
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "killing myself" in result.stdout and "unreachable" not in result.stdout


@pytest.mark.multiprocess
def test_save_killed_midway_keeps_last_good_checkpoint(tmp_path):
    _run_child_until_it_kills_itself(_child_dies_while_committing, tmp_path)
    leftovers = [p.name for p in tmp_path.iterdir() if "orbax-checkpoint-tmp" in p.name]
    assert leftovers == ["2.orbax-checkpoint-tmp"]
    assert any(p.is_file() for p in (tmp_path / leftovers[0]).rglob("*"))  # data was written

    target = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32), "step": 0}
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [1]  # the unfinished step is never listed
        restored = checkpointer.restore(target=target)
        assert restored["step"] == 1
        np.testing.assert_array_equal(restored["w"], np.ones((64, 64), np.float32))
        # a reader leaves it alone (it could be a save in progress); the next writer (the
        # dead one's lock is stale) removes it
        assert (tmp_path / leftovers[0]).exists()
        # training goes on: step 2 can be saved again
        assert checkpointer.save(2, {"w": jnp.full((64, 64), 2.0), "step": 2})
        assert not (tmp_path / leftovers[0]).exists()
        assert checkpointer.restore(target=target)["step"] == 2


# ---------------------------------------------------------------------------------------------
# Structure mismatches


def mismatch_cases():
    model_target = abstract_model()
    return {
        "shape": (
            {"model": abstract_model(width=32), "step": 0},
            r"first mismatching leaf: `model/layers/0/weight` \(shape\): \(16, 8\) in the "
            r"checkpoint, \(32, 8\) in the target",
        ),
        "missing leaf": (
            {"model": model_target, "step": 0, "ema": jax.ShapeDtypeStruct((3,), jnp.float32)},
            r"first mismatching leaf: `ema` \(missing leaf\): the target has a jax array, the "
            r"checkpoint none",
        ),
        "extra leaf": (
            {"model": model_target},
            r"first mismatching leaf: `step` \(extra leaf\): the checkpoint has a Python int",
        ),
        "dtype": (
            {
                "model": jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) if is_data(x) else x,
                    model_target,
                ),
                "step": 0,
            },
            r"`model/layers/0/weight` \(dtype\): float32 in the checkpoint, bfloat16 in the target",
        ),
        "kind": (
            {"model": model_target, "step": 0.0},
            r"`step` \(kind\): the checkpoint holds a Python int, the target a Python float",
        ),
    }


@pytest.mark.parametrize("case", list(mismatch_cases()), ids=list(mismatch_cases()))
def test_structure_mismatch_names_first_leaf_and_difference(tmp_path, case):
    target, pattern = mismatch_cases()[case]
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(4, {"model": make_model(), "step": 4})
        with pytest.raises(CheckpointMismatchError, match=pattern) as caught:
            checkpointer.restore(target=target)
        # a mismatch is the caller's problem, not damage: no fallback, no warning
        assert caught.value.step == 4
        assert f"step 4 at {tmp_path / '4'} does not have the structure of `target`" in str(
            caught.value
        )


def test_prng_impl_and_key_kind_mismatches(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, {"key": jax.random.key(0)})
        with pytest.raises(
            CheckpointMismatchError,
            match=r"`key` \(PRNG impl\): the checkpoint holds threefry2x32, the target "
            r"key<rbg>",
        ):
            checkpointer.restore(target={"key": jax.random.key(0, impl="rbg")})
        with pytest.raises(
            CheckpointMismatchError,
            match=r"`key` \(kind\): the checkpoint holds a PRNG key array \(impl threefry2x32\)"
            r", the target a jax array",
        ):
            checkpointer.restore(target={"key": jax.ShapeDtypeStruct((2,), jnp.uint32)})


def test_many_mismatches_are_all_counted(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, {f"w{i:02d}": jnp.zeros(2) for i in range(15)})
        with pytest.raises(CheckpointMismatchError) as caught:
            checkpointer.restore(target={f"w{i:02d}": jnp.zeros(3) for i in range(15)})
    message = str(caught.value)
    assert "All 15 differences" in message and "... and 5 more" in message


def test_foreign_orbax_checkpoint_is_refused(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(
        tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    ) as manager:
        manager.save(0, args=ocp.args.StandardSave({"w": jnp.ones(2)}))
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(CheckpointMismatchError, match=r"was not written by eqpar\.checkpoint"):
            checkpointer.restore(0, target={"w": jnp.zeros(2)})


# ---------------------------------------------------------------------------------------------
# Safety: the format, and no code runs on load


def test_on_disk_format_is_json_and_tensorstore_and_loading_never_unpickles(tmp_path, monkeypatch):
    state = {"model": make_model(), "key": jax.random.key(1), "step": 2}
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(2, state)
    step_dir = tmp_path / "2"
    # every metadata file is JSON; the rest is TensorStore's OCDBT store
    for name in ("_CHECKPOINT_METADATA", "default/_METADATA", "default/_sharding"):
        json.loads((step_dir / name).read_text())
    records = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    assert [r["path"] for r in records["eqpar"]["leaves"]][:3] == [
        "key",
        "model/layers/0/weight",
        "model/layers/0/bias",
    ]
    for path in step_dir.rglob("*"):
        if path.is_file():
            assert not path.read_bytes().startswith(b"\x80"), f"{path} looks like a pickle"

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load tried to unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(np, "load", refuse)
    target = {"model": abstract_model(), "key": jax.random.key(0), "step": 0}
    with Checkpointer(tmp_path) as checkpointer:
        restored = checkpointer.restore(target=target)
    assert_bitwise_equal(restored["model"], state["model"])


def test_no_interpreter_hook_or_foreign_logger_is_patched(tmp_path):
    """Neither saving nor a failed (damaged) restore touches `sys.unraisablehook` or the
    loggers of other libraries; orbax's logs are quieted through absl's own setting."""
    loggers = [logging.getLogger(name) for name in ("", "absl", "asyncio", "orbax")]

    def snapshot():
        hooks = [sys.unraisablehook, sys.excepthook]
        return hooks, [(list(log.filters), list(log.handlers), log.level) for log in loggers]

    def from_eqpar(hook: object) -> bool:
        return "eqpar" in str(getattr(hook, "__module__", ""))

    before = snapshot()
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, corruption_state(1))
        checkpointer.save(2, corruption_state(2))
        _delete_array_files(tmp_path / "2")
        with pytest.raises(CorruptCheckpointError):
            checkpointer.restore(2, target=corruption_target())
    assert snapshot() == before
    hooks, states = snapshot()
    assert not [hook for hook in hooks if from_eqpar(hook)]
    assert not [f for filters, _, _ in states for f in filters if from_eqpar(f)]


# ---------------------------------------------------------------------------------------------
# Checksums


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint32, jnp.bool_]
)
def test_checksum_is_the_same_on_device_on_host_and_under_any_sharding(dtype):
    raw = np.asarray(jax.random.normal(jax.random.key(0), (16, 8)) * 50)
    values = raw > 0 if dtype == jnp.bool_ else raw.astype(dtype)
    on_one_device = jnp.asarray(values)
    sharded = jax.device_put(values, pipe_model_layout(on_one_device))
    fsdp = jax.device_put(values, fsdp8_layout(on_one_device))
    reversed_devices = Mesh(np.array(jax.devices()[:4])[::-1], ("model",))
    reordered = jax.device_put(values, NamedSharding(reversed_devices, P("model")))
    digests = [digest(v) for v in (values, on_one_device, sharded, fsdp, reordered)]
    assert digests[0] is not None and len(set(digests)) == 1
    flat = values.reshape(-1)
    i = next(i for i in range(flat.size - 1) if flat[i] != flat[i + 1])
    changed = flat.copy()
    changed[i] = flat[i + 1]  # one element differs
    swapped = flat.copy()
    swapped[[i, i + 1]] = flat[[i + 1, i]]  # two elements trade places
    changed_digest, swapped_digest = (digest(v.reshape(values.shape)) for v in (changed, swapped))
    assert changed_digest != digests[0] and swapped_digest != digests[0]


def test_checksums_can_be_turned_off(tmp_path):
    with Checkpointer(tmp_path, checksums=False) as checkpointer:
        checkpointer.save(1, corruption_state(1))
    records = json.loads((tmp_path / "1" / "_CHECKPOINT_METADATA").read_text())
    assert all("checksum" not in r for r in records["custom_metadata"]["eqpar"]["leaves"])
    with Checkpointer(tmp_path) as checkpointer:
        assert_bitwise_equal(checkpointer.restore(target=corruption_target()), corruption_state(1))


def test_checksum_tells_constant_arrays_apart():
    # The old position-weighted sum was 0 for every constant float32 array whose length is a
    # multiple of 512, so ones(1024) and zeros(1024) had the same checksum.
    for n in (512, 1024, 4096):
        digests = {digest(jnp.full(n, value, jnp.float32)) for value in (0.0, 1.0, 2.0, -1.0)}
        assert len(digests) == 4, n
    assert digest(jnp.ones(1024)) != digest(jnp.ones(2048)[:1024] * 0)
    # Known answers: the rule is part of the on-disk format (a changed rule would make every
    # saved checkpoint look damaged), so it is pinned.
    assert digest(jnp.arange(8.0)) == 4271693182
    assert digest(np.arange(8, dtype=np.int64)) == 1331129208


def test_checkpoint_of_the_previous_format_verifies_with_its_own_checksum(tmp_path):
    # A version-2 step, as eqpar wrote it before checksum rule 3: the same files, with the old
    # rule's checksum of arange(8.0) (96468992) and no stacking depths.
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": jnp.arange(8.0)})
        checkpointer.save(2, {"w": jnp.arange(8.0)})

    def as_version_2(checksum: int):
        def edit(metadata: dict) -> dict:
            entry = metadata["custom_metadata"]["eqpar"]
            assert entry["version"] == 3 and entry["leaves"][0]["checksum"] != checksum
            entry["version"], entry["leaves"][0]["checksum"] = 2, checksum
            return metadata

        return edit

    _replace_json(tmp_path / "1" / "_CHECKPOINT_METADATA", as_version_2(96468992))
    _replace_json(tmp_path / "2" / "_CHECKPOINT_METADATA", as_version_2(96468993))
    target = {"w": jax.ShapeDtypeStruct((8,), jnp.float32)}
    with Checkpointer(tmp_path) as checkpointer:
        np.testing.assert_array_equal(checkpointer.restore(1, target=target)["w"], np.arange(8.0))
        with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
            checkpointer.restore(2, target=target)


# ---------------------------------------------------------------------------------------------
# Argument errors


def test_constructor_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="`save_every` must be a positive int, got 0"):
        Checkpointer(tmp_path, save_every=0)
    with pytest.raises(ValueError, match=r"`keep` must be a positive int \(or None"):
        Checkpointer(tmp_path, keep=0)
    # wrong types are refused (under the suite's beartype hook the annotation does it first)
    for arguments, name in (
        ({"save_every": "10"}, "save_every"),
        ({"save_every": 2.5}, "save_every"),
        ({"keep": 1.5}, "keep"),
        ({"save_every": True}, "save_every"),
    ):
        with pytest.raises(TypeError, match=name):
            Checkpointer(tmp_path, **arguments)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=f"`{name}` must be an integer"):
            _as_step(arguments[name], name, 1)
    with pytest.raises(ValueError, match="`timeout` must be a positive number"):
        Checkpointer(tmp_path, timeout=0)
    assert not list(tmp_path.glob("eqpar-writer.lock"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        Checkpointer(tmp_path / "file")


def test_save_argument_errors(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(ValueError, match="`step` must be >= 0, got -1"):
            checkpointer.save(-1, {"w": 1})
        # (under the test suite's beartype hook the annotation refuses it first)
        with pytest.raises(TypeError, match="step"):
            checkpointer.save(1.5, {"w": 1})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"`step` must be an integer .* got float"):
            _as_step(1.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"`state` leaf `w` is a jax.ShapeDtypeStruct"):
            checkpointer.save(0, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
        with pytest.raises(ValueError, match=r"same name 'a/b': `a/b` and `a/b`"):
            checkpointer.save(0, {"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}})
        with pytest.raises(ValueError, match=r"same name 'state.a.b': `a/b` and `a.b`"):
            checkpointer.save(0, {"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}})
        with pytest.raises(ValueError, match="`state` has no leaves to save"):
            checkpointer.save(0, {"name": "x", "fn": jax.nn.relu})
        with pytest.raises(TypeError, match="NumPy array of Python objects"):
            checkpointer.save(0, {"o": np.array([object()])})
        assert list(tmp_path.iterdir()) == []  # refused before anything is written
        unstorable = [
            (jnp.zeros(3, jnp.uint4), r"uint4, .* Save it as uint8 \(`x.astype\(jnp.uint8\)`"),
            (np.zeros(2, "datetime64[s]"), r"datetime64\[s\], .* Save it as int64"),
            (np.array(["text"]), r"str128, .* Save it as a numeric array"),
        ]
        for value, message in unstorable:
            with pytest.raises(TypeError, match=r"`state` leaf `a/q` has dtype " + message):
                checkpointer.save(0, {"w": jnp.ones(2), "a": {"q": value}})
            assert list(tmp_path.iterdir()) == []
        with pytest.raises(ValueError, match=r"`state` leaf `a/w` has shape \(0, 3\)"):
            checkpointer.save(0, {"a": {"w": jnp.zeros((0, 3)), "v": jnp.ones(2)}})
        with pytest.raises(ValueError, match=r"`state` leaf `a/n` has shape \(2, 0\)"):
            checkpointer.save(0, {"a": {"n": np.zeros((2, 0))}})
        deleted = jnp.ones(3)
        deleted.delete()  # as after donating it to a jitted step
        with pytest.raises(ValueError, match=r"`state` leaf `a/x` is a deleted jax.Array"):
            checkpointer.save(0, {"a": {"x": deleted}})
        assert checkpointer.all_steps() == []


def test_restore_argument_errors(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, {"w": jnp.ones(6)})
        target = {"w": jax.ShapeDtypeStruct((6,), jnp.float32)}
        with pytest.raises(ValueError, match=r"`shardings` leaf `v` is .* at an array leaf"):
            checkpointer.restore(target=target, shardings={"v": one_device_layout(None)})
        with pytest.raises(
            TypeError, match=r"`shardings` leaf `w` is P\(\), but expected a Sharding"
        ):
            checkpointer.restore(target=target, shardings={"w": P()})
        with pytest.raises(ValueError, match=r"`target` leaf `w` of shape \(6,\) cannot be placed"):
            checkpointer.restore(target=target, shardings=fsdp8_layout(jnp.ones(1)))
