"""Microbatches: splitting a batch, and `Microbatched` per-example stage arguments."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._axes import axis_size
from .._typing import AxisName
from .._vma import varies_over as _varies_over
from .._vma import varying_axes as _varying_axes
from ._tools import cast_tree, describe_tree, index_tree

# --------------------------------------------------------------------------------------
# Per-example extra arguments.


class Microbatched(eqx.Module):
    """An extra stage argument whose rows go with the rows of the batch.

    The executors pass extra positional and keyword arguments to every stage call unchanged,
    which suits parameters and constants. Wrap a per-example argument (an attention padding
    mask `[batch, seq]`, token positions, ...) in `Microbatched` instead: it is cut into
    microbatches exactly like the batch `x`, and the stage working on microbatch `m` receives
    the plain value holding row block `m` (not the wrapper). Like `x`, it must be the same on
    every device of the pipeline axis; each device then picks the rows it needs locally, so
    nothing extra travels the ring. Integer and boolean leaves are fine: they get no
    cotangents. Outside the pipeline (`PipelineModule.apply_serially`) the whole value is
    passed.

    **Arguments:**

    - `value`: a pytree of arrays whose leading axis is the batch axis of `x` (same size).

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import Microbatched, execute_pipeline

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))

    def run(x, mask):
        stage = lambda h, m: jnp.where(m[:, None], h + 1.0, h)  # m: this microbatch's rows
        return execute_pipeline(
            stage, x, Microbatched(mask), num_microbatches=2, model_axis_name="pipe",
            broadcast_output=True,
        )

    f = jax.shard_map(run, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    mask = jnp.array([True, False, True, True])
    out = f(jnp.zeros((4, 3)), mask)
    assert jnp.array_equal(out[:, 0], jnp.array([2.0, 0.0, 2.0, 2.0]))
    ```
    """

    value: PyTree


def _is_microbatched(node: PyTree) -> bool:
    return isinstance(node, Microbatched)


def _argument_name(path: tuple) -> str:
    """`args[1]...` or `kwargs['mask']...` for a path into the `(args, kwargs)` pair."""
    head, rest = path[0], path[1:]
    if getattr(head, "idx", None) == 0:
        return f"args{jax.tree_util.keystr(rest)}"
    return f"kwargs{jax.tree_util.keystr(rest)}"


def _has_microbatched(args: PyTree, kwargs: PyTree) -> bool:
    leaves = jax.tree.leaves((args, kwargs), is_leaf=_is_microbatched)
    return any(_is_microbatched(leaf) for leaf in leaves)


def reject_microbatched(args: PyTree, kwargs: PyTree, caller: str) -> None:
    if _has_microbatched(args, kwargs):
        raise TypeError(
            f"{caller}: a `Microbatched` argument needs the index of the microbatch being "
            f"processed, which a single step does not know. Pass this step's rows of the value "
            f"directly, or call `execute_pipeline`, which splits `Microbatched` arguments."
        )


def _check_microbatched_rows(value: PyTree, name: str, batch: int, caller: str) -> None:
    rows = batch_size(value, name, caller)
    if rows is None:
        raise ValueError(
            f"{caller}: `{name}` is a `Microbatched` argument without array leaves; wrap a "
            f"per-example array (leading batch axis) or pass the value unwrapped."
        )
    if rows != batch:
        raise ValueError(
            f"{caller}: `{name}` (a `Microbatched` argument) has {rows} rows but the batch `x` "
            f"has {batch}; a per-example argument needs one row per example of `x` (after any "
            f"data sharding). Pass the matching rows, or pass it unwrapped if every example "
            f"shares it."
        )


def unwrap_microbatched(
    args: PyTree, kwargs: PyTree, batch: int | None, caller: str, axis_name: AxisName | None = None
) -> tuple:
    """`(args, kwargs)` with every `Microbatched` replaced by its whole value (rows checked
    against `batch` when it is known; with `axis_name`, checked to be the same on every
    device of that pipeline axis, as `microbatch_arguments` checks them)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_microbatched)
    leaves = []
    for path, leaf in flat:
        if _is_microbatched(leaf):
            if batch is not None:
                _check_microbatched_rows(leaf.value, _argument_name(path), batch, caller)
            if axis_name is not None:
                check_replicated(leaf.value, _argument_name(path), axis_name, caller)
            leaf = leaf.value
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def microbatch_arguments(
    args: PyTree,
    kwargs: PyTree,
    *,
    num_microbatches: int,
    batch: int,
    axis_name: AxisName,
    caller: str,
    cast: frozenset = frozenset(),
) -> Callable[[Any], tuple[tuple, dict]]:
    """A function `at(m) -> (args, kwargs)` giving the stage arguments for microbatch `m`
    (traced): every `Microbatched` replaced by its row block `m`, everything else unchanged."""
    flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_microbatched)
    splits: list[Any] = []
    for path, leaf in flat:
        if not _is_microbatched(leaf):
            splits.append(None)
            continue
        name = _argument_name(path)
        _check_microbatched_rows(leaf.value, name, batch, caller)
        check_replicated(leaf.value, name, axis_name, caller)
        split = split_microbatches(leaf.value, num_microbatches, batch, name, caller)
        splits.append(cast_tree(split, cast) if cast else split)
    if all(split is None for split in splits):
        return lambda index: (tuple(args), dict(kwargs))

    def at(index: PyTree) -> tuple[tuple, dict]:
        leaves = [
            leaf if split is None else index_tree(split, index)
            for (_, leaf), split in zip(flat, splits)
        ]
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        return tuple(call_args), dict(call_kwargs)

    return at


# --------------------------------------------------------------------------------------
# Splitting a batch into microbatches.


def batch_size(tree: PyTree, name: str, caller: str) -> int | None:
    """The common leading size of the array leaves of `tree` (None when it has none)."""
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = jnp.shape(leaf)
        if not shape:
            raise ValueError(
                f"{caller}: every leaf of `{name}` needs a leading batch axis; the leaf at "
                f"{name}{jax.tree_util.keystr(path)} is a scalar."
            )
        sizes[jax.tree_util.keystr(path)] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{caller}: the leaves of `{name}` disagree on the batch size (leading axis): "
            f"{sizes}. Give every leaf the same number of rows."
        )
    return next(iter(sizes.values()), None)


def check_replicated(tree: PyTree, name: str, axis_name: AxisName, caller: str) -> None:
    """The batch must be the same on every device of the pipeline axis (check_vma types).

    Under `shard_map(..., check_vma=False)` JAX does not say what differs between devices, so
    a batch split over the pipeline axis cannot be told from a replicated one: refused, unless
    the axis has one device (nothing to lose)."""
    if _varies_over(jnp.zeros(()), axis_name) is None and axis_size(axis_name, caller) > 1:
        raise ValueError(
            f"{caller}: the pipeline needs `shard_map`'s replication types (its default "
            f"check_vma=True) to check that `{name}` is the same on every device of the pipeline "
            f"axis {axis_name!r}; under check_vma=False a batch split over {axis_name!r} would "
            f"silently lose the rows of all but one device. Call it inside `eqpar.shard_map` or "
            f"`jax.shard_map` with check_vma=True (the default)."
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if axis_name in _varying_axes(leaf):
            raise ValueError(
                f"{caller}: `{name}{jax.tree_util.keystr(path)}` varies over the pipeline axis "
                f"{axis_name!r}, but the pipeline reads the batch on one device of that axis "
                f"only, so the rows of the others would be lost. Pass the batch replicated over "
                f"{axis_name!r} (no {axis_name!r} in its shard_map in_specs), or gather it "
                f"first with `lax.all_gather(..., {axis_name!r}, tiled=True)`."
            )


def split_microbatches(tree: PyTree, num_microbatches: int, batch: int, name: str, caller: str):
    if batch % num_microbatches:
        raise ValueError(
            f"{caller}: the batch of {batch} rows in `{name}` does not divide into "
            f"num_microbatches={num_microbatches}. Choose a batch size that is a multiple of "
            f"num_microbatches (or a num_microbatches that divides {batch})."
        )
    size = batch // num_microbatches
    return jax.tree.map(lambda a: jnp.reshape(a, (num_microbatches, size, *a.shape[1:])), tree)


def merge_microbatches(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.reshape(a, (a.shape[0] * a.shape[1], *a.shape[2:])), tree)


def check_stage_keeps_shape(stage: Callable, microbatch: PyTree, args, kwargs, caller: str) -> None:
    out = jax.eval_shape(lambda h: stage(h, *args, **kwargs), microbatch)
    ins = jax.eval_shape(lambda h: h, microbatch)
    same_structure = jax.tree.structure(out) == jax.tree.structure(ins)
    if same_structure and all(
        o.shape == i.shape and o.dtype == i.dtype
        for o, i in zip(jax.tree.leaves(out), jax.tree.leaves(ins))
    ):
        return
    raise ValueError(
        f"{caller}: a pipeline stage must return exactly the shape and dtype it takes, because "
        f"its output travels the ring as the next stage's input; the stage maps a microbatch "
        f"{describe_tree(ins)} to {describe_tree(out)}. Keep layers that change the shape or dtype "
        f"(embeddings, output heads, casts) outside the pipeline: apply them before and after "
        f"it, or pad the stage output back to the input shape."
    )
