"""A tour of eqpar's primitives on a 2x4 mesh of simulated CPU devices.

Run with `python examples/primitives_tour.py` inside the venv (`.venv/bin/python`).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if jax.config.jax_platforms == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqpar import collectives, placement, ragged


def ring_collectives(mesh: Mesh) -> None:
    print("== ring collectives over the 'model' axis (4 devices) ==")

    def gather_sources(x: jax.Array) -> jax.Array:
        items = collectives.async_gather(x[0, 0], "model")  # 4 blocks of shape [1]
        return jnp.stack(items)[None, None]  # [1, 1, 4, 1]

    ids = jnp.arange(8.0).reshape(2, 4, 1)  # device (data=i, model=j) holds 4 * i + j
    out = jax.shard_map(
        gather_sources, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model")
    )(ids)
    for j in range(4):
        got = out[0, j, :, 0].astype(int).tolist()
        print(f"  async_gather on model index {j}: items came from devices {got}")

    def ring_vs_psum_scatter(x: jax.Array) -> jax.Array:
        d = lax.axis_index("model")
        chunks = x[0, 0]  # [4, 3]: chunk c is meant for model index c
        ordered = [jnp.take(chunks, (d - 1 - k) % 4, axis=0) for k in range(4)]
        ring = collectives.async_scatter_split(ordered, "model")
        reference = lax.psum_scatter(chunks, "model", tiled=False)
        return jnp.abs(ring - reference).max()[None, None]

    x = jax.random.normal(jax.random.key(0), (2, 4, 4, 3))
    err = jax.shard_map(
        ring_vs_psum_scatter,
        mesh=mesh,
        in_specs=P("data", "model"),
        out_specs=P("data", "model"),
    )(x)
    print(f"  async_scatter_split vs lax.psum_scatter: largest difference {float(err.max()):.2e}")


def ragged_split() -> None:
    print("== ragged batch split over 4 devices ==")
    lengths = [5, 1, 2, 7, 3, 3]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = np.arange(offsets[-1], dtype=np.int32)
    splits = ragged.balanced_splits(offsets, 4)
    print(f"  sequence lengths {lengths} -> balanced splits {np.asarray(splits).tolist()}")
    pieces, piece_offsets = ragged.split_batch(jax.devices()[:4], tokens, offsets, splits)
    for piece, rows in zip(pieces, piece_offsets, strict=True):
        device = next(iter(piece.devices()))
        print(f"  {device}: {piece.shape[0]:2d} tokens, offsets {np.asarray(rows).tolist()}")


def host_placement(mesh: Mesh) -> None:
    print("== host batch -> global array -> host (placement) ==")
    local_batch = {"x": np.arange(16.0).reshape(8, 2)}
    global_batch = placement.host_to_global_device_array(local_batch, mesh=mesh)
    print(
        f"  global x: shape {global_batch['x'].shape}, sharding {global_batch['x'].sharding.spec}"
    )
    total = jax.jit(lambda b: b["x"].sum())(global_batch)
    back = placement.global_to_host_array(global_batch, mesh=mesh)
    same = np.array_equal(back["x"], local_batch["x"])
    print(
        f"  jitted sum {float(total)} (numpy: {local_batch['x'].sum()}), round trip exact: {same}"
    )


def main() -> None:
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("data", "model"))
    print(f"mesh: {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices")
    ring_collectives(mesh)
    ragged_split()
    host_placement(mesh)


if __name__ == "__main__":
    main()
