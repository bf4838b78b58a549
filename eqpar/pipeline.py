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
- `execute_schedule`: a whole training step in the order of any training schedule of
  `eqpar.schedule` (1F1B, zero-bubble ZB-H1, GPipe or circular with their backward). Every
  executor here runs the same loop, `_run_schedule`, from the table its schedule gives.
- `Microbatched`: marks an extra stage argument (an attention mask, positions) as per-example,
  so that every stage call gets the rows of the microbatch it is working on.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PyTree, Scalar

from . import _program
from ._axes import axis_size
from ._typing import AxisName
from ._vma import cast_varying as _cast_varying
from ._vma import varying_axes as _varying_axes
from .schedule import CircularSchedule, OneFOneBSchedule, PipelineSchedule

# --------------------------------------------------------------------------------------
# Replication types (shard_map's `check_vma`) across JAX versions.


def _cast_tree(tree: Any, axes: Any) -> Any:
    """`_cast_varying` leaf by leaf; `axes` is a frozenset or a tree of them like `tree`."""
    if isinstance(axes, frozenset):
        return jax.tree.map(lambda x: _cast_varying(x, axes), tree)
    return jax.tree.map(_cast_varying, tree, axes)


def _vary_like_input(tree: Any, x: Any, axis_name: AxisName | None) -> Any:
    """`tree`'s inexact arrays marked varying over the mesh axes the batch `x` varies over
    (but `axis_name`).

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


def _unwrap_microbatched(
    args: Any, kwargs: Any, batch: int | None, caller: str, axis_name: AxisName | None = None
) -> tuple:
    """`(args, kwargs)` with every `Microbatched` replaced by its whole value (rows checked
    against `batch` when it is known; with `axis_name`, checked to be the same on every
    device of that pipeline axis, as `_microbatch_arguments` checks them)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_microbatched)
    leaves = []
    for path, leaf in flat:
        if _is_microbatched(leaf):
            if batch is not None:
                _check_microbatched_rows(leaf.value, _argument_name(path), batch, caller)
            if axis_name is not None:
                _check_replicated(leaf.value, _argument_name(path), axis_name, caller)
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
# The executor: any schedule table, run as one `lax.scan`.


class _Carry(NamedTuple):
    """The loop state of `_run_schedule` (fields a run does not need are `None`)."""

    received: Any  # the activation the previous device sent at the last step
    received_cotangent: Any  # the cotangent the next device sent at the last step
    inputs: Any  # stage inputs waiting for their actions: [input slots + 1, ...]
    cotangents: Any  # cotangents, and the last stage's outputs, waiting: [slots + 1, ...]
    residuals: Any  # what forwards stored for their backwards: [residual slots + 1, ...]
    outputs: Any  # forward runs: the last stage's outputs, [M + 1, ...]
    grads: Any  # gradient of the stage parameters so far
    loss_grads: Any  # gradient of loss_fn's parameters so far
    loss: Any  # the loss so far (on the device of the last stage)
    x_grads: Any  # gradient of the batch so far, [M + 1, ...] (on the first device)


class _Work(NamedTuple):
    """What one step hands to the branch of its action."""

    h: Any  # the stage input of the action's microbatch
    microbatch: Any  # its index (selects the `Microbatched` rows and the targets)
    repeat: Any  # which of the device's stages (circular schedules)
    cotangents: Any  # the cotangent buffer (a backward reads its slot inside its branch)
    cotangent_slot: Any
    residuals: Any  # the residual buffer, likewise
    residual_slot: Any
    grads: Any
    loss_grads: Any
    loss: Any
    loss_cotangent: Any  # the output cotangent from `loss_everywhere` (else None)


class _Done(NamedTuple):
    """What a branch returns (zeros where its action makes nothing)."""

    sent_forward: Any  # the stage output, for the device of the next stage
    sent_back: Any  # the input cotangent, for the device of the previous stage
    kept_cotangent: Any  # the last stage's output (forward) or its cotangent (backward input)
    residuals: Any  # what a forward stores for its backward
    output: Any  # a forward run's last-stage output
    grads: Any
    loss_grads: Any
    loss: Any


def _without_stage_weights(policy: Callable) -> Callable:
    """`policy`, except that it never saves the values named `_STAGE_WEIGHTS`."""
    exclude = jax.checkpoint_policies.save_anything_except_these_names(_STAGE_WEIGHTS)
    return lambda *args, **params: exclude(*args, **params) and policy(*args, **params)


_STAGE_WEIGHTS = "eqpar_pipeline_stage_weights"


def _run_schedule(
    program: _program.Program,
    stages: Any,
    loss_fn: Callable | None,
    microbatches: Any,
    target_microbatches: Any,
    arguments_at: Callable,
    *,
    axis_name: AxisName,
    loss_dtype: Any = None,
    return_all_grads: bool = False,
    loss_on_every_device: bool = False,
    stage_policy: Callable | None = None,
) -> _Carry:
    """Run `program` (a compiled schedule table) in one `lax.scan` on this device.

    Each step writes what arrived into its buffer slot, runs the branch its action names
    (`lax.switch`), keeps what the action made for later, and sends activations forward and
    cotangents back, to exactly the devices that step's actions need (one `lax.switch` over
    the distinct sets of device pairs, indexed by the step, so every device takes the same
    branch). With `loss_fn=None` it runs a forward table and collects the last stage's
    outputs (differentiate through it); otherwise a training table, each backward computed
    with `jax.vjp` from the residuals its forward stored (`program.num_residual_slots > 0`)
    or by recomputing the forward (none stored).

    With `loss_on_every_device` (a loss function split over the pipeline axis, such as a
    vocabulary-parallel head), the loss of each microbatch runs outside the branches, on
    every device at the step its last stage's backward starts: the last stage's output goes
    to every device (one `psum`), each computes the loss and the gradient of its own part
    of the loss function, and the output's cotangent comes back summed to the last stage.

    A forward run given the stage's remat policy (`stage_policy`, as `PipelineModule`
    passes it), or of several stages per device, calls each stage under one
    `jax.checkpoint` with that policy (default: keep everything), never keeping a circular
    stage's slice of the stacked weights; with a policy it also skips the stage in each
    device's idle steps (see `skips_bubbles`).
    """
    training = loss_fn is not None
    store = program.num_residual_slots > 0
    num_repeats, num_microbatches = program.num_repeats, len(jax.tree.leaves(microbatches)[0])
    pipe = frozenset({axis_name})
    device = lax.axis_index(axis_name)
    params, static = eqx.partition(stages, eqx.is_inexact_array)
    # Circular: the other array leaves (integers) are stacked too; slice them per stage.
    others, static = eqx.partition(static, eqx.is_array) if num_repeats > 1 else (None, static)
    params = _cast_tree(params, pipe)  # stays outside the loop: any sum over pipe runs once
    microbatches = _cast_tree(microbatches, pipe)
    first = _take(microbatches, 0)
    loss_params, loss_static = eqx.partition(loss_fn, eqx.is_inexact_array)
    if not loss_on_every_device:  # it runs inside the branches, which must agree on types
        loss_params = _cast_tree(loss_params, pipe)
    targets = _cast_tree(target_microbatches, pipe)

    def stage_params(p: Any, repeat: Any) -> Any:
        if num_repeats == 1:
            return p
        # Named so that autodiff of a forward run recomputes the slice instead of keeping a
        # copy of the stage's weights for every step (see `call` below).
        return jax.tree.map(lambda a: checkpoint_name(a, _STAGE_WEIGHTS), _take(p, repeat))

    def run_stage(p: Any, h: Any, microbatch: Any, repeat: Any) -> Any:
        call_args, call_kwargs = arguments_at(microbatch)
        rest = static if others is None else eqx.combine(_take(others, repeat), static)
        return eqx.combine(p, rest)(h, *call_args, **call_kwargs)

    def forward_run(h: Any, microbatch: Any, repeat: Any, runs: Any = None) -> Any:
        """A forward run's stage call; with `runs` (1 or 0, by device) skipped where 0."""

        def call(p: Any, h: Any, m: Any, r: Any, runs: Any) -> Any:
            def stage(h: Any, m: Any, r: Any) -> Any:
                return run_stage(stage_params(p, r), h, m, r)

            if runs is None:
                return stage(h, m, r)
            return _switch(runs, [lambda h, m, r: _zeros_like(h), stage], h, m, r)

        if stage_policy is None and num_repeats == 1:  # a caller's stage, called as it is
            return call(params, h, microbatch, repeat, None)
        # One checkpoint around the stage (and the skip), whose policy is the stage's own: a
        # policy around an inner `jax.checkpoint` decides for it too (it would keep what the
        # inner one drops), and without it autodiff of the loop keeps more (the residuals of
        # both branches of the skip, a circular stage's slice of the weights at every step).
        policy = _without_stage_weights(stage_policy or jax.checkpoint_policies.everything_saveable)
        return jax.checkpoint(call, policy=policy)(params, h, microbatch, repeat, runs)

    # A forward run skips the stage in a device's idle (bubble) steps, in a `lax.switch` whose
    # branch differs by device (the devices of a collective over another mesh axis share
    # their pipeline position, so they take the same branch), when a remat policy is in
    # force (`stage_policy`; without one, autodiff of the skip keeps more than the bubbles
    # save). A `ppermute` in such a branch gives wrong values (see `execute_schedule`): a
    # stage with one runs at every step, bubbles included.
    skips_bubbles = (
        not training
        and stage_policy is not None
        and bool((program.kind == _program.IDLE).any())
        and not _uses_primitive(jax.make_jaxpr(lambda h: forward_run(h, 0, 0))(first), "ppermute")
    )

    def stage_vjp(p: Any, h: Any, microbatch: Any, repeat: Any = 0) -> tuple:
        """`jax.vjp` of the stage in its inexact leaves: `(pullback, output)`. Only the
        inexact leaves of the activations carry cotangents; integer or boolean leaves (masks,
        positions) ride along unchanged."""
        h_diff, h_rest = eqx.partition(h, eqx.is_inexact_array)

        def stage_part(p: Any, hd: Any) -> Any:
            out = run_stage(p, eqx.combine(hd, h_rest), microbatch, repeat)
            return eqx.filter(out, eqx.is_inexact_array), out

        _, pullback, out = jax.vjp(stage_part, p, h_diff, has_aux=True)
        return pullback, out

    layout = _Residuals(stage_vjp, stage_params(params, 0), first) if store else None
    no_residuals = layout.zeros() if layout else ()
    zero_h = _zeros_like(first)
    zero_cotangent = eqx.filter(zero_h, eqx.is_inexact_array)
    zero_output = zero_h if not training else None
    scale = jnp.asarray(1.0 / num_microbatches, loss_dtype or jnp.float32)

    def add(total: Any, part: Any, repeat: Any) -> Any:
        if num_repeats == 1:
            return _add(total, part)
        return jax.tree.map(
            lambda g, d: lax.dynamic_update_index_in_dim(
                g, lax.dynamic_index_in_dim(g, repeat, keepdims=False) + d, repeat, 0
            ),
            total,
            part,
        )

    def nothing(w: _Work) -> _Done:
        return _Done(
            zero_h, zero_cotangent, zero_cotangent, no_residuals, zero_output,
            w.grads, w.loss_grads, w.loss,
        )  # fmt: skip

    def forward(w: _Work) -> _Done:
        p = stage_params(params, w.repeat)
        if not (training and store):
            return nothing(w)._replace(sent_forward=run_stage(p, w.h, w.microbatch, w.repeat))
        pullback, out = stage_vjp(p, w.h, w.microbatch, w.repeat)
        assert layout is not None
        residuals = layout.split(pullback, out, p, w.h)
        return nothing(w)._replace(sent_forward=out, residuals=residuals)

    def forward_last(w: _Work) -> _Done:
        if not training:
            out = run_stage(stage_params(params, w.repeat), w.h, w.microbatch, w.repeat)
            return nothing(w)._replace(output=out)
        done = forward(w)  # the output waits in the cotangent buffer for the loss
        return done._replace(
            sent_forward=zero_h, kept_cotangent=eqx.filter(done.sent_forward, eqx.is_inexact_array)
        )

    def pullback_of(w: _Work) -> tuple[Callable, Any, Any]:
        """The stage's pullback, the replication types of its output (which the cotangent
        must have) and, when recomputed, the output itself (else `None`)."""
        p = stage_params(params, w.repeat)
        if not store:
            pullback, out = stage_vjp(p, w.h, w.microbatch, w.repeat)
            return pullback, _axes_tree(eqx.filter(out, eqx.is_inexact_array)), out
        assert layout is not None
        pullback, out_axes = layout.join(_take(w.residuals, w.residual_slot), p, w.h)
        return pullback, out_axes, None

    def backward(w: _Work, *, weights: bool = True, inputs: bool = True) -> _Done:
        pullback, out_axes, _ = pullback_of(w)
        cotangent = _cast_tree(_take(w.cotangents, w.cotangent_slot), out_axes)
        d_params, d_h = pullback(cotangent)
        done = nothing(w)
        if weights:
            done = done._replace(grads=add(w.grads, d_params, w.repeat))
        return done._replace(sent_back=d_h) if inputs else done

    def loss_and_pullback(out_diff: Any, out_rest: Any, microbatch: Any) -> tuple:
        """The cotangent of one microbatch's output, the gradient of `loss_fn`'s parameters
        and the microbatch's share of the mean loss."""
        target = _take(targets, microbatch)

        def loss_of(od: Any, lp: Any) -> Any:
            return eqx.combine(lp, loss_static)(eqx.combine(od, out_rest), target)

        value, loss_pullback = jax.vjp(loss_of, out_diff, loss_params)
        d_out, d_loss_params = loss_pullback(_cast_varying(scale, _varying_axes(value)))
        return d_out, d_loss_params, value * scale

    # The steps at which a last stage's backward starts: the device that runs it, its
    # microbatch and the slot where its forward kept the output (-1: none at that step).
    last_stage = np.isin(program.kind, (_program.BACKWARD_LAST, _program.BACKWARD_INPUT_LAST))
    if (last_stage.sum(axis=1) > 1).any():  # one device holds the last stage
        raise AssertionError("a step starts two last-stage backwards")
    loss_device = np.where(last_stage.any(axis=1), last_stage.argmax(axis=1), -1)
    steps = np.arange(len(program.kind))
    at_loss_device = (steps, np.maximum(loss_device, 0))
    loss_steps = jnp.asarray(np.stack([
        loss_device, program.microbatch[at_loss_device], program.cotangent_slot[at_loss_device],
        program.repeat[at_loss_device],
    ], axis=-1))  # fmt: skip

    def loss_everywhere(cotangents: Any, h: Any, t: Array) -> tuple:
        """At a step where a last stage's backward starts: every device's part of its loss
        (`loss_on_every_device`); zeros at the other steps. `h` is this device's stage input
        at the step: on the last stage's device, the input of that stage's backward."""
        owner, microbatch, slot, repeat = loss_steps[t]

        def run(cotangents: Any) -> tuple:
            if store:  # the last stage's forward kept its output
                kept = _take(cotangents, jnp.maximum(slot, 0))
            else:  # it left its forward to its backward: run it here, on every device alike
                out = run_stage(stage_params(params, repeat), h, microbatch, repeat)
                kept = eqx.filter(out, eqx.is_inexact_array)
            out_diff = jax.tree.map(
                lambda a: lax.psum(jnp.where(device == owner, a, jnp.zeros_like(a)), axis_name),
                kept,
            )
            # Integer leaves (masks) pass through the stages unchanged: the microbatch's own.
            out_rest = _integer_leaves(_take(microbatches, microbatch))
            return loss_and_pullback(out_diff, out_rest, microbatch)

        def skip(cotangents: Any) -> tuple:
            shapes = jax.eval_shape(run, cotangents)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        # The step, not the device, picks the branch: every device runs the same one.
        return _switch((owner >= 0).astype(jnp.int32), [skip, run], cotangents)

    def backward_last(w: _Work, *, weights: bool = True) -> _Done:
        pullback, out_axes, out = pullback_of(w)
        if out is None:  # the forward kept the output's inexact leaves; the others are the
            # input's (a stage passes integer leaves such as masks through unchanged)
            out = eqx.combine(_take(w.cotangents, w.cotangent_slot), _integer_leaves(w.h))
        if loss_on_every_device:  # the loss ran before the branches (`loss_everywhere`)
            d_out, done = w.loss_cotangent, nothing(w)
        else:
            out_diff, out_rest = eqx.partition(out, eqx.is_inexact_array)
            d_out, d_loss_params, part = loss_and_pullback(out_diff, out_rest, w.microbatch)
            done = nothing(w)._replace(
                loss_grads=_add(w.loss_grads, d_loss_params), loss=w.loss + part
            )
        d_params, d_h = pullback(_cast_tree(d_out, out_axes))
        done = done._replace(sent_back=d_h)
        if weights:
            return done._replace(grads=add(w.grads, d_params, w.repeat))
        return done._replace(kept_cotangent=d_out)  # for the weight gradient, later

    by_kind = {
        _program.IDLE: nothing,
        _program.FORWARD: forward,
        _program.FORWARD_LAST: forward_last,
        _program.BACKWARD: backward,
        _program.BACKWARD_LAST: backward_last,
        _program.BACKWARD_INPUT: lambda w: backward(w, weights=False),
        _program.BACKWARD_INPUT_LAST: lambda w: backward_last(w, weights=False),
        _program.BACKWARD_WEIGHT: lambda w: backward(w, inputs=False),
    }
    # Only the kinds the table uses are traced: one branch each.
    kinds = np.unique(program.kind)
    branches = [by_kind[int(k)] for k in kinds]
    columns = (
        program.kind, np.searchsorted(kinds, program.kind), program.microbatch, program.repeat,
        program.input_slot, program.cotangent_slot, program.residual_slot,
        program.received_input_slot, program.received_cotangent_slot,
    )  # fmt: skip
    table = jnp.asarray(np.stack(columns, axis=-1))  # [steps, devices, columns]
    sends = jnp.asarray(np.stack([program.forward_sends, program.backward_sends], axis=-1))

    def send(tree: Any, pattern: Any, pairs: tuple) -> Any:
        def shift(pair_set: tuple) -> Callable:
            if not pair_set:
                return _zeros_like
            return lambda t: jax.tree.map(lambda a: lax.ppermute(a, axis_name, pair_set), t)

        if len(pairs) == 1:
            return shift(pairs[0])(tree)
        return _switch(pattern, [shift(p) for p in pairs], tree)

    def step(carry: _Carry, t: Array) -> tuple[_Carry, None]:
        (
            kind,
            branch,
            microbatch,
            repeat,
            input_slot,
            cotangent_slot,
            residual_slot,
            got_h,
            got_cot,
        ) = table[t, device]
        inputs = _write(carry.inputs, got_h, carry.received)
        cotangents = carry.cotangents
        if training:
            cotangents = _write(cotangents, got_cot, carry.received_cotangent)
        fresh = _take(microbatches, microbatch)
        waiting = _take(inputs, jnp.maximum(input_slot, 0))
        h = jax.tree.map(lambda f, s: jnp.where(input_slot < 0, f, s), fresh, waiting)
        loss_grads, loss, loss_cotangent = carry.loss_grads, carry.loss, None
        if training and loss_on_every_device:
            loss_cotangent, d_loss_params, part = loss_everywhere(cotangents, h, t)
            loss_grads, loss = _add(loss_grads, d_loss_params), loss + part
        work = _Work(
            h, microbatch, repeat, cotangents, cotangent_slot, carry.residuals, residual_slot,
            carry.grads, loss_grads, loss, loss_cotangent,
        )  # fmt: skip
        if training:
            done = _switch(branch, branches, work) if len(branches) > 1 else branches[0](work)
        is_forward = (kind == _program.FORWARD) | (kind == _program.FORWARD_LAST)
        if not training:
            out = forward_run(
                h, microbatch, repeat, is_forward.astype(jnp.int32) if skips_bubbles else None
            )
            done = nothing(work)._replace(sent_forward=out, output=out)
        keeps_cotangent = (kind == _program.FORWARD_LAST) | (kind == _program.BACKWARD_INPUT_LAST)
        spare_cotangent = program.num_cotangent_slots
        if training:
            cotangents = _write(
                cotangents, jnp.where(keeps_cotangent, cotangent_slot, spare_cotangent),
                done.kept_cotangent,
            )  # fmt: skip
        residuals = carry.residuals
        if store:
            spare = program.num_residual_slots
            residuals = _write(
                residuals, jnp.where(is_forward, residual_slot, spare), done.residuals
            )
        outputs, x_grads = carry.outputs, carry.x_grads
        if outputs is not None:
            row = jnp.where(kind == _program.FORWARD_LAST, microbatch, num_microbatches)
            outputs = _write(outputs, row, done.output)
        if x_grads is not None:
            takes_input = (kind >= _program.BACKWARD) & (kind != _program.BACKWARD_WEIGHT)
            row = jnp.where(
                takes_input & (device == 0) & (repeat == 0), microbatch, num_microbatches
            )
            x_grads = _write(x_grads, row, done.sent_back)
        forward_pattern, backward_pattern = sends[t]
        new = _Carry(
            send(done.sent_forward, forward_pattern, program.forward_pairs),
            send(done.sent_back, backward_pattern, program.backward_pairs) if training else None,
            inputs, cotangents, residuals, outputs,
            done.grads, done.loss_grads, done.loss, x_grads,
        )  # fmt: skip
        return new, None

    def buffer(tree: Any, rows: int) -> Any:
        return jax.tree.map(lambda z: jnp.zeros((rows, *z.shape), z.dtype), tree)

    init = _Carry(
        received=zero_h,
        received_cotangent=zero_cotangent if training else None,
        inputs=buffer(zero_h, program.num_input_slots + 1),
        cotangents=buffer(zero_cotangent, program.num_cotangent_slots + 1) if training else None,
        residuals=buffer(no_residuals, program.num_residual_slots + 1),
        outputs=None if training else buffer(zero_h, num_microbatches + 1),
        grads=_cast_tree(_zeros_like(params), _axes_tree(params)) if training else None,
        loss_grads=_cast_tree(_zeros_like(loss_params), _axes_tree(loss_params))
        if training
        else None,
        loss=_cast_varying(jnp.zeros((), scale.dtype), pipe) if training else None,
        x_grads=buffer(zero_cotangent, num_microbatches + 1) if return_all_grads else None,
    )
    carry, _ = _scan(step, init, _steps(len(program.kind)))
    return carry


def _integer_leaves(tree: Any) -> Any:
    return eqx.filter(tree, eqx.is_inexact_array, inverse=True)


def _write(buffer: Any, row: Any, value: Any) -> Any:
    """`buffer` with `value` in row `row` (traced)."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, row, 0), buffer, value)


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
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
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
    holds fewer activations. With one device and one microbatch there is no loop: the stage
    is called once on the batch.

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
    return _gpipe_forward(
        module, x, args, kwargs, num_microbatches=num_microbatches,
        model_axis_name=model_axis_name, broadcast_output=broadcast_output,
    )  # fmt: skip


def _gpipe_forward(
    module: Any,
    x: Any,
    args: tuple,
    kwargs: dict,
    *,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool,
    stage_policy: Callable | None = None,
    reduce_in_layers: bool = False,
) -> Any:
    """`execute_pipeline`; `stage_policy` is the `jax.checkpoint` policy of each stage call
    (`None`: the stage is called as it is, at every step); `reduce_in_layers`: see
    `_single_step`, which runs a pipeline of one stage and one microbatch."""
    caller = "execute_pipeline"
    num_microbatches = _check_microbatches(num_microbatches, caller)
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
    batch = _batch_size(x, "x", caller)
    if batch is None:
        raise ValueError(f"{caller}: `x` has no array leaves; pass the batch to pipeline.")
    _check_replicated(x, "x", model_axis_name, caller)
    if num_stages == 1 and num_microbatches == 1:
        out = _single_step(
            module, x, args, kwargs, batch=batch, axis_name=model_axis_name,
            stage_policy=stage_policy, reduce_in_layers=reduce_in_layers,
        )  # fmt: skip
        return _gather_output(out, model_axis_name, broadcast_output)
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
    program = _forward_program(num_stages, num_microbatches, 1)
    carry = _run_schedule(
        program, module, None, microbatches, None, arguments_at, axis_name=model_axis_name,
        stage_policy=stage_policy,
    )  # fmt: skip
    outputs = jax.tree.map(lambda o: o[:num_microbatches], carry.outputs)
    return _gather_output(_merge_microbatches(outputs), model_axis_name, broadcast_output)


def _single_step(
    stage: Any,
    x: Any,
    args: tuple,
    kwargs: dict,
    *,
    batch: int,
    axis_name: AxisName,
    stage_policy: Callable | None,
    reduce_in_layers: bool,
) -> Any:
    """A one-stage, one-microbatch pipeline: the stage called once on the whole batch.

    The parameters replicated over a data axis are cast to vary over it up front
    (`_vary_like_input`, as in the schedule loop), so that autodiff sums their gradients
    once, at the end; unless `reduce_in_layers` (the stage's `ScannedLayers` rematerialise
    each layer and cast that layer's parameters inside it, `_call_varying`): each layer's
    gradient is then summed inside the backward scan and the stacked gradients are written
    reduced, instead of held whole and unreduced until that one sum (as much memory again
    as the layers' parameters). Layers that keep everything for the backward pass keep the
    up-front cast: casting inside them would keep each layer's varying copy of its weights,
    which costs more than the unreduced gradients."""
    caller = "execute_pipeline"
    args, kwargs = _unwrap_microbatched(args, kwargs, batch, caller, axis_name)
    # One stage could change the shape, but then more stages could not: refuse it alike.
    _check_stage_keeps_shape(stage, x, args, kwargs, caller)
    if not reduce_in_layers:
        stage = _vary_like_input(stage, x, axis_name)
    call = _call_stage
    if stage_policy is not None:
        call = eqx.filter_checkpoint(_call_stage, policy=stage_policy)
    return call(stage, x, *args, **kwargs)


def _call_stage(stage: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    return stage(x, *args, **kwargs)


def _call_varying(stage: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """`stage(x, ...)` with the stage's parameters first cast to vary over every mesh axis
    `x` varies over: autodiff then sums each parameter's gradient over those axes once, at
    this call, however often the stage uses the parameter."""
    return _vary_like_input(stage, x, None)(x, *args, **kwargs)


@functools.lru_cache(maxsize=64)
def _forward_program(num_stages: int, num_microbatches: int, num_repeats: int):
    """The program of the GPipe (`num_repeats == 1`) or circular forward table."""
    schedule = CircularSchedule(num_stages, num_microbatches, num_repeats)
    return _program.compile_schedule(schedule, store_residuals=False)


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
    return _circular_forward(
        stages, x, args, kwargs, num_microbatches=num_microbatches,
        model_axis_name=model_axis_name, broadcast_output=broadcast_output,
    )  # fmt: skip


def _circular_forward(
    stages: Any,
    x: Any,
    args: tuple,
    kwargs: dict,
    *,
    num_microbatches: int,
    model_axis_name: AxisName,
    broadcast_output: bool,
    stage_policy: Callable | None = None,
) -> Any:
    """`execute_circular_pipeline`; `stage_policy` is the `jax.checkpoint` policy of each
    stage call (`None`: keep everything), which never keeps the stage's slice of the stacked
    weights."""
    caller = "execute_circular_pipeline"
    num_microbatches = _check_microbatches(num_microbatches, caller)
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
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

    program = _forward_program(num_stages, num_microbatches, num_repeats)
    carry = _run_schedule(
        program, stages, None, microbatches, None, arguments_at, axis_name=model_axis_name,
        stage_policy=stage_policy,
    )  # fmt: skip
    outputs = jax.tree.map(lambda o: o[:num_microbatches], carry.outputs)
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
      `return_all_grads=True`. It runs on the last stage's device, and cannot use
      collectives over `model_axis_name` there, unless some of its parameters are split over
      that axis (a vocabulary-parallel head, `eqpar.ColumnParallel(("model", axis))` with
      `eqpar.nn.vocab_parallel_cross_entropy`): it then runs on every device of the axis on
      the last stage's output, and each device gets the gradient of its own part.
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
    schedule = OneFOneBSchedule(
        axis_size(model_axis_name, caller, argument="model_axis_name"), num_microbatches
    )
    options = dict(return_all_grads=return_all_grads, recompute=recompute)
    return _execute_schedule(
        caller, schedule, module, loss_fn, x, targets, args, kwargs, model_axis_name, **options
    )


def execute_schedule(
    schedule: PipelineSchedule,
    stages: Callable,
    loss_fn: Callable,
    x: PyTree[Array],
    targets: PyTree[Array],
    *args: Any,
    model_axis_name: AxisName,
    return_all_grads: bool = False,
    recompute: bool = False,
    **kwargs: Any,
) -> tuple[Float[Scalar, ""], Any]:
    """A pipelined training step in the order of any training `schedule` (inside
    `shard_map`): the mean loss over microbatches and its gradients.

    The schedule's table (`eqpar.schedule`) is the program: at every step each device runs
    the action its cell names: a stage's forward, its backward, or (zero-bubble schedules)
    the input half or the weight half of its backward, or nothing; stage inputs, cotangents
    and stored residuals wait in buffers sized to what the table keeps alive at once, and
    each step sends only what its actions made, to the devices that need it. One
    `lax.scan` runs the whole table, so a new schedule is a new table, not a new executor.
    `execute_1f1b` is this function with `OneFOneBSchedule`; `GPipeSchedule` and
    `CircularSchedule` with `include_backward=True`, and `ZeroBubbleH1Schedule`, run the
    same way.

    By default a forward keeps what its backward needs (the residuals of `jax.vjp`, without
    the parameters and the stage input, which are kept anyway), so no stage runs its
    forward twice; `recompute=True` keeps only the stage input and recomputes the forward
    in each backward action. The last stage's forward also keeps its output, from which its
    backward computes the loss (with `recompute=True` its forward waits for its backward).

    Each device runs the branch of its own action, so a stage's collectives over other mesh
    axes run inside branches that differ between devices: `psum`, all-gather and
    reduce-scatter (tensor parallelism: `TPDense`, plan-converted layers) give the right
    values there, `lax.ppermute` does not, and a stage that uses it (ring attention,
    `TPAsyncDense`) is refused with a `ValueError`. The forward executors (`execute_pipeline`,
    `execute_circular_pipeline`) run every stage on every device at every step and take it.

    **Arguments:**

    - `schedule`: a training schedule (`schedule.has_backward`) whose `num_devices` is the
      size of the pipeline axis; its `num_microbatches` must divide the batch.
    - `stages`: this device's stage, a callable pytree `stages(x, *args, **kwargs)` that
      returns the shapes and dtypes it takes; for a circular schedule of `V` stages per
      device, those `V` stages stacked on a leading axis, entry `i` being model stage
      `i * S + d` (as for `execute_circular_pipeline`). Gradients are taken with respect
      to its inexact array leaves.
    - `loss_fn`: `loss_fn(outputs, targets) -> scalar` for one microbatch, e.g. a mean over
      its rows; a callable pytree whose array leaves (say an output head) get gradients with
      `return_all_grads=True`. It runs on the last stage's device, and cannot use
      collectives over `model_axis_name` there, unless some of its parameters are split over
      that axis (a vocabulary-parallel head, `eqpar.ColumnParallel(("model", axis))` with
      `eqpar.nn.vocab_parallel_cross_entropy`): it then runs on every device of the axis on
      the last stage's output, and each device gets the gradient of its own part.
    - `x`: the batch entering the first stage, a pytree with a leading batch axis, the same
      on every device of the pipeline axis.
    - `targets`: the matching targets (a pytree with the same leading batch size, or `None`).
    - `*args`, `**kwargs`: passed to every stage call unchanged, except `Microbatched`
      values, which are split into microbatches with `x`. They get no gradients.
    - `model_axis_name`: the pipeline axis.
    - `return_all_grads`: also return the gradients of `loss_fn`'s array leaves and of `x`.
    - `recompute`: recompute each stage's forward in its backward actions instead of
      storing its residuals.

    **Returns:** `(loss, grads)` as for `execute_1f1b` (`grads` stacked like `stages` for a
    circular schedule); with `return_all_grads=True`, `(loss, (grads, loss_fn_grads,
    x_grads))`.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from eqpar.pipeline import execute_schedule
    from eqpar.schedule import ZeroBubbleH1Schedule

    class Stage(eqx.Module):
        linear: eqx.nn.Linear
        def __call__(self, h):
            return jnp.tanh(jax.vmap(self.linear)(h))

    mesh = Mesh(np.array(jax.devices()[:4]), ("pipe",))
    keys = jax.random.split(jax.random.key(0), 4)
    stages = eqx.filter_vmap(lambda k: Stage(eqx.nn.Linear(3, 3, key=k)))(keys)
    params, static = eqx.partition(stages, eqx.is_array)
    loss_fn = lambda y, t: jnp.mean((y - t) ** 2)
    schedule = ZeroBubbleH1Schedule(num_stages=4, num_microbatches=4)

    def step(params, x, t):
        stage = eqx.combine(jax.tree.map(lambda a: a[0], params), static)
        loss, grads = execute_schedule(schedule, stage, loss_fn, x, t, model_axis_name="pipe")
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

    assert jnp.allclose(loss, serial_loss(params), rtol=1e-5)
    expected = jax.grad(serial_loss)(params)
    assert jnp.allclose(grads.linear.weight, expected.linear.weight, rtol=1e-5, atol=1e-7)
    ```
    """
    options = dict(return_all_grads=return_all_grads, recompute=recompute)
    return _execute_schedule(
        "execute_schedule", schedule, stages, loss_fn, x, targets, args, kwargs, model_axis_name,
        **options,
    )  # fmt: skip


def _execute_schedule(
    caller: str,
    schedule: PipelineSchedule,
    stages: Any,
    loss_fn: Callable,
    x: Any,
    targets: Any,
    args: tuple,
    kwargs: dict,
    model_axis_name: AxisName,
    *,
    return_all_grads: bool,
    recompute: bool,
) -> tuple[Any, Any]:
    if not isinstance(schedule, PipelineSchedule) or not schedule.has_backward:
        raise TypeError(
            f"{caller}: `schedule` must be a training schedule from `eqpar.schedule` (with "
            f"backward actions), such as `OneFOneBSchedule(S, M)`, "
            f"`ZeroBubbleH1Schedule(S, M)` or `GPipeSchedule(S, M, include_backward=True)`; "
            f"got {schedule!r}. For a forward pass use `execute_pipeline`."
        )
    num_stages = axis_size(model_axis_name, caller, argument="model_axis_name")
    if schedule.num_devices != num_stages:
        raise ValueError(
            f"{caller}: the schedule is for {schedule.num_devices} devices but the pipeline "
            f"axis {model_axis_name!r} has {num_stages}. Build the schedule with "
            f"num_stages={num_stages}."
        )
    num_microbatches = schedule.num_microbatches
    num_repeats = schedule._num_trips()
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
    arguments_at = _microbatch_arguments(
        args,
        kwargs,
        num_microbatches=num_microbatches,
        batch=batch,
        axis_name=model_axis_name,
        caller=caller,
        cast=frozenset({model_axis_name}),
    )
    if num_repeats > 1 and _stack_size(stages, caller) != num_repeats:
        raise ValueError(
            f"{caller}: the schedule runs {num_repeats} stages per device, so `stages` must "
            f"stack that many on the leading axis of its array leaves; it stacks "
            f"{_stack_size(stages, caller)}."
        )
    replicated_axes = (
        _axes_tree(eqx.filter(stages, eqx.is_inexact_array)),
        _axes_tree(eqx.filter(loss_fn, eqx.is_inexact_array)),
    )
    stages = _vary_like_input(stages, x, model_axis_name)
    loss_fn = _vary_like_input(loss_fn, x, model_axis_name)
    # A loss function with parameters split over the pipeline axis (a vocabulary-parallel
    # head) runs on every device of it, outside the per-device branches, on the last
    # stage's output handed to every device (a `psum`); otherwise on the last stage's device
    # alone, where it cannot use that axis.
    loss_on_every_device = any(
        model_axis_name in axes for axes in jax.tree.leaves(replicated_axes[1])
    )
    first = _take(microbatches, 0)
    stage = stages if num_repeats == 1 else _first_of_stack(stages)
    _check_stage_keeps_shape(stage, first, *arguments_at(0), caller)

    def first_loss(h: Any, t: Any) -> Any:
        out = stage(h, *arguments_at(0)[0], **arguments_at(0)[1])
        if loss_on_every_device:  # as the run hands it over: the same on every device
            out = jax.tree.map(
                lambda a: lax.psum(a, model_axis_name) if eqx.is_inexact_array(a) else a, out
            )
        return loss_fn(out, t)

    loss_shape = jax.eval_shape(first_loss, first, _take(target_microbatches, 0))
    if not isinstance(loss_shape, jax.ShapeDtypeStruct) or loss_shape.shape != ():
        raise ValueError(
            f"{caller}: `loss_fn(outputs, targets)` must return one scalar per microbatch "
            f"(e.g. a mean over rows); it returned {_describe(loss_shape)}."
        )
    if not jnp.issubdtype(loss_shape.dtype, jnp.inexact):
        raise TypeError(
            f"{caller}: `loss_fn` must return a floating-point scalar, got {loss_shape.dtype.name}."
        )

    call_args, call_kwargs = arguments_at(0)
    if _uses_primitive(
        jax.make_jaxpr(lambda h: stage(h, *call_args, **call_kwargs))(first), "ppermute"
    ):
        # Each device runs the branch of its own action (`lax.switch` on a per-device index);
        # a `ppermute` inside such a branch, over any mesh axis, gives wrong values (seen on
        # CPU), where psum, all-gather and reduce-scatter give the right ones.
        raise ValueError(
            f"{caller}: the stage uses `lax.ppermute` (a ring collective: ring attention, "
            f"`TPAsyncDense`, `eqpar.collectives`), which cannot run inside the per-device "
            f"branches of a training schedule. Train through the forward pass instead "
            f"(`jax.grad` of `execute_pipeline` / `PipelineModule.__call__`, the GPipe or "
            f"circular schedule), or use a collective without `ppermute` in the stage "
            f"(`strategy='all_gather'` attention, `TPDense`)."
        )
    target = _take(target_microbatches, 0)
    loss_axes = _collective_axes(jax.make_jaxpr(lambda h, t: loss_fn(h, t))(first, target))
    if model_axis_name in loss_axes and not loss_on_every_device:
        raise ValueError(
            f"{caller}: `loss_fn` uses a collective over the pipeline axis "
            f"{model_axis_name!r}, but none of its parameters is split over that axis, so it "
            f"runs on the last stage's device alone, where such a collective cannot run. "
            f"Split its parameters over {model_axis_name!r} too (e.g. "
            f"`eqpar.ColumnParallel(('model', {model_axis_name!r}))` on the output head with "
            f"`eqpar.nn.vocab_parallel_cross_entropy`): it then runs on every device of the "
            f"axis; or remove the collective."
        )
    program = _program.compile_schedule(schedule, store_residuals=not recompute)
    carry = _run_schedule(
        program,
        stages,
        loss_fn,
        microbatches,
        target_microbatches,
        arguments_at,
        axis_name=model_axis_name,
        loss_dtype=loss_shape.dtype,
        return_all_grads=return_all_grads,
        loss_on_every_device=loss_on_every_device,
    )
    device = lax.axis_index(model_axis_name)
    is_first, is_last = device == 0, device == num_stages - 1
    # Parameters replicated over the batch's axes were cast to varying before the loop: sum
    # their gradients over those axes once, as autodiff through the replication would.
    grads = _sum_over_cast_axes(carry.grads, replicated_axes[0], x, model_axis_name)
    loss_grads = _sum_over_cast_axes(carry.loss_grads, replicated_axes[1], x, model_axis_name)
    loss = lax.psum(jnp.where(is_last, carry.loss, jnp.zeros_like(carry.loss)), model_axis_name)
    if not return_all_grads:
        return loss, grads
    if not loss_on_every_device:  # they are on the last stage's device: copy them to all
        loss_grads = jax.tree.map(
            lambda g: lax.psum(jnp.where(is_last, g, jnp.zeros_like(g)), model_axis_name),
            loss_grads,
        )
    x_grads = jax.tree.map(
        lambda g: lax.psum(jnp.where(is_first, g[:num_microbatches], 0), model_axis_name),
        carry.x_grads,
    )
    return loss, (grads, loss_grads, _merge_microbatches(x_grads))


def _equations(jaxpr: Any) -> Any:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in getattr(inner, "eqns", ()):
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, list | tuple) else (value,):
                if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                    yield from _equations(item)


def _uses_primitive(jaxpr: Any, name: str) -> bool:
    """Whether `name` is a primitive of `jaxpr` or of any jaxpr nested in its equations."""
    return any(eqn.primitive.name == name for eqn in _equations(jaxpr))


# Primitives that move data between the devices of the mesh axes they name.
_COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
    "reduce_scatter", "ppermute", "all_to_all",
})  # fmt: skip


def _collective_axes(jaxpr: Any) -> frozenset:
    """The mesh axes the collectives of `jaxpr` (nested jaxprs included) run over."""
    axes: set = set()
    for eqn in _equations(jaxpr):
        if eqn.primitive.name in _COLLECTIVES:
            named = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes.update(named if isinstance(named, tuple | list) else (named,))
    return frozenset(axes)


def _first_of_stack(stages: Any) -> Any:
    """Entry 0 of stages stacked on their array leaves' leading axis."""
    arrays, static = eqx.partition(stages, eqx.is_array)
    return eqx.combine(_take(arrays, 0), static)


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
    "execute_schedule",
]
