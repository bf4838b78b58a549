"""`ModelParallelismWrapper`: independent copies of any module, one per device of a mesh axis."""

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray, PyTree

from .._axes import axis_size as _bound_axis_size
from .._checks import check_int
from .._declare import prefixed, stacked_partition_specs

__all__ = [
    "ModelParallelismWrapper",
]


class ModelParallelismWrapper(eqx.Module):
    """`axis_size` independent copies of any module, one per device of a mesh axis.

    The copies are stacked on a leading axis (with `eqx.filter_vmap`) that is sharded over
    `model_axis_name`; inside `shard_map` every device calls its own copy. Use it for parts of
    a model that are cheaper to run redundantly or independently per device than to split.

    **Arguments:**

    - `module_fn`: `key -> eqx.Module`, builds one copy.
    - `model_axis_name`: the mesh axis the copies are spread over.
    - `axis_size`: the size of that axis (the number of copies).
    - `key`: a `jax.random` key.
    - `split_keys`: give each copy its own key (`True`) or the same key (identical copies).
    - `mask_except_model_idx`: if an index `i`, the output is zeroed on every device of the
      axis but `i` (so a later `psum` counts it once).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqpar
    from eqpar.nn import ModelParallelismWrapper

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    wrapper = ModelParallelismWrapper(
        lambda k: eqx.nn.Linear(3, 3, key=k), model_axis_name="model", axis_size=2,
        key=jax.random.key(0),
    )
    specs = eqpar.partition_specs(wrapper)
    out = eqpar.shard_map(
        lambda m, x: m(x)[None], mesh=mesh, in_specs=(specs, P()), out_specs=P("model")
    )(wrapper, jnp.ones(3))
    assert out.shape == (2, 3)  # one row per device's own copy
    ```
    """

    module: eqx.Module
    model_axis_name: Hashable = eqx.field(static=True)
    axis_size: int = eqx.field(static=True)
    mask_except_model_idx: int | None = eqx.field(static=True)

    def __init__(
        self,
        module_fn: Callable[[PRNGKeyArray], eqx.Module],
        *,
        model_axis_name: Hashable,
        axis_size: int,
        key: PRNGKeyArray,
        split_keys: bool = True,
        mask_except_model_idx: int | None = None,
    ):
        check_int(axis_size, name="axis_size", owner="ModelParallelismWrapper")
        if mask_except_model_idx is not None and not 0 <= mask_except_model_idx < axis_size:
            raise ValueError(
                "ModelParallelismWrapper: mask_except_model_idx must be in [0, axis_size) = "
                f"[0, {axis_size}); got {mask_except_model_idx}."
            )
        keys = (
            jax.random.split(key, axis_size)
            if split_keys
            else jnp.broadcast_to(key, (axis_size, *key.shape))
        )
        self.module = eqx.filter_vmap(module_fn)(keys)
        self.model_axis_name = model_axis_name
        self.axis_size = axis_size
        self.mask_except_model_idx = mask_except_model_idx

    def __partition_specs__(self) -> Mapping[str, P]:
        return prefixed("module", stacked_partition_specs(self.module, self.model_axis_name))

    def __call__(self, *args: PyTree, **kwargs: Any) -> PyTree:
        """Call this device's copy (inside `shard_map`) with `*args, **kwargs`.

        **Returns:** the copy's output, zeroed on all devices but `mask_except_model_idx` if
        that is set.
        """
        n = _bound_axis_size(
            self.model_axis_name, "ModelParallelismWrapper", argument="model_axis_name"
        )
        if n != self.axis_size:
            raise ValueError(
                f"ModelParallelismWrapper: built with axis_size={self.axis_size} but axis "
                f"{self.model_axis_name!r} has size {n}. Rebuild it with axis_size={n}."
            )
        arrays, static = eqx.partition(self.module, eqx.is_array)
        leading = {leaf.shape[0] for leaf in jax.tree.leaves(arrays)}
        if leading - {1}:
            raise ValueError(
                "ModelParallelismWrapper: each device must see one copy (leading dimension 1); "
                f"got leading dimensions {sorted(leading)}. Pass the wrapper into shard_map "
                "with the specs of `eqpar.partition_specs(model)`."
            )
        own = eqx.combine(jax.tree.map(lambda leaf: leaf[0], arrays), static)
        out = own(*args, **kwargs)  # type: ignore[operator]
        if self.mask_except_model_idx is None:
            return out
        keep = lax.axis_index(self.model_axis_name) == self.mask_except_model_idx
        return jax.tree.map(lambda y: jnp.where(keep, y, jnp.zeros_like(y)), out)
