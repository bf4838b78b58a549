"""What is true while a function is traced, for layers that must know it.

- `under_vmap`: whether a `jax.vmap` batches a value. The layers that take a whole batch
  themselves (pipelined blocks, mixtures of experts) refuse a per-example vmap with the fix,
  where JAX would otherwise fail deep inside with a message about its internals.
- `pipeline_axes`: the mesh axes of the pipelines whose stages are being traced. A stage's
  activations differ over such an axis (each device holds other microbatches), but they are
  not a batch split over it: a layer that sums statistics over the axes that split its batch
  (a mixture of experts' router losses) leaves them out, and must not wait on a collective
  over them, which other devices reach at other steps or not at all.
"""

import contextlib
import threading
from collections.abc import Hashable, Iterator

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


_pipelines = threading.local()


@contextlib.contextmanager
def pipeline_stage(axis_name: Hashable) -> Iterator[None]:
    """Inside the block, stages of a pipeline over `axis_name` are being traced."""
    stack = _pipelines.__dict__.setdefault("axes", [])
    stack.append(axis_name)
    try:
        yield
    finally:
        stack.pop()


def pipeline_axes() -> frozenset:
    """The axes of the pipelines whose stages are being traced (empty outside them)."""
    names: set = set()
    for axis in _pipelines.__dict__.get("axes", []):
        names.update(axis if isinstance(axis, tuple) else (axis,))
    return frozenset(names)
