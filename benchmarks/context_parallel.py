"""Context parallelism: per-device memory and collective bytes of attention against sequence
length, ring attention and all-gather attention against one device.

One training step of one attention call (forward and gradients with respect to query, key
and value) for one sequence of `S` tokens with `H = 4` heads of size `D = 32` (a small
width), causal, compiled ahead of time from `jax.ShapeDtypeStruct`s (nothing runs):

- `serial`: `jax.nn.dot_product_attention` on one device (the whole `[S, S]` scores);
- `all-gather n=8`: `eqpar.context.all_gather_attention` over a context axis of 8 devices;
- `ring n=2/4/8`: `eqpar.context.ring_attention` (balanced layout);
- `ulysses n=2/4`: `eqpar.context.ulysses_attention` (balanced layout; the 4 heads divide
  2 and 4 devices, not 8);
- `ulysses 4 x ring 2`: the hybrid on 8 devices, the all-to-all over 4 of them and the ring
  over 2 (contiguous layout).

Reported per device, from the compiled program (exact figures, not timings): temp memory
(`memory_analysis`) and bytes received by collectives, with the ring's theoretical volume
`(n - 1) 2 blk` forward + `(n - 1) 2 blk + n 2 blk` backward, `blk = S / n * H * D * 4` bytes
(the key and value blocks travel the ring forward and again backward; their float32
gradients go one full turn; at n = 2 XLA reuses the forward's received block in the
backward, so 3/4 of it), and Ulysses's `7 (n - 1) / n blk`: the query, key and value blocks
cross forward and their gradients and the output's backward (the forward output's
all-to-all is dead code in this gradient-only program; a step that also returns the loss
moves an eighth `(n - 1) / n blk`). Run: `python benchmarks/context_parallel.py` (`--quick`: 4k and
16k tokens only).
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

if os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
from _hlo import collective_bytes, format_bytes, memory_figures
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqpar.context import all_gather_attention, ring_attention, ulysses_attention

HEADS, HEAD_SIZE = 4, 32


def _hybrid(q, k, v, *, axis_name, causal, layout):
    del axis_name, layout  # the hybrid's two axes, contiguous
    return ulysses_attention(q, k, v, axis_name="heads", ring_axis_name="ring", causal=causal)


def training_step(attend, n):
    """`grad` of `sum(attention * cotangent)` w.r.t. q, k, v, over a context axis of n."""
    if attend is _hybrid:
        sequence = P(("ring", "heads"))
        sharded = jax.shard_map(
            lambda q, k, v, c: jnp.sum(
                attend(q, k, v, axis_name=None, causal=True, layout=None) * c
            )[None],
            mesh=Mesh(np.array(jax.devices()[:n]).reshape(2, n // 2), ("ring", "heads")),
            in_specs=sequence,
            out_specs=sequence,
        )

        def loss(q, k, v, c):
            return sharded(q, k, v, c).sum()

    elif attend is None:

        def loss(q, k, v, c):
            return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) * c)

    else:
        sharded = jax.shard_map(
            lambda q, k, v, c: jnp.sum(
                attend(q, k, v, axis_name="context", causal=True, layout="balanced") * c
            )[None],
            mesh=Mesh(np.array(jax.devices()[:n]), ("context",)),
            in_specs=P("context"),
            out_specs=P("context"),
        )

        def loss(q, k, v, c):
            return sharded(q, k, v, c).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(seq: int) -> list[dict]:
    shape = jax.ShapeDtypeStruct((seq, HEADS, HEAD_SIZE), jnp.float32)
    rows = []
    for name, attend, n in (
        ("serial", None, 1),
        ("all-gather n=8", all_gather_attention, 8),
        ("ring n=2", ring_attention, 2),
        ("ring n=4", ring_attention, 4),
        ("ring n=8", ring_attention, 8),
        ("ulysses n=2", ulysses_attention, 2),
        ("ulysses n=4", ulysses_attention, 4),
        ("ulysses 4 x ring 2", _hybrid, 8),
    ):
        compiled = training_step(attend, n).lower(shape, shape, shape, shape).compile()
        block = seq // n * HEADS * HEAD_SIZE * 4
        theory = None
        if attend is ring_attention:
            theory = (n - 1) * 2 * block * 2 + n * 2 * block
        elif attend is ulysses_attention:
            theory = 7 * (n - 1) * block // n
        rows.append(
            {
                "name": name,
                "n": n,
                "temp": memory_figures(compiled)["temp"],
                "bytes": collective_bytes(compiled),
                "theory": theory,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4k and 16k tokens only")
    args = parser.parse_args(argv)
    lengths = [4096, 16384] if args.quick else [4096, 8192, 16384, 32768, 65536]
    print(f"attention, causal, heads={HEADS}, head size={HEAD_SIZE}, float32, fwd + bwd")
    header = (
        f"{'seq':>6}  {'program':<18} {'temp/device':>12} {'temp x n / ring2 x 2':>21} "
        f"{'bytes/device':>13} {'theory':>12}"
    )
    print(header)
    for seq in lengths:
        rows = measure(seq)
        ring2 = next(row for row in rows if row["name"] == "ring n=2")
        for row in rows:
            scaled = row["temp"] * row["n"] / (ring2["temp"] * 2)
            theory = "" if row["theory"] is None else format_bytes(row["theory"])
            print(
                f"{seq:>6}  {row['name']:<18} {format_bytes(row['temp']):>12} {scaled:>21.2f} "
                f"{format_bytes(row['bytes']):>13} {theory:>12}"
            )
            if row["theory"] is not None and row["bytes"] != row["theory"]:
                # At n = 2 the ring loops run once and are unrolled; XLA then reuses the block
                # the forward pass received for the backward pass instead of receiving it again.
                print(f"  {row['name']}: {row['bytes'] / row['theory']:.2f} x the theory")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
