"""Pipeline parallelism as pure functions called inside `shard_map`.

Every device of the pipeline axis holds one stage (or, for the circular schedule, several)
and passes activations to the next device over a ring with `lax.ppermute`. All loops are one
`lax.scan` over clock steps, so the compiled program does not grow with the number of
microbatches. The functions here know nothing of Equinox modules beyond "a callable pytree";
`eqpar.nn.PipelineModule` wraps them.

- `execute_pipeline_step`: one clock step of the ring.
- `execute_pipeline`: the GPipe forward pass (differentiate through it for training).
- `execute_circular_pipeline`: the circular (interleaved) forward pass, several stages per
  device.
- `execute_1f1b`: a whole training step (loss and gradients) in the one-forward-one-backward
  order, holding at most `S` microbatch inputs per device.
- `Microbatched`: marks an extra stage argument (an attention mask, positions) as per-example,
  so that every stage call gets the rows of the microbatch it is working on.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PyTree, Scalar

from ._typing import AxisName
from ._vma import cast_varying as _cast_varying
from ._vma import varying_axes as _varying_axes
from .schedule import _one_f_one_b_slot

# --------------------------------------------------------------------------------------
# Replication types (shard_map's `check_vma`) across JAX versions.


def _cast_tree(tree: Any, axes: Any) -> Any:
    """`_cast_varying` leaf by leaf; `axes` is a frozenset or a tree of them like `tree`."""
    if isinstance(axes, frozenset):
        return jax.tree.map(lambda x: _cast_varying(x, axes), tree)
    return jax.tree.map(_cast_varying, tree, axes)


def _vary_like_input(tree: Any, x: Any, axis_name: AxisName) -> Any:
    """`tree`'s inexact arrays marked varying over the mesh axes the batch `x` varies over.

    Parameters replicated over, say, a data axis would otherwise become varying only inside
    the pipeline's scan, and autodiff would then sum their gradients over that axis at every
    step of the scan; cast once here, the sum happens once, outside the loop.
    """
    axes = frozenset().union(*(_varying_axes(leaf) for leaf in jax.tree.leaves(x)))
    axes = axes - {axis_name}
    if not axes:
        return tree
    return jax.tree.map(
        lambda leaf: _cast_varying(leaf, axes) if eqx.is_inexact_array(leaf) else leaf, tree
    )


def _sum_over_cast_axes(grads: Any, original_axes: Any, x: Any, axis_name: AxisName) -> Any:
    """Undo `_vary_like_input` for gradients: `psum` each over the axes it was cast to."""
    axes = frozenset().union(*(_varying_axes(leaf) for leaf in jax.tree.leaves(x)))
    axes = axes - {axis_name}

    def total(g: Any, original: frozenset) -> Any:
        added = tuple(sorted(axes - original, key=str))
        return lax.psum(g, added) if added else g

    return jax.tree.map(total, grads, original_axes)


def _axes_tree(tree: Any) -> Any:
    return jax.tree.map(_varying_axes, tree)


def _union_axes(*trees: Any) -> Any:
    return jax.tree.map(lambda *sets: frozenset().union(*sets), *trees)


def _scan(body: Callable, init: Any, xs: Any) -> tuple[Any, Any]:
    """`lax.scan(body, init, xs)` with the carry's replication types widened until the body
    maps them to themselves (as `check_vma` requires of a scan carry)."""
    carry = init
    for _ in range(8):
        out_carry, _ = jax.eval_shape(body, carry, _take(xs, 0))
        wanted = _union_axes(_axes_tree(carry), _axes_tree(out_carry))
        if jax.tree.leaves(wanted) == jax.tree.leaves(_axes_tree(carry)):
            break
        carry = _cast_tree(carry, wanted)
    return lax.scan(body, carry, xs)


def _steps(length: int) -> Array:
    return jnp.arange(length, dtype=jnp.int32)


def _switch(index: Any, branches: list[Callable], *operands: Any) -> Any:
    """`lax.switch` whose branches may return values of different replication types."""
    results = [jax.eval_shape(branch, *operands) for branch in branches]
    wanted = _union_axes(*[_axes_tree(r) for r in results])

    def widen(branch: Callable) -> Callable:
        return lambda *ops: _cast_tree(branch(*ops), wanted)

    return lax.switch(index, [widen(b) for b in branches], *operands)


# --------------------------------------------------------------------------------------
# Small shared helpers.


def _axis_size(axis_name: AxisName, caller: str) -> int:
    try:
        size = lax.axis_size(axis_name) if hasattr(lax, "axis_size") else lax.psum(1, axis_name)
    except NameError as error:
        raise ValueError(
            f"{caller}: `model_axis_name={axis_name!r}` is not a mesh axis in scope. Call it "
            f"inside `jax.shard_map` (or `eqpar.shard_map`) over a mesh with an axis named "
            f"{axis_name!r}."
        ) from error
    return int(size)


def _check_microbatches(num_microbatches: object, caller: str) -> int:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise TypeError(
            f"{caller}: `num_microbatches` must be an int, got "
            f"{type(num_microbatches).__name__} {num_microbatches!r}."
        )
    if num_microbatches < 1:
        raise ValueError(
            f"{caller}: `num_microbatches` must be at least 1, got {num_microbatches}."
        )
    return num_microbatches


def _batch_size(tree: Any, name: str, caller: str) -> int | None:
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


def _check_replicated(tree: Any, name: str, axis_name: AxisName, caller: str) -> None:
    """The batch must be the same on every device of the pipeline axis (check_vma types)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if axis_name in _varying_axes(leaf):
            raise ValueError(
                f"{caller}: `{name}{jax.tree_util.keystr(path)}` varies over the pipeline axis "
                f"{axis_name!r}, but the pipeline reads the batch on one device of that axis "
                f"only, so the rows of the others would be lost. Pass the batch replicated over "
                f"{axis_name!r} (no {axis_name!r} in its shard_map in_specs), or gather it "
                f"first with `lax.all_gather(..., {axis_name!r}, tiled=True)`."
            )


def _split_microbatches(tree: Any, num_microbatches: int, batch: int, name: str, caller: str):
    if batch % num_microbatches:
        raise ValueError(
            f"{caller}: the batch of {batch} rows in `{name}` does not divide into "
            f"num_microbatches={num_microbatches}. Choose a batch size that is a multiple of "
            f"num_microbatches (or a num_microbatches that divides {batch})."
        )
    size = batch // num_microbatches
    return jax.tree.map(lambda a: jnp.reshape(a, (num_microbatches, size, *a.shape[1:])), tree)


def _merge_microbatches(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.reshape(a, (a.shape[0] * a.shape[1], *a.shape[2:])), tree)


def _take(tree: Any, index: Any) -> Any:
    """Row `index` (traced) of every array leaf of `tree`."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def _put(tree: Any, index: Any, value: Any, when: Any) -> Any:
    """`tree` with row `index` replaced by `value` where `when` holds (otherwise unchanged)."""

    def put(a: Array, v: Array) -> Array:
        old = lax.dynamic_index_in_dim(a, index, keepdims=False)
        return lax.dynamic_update_index_in_dim(a, jnp.where(when, v, old), index, 0)

    return jax.tree.map(put, tree, value)


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.result_type(a)), tree)


def _ring_shift(tree: Any, axis_name: AxisName, size: int, offset: int, wrap: bool = True) -> Any:
    """Send every leaf `offset` devices along the axis. Without `wrap` the pair that would go
    round the end of the ring (last -> first, or first -> last) is left out, and the device
    it would reach gets zeros: GPipe and 1F1B never use what crosses there."""
    perm = [(i, (i + offset) % size) for i in range(size) if wrap or 0 <= i + offset < size]
    return jax.tree.map(lambda a: lax.ppermute(a, axis_name, perm), tree)


def _describe(tree: Any) -> str:
    return str(jax.tree.map(lambda a: f"{jnp.result_type(a).name}{list(jnp.shape(a))}", tree))


def _check_stage_keeps_shape(stage: Callable, microbatch: Any, args, kwargs, caller: str) -> None:
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
        f"{_describe(ins)} to {_describe(out)}. Keep layers that change the shape or dtype "
        f"(embeddings, output heads, casts) outside the pipeline: apply them before and after "
        f"it, or pad the stage output back to the input shape."
    )


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


def _is_microbatched(node: Any) -> bool:
    return isinstance(node, Microbatched)


def _argument_name(path: tuple) -> str:
    """`args[1]...` or `kwargs['mask']...` for a path into the `(args, kwargs)` pair."""
    head, rest = path[0], path[1:]
    if getattr(head, "idx", None) == 0:
        return f"args{jax.tree_util.keystr(rest)}"
    return f"kwargs{jax.tree_util.keystr(rest)}"


def _has_microbatched(args: Any, kwargs: Any) -> bool:
    leaves = jax.tree.leaves((args, kwargs), is_leaf=_is_microbatched)
    return any(_is_microbatched(leaf) for leaf in leaves)


def _reject_microbatched(args: Any, kwargs: Any, caller: str) -> None:
    if _has_microbatched(args, kwargs):
        raise TypeError(
            f"{caller}: a `Microbatched` argument needs the index of the microbatch being "
            f"processed, which a single step does not know. Pass this step's rows of the value "
            f"directly, or call `execute_pipeline`, which splits `Microbatched` arguments."
        )


def _check_microbatched_rows(value: Any, name: str, batch: int, caller: str) -> None:
    rows = _batch_size(value, name, caller)
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


def _unwrap_microbatched(args: Any, kwargs: Any, batch: int | None, caller: str) -> tuple:
    """`(args, kwargs)` with every `Microbatched` replaced by its whole value (rows checked
    against `batch` when it is known)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_microbatched)
    leaves = []
    for path, leaf in flat:
        if _is_microbatched(leaf):
            if batch is not None:
                _check_microbatched_rows(leaf.value, _argument_name(path), batch, caller)
            leaf = leaf.value
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _microbatch_arguments(
    args: Any,
    kwargs: Any,
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
        _check_replicated(leaf.value, name, axis_name, caller)
        split = _split_microbatches(leaf.value, num_microbatches, batch, name, caller)
        splits.append(_cast_tree(split, cast) if cast else split)
    if all(split is None for split in splits):
        return lambda index: (tuple(args), dict(kwargs))

    def at(index: Any) -> tuple[tuple, dict]:
        leaves = [
            leaf if split is None else _take(split, index) for (_, leaf), split in zip(flat, splits)
        ]
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        return tuple(call_args), dict(call_kwargs)

    return at


# --------------------------------------------------------------------------------------
# GPipe.


def execute_pipeline_step(
    module: Callable,
    state: PyTree[Array],
    input: PyTree[Array],
    *args: Any,
    model_axis_name: AxisName,
    **kwargs: Any,
) -> tuple[PyTree[Array], PyTree[Array]]:
    """One clock step of a pipeline over the mesh axis `model_axis_name` (inside `shard_map`).

    The first device of the axis feeds `input` to its stage, every other device the `state` it
    received from its predecessor at the previous step. Each stage's result is sent one device
    further round the ring, where it becomes that device's next `state`.

    **Arguments:**

    - `module`: this device's stage, any callable `module(x, *args, **kwargs)` returning a
      pytree of the same shapes and dtypes as `x`.
    - `state`: what this device received at the previous step (zeros at the first step).
    - `input`: the microbatch entering the pipeline at this step (used on the first device).
    - `*args`, `**kwargs`: passed to `module` unchanged (a `Microbatched` argument is an
      error here: pass the rows of the microbatch this device works on).
    - `model_axis_name`: the pipeline axis of the mesh.

    **Returns:** `(new_state, output)`: `new_state` is the stage result of the previous device
    (to feed back as `state`; zeros on the first device, which reads `input` instead, so
    nothing crosses from the last device to the first); `output` is this stage's result on
    the last device and zeros on the others.

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_pipeline_step

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))

    def two_steps(scale, x):  # scale: this device's [1] slice of a [2] stack
        stage = lambda h: h * scale[0]
        state = jnp.zeros_like(x)
        state, _ = execute_pipeline_step(stage, state, x, model_axis_name="pipe")
        _, out = execute_pipeline_step(stage, state, x, model_axis_name="pipe")
        return out[None]

    f = jax.shard_map(two_steps, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P("pipe"))
    out = f(jnp.array([2.0, 3.0]), jnp.ones(3))
    assert jnp.allclose(out[1], 6.0) and jnp.allclose(out[0], 0.0)
    ```
    """
    caller = "execute_pipeline_step"
    _reject_microbatched(args, kwargs, caller)
    num_stages = _axis_size(model_axis_name, caller)
    index = lax.axis_index(model_axis_name)
    stage_input = jax.tree.map(lambda i, s: jnp.where(index == 0, i, s), input, state)
    out = module(stage_input, *args, **kwargs)
    new_state = _ring_shift(out, model_axis_name, num_stages, +1, wrap=False)
    output = jax.tree.map(lambda o: jnp.where(index == num_stages - 1, o, jnp.zeros_like(o)), out)
    return new_state, output


def _gather_output(outputs: Any, model_axis_name: AxisName, broadcast_output: bool) -> Any:
    if broadcast_output:
        return jax.tree.map(lambda o: lax.psum(o, model_axis_name), outputs)
    return outputs


def execute_pipeline(
    module: Callable,
    x: PyTree[Array],
    *args: Any,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool = False,
    **kwargs: Any,
) -> PyTree[Array]:
    """Run a GPipe pipeline over the mesh axis `model_axis_name` (inside `shard_map`).

    The batch is cut into `num_microbatches` equal microbatches that enter the first device
    one step apart; after `num_microbatches + S - 1` steps of one `lax.scan` (`S` the axis
    size) every microbatch has passed every stage. Differentiate through it for training
    (the backward pass runs the same steps in reverse); see `execute_1f1b` for a schedule that
    holds fewer activations.

    **Arguments:**

    - `module`: this device's stage: a callable `module(x, *args, **kwargs)` that returns the
      shapes and dtypes it takes (for instance the local slice of stages stacked over the
      pipeline axis).
    - `x`: the batch, a pytree of arrays sharing a leading batch axis; every device passes the
      same batch (only the first device reads it).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x` (the stage working on microbatch
      `m` gets its rows `m`).
    - `num_microbatches`: how many microbatches; must divide the batch size.
    - `model_axis_name`: the pipeline axis of the mesh.
    - `broadcast_output`: return the result on every device (one `psum` over the axis)
      instead of only on the last.

    **Returns:** the stage outputs of all microbatches in batch order, shaped like `x`, on
    the last device and zeros elsewhere (everywhere with `broadcast_output=True`).

    ```python
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_pipeline

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    scales = jnp.array([1.0, 2.0, 3.0, 4.0])  # stage s multiplies by scales[s]

    def run(scale, x):
        stage = lambda h: h * scale[0]
        return execute_pipeline(
            stage, x, num_microbatches=2, model_axis_name="pipe", broadcast_output=True
        )

    f = jax.shard_map(run, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P())
    x = jnp.arange(8.0).reshape(4, 2)
    assert jnp.allclose(f(scales, x), x * 24.0)
    ```
    """
    caller = "execute_pipeline"
    num_microbatches = _check_microbatches(num_microbatches, caller)
    num_stages = _axis_size(model_axis_name, caller)
    batch = _batch_size(x, "x", caller)
    if batch is None:
        raise ValueError(f"{caller}: `x` has no array leaves; pass the batch to pipeline.")
    _check_replicated(x, "x", model_axis_name, caller)
    module = _vary_like_input(module, x, model_axis_name)
    microbatches = _split_microbatches(x, num_microbatches, batch, "x", caller)
    arguments_at = _microbatch_arguments(
        args,
        kwargs,
        num_microbatches=num_microbatches,
        batch=batch,
        axis_name=model_axis_name,
        caller=caller,
    )
    _check_stage_keeps_shape(module, _take(microbatches, 0), *arguments_at(0), caller)
    device = lax.axis_index(model_axis_name)

    def step(state: Any, t: Array) -> tuple[Any, Any]:
        entering = _take(microbatches, jnp.minimum(t, num_microbatches - 1))
        # Device d works on microbatch t - d (out-of-range steps compute discarded values).
        call_args, call_kwargs = arguments_at(jnp.clip(t - device, 0, num_microbatches - 1))
        return execute_pipeline_step(
            module, state, entering, *call_args, model_axis_name=model_axis_name, **call_kwargs
        )

    init = _zeros_like(_take(microbatches, 0))
    _, outputs = _scan(step, init, _steps(num_microbatches + num_stages - 1))
    outputs = jax.tree.map(lambda o: o[num_stages - 1 :], outputs)
    return _gather_output(_merge_microbatches(outputs), model_axis_name, broadcast_output)


# --------------------------------------------------------------------------------------
# Circular (interleaved).


def _stack_size(stages: Any, caller: str) -> int:
    sizes: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stages)[0]:
        if eqx.is_array(leaf):
            sizes[jax.tree_util.keystr(path)] = leaf.shape[0] if leaf.ndim else 0
    if len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise ValueError(
            f"{caller}: `stages` must be a pytree whose array leaves all carry the same leading "
            f"stacking axis (one entry per stage held by this device); found leading sizes "
            f"{sizes} (0 = scalar)."
        )
    return next(iter(sizes.values()))


def execute_circular_pipeline(
    stages: PyTree,
    x: PyTree[Array],
    *args: Any,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool = False,
    **kwargs: Any,
) -> PyTree[Array]:
    """Run a circular (interleaved) pipeline over `model_axis_name` (inside `shard_map`).

    The model has `S * V` stages for an axis of size `S`; stage `s` lives on device `s % S`,
    so each device holds `V` non-adjacent stages and every microbatch goes round the ring `V`
    times. With `M >= S` microbatches this takes `V * M + S - 1` steps, a bubble of
    `(S - 1) / (V * M + S - 1)` instead of GPipe's `(S - 1) / (M + S - 1)` for the same model
    cut into `S` stages. A microbatch that completes a trip waits in a buffer of
    `max(M, S) - S + 1` microbatches on the first device until it is its turn again.

    **Arguments:**

    - `stages`: this device's `V` stages stacked on a leading axis: a pytree whose array
      leaves have leading size `V` and whose slice `i` (taken leaf by leaf) is a callable
      stage, entry `i` being model stage `i * S + d` on device `d`. Stages stored in model
      order as `[V, S, ...]` and sharded `P(None, axis)` give exactly this block (drop the
      unit second axis), which is how `eqpar.nn.PipelineModule` stores them.
    - `x`: the batch, a pytree of arrays with a leading batch axis (same on every device).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x`.
    - `num_microbatches`: `M`; must divide the batch size.
    - `model_axis_name`: the pipeline axis.
    - `broadcast_output`: return the result on every device instead of only the last.

    **Returns:** the outputs in batch order on the last device, zeros elsewhere (or
    everywhere with `broadcast_output=True`).

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_circular_pipeline

    class Scale(eqx.Module):
        factor: jax.Array
        def __call__(self, h):
            return h * self.factor

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))
    # 4 stages in model order, stored [V, S] = [2, 2]; sharding the second axis over "pipe"
    # gives device d the column [stage d, stage 2 + d], no reordering needed.
    factors = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(2, 2)

    def run(factors, x):  # factors: this device's [2, 1] block
        return execute_circular_pipeline(
            Scale(factors[:, 0]), x, num_microbatches=2, model_axis_name="pipe",
            broadcast_output=True,
        )

    f = jax.shard_map(run, mesh=mesh, in_specs=(P(None, "pipe"), P()), out_specs=P())
    assert jnp.allclose(f(factors, jnp.ones((4, 2))), 24.0)
    ```
    """
    caller = "execute_circular_pipeline"
    num_microbatches = _check_microbatches(num_microbatches, caller)
    num_stages = _axis_size(model_axis_name, caller)
    num_repeats = _stack_size(stages, caller)
    batch = _batch_size(x, "x", caller)
    if batch is None:
        raise ValueError(f"{caller}: `x` has no array leaves; pass the batch to pipeline.")
    _check_replicated(x, "x", model_axis_name, caller)
    stages = _vary_like_input(stages, x, model_axis_name)
    microbatches = _split_microbatches(x, num_microbatches, batch, "x", caller)
    arguments_at = _microbatch_arguments(
        args,
        kwargs,
        num_microbatches=num_microbatches,
        batch=batch,
        axis_name=model_axis_name,
        caller=caller,
    )
    arrays, static = eqx.partition(stages, eqx.is_array)

    def stage_at(repeat: Any) -> Callable:
        return eqx.combine(_take(arrays, repeat), static)

    first = _take(microbatches, 0)
    _check_stage_keeps_shape(stage_at(0), first, *arguments_at(0), caller)

    period = max(num_microbatches, num_stages)
    wait = period - num_stages  # steps a finished trip waits before re-entering device 0
    slots = wait + 1
    device = lax.axis_index(model_axis_name)

    def step(carry: Any, t: Array) -> tuple[Any, Any]:
        received, waiting = carry
        waiting = _put(waiting, t % slots, received, True)
        delayed = _take(waiting, (t - wait) % slots)
        k = t - device
        repeat = jnp.clip(k // period, 0, num_repeats - 1)
        microbatch = jnp.clip(k % period, 0, num_microbatches - 1)
        fresh = _take(microbatches, microbatch)
        first_trip = k // period == 0
        stage_input = jax.tree.map(
            lambda f, d, r: jnp.where(device == 0, jnp.where(first_trip, f, d), r),
            fresh,
            delayed,
            received,
        )
        call_args, call_kwargs = arguments_at(microbatch)
        out = stage_at(repeat)(stage_input, *call_args, **call_kwargs)
        output = jax.tree.map(
            lambda o: jnp.where(device == num_stages - 1, o, jnp.zeros_like(o)), out
        )
        return (_ring_shift(out, model_axis_name, num_stages, +1), waiting), output

    zeros = _zeros_like(first)
    waiting = jax.tree.map(lambda z: jnp.zeros((slots, *z.shape), z.dtype), zeros)
    num_steps = (num_repeats - 1) * period + num_microbatches + num_stages - 1
    _, outputs = _scan(step, (zeros, waiting), _steps(num_steps))
    start = (num_repeats - 1) * period + num_stages - 1
    outputs = jax.tree.map(lambda o: o[start : start + num_microbatches], outputs)
    return _gather_output(_merge_microbatches(outputs), model_axis_name, broadcast_output)


# --------------------------------------------------------------------------------------
# 1F1B.


def execute_1f1b(
    module: Callable,
    loss_fn: Callable,
    x: PyTree[Array],
    targets: PyTree[Array],
    *args: Any,
    num_microbatches: int,
    model_axis_name: AxisName,
    return_all_grads: bool = False,
    recompute: bool = False,
    **kwargs: Any,
) -> tuple[Float[Scalar, ""], Any]:
    """A pipelined training step in the one-forward-one-backward (1F1B) order (inside
    `shard_map`): the mean loss over microbatches and its gradients.

    Each device runs its stage's forward for a microbatch, then, as soon as the cotangent of
    the oldest microbatch comes back from the next device, that microbatch's backward; so it
    never holds the activations of more than `S` microbatches (`S` the axis size), where
    autodiff through `execute_pipeline` holds all `M`. By default a stage's forward keeps
    what its backward needs (the residuals of `jax.vjp`, in a ring of `S` slots, without the
    copies of the parameters and the stage input that are stored anyway), so no stage runs
    its forward twice; `recompute=True` keeps only the stage input and recomputes the forward
    in the backward step (less memory, one more forward per microbatch). Wrap the stage in
    `jax.checkpoint` with a policy for anything in between. The loss is computed on the last
    device inside its backward step (its forward is never run separately).
    Steps follow `eqpar.schedule.OneFOneBSchedule`: `2 * (M + S - 1)` of them, each device
    running only the branch (forward, backward or nothing) its schedule names.

    **Arguments:**

    - `module`: this device's stage, a callable pytree (e.g. an Equinox module)
      `module(x, *args, **kwargs)` returning the shapes and dtypes it takes. Gradients are
      taken with respect to its inexact array leaves.
    - `loss_fn`: `loss_fn(outputs, targets) -> scalar` for one microbatch, e.g. a mean over
      its rows; a callable pytree whose array leaves (say an output head) get gradients with
      `return_all_grads=True`. It must not use collectives over `model_axis_name`.
    - `x`: the batch entering the first stage, a pytree with a leading batch axis.
    - `targets`: the matching targets (a pytree with the same leading batch size, or `None`).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x` (forward and backward of
      microbatch `m` both get rows `m`). They get no gradients.
    - `num_microbatches`: `M`; must divide the batch size.
    - `model_axis_name`: the pipeline axis.
    - `return_all_grads`: also return the gradients of `loss_fn`'s array leaves and of `x`.
    - `recompute`: recompute each stage's forward in its backward step instead of storing
      its residuals.

    **Returns:** `(loss, grads)`, with `loss = mean over microbatches of loss_fn` on every
    device and `grads` the gradient of `loss` with respect to this device's `module` (same
    structure, `None` for leaves that are not inexact arrays). With `return_all_grads=True`,
    `(loss, (grads, loss_fn_grads, x_grads))`; `loss_fn_grads` and `x_grads` are the same on
    every device of the pipeline axis. As with `jax.grad` inside `shard_map`, the gradient of a
    parameter replicated over another mesh axis (say `data`, each shard with its own rows)
    arrives summed over that axis while `loss` is this shard's: take `lax.pmean` of the loss
    and divide such gradients by the axis size for the mean. `grads` is this device's stage
    only; a parameter shared by several stages needs its gradients summed over the pipeline
    axis.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_1f1b

    class Stage(eqx.Module):
        linear: eqx.nn.Linear
        def __call__(self, h):
            return jax.vmap(self.linear)(h)

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    keys = jax.random.split(jax.random.key(0), 4)
    stages = eqx.filter_vmap(lambda k: Stage(eqx.nn.Linear(3, 3, key=k)))(keys)
    params, static = eqx.partition(stages, eqx.is_array)
    loss_fn = lambda y, t: jnp.mean((y - t) ** 2)

    def step(params, x, t):
        stage = eqx.combine(jax.tree.map(lambda a: a[0], params), static)
        loss, grads = execute_1f1b(
            stage, loss_fn, x, t, num_microbatches=4, model_axis_name="pipe"
        )
        return loss, jax.tree.map(lambda g: g[None], grads)

    f = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P("pipe"), P(), P()), out_specs=(P(), P("pipe"))
    ))
    x, t = jnp.ones((8, 3)), jnp.zeros((8, 3))
    loss, grads = f(params, x, t)

    def serial_loss(params):
        h = x
        for i in range(4):
            h = eqx.combine(jax.tree.map(lambda a: a[i], params), static)(h)
        return loss_fn(h, t)

    expected = jax.grad(serial_loss)(params)
    assert jnp.allclose(loss, serial_loss(params), rtol=1e-5)
    assert jnp.allclose(grads.linear.weight, expected.linear.weight, rtol=1e-5, atol=1e-7)
    ```
    """
    caller = "execute_1f1b"
    num_microbatches = _check_microbatches(num_microbatches, caller)
    num_stages = _axis_size(model_axis_name, caller)
    batch = _batch_size(x, "x", caller)
    if batch is None:
        raise ValueError(f"{caller}: `x` has no array leaves; pass the batch to pipeline.")
    target_batch = _batch_size(targets, "targets", caller)
    if target_batch not in (None, batch):
        raise ValueError(
            f"{caller}: `x` has {batch} rows but `targets` has {target_batch}; give both the "
            f"same batch size."
        )
    _check_replicated(x, "x", model_axis_name, caller)
    _check_replicated(targets, "targets", model_axis_name, caller)
    microbatches = _split_microbatches(x, num_microbatches, batch, "x", caller)
    target_microbatches = _split_microbatches(targets, num_microbatches, batch, "targets", caller)
    pipe = frozenset({model_axis_name})
    arguments_at = _microbatch_arguments(
        args,
        kwargs,
        num_microbatches=num_microbatches,
        batch=batch,
        axis_name=model_axis_name,
        caller=caller,
        cast=pipe,
    )
    first = _take(microbatches, 0)
    replicated_axes = (
        _axes_tree(eqx.filter(module, eqx.is_inexact_array)),
        _axes_tree(eqx.filter(loss_fn, eqx.is_inexact_array)),
    )
    module = _vary_like_input(module, x, model_axis_name)
    loss_fn = _vary_like_input(loss_fn, x, model_axis_name)
    _check_stage_keeps_shape(module, first, *arguments_at(0), caller)

    params, static = eqx.partition(module, eqx.is_inexact_array)
    loss_params, loss_static = eqx.partition(loss_fn, eqx.is_inexact_array)

    def run_stage(p: Any, h: Any, call: tuple) -> Any:
        return eqx.combine(p, static)(h, *call[0], **call[1])

    def run_last(p: Any, h: Any, lp: Any, target: Any, call: tuple) -> Any:
        return eqx.combine(lp, loss_static)(run_stage(p, h, call), target)

    loss_shape = jax.eval_shape(
        lambda p, h, lp, t: run_last(p, h, lp, t, arguments_at(0)),
        params,
        first,
        loss_params,
        _take(target_microbatches, 0),
    )
    if not isinstance(loss_shape, jax.ShapeDtypeStruct) or loss_shape.shape != ():
        raise ValueError(
            f"{caller}: `loss_fn(outputs, targets)` must return one scalar per microbatch "
            f"(e.g. a mean over rows); it returned {_describe(loss_shape)}."
        )
    if not jnp.issubdtype(loss_shape.dtype, jnp.inexact):
        raise TypeError(
            f"{caller}: `loss_fn` must return a floating-point scalar, got {loss_shape.dtype.name}."
        )

    device = lax.axis_index(model_axis_name)
    is_first = device == 0
    is_last = device == num_stages - 1
    # Everything the branches touch varies over the pipeline axis, so that no gradient
    # inside a branch needs a reduction over that axis (which only some devices would run).
    params = _cast_tree(params, pipe)
    loss_params = _cast_tree(loss_params, pipe)
    microbatches = _cast_tree(microbatches, pipe)
    target_microbatches = _cast_tree(target_microbatches, pipe)
    cotangent_scale = jnp.asarray(1.0 / num_microbatches, loss_shape.dtype)

    def stage_vjp(p: Any, h: Any, microbatch: Any) -> tuple:
        """`jax.vjp` of the stage in its inexact leaves: `(pullback, output)`. Only the
        inexact leaves of the activations carry cotangents; integer or boolean leaves (masks,
        positions) ride along unchanged."""
        h_diff, h_rest = eqx.partition(h, eqx.is_inexact_array)

        def stage_part(p: Any, hd: Any) -> Any:
            out = run_stage(p, eqx.combine(hd, h_rest), arguments_at(microbatch))
            return eqx.filter(out, eqx.is_inexact_array), out

        _, pullback, out = jax.vjp(stage_part, p, h_diff, has_aux=True)
        return pullback, out

    layout = None if recompute else _Residuals(stage_vjp, params, _take(microbatches, 0))
    no_residuals = layout.zeros() if layout else ()

    def idle(state: _BranchState) -> _BranchOut:
        return _BranchOut(
            _zeros_like(state.h),
            _zeros_like(state.cot),
            state.grads,
            state.loss_grads,
            state.loss,
            no_residuals,
        )

    def forward(state: _BranchState) -> _BranchOut:
        if layout is None:
            sent, residuals = run_stage(params, state.h, arguments_at(state.microbatch)), ()
        else:
            pullback, sent = stage_vjp(params, state.h, state.microbatch)
            residuals = layout.split(pullback, sent, params, state.h)
        zero_cot = _zeros_like(state.cot)
        return _BranchOut(sent, zero_cot, state.grads, state.loss_grads, state.loss, residuals)

    def backward(state: _BranchState) -> _BranchOut:
        if layout is None:
            pullback, out = stage_vjp(params, state.h, state.microbatch)
            output_axes = _axes_tree(eqx.filter(out, eqx.is_inexact_array))
        else:
            stored = _take(state.residuals, state.microbatch % num_stages)
            pullback, output_axes = layout.join(stored, params, state.h)
        d_params, d_h = pullback(_cast_tree(state.cot, output_axes))
        grads = _add(state.grads, d_params)
        zero_h = _zeros_like(state.h)
        return _BranchOut(zero_h, d_h, grads, state.loss_grads, state.loss, no_residuals)

    def backward_last(state: _BranchState) -> _BranchOut:
        h_diff, h_rest = eqx.partition(state.h, eqx.is_inexact_array)

        def last_part(p: Any, hd: Any, lp: Any) -> Any:
            return run_last(
                p, eqx.combine(hd, h_rest), lp, state.target, arguments_at(state.microbatch)
            )

        value, pullback = jax.vjp(last_part, params, h_diff, loss_params)
        scale = _cast_varying(cotangent_scale, _varying_axes(value))
        d_params, d_h, d_loss_params = pullback(scale)
        return _BranchOut(
            _zeros_like(state.h),
            d_h,
            _add(state.grads, d_params),
            _add(state.loss_grads, d_loss_params),
            state.loss + value * cotangent_scale,
            no_residuals,
        )

    branches = [idle, forward, backward, backward_last]

    def step(carry: tuple, t: Array) -> tuple[tuple, None]:
        received, cotangent, stash, residuals, grads, loss_grads, loss, x_grads = carry
        fwd, bwd = _one_f_one_b_slot(
            t, device, num_stages=num_stages, num_microbatches=num_microbatches, xp=jnp
        )
        sent, _ = _one_f_one_b_slot(
            t - 1, device - 1, num_stages=num_stages, num_microbatches=num_microbatches, xp=jnp
        )
        # Inputs wait in a ring of S slots (microbatch m in slot m % S) from their arrival
        # until their backward: the schedule never has more than S in flight on a device.
        stash = _put(stash, sent % num_stages, received, (sent >= 0) & ~is_first)
        fresh = _take(microbatches, jnp.clip(fwd, 0, num_microbatches - 1))
        stash = _put(stash, fwd % num_stages, fresh, (fwd >= 0) & is_first)
        current = jnp.clip(jnp.where(fwd >= 0, fwd, bwd), 0, num_microbatches - 1)
        h = _take(stash, current % num_stages)
        target = _take(target_microbatches, jnp.clip(bwd, 0, num_microbatches - 1))
        # The last stage's forward is folded into its backward, which recomputes it anyway.
        branch = jnp.where(
            bwd >= 0, jnp.where(is_last, 3, 2), jnp.where((fwd >= 0) & ~is_last, 1, 0)
        )
        # the whole ring of residuals goes in: only the backward branch reads its slot
        state = _BranchState(h, cotangent, target, current, grads, loss_grads, loss, residuals)
        out = _switch(branch, branches, state)
        sent_forward, sent_back, grads, loss_grads, loss = out[:5]
        # The residuals of this forward wait in slot m % S, like the inputs, until its backward.
        # (Other steps write their zeros to a spare slot S: an unconditional write, no select.)
        slot = jnp.where(branch == 1, fwd % num_stages, num_stages)
        residuals = jax.tree.map(
            lambda a, v: lax.dynamic_update_index_in_dim(a, v, slot, 0), residuals, out.residuals
        )
        if x_grads is not None:
            x_grads = _put(
                x_grads, jnp.clip(bwd, 0, num_microbatches - 1), sent_back, (bwd >= 0) & is_first
            )
        # The last device's output and the first device's input cotangent go nowhere.
        received = _ring_shift(sent_forward, model_axis_name, num_stages, +1, wrap=False)
        cotangent = _ring_shift(sent_back, model_axis_name, num_stages, -1, wrap=False)
        return (received, cotangent, stash, residuals, grads, loss_grads, loss, x_grads), None

    zeros = _cast_tree(_zeros_like(first), pipe)
    stash = jax.tree.map(lambda z: jnp.zeros((num_stages, *z.shape), z.dtype), zeros)
    x_grads = None
    if return_all_grads:
        x_grads = eqx.filter(_zeros_like(microbatches), eqx.is_inexact_array)
    init = (
        zeros,
        eqx.filter(zeros, eqx.is_inexact_array),
        stash,
        jax.tree.map(lambda z: jnp.zeros((num_stages + 1, *z.shape), z.dtype), no_residuals),
        _cast_tree(_zeros_like(params), _axes_tree(params)),
        _cast_tree(_zeros_like(loss_params), _axes_tree(loss_params)),
        _cast_varying(jnp.zeros((), loss_shape.dtype), pipe),
        x_grads,
    )
    carry, _ = _scan(step, init, _steps(2 * (num_microbatches + num_stages - 1)))
    _, _, _, _, grads, loss_grads, loss, x_grads = carry
    # Parameters replicated over the batch's axes were cast to varying before the loop: sum
    # their gradients over those axes once, as autodiff through the replication would.
    grads = _sum_over_cast_axes(grads, replicated_axes[0], x, model_axis_name)
    loss_grads = _sum_over_cast_axes(loss_grads, replicated_axes[1], x, model_axis_name)
    loss = lax.psum(jnp.where(is_last, loss, jnp.zeros_like(loss)), model_axis_name)
    if not return_all_grads:
        return loss, grads
    loss_grads = jax.tree.map(
        lambda g: lax.psum(jnp.where(is_last, g, jnp.zeros_like(g)), model_axis_name), loss_grads
    )
    x_grads = jax.tree.map(
        lambda g: lax.psum(jnp.where(is_first, g, jnp.zeros_like(g)), model_axis_name), x_grads
    )
    return loss, (grads, loss_grads, _merge_microbatches(x_grads))


class _BranchState(NamedTuple):
    """What a 1F1B step hands to its forward / backward / idle branch."""

    h: Any  # the stage input of the microbatch this step works on
    cot: Any  # the cotangent received from the next stage
    target: Any  # the targets of the microbatch (used by the last stage)
    microbatch: Any  # the index of that microbatch (selects its `Microbatched` rows)
    grads: Any  # running gradient of the stage parameters
    loss_grads: Any  # running gradient of loss_fn's parameters
    loss: Any  # running loss
    residuals: Any  # the ring of stored residuals (the backward reads its microbatch's slot)


class _BranchOut(NamedTuple):
    """What a 1F1B branch returns: what to send each way and the updated running sums."""

    sent_forward: Any  # the stage output, for the next device
    sent_back: Any  # the input cotangent, for the previous device
    grads: Any
    loss_grads: Any
    loss: Any
    residuals: Any  # what a forward stores for its backward (zeros from the other branches)


class _Residuals:
    """The residuals a 1F1B forward stores for its backward.

    `jax.vjp`'s pullback is a pytree whose leaves are its residuals. The forward step stores
    those that are not the parameters or the stage input themselves (a linear layer's weight
    and input are kept anyway, so they are not copied into every slot); the backward step
    rebuilds the pullback from the stored ones and the inputs. The backward uses the tree
    structure and the leaf sources that the forward branch recorded when it was traced with
    the same operand types (shapes, dtypes, replication types; the branches of one step share
    their operands), so the two always agree even where JAX caches a trace; an abstract probe
    beforehand gives only the shapes the other branches return as zeros."""

    def __init__(self, stage_vjp: Callable, params: Any, h: Any):
        def probe(params: Any, h: Any) -> Any:
            pullback, _ = stage_vjp(params, h, jnp.zeros((), jnp.int32))
            return self._stored(pullback, _sources(pullback, params, h))

        self.shapes = jax.eval_shape(probe, params, h)
        self.recorded: dict = {}  # operand types -> the forward's treedef, sources, out axes

    @staticmethod
    def _stored(pullback: Any, sources: tuple) -> tuple:
        return tuple(r for r, s in zip(jax.tree.leaves(pullback), sources) if s is None)

    def zeros(self) -> tuple:
        return tuple(_zeros_like(self.shapes))

    def split(self, pullback: Any, out: Any, params: Any, h: Any) -> tuple:
        """The residuals of `pullback` to store (recording where the others come from, and
        the replication types of the output `out`, which its cotangent must have)."""
        sources = _sources(pullback, params, h)
        out_axes = _axes_tree(eqx.filter(out, eqx.is_inexact_array))
        self.recorded[_types(params, h)] = (jax.tree.structure(pullback), sources, out_axes)
        stored = self._stored(pullback, sources)
        if [(r.shape, r.dtype) for r in stored] != [(r.shape, r.dtype) for r in self.shapes]:
            raise RuntimeError(
                "execute_1f1b: the stage's residuals differ between two traces of the same "
                "stage, so they cannot be stored for the backward step; pass recompute=True."
            )
        return stored

    def join(self, stored: Any, params: Any, h: Any) -> tuple[Any, Any]:
        """The pullback rebuilt from the stored residuals and the inputs, and the replication
        types its cotangent must have."""
        treedef, sources, out_axes = self.recorded[_types(params, h)]  # forward traced first
        inputs, rest = _inputs(params, h), iter(stored)
        leaves = [next(rest) if s is None else inputs[s] for s in sources]
        return jax.tree.unflatten(treedef, leaves), out_axes


def _types(*trees: Any) -> tuple:
    return tuple((x.shape, x.dtype, _varying_axes(x)) for x in jax.tree.leaves(trees))


def _inputs(params: Any, h: Any) -> list:
    return jax.tree.leaves((params, eqx.filter(h, eqx.is_inexact_array)))


def _sources(pullback: Any, params: Any, h: Any) -> tuple:
    """For each residual of `pullback`: the index of the input leaf it is, or None."""
    inputs = _inputs(params, h)
    return tuple(
        next((i for i, a in enumerate(inputs) if a is r), None) for r in jax.tree.leaves(pullback)
    )


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(lambda u, v: u + v, a, b)


__all__ = [
    "Microbatched",
    "execute_1f1b",
    "execute_circular_pipeline",
    "execute_pipeline",
    "execute_pipeline_step",
]
