"""Whether a `jax.vmap` batches a value at trace time: the layers that take a whole batch
themselves (pipelined blocks, mixtures of experts) use it to refuse a per-example vmap with
the fix, where JAX would otherwise fail deep inside with a message about its internals."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import PyTree


def under_vmap(tree: PyTree) -> bool:
    """Whether some array leaf of `tree` is batched by a `jax.vmap` around this call (read
    off a `custom_vmap` probe whose batching rule runs, at trace time, only under one)."""
    # Without gradients: the probe is only read for its batching, and a `custom_vmap`
    # function cannot be differentiated in reverse mode.
    leaves = [jax.lax.stop_gradient(leaf) for leaf in jax.tree.leaves(tree) if eqx.is_array(leaf)]
    if not leaves:
        return False
    seen: list[bool] = []

    @custom_vmap
    def probe(leaves: list) -> jax.Array:
        return jnp.zeros((), jnp.int32)

    @probe.def_vmap
    def rule(size: int, in_batched: list, leaves: list) -> tuple[jax.Array, bool]:
        seen.append(any(jax.tree.leaves(in_batched)))
        return jnp.zeros((), jnp.int32), False

    probe(leaves)
    return any(seen)
