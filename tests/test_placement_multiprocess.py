"""Placement across 2 real processes x 4 CPU devices on 127.0.0.1, and the harness that runs
them (`multiprocess_util.run_processes`).

The functions starting with `_child` run inside the started processes; they import JAX
configuration and eqpar in their bodies so that importing this module has no side effects.
"""

import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from multiprocess_util import (
    ENV_COORDINATOR,
    MultiprocessFailure,
    free_port,
    initialize_cpu_distributed,
    process_context,
    run_processes,
)

pytestmark = pytest.mark.multiprocess

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120.0


def _import_placement():
    """eqpar.placement under the same jaxtyping + beartype checking as the pytest suite."""
    import jaxtyping

    with jaxtyping.install_import_hook("eqpar", "beartype.beartype"):
        from eqpar import placement
    return placement


def _rows_of(process_id: int) -> dict:
    """The local batch process `process_id` feeds: 8 rows, distinct across processes."""
    return {
        "x": np.arange(24, dtype=np.float32).reshape(8, 3) + 1000 * process_id,
        "pair": (
            np.arange(8, dtype=np.int32) + 100 * process_id,
            np.full((8, 2, 2), process_id, np.float32),
        ),
    }


def _child_placement():
    process_id, num_processes = initialize_cpu_distributed(num_cpu_devices=4)
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    placement = _import_placement()
    full, replicated = placement.DataPartitionType.FULL, placement.DataPartitionType.REPLICATED
    tree_map = jax.tree_util.tree_map

    assert (num_processes, jax.process_count(), jax.process_index()) == (2, 2, process_id)
    assert (jax.local_device_count(), jax.device_count()) == (4, 8)
    devices = np.array(jax.devices())
    assert [d.process_index for d in devices] == [0] * 4 + [1] * 4
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))

    local = _rows_of(process_id)
    expected = tree_map(lambda a, b: np.concatenate([a, b]), _rows_of(0), _rows_of(1))

    # FULL: global batch = 2 x 8 rows, this process's rows on its own devices
    placed = placement.host_to_global_device_array(local, mesh=mesh)
    for array, host in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(local)):
        assert array.shape == (16, *host.shape[1:]) and array.dtype == host.dtype
        assert not array.is_fully_addressable
        for i, device in enumerate(mesh.devices[process_id]):  # row `p` of the mesh is process p
            (shard,) = [s for s in array.addressable_shards if s.device == device]
            np.testing.assert_array_equal(np.asarray(shard.data), host[2 * i : 2 * i + 2])
    gathered = multihost_utils.process_allgather(placed, tiled=True)
    tree_map(np.testing.assert_array_equal, gathered, expected)

    # a jitted reduction over the global batch equals numpy over the concatenated rows
    def reduce(tree):
        ids, block = tree["pair"]
        return {
            "column_sums": jnp.sum(tree["x"], axis=0),
            "total": jnp.sum(tree["x"] ** 2) + jnp.sum(ids) + jnp.sum(block),
        }

    reduced = jax.jit(reduce, out_shardings=NamedSharding(mesh, P()))(placed)
    serial = reduce(tree_map(jnp.asarray, expected))
    for name in ("column_sums", "total"):
        np.testing.assert_allclose(np.asarray(reduced[name]), np.asarray(serial[name]), rtol=1e-5)

    # the round trip gives this process its own rows back, exactly
    back = placement.global_to_host_array(placed, mesh=mesh)
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(local)):
        assert type(got) is np.ndarray and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)

    # a computed array in another layout comes back as this process's rows too
    doubled = jax.jit(lambda t: t["x"] * 2, out_shardings=NamedSharding(mesh, P("data")))(placed)
    np.testing.assert_array_equal(
        placement.global_to_host_array(doubled, mesh=mesh), local["x"] * 2
    )

    # REPLICATED: every device holds the whole table; each process gets it back once
    table = np.arange(6, dtype=np.float32).reshape(2, 3)
    shared = placement.host_to_global_device_array(table, replicated, mesh=mesh)
    assert shared.shape == (2, 3) and shared.sharding.is_fully_replicated
    assert float(jax.jit(jnp.sum)(shared)) == 15.0
    np.testing.assert_array_equal(
        placement.global_to_host_array(shared, replicated, mesh=mesh), table
    )

    # the mesh can come from jax.set_mesh
    with jax.set_mesh(mesh):
        ids = placement.host_to_global_device_array(local["pair"][0])
        np.testing.assert_array_equal(placement.global_to_host_array(ids, full), local["pair"][0])

    # processes interleaved in the mesh: global blocks alternate between the processes
    interleaved = Mesh(devices[[0, 4, 1, 5, 2, 6, 3, 7]].reshape(4, 2), ("data", "model"))
    mixed = placement.host_to_global_device_array(local["x"], mesh=interleaved)
    expected_mixed = np.concatenate(
        [_rows_of(k % 2)["x"][2 * (k // 2) : 2 * (k // 2) + 2] for k in range(8)]
    )
    np.testing.assert_array_equal(
        multihost_utils.process_allgather(mixed, tiled=True), expected_mixed
    )
    np.testing.assert_array_equal(
        placement.global_to_host_array(mixed, mesh=interleaved), local["x"]
    )

    # a local batch that does not divide over this process's 4 devices is refused
    _expect(
        ValueError,
        lambda: placement.host_to_global_device_array({"odd": np.zeros((6, 2))}, mesh=mesh),
        "leaf 'odd' has a local batch of 6 rows",
    )

    print(f"process {process_id}: placement checks passed")
    _check_processes_must_agree(placement, mesh, process_id)
    print(f"process {process_id}: agreement checks passed")


def _expect(error_type: type[Exception], call, *fragments: str) -> None:
    try:
        call()
    except error_type as error:
        assert all(fragment in str(error) for fragment in fragments), (fragments, error)
    else:
        raise AssertionError(f"no {error_type.__name__} with {fragments}")


def _check_processes_must_agree(placement, mesh, process_id: int) -> None:
    """Data that differs between processes is an error on every process, naming the leaf and
    what each process passed, never a global array that differs between processes."""
    import eqpar

    place = placement.host_to_global_device_array
    replicated = placement.DataPartitionType.REPLICATED
    rows = 8 if process_id == 0 else 4
    _expect(
        ValueError,
        lambda: place({"ok": np.zeros((8, 1)), "x": [np.zeros((rows, 3), np.float32)]}, mesh=mesh),
        "disagree on leaf 'x/0'",
        "process 0: shape (8, 3) float32",
        "process 1: shape (4, 3) float32",
    )
    dtype = np.float32 if process_id == 0 else np.int32
    _expect(
        ValueError,
        lambda: place({"x": np.zeros((8, 3), dtype)}, mesh=mesh),
        "disagree on leaf 'x'",
        "process 0: shape (8, 3) float32",
        "process 1: shape (8, 3) int32",
    )
    _expect(
        ValueError,
        lambda: place({"table": np.full(3, process_id, np.float32)}, replicated, mesh=mesh),
        "disagree on leaf 'table'",
        "CRC-32",
    )
    # int64 values beyond int32 (jax_enable_x64 is off): on one process only, or on both
    big = np.arange(8, dtype=np.int64) + (2**40 if process_id == 1 else 0)
    _expect(
        ValueError,
        lambda: place({"ids": big}, mesh=mesh),
        "disagree on leaf 'ids'",
        "values out of range",
    )
    _expect(
        ValueError,
        lambda: place({"ids": np.arange(8, dtype=np.int64) + 2**40}, mesh=mesh),
        "leaf 'ids' holds int64 values",
        "jax_enable_x64",
    )
    # Distribution input placement shares the implementation, checks included
    data_parallel = eqpar.DataParallel(devices=list(mesh.devices.flat))
    _expect(
        ValueError,
        lambda: data_parallel.distribute_input({"x": np.zeros((rows, 2), np.float32)}),
        "distribute_input",
        "disagree on leaf 'x'",
    )
    x = data_parallel.distribute_input({"x": np.full((4, 2), process_id, np.float32)})["x"]
    assert x.shape == (8, 2) and float(x.sum()) == 8.0


def test_two_processes_place_reduce_and_round_trip():
    results = run_processes(_child_placement, 2, timeout=TIMEOUT, cwd=REPO_ROOT)
    for result in results:
        assert f"process {result.process_id}: placement checks passed" in result.stdout
        assert f"process {result.process_id}: agreement checks passed" in result.stdout


def _child_failure_reaches_every_process():
    """Data that one process refuses by itself (before any exchange) fails the call on every
    process at once, the others naming that process; the next call then pairs up as usual."""
    process_id, _ = initialize_cpu_distributed(num_cpu_devices=2)
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    placement = _import_placement()
    place = placement.host_to_global_device_array
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))

    # process 1 passes a string leaf: its own TypeError names the leaf; process 0's names it
    tag = "a" if process_id == 1 else np.zeros(2, np.int32)
    ok = np.zeros((2, 3), np.float32)
    own = ("leaf 'pair/1' must be a NumPy array", "not str")
    peer = ("process 1 refused its own data", "[process 1] TypeError:", *own)
    _expect(
        TypeError, lambda: place({"pair": (ok, tag)}, mesh=mesh), *(own if process_id else peer)
    )
    # a mesh with 2 devices of process 0 and 1 of process 1: 3 local rows split on process 1 only
    uneven = Mesh(devices[[0, 1, 2]], ("data",))
    own = ("leaf 'x' has a local batch of 3 rows", "the 2 local devices")
    peer = ("process 0 refused its own data", "[process 0] ValueError:", *own)
    _expect(
        ValueError,
        lambda: place({"x": np.zeros((3, 1))}, mesh=uneven),
        *(peer if process_id else own),
    )
    # the next call on every process pairs up with the same call of the other
    local = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * process_id
    placed = place({"x": local}, mesh=mesh)["x"]
    together = np.concatenate(
        [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * p for p in (0, 1)]
    )
    np.testing.assert_array_equal(multihost_utils.process_allgather(placed, tiled=True), together)
    print(f"process {process_id}: failures reached every process")


def test_a_process_that_refuses_its_data_fails_the_call_everywhere_at_once():
    # Before, process 0 waited for process 1 in the exchange until gloo's 30 s deadline (or
    # paired with process 1's next call); the harness timeout turns a regression into a failure.
    results = run_processes(_child_failure_reaches_every_process, 2, timeout=60, cwd=REPO_ROOT)
    for result in results:
        assert f"process {result.process_id}: failures reached every process" in result.stdout


def _child_without_its_peer():
    initialize_cpu_distributed(num_cpu_devices=4, initialization_timeout=1)
    print("initialized without its peer")


def test_missing_peer_fails_instead_of_hanging():
    # Only process 0 of 2 starts: JAX's own initialization timeout must end it, well before the
    # harness timeout would.
    with pytest.raises(MultiprocessFailure) as info:
        run_processes(_child_without_its_peer, 2, start=[0], timeout=TIMEOUT, cwd=REPO_ROOT)
    (result,) = info.value.results
    assert result.process_id == 0
    assert result.killed_because is None and result.returncode != 0
    assert "initialized without its peer" not in result.stdout
    assert re.search(r"deadline|timed? ?out", result.stderr, re.IGNORECASE), result.stderr
    assert result.stderr.strip() in str(info.value)


# --------------------------------------------------------------------------------------------
# The harness itself


def _child_report():
    process_id, num_processes, coordinator = process_context()
    import os

    print(f"id={process_id} of={num_processes} at={coordinator} extra={os.environ['EXTRA']}")
    print(f"stderr of {process_id}", file=sys.stderr)


def test_harness_passes_ids_env_and_captures_output():
    results = run_processes(_child_report, 3, timeout=60, env={"EXTRA": "yes"})
    assert [result.process_id for result in results] == [0, 1, 2]
    coordinators = set()
    for result in results:
        assert result.ok and result.returncode == 0 and result.killed_because is None
        match = re.fullmatch(
            rf"id={result.process_id} of=3 at=(127\.0\.0\.1:\d+) extra=yes\n", result.stdout
        )
        assert match, result.stdout
        coordinators.add(match.group(1))
        assert result.stderr == f"stderr of {result.process_id}\n"
    assert len(coordinators) == 1


def test_harness_runs_a_script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(f"import os\nprint('script', os.environ[{ENV_COORDINATOR!r}])\n")
    (result,) = run_processes(script, 1, timeout=60)
    assert re.fullmatch(r"script 127\.0\.0\.1:\d+\n", result.stdout)


def _child_hang():
    print("about to hang", flush=True)
    threading.Event().wait()


def test_harness_kills_a_process_that_runs_past_its_timeout():
    results = run_processes(_child_hang, 1, timeout=2, check=False)
    (result,) = results
    assert result.killed_because == "timeout" and result.returncode < 0
    assert result.stdout == "about to hang\n"
    assert not result.ok
    message = str(MultiprocessFailure(results))  # what `check=True` raises
    assert "1 of 1 processes did not succeed: process 0: killed after the 2 s timeout" in message
    assert "about to hang" in message


def _child_fail_or_hang():
    process_id, _, _ = process_context()
    if process_id == 0:
        raise RuntimeError("process 0 gives up")
    _child_hang()


def test_harness_stops_the_peers_of_a_failed_process():
    with pytest.raises(MultiprocessFailure) as info:
        run_processes(_child_fail_or_hang, 2, timeout=TIMEOUT, grace=1)
    failed, peer = info.value.results
    assert failed.returncode == 1 and failed.killed_because is None
    assert "RuntimeError: process 0 gives up" in failed.stderr
    assert peer.killed_because == "peer failure" and peer.returncode < 0
    assert peer.stdout == "about to hang\n"
    message = str(info.value)
    assert "2 of 2 processes did not succeed" in message
    assert "process 1: killed" in message and "after another process failed" in message
    assert "RuntimeError: process 0 gives up" in message


def test_harness_argument_errors():
    def local_function():
        pass

    with pytest.raises(ValueError, match="module-level function"):
        run_processes(local_function, 1)
    with pytest.raises(ValueError, match="is not a file"):
        run_processes("no/such/script.py", 1)
    with pytest.raises(ValueError, match=r"process ids 0\.\.1"):
        run_processes(_child_report, 2, start=[2])
    assert 0 < free_port() < 65536
