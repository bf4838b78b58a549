"""The training example as a multi-process job, its launcher, its data pipeline, and
`eqpar.initialize`'s start-up errors.

The example runs as 2 real processes x 4 CPU devices on 127.0.0.1 (started by hand, through
environment variables, and by `--processes 2`) and as 1 process of 8 devices; one process is
SIGKILLed mid-run, and the runs resumed on 2 and then on 1 process train exactly the steps and
examples of an uninterrupted run. A process SIGKILLed while its peer waits in a collective
makes that peer fail: at once where the collective sees the closed connection, else after
`heartbeat_timeout_seconds`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from multiprocess_util import free_port, process_context, run_processes

pytestmark = pytest.mark.multiprocess

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
TRAIN_LM = EXAMPLES / "train_lm.py"
TIMEOUT = 240  # seconds any one process of the tests below may run
BATCH = 8


@pytest.fixture(scope="module")
def examples():
    """The example modules (importing them configures nothing beyond the 8 devices we have)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import data
    import launch
    import train_lm

    return data, launch, train_lm


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EQPAR_")}
    env.pop("XLA_FLAGS", None)
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **extra}


def _cached(tmp_path: Path, **extra: str) -> dict[str, str]:
    """`_environment` with JAX's compilation cache in `tmp_path`: the resumed runs load the
    programs the first run compiled."""
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}  # fmt: skip
    return _environment(**cache, **extra)


def _saved_steps(directory: Path) -> list[int]:
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _log_lines(directory: Path) -> dict[str, list[dict]]:
    """Each process's lines of `--log-examples`, by file name."""
    return {
        path.name: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(directory.glob("process*.jsonl"))
    }


def _finish(popen: subprocess.Popen, timeout: float) -> str:
    try:
        output, _ = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        popen.kill()  # the launcher's SIGKILL cannot be caught: its processes' groups too
        output, _ = popen.communicate()
        pytest.fail(f"did not finish in {timeout} s:\n{output}")
    return output


def _run_until_a_checkpoint_then_kill(command: list, tmp_path: Path, ckpt: Path) -> None:
    """Phase 1 of the killed-job test: two processes started by hand (the environment-variable
    launch), 6 steps; process 1 SIGKILLed (by its pid) once a checkpoint is on disk. A process
    that ends before fails the test with its output."""
    coordinator = f"127.0.0.1:{free_port()}"
    job = {"EQPAR_COORDINATOR_ADDRESS": coordinator, "EQPAR_NUM_PROCESSES": "2"}
    started = [
        subprocess.Popen(
            [*command, "--steps", "6", "--save-every", "1", "--check"],
            cwd=tmp_path,
            env=_cached(tmp_path, **job, EQPAR_PROCESS_ID=str(p), EQPAR_NUM_CPU_DEVICES="4"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _saved_steps(ckpt) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in started):
                for process in started:  # the others too: what each was doing
                    if process.poll() is None:
                        process.kill()
                output = "\n".join(
                    f"process {i}, exit status {p.returncode}:\n{p.communicate()[0]}"
                    for i, p in enumerate(started)
                )
                pytest.fail(f"a process ended before the kill:\n{output}")
            time.sleep(0.02)
        if not _saved_steps(ckpt):
            for process in started:
                process.kill()
            output = "\n".join(f"process {i}:\n{p.communicate()[0]}" for i, p in enumerate(started))
            pytest.fail(f"no checkpoint within {TIMEOUT} s:\n{output}")
        os.kill(started[1].pid, signal.SIGKILL)
        started[1].wait(timeout=30)
        # The job is lost: the survivor fails in its next collective, or in a checkpoint's
        # barrier when JAX's heartbeat timeout ends it; the test does not wait for that.
        time.sleep(1)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.communicate()


def test_killed_job_resumes_on_two_then_one_process_with_exactly_the_next_examples(
    examples, tmp_path
):
    data, _, _ = examples
    data.write_corpus(tmp_path / "corpus", num_documents=120, vocab_size=32)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    args = ["--size", "tiny", "--batch-size", str(BATCH), "--mesh", "data=8", "--fsdp",
            "--optimizer", "sgd", "--data", str(tmp_path / "corpus"), "--log-examples", str(log),
            "--ckpt-dir", str(ckpt), "--no-progress",
            "--out", str(tmp_path / "out")]  # fmt: skip
    command = [sys.executable, str(TRAIN_LM), *args]
    began = time.monotonic()

    # 1. Two processes started by hand (the environment-variable launch), 6 steps; process 1
    # is SIGKILLed (by its pid) once a checkpoint is on disk.
    _run_until_a_checkpoint_then_kill(command, tmp_path, ckpt)
    killed_at = max(_saved_steps(ckpt))
    assert 1 <= killed_at < 4
    after_a = _log_lines(log)
    print(f"killed at step {killed_at}: {time.monotonic() - began:.1f} s")

    # 2. Resumed on 2 processes by the launcher, to step 4.
    launcher = subprocess.Popen(
        [*command, "--resume", "--steps", "4", "--save-every", "4", "--processes", "2",
         "--timeout", str(TIMEOUT)],
        cwd=tmp_path, env=_cached(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    output_b = _finish(launcher, TIMEOUT + 30)
    assert launcher.returncode == 0, output_b
    assert "all 2 processes succeeded" in output_b
    assert "[Gloo]" not in output_b and "peer ranks" not in output_b  # the chatter is hidden
    start_b = int(re.search(r"\[p0\] resumed from step (\d+)", output_b)[1])
    assert killed_at <= start_b < 4
    after_b = _log_lines(log)
    print(f"resumed on 2 processes: {time.monotonic() - began:.1f} s")

    # 3. Resumed on 1 process of 8 devices, to step 6; its --check trains the 6 steps
    # uninterrupted on one device.
    result = subprocess.run(
        [*command, "--resume", "--steps", "6", "--save-every", "6", "--check",
         "--json", str(tmp_path / "c.json")],
        cwd=tmp_path, env=_cached(tmp_path), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step 4" in result.stdout
    uninterrupted = json.loads((tmp_path / "c.json").read_text())["check"]
    assert uninterrupted["passed"]

    # Each step's lines from the run that trained it for good: the killed run up to the step
    # it was resumed from, the 2-process run up to step 4, the 1-process run after.
    print(f"resumed on 1 process: {time.monotonic() - began:.1f} s")
    owner = {step: 0 if step <= start_b else 1 if step <= 4 else 2 for step in range(1, 7)}
    kept = []
    for name, lines in _log_lines(log).items():
        a, b = len(after_a.get(name, [])), len(after_b.get(name, []))
        run_of = [0] * a + [1] * (b - a) + [2] * (len(lines) - b)
        kept += [line for line, run in zip(lines, run_of) if owner[line["step"]] == run]
    losses, ids = {}, []
    for line in kept:
        losses.setdefault(line["step"], line["loss"])
        assert line["loss"] == losses[line["step"]]  # every process saw the same loss
        ids += line["examples"]
    assert sorted(losses) == list(range(1, 7))
    np.testing.assert_allclose(
        [losses[step] for step in range(1, 7)], uninterrupted["serial_losses"], rtol=1e-5
    )
    assert sorted(ids) == list(range(6 * BATCH))  # every example exactly once
    # Each 2-process step read half its rows on each process.
    assert {tuple(line["rows"]) for line in kept if owner[line["step"]] < 2} == {(0, 4), (4, 8)}


def test_corpus_rows_do_not_depend_on_who_reads_them(examples, tmp_path):
    data, _, _ = examples
    corpus = data.write_corpus(tmp_path, num_documents=30, vocab_size=32, num_files=3)
    assert data.open_corpus(tmp_path).lengths.tolist() == corpus.lengths.tolist()
    source = data.PackedCorpus(corpus, batch_size=6, seq_len=15, seed=4)
    # Epoch 0 laid end to end in its order and cut into rows of 16 tokens.
    order = np.random.default_rng([4, 0]).permutation(30)
    stream = np.concatenate([source.documents[int(d)] for d in order])
    expected = stream[: source.rows_per_epoch * 16].reshape(-1, 16)
    for position in (0, 1):
        whole = source.rows(position, range(6))
        parts = [source.rows(position, range(3 * p, 3 * p + 3)) for p in range(2)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
        np.testing.assert_array_equal(whole, expected[6 * position : 6 * position + 6])
    # Past the epoch's rows, the next epoch's order.
    last = source.rows_per_epoch // 6 + 1
    ids = source.example_ids(last, range(6))
    assert ids[-1] >= source.rows_per_epoch
    assert source.rows(last, range(6)).shape == (6, 16)


def test_place_rows_builds_the_global_batch(examples, tmp_path):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    data, _, train_lm = examples
    source = data.PackedCorpus(
        data.write_corpus(tmp_path, num_documents=30), batch_size=8, seq_len=15
    )
    mesh = train_lm.make_mesh({"data": 4, "pipe": 1, "model": 2})
    sharding = NamedSharding(mesh.jax_mesh, P("data"))
    assert data.process_rows(sharding, (8, 16)) == range(8)  # one process holds every row
    tokens = data.place_rows(source, 2, sharding, 16)
    assert tokens.sharding == sharding and isinstance(tokens, jax.Array)
    np.testing.assert_array_equal(np.asarray(tokens), source.rows(2, range(8)))


def test_data_errors_say_what_to_do(examples, tmp_path):
    data, _, _ = examples
    with pytest.raises(data.DataError, match=r"python examples/data.py .* --vocab-size V"):
        data.open_corpus(tmp_path / "missing")
    corpus = data.write_corpus(tmp_path, num_documents=4)
    with pytest.raises(data.DataError, match=r"fewer than one batch of --batch-size 64"):
        data.PackedCorpus(corpus, batch_size=64, seq_len=15)
    source = data.PackedCorpus(corpus, batch_size=2, seq_len=15)
    saved = data.checkpoint_state(data.PackedCorpus(corpus, batch_size=4, seq_len=15))
    with pytest.raises(data.DataError, match=r"batch_size 4 -> 2.*resume with the saved"):
        data.check_restored(saved, source)
    # A damaged file is named, with --data and the fix: truncated (found when it is opened),
    # or damaged inside (found when a document is read).
    shard = corpus.directory / corpus.files[1]
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(data.DataError) as error_info:
        data.PackedCorpus(corpus, batch_size=2, seq_len=15)
    assert str(error_info.value).startswith(f"--data {tmp_path}: cannot open {shard} (")
    assert "truncated or damaged: write the corpus again" in str(error_info.value)
    shard.write_bytes(whole[:200] + bytes(200) + whole[400:])  # inside its records
    source = data.PackedCorpus(corpus, batch_size=2, seq_len=15)
    with pytest.raises(data.DataError, match=rf"--data {tmp_path}: cannot read document \d+ "
                       rf"from {shard} \(RuntimeError: Corrupted"):  # fmt: skip
        for position in range(source.rows_per_epoch // 2):
            source.rows(position, range(2))
    (tmp_path / "corpus.json").write_text("{")
    with pytest.raises(data.DataError, match=r"cannot read .*corpus.json"):
        data.open_corpus(tmp_path)


def _fake_script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "fake.py"
    path.write_text(
        "import os, sys, time\nprocess_id = int(os.environ['EQPAR_PROCESS_ID'])\n" + body
    )
    return [sys.executable, str(path)]


def test_launcher_prefixes_lines_and_hides_start_up_chatter(examples, tmp_path):
    _, launch, _ = examples
    body = (
        "print('[Gloo] Rank', process_id)\nprint('step 1 of', os.environ['EQPAR_NUM_PROCESSES'])\n"
    )
    shown: list[str] = []
    processes = launch.launch(_fake_script(tmp_path, body), 2, write=shown.append)
    assert all(p.ok for p in processes)
    assert sorted(shown) == ["[p0] step 1 of 2", "[p1] step 1 of 2"]
    assert [list(p.hidden) for p in processes] == [["[Gloo] Rank 0"], ["[Gloo] Rank 1"]]
    shown.clear()
    launch.launch(_fake_script(tmp_path, body), 1, verbose=True, write=shown.append)
    assert shown == ["[p0] [Gloo] Rank 0", "[p0] step 1 of 1"]


# What Gloo's and JAX's C++ threads write while processes connect, as it reaches the launcher:
# Gloo writes its line piece by piece from several threads, so a line can hold pieces of two
# (`[p1]  peer ranks. ...` was shown before), or be the last piece alone.
CHATTER = [
    "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
    "[Gloo] Rank 0 is connected to 0[Gloo] Rank 0 is connected to 0 peer ranks. Expected "
    "number of connected peer ranks is : 0",
    " peer ranks. Expected number of connected peer ranks is : 0",
    " is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
    "Expected number of connected peer ranks is : 7",
    "7",
    "I0000 00:00:1732700000.123456   12345 coordination_service_agent.cc:372] Coordination "
    "agent has successfully connected.",
    "E1127 11:52:03.123456    4242 client.cc:99] Polled an error",
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "2024-11-27 11:52:03.123456: W external/xla/xla/pjrt/cpu/gloo_collectives.cc:12] text",
]


def test_launcher_hides_chatter_by_what_it_says(examples, tmp_path):
    _, launch, _ = examples
    body = f"for line in {CHATTER!r}:\n    print(line)\nprint('step 1 of 2')\n"
    shown: list[str] = []
    processes = launch.launch(_fake_script(tmp_path, body), 2, write=shown.append)
    assert all(p.ok for p in processes)
    assert sorted(shown) == ["[p0] step 1 of 2", "[p1] step 1 of 2"]
    assert [list(p.hidden) for p in processes] == [CHATTER, CHATTER]  # shown if it fails


def test_launcher_kills_past_the_timeout_and_after_a_peer_failed(examples, tmp_path):
    _, launch, _ = examples
    sleeper = _fake_script(tmp_path, "if process_id == 1:\n    time.sleep(600)\n")
    first, second = launch.launch(sleeper, 2, timeout=2.0, write=lambda line: None)
    assert first.ok and second.killed_because == "timeout" and second.popen.returncode == -9
    failing = _fake_script(tmp_path, "if process_id == 0:\n    time.sleep(600)\nsys.exit(3)\n")
    first, second = launch.launch(failing, 2, grace=1.0, write=lambda line: None)
    assert second.popen.returncode == 3 and second.killed_because is None
    assert first.killed_because == "peer failure" and first.popen.returncode == -9


def _child_initialize_alone():
    """One process of a job of 2 calls `eqpar.initialize`; the other never starts."""
    process_id, num_processes, coordinator = process_context()
    import jax

    jax.config.update("jax_platforms", "cpu")
    import eqpar

    try:
        eqpar.initialize(coordinator, num_processes, process_id, initialization_timeout=2)
    except TimeoutError as error:
        print(f"TimeoutError: {error}")
        sys.exit(3)
    print("initialized without its peer")


@pytest.mark.parametrize("started", [0, 1], ids=["coordinator-alone", "peer-alone"])
def test_a_process_that_never_starts_is_a_python_error_in_bounded_time(started):
    # JAX alone would SIGABRT with "another task died"; eqpar raises a TimeoutError that names
    # what is missing, within the 2 s initialization_timeout (plus start-up).
    (result,) = run_processes(
        _child_initialize_alone, 2, start=[started], timeout=60, check=False, cwd=REPO_ROOT
    )
    assert result.killed_because is None, result.describe()
    assert result.returncode == 3, f"{result.describe()}\n{result.stdout}\n{result.stderr}"
    if started == 0:
        assert "process(es) [1] never connected" in result.stdout
    else:
        assert "could not reach the coordinator (process 0) at 127.0.0.1:" in result.stdout
    assert "initialization_timeout" in result.stdout
    assert result.seconds < 30


HEARTBEAT_TIMEOUT = 3  # seconds: JAX's coordination service then declares a silent peer dead


def _child_peer_dies_in_a_collective():
    """Process 1 is SIGKILLed (by its own pid) while process 0 waits for it in a collective
    (`EQPAR_TEST_COLLECTIVE`: an all-gather or an all-reduce over both processes)."""
    process_id, num_processes, coordinator = process_context()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import eqpar

    eqpar.initialize(
        coordinator,
        num_processes,
        process_id,
        initialization_timeout=30,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT,
    )
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    whole = NamedSharding(mesh, P())
    if os.environ["EQPAR_TEST_COLLECTIVE"] == "all-gather":
        collective = jax.jit(lambda x: 2 * x, out_shardings=whole)
    else:
        collective = jax.jit(lambda x: x.sum(), out_shardings=whole)
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.ones(2, np.float32)
    )
    np.asarray(collective(x))  # both processes: compiled, and the connections made
    if process_id == 1:
        time.sleep(1.0)  # process 0 is inside the next collective by now
        print("killing myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            np.asarray(collective(x))
    except Exception as error:  # any error: the test reads which one
        print(f"raised {type(error).__name__}: {error}", flush=True)
        os._exit(3)  # as the example does: JAX's exit barrier would wait for the dead peer


@pytest.mark.parametrize("collective", ["all-gather", "all-reduce"])
def test_a_process_that_dies_makes_the_other_fail_promptly(collective):
    # An all-gather on gloo sees the dead peer's closed connection at once: a Python
    # JaxRuntimeError. An all-reduce waiting on process 0 does not see it: JAX's coordination
    # service ends the survivor (SIGABRT, "another task died") once the dead peer has missed
    # its heartbeats for `heartbeat_timeout_seconds` (JAX's default 100 s; 3 s here).
    survivor, killed = run_processes(
        _child_peer_dies_in_a_collective,
        2,
        timeout=60,
        grace=30,  # the harness must not be the one that ends the survivor
        env={"EQPAR_TEST_COLLECTIVE": collective},
        check=False,
        cwd=REPO_ROOT,
    )
    output = f"{survivor.describe()}\n{survivor.stdout}\n{survivor.stderr[-3000:]}"
    assert killed.returncode == -signal.SIGKILL and "killing myself" in killed.stdout, (
        f"{killed.describe()}\n{killed.stdout}\n{killed.stderr[-3000:]}"
    )
    assert survivor.killed_because is None, output
    # Both started together: the survivor's extra seconds are its time after the death.
    after_death = survivor.seconds - killed.seconds
    if collective == "all-gather":
        assert survivor.returncode == 3, output
        assert "raised JaxRuntimeError" in survivor.stdout, output
        assert "Connection closed by peer" in survivor.stdout, output
        assert after_death < 5, output
    else:
        assert survivor.returncode == -signal.SIGABRT, output
        assert "stopped sending heartbeats" in survivor.stderr, output
        assert after_death < HEARTBEAT_TIMEOUT + 10, output
    print(f"{collective}: the survivor ended {after_death:.1f} s after its peer's death")


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_coordinator_address_of_another_machine_is_a_clear_error_at_once(
    num_processes, monkeypatch
):
    # 192.0.2.1 (TEST-NET-1) is no address of this machine. Before: with 2 processes, a bare
    # `OSError: [Errno 99] Cannot assign requested address`; with 1, JAX's own bind crashed
    # the process (a segfault). Binding fails at once: no network wait to bound.
    import time

    import jax

    import eqpar
    from eqpar import runtime

    started = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: started.append(kwargs))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime, "_initialized_by_eqpar", None)
    monkeypatch.delenv("EQPAR_COORDINATOR_BIND_ADDRESS", raising=False)
    begin = time.monotonic()
    with pytest.raises(OSError) as info:
        eqpar.initialize("192.0.2.1:1234", num_processes, 0, initialization_timeout=2)
    assert time.monotonic() - begin < 5
    message = str(info.value)
    assert "process 0 (the coordinator) cannot listen on 192.0.2.1:1234" in message
    assert "'192.0.2.1' is not an address of this machine" in message
    assert "`coordinator_bind_address`" in message and "'0.0.0.0:1234'" in message
    assert not started  # refused before JAX's runtime starts
    if num_processes == 1:  # the fix it names: listen on a local address, keep the address
        eqpar.initialize("192.0.2.1:1234", 1, 0, coordinator_bind_address="127.0.0.1:1234")
        (call,) = started
        assert call["coordinator_address"] == "192.0.2.1:1234"
        assert call["coordinator_bind_address"] == "127.0.0.1:1234"
