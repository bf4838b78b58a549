"""The multi-controller runtime: `initialize` starts JAX's distributed runtime on every process.

Kept apart from meshes (`eqpar.mesh`): this is process start-up (arguments resolved from
environment variables, a TCP rendezvous that tells every process whether its peers arrived,
then `jax.distributed.initialize`); a mesh only arranges devices once they exist. The names
stay importable from `eqpar.mesh` and `eqpar` as before.
"""

__all__ = [
    "COORDINATOR_ADDRESS_ENV",
    "COORDINATOR_BIND_ADDRESS_ENV",
    "LOCAL_DEVICE_IDS_ENV",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "DistributedConfig",
    "initialize",
    "resolve_distributed_config",
]

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

COORDINATOR_ADDRESS_ENV = "EQPAR_COORDINATOR_ADDRESS"
"""Environment variable read by `initialize` for `coordinator_address` (process 0's `host:port`)."""

NUM_PROCESSES_ENV = "EQPAR_NUM_PROCESSES"
"""Environment variable read by `initialize` for `num_processes`."""

PROCESS_ID_ENV = "EQPAR_PROCESS_ID"
"""Environment variable read by `initialize` for `process_id`."""

COORDINATOR_BIND_ADDRESS_ENV = "EQPAR_COORDINATOR_BIND_ADDRESS"
"""Environment variable read by `initialize` for `coordinator_bind_address`."""

LOCAL_DEVICE_IDS_ENV = "EQPAR_LOCAL_DEVICE_IDS"
"""Environment variable read by `initialize` for `local_device_ids` (comma-separated ints)."""


class DistributedConfig(NamedTuple):
    """The arguments `initialize` passes to `jax.distributed.initialize`, after resolution.

    Fields still `None` are left to JAX's cluster detection.

    ```python
    from eqpar.runtime import DistributedConfig, resolve_distributed_config
    config = resolve_distributed_config("10.0.0.1:1234", 2, 0, environ={})
    assert config == DistributedConfig("10.0.0.1:1234", 2, 0, "10.0.0.1:1234", None)
    ```
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    coordinator_bind_address: str | None
    local_device_ids: tuple[int, ...] | None


def _parse_int(value: str, *, name: str, source: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(
            f"initialize: {name} must be an integer; {source} holds {value!r}."
        ) from None


def _split_host_port(address: str, *, name: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"initialize: {name} must look like 'host:port' (e.g. '10.0.0.1:1234' or "
            f"'[::1]:1234'); got {address!r}."
        )
    return host, int(port)


def resolve_distributed_config(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    coordinator_bind_address: str | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DistributedConfig:
    """Fill the arguments of `initialize` from the environment and check them; starts nothing.

    Each argument left as `None` is read from its environment variable:
    `EQPAR_COORDINATOR_ADDRESS`, `EQPAR_NUM_PROCESSES`, `EQPAR_PROCESS_ID`,
    `EQPAR_COORDINATOR_BIND_ADDRESS` and `EQPAR_LOCAL_DEVICE_IDS` (comma-separated).
    A comma-separated list of addresses (as Keras' `job_addresses`, one per process) means its
    first entry, process 0, is the coordinator; its length is the number of processes, so a
    `num_processes` that says otherwise is a `ValueError` (and a missing one is taken from it).
    Without an explicit bind address, the coordinator binds to the coordinator address itself,
    never to every network interface.

    **Arguments:**

    - `coordinator_address`: `host:port` of process 0.
    - `num_processes`: number of processes of the job.
    - `process_id`: this process's index in `[0, num_processes)`.
    - `coordinator_bind_address`: `host:port` the coordinator service listens on.
    - `local_device_ids`: restrict this process to these local devices.
    - `environ`: where to read the variables from (default: `os.environ`).

    **Returns:** a `DistributedConfig`; fields still `None` are left to JAX's cluster detection.

    ```python
    from eqpar.runtime import resolve_distributed_config
    env = {"EQPAR_COORDINATOR_ADDRESS": "10.0.0.1:1234", "EQPAR_NUM_PROCESSES": "2"}
    config = resolve_distributed_config(process_id=1, environ=env)
    assert config.num_processes == 2 and config.process_id == 1
    assert config.coordinator_bind_address == "10.0.0.1:1234"
    ```
    """
    env = os.environ if environ is None else environ

    def from_env(value, var):
        if value is not None:
            return value, "argument"
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            return None, None
        return raw, f"${var}"

    address, address_source = from_env(coordinator_address, COORDINATOR_ADDRESS_ENV)
    job_addresses = [] if address is None else [a.strip() for a in address.split(",") if a.strip()]
    if address is not None:
        address = job_addresses[0] if job_addresses else address
        _split_host_port(address, name=f"coordinator_address (from {address_source})")

    count, count_source = from_env(num_processes, NUM_PROCESSES_ENV)
    if isinstance(count, str):
        count = _parse_int(count, name="num_processes", source=str(count_source))
    if len(job_addresses) > 1 and count is None:
        count, count_source = len(job_addresses), "the address list"
    elif len(job_addresses) > 1 and count != len(job_addresses):
        raise ValueError(
            f"initialize: coordinator_address (from {address_source}) lists "
            f"{len(job_addresses)} addresses, one per process as Keras' job_addresses, but "
            f"num_processes={count} (from {count_source}); list one address per process (the "
            f"first is the coordinator) or pass only the coordinator's address."
        )
    if count is not None and count < 1:
        raise ValueError(
            f"initialize: num_processes (from {count_source}) must be >= 1; got {count}."
        )

    index, index_source = from_env(process_id, PROCESS_ID_ENV)
    if isinstance(index, str):
        index = _parse_int(index, name="process_id", source=str(index_source))
    if index is not None and index < 0:
        raise ValueError(f"initialize: process_id (from {index_source}) must be >= 0; got {index}.")
    if index is not None and count is not None and index >= count:
        raise ValueError(
            f"initialize: process_id={index} (from {index_source}) must be smaller than "
            f"num_processes={count} (from {count_source})."
        )

    bind, bind_source = from_env(coordinator_bind_address, COORDINATOR_BIND_ADDRESS_ENV)
    if bind is not None:
        _split_host_port(bind, name=f"coordinator_bind_address (from {bind_source})")
    elif address is not None:
        bind = address

    ids, ids_source = from_env(local_device_ids, LOCAL_DEVICE_IDS_ENV)
    if isinstance(ids, str):
        ids = tuple(
            _parse_int(part, name="local_device_ids", source=str(ids_source))
            for part in ids.split(",")
            if part.strip()
        )
    elif isinstance(ids, int):
        ids = (ids,)
    elif ids is not None:
        ids = tuple(int(i) for i in ids)

    return DistributedConfig(address, count, index, bind, ids)


_initialize_lock = threading.Lock()
_initialized_by_eqpar: DistributedConfig | None = None


_HELLO = "eqpar-initialize/1"
"""First word of the messages of `_rendezvous` (a peer that says anything else is ignored)."""


def _endpoint(address: str, name: str) -> tuple[str, int]:
    host, port = _split_host_port(address, name=name)
    return host.strip("[]"), port


def _listen(address: str, port: int | None = None) -> socket.socket:
    """A listening socket on the coordinator's bind address `address` (on `port` instead of
    the address's own port when given: 0 checks only that the host is this machine's), or an
    `OSError` that says why it cannot be and names the fix, instead of the bare one from
    `bind`. Raised at once: binding does not wait on the network."""
    host, own_port = _endpoint(address, "coordinator_bind_address")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, own_port if port is None else port), family=family)
    except OSError as error:
        reason = (error.strerror or str(error)).split(" (while attempting")[0]
        where = f"initialize: process 0 (the coordinator) cannot listen on {address}"
        if error.errno == errno.EADDRINUSE:
            message = (
                f"{where}: port {own_port} is in use ({reason}). Choose another port (in "
                "`coordinator_address`, the same on every process) or end what holds it."
            )
        else:  # EADDRNOTAVAIL: another machine's address, a NAT'd or public IP; or no host
            what = {
                errno.EADDRNOTAVAIL: "is not an address of this machine",
                socket.EAI_NONAME: "does not resolve on this machine",
            }.get(error.errno or 0, "cannot be listened on here")
            message = (
                f"{where}: {host!r} {what} ({reason}). The coordinator listens on "
                "`coordinator_address` unless `coordinator_bind_address` (or "
                f"${COORDINATOR_BIND_ADDRESS_ENV}) says where: pass process 0's own address "
                f"with the same port there, or '0.0.0.0:{own_port}' to listen on every "
                "interface, and keep `coordinator_address` as the address the others reach."
            )
        raise OSError(message) from None


def _rendezvous(config: DistributedConfig, timeout: float) -> None:
    """Meet every process on the coordinator's port before JAX's runtime starts.

    JAX's `jax.distributed.initialize` ends a process whose peers do not all arrive within
    `initialization_timeout` with a fatal C++ error (SIGABRT, blaming "another task" that
    died), which no Python code can catch, a few seconds after the timeout. This check runs
    first, in plain Python: process 0 listens on its bind address and waits for a line from
    every other process; the others connect to the coordinator address, send their id and
    wait for process 0's answer. A process that never comes is then a `TimeoutError` on every
    process that did, naming it, within `timeout` seconds. Process 0 closes the port before
    JAX's coordination service binds it; the other processes close their side first, so no
    socket of process 0 lingers on that port.
    """
    deadline = time.monotonic() + timeout
    count, me = config.num_processes, config.process_id
    assert count is not None and me is not None and config.coordinator_address is not None
    if me == 0:
        bind = config.coordinator_bind_address or config.coordinator_address
        peers: dict[int, socket.socket] = {}
        server = _listen(bind)
        try:
            while len(peers) < count - 1:
                server.settimeout(max(deadline - time.monotonic(), 0.001))
                connection, _ = server.accept()  # TimeoutError once the time is up
                connection.settimeout(max(deadline - time.monotonic(), 0.001))
                words = connection.recv(256).decode(errors="replace").split()
                ours = len(words) == 3 and words[0] == _HELLO and words[1].isdigit()
                if not ours or not 0 < int(words[1]) < count or words[2] != str(count):
                    connection.close()  # not one of this job's processes
                    continue
                peers.setdefault(int(words[1]), connection)
            for connection in peers.values():
                connection.sendall(f"{_HELLO} go\n".encode())
            for connection in peers.values():
                connection.settimeout(max(deadline - time.monotonic(), 1.0))
                with contextlib.suppress(OSError):
                    connection.recv(16)  # the peer closes first
        except TimeoutError:
            missing = sorted(set(range(1, count)) - set(peers))
            message = (
                f"initialize: process 0 (the coordinator, listening on {bind}) waited "
                f"{timeout:g} s (initialization_timeout) for the {count} processes of the job, "
                f"but process(es) {missing} never connected. Start every process with the same "
                "coordinator address and num_processes, or allow more time."
            )
            for connection in peers.values():
                with contextlib.suppress(OSError):
                    connection.sendall(f"{_HELLO} fail {message}\n".encode())
            raise TimeoutError(message) from None
        finally:
            for connection in peers.values():
                connection.close()
            server.close()
        return
    address = config.coordinator_address
    while True:
        try:
            connection = socket.create_connection(
                _endpoint(address, "coordinator_address"),
                timeout=max(min(1.0, deadline - time.monotonic()), 0.001),
            )
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"initialize: process {me} could not reach the coordinator (process 0) at "
                    f"{address} within {timeout:g} s (initialization_timeout). Start process 0, "
                    "check the address, or allow more time."
                ) from None
            time.sleep(0.05)
    with connection:  # a little longer than process 0 waits, to hear its verdict
        connection.settimeout(max(deadline - time.monotonic(), 0.0) + 5.0)
        connection.sendall(f"{_HELLO} {me} {count}\n".encode())
        try:
            reply = connection.recv(4096).decode(errors="replace")
        except TimeoutError:
            reply = ""
    if not reply.startswith(f"{_HELLO} go"):
        failed = reply.startswith(f"{_HELLO} fail ")
        raise TimeoutError(
            reply[len(f"{_HELLO} fail ") :].strip()
            if failed
            else f"initialize: process {me} reached the coordinator at {address}, but the job "
            f"was not complete within {timeout:g} s (initialization_timeout)."
        )


def _runtime_is_initialized() -> bool:
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None:
        return bool(is_initialized())
    return _initialized_by_eqpar is not None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    coordinator_bind_address: str | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    initialization_timeout: int = 300,
    cluster_detection_method: str | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int | None = None,
) -> DistributedConfig:
    """Start JAX's multi-controller runtime (`jax.distributed.initialize`) once per process.

    Call it first thing in every process of a multi-host job, before any other JAX call.
    Missing arguments come from the environment variables `EQPAR_COORDINATOR_ADDRESS`,
    `EQPAR_NUM_PROCESSES`, `EQPAR_PROCESS_ID`, `EQPAR_COORDINATOR_BIND_ADDRESS` and
    `EQPAR_LOCAL_DEVICE_IDS`; what is still missing is left to JAX's cluster detection
    (SLURM, Open MPI, TPU pods). The coordinator binds to the host of
    `coordinator_address` unless `coordinator_bind_address` says otherwise.

    A second call, once the runtime runs, does nothing and returns the configuration in
    use; it raises if it asks for a different process count or id.

    **A process that never comes.** JAX itself ends every waiting process with a fatal C++
    error (SIGABRT, with a misleading "another task died") a few seconds after
    `initialization_timeout`, which Python cannot catch. So, when the address, count and id
    are known and there are several processes, `initialize` first meets the other processes
    on the coordinator's port in plain Python (process 0 listens, the others connect and say
    who they are): a process that is missing, or a coordinator that cannot be reached, is a
    `TimeoutError` naming it within `initialization_timeout` seconds, and only then does
    `jax.distributed.initialize` start (with the same timeout), so a start-up can take up to
    twice `initialization_timeout`. Every process of the job must therefore call
    `initialize` (not `jax.distributed.initialize` directly).

    **Timeouts and their defaults.** `initialization_timeout=300` s (JAX's default too): how
    long processes wait for each other at start-up, in the check above and again in JAX.
    `heartbeat_timeout_seconds`: JAX's default is 100 s, after which the coordination service
    declares a silent process dead and ends the job. `shutdown_timeout_seconds`: JAX's default
    is 300 s, how long a process waits for the others at the shutdown barrier at exit. A
    collective whose peer process died usually fails at once (the connection is reset);
    these timeouts bound the waits that do not.

    **Arguments:**

    - `coordinator_address`: `host:port` of process 0.
    - `num_processes`: number of processes.
    - `process_id`: this process's index.
    - `coordinator_bind_address`: `host:port` the coordinator (process 0) listens on. By
      default the coordinator listens only on `coordinator_address` itself, never on every
      interface. When that address is not one of process 0's own interfaces (a NAT'd public
      IP, a Kubernetes service name, a hostname that resolves to 127.0.1.1), pass the local
      address to listen on here, e.g. `"10.0.0.1:1234"`, or `"0.0.0.0:1234"` to listen on all.
    - `local_device_ids`: the local devices this process uses.
    - `initialization_timeout`: seconds to wait for every process to connect (default 300).
    - `cluster_detection_method`: passed to `jax.distributed.initialize`.
    - `heartbeat_timeout_seconds`, `shutdown_timeout_seconds`: how long a process waits for
      a silent peer, and at the shutdown barrier, before giving up (JAX's defaults, 100 s and
      300 s, when `None`); smaller values make a job whose peer died fail sooner.

    **Raises:** `ValueError` for arguments that contradict each other (see
    `resolve_distributed_config`); `OSError` at once, on process 0, when it cannot listen on
    its bind address (not an address of this machine: pass `coordinator_bind_address`; or a
    port in use), rather than JAX's crash; `TimeoutError` when a process does not join in
    time.

    **Returns:** the `DistributedConfig` that was used.

    ```python
    import eqpar
    # In each of two processes (process_id 0 and 1), before any other JAX call:
    # eqpar.initialize("10.0.0.1:1234", num_processes=2, process_id=0)
    # or, with EQPAR_COORDINATOR_ADDRESS / EQPAR_NUM_PROCESSES / EQPAR_PROCESS_ID exported:
    # eqpar.initialize()
    assert callable(eqpar.initialize)
    ```
    """
    global _initialized_by_eqpar
    config = resolve_distributed_config(
        coordinator_address,
        num_processes,
        process_id,
        coordinator_bind_address=coordinator_bind_address,
        local_device_ids=local_device_ids,
    )
    with _initialize_lock:
        if _runtime_is_initialized():
            _check_matches_running(config)
            return _initialized_by_eqpar or config
        if config.process_id == 0 and config.coordinator_bind_address is not None:
            _listen(config.coordinator_bind_address, port=0).close()  # before JAX would crash
        if None not in config[:3] and (config.num_processes or 1) > 1:
            _rendezvous(config, float(initialization_timeout))
        # Only the timeouts given: older JAX releases lack some of these parameters.
        timeouts: dict[str, Any] = {
            name: value
            for name, value in (
                ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
                ("shutdown_timeout_seconds", shutdown_timeout_seconds),
            )
            if value is not None
        }
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            local_device_ids=list(config.local_device_ids)
            if config.local_device_ids is not None
            else None,
            cluster_detection_method=cluster_detection_method,
            initialization_timeout=initialization_timeout,
            coordinator_bind_address=config.coordinator_bind_address,
            **timeouts,
        )
        _initialized_by_eqpar = config
        return config


def _check_matches_running(config: DistributedConfig) -> None:
    running = (jax.process_count(), jax.process_index())
    if config.num_processes is not None and config.num_processes != running[0]:
        raise ValueError(
            f"initialize: the runtime already runs with num_processes={running[0]}; "
            f"this call asks for num_processes={config.num_processes}. Restart the process "
            f"to change it."
        )
    if config.process_id is not None and config.process_id != running[1]:
        raise ValueError(
            f"initialize: the runtime already runs as process_id={running[1]}; this call "
            f"asks for process_id={config.process_id}. Restart the process to change it."
        )
