"""Start every process of `multihost.py` on this machine, bounded in time, and report.

    python examples/launch_multihost.py                          # 2 processes x 4 CPU devices
    python examples/launch_multihost.py --out runs/mh -- --steps 5 --smallest
    python examples/launch_multihost.py --kill-process 1 --kill-after-step 1   # fault drill

Arguments after `--` go to every `multihost.py` process. The coordinator is process 0 on
`127.0.0.1:<free port>`, bound to loopback only. Each process runs in a process group of its
own; the launcher only ever signals those groups, and:

- kills every process still running after `--timeout` seconds;
- once a process has failed, gives the others `--grace` seconds to fail on their own (they
  notice the lost peer in their next collective) and then kills them;
- with `--kill-process P --kill-after-step N`, sends SIGKILL to process `P` as soon as it
  reports that step `N` is done (to show that the survivors do not hang).

Each process's stdout/stderr and losses (`process<P>.out`, `.err`, `.json`) and a summary
(`summary.json`) go to `--out`. The exit status is 0 only if every process succeeded.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

MULTIHOST = pathlib.Path(__file__).resolve().parent / "multihost.py"
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass
class Process:
    """One started process and what became of it."""

    process_id: int
    popen: subprocess.Popen
    stdout: pathlib.Path
    stderr: pathlib.Path
    started: float
    ended: float | None = None
    killed_because: str | None = None  # "timeout", "peer failure" or "injected" (SIGKILL)

    @property
    def ok(self) -> bool:
        return self.popen.returncode == 0 and self.killed_because is None

    def describe(self) -> str:
        seconds = (self.ended or time.monotonic()) - self.started
        if self.killed_because == "injected":
            return f"process {self.process_id}: killed on request (SIGKILL) after {seconds:.1f} s"
        if self.killed_because is not None:
            return (
                f"process {self.process_id}: killed ({self.killed_because}) after {seconds:.1f} s"
            )
        status = "ok" if self.ok else "FAILED"
        return (
            f"process {self.process_id}: {status}, exit code {self.popen.returncode} after "
            f"{seconds:.1f} s"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "process_id": self.process_id,
            "returncode": self.popen.returncode,
            "killed_because": self.killed_because,
            "started": self.started,
            "ended": self.ended,
            "seconds": (self.ended or time.monotonic()) - self.started,
            "ok": self.ok,
        }


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port the OS reports free on `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _kill_group(process: Process, reason: str) -> None:
    """SIGKILL the group the launcher created for `process`; only while it is unreaped, so the
    group id (its pid) cannot belong to anything else."""
    if process.popen.poll() is not None:
        return
    try:
        os.killpg(process.popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.popen.wait()
    process.ended = time.monotonic()
    process.killed_because = reason


def _reported_step(path: pathlib.Path, process_id: int, step: int) -> bool:
    """Whether the process has written that it is loading the rows of step `step + 1`, which it
    does only after step `step`'s loss has come back."""
    marker = f"process {process_id}: step {step + 1}:"
    try:
        return marker in path.read_text(errors="replace")
    except FileNotFoundError:
        return False


def launch(
    multihost_args: Sequence[str] = (),
    *,
    num_processes: int = 2,
    timeout: float = 240.0,
    grace: float = 60.0,
    out: pathlib.Path = pathlib.Path("outputs/multihost"),
    kill_process: int | None = None,
    kill_after_step: int = 1,
    poll: float = 0.05,
    script: pathlib.Path = MULTIHOST,
) -> list[Process]:
    """Run `num_processes` copies of `script` (`multihost.py`) and wait for all of them (see
    the module docstring for the rules); returns them in process-id order."""
    out.mkdir(parents=True, exist_ok=True)
    coordinator = f"{LOOPBACK}:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes: list[Process] = []
    files: list[IO[bytes]] = []
    try:
        for process_id in range(num_processes):
            stdout = out / f"process{process_id}.out"
            stderr = out / f"process{process_id}.err"
            result = out / f"process{process_id}.json"
            result.unlink(missing_ok=True)  # a stale result must not pass for this run's
            files += [stdout.open("wb"), stderr.open("wb")]
            command = [
                sys.executable,
                str(script),
                "--process-id",
                str(process_id),
                "--num-processes",
                str(num_processes),
                "--coordinator",
                coordinator,
                "--bind-address",
                coordinator,
                "--json",
                str(result),
                *multihost_args,
            ]
            popen = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=files[-2],
                stderr=files[-1],
                start_new_session=True,  # a process group of its own, for `_kill_group`
            )
            processes.append(Process(process_id, popen, stdout, stderr, time.monotonic()))

        stop_at = {p.process_id: p.started + timeout for p in processes}
        while any(p.ended is None for p in processes):
            now = time.monotonic()
            for process in processes:
                if process.ended is not None:
                    continue
                if process.popen.poll() is not None:
                    process.ended = now
                elif process.process_id == kill_process and _reported_step(
                    process.stdout, process.process_id, kill_after_step
                ):
                    _kill_group(process, "injected")
                elif now >= stop_at[process.process_id]:
                    failed_peer = stop_at[process.process_id] < process.started + timeout
                    _kill_group(process, "peer failure" if failed_peer else "timeout")
                if process.ended is not None and not process.ok:
                    for other in processes:
                        stop_at[other.process_id] = min(stop_at[other.process_id], now + grace)
            time.sleep(poll)
    finally:
        for process in processes:
            _kill_group(process, "launcher stopped")
        for file in files:
            file.close()
    return processes


def _tail(path: pathlib.Path, lines: int) -> str:
    text = path.read_text(errors="replace").rstrip().splitlines()
    return "\n".join([line for line in text if not line.startswith("[Gloo]")][-lines:])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passed = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    parser.add_argument(
        "--grace", type=float, default=60.0, help="seconds the others get after a failure"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("outputs/multihost"))
    parser.add_argument("--kill-process", type=int, default=None, help="process to SIGKILL")
    parser.add_argument("--kill-after-step", type=int, default=1)
    parser.add_argument("--tail", type=int, default=3, help="output lines shown per process")
    args = parser.parse_args(argv)
    # SIGTERM (e.g. from a test's own timeout) unwinds `launch`, which kills what it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.num_processes < 1:
        parser.error(f"--num-processes must be at least 1; got {args.num_processes}")
    if args.kill_process is not None and not 0 <= args.kill_process < args.num_processes:
        parser.error(
            f"--kill-process must be a process id in [0, {args.num_processes}); "
            f"got {args.kill_process}"
        )

    processes = launch(
        passed,
        num_processes=args.num_processes,
        timeout=args.timeout,
        grace=args.grace,
        out=args.out,
        kill_process=args.kill_process,
        kill_after_step=args.kill_after_step,
    )
    ok = all(process.ok for process in processes)
    for process in processes:
        print(f"----- {process.describe()} -----")
        print(_tail(process.stdout, args.tail) or "(no output)")
        if not process.ok:
            print("--- stderr ---")
            print(_tail(process.stderr, args.tail) or "(no output)")
    failed = [p.process_id for p in processes if not p.ok]
    summary = {"ok": ok, "failed": failed, "processes": [p.summary() for p in processes]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if ok:
        print(f"all {len(processes)} processes succeeded; outputs in {args.out}")
        return 0
    print(f"FAILED: processes {failed} did not succeed; outputs in {args.out}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
