"""Run test code in several real Python processes on 127.0.0.1, each bounded by a timeout.

Multi-host code is tested the way it runs on a cluster: N separate processes that meet through
`jax.distributed.initialize`. This module is the harness for that, shared by every
multi-process test. It never leaves anything behind: each process is started in a new process
group of its own, and any process still running when it times out (or after a peer has failed)
is killed through that group, never through a search by name.

Parent side (in the pytest process):

```python
from multiprocess_util import run_processes

def _child():                       # module level, so the child can import it
    from multiprocess_util import initialize_cpu_distributed
    process_id, num_processes = initialize_cpu_distributed(num_cpu_devices=4)
    import jax
    assert jax.device_count() == 4 * num_processes
    print(f"process {process_id} done")

def test_something():
    results = run_processes(_child, num_processes=2, timeout=120)
    assert all(f"process {r.process_id} done" in r.stdout for r in results)
```

`run_processes` raises `MultiprocessFailure` (an `AssertionError`, so pytest reports a test
failure) carrying every process's exit status, stdout and stderr as soon as one process fails
or times out; `check=False` returns the results instead.

Child side: `process_context()` gives this process's id, the process count and the coordinator
address; `initialize_cpu_distributed()` configures the CPU backend (gloo collectives, a number
of CPU devices) and calls `jax.distributed.initialize` with them. The child functions should
import JAX-configuring code (and the package under test) inside the function body, so that
importing the test module in the child has no side effects.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "MultiprocessFailure",
    "ProcessResult",
    "free_port",
    "initialize_cpu_distributed",
    "process_context",
    "run_processes",
]

ENV_PROCESS_ID = "EQPAR_TEST_PROCESS_ID"
ENV_NUM_PROCESSES = "EQPAR_TEST_NUM_PROCESSES"
ENV_COORDINATOR = "EQPAR_TEST_COORDINATOR"

HOST = "127.0.0.1"

# Run in each child as `python -c`: import the target's module by name and call the target.
_BOOTSTRAP = """\
import importlib, sys
root, module_name, qualname = sys.argv[1:4]
sys.path.insert(0, root)
target = importlib.import_module(module_name)
for attribute in qualname.split("."):
    target = getattr(target, attribute)
target()
"""


@dataclass(frozen=True)
class ProcessResult:
    """What one process did.

    - `process_id`: its index (the `process_id` given to `jax.distributed.initialize`).
    - `returncode`: its exit status; negative for a signal (`-9` when the harness killed it).
    - `killed_because`: `None` if it ended on its own, else `"timeout"` (it ran past the
      timeout) or `"peer failure"` (still running `grace` seconds after another process
      failed).
    - `stdout`, `stderr`: everything it wrote.
    - `seconds`: wall time from start to exit.
    """

    process_id: int
    returncode: int
    killed_because: str | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_because is None

    def describe(self) -> str:
        if self.killed_because == "timeout":
            status = f"killed after the {self.seconds:.0f} s timeout"
        elif self.killed_because == "peer failure":
            status = f"killed {self.seconds:.0f} s in, after another process failed"
        else:
            status = f"exit code {self.returncode} after {self.seconds:.1f} s"
        return f"process {self.process_id}: {status}"


class MultiprocessFailure(AssertionError):
    """One or more processes failed or timed out; `results` holds every process's result."""

    def __init__(self, results: list[ProcessResult]):
        self.results = results
        failed = [result for result in results if not result.ok]
        lines = [
            f"{len(failed)} of {len(results)} processes did not succeed: "
            + "; ".join(result.describe() for result in failed)
        ]
        for result in results:
            lines += [
                f"----- {result.describe()} -----",
                "--- stdout ---",
                result.stdout.rstrip() or "(empty)",
                "--- stderr ---",
                result.stderr.rstrip() or "(empty)",
            ]
        super().__init__("\n".join(lines))


def free_port(host: str = HOST) -> int:
    """A TCP port that is free on `host` right now (the OS picks it; another program could
    still take it before it is used, which is unlikely on a test machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _target_command(target: Callable[[], Any] | str | os.PathLike) -> list[str]:
    if isinstance(target, str | os.PathLike):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"`target` {str(path)!r} is not a file; give a script or a function.")
        return [sys.executable, str(path)]
    if not callable(target):
        raise TypeError(f"`target` must be a function or a script path, got {target!r}.")
    module_name = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    module = sys.modules.get(module_name or "")
    module_file = getattr(module, "__file__", None)
    if module_name in (None, "__main__") or module_file is None or "<locals>" in qualname:
        raise ValueError(
            f"`target` {qualname or target!r} must be a module-level function of an importable "
            "module (the child process imports it by name); move it to module level or pass "
            "a script path."
        )
    # The directory that makes `module_name` importable (several levels up for a package).
    root = Path(module_file).resolve().parent
    for _ in range(module_name.count(".")):  # type: ignore[union-attr]
        root = root.parent
    return [sys.executable, "-c", _BOOTSTRAP, str(root), str(module_name), qualname]


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the process group the harness created for `process` (its pid is the group id).

    Only called while `process` has not been reaped, so the group id still belongs to it.
    """
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _read(stream: IO[bytes]) -> str:
    stream.seek(0)
    return stream.read().decode(errors="replace")


def run_processes(
    target: Callable[[], Any] | str | os.PathLike,
    num_processes: int,
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    start: Iterable[int] | None = None,
    grace: float = 10.0,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
) -> list[ProcessResult]:
    """Run `target` in `num_processes` Python processes and wait for all of them.

    **Arguments:**

    - `target`: a module-level function (each process imports its module and calls it with
      no arguments) or the path of a Python script (run as `python script.py`).
    - `num_processes`: how many processes make up the job; every process sees it as
      `EQPAR_TEST_NUM_PROCESSES`, its own index as `EQPAR_TEST_PROCESS_ID` and the
      coordinator address (`127.0.0.1:<free port>`) as `EQPAR_TEST_COORDINATOR`.
    - `timeout`: seconds each process may run; a process still running then is killed.
    - `env`: extra environment variables for every process (on top of this process's
      environment). `PYTHONUNBUFFERED=1` is always set so output survives a kill.
    - `start`: the process ids to actually start (default: all of them). Starting fewer than
      `num_processes` simulates peers that never come.
    - `grace`: once a process has failed, seconds the others get to finish before they are
      killed (they would otherwise wait for the failed peer until their own timeouts).
    - `cwd`: working directory of the processes (default: this process's).
    - `check`: raise `MultiprocessFailure` if any process failed, timed out or was killed.

    **Returns:** one `ProcessResult` per started process, in process-id order.
    """
    __tracebackhide__ = True  # pytest: report the failure, not this function's source
    if num_processes < 1:
        raise ValueError(f"`num_processes` must be at least 1, got {num_processes}.")
    process_ids = sorted(set(range(num_processes) if start is None else start))
    if not process_ids or not set(process_ids) <= set(range(num_processes)):
        raise ValueError(
            f"`start` must name some of the process ids 0..{num_processes - 1}, got {start!r}."
        )
    command = _target_command(target)
    coordinator = f"{HOST}:{free_port()}"
    base_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}

    processes: dict[int, subprocess.Popen] = {}
    outputs: dict[int, tuple[IO[bytes], IO[bytes]]] = {}
    started: dict[int, float] = {}
    ended: dict[int, float] = {}
    killed_because: dict[int, str] = {}
    try:
        for process_id in process_ids:
            # Files, not pipes: a chatty process can never block on a full pipe buffer.
            outputs[process_id] = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
            started[process_id] = time.monotonic()
            processes[process_id] = subprocess.Popen(
                command,
                env={
                    **base_env,
                    ENV_PROCESS_ID: str(process_id),
                    ENV_NUM_PROCESSES: str(num_processes),
                    ENV_COORDINATOR: coordinator,
                },
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=outputs[process_id][0],
                stderr=outputs[process_id][1],
                start_new_session=True,  # its own process group, which the harness can kill
            )

        deadline = {process_id: started[process_id] + timeout for process_id in process_ids}
        stop_at = dict(deadline)
        while len(ended) < len(processes):
            for process_id, process in processes.items():
                if process_id in ended:
                    continue
                if process.poll() is not None:
                    ended[process_id] = time.monotonic()
                    if process.returncode != 0:  # a failed peer: the others get `grace` more
                        for other in stop_at:
                            stop_at[other] = min(stop_at[other], ended[process_id] + grace)
                elif time.monotonic() >= stop_at[process_id]:
                    past_deadline = stop_at[process_id] == deadline[process_id]
                    killed_because[process_id] = "timeout" if past_deadline else "peer failure"
                    _kill_group(process)
                    ended[process_id] = time.monotonic()
            if len(ended) < len(processes):
                # Block briefly on one running process instead of spinning.
                waiting = next(p for i, p in processes.items() if i not in ended)
                try:
                    waiting.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for process in processes.values():
            if process.poll() is None:
                _kill_group(process)

    results = []
    for process_id, process in processes.items():
        stdout_file, stderr_file = outputs[process_id]
        results.append(
            ProcessResult(
                process_id=process_id,
                returncode=process.returncode,
                killed_because=killed_because.get(process_id),
                stdout=_read(stdout_file),
                stderr=_read(stderr_file),
                seconds=ended.get(process_id, time.monotonic()) - started[process_id],
            )
        )
        stdout_file.close()
        stderr_file.close()
    if check and not all(result.ok for result in results):
        raise MultiprocessFailure(results)
    return results


# ---------------------------------------------------------------------------------------------
# Child side


def process_context() -> tuple[int, int, str]:
    """`(process_id, num_processes, coordinator_address)` of this process, as set by
    `run_processes`."""
    try:
        return (
            int(os.environ[ENV_PROCESS_ID]),
            int(os.environ[ENV_NUM_PROCESSES]),
            os.environ[ENV_COORDINATOR],
        )
    except KeyError as error:
        raise RuntimeError(
            f"{error.args[0]} is not set: this function runs in processes started by "
            "`multiprocess_util.run_processes`."
        ) from None


def initialize_cpu_distributed(
    num_cpu_devices: int = 4, *, initialization_timeout: int = 60
) -> tuple[int, int]:
    """Join the multi-process JAX job that `run_processes` started, on CPU devices.

    Configures the CPU backend before it starts (gloo cross-process collectives,
    `num_cpu_devices` devices in this process), then calls `jax.distributed.initialize` with
    the coordinator on 127.0.0.1 (bound to 127.0.0.1 only, where JAX supports it).

    **Arguments:**

    - `num_cpu_devices`: CPU devices of this process.
    - `initialization_timeout`: seconds to wait for all processes to connect before failing.

    **Returns:** `(process_id, num_processes)`.
    """
    import jax

    process_id, num_processes, coordinator = process_context()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", num_cpu_devices)
    options: dict[str, Any] = {
        "coordinator_address": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
        "initialization_timeout": initialization_timeout,
    }
    if "coordinator_bind_address" in inspect.signature(jax.distributed.initialize).parameters:
        options["coordinator_bind_address"] = coordinator
    jax.distributed.initialize(**options)
    return process_id, num_processes
