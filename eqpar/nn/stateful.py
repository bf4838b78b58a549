"""Stateful layers (`eqx.nn.State`) inside `shard_map`: `eqx.nn.BatchNorm` with the serial
program's batch statistics, and `eqx.nn.SpectralNorm` whose power iteration stays the same
on every device.

On one device a `BatchNorm` under the author's `jax.vmap(..., axis_name="batch")` averages
over the whole batch (`lax.pmean` over the vmap axis). Inside `shard_map` three things stand
in the way of running it unchanged, and the twins here remove them:

- **The batch is split.** Each device holds `batch / n` examples of a batch split over a
  mesh axis (`data`), so a mean over the vmap axis alone is the shard's. `ParallelBatchNorm`
  averages over the vmap axis *and* over every mesh axis its input is split over (read off
  JAX's replication types: the data axes, and a sequence split over a model or context axis;
  never a pipeline's axis), which is the serial whole-batch statistic; per-shard statistics
  are an option.
- **JAX cannot reduce over a vmap axis there.** With `check_vma=True` (the default), a
  `lax.psum` over a `jax.vmap` axis inside `shard_map` fails in JAX's replication typing
  (JAX 0.10). The twin reduces over the vmap axis through a `custom_vmap` rule, which
  receives the whole batch, instead.
- **The state enters replicated.** `eqx.nn.State.set` refuses a new value whose replication
  type differs from the old one's, so a statistic that differs between devices cannot be
  stored. The twins store values that are the same on every device: the whole-batch
  statistics, or with per-shard statistics their mean over the devices; a power iteration
  on a weight all-gathered by FSDP (the same values everywhere, typed as varying) is typed
  back as the same everywhere.

`eqpar.shard_map` puts these twins in place of every `eqx.nn.BatchNorm` and
`eqx.nn.SpectralNorm` in its arguments while the mapped function runs, and the original
classes back in its results, so the author's model needs no change.
"""

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._axes import axis_names
from .._tracing import pipeline_axes
from .._vma import varying_axes
from ._twins import copy_fields, rebuilt

__all__ = ["ParallelBatchNorm", "ParallelSpectralNorm"]

BATCH_STATS_CHOICES = ("global", "per_shard")


def check_batch_stats(batch_stats: object, owner: str) -> str | tuple:
    """`batch_stats` as `"global"`, `"per_shard"` or a tuple of mesh axis names."""
    if isinstance(batch_stats, str):
        if batch_stats in BATCH_STATS_CHOICES:
            return batch_stats
    elif isinstance(batch_stats, tuple | list) and all(
        isinstance(name, Hashable) and not isinstance(name, tuple | list) for name in batch_stats
    ):
        return tuple(batch_stats)
    raise ValueError(
        f"{owner}: `batch_stats` must be 'global' (statistics over the whole batch, as on one "
        f"device), 'per_shard' (over each device's examples) or a tuple of mesh axis names to "
        f"average over, e.g. ('data',); got {batch_stats!r}."
    )


def _vmap_mean(value: Array, names: tuple) -> Array:
    """The mean of `value` over the `jax.vmap` axes named `names` (as `lax.pmean` over them
    gives), computed by batching rules that see the whole batch rather than by a collective.
    An unbound name raises JAX's `NameError`, as `lax.pmean` would."""
    return _mean_over(value, names, tuple(lax.axis_index(name) for name in names))


def _mean_over(value: Array, names: tuple, indices: tuple) -> Array:
    # `indices[i]` is `lax.axis_index(names[i])`: batched exactly by the vmap of that name,
    # which is how the rule tells the vmaps to average over from others around the call.
    if not names:
        return value

    @custom_vmap
    def mean(value: Array, indices: tuple) -> Array:
        return value  # traced for the output's type only; every call is batched

    @mean.def_vmap
    def rule(size: int, in_batched: list, value: Array, indices: tuple) -> tuple[Array, bool]:
        value_batched, indices_batched = in_batched
        hit = [bool(b) for b in indices_batched]
        if any(hit):  # this vmap is one of `names`: average over it, then over the others
            if value_batched:
                value = jnp.mean(value, axis=0)
            rest = tuple(n for n, h in zip(names, hit) if not h)
            rest_indices = tuple(i for i, h in zip(indices, hit) if not h)
            return _mean_over(value, rest, rest_indices), False
        # Another vmap (an inner one of the author's): its axis stays part of the value.
        if not value_batched:
            value = jnp.broadcast_to(value, (size, *value.shape))
        return _mean_over(value, names, indices), True

    return mean(value, indices)


def _sorted(axes: set | frozenset) -> tuple:
    return tuple(sorted(axes, key=str))


def _split_axes(x: Array) -> frozenset:
    """The mesh axes `x` is split over (differs between devices), a pipeline's excepted (its
    stages hold other microbatches: not a split of this batch)."""
    return frozenset(varying_axes(x)) - pipeline_axes()


def _same_everywhere(values: PyTree, axes: tuple) -> PyTree:
    """`values`, averaged over `axes`: what every device stores."""
    return jax.tree.map(lambda v: lax.pmean(v, axes), values) if axes else values


class ParallelBatchNorm(eqx.nn.BatchNorm):
    """`eqx.nn.BatchNorm` inside `shard_map`: the statistics of the whole batch, as on one
    device, when the batch (or the sequence) is split over mesh axes.

    `eqpar.shard_map` puts one in place of every `eqx.nn.BatchNorm` of its arguments (and the
    original back in its results), so a model written for one device, its loss threading an
    `eqx.nn.State` through `jax.vmap(model, axis_name=...)`, runs unchanged. Its fields are
    the original's plus `batch_stats`:

    - `"global"` (the default): the mean and variance over the vmap axis `axis_name` and over
      every mesh axis the input is split over, which JAX's replication types say (with
      `check_vma=True`): the data axes, and a sequence split over a model or context axis.
      A pipeline's axis is never one (its stages hold other microbatches). These are the
      serial program's statistics: the batch's, not the device's share of it.
    - `"per_shard"`: over each device's own examples only (what a plain per-device program
      computes; cheaper, not the serial numbers). The running statistics in the state are
      then the mean over the devices of each device's, so the state stays the same on every
      device.
    - a tuple of mesh axes, e.g. `("data",)`: over exactly those (needed where JAX does not
      track replication, `check_vma=False`); the running statistics are averaged over any
      other axis the input is split over.

    The variance is computed around the whole-batch mean (two passes, as Equinox does). In
    inference mode it is the original layer (the running statistics, no reduction).

    **Arguments:**

    - `layer`: the `eqx.nn.BatchNorm` (its fields are taken as they are).
    - `batch_stats`: `"global"`, `"per_shard"` or a tuple of mesh axis names.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P

    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    mesh = eqpar.DeviceMesh((2,), ("data",), devices=jax.devices()[:2])
    x = jnp.arange(24.0).reshape(8, 3) ** 2

    def normalize(norm, state, x):
        return jax.vmap(norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)

    whole = eqpar.shard_map(  # converts the BatchNorm itself: whole-batch statistics
        normalize, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P("data"), P())
    )
    out, new_state = whole(norm, state, x)
    serial_out, serial_state = normalize(norm, state, x)
    assert jnp.allclose(out, serial_out, rtol=1e-5, atol=1e-6)
    assert eqpar.nn.ParallelBatchNorm(norm, batch_stats="per_shard").to_serial() == norm
    ```
    """

    batch_stats: Any = eqx.field(static=True)

    def __init__(self, layer: eqx.nn.BatchNorm, *, batch_stats: str | tuple = "global"):
        if not isinstance(layer, eqx.nn.BatchNorm):
            raise TypeError(
                f"ParallelBatchNorm: expected an eqx.nn.BatchNorm; got {type(layer).__name__}."
            )
        copy_fields(layer, self, eqx.nn.BatchNorm)
        self.batch_stats = check_batch_stats(batch_stats, "ParallelBatchNorm")

    def to_serial(self) -> eqx.nn.BatchNorm:
        """The original `eqx.nn.BatchNorm` (the same arrays and state indices)."""
        return rebuilt(self, eqx.nn.BatchNorm)

    def __call__(
        self,
        x: Array,
        state: eqx.nn.State,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> tuple[Array, eqx.nn.State]:
        """As `eqx.nn.BatchNorm.__call__`: `x` is one example, `[input_size, ...]`, under a
        `jax.vmap` named `axis_name`; returns the normalised `x` and the updated state."""
        if inference is None:
            inference = self.inference
        if inference:  # the running statistics: nothing is reduced
            return super().__call__(x, state, inference=True)
        reduce_axes, store_axes = self._axes(x)
        mean, var = self._statistics(x, reduce_axes)
        momentum = self.momentum
        if self.mode == "ema":
            assert self.ema_first_time_index is not None and self.ema_state_index is not None
            first_time = state.get(self.ema_first_time_index)
            # False typed as the old value (a constant is not typed with the manual mesh as
            # shard_map's arguments are, and `State.set` compares the types).
            state = state.set(self.ema_first_time_index, jnp.zeros_like(first_time))
            running_mean, running_var = state.get(self.ema_state_index)
            blend_mean = (1 - momentum) * mean + momentum * running_mean
            blend_var = (1 - momentum) * var + momentum * running_var
            mean = lax.select(first_time, mean, blend_mean)
            var = lax.select(first_time, var, blend_var)
            state = state.set(self.ema_state_index, _same_everywhere((mean, var), store_axes))
        else:
            assert self.batch_counter is not None and self.batch_state_index is not None
            counter = state.get(self.batch_counter)
            hidden_mean, hidden_var = state.get(self.batch_state_index)
            hidden = (
                hidden_mean * momentum + mean * (1 - momentum),
                hidden_var * momentum + var * (1 - momentum),
            )
            state = state.set(self.batch_counter, counter + 1)
            state = state.set(self.batch_state_index, _same_everywhere(hidden, store_axes))
        shape = (-1,) + (1,) * (jnp.ndim(x) - 1)
        out = (x - mean.reshape(shape)) / jnp.sqrt(var.reshape(shape) + self.eps)
        if self.channelwise_affine:
            assert self.weight is not None and self.bias is not None
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out, state

    def _axes(self, x: Array) -> tuple[tuple, tuple]:
        """The mesh axes the statistics are averaged over, and those the stored running
        statistics are averaged over afterwards (where the input is split but the statistics
        are not: per shard)."""
        split = _split_axes(x)
        if self.batch_stats == "global":
            reduce = split
        elif self.batch_stats == "per_shard":
            reduce = frozenset()
        else:
            reduce = frozenset(self.batch_stats)
        return _sorted(reduce), _sorted(split - reduce)

    def _statistics(self, x: Array, mesh_axes: tuple) -> tuple[Array, Array]:
        """Per channel: the mean over the batch (vmap axes, `mesh_axes`) of each example's
        mean over its other dimensions, and the variance around it."""
        mesh = set(jax.sharding.get_abstract_mesh().axis_names)
        names = axis_names(self.axis_name)
        # An `axis_name` may name mesh axes itself (a model written for `shard_map`).
        vmap_names = tuple(n for n in names if n not in mesh)
        mesh_axes = (*mesh_axes, *(n for n in names if n in mesh and n not in mesh_axes))

        def whole(value: Array) -> Array:
            value = _vmap_mean(value, vmap_names)
            return lax.pmean(value, mesh_axes) if mesh_axes else value

        flat = jnp.reshape(x, (jnp.shape(x)[0], -1))
        mean = whole(jnp.mean(flat, axis=1))
        centred = flat - mean[:, None]
        var = whole(jnp.mean(centred * jnp.conj(centred), axis=1))
        return mean, jnp.maximum(0.0, var)


def _power_iteration(matrix: Array, u: Array, v: Array, eps: float) -> tuple[Array, Array]:
    """One step of the power iteration for the top singular vectors (Equinox's order)."""
    u = matrix @ v
    u = u / jnp.maximum(eps, jnp.sqrt(jnp.sum(u**2)))
    v = matrix.T @ u
    v = v / jnp.maximum(eps, jnp.sqrt(jnp.sum(v**2)))
    return u, v


class ParallelSpectralNorm(eqx.nn.SpectralNorm):
    """`eqx.nn.SpectralNorm` inside `shard_map`, with its power iteration the same on every
    device.

    `eqpar.shard_map` puts one in place of every `eqx.nn.SpectralNorm` of its arguments (and
    the original back in its results). It computes what the original computes; the
    difference is the type of the stored vectors: where the weight arrives all-gathered
    (FSDP's `stored_specs`), JAX types it as differing between devices although its values
    are the same everywhere, and so would be the power iteration's vectors, which the
    replicated state cannot take (`eqx.nn.State.set` refuses them). The twin types them as
    the same everywhere (an exact `lax.pmax` of equal values).

    The weight must be whole on every device: a layer split by tensor parallelism inside a
    spectral norm is refused with the fix (leave it out of the plan).

    **Arguments:**

    - `layer`: the `eqx.nn.SpectralNorm` (its fields are taken as they are).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar

    linear = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    make = lambda: eqx.nn.SpectralNorm(linear, "weight", key=jax.random.key(1))
    norm, state = eqx.nn.make_with_state(make)()
    twin = eqpar.nn.ParallelSpectralNorm(norm)
    out, _ = twin(jnp.ones(4), state)
    serial_out, _ = norm(jnp.ones(4), eqx.nn.make_with_state(make)()[1])
    assert jnp.allclose(out, serial_out) and twin.to_serial() == norm
    ```
    """

    def __init__(self, layer: eqx.nn.SpectralNorm):
        if not isinstance(layer, eqx.nn.SpectralNorm):
            raise TypeError(
                f"ParallelSpectralNorm: expected an eqx.nn.SpectralNorm; got "
                f"{type(layer).__name__}."
            )
        copy_fields(layer, self, eqx.nn.SpectralNorm)

    def to_serial(self) -> eqx.nn.SpectralNorm:
        """The original `eqx.nn.SpectralNorm` (the same layer and state index)."""
        return rebuilt(self, eqx.nn.SpectralNorm)

    def __call__(
        self,
        x: Array,
        state: eqx.nn.State,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> tuple[Array, eqx.nn.State]:
        """As `eqx.nn.SpectralNorm.__call__`: the wrapped layer's output with its weight
        divided by its largest singular value, and the updated state."""
        u, v = state.get(self.uv_index)
        weight = getattr(self.layer, self.weight_name)
        matrix = jnp.reshape(weight, (weight.shape[0], -1))
        if matrix.shape != (u.shape[0], v.shape[0]):
            raise ValueError(
                f"ParallelSpectralNorm: the wrapped {type(self.layer).__name__}'s "
                f"`{self.weight_name}` is {tuple(weight.shape)} on this device, but its power "
                f"iteration holds vectors for a [{u.shape[0]}, {v.shape[0]}] matrix: the layer "
                f"is split over a mesh axis (a tensor-parallel style on the layer inside the "
                f"spectral norm). The singular value needs the whole weight: leave that layer "
                f"out of the plan (it stays whole on every device), or name it Replicated()."
            )
        if inference is None:
            inference = self.inference
        if not inference:
            stored = varying_axes(u) | varying_axes(v)
            stopped = lax.stop_gradient(matrix)
            for _ in range(self.num_power_iterations):
                u, v = _power_iteration(stopped, u, v, self.eps)
            # Computed from a weight typed as differing between devices (gathered): the values
            # are the same everywhere, so the max over the devices is each of them, exactly.
            extra = _sorted((varying_axes(u) | varying_axes(v)) - stored)
            if extra:
                u, v = lax.pmax(u, extra), lax.pmax(v, extra)
            state = state.set(self.uv_index, (u, v))
        sigma = jnp.einsum("i,ij,j->", u, matrix, v)
        normalised = jnp.reshape(matrix / sigma, weight.shape)
        layer = eqx.tree_at(lambda layer: getattr(layer, self.weight_name), self.layer, normalised)
        return layer(x), state


_SERIAL = (eqx.nn.BatchNorm, eqx.nn.SpectralNorm)


def stateful_layer_kinds(tree: PyTree) -> frozenset[type]:
    """Which of `eqx.nn.BatchNorm` and `eqx.nn.SpectralNorm` `tree` holds (of exactly those
    classes: the author's own subclasses are left alone)."""
    is_layer = lambda node: type(node) in _SERIAL
    leaves = jax.tree.leaves(tree, is_leaf=is_layer)
    return frozenset(type(leaf) for leaf in leaves if is_layer(leaf))


def manual_stateful_layers(tree: PyTree, *, batch_stats: str | tuple) -> PyTree:
    """`tree` with every `eqx.nn.BatchNorm` and `eqx.nn.SpectralNorm` (of exactly those
    classes) as its twin for a manual region (`eqpar.shard_map` calls this as its function
    runs)."""

    def convert(node: PyTree) -> PyTree:
        if type(node) is eqx.nn.BatchNorm:
            return ParallelBatchNorm(node, batch_stats=batch_stats)
        if type(node) is eqx.nn.SpectralNorm:
            return ParallelSpectralNorm(node)
        return node

    return jax.tree.map(convert, tree, is_leaf=lambda node: type(node) in _SERIAL)


def serial_stateful_layers(tree: PyTree) -> PyTree:
    """The inverse of `manual_stateful_layers`: the twins back in their original classes."""
    is_twin = lambda node: isinstance(node, ParallelBatchNorm | ParallelSpectralNorm)
    return jax.tree.map(
        lambda node: node.to_serial() if is_twin(node) else node, tree, is_leaf=is_twin
    )
