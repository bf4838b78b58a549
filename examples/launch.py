"""Run `train_lm.py` as the processes of a multi-process job: on this machine, or as one process
of a job started by SLURM, `mpirun` or by hand.

    python examples/train_lm.py --processes 2 --size tiny --steps 20   # 2 local processes

`--processes N` starts N copies of the same command on this machine, process 0 the coordinator
on `127.0.0.1:<free port>` (listening on loopback only), each with its own simulated CPU
devices (`EQPAR_NUM_CPU_DEVICES`, by default 8 / N) and gloo collectives between them. The
launcher prints every process's lines as they come, prefixed `[p<id>]`, and hides the start-up
chatter of JAX's runtime and of Gloo (`[Gloo] Rank 0 is connected to 1 peer ranks...`, also
where the threads that write it cut it into pieces, and glog/absl lines) unless `--verbose`;
a process that fails shows its hidden lines too. It bounds every process by
`--timeout` seconds, gives the others `GRACE` seconds to fail on their own once one has failed,
and only ever signals the process groups it created. Its exit status is 0 only if every process
succeeded.

Each process joins the job through `eqpar.initialize()`, which reads `EQPAR_COORDINATOR_ADDRESS`,
`EQPAR_NUM_PROCESSES` and `EQPAR_PROCESS_ID` (set by the launcher, or by hand) or else leaves it
to JAX's cluster detection (SLURM, Open MPI, Cloud TPU): see `--distributed` and
docs/tutorials/multihost.md.
"""

import collections
import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any

LOOPBACK = "127.0.0.1"
GRACE = 30.0  # seconds the other processes get to fail by themselves after one failed
JOB_VARIABLES = ("EQPAR_COORDINATOR_ADDRESS", "EQPAR_NUM_PROCESSES", "EQPAR_PROCESS_ID")
# Start-up chatter, matched by what it says wherever it is in a line: the C++ threads of
# Gloo and of JAX's runtime write to the same stream piece by piece, so one line can hold
# pieces of two messages, or begin in the middle of one (`  peer ranks. Expected number of
# connected peer ranks is : 3`, a lone `3`).
CHATTER = re.compile(
    r"\[Gloo\]"  # Gloo: `[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of ...`
    r"|\bis connected to \d+\b|\bpeer ranks\b"  # ... and the pieces of that line
    r"|^\s*\d+\s*$"  # its last piece alone: the expected number
    r"|\b[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w./-]+:\d+\]"  # glog/absl, from C++
    r"|^[IWEF]\d{4} \d\d:\d\d:\d\d"  # the same, cut short
    r"|^WARNING: All log messages before absl::InitializeLog"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] [\w./-]+:\d+\]"  # TensorFlow's format
)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port the OS reports free on `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def in_job() -> bool:
    """Whether this process was started as one process of a job by `launch` (or by hand with
    the same variables)."""
    return all(os.environ.get(name) for name in JOB_VARIABLES)


def join(*, timeout: int = 120) -> None:
    """Join the job before JAX starts: gloo collectives between CPU processes (other backends
    ignore it), then `eqpar.initialize()` with its environment variables or JAX's cluster
    detection."""
    import jax

    import eqpar

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    eqpar.initialize(initialization_timeout=timeout)


@dataclasses.dataclass
class Process:
    """One started process and what became of it."""

    process_id: int
    popen: subprocess.Popen
    started: float
    hidden: collections.deque  # its last lines of chatter, shown if it fails
    ended: float | None = None
    killed_because: str | None = None  # "timeout" or "peer failure" (SIGKILL)

    @property
    def ok(self) -> bool:
        return self.popen.returncode == 0 and self.killed_because is None

    def describe(self) -> str:
        seconds = (self.ended or time.monotonic()) - self.started
        if self.killed_because is not None:
            reason = self.killed_because
            return f"process {self.process_id}: killed ({reason}) after {seconds:.1f} s"
        status = "ok" if self.ok else f"FAILED (exit code {self.popen.returncode})"
        return f"process {self.process_id}: {status} after {seconds:.1f} s"


def _kill_group(process: Process, reason: str) -> None:
    """SIGKILL the group `launch` created for `process`, only while it is unreaped (so the
    group id, its pid, cannot belong to anything else)."""
    if process.popen.poll() is not None:
        return
    try:
        os.killpg(process.popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.popen.wait()
    process.ended = time.monotonic()
    process.killed_because = reason


def _read_lines(process_id: int, stream: IO[str], lines: queue.Queue) -> None:
    for line in stream:
        lines.put((process_id, line.rstrip("\n")))
    lines.put((process_id, None))


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    timeout: float = 600.0,
    grace: float = GRACE,
    verbose: bool = False,
    devices_per_process: int | None = None,
    write: Callable[[str], Any] = print,
) -> list[Process]:
    """Run `num_processes` copies of `command` as one job on this machine and wait for them.

    **Arguments:**

    - `command`: the program and its arguments, the same for every process.
    - `num_processes`: how many.
    - `timeout`: seconds each may run before it is killed.
    - `grace`: seconds the others get once one has failed, before they are killed.
    - `verbose`: show JAX's and Gloo's start-up chatter too.
    - `devices_per_process`: simulated CPU devices of each (default `EQPAR_NUM_CPU_DEVICES`
      if set, else 8 / `num_processes`).
    - `write`: where the prefixed lines go.

    **Returns:** the processes, in process-id order.
    """
    coordinator = f"{LOOPBACK}:{free_port()}"
    if devices_per_process is None:
        default = max(1, 8 // num_processes)
        devices_per_process = int(os.environ.get("EQPAR_NUM_CPU_DEVICES", default))
    lines: queue.Queue = queue.Queue()
    processes: list[Process] = []
    try:
        for process_id in range(num_processes):
            env = {
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
                "EQPAR_NUM_CPU_DEVICES": str(devices_per_process),
                "EQPAR_COORDINATOR_ADDRESS": coordinator,
                "EQPAR_COORDINATOR_BIND_ADDRESS": coordinator,
                "EQPAR_NUM_PROCESSES": str(num_processes),
                "EQPAR_PROCESS_ID": str(process_id),
            }
            popen = subprocess.Popen(
                list(command),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,  # a process group of its own, for `_kill_group`
            )
            process = Process(process_id, popen, time.monotonic(), collections.deque(maxlen=40))
            processes.append(process)
            assert popen.stdout is not None
            threading.Thread(
                target=_read_lines, args=(process_id, popen.stdout, lines), daemon=True
            ).start()

        open_streams = num_processes
        stop_at = [p.started + timeout for p in processes]
        while open_streams or any(p.ended is None for p in processes):
            try:
                process_id, line = lines.get(timeout=0.1)
            except queue.Empty:
                pass
            else:
                if line is None:
                    open_streams -= 1
                elif verbose or not CHATTER.search(line):
                    write(f"[p{process_id}] {line}")
                else:
                    processes[process_id].hidden.append(line)
            now = time.monotonic()
            for process in processes:
                if process.ended is None and process.popen.poll() is not None:
                    process.ended = now
                elif process.ended is None and now >= stop_at[process.process_id]:
                    late = stop_at[process.process_id] < process.started + timeout
                    _kill_group(process, "peer failure" if late else "timeout")
                if process.ended is not None and not process.ok:
                    for other in processes:
                        stop_at[other.process_id] = min(stop_at[other.process_id], now + grace)
    finally:
        for process in processes:
            _kill_group(process, "launcher stopped")
    return processes


def launch_command(
    argv: Sequence[str], num_processes: int, *, timeout: float, verbose: bool, script: str
) -> int:
    """`launch` `script` with `argv` on `num_processes` processes and report; the exit status:
    0 only if every process succeeded, the processes' own where all failed with the same one
    (2: they refused the options), else 1."""
    # SIGTERM (e.g. from a test's timeout) unwinds `launch`, which kills what it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(
        f"launching {num_processes} processes on {LOOPBACK} (lines prefixed [p<id>]"
        f"{'' if verbose else '; JAX and Gloo start-up chatter hidden, --verbose shows it'})",
        flush=True,
    )
    processes = launch(
        [sys.executable, script, *argv],
        num_processes,
        timeout=timeout,
        verbose=verbose,
        write=lambda line: print(line, flush=True),
    )
    for process in processes:
        print(process.describe())
        if not process.ok and process.hidden and not verbose:
            print("\n".join(f"  [p{process.process_id}] {line}" for line in process.hidden))
    failed = [p.process_id for p in processes if not p.ok]
    if failed:
        print(f"FAILED: processes {failed} did not succeed", file=sys.stderr)
        codes = {p.popen.returncode for p in processes}
        # Every process refused the same way (a usage error: 2): the launcher says the same.
        return codes.pop() if len(codes) == 1 and min(codes) > 0 else 1
    print(f"all {num_processes} processes succeeded")
    return 0


def exit_status(main: Callable[[], int], *, distributed: bool) -> int:
    """Run `main` and give its exit status; in a job, leave at once on an error.

    A process whose peer died fails in its next collective (`JaxRuntimeError`). JAX's exit-time
    shutdown would then wait at a barrier for every peer until the coordination service's
    heartbeat timeout ends it (about a minute); a failed process of a job therefore prints
    its error and leaves through `os._exit`."""
    if not distributed:
        return main()
    try:
        status = main()
    except SystemExit as error:  # a usage error: say so and leave
        if isinstance(error.code, str):
            print(error.code, file=sys.stderr)
        status = 0 if error.code is None else error.code if isinstance(error.code, int) else 2
        if status == 0:
            return 0
    except BaseException:
        traceback.print_exc()
        status = 1
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
