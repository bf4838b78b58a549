"""The two-host training example (`examples/multihost.py`) and its launcher.

The launcher runs 2 real processes x 4 CPU devices on 127.0.0.1; their losses must equal the
single-process run on this process's 8 devices, and when one process is SIGKILLed the other
must fail on its own, promptly, and the launcher must report it.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from multiprocess_util import process_context, run_processes

pytestmark = pytest.mark.multiprocess

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
LAUNCHER = EXAMPLES / "launch_multihost.py"
# The smallest run that still splits over every axis of data=2,pipe=2,model=2.
MULTIHOST_ARGS = ["--smallest", "--batch-size", "8", "--microbatches", "2", "--mesh"]
MESH = "data=2,pipe=2,model=2"
LAUNCHER_TIMEOUT = 240  # each process; the launcher kills what is still running then
SURVIVOR_BOUND = 60.0  # seconds the survivor may take to fail after its peer's death


@pytest.fixture(scope="module")
def examples():
    """The example modules (importing them configures nothing beyond the 8 devices we have)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import launch_multihost
    import lm
    import multihost
    import train_lm

    return lm, train_lm, multihost, launch_multihost


def _start_launcher(out: Path, steps: int, *launcher_args: str) -> subprocess.Popen:
    command = [
        sys.executable,
        str(LAUNCHER),
        "--out",
        str(out),
        "--timeout",
        str(LAUNCHER_TIMEOUT),
        *launcher_args,
        "--",
        *MULTIHOST_ARGS,
        MESH,
        "--steps",
        str(steps),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(launcher: subprocess.Popen) -> tuple[int, str, str]:
    try:
        stdout, stderr = launcher.communicate(timeout=LAUNCHER_TIMEOUT + 60)
    except subprocess.TimeoutExpired:
        launcher.terminate()  # on SIGTERM the launcher kills the processes it started
        stdout, stderr = launcher.communicate()
        pytest.fail(f"the launcher itself did not finish:\n{stdout}\n{stderr}")
    return launcher.returncode, stdout, stderr


def test_two_processes_train_like_one(examples, tmp_path):
    _, train_lm, multihost, _ = examples
    steps = 3
    launcher = _start_launcher(tmp_path, steps)
    try:
        # Meanwhile, the same run in this process on its 8 devices, same mesh arrangement.
        args = multihost.parse_args([*MULTIHOST_ARGS, MESH, "--steps", str(steps)])
        reference, _ = train_lm.train(
            multihost.run_config(args),
            config=multihost.SMALLEST,
            progress=False,
            show_layout=False,
        )
    except BaseException:
        launcher.terminate()
        launcher.communicate()
        raise
    returncode, stdout, stderr = _finish(launcher)
    assert returncode == 0, f"{stdout}\n{stderr}"
    assert "all 2 processes succeeded" in stdout

    assert len(reference) == steps
    for process_id in range(2):
        result = json.loads((tmp_path / f"process{process_id}.json").read_text())
        assert result["process_id"] == process_id and result["num_processes"] == 2
        assert result["mesh"] == {"data": 2, "pipe": 2, "model": 2}
        np.testing.assert_allclose(result["losses"], reference, rtol=1e-5)
        output = (tmp_path / f"process{process_id}.out").read_text()
        # Each process loaded only its half of every global batch of 8 rows.
        rows = f"[{4 * process_id}, {4 * process_id + 4})"
        for step in range(1, steps + 1):
            assert f"process {process_id}: step {step}: rows {rows} of the global batch" in output
        # The coordinator listens on loopback only.
        assert "coordinator 127.0.0.1:" in output and "(bound to 127.0.0.1:" in output


def test_a_dead_process_makes_the_other_fail_promptly(tmp_path):
    # Many steps: process 0 cannot finish them without process 1.
    launcher = _start_launcher(
        tmp_path, 50, "--kill-process", "1", "--kill-after-step", "1", "--grace", "120"
    )
    returncode, stdout, stderr = _finish(launcher)
    summary = json.loads((tmp_path / "summary.json").read_text())
    survivor, killed = summary["processes"]

    assert returncode == 1
    assert summary["ok"] is False and summary["failed"] == [0, 1]
    assert "FAILED: processes [0, 1] did not succeed" in stderr
    assert killed["killed_because"] == "injected" and killed["returncode"] == -9
    assert "process 1: step 2:" in (tmp_path / "process1.out").read_text()  # after step 1
    # The survivor failed by itself (not killed by the launcher), with an error, in time.
    assert survivor["killed_because"] is None and survivor["returncode"] == 1, stdout
    assert "process 0: FAILED, exit code 1" in stdout
    assert survivor["ended"] - killed["ended"] < SURVIVOR_BOUND
    assert "JaxRuntimeError" in (tmp_path / "process0.err").read_text()
    assert not (tmp_path / "process0.json").exists()  # no losses written for a failed run


def test_process_rows_split_the_global_batch(examples):
    lm, _, multihost, _ = examples
    tokens = lm.encode(lm.make_corpus(2_000), 32)
    batches = lm.Batches(tokens, batch_size=12, seq_len=8, seed=3)
    for position in (0, 7):
        whole = batches.batch(position)
        parts = []
        for process in range(3):
            rows = multihost.process_rows(12, process, 3)
            assert rows == range(4 * process, 4 * process + 4)
            parts.append(multihost.load_rows(batches, position, rows))
        np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_process_rows_refuse_an_uneven_split(examples):
    _, _, multihost, _ = examples
    with pytest.raises(SystemExit, match=r"--batch-size 10 must divide by the 3 processes"):
        multihost.process_rows(10, 0, 3)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fake_multihost.py"
    path.write_text(
        "import sys\n"
        "process_id = int(sys.argv[sys.argv.index('--process-id') + 1])\n" + textwrap.dedent(body)
    )
    return path


def test_launcher_kills_a_process_past_its_timeout(examples, tmp_path):
    *_, launch_multihost = examples
    script = _script(tmp_path, "import time\nif process_id == 1:\n    time.sleep(600)\n")
    first, second = launch_multihost.launch(
        num_processes=2, timeout=2.0, out=tmp_path / "out", script=script
    )
    assert first.ok and first.killed_because is None
    assert second.killed_because == "timeout" and second.popen.returncode == -9
    assert not second.ok


def test_launcher_stops_the_others_after_a_failure_and_grace(examples, tmp_path):
    *_, launch_multihost = examples
    body = "import time\nif process_id == 0:\n    time.sleep(600)\nsys.exit(3)\n"
    first, second = launch_multihost.launch(
        num_processes=2,
        timeout=600.0,
        grace=1.0,
        out=tmp_path / "out",
        script=_script(tmp_path, body),
    )
    assert second.popen.returncode == 3 and second.killed_because is None
    assert first.killed_because == "peer failure" and first.popen.returncode == -9


def test_launcher_refuses_a_kill_process_out_of_range(examples, tmp_path, capsys):
    *_, launch_multihost = examples
    with pytest.raises(SystemExit) as error:
        launch_multihost.main(["--kill-process", "2"])
    assert error.value.code == 2
    assert "--kill-process must be a process id in [0, 2); got 2" in capsys.readouterr().err


def test_process_rows_become_one_global_batch(examples):
    # One process: its rows are the whole batch, placed by eqpar (split over every mesh axis;
    # the step regroups them over `data` within each process).
    lm, train_lm, multihost, _ = examples
    from jax.sharding import PartitionSpec as P

    mesh = train_lm.make_mesh({"data": 2, "pipe": 2, "model": 2})
    multihost.check_mesh_follows_processes(mesh)
    batches = lm.Batches(lm.encode(lm.make_corpus(2_000), 32), batch_size=8, seq_len=8)
    tokens = multihost.place_process_rows(batches, 5, mesh)
    assert tokens.sharding.spec == P(("data", "pipe", "model"))
    np.testing.assert_array_equal(np.asarray(tokens), batches.batch(5))


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


def test_multihost_flags_refuse_counts_below_one(examples, capsys):
    _, _, multihost, _ = examples
    for flag in ("--microbatches", "--batch-size", "--steps"):
        with pytest.raises(SystemExit):
            multihost.parse_args([flag, "0"])
        assert f"argument {flag}: must be a positive integer, got '0'" in capsys.readouterr().err
