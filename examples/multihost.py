"""The language-model training of `train_lm.py` as one process of a multi-host job.

Start it once per process (or let `launch_multihost.py` start them all):

    python examples/multihost.py --process-id 0 --num-processes 2 --coordinator 127.0.0.1:4321 &
    python examples/multihost.py --process-id 1 --num-processes 2 --coordinator 127.0.0.1:4321

Every process simulates `--cpu-devices` CPU devices (4 by default) and joins the others through
`eqpar.initialize` (JAX's multi-controller runtime, gloo collectives between processes). The
coordinator (process 0) listens only on `--bind-address`, which defaults to the host of
`--coordinator` (loopback above), never on every interface. Missing options fall back to the
variables `EQPAR_COORDINATOR_ADDRESS`, `EQPAR_NUM_PROCESSES`, `EQPAR_PROCESS_ID` and
`EQPAR_COORDINATOR_BIND_ADDRESS`.

**Device order.** `jax.devices()` lists process 0's devices first, then process 1's, and so on.
The mesh `data=2,pipe=2,model=2` reshapes that list to `[data, pipe, model]`, so data index `p`
is exactly process `p`'s 4 devices: the pipeline stages and tensor-parallel shards of one data
replica live in one process, and only the data-parallel gradient average (and the loss mean)
crosses processes.

**Data.** `lm.Batches` gives the same global batch of `B` rows at every position on every
process. Process `p` of `P` loads only rows `[p * B / P, (p + 1) * B / P)` and
`eqpar.placement.host_to_global_device_array` joins the processes' rows into one global array
of `B` rows, so the run sees exactly the batches of the single-process run.

Each process prints its losses and, with `--json`, writes them to a file. If a peer dies, the
survivors fail in the next collective and exit with status 1 (see `_exit_now`).
"""

import argparse
import json
import os
import pathlib
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import lm
import train_lm

import eqpar
from eqpar.placement import host_to_global_device_array

SMALLEST = lm.LMConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, d_hidden=32, num_layers=2)
"""The smallest model that still splits over every axis of `data=2,pipe=2,model=2` (tests)."""


def process_rows(batch_size: int, process_index: int, process_count: int) -> range:
    """The rows of each global batch that process `process_index` loads: an equal,
    contiguous share, in process order."""
    if batch_size % process_count:
        raise SystemExit(
            f"--batch-size {batch_size} must divide by the {process_count} processes (each "
            f"loads an equal share of the rows; none are dropped or padded)."
        )
    share = batch_size // process_count
    return range(process_index * share, (process_index + 1) * share)


def load_rows(batches: lm.Batches, position: int, rows: range) -> np.ndarray:
    """Rows `rows` of `batches.batch(position)`, without building the other rows."""
    # The same draw as `lm.Batches.batch`, so row `i` here is row `i` of the global batch.
    rng = np.random.default_rng([batches.seed, position])
    starts = rng.integers(0, len(batches.tokens) - batches.seq_len - 1, size=batches.batch_size)
    return np.stack([batches.tokens[s : s + batches.seq_len + 1] for s in starts[rows]])


def check_mesh_follows_processes(mesh: eqpar.DeviceMesh) -> None:
    """Each data index must live in one process, so that the data axis is the one that crosses
    processes and a process's rows are a contiguous block of the global batch."""
    devices = mesh.jax_mesh.devices
    owners = np.vectorize(lambda device: device.process_index)(devices)
    count = jax.process_count()
    data = devices.shape[0]
    per_process = data // count if data % count == 0 else 0
    expected = np.arange(data)[:, None, None] // max(per_process, 1)
    if per_process == 0 or not (owners == expected).all():
        raise SystemExit(
            f"--mesh: the data axis (size {data}) must be a multiple of the {count} processes "
            f"so that each data index lies within one process; process of each mesh device:\n"
            f"{owners}"
        )


def place_process_rows(batches: lm.Batches, position: int, mesh: eqpar.DeviceMesh) -> jax.Array:
    """The global token array of step `position`, fed by every process with its own rows."""
    rows = process_rows(batches.batch_size, jax.process_index(), jax.process_count())
    print(
        f"process {jax.process_index()}: step {position + 1}: rows "
        f"[{rows.start}, {rows.stop}) of the global batch",
        flush=True,
    )
    # FULL splits the rows over every mesh axis, a process's rows over its own devices; the
    # step's shard_map wants them split over `data` only, so the compiled step gathers each
    # data replica's rows across that replica's (pipe, model) devices, all in one process.
    return host_to_global_device_array(load_rows(batches, position, rows), mesh=mesh.jax_mesh)


def configure_cpu(num_devices: int) -> None:
    """Simulated CPU devices and gloo collectives between processes (before JAX starts)."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", num_devices)


def _exit_now(status: int) -> None:
    """Leave without JAX's exit-time shutdown: it waits at a barrier for every peer, so after a
    peer's death it would hang until the coordination service's own timeouts run out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument(
        "--coordinator", default=None, help="host:port of process 0, e.g. 127.0.0.1:4321"
    )
    parser.add_argument(
        "--bind-address",
        default=None,
        help="host:port the coordinator listens on (default: the --coordinator address)",
    )
    parser.add_argument("--cpu-devices", type=int, default=4, help="CPU devices per process")
    parser.add_argument("--connect-timeout", type=int, default=60, help="seconds to meet peers")
    parser.add_argument("--mesh", default="data=2,pipe=2,model=2")
    # The training options and their defaults are train_lm.py's (fewer steps).
    defaults = train_lm.RunConfig
    parser.add_argument("--schedule", choices=lm.SCHEDULES, default=defaults.schedule)
    positive = train_lm.positive_int
    parser.add_argument("--microbatches", type=positive, default=defaults.microbatches)
    parser.add_argument("--steps", type=positive, default=20)
    parser.add_argument("--batch-size", type=positive, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default=defaults.optimizer)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--precision", choices=lm.PRECISIONS, default=defaults.precision)
    parser.add_argument(
        "--remat", choices=("none", "full", "matmuls"), default=defaults.remat,
        help="what each layer keeps for the backward pass (as in train_lm.py)",
    )  # fmt: skip
    parser.add_argument("--smallest", action="store_true", help="the SMALLEST model (tests)")
    parser.add_argument("--json", type=pathlib.Path, help="write this process's losses here")
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace) -> train_lm.RunConfig:
    return train_lm.RunConfig(
        mesh=train_lm.parse_mesh(args.mesh, jax.device_count()),
        schedule=args.schedule,
        microbatches=args.microbatches,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        seed=args.seed,
        precision=args.precision,
        remat=args.remat,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    configure_cpu(args.cpu_devices)
    distributed = eqpar.initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        coordinator_bind_address=args.bind_address,
        initialization_timeout=args.connect_timeout,
    )
    process = jax.process_index()
    print(
        f"process {process} of {jax.process_count()}: {jax.local_device_count()} local, "
        f"{jax.device_count()} global devices; coordinator {distributed.coordinator_address} "
        f"(bound to {distributed.coordinator_bind_address})",
        flush=True,
    )
    run = run_config(args)
    mesh = train_lm.make_mesh(run.mesh)
    check_mesh_follows_processes(mesh)
    config = SMALLEST if args.smallest else lm.LMConfig()
    started = time.perf_counter()
    losses, _ = train_lm.train(
        run,
        config=config,
        progress=False,
        show_layout=process == 0,
        place_batch=place_process_rows,
    )
    seconds = time.perf_counter() - started
    print(
        f"process {process}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {run.steps} steps "
        f"({seconds:.1f} s)",
        flush=True,
    )
    summary = {
        "process_id": process,
        "num_processes": jax.process_count(),
        "mesh": run.mesh,
        "losses": losses,
        "seconds": seconds,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary))
    return summary


if __name__ == "__main__":
    try:
        main()
    except SystemExit as error:  # a usage error: say so and leave (see `_exit_now`)
        if error.code in (None, 0):
            raise
        if isinstance(error.code, str):
            print(error.code, file=sys.stderr)
        _exit_now(2)
    except BaseException:  # a lost peer surfaces here, as a JaxRuntimeError from the next step
        traceback.print_exc()
        _exit_now(1)
