"""Sharded checkpoints (`eqpar.checkpoint`): the guarantees under faults (quarantine, damaged
metadata, step identity, one writer, atomic removal of old steps, a save on only some
processes). Helpers come from `test_checkpoint`; the functions starting with `_child` run in
processes started by `multiprocess_util`."""

import os
import shutil
import signal
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multiprocess_util import run_processes
from test_checkpoint import (
    ENV_DIRECTORY,
    _flip_array_bytes,
    _replace_json,
    _run_child_until_it_kills_itself,
    assert_bitwise_equal,
    corruption_state,
    corruption_target,
)

from eqpar.checkpoint import Checkpointer, CorruptCheckpointError


def test_damaged_step_is_quarantined_and_saving_goes_on_past_it(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(10, corruption_state(10))
        checkpointer.save(20, corruption_state(20))
    _flip_array_bytes(tmp_path / "20")
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.warns(UserWarning) as record:
            restored = checkpointer.restore(target=corruption_target())
        assert "moved aside" in str(record[-1].message)
        assert restored["step"] == 10 and checkpointer.all_steps() == [10]
        (moved,) = tmp_path.glob("20.damaged-*")  # kept for inspection, no longer a step
        assert (moved / "_CHECKPOINT_METADATA").is_file()
        assert checkpointer.should_save(20)
        assert checkpointer.save(20, corruption_state(20))  # no longer blocked
        assert checkpointer.all_steps() == [10, 20]
        assert_bitwise_equal(checkpointer.restore(target=corruption_target()), corruption_state(20))


def _drop_one_array_entry(metadata: dict) -> dict:
    tree = metadata["tree_metadata"]
    del tree[next(iter(tree))]
    return metadata


METADATA_DAMAGE = {
    "step metadata not a dict": lambda d: (d / "_CHECKPOINT_METADATA").write_text("[]"),
    "step metadata a string": lambda d: (d / "_CHECKPOINT_METADATA").write_text('"x"'),
    "custom metadata not a dict": lambda d: _replace_json(
        d / "_CHECKPOINT_METADATA", lambda m: {**m, "custom_metadata": [1]}
    ),
    "eqpar entry missing": lambda d: _replace_json(
        d / "_CHECKPOINT_METADATA", lambda m: {**m, "custom_metadata": {}}
    ),
    "leaf list wrong contents": lambda d: _replace_json(
        d / "_CHECKPOINT_METADATA",
        lambda m: {**m, "custom_metadata": {"eqpar": {"version": 2, "leaves": [{"path": 3}]}}},
    ),
    "array metadata entry missing": lambda d: _replace_json(
        d / "default" / "_METADATA", _drop_one_array_entry
    ),
    "array metadata not a dict": lambda d: (d / "default" / "_METADATA").write_text("[]"),
}


@pytest.mark.parametrize("damage", list(METADATA_DAMAGE), ids=list(METADATA_DAMAGE))
def test_damaged_metadata_is_a_damaged_step(tmp_path, damage):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": jnp.full(4, 1.0), "step": 1})
        checkpointer.save(2, {"w": jnp.full(4, 2.0), "step": 2})
    METADATA_DAMAGE[damage](tmp_path / "2")
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32), "step": 0}
    with Checkpointer(tmp_path) as checkpointer:  # the directory still opens
        assert checkpointer.all_steps() == [1, 2]
        with pytest.raises(CorruptCheckpointError, match=r"step 2 at .* is damaged"):
            checkpointer.restore(2, target=target)
        with pytest.warns(UserWarning) as record:
            assert checkpointer.restore(target=target)["step"] == 1
        assert str(record[-1].message).startswith("Restored step 1")
        assert checkpointer.save(2, {"w": jnp.full(4, 2.0), "step": 2})


def test_restore_of_a_step_checks_the_step_it_holds(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"w": jnp.full(4, 1.0)})
        checkpointer.save(2, {"w": jnp.full(4, 2.0)})
    shutil.rmtree(tmp_path / "2")
    shutil.copytree(tmp_path / "1", tmp_path / "2")  # step 1's files under step 2's name
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(CorruptCheckpointError, match="it holds step 1, not 2"):
            checkpointer.restore(2, target=target)
        with pytest.warns(UserWarning):
            restored = checkpointer.restore(target=target)
        assert checkpointer.restored_step == 1
        np.testing.assert_array_equal(restored["w"], np.full(4, 1.0))


def _edit_leaf_record(step_dir: Path, path: str, **changes) -> None:
    """Change (or, with None, drop) fields of one leaf's record in eqpar's step metadata."""

    def edit(metadata: dict) -> dict:
        (record,) = (r for r in metadata["custom_metadata"]["eqpar"]["leaves"] if r["path"] == path)
        record.update(changes)
        for field in [field for field, value in changes.items() if value is None]:
            del record[field]
        return metadata

    _replace_json(step_dir / "_CHECKPOINT_METADATA", edit)


def test_a_leaf_record_contradicting_its_stored_array(tmp_path):
    def state(step: int) -> dict:
        return {"w": jnp.arange(4.0) * step, "n": step, "key": jax.random.key(step)}

    def assert_is_state(restored: dict, step: int) -> None:
        expected = state(step)
        assert restored["n"] == step and type(restored["n"]) is int
        np.testing.assert_array_equal(restored["w"], expected["w"])
        key_data = jax.random.key_data
        np.testing.assert_array_equal(key_data(restored["key"]), key_data(expected["key"]))

    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, state(1))
        checkpointer.save(2, state(2))
    # The records say `w` is a Python int and `n` a PRNG key; the stored arrays say otherwise.
    _edit_leaf_record(tmp_path / "2", "w", kind="int")
    _edit_leaf_record(tmp_path / "2", "n", kind="prng_key", impl="threefry2x32")
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32), "n": 0, "key": jax.random.key(0)}
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.warns(UserWarning) as record:
            restored = checkpointer.restore(2, target=target)
        assert_is_state(restored, 2)  # what the stored arrays hold, which fits the target
        messages = sorted(str(warning.message) for warning in record)
        assert "says `n` is a PRNG key array (impl threefry2x32)" in messages[0]
        assert (
            "says `w` is a Python int (stored as a 0-d int64 array), but its stored array is "
            "float32 of shape (4,): the checkpoint's metadata is inconsistent with its stored "
            "array. Restored the stored array" in messages[1]
        )
    # A PRNG key whose record lost its kind is not guessed: the step is damaged, and
    # `restore()` falls back to step 1.
    _edit_leaf_record(tmp_path / "2", "key", kind="int", impl=None)
    with Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(
            CorruptCheckpointError, match=r"is damaged: .* says `key` is a Python int"
        ):
            checkpointer.restore(2, target=target)
        with pytest.warns(UserWarning):
            assert_is_state(checkpointer.restore(target=target), 1)
        assert checkpointer.restored_step == 1


def test_one_writer_per_directory_and_readers_never_disturb_a_save(tmp_path):
    writer = Checkpointer(tmp_path)
    writer.save(1, {"w": jnp.ones(2)})
    in_progress = tmp_path / "2.orbax-checkpoint-tmp"  # as if the writer were saving step 2
    (in_progress / "default").mkdir(parents=True)
    (in_progress / "default" / "data").write_bytes(b"partial")
    with Checkpointer(tmp_path) as reader:  # e.g. an eval job
        assert reader.all_steps() == [1]
        assert reader.restore(target={"w": jnp.zeros(2)})["w"].tolist() == [1.0, 1.0]
        with pytest.raises(RuntimeError, match=f"held by pid {os.getpid()} on host") as caught:
            reader.save(3, {"w": jnp.ones(2)})
        assert "One directory has one writer" in str(caught.value)
    assert (in_progress / "default" / "data").read_bytes() == b"partial"  # untouched
    writer.close()  # releases the lock (the file stays; the kernel's lock is what counts)
    with Checkpointer(tmp_path) as next_writer:
        assert next_writer.save(3, {"w": jnp.ones(2)})
        assert not in_progress.exists()  # the lock holder removes unfinished saves
        assert next_writer.all_steps() == [1, 3]


def test_two_threads_on_one_checkpointer_are_refused(tmp_path, monkeypatch):
    import eqpar.checkpoint as module

    entered, release = threading.Event(), threading.Event()
    real_leaves = module._leaves

    def leaves(tree, argument):  # holds the other thread inside `save`
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(timeout=60)
        return real_leaves(tree, argument)

    monkeypatch.setattr(module, "_leaves", leaves)
    with Checkpointer(tmp_path) as checkpointer:
        errors = []
        thread = threading.Thread(
            target=lambda: errors.append(checkpointer.save(0, {"w": jnp.ones(2)}))
        )
        thread.start()
        assert entered.wait(timeout=60)
        try:
            with pytest.raises(RuntimeError, match="in use by another thread"):
                checkpointer.save(1, {"w": jnp.ones(2)})
        finally:
            release.set()
            thread.join(timeout=60)
        assert errors == [True] and checkpointer.all_steps() == [0]


def _child_dies_while_removing_an_old_step():
    """keep=1: save step 1, then die by SIGKILL in the middle of removing it (after one of
    its files is gone) while saving step 2."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp

    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        if files:
            files[0].unlink()
            print("killing myself while removing a step", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rmtree(path, *args, **kwargs)

    checkpointer = Checkpointer(os.environ[ENV_DIRECTORY], keep=1)
    checkpointer.save(1, {"w": jnp.full(8, 1.0)})
    shutil.rmtree = rmtree
    checkpointer.save(2, {"w": jnp.full(8, 2.0)})
    print("unreachable", flush=True)


@pytest.mark.multiprocess
def test_removing_old_steps_is_atomic_under_sigkill(tmp_path):
    _run_child_until_it_kills_itself(_child_dies_while_removing_an_old_step, tmp_path)
    target = {"w": jax.ShapeDtypeStruct((8,), jnp.float32)}
    with Checkpointer(tmp_path, keep=1) as checkpointer:
        assert checkpointer.all_steps() == [2]  # no half-removed step 1 listed
        np.testing.assert_array_equal(checkpointer.restore(target=target)["w"], np.full(8, 2.0))
        assert checkpointer.save(3, {"w": jnp.full(8, 3.0)})  # takes over the stale lock
        assert checkpointer.all_steps() == [3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["3"]


def _child_saves_on_one_process_only():
    from multiprocess_util import initialize_cpu_distributed

    process_id, _ = initialize_cpu_distributed(num_cpu_devices=2)
    import jax.numpy as jnp

    checkpointer = Checkpointer(os.environ[ENV_DIRECTORY], timeout=3)
    if process_id == 0:
        try:
            checkpointer.save(0, {"w": jnp.ones(2)})
        except RuntimeError as error:
            print(f"refused: {error}", flush=True)
    print(f"process {process_id} done", flush=True)


@pytest.mark.multiprocess
def test_save_on_only_some_processes_fails_in_bounded_time(tmp_path):
    results = run_processes(
        _child_saves_on_one_process_only,
        num_processes=2,
        timeout=60,
        env={ENV_DIRECTORY: str(tmp_path)},
        check=False,
    )
    assert "refused: `save` waited 3 s for the other processes" in results[0].stdout, results
    assert "Every process must call `save` with the same step" in results[0].stdout
    assert all(f"process {r.process_id} done" in r.stdout for r in results)
