"""`PipelinedBlocks`: the model's own list of blocks, run as a pipeline while the author's
`__call__` runs as written.

The plan entry `Pipeline` replaces a list of blocks (say `model.layers`) with this module. It
holds the blocks stacked and cut into stages (a `PipelineModule` of `ScannedLayers`, sharded
over the pipeline axis) and still behaves as the list did where the author's code uses it:
`len`, iteration and indexing give one callable per block. Calling them in order, each on the
previous one's output, is recorded rather than run; the last call runs all of them at once as
a GPipe or circular pipeline and returns what the last block would have. Per-layer arguments
(a dropout key split per block) are stacked and each block gets its own; arguments every
block gets (an attention mask, positions) are passed once.

Why a record and not a trace of the whole program: the blocks' calls are the only part that
changes, and the author's code around them (embedding, head, the loss, a per-example
`jax.vmap`) runs as JAX would run it. Under `jax.vmap` the record sees one example; the run
is a `jax.custom_batching.custom_vmap` function, whose batching rule receives the whole batch
(every example's values, batch axis first), which is what the pipeline splits into
microbatches. A model that takes the whole batch (no `vmap`) says so with `batch_axis=0`: the
leading axis of the first block's input is then the batch. Differentiating the author's loss
differentiates the pipeline (the one gradient rule: the gradient of the global loss, nothing
divided by hand).
"""

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._axes import bound_axis_size
from .._checks import check_int
from .._paths import path_to_str
from .._schedule_tables import check_stages_per_device
from .._tracing import under_vmap
from .._typing import AxisName
from .._vma import varying_axes
from ..pipeline._microbatch import Microbatched
from ..schedule import SCHEDULES
from ._accumulate import accumulated_value_and_grad, split_microbatches
from ._block_outputs import (
    BlockOutputs,
    Later,
    aux_buffers,
    field_path_str,
    free_static_fields,
    get_at,
    join_output,
    later_outputs,
    outputs_of,
    program_of,
    same_program,
    split_output,
    with_values,
    write_row,
)
from ._own_region import (
    axis_names_of,
    call_in_own_region,
    manual_specs,
    modules_in,
    region_axes,
    region_mesh,
)
from ._plan_blocks import block_options
from ._reduction import reduction_of
from .pipeline import PipelineModule
from .stacks import RematPolicy, ScannedLayers, map_arrays, stack_layers, unstack_layers

_OWNER = "PipelinedBlocks"
# The loss runs inside the pipeline (V-shaped ones on device 0, the others on the last).
TRAINING_SCHEDULES = ("1f1b", "zb-h1", "zb-v", "dualpipe-v")
# The recorders of `eqpar.value_and_grad` calls being traced (innermost last).
_RECORDERS: list[Any] = []


class PipelinedBlocks(eqx.Module):
    """A list of blocks run as a pipeline over a mesh axis, while the model around it keeps
    its own `__call__` (the plan style `eqpar.Pipeline` builds it).

    The blocks are stacked in model order and cut into `num_stages * num_repeats` stages of
    equal depth (`pipeline`, a `PipelineModule` of `ScannedLayers`), sharded over
    `axis_name`. Where the author's code used the list it still works: `len(blocks)`,
    `for block in blocks`, `blocks[i]`, `zip(blocks, keys)`, and a block's settings
    (`blocks[i].some_static_field`; its arrays are held stacked). Call the blocks in order,
    each on the previous block's output (by position or by keyword), with any other
    arguments: the calls before the last return a placeholder (its `shape` and `dtype` are
    known, its values are not: use it only as the next block's input), and the last runs the
    pipeline. Inside `shard_map` over `axis_name` that is GPipe (`num_repeats == 1`) or the
    circular schedule, the batch cut into `num_microbatches`. Outside it, blocks placed on a
    mesh with `axis_name` open a region of their own (manual over the pipe axis, the axes
    their converted layers work over and the data axes, the batch split over these) and run
    the same pipeline, so the step written for one device runs unchanged; blocks not placed
    run one after another on one device (the serial twin).

    The model runs one example per call under `jax.vmap` (`batch_axis=None`, Equinox's
    way), and the pipeline gets the whole batch from the vmap; a model that takes the whole
    batch says `batch_axis=0`. Blocks called without a vmap under `batch_axis=None` (under
    `lax.map`, or a vmap a `jit` / `checkpoint` hides) are refused: the pipeline would take
    one example's first axis for the batch.

    A block may return `(x, aux...)` instead of `x` alone: a cache, an auxiliary loss,
    attention weights. The first item is what the next block takes; the auxiliary outputs
    travel through the pipeline with the activations (one row per block, per microbatch:
    their bytes join each hop between stages) and reach the loop as the serial loop receives
    them. Before the last block's call they are stand-ins the loop may collect
    (`caches.append(cache)`) and add up (`aux_loss = aux_loss + aux`); once it is called
    they are the values (per block, the batch whole), and behave and return as arrays. A
    block that takes the whole batch must return them per example (leading axis the batch).
    A residual written around the call, `x = x + block(x)` (or `h, aux = block(x); x = x +
    h`) for every block, runs inside each stage; the last block's output then becomes a value
    added to its input the same way. Blocks whose static fields differ in other than ints and
    bools (a per-instance `cache_key`) stack where every block's call traces to block 0's
    program (checked on the first run; refused, naming the field, where it does not).

    Arguments that every block receives as the same object are passed once (split into
    microbatches where they are per example: under the vmap, those it batches; with
    `batch_axis=0`, those wrapped in `eqpar.pipeline.Microbatched`, and a plain array as
    long as the batch is refused as ambiguous); arguments that differ by block (a key per
    block) are stacked, and each block gets its own. Non-array arguments (flags such as
    `enable_dropout`) must be equal for every block.

    Prefer `eqpar.parallelize(model, {"layers": eqpar.Pipeline(...)})` to building this by
    hand; `eqpar.unparallelize` gives the list back.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P

    class Block(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout
        def __call__(self, x, key):
            return self.dropout(jnp.tanh(self.linear(x)), key=key)

    class Model(eqx.Module):
        layers: list
        def __call__(self, x, key):  # one example; a key per block
            for layer, k in zip(self.layers, jax.random.split(key, len(self.layers))):
                x = layer(x, k)
            return x.sum()

    keys = jax.random.split(jax.random.key(0), 4)
    model = Model([Block(eqx.nn.Linear(3, 3, key=k), eqx.nn.Dropout(0.5)) for k in keys])
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2)}
    parallel = eqpar.parallelize(model, plan)
    mesh = eqpar.DeviceMesh((2,), ("pipe",), devices=jax.devices()[:2])
    loss = lambda m, x, k: jax.vmap(m)(x, k).mean()
    run = eqpar.shard_map(
        loss, mesh=mesh, in_specs=(eqpar.partition_specs(parallel), P(), P()), out_specs=P()
    )
    x, k = jnp.ones((4, 3)), jax.random.split(jax.random.key(1), 4)
    assert jnp.allclose(run(parallel, x, k), loss(model, x, k), rtol=1e-5)
    assert eqx.tree_equal(eqpar.unparallelize(parallel), model)
    ```
    """

    pipeline: PipelineModule
    num_layers: int = eqx.field(static=True)
    container: type = eqx.field(static=True)
    batch_axis: int | None = eqx.field(static=True)
    schedule: str = eqx.field(static=True)
    skeletons: tuple = eqx.field(static=True)  # each block with its arrays left out
    # Static fields that differ by block (not ints or bools): the stack holds block 0's
    # values, `skeletons` each block's own; the first run checks the programs are the same.
    free_fields: tuple = eqx.field(static=True, default=())

    def __init__(
        self,
        blocks: Sequence[Any],
        *,
        num_stages: int,
        num_microbatches: int,
        num_repeats: int = 1,
        axis_name: AxisName = "pipe",
        remat: RematPolicy | bool = "none",
        batch_axis: int | None = None,
        schedule: str | None = None,
    ):
        if isinstance(blocks, str | bytes) or not isinstance(blocks, Sequence) or not blocks:
            raise TypeError(
                f"{_OWNER}: `blocks` must be a non-empty list (or tuple) of the model's blocks, "
                f"got {type(blocks).__name__}{'' if blocks else ' (empty)'}."
            )
        for index, block in enumerate(blocks):
            if not callable(block):
                raise TypeError(
                    f"{_OWNER}: `blocks[{index}]` is a {type(block).__name__}, which cannot be "
                    f"called; a pipeline runs the blocks one after another."
                )
        _refuse_state(blocks)
        if _is_abstract(blocks):
            # An abstract model (`eqx.filter_eval_shape`, a restore target): built as the
            # concrete one would be, through `eval_shape`, so its arrays are ShapeDtypeStructs
            # of the stacked shapes.
            built = eqx.filter_eval_shape(
                lambda b: PipelinedBlocks(
                    b, num_stages=num_stages, num_microbatches=num_microbatches,
                    num_repeats=num_repeats, axis_name=axis_name, remat=remat,
                    batch_axis=batch_axis, schedule=schedule,
                ),
                blocks,
            )  # fmt: skip
            for field in dataclasses.fields(built):
                setattr(self, field.name, getattr(built, field.name))
            return
        if batch_axis not in (None, 0) or isinstance(batch_axis, bool):
            raise ValueError(
                f"{_OWNER}: `batch_axis` is None (the model runs one example per call under "
                f"`jax.vmap`, Equinox's way) or 0 (the model takes the whole batch, its leading "
                f"axis); got {batch_axis!r}."
            )
        self.num_layers = len(blocks)
        self.container = type(blocks)
        self.batch_axis = batch_axis
        expected = "gpipe" if num_repeats == 1 else "circular"
        if schedule not in (None, expected, *TRAINING_SCHEDULES):
            raise ValueError(
                f"{_OWNER}: `schedule` is {expected!r} (the default for num_repeats="
                f"{num_repeats}) or one of {TRAINING_SCHEDULES} (trained through "
                f"`eqpar.value_and_grad`); got {schedule!r}."
            )
        if schedule in TRAINING_SCHEDULES:
            check_stages_per_device(
                schedule,
                SCHEDULES[schedule].stages_per_device,
                num_repeats,
                _OWNER,
                argument="num_repeats",
            )
        self.schedule = schedule or expected
        self.skeletons = tuple(
            jax.tree.map(lambda leaf: _HELD if eqx.is_array(leaf) else leaf, block)
            for block in blocks
        )
        self.free_fields = free_static_fields(blocks)
        if self.free_fields:
            first = [get_at(blocks[0], path) for path in self.free_fields]
            blocks = [with_values(block, self.free_fields, first) for block in blocks]
        self.pipeline = PipelineModule.from_layers(
            stack_layers(list(blocks)),
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            num_repeats=num_repeats,
            axis_name=axis_name,
            remat=remat,
            broadcast_output=True,
        )

    # ----------------------------------------------------------------------------------
    # The list the author's code sees.

    def __len__(self) -> int:
        return self.num_layers

    def __iter__(self) -> Iterator["_BlockCall"]:
        return (_BlockCall(self, index) for index in range(self.num_layers))

    def __getitem__(self, index: int | slice) -> "_BlockCall":
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(
                f"{_OWNER}: index the pipelined blocks with one int (got "
                f"{type(index).__name__}): they run together, in order, so a slice or a "
                f"subset of them cannot be a pipeline. Call every block in order, or leave "
                f"the list out of the plan."
            )
        if not -self.num_layers <= index < self.num_layers:
            raise IndexError(
                f"{_OWNER}: index {index} is out of range for {self.num_layers} blocks."
            )
        return _BlockCall(self, index % self.num_layers)

    def blocks(self) -> list[Any]:
        """The blocks as separate modules, in model order (the arrays indexed out of the
        stack; static fields that differ by block are each block's own values again)."""
        if _is_abstract(self):
            return eqx.filter_eval_shape(lambda owner: owner.blocks(), self)
        blocks = unstack_layers(self.pipeline.to_layers())
        if not self.free_fields:
            return blocks
        return [
            with_values(block, self.free_fields, [get_at(skeleton, p) for p in self.free_fields])
            for block, skeleton in zip(blocks, self.skeletons, strict=True)
        ]

    def _one_layer(self) -> PyTree:
        """Block 0 as the stack holds it (its arrays indexed out), for tracing its call. An
        array whose type carries its split over the stages (an Explicit pipe axis) stands as
        its block's `jax.ShapeDtypeStruct` (the same mesh, the block's dimensions' split):
        indexing one stage's row out of it is a sharding type error, and only the type is
        traced."""
        dims = (1 if self.pipeline.num_repeats == 1 else 2) + 1
        stages = self.pipeline.stages
        assert isinstance(stages, ScannedLayers)

        def first(a: jax.Array) -> Any:
            sharding = getattr(jax.typeof(a), "sharding", None)
            spec = getattr(sharding, "spec", ())
            if sharding is not None and any(entry is not None for entry in spec[:dims]):
                block = sharding.update(spec=P(*spec[dims:]))
                return jax.ShapeDtypeStruct(a.shape[dims:], a.dtype, sharding=block)
            return a[(0,) * dims]

        return map_arrays(first, stages.layers)

    def _replaying(self) -> bool:
        """Whether `eqpar.value_and_grad` replays the loss with the blocks' output given (the
        blocks hold no arrays then; what their calls give was read when it captured them)."""
        recorder = _RECORDERS[-1] if _RECORDERS else None
        return (
            self.schedule in TRAINING_SCHEDULES
            and recorder is not None
            and recorder.mode == "inject"
        )

    def _outputs(
        self, x: PyTree, args: tuple, kwargs: dict, input_name: str | None
    ) -> BlockOutputs:
        """How the blocks' output is read (the activation alone, or with auxiliary outputs)."""
        if self._replaying():
            return _RECORDERS[-1].how._replace(residual=False)

        def call(block: PyTree, x: PyTree, args: tuple, kwargs: dict) -> PyTree:
            args, kwargs = _unwrap_microbatched((args, kwargs))
            return _call_block(block, input_name, x, args, kwargs)

        return outputs_of(call, self._one_layer(), x, args, kwargs)

    def _check_program(self, index: int, chain: "_Chain", args: tuple, kwargs: dict) -> None:
        """Refuse block `index` if a static field it holds apart from block 0 (its own value
        of a field that differs by block) changes what its call computes."""
        if not self.free_fields or index == 0 or self._replaying():
            return
        mine = [get_at(self.skeletons[index], path) for path in self.free_fields]
        theirs = [get_at(self.skeletons[0], path) for path in self.free_fields]
        if all(a is b or _same_static(a, b) for a, b in zip(mine, theirs)):
            return
        name = chain.input_name

        def call(block: PyTree, x: PyTree, args: tuple, kwargs: dict) -> PyTree:
            args, kwargs = _unwrap_microbatched((args, kwargs))
            return _call_block(block, name, x, args, kwargs)

        block = self._one_layer()
        if chain.program is None:
            chain.program = program_of(call, block, chain.start, args, kwargs)
        own = program_of(
            call, with_values(block, self.free_fields, mine), chain.start, args, kwargs
        )
        if not same_program(chain.program, own):
            differing = [
                f"`{field_path_str(path)}` ({a!r} vs {b!r})"
                for path, a, b in zip(self.free_fields, mine, theirs)
                if not _same_static(a, b)
            ]
            raise ValueError(
                f"{_OWNER}: block {index} differs from block 0 in the static field"
                f"{'s' if len(differing) > 1 else ''} {', '.join(differing)}, and its call "
                f"computes something else with it (the two trace to different programs), "
                f"while a pipeline runs one program for every block. Give every block the "
                f"same value, hold what differs as an array (or an int static field, which "
                f"is stacked as one), or leave this list out of the pipeline plan."
            )

    def serial(self) -> list | tuple:
        """The list (or tuple) of blocks this module replaced: the inverse of building it."""
        blocks = self.blocks()
        if hasattr(self.container, "_fields"):  # a NamedTuple takes its items one by one
            return self.container(*blocks)
        return self.container(blocks)

    # ----------------------------------------------------------------------------------
    # Running the recorded calls.

    def _run(
        self, x: PyTree, calls: list[tuple[tuple, dict]], input_name: str | None, how: BlockOutputs
    ) -> tuple[PyTree, list | None]:
        """The recorded calls run: `(the last block's activation, each block's auxiliary
        output leaves, or None where the blocks return none)`."""
        # Outside `shard_map` over the pipe axis, blocks placed on a mesh with it run as the
        # pipeline in a region of their own (`_call_pipeline`); a training schedule's region
        # is opened by `eqpar.value_and_grad`, around the loss.
        if bound_axis_size(self.pipeline.axis_name) is None and (
            self.schedule in TRAINING_SCHEDULES or not _placed_for_pipe(self.pipeline)
        ):
            stack = self.pipeline.to_layers()  # one device: the blocks in order
            aux_blocks: list = []
            for index, (args, kwargs) in enumerate(calls):
                block = map_arrays(lambda a, i=index: a[i], stack)
                # A `Microbatched` argument is passed whole, as the pipeline's serial twin does.
                args, kwargs = _unwrap_microbatched((args, kwargs))
                out = _call_block(block, input_name, x, args, kwargs)
                x, aux = split_output(how, x, out)
                aux_blocks.append(aux)
            return x, aux_blocks if how.has_aux else None
        layout, per_layer_values, shared_values = _ArgumentLayout.of(calls, input_name)
        if self.schedule in TRAINING_SCHEDULES:
            recorder = _RECORDERS[-1] if _RECORDERS else None
            if recorder is None:
                raise ValueError(
                    f"{_OWNER}: schedule={self.schedule!r} runs the loss inside the pipeline, "
                    f"so it computes the loss and the gradients itself: take them with "
                    f"`eqpar.value_and_grad(loss_fn)(model, *batch)` (inside `shard_map` or "
                    f"not) instead of differentiating the loss (or calling the model) directly."
                )
            return recorder.mark(self, layout, how, x, per_layer_values, shared_values)
        num_layers = self.num_layers
        if not under_vmap((x, per_layer_values, shared_values)):
            if self.batch_axis is None:
                raise _no_vmap_error()
            try:
                h, buffers = _run_pipeline(
                    self.pipeline, layout, how, x, per_layer_values, shared_values, None,
                    num_layers=num_layers,
                )  # fmt: skip
            except (TypeError, ValueError) as error:
                if _HIDDEN_VMAP not in str(error):
                    error.add_note(f"{_OWNER}: {_HIDDEN_VMAP_FIX}")
                raise
            return h, _by_block(how, buffers, num_layers, axis=1)
        params, pipeline_static = eqx.partition(self.pipeline, eqx.is_array)

        # Under `jax.vmap` the values here are one example's; the batching rule below gets
        # the whole batch. The function itself is only traced for its output's type (the
        # blocks keep the shape of their input; their auxiliary outputs, one row per block),
        # never run.
        @custom_vmap
        def pipelined(params: PyTree, x: PyTree, per_layer: list, shared: list) -> PyTree:
            rows = [jnp.zeros((num_layers, *s.shape), s.dtype) for s in how.aux_shapes]
            return x, rows if how.has_aux else []

        @pipelined.def_vmap
        def per_example(size: int, in_batched: list, params, x, per_layer, shared):
            params_batched, x_batched, per_layer_batched, shared_batched = in_batched
            if any(jax.tree.leaves(params_batched)):
                raise ValueError(
                    f"{_OWNER}: the blocks' parameters are batched by a `jax.vmap` around the "
                    f"model (a vmap over models); a pipeline runs one model. vmap over the "
                    f"examples only."
                )
            x = _whole_batch(x, x_batched, size)
            pipeline = eqx.combine(params, pipeline_static)
            batched = (per_layer_batched, shared_batched)
            out = _run_pipeline(
                pipeline, layout, how, x, per_layer, shared, batched, num_layers=num_layers
            )
            return out, jax.tree.map(lambda _: True, out)

        h, buffers = pipelined(params, x, per_layer_values, shared_values)
        return h, _by_block(how, buffers, num_layers, axis=0)


def _unwrap_microbatched(tree: PyTree) -> PyTree:
    """`tree` with each `Microbatched` argument's whole value in its place."""
    is_microbatched = lambda node: isinstance(node, Microbatched)
    return jax.tree.map(
        lambda v: v.value if is_microbatched(v) else v, tree, is_leaf=is_microbatched
    )


def _by_block(how: BlockOutputs, buffers: list, num_layers: int, *, axis: int) -> list | None:
    """Each block's auxiliary output leaves, read out of the rows (`axis`) of the buffers the
    pipeline filled."""
    if not how.has_aux:
        return None
    return [
        [jax.lax.index_in_dim(b, i, axis=axis, keepdims=False) for b in buffers]
        for i in range(num_layers)
    ]


def _refuse_state(blocks: Sequence[Any]) -> None:
    """Refuse blocks holding stateful layers (an `eqx.nn.StateIndex`: `BatchNorm`,
    `SpectralNorm`), naming the first and the routes that train them."""
    is_index = lambda node: isinstance(node, eqx.nn.StateIndex)
    found = [
        path
        for path, leaf in jax.tree_util.tree_flatten_with_path(list(blocks), is_leaf=is_index)[0]
        if is_index(leaf)
    ]
    if found:
        block, *inside = found[0][:-1]
        where = f"block {getattr(block, 'idx', block)}" + (
            f" at {path_to_str(tuple(inside))!r}" if inside else ""
        )
        raise ValueError(
            f"{_OWNER}: the blocks hold stateful layers (an eqx.nn.StateIndex in {where}: "
            f"an eqx.nn.BatchNorm, SpectralNorm or a layer of your own that keeps "
            f"an eqx.nn.State). A pipeline runs each block on one microbatch at a time, so a "
            f"block's batch statistics would be a microbatch's rather than the batch's, as on "
            f"one device, and its state would be updated once per microbatch. Pipelined blocks "
            f"must be stateless: keep the stateful layers outside the pipelined list (in the "
            f"model's stem or head, which run on the whole batch), or train this model without "
            f"a pipeline: DataParallel / FSDP, or `eqpar.shard_map` over data and model axes, "
            f"where eqx.nn.BatchNorm computes the whole batch's statistics."
        )


def _is_abstract(tree: PyTree) -> bool:
    """Whether `tree` holds abstract arrays (`jax.ShapeDtypeStruct`, as
    `eqx.filter_eval_shape` gives)."""
    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tree))


class _BlockCall:
    """Block `index` of a `PipelinedBlocks`: calling it records the call (and the last block's
    call runs them all); its attributes are the block's settings (static fields; its arrays
    are held stacked over the stages)."""

    def __init__(self, owner: PipelinedBlocks, index: int):
        self._owner = owner
        self._index = index

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._owner.skeletons[self._index], name)

    def __repr__(self) -> str:
        return f"<{_OWNER}: block {self._index} of {self._owner.num_layers}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner, index = self._owner, self._index
        args, kwargs, input_name, x = _take_input(owner.skeletons[index], args, kwargs)
        if index == 0:
            if isinstance(x, _Pending | _ResidualTail):
                raise ValueError(
                    f"{_OWNER}: block 0 was called on the output of the blocks' calls so far; "
                    f"the pipelined blocks run once per forward, in order, each on the "
                    f"previous block's output."
                )
            chain = _Chain(x, input_name)
            chain.how = owner._outputs(x, args, kwargs, input_name)
        else:
            if not isinstance(x, _Pending) or x.owner is not owner:
                raise ValueError(
                    f"{_OWNER}: block {index} was called on {type(x).__name__}, not on the "
                    f"output of block {index - 1}. Pipelined blocks run in order, each on the "
                    f"previous block's output (or on that added to the previous block's "
                    f"input, `x = x + block(x)`): call block 0 first and pass each output on "
                    f"(keep code that reads it for after the last block, or move it inside "
                    f"the block's `__call__`)."
                )
            chain = x.chain
            if len(chain.calls) != index or x.index != index - 1:
                raise ValueError(
                    f"{_OWNER}: block {index} was called after block {len(chain.calls) - 1}; "
                    f"call every block once, in order."
                )
            if input_name != chain.input_name:
                raise ValueError(
                    f"{_OWNER}: block {index} takes its input "
                    f"{_describe_input(input_name)} but block 0 took it "
                    f"{_describe_input(chain.input_name)}; call every block alike."
                )
            chain.added.append(x.added)
            if x.added != chain.added[0]:
                with_residual = [i for i, added in enumerate(chain.added) if added]
                without = [i for i, added in enumerate(chain.added) if not added]
                raise ValueError(
                    f"{_OWNER}: the loop adds the input of block(s) {with_residual} to their "
                    f"output (`x = x + block(x)`) but not that of block(s) {without}; a "
                    f"pipeline runs one program for every block. Write the loop alike for "
                    f"every block, or move the residual inside the block's `__call__`."
                )
        chain.calls.append((args, kwargs))
        owner._check_program(index, chain, args, kwargs)
        if index == owner.num_layers - 1:
            residual = bool(chain.added) and chain.added[0]
            how = chain.how._replace(residual=residual)
            h, aux_blocks = owner._run(chain.start, chain.calls, chain.input_name, how)
            aux_blocks = aux_blocks or [[]] * owner.num_layers
            for laters, values in zip(chain.laters, aux_blocks):
                for later, value in zip(laters, values, strict=True):
                    later.resolve(value)
            carried = _ResidualTail(h, x) if residual else h
            return join_output(how, carried, aux_blocks[-1])
        pending = _Pending(owner, chain, index, x)
        laters = later_outputs(chain.how, index)
        chain.laters.append(laters)
        return join_output(chain.how, pending, laters)


class _Chain:
    """One forward's record of the calls of the pipelined blocks: the first block's input, the
    calls so far, how the blocks' outputs are read, the auxiliary outputs handed out before the
    pipeline runs (resolved when it does), and whether the loop added each block's input to
    its output."""

    def __init__(self, start: PyTree, input_name: str | None):
        self.start, self.input_name = start, input_name
        self.calls: list[tuple[tuple, dict]] = []
        self.how = BlockOutputs()
        self.laters: list[list[Later]] = []
        self.added: list[bool] = []
        self.program: Any = None  # block 0's traced call, where static fields differ


def _take_input(skeleton: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, str | None, Any]:
    """The block's input (its first argument, by position or by name) apart from the rest:
    `(other args, other kwargs, its name if passed by keyword, the input)`."""
    if args:
        return args[1:], kwargs, None, args[0]
    try:
        parameters = list(inspect.signature(type(skeleton).__call__).parameters)
    except (TypeError, ValueError):  # no signature to read
        parameters = []
    name = parameters[1] if len(parameters) > 1 else None
    if name is None or name not in kwargs:
        raise TypeError(
            f"{_OWNER}: a block was called without its input; pass the previous block's "
            f"output first (by position, or by the name of the block's first parameter)."
        )
    rest = dict(kwargs)
    return (), rest, name, rest.pop(name)


def _describe_input(name: str | None) -> str:
    return "by position" if name is None else f"as the keyword {name!r}"


class _StandIn:
    """What the author's code gets in place of something the pipeline holds: any use of it
    as a value raises the subclass's `_message()`, naming why and the fix."""

    def _message(self) -> str:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._message())

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise TypeError(self._message())

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __matmul__ = __rmatmul__ = __truediv__ = __rtruediv__ = __pow__ = __neg__ = _refuse
    __getitem__ = __iter__ = __len__ = __bool__ = __float__ = __int__ = __index__ = _refuse
    __array__ = _refuse


class _Held(_StandIn):
    """Where a block's array sits in `PipelinedBlocks.skeletons`: the arrays are held stacked
    over the pipeline's stages, so the author's code can read a block's settings but not its
    arrays (which the block's own `__call__` reads as usual)."""

    def __repr__(self) -> str:
        return f"<{_OWNER}: an array held stacked over the pipeline's stages>"

    def _message(self) -> str:
        return (
            f"{_OWNER}: a block's arrays are held stacked over the pipeline's stages, so code "
            f"outside the blocks can read the blocks' settings (static fields) but not their "
            f"arrays; read them inside the block's `__call__`, or `eqpar.unparallelize` the "
            f"model first."
        )


_HELD = _Held()


class _Pending(_StandIn):
    """The output of a pipelined block before the last: only the next block can take it, as
    it is or added to the block's input (`x = x + block(x)`, a residual the pipeline then
    runs inside every stage). Its shape and dtype are known (every block keeps those of its
    input); its values are not."""

    def __init__(
        self, owner: PipelinedBlocks, chain: _Chain, index: int, given: Any, added: bool = False
    ):
        self.owner, self.chain, self.index, self.given, self.added = (
            owner, chain, index, given, added,
        )  # fmt: skip

    @property
    def shape(self) -> Any:
        return jax.tree.map(jnp.shape, self.chain.start)

    @property
    def dtype(self) -> Any:
        return jax.tree.map(jnp.result_type, self.chain.start)

    @property
    def ndim(self) -> Any:
        return jax.tree.map(jnp.ndim, self.chain.start)

    def _plus_input(self) -> "_Pending":
        """This output added to its block's input: the residual around the call."""
        if self.added or not eqx.is_array(self.chain.start):
            self._refuse()
        return _Pending(self.owner, self.chain, self.index, self.given, added=True)

    def __add__(self, other: Any) -> Any:
        if other is self.given:  # block(x) + x
            return self._plus_input()
        if isinstance(other, _Pending) and other.given is self:  # x + block(x)
            return other._plus_input()
        if isinstance(other, _ResidualTail) and other.given is self:  # x + last_block(x)
            return other.value
        return self._refuse()

    def __radd__(self, other: Any) -> Any:
        if other is self.given:  # x + block(x), x the first block's input
            return self._plus_input()
        return self._refuse()

    def _message(self) -> str:
        return (
            f"{_OWNER}: the output of block {self.index} of {self.owner.num_layers} was used "
            f"as a value; a pipeline computes every block's output at once, when the last "
            f"block is called. Pass each block's output straight to the next block (or add it "
            f"to the block's input, `x = x + block(x)`, alike for every block) and call every "
            f"block, then read the last one's output; move other code between the blocks "
            f"inside the block's `__call__` (or leave this list out of the pipeline plan)."
        )

    def __repr__(self) -> str:
        return (
            f"<{_OWNER}: the pending output of block {self.index} of "
            f"{self.owner.num_layers}; the blocks' outputs exist once every block is called, "
            f"in order, each directly on the previous one's output (not through a "
            f"`jax.vmap`, `jax.jit` or `jax.checkpoint` of the block itself)>"
        )


class _ResidualTail(_StandIn):
    """The last block's output where the loop adds each block's input to its output: the
    pipeline ran the residual inside every stage, so this only becomes a value added to the
    last block's input, as the loop did for the others (`x = x + block(x)`)."""

    def __init__(self, value: PyTree, given: _Pending):
        self.value, self.given = value, given

    @property
    def shape(self) -> Any:
        return jnp.shape(self.value)

    @property
    def dtype(self) -> Any:
        return jnp.result_type(self.value)

    def __add__(self, other: Any) -> Any:
        if other is self.given:
            return self.value
        return self._refuse()

    __radd__ = __add__

    def _message(self) -> str:
        return (
            f"{_OWNER}: the loop adds each block's input to its output (`x = x + block(x)`), "
            f"so the pipeline ran that residual inside every stage, the last block's too; its "
            f"output becomes a value only added to its input in the same way. Write the loop "
            f"alike for every block, or move the residual inside the block's `__call__`."
        )

    def __repr__(self) -> str:
        return (
            f"<{_OWNER}: the last block's output, which becomes a value only added to its "
            f"input (`x = x + block(x)`), as the loop did for the other blocks: the pipeline "
            f"ran that residual inside every stage>"
        )


class _ArgumentLayout(NamedTuple):
    """Where each leaf of the blocks' other arguments comes from.

    `treedef` is the arguments' pytree structure; `kinds[j]` says where leaf `j` comes from:
    `("layer", i)` for row `i` of the stacked per-layer arrays, `("shared", i)` for shared
    value `i` (an array, or a `Microbatched` one), `("static", i)` for `statics[i]`, a
    non-array leaf equal for every block. `paths[j]` names leaf `j` for messages;
    `input_name` is the keyword the blocks take their input by (`None`: by position)."""

    treedef: Any
    kinds: tuple
    statics: tuple
    paths: tuple
    input_name: str | None

    @classmethod
    def of(
        cls, calls: list[tuple[tuple, dict]], input_name: str | None
    ) -> tuple["_ArgumentLayout", list, list]:
        """The layout of the recorded calls, their stacked per-layer arrays and their shared
        values."""
        is_microbatched = lambda node: isinstance(node, Microbatched)
        flat = [
            jax.tree_util.tree_flatten_with_path(call, is_leaf=is_microbatched) for call in calls
        ]
        paths, treedef = [path for path, _ in flat[0][0]], flat[0][1]
        for index, (_, other) in enumerate(flat[1:], start=1):
            if other != treedef:
                raise ValueError(
                    f"{_OWNER}: block {index} was called with arguments of another structure "
                    f"than block 0 ({other} vs {treedef}); pipelined blocks share one call "
                    f"signature."
                )
        per_layer, shared, kinds, statics = [], [], [], []
        for j, path in enumerate(paths):
            values = [leaves[j][1] for leaves, _ in flat]
            where = _argument_path(path)
            if is_microbatched(values[0]):
                if any(v is not values[0] for v in values[1:]):
                    raise ValueError(
                        f"{_OWNER}: the `Microbatched` argument {where} differs by block; pass "
                        f"one per-example value that every block takes."
                    )
                kinds.append(("shared", len(shared)))
                shared.append(values[0])
            elif not eqx.is_array(values[0]):
                if any(not _same_static(values[0], v) for v in values[1:]):
                    index = next(i for i, v in enumerate(values) if not _same_static(values[0], v))
                    raise ValueError(
                        f"{_OWNER}: the non-array argument {where} is {values[index]!r} for "
                        f"block {index} but {values[0]!r} for block 0; a pipeline calls every "
                        f"block alike. Pass what differs by block as an array (a key, an index)."
                    )
                kinds.append(("static", len(statics)))
                statics.append(values[0])
            elif all(v is values[0] for v in values[1:]):
                kinds.append(("shared", len(shared)))
                shared.append(values[0])
            else:
                shapes = {(jnp.shape(v), jnp.result_type(v)) for v in values}
                if len(shapes) != 1:
                    raise ValueError(
                        f"{_OWNER}: the argument {where} differs by block in shape or dtype "
                        f"({sorted(map(str, shapes))}); arguments that differ by block are "
                        f"stacked, so they must agree in shape and dtype."
                    )
                kinds.append(("layer", len(per_layer)))
                per_layer.append(jnp.stack(values))
        where = tuple(_argument_path(path) for path in paths)
        layout = cls(treedef, tuple(kinds), tuple(statics), where, input_name)
        return layout, per_layer, shared


def _same_static(a: object, b: object) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # an object whose == is not a plain bool
        return False


def _argument_path(path: tuple) -> str:
    head, rest = path[0], path[1:]
    name = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    inner = path_to_str(rest)
    return f"`{name}{'/' + inner if inner else ''}`"


class _LayerCall(eqx.Module):
    """One block as a stage layer: takes `(x, layer)` (the activation and the number of the
    block in the model, per example), gives the block's output and the next number. Where the
    blocks return auxiliary outputs, the carry holds a third item, their rows for every
    block (`[batch, blocks, ...]` per leaf), and each block writes its own row."""

    block: Any
    layout: _ArgumentLayout = eqx.field(static=True)
    per_example: bool = eqx.field(static=True)
    batched: tuple | None = eqx.field(static=True)
    how: BlockOutputs = eqx.field(static=True, default=BlockOutputs())

    def __call__(self, carry: tuple, per_layer: list, shared: list) -> tuple:
        h, number = carry[0], carry[1]
        layer = number[0]
        per_layer_batched, shared_batched = self.batched or (None, None)

        def arguments(per_layer_rows: list, shared_values: list) -> tuple:
            leaves = []
            for kind, i in self.layout.kinds:
                if kind == "static":
                    leaves.append(self.layout.statics[i])
                elif kind == "shared":
                    leaves.append(shared_values[i])
                else:
                    leaves.append(per_layer_rows[i])
            return jax.tree.unflatten(self.layout.treedef, leaves)

        name = self.layout.input_name
        if not self.per_example:
            rows = [values[layer] for values in per_layer]
            args, kwargs = arguments(rows, shared)
            out = _call_block(self.block, name, h, args, kwargs)
            h_out, aux = split_output(self.how, h, out)
        else:

            def one(h: PyTree, rows: list, shared_values: list) -> tuple[PyTree, list]:
                args, kwargs = arguments(rows, shared_values)
                return split_output(self.how, h, _call_block(self.block, name, h, args, kwargs))

            assert per_layer_batched is not None and shared_batched is not None
            rows = [v[:, layer] if b else v[layer] for v, b in zip(per_layer, per_layer_batched)]
            row_axes = [0 if b else None for b in per_layer_batched]
            shared_axes = [0 if b else None for b in shared_batched]
            h_out, aux = jax.vmap(one, in_axes=(0, row_axes, shared_axes))(h, rows, shared)
        if len(carry) == 2:
            return h_out, number + 1
        return h_out, number + 1, write_row(list(carry[2]), aux, layer)


def _call_block(block: Any, input_name: str | None, x: PyTree, args: tuple, kwargs: dict) -> Any:
    """`block(x, *args, **kwargs)`, the input passed as the author's code passed it."""
    if input_name is None:
        return block(x, *args, **kwargs)
    return block(*args, **{input_name: x}, **kwargs)


def _run_pipeline(
    pipeline: PipelineModule,
    layout: _ArgumentLayout,
    how: BlockOutputs,
    x: PyTree,
    per_layer: list,
    shared: list,
    batched: tuple | None,
    *,
    num_layers: int,
) -> tuple[PyTree, list]:
    """The recorded calls as one pipeline run over the whole batch (inside `shard_map`):
    the last block's activation, and the rows of the blocks' auxiliary outputs
    (`[batch, blocks, ...]` per leaf; none where the blocks return none)."""
    sizes = {leaf.shape[0] for leaf in jax.tree.leaves(x) if jnp.ndim(leaf)}
    if len(sizes) != 1:
        raise ValueError(
            f"{_OWNER}: the first block's input must be a batch whose array leaves share one "
            f"leading (batch) size; found {sorted(sizes)}."
        )
    size = sizes.pop()
    microbatched = [i for i, value in enumerate(shared) if isinstance(value, Microbatched)]
    if batched is not None and microbatched:
        raise ValueError(
            f"{_OWNER}: a block argument is wrapped in `Microbatched` while the model runs one "
            f"example per call under `jax.vmap`, which already gives each example its rows; "
            f"pass the plain value."
        )
    if batched is None and pipeline.num_microbatches > 1:
        _check_whole_arguments(layout, per_layer, shared, size)
    flags = batched if batched is not None else ([False] * len(per_layer), [False] * len(shared))
    flags = tuple(tuple(_flag(b) for b in group) for group in flags)
    per_example = batched is not None
    runnable, arguments = _runnable(pipeline, layout, per_example, flags, per_layer, shared, how)
    number = jnp.zeros((size,), jnp.int32) if per_example else _batch_counter(x)
    if not how.has_aux:
        out, _ = _call_pipeline(runnable, (x, number), arguments)
        return out, []
    buffers = aux_buffers(
        how, x, num_layers, per_example=per_example, recorded_rows=size,
        pipeline_axis=pipeline.axis_name,
    )  # fmt: skip
    out, _, buffers = _call_pipeline(runnable, (x, number, buffers), arguments)
    return out, list(buffers)


def _placed_for_pipe(pipeline: PipelineModule) -> bool:
    """Whether the stacked blocks are placed on a mesh with the pipe axis (else they run in
    order, as on one device: a parallelized model not placed)."""
    try:
        region_mesh(_OWNER, pipeline, pipeline.axis_name)
    except ValueError:
        return False
    return True


def _call_pipeline(runnable: PipelineModule, carry: tuple, arguments: tuple) -> tuple:
    """`runnable(carry, *arguments)`: inside `shard_map` over the pipe axis as it is, and
    outside (the one-device step on a placed model) in a region of its own, so that the
    blocks run as the pipeline they are (each device its stage, activations sent between
    stages) rather than as stacked arrays the compiler would bring to every device for each
    block.

    The region is manual over the pipe axis, the axes the blocks' converted layers work over
    and the data axes (every other mesh axis but those `Sharded` keys leave to the
    compiler), over which the batch is split as the `shard_map` route splits it: the carry's
    leading axis and that of the block arguments with rows of their own (`Microbatched`);
    other arguments cross whole."""
    axis_name = runnable.axis_name
    if bound_axis_size(axis_name) is not None:
        return runnable(carry, *arguments)
    mesh = region_mesh(_OWNER, runnable, axis_name)
    manual = frozenset(mesh.axis_names) - _compiler_axes(runnable)
    axes = tuple(n for n in mesh.axis_names if n in manual)
    inner = frozenset(axis_names_of(axis_name)) | region_axes(runnable)
    data = tuple(n for n in axes if n not in inner)
    batch = P(data) if data else P()
    carry_specs = jax.tree.map(lambda leaf: batch if jnp.ndim(leaf) else P(), carry)
    is_microbatched = lambda node: isinstance(node, Microbatched)
    argument_specs = jax.tree.map(
        lambda node: batch if is_microbatched(node) else P(), arguments, is_leaf=is_microbatched
    )

    def run(runnable: PipelineModule, carry: tuple, arguments: tuple) -> tuple:
        return runnable(carry, *arguments)

    return call_in_own_region(
        _OWNER,
        axes,
        runnable,
        run,
        (carry, arguments),
        arg_specs=(carry_specs, argument_specs),
        out_specs=carry_specs,
        specs=manual_specs(runnable, frozenset(axes)),
        arg_names=("the first block's input", "the blocks' other arguments"),
    )


def _runnable(
    pipeline: PipelineModule,
    layout: _ArgumentLayout,
    per_example: bool,
    flags: tuple,
    per_layer: list,
    shared: list,
    how: BlockOutputs,
) -> tuple[PipelineModule, tuple[list, list]]:
    """`pipeline` with each of its stacked blocks called through `_LayerCall` (its own
    arguments picked out, per example or on the whole microbatch), and the two argument
    lists its stages take: the per-layer and the shared values, those flagged per example
    in `flags` wrapped in `Microbatched`."""
    stack = pipeline.stages
    assert isinstance(stack, ScannedLayers)
    layer = _LayerCall(
        stack.layers,
        layout=layout,
        per_example=per_example,
        batched=flags if per_example else None,
        how=how,
    )
    runnable = eqx.tree_at(lambda p: p.stages, pipeline, ScannedLayers(layer, remat=stack.remat))
    wrap = lambda values, flags: [
        Microbatched(v) if b and not isinstance(v, Microbatched) else v
        for v, b in zip(values, flags)
    ]
    return runnable, (wrap(per_layer, flags[0]), wrap(shared, flags[1]))


def _whole_batch(x: PyTree, batched: PyTree, size: int) -> PyTree:
    """`x` in a batching rule with its unbatched leaves broadcast over the batch of `size`."""
    return jax.tree.map(
        lambda leaf, b: leaf if b else jnp.broadcast_to(leaf, (size, *jnp.shape(leaf))), x, batched
    )


def _check_whole_arguments(
    layout: _ArgumentLayout, per_layer: list, shared: list, size: int
) -> None:
    """On a model that takes the whole batch, refuse a plain array argument whose leading size
    is the batch's: whether its rows go with the examples (a mask) or it is one value for all
    of them (positions, when as many as the examples) cannot be told, and each microbatch
    would get the whole array."""
    for (kind, i), where in zip(layout.kinds, layout.paths):
        if kind == "static":
            continue
        value = per_layer[i][0] if kind == "layer" else shared[i]
        if not isinstance(value, Microbatched) and jnp.ndim(value) and value.shape[0] == size:
            raise ValueError(
                f"{_OWNER}: the block argument {where} has leading size {size}, the size of "
                f"the batch the pipeline cuts into microbatches, so each microbatch would get "
                f"all of it. If its rows go with the examples (a padding mask), wrap it in "
                f"`eqpar.pipeline.Microbatched`; or run the model one example per call under "
                f"`jax.vmap` (Pipeline(batch_axis=None)), which splits what is per example "
                f"by itself."
            )


@custom_vmap
def _unbatched_counter(leaf: jax.Array) -> jax.Array:
    return jnp.zeros(jnp.shape(leaf)[:1], jnp.int32)


_HIDDEN_VMAP = "a `jax.vmap` that a `jax.jit` or `jax.checkpoint`"
_HIDDEN_VMAP_FIX = (
    f"the blocks ran without a `jax.vmap` around them, so the first axis of block 0's input "
    f"is taken for the batch. If the model is called one example at a time under "
    f"{_HIDDEN_VMAP} (or their Equinox filters) between the vmap and the blocks hides, put "
    f"the jit or checkpoint outside the vmap (or remat the blocks with `Pipeline(remat=...)`)."
)


def _no_vmap_error() -> ValueError:
    """Blocks called on one example without a `jax.vmap` the pipeline can see."""
    return ValueError(
        f"{_OWNER}: the blocks were called without a `jax.vmap` around them, but "
        f"the pipeline expects the model to run one example per call under "
        f"`jax.vmap` (Pipeline(batch_axis=None)), which gives it the whole batch. "
        f"If the model takes the whole batch itself (its leading axis), pass "
        f"Pipeline(..., batch_axis=0). If it is called per example under "
        f"`lax.map` / `lax.scan`, or under {_HIDDEN_VMAP} between the vmap and the "
        f"blocks hides, call it under `jax.vmap` directly (remat the blocks with "
        f"Pipeline(remat=...))."
    )


@_unbatched_counter.def_vmap
def _refuse_hidden_vmap(size: int, in_batched: list, leaf: jax.Array) -> Any:
    raise ValueError(
        f"{_OWNER}: the blocks were called under {_HIDDEN_VMAP} inside it hid from them, so the "
        f"pipeline took one example's first axis for the batch. Put the jit or checkpoint "
        f"outside the vmap (or remat the blocks with `Pipeline(remat=...)`)."
    )


def _batch_counter(x: PyTree) -> jax.Array:
    """The block number carried with each example, `[batch]` zeros, made by a function that
    refuses to be batched: were a `jax.vmap` around the model hidden from the recording (by a
    `jit` or `checkpoint` inside it), the pipeline would have split one example's first axis
    as if it were the batch, and this turns that into an error at trace time."""
    leaf = next(
        leaf
        for leaf in jax.tree.leaves(x)
        if jnp.ndim(leaf) and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    )
    return _unbatched_counter(jax.lax.stop_gradient(leaf))


def _flag(batched: Any) -> bool:
    leaves = jax.tree.leaves(batched)
    return bool(leaves and all(leaves))


# --------------------------------------------------------------------------------------
# Schedules that run the loss inside the pipeline (1F1B, ZB-H1), the model's `__call__` kept.
#
# The schedule needs the author's loss in two pieces: the code before the blocks (the
# embedding), which makes the blocks' input and arguments, and the code after them (the
# head and the loss), a function of the blocks' output. Both are the author's `loss_fn`,
# run on one microbatch with the pipelined blocks' call changed: to capture what it is given
# and stop there (before), or to return a given output (after; the code before the blocks
# then computes nothing that is used, and the compiler drops it).


class _Captured(Exception):
    """Stops `loss_fn` at the blocks' call once their input is captured."""


class _Recorder:
    """The pipelined blocks' call while `value_and_grad` runs `loss_fn`: `mode` is
    `"capture"` (keep the blocks' input, per-layer and shared arguments, and stop) or
    `"inject"` (return `output` as the blocks' output). It keeps the blocks, the layout of
    their arguments and which arguments are per example."""

    def __init__(self, mode: str, output: PyTree = None, how: BlockOutputs | None = None) -> None:
        self.mode, self.output = mode, output  # inject: (activation, aux rows)
        self.blocks: PipelinedBlocks | None = None
        self.layout: _ArgumentLayout | None = None
        self.how = how or BlockOutputs()  # how the blocks' outputs are read
        self.per_example = False
        self.batched: tuple = ((), ())  # per entry of the per-layer and shared arguments
        self.values: tuple = ()  # captured: (x, per_layer, shared) for the whole microbatch

    def mark(
        self,
        blocks: PipelinedBlocks,
        layout: _ArgumentLayout,
        how: BlockOutputs,
        x: PyTree,
        per_layer: list,
        shared: list,
    ) -> tuple[PyTree, list | None]:
        if self.blocks is not None:
            raise ValueError(
                f"{_OWNER}: a model trained with a schedule that runs the loss inside the "
                f"pipeline holds one pipelined list, called once per forward; it was called "
                f"again."
            )
        self.blocks, self.layout, self.how = blocks, layout, how
        num_layers = blocks.num_layers
        if not under_vmap((x, per_layer, shared)):
            if blocks.batch_axis is None:
                raise _no_vmap_error()
            flags = (
                tuple(False for _ in per_layer),
                tuple(isinstance(v, Microbatched) for v in shared),
            )
            h, buffers = self._at_batch_level(x, per_layer, shared, flags)
            return h, _by_block(how, buffers, num_layers, axis=1)
        self.per_example = True
        # The output to give is passed in (unbatched) so that the function's own output,
        # traced for its type only, is one example of it.
        output = (x, []) if self.mode == "capture" else self.output

        @custom_vmap
        def marked(x: PyTree, per_layer: list, shared: list, output: PyTree) -> PyTree:
            return jax.tree.map(lambda a: a[0], output) if self.mode == "inject" else (x, [])

        @marked.def_vmap
        def batch_level(size: int, in_batched: list, x, per_layer, shared, output):
            x_batched, per_layer_batched, shared_batched, _ = in_batched
            x = _whole_batch(x, x_batched, size)
            flags = (
                tuple(_flag(b) for b in per_layer_batched),
                tuple(_flag(b) for b in shared_batched),
            )
            out = self._at_batch_level(x, per_layer, shared, flags)
            return out, jax.tree.map(lambda _: True, out)

        h, buffers = marked(x, per_layer, shared, output)
        return h, _by_block(how, buffers, num_layers, axis=0)

    def _at_batch_level(
        self, x: PyTree, per_layer: list, shared: list, flags: tuple
    ) -> tuple[PyTree, list]:
        self.batched = flags
        if self.mode == "capture":
            self.values = (x, per_layer, shared)
            raise _Captured
        shapes = lambda tree: jax.tree.map(jnp.shape, tree)
        if shapes(self.output[0]) != shapes(x):
            raise AssertionError(f"{_OWNER}: the output {shapes(self.output[0])} for {shapes(x)}")
        return self.output


def _with_recorder(recorder: _Recorder, fn: Callable, *args: Any) -> Any:
    _RECORDERS.append(recorder)
    try:
        return fn(*args)
    finally:
        _RECORDERS.remove(recorder)


def _depends_on(
    jaxpr: Any, sources: set, targets: list, *, through_stop_gradient: bool = True
) -> list[bool]:
    """For each of `targets` (variables of `jaxpr`), whether it is computed from any of
    `sources` (nested jaxprs are taken whole: any input reaches every output); with
    `through_stop_gradient=False`, not through a `lax.stop_gradient`."""
    reached = set(sources)
    for eqn in jaxpr.eqns:
        if not through_stop_gradient and eqn.primitive.name == "stop_gradient":
            continue
        if any(not isinstance(v, Literal) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return [not isinstance(v, Literal) and v in reached for v in targets]


class _AfterBlocks(eqx.Module):
    """The author's loss on one microbatch with the blocks' output given: the code after the
    blocks (the head and the loss), as the schedule's loss `(blocks' output, microbatch) ->
    loss`. `arrays` are the model's arrays that code reads (they get gradients); the others
    (the pipelined blocks', and those only the code before the blocks reads, which runs here
    too but whose results go unused) are zeros of their shapes, made inside and dropped by
    the compiler, so the schedule keeps no gradient for them."""

    arrays: PyTree
    blocks: PipelinedBlocks  # without arrays: it records the calls and gives the output
    static: PyTree = eqx.field(static=True)
    where: Callable = eqx.field(static=True)
    loss_fn: Callable = eqx.field(static=True)
    batch_def: Any = eqx.field(static=True)
    unread: PyTree = eqx.field(static=True, default=None)  # shapes where `arrays` has None
    how: BlockOutputs = eqx.field(static=True, default=BlockOutputs())

    def __call__(self, out: tuple, batch: list) -> jax.Array:
        given = (out[0], list(out[2]) if len(out) > 2 else [])
        arrays = self.arrays
        if self.unread is not None:
            stand_ins = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.unread)
            arrays = eqx.combine(arrays, stand_ins)
        model = eqx.combine(arrays, self.static)
        model = eqx.tree_at(self.where, model, self.blocks, is_leaf=_is_none)
        batch = jax.tree.unflatten(self.batch_def, batch)
        return _with_recorder(_Recorder("inject", given, self.how), self.loss_fn, model, *batch)

    @classmethod
    def reading_only_what_it_needs(
        cls, arrays: PyTree, *rest: Any, out: tuple, batch: list, how: BlockOutputs
    ):
        """An `_AfterBlocks` whose `arrays` are those the code after the blocks reads (found
        by tracing it once on `out` and `batch`)."""
        whole = cls(arrays, *rest, how=how)
        leaves, treedef = jax.tree.flatten(arrays)
        jaxpr = jax.make_jaxpr(
            lambda leaves: eqx.tree_at(lambda a: a.arrays, whole,
                                       jax.tree.unflatten(treedef, leaves))(out, batch)
        )(leaves).jaxpr  # fmt: skip
        read = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, Literal)}
        read |= {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        used = [v in read for v in jaxpr.invars]
        kept = jax.tree.unflatten(treedef, [a if u else None for a, u in zip(leaves, used)])
        unread = jax.tree.unflatten(
            treedef,
            [None if u else jax.ShapeDtypeStruct(a.shape, a.dtype) for a, u in zip(leaves, used)],
        )
        return cls(kept, *rest, unread=unread, how=how)


def value_and_grad(
    loss_fn: Callable, *, has_aux: bool = False, reduction: str = "mean", microbatches: int = 1
) -> Callable:
    """`loss_fn`'s value and gradients with respect to the model, for every mode, by the one
    gradient rule: the loss of the whole batch and its gradients (inside `shard_map`).

    `loss_fn(model, *batch) -> scalar` is the author's loss on the rows it is given, a mean
    over them (`reduction="mean"`, the default) or a sum (`reduction="sum"`), the model
    called however the author calls it. Where the batch is split over mesh axes (`data`),
    the result is the loss of the whole batch and its gradients: the mean of the shards'
    losses (`reduction="mean"`, as differentiating `lax.pmean(loss_fn(...), axes)` gives) or
    their sum (`reduction="sum"`, `lax.psum`). Where the model holds blocks
    pipelined by a plan with `Pipeline(..., schedule="1f1b")` (or `"zb-h1"`, `"zb-v"`,
    `"dualpipe-v"`), the schedule runs
    the loss inside the pipeline: `loss_fn` is traced once, on one microbatch, and cut where
    the blocks are called; the code before them (the embedding) runs on every microbatch,
    the blocks as the schedule's stages, and the code after them (the head and the loss) as
    the schedule's loss on the last stage. The schedule takes the mean of the microbatches'
    losses, which is the batch's for a mean over examples; with `reduction="sum"` the result
    is multiplied by the number of microbatches (and of data shards), which is the batch's
    sum. The rule is checked at trace time: the code after the blocks is evaluated on
    stand-in values of one microbatch and of that microbatch given twice over, and a loss
    that doubles under `reduction="mean"` (a sum over examples, which would come out divided
    by the number of microbatches) or stays the same under `reduction="sum"` is refused with
    the fix (code that cannot run outside the program, such as a collective in the loss,
    is not checked). It also needs code before and after the blocks
    that treats examples independently (it runs on one microbatch at a time, so a statistic
    over the whole batch, such as a batch norm, becomes the microbatch's), randomness drawn
    from per-example keys in the batch (a key closed over in `loss_fn` would repeat on every
    microbatch), and blocks' arguments that neither depend on the parameters (the schedule
    gives them no gradients) nor, unless per example, on the batch; those two are checked.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *batch) -> scalar`; every leaf of `batch` has the batch
      as its leading axis.
    - `has_aux`: `loss_fn` returns `(loss, aux)`, as for `eqx.filter_value_and_grad`; `aux`
      comes back as `loss_fn` gives it (e.g. the updated `eqx.nn.State` of a model with
      `eqx.nn.BatchNorm`, whose statistics inside `eqpar.shard_map` are the whole batch's).
      Not with the schedules that run the loss inside the pipeline (refused).
    - `reduction`: how `loss_fn` reduces over the examples of its batch: `"mean"` (the
      default) or `"sum"`.
    - `microbatches`: gradient accumulation on any mesh: the rows of this device's batch
      are cut into this many equal microbatches, and one `lax.scan` adds up their
      gradients (in float32 at least) before the one reduction over the data axes, so the
      step holds one microbatch's activations and gradients and the gradient sum: the same
      loss and gradients as the whole batch, up to rounding. `aux` comes back stacked, one entry
      per microbatch. Not with the schedules that cut the batch themselves (refused: set
      their `Pipeline(microbatches=...)`).

    **Returns:** a function `(model, *batch) -> (loss, grads)`, `grads` shaped as
    `eqx.filter(model, eqx.is_inexact_array)`; with `has_aux`, `((loss, aux), grads)`.

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, eqpar
    from jax.sharding import PartitionSpec as P

    class Model(eqx.Module):
        embed: eqx.nn.Linear
        layers: list
        head: eqx.nn.Linear
        def __call__(self, x):  # one example
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    keys = jax.random.split(jax.random.key(0), 6)
    model = Model(eqx.nn.Linear(3, 4, key=keys[0]),
                  [eqx.nn.MLP(4, 4, 8, 1, key=k) for k in keys[1:5]],
                  eqx.nn.Linear(4, 1, key=keys[5]))
    loss = lambda m, x, y: jnp.mean((jax.vmap(m)(x)[:, 0] - y) ** 2)
    plan = {"layers": eqpar.Pipeline(stages=2, microbatches=2, schedule="1f1b")}
    parallel = eqpar.parallelize(model, plan)
    mesh = eqpar.DeviceMesh((2,), ("pipe",), devices=jax.devices()[:2])
    specs = eqpar.partition_specs(parallel)
    step = eqpar.shard_map(
        eqpar.value_and_grad(loss), mesh=mesh, in_specs=(specs, P(), P()),
        out_specs=(P(), eqpar.partition_specs(eqx.filter(parallel, eqx.is_inexact_array))),
    )
    x, y = jnp.ones((4, 3)), jnp.zeros(4)
    value, grads = step(parallel, x, y)
    serial_value, serial_grads = eqx.filter_value_and_grad(loss)(model, x, y)
    assert jnp.allclose(value, serial_value, rtol=1e-5)
    got = eqpar.unparallelize(grads).layers[2].layers[0].weight
    want = serial_grads.layers[2].layers[0].weight
    assert jnp.allclose(got, want, rtol=1e-4, atol=1e-7)
    ```
    """
    if not callable(loss_fn):
        raise TypeError(
            f"value_and_grad: `loss_fn` must be callable, got {type(loss_fn).__name__}."
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"value_and_grad: `reduction` is 'mean' (a loss that is a mean over the examples "
            f"of its batch, the default) or 'sum' (a sum over them); got {reduction!r}."
        )

    check_int(microbatches, name="microbatches", owner="value_and_grad", minimum=1)

    def run(model: PyTree, *batch: PyTree) -> tuple[Any, PyTree]:
        is_blocks = lambda node: isinstance(node, PipelinedBlocks)
        scheduled = [
            node
            for node in jax.tree.leaves(model, is_leaf=is_blocks)
            if is_blocks(node) and node.schedule in TRAINING_SCHEDULES
        ]
        if not scheduled and microbatches > 1:
            return accumulated_value_and_grad(
                loss_fn, model, batch, has_aux=has_aux, reduction=reduction,
                microbatches=microbatches,
            )  # fmt: skip
        if not scheduled:
            return _global_value_and_grad(loss_fn, model, batch, has_aux, reduction)
        if microbatches > 1:
            raise ValueError(
                f"value_and_grad: microbatches={microbatches} with blocks pipelined by "
                f"schedule={scheduled[0].schedule!r}, which cuts the batch into its own "
                f"microbatches: set them in the plan's `Pipeline(microbatches=...)` and leave "
                f"`microbatches` at 1."
            )
        if has_aux:
            raise ValueError(
                f"value_and_grad: has_aux=True with blocks pipelined by "
                f"schedule={scheduled[0].schedule!r}, which runs the loss on one microbatch at "
                f"a time inside the pipeline, so `loss_fn`'s other results (an eqx.nn.State, "
                f"batch statistics) would be a microbatch's, not the batch's. Use "
                f"schedule='gpipe' or 'circular' (differentiate the loss as on one device), or "
                f"return the loss alone."
            )
        if len(scheduled) > 1:
            raise ValueError(
                "value_and_grad: the model holds several lists pipelined with a schedule that "
                "runs the loss inside the pipeline; one such list per model."
            )
        blocks = scheduled[0]
        if bound_axis_size(blocks.pipeline.axis_name) is None:
            return _in_own_pipeline_region(loss_fn, model, batch, blocks, reduction)
        return _scheduled_value_and_grad(loss_fn, model, batch, blocks, reduction)

    return run


def _in_own_pipeline_region(
    loss_fn: Callable, model: PyTree, batch: tuple, blocks: PipelinedBlocks, reduction: str
) -> tuple:
    """The scheduled step called outside `shard_map` over the pipe axis (the one-device step
    on a placed model): inside a region of its own, as the documented recipe writes it by
    hand. It is manual over every mesh axis but those `Sharded` keys leave to the compiler
    (a collective the compiler would place inside the schedule's per-device branches could
    wait on a device in another branch); the batch's first dimension is split over the axes
    that neither the pipeline nor a converted layer works over (the data axes)."""
    owner = "value_and_grad"
    pipe = frozenset(axis_names_of(blocks.pipeline.axis_name))
    mesh = region_mesh(owner, model, blocks.pipeline.axis_name)
    compiler = _compiler_axes(model)
    manual = frozenset(mesh.axis_names) - compiler
    data = tuple(name for name in mesh.axis_names if name in manual - pipe - region_axes(model))
    specs = manual_specs(model, manual)
    batch_spec = P(data) if data else P()
    index = next(i for i, node in enumerate(jax.tree.leaves(model, is_leaf=_is_pipelined))
                 if node is blocks)  # fmt: skip

    def step(model: PyTree, *batch: PyTree) -> tuple:
        inner = [n for n in jax.tree.leaves(model, is_leaf=_is_pipelined)][index]
        return _scheduled_value_and_grad(loss_fn, model, batch, inner, reduction)

    return call_in_own_region(
        owner,
        tuple(name for name in mesh.axis_names if name in manual),
        model,
        step,
        batch,
        arg_specs=(batch_spec,) * len(batch),
        out_specs=(P(), specs),
        specs=specs,
        arg_names=tuple(f"batch[{i}]" for i in range(len(batch))),
    )


def _compiler_axes(tree: PyTree) -> frozenset:
    """The mesh axes that `Sharded` keys lay raw arrays of blocks in `tree` out over: the
    compiler's, never a region's."""
    found: set = set()
    for module in modules_in(tree):
        options = block_options(module)
        for _, spec in options.specs if options is not None else ():
            for entry in spec:
                if entry is not None and entry is not P.UNCONSTRAINED:
                    found.update(axis_names_of(entry))
    return frozenset(found)


def _is_pipelined(node: object) -> bool:
    return isinstance(node, PipelinedBlocks)


def _global_value_and_grad(
    loss_fn: Callable, model: PyTree, batch: tuple, has_aux: bool = False, reduction: str = "mean"
) -> tuple:
    def global_loss(model: PyTree) -> Any:
        out = loss_fn(model, *batch)
        loss, aux = out if has_aux else (out, None)
        axes = tuple(sorted(varying_axes(loss), key=str))
        if axes:
            loss = jax.lax.psum(loss, axes) if reduction == "sum" else jax.lax.pmean(loss, axes)
        return (loss, aux) if has_aux else loss

    return eqx.filter_value_and_grad(global_loss, has_aux=has_aux)(model)


def _scheduled_value_and_grad(
    loss_fn: Callable, model: PyTree, batch: tuple, blocks: PipelinedBlocks, reduction: str
) -> tuple:
    owner = "value_and_grad"
    num_microbatches = blocks.pipeline.num_microbatches
    batch_leaves, batch_def = jax.tree.flatten(batch)
    split, _, size = split_microbatches(batch, num_microbatches, owner, "num_microbatches")
    rows = size // num_microbatches
    # The model's arrays but the pipelined blocks' (the schedule runs those); the blocks
    # stay in the model without arrays, to record their calls.
    where = _where(model, blocks)
    arrays, static = eqx.partition(eqx.tree_at(where, model, None), eqx.is_array)
    hollow = eqx.filter(blocks, eqx.is_array, inverse=True)

    def before(arrays: PyTree, microbatch: list) -> tuple[tuple, _Recorder]:
        """The blocks' input and arguments on one microbatch: `loss_fn` up to their call
        (the blocks keep their arrays here, to read what their calls give)."""
        recorder = _Recorder("capture")
        whole = eqx.tree_at(where, eqx.combine(arrays, static), blocks, is_leaf=_is_none)
        try:
            _with_recorder(recorder, loss_fn, whole, *jax.tree.unflatten(batch_def, microbatch))
        except _Captured:
            return recorder.values, recorder
        raise ValueError(f"{owner}: `loss_fn` did not call the pipelined blocks.")

    # What the blocks are given, and which of it is per example (read off one microbatch).
    first_microbatch = [leaf[0] for leaf in split]
    _, first = before(arrays, first_microbatch)
    assert first.layout is not None
    _check_arguments(lambda a, mb: before(a, mb)[0], arrays, first_microbatch, first)
    made, before_vjp = jax.vjp(lambda a: jax.lax.map(lambda mb: before(a, mb)[0], split), arrays)
    x_made, per_layer_made, shared_made = made
    whole = lambda a: a.reshape(size, *a.shape[2:])
    per_layer_batched, shared_batched = first.batched
    x = jax.tree.map(whole, x_made)
    # Per example, or the same for every microbatch (checked): microbatch 0's.
    per_layer = [whole(a) if b else a[0] for a, b in zip(per_layer_made, per_layer_batched)]
    shared = [
        jax.tree.map(whole if b else (lambda a: a[0]), value)
        for value, b in zip(shared_made, shared_batched)
    ]

    how = first.how
    runnable, arguments = _runnable(
        blocks.pipeline, first.layout, first.per_example, first.batched, per_layer, shared, how
    )
    carry: tuple = (x, jnp.zeros((size,), jnp.int32))
    if how.has_aux:
        buffers = aux_buffers(
            how, x, blocks.num_layers, per_example=first.per_example, recorded_rows=rows,
            pipeline_axis=blocks.pipeline.axis_name,
        )  # fmt: skip
        carry = (*carry, buffers)
    out = jax.tree.map(lambda a: a[:rows], carry)
    head = _AfterBlocks.reading_only_what_it_needs(
        arrays, hollow, static, where, loss_fn, batch_def,
        out=out, batch=first_microbatch, how=how,
    )  # fmt: skip
    _check_reduction(head, out, first_microbatch, reduction, blocks)
    loss, (stage_grads, head_grads, x_grads) = runnable.value_and_grad(
        head,
        carry,
        list(batch_leaves),
        *arguments,
        schedule=blocks.schedule,
        return_all_grads=True,
    )
    x_leaves, x_def = jax.tree.flatten(x_made)
    x_cotangents = [
        g.reshape(a.shape) if eqx.is_inexact_array(a) and g is not None else _no_cotangent(a)
        for a, g in zip(x_leaves, _leaves_or_none(x_grads[0], len(x_leaves)))
    ]
    nothing = lambda tree: jax.tree.map(_no_cotangent, tree)
    cotangent = (jax.tree.unflatten(x_def, x_cotangents), nothing(per_layer_made),
                 nothing(shared_made))  # fmt: skip
    (before_grads,) = before_vjp(cotangent)
    grads = jax.tree.map(_add, before_grads, head_grads.arrays, is_leaf=_is_none)
    grads = _assemble(model, where, blocks, grads, stage_grads)
    if reduction == "sum":
        # The schedule's loss is the mean over the microbatches, and over the data shards
        # the loss differs by: the batch's sum is that many times as large.
        shard_axes = varying_axes(jax.eval_shape(head, out, first_microbatch))
        shard_axes &= frozenset().union(*map(varying_axes, batch_leaves))
        shard_axes -= {blocks.pipeline.axis_name}
        scale = num_microbatches * (
            jax.lax.axis_size(tuple(sorted(shard_axes, key=str))) if shard_axes else 1
        )
        loss = loss * scale
        grads = jax.tree.map(lambda g: g * scale if eqx.is_inexact_array(g) else g, grads)
    return loss, grads


def _check_reduction(
    head: "_AfterBlocks", out: tuple, microbatch: list, reduction: str, blocks: PipelinedBlocks
) -> None:
    """Refuse a loss that is not reduced over examples as `reduction` says (checked on
    stand-in values: `reduction_of`)."""
    found = reduction_of(
        lambda arrays, given: dataclasses.replace(head, arrays=arrays)(given[0], given[1]),
        head.arrays,
        (out, microbatch),
    )
    if found is None or found == reduction:
        return
    count = blocks.pipeline.num_microbatches
    schedule = f"schedule={blocks.schedule!r}"
    if found == "sum":
        raise ValueError(
            f"value_and_grad: `loss_fn` is a sum over the examples of its batch (given a "
            f"microbatch twice over, its loss doubles), but the {schedule} runs it on each of "
            f"the {count} microbatches and takes their mean, as for a mean over examples: the "
            f"loss and every gradient would come out divided by {count}. Pass "
            f'`eqpar.value_and_grad(loss_fn, reduction="sum")`, or return a mean over the '
            f"examples."
        )
    raise ValueError(
        f'value_and_grad: reduction="sum" was given, but `loss_fn` is a mean over the examples '
        f"of its batch (given a microbatch twice over, its loss stays the same): the loss and "
        f"every gradient would come out multiplied by {count}. Pass reduction='mean' (the "
        f"default), or return a sum over the examples."
    )


def _add(a: Any, b: Any) -> Any:
    """Two gradients of one leaf added (`None` or `float0` where there is none)."""
    if not eqx.is_inexact_array(a):
        return b
    return a if not eqx.is_inexact_array(b) else a + b


def _is_none(node: object) -> bool:
    return node is None


def _where(model: PyTree, blocks: PipelinedBlocks) -> Callable:
    """`where` for `eqx.tree_at`: the place of `blocks` in `model`."""
    is_blocks = lambda node: node is blocks
    path = next(
        path
        for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_blocks)[0]
        if is_blocks(node)
    )

    def where(tree: PyTree) -> Any:
        for key in path:
            if isinstance(key, jax.tree_util.GetAttrKey):
                tree = getattr(tree, key.name)
            elif isinstance(key, jax.tree_util.SequenceKey):
                tree = tree[key.idx]
            elif isinstance(key, jax.tree_util.DictKey):
                tree = tree[key.key]
            else:
                raise TypeError(f"value_and_grad: cannot follow {key!r} to the pipelined blocks.")
        return tree

    return where


def _leaves_or_none(tree: PyTree, count: int) -> list:
    """The leaves of a gradient tree with `None` kept where a leaf has no gradient."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda n: n is None)
    assert len(leaves) == count, (len(leaves), count)
    return leaves


def _no_cotangent(a: jax.Array) -> Any:
    """A zero cotangent for `a` (`float0` for integer, boolean and key arrays)."""
    if eqx.is_inexact_array(a):
        return jnp.zeros_like(a)
    return np.zeros(jnp.shape(a), dtype=jax.dtypes.float0)


def _check_arguments(
    before: Callable, arrays: PyTree, microbatch: list, recorder: _Recorder
) -> None:
    """Refuse what the schedule cannot carry: a floating-point argument of the blocks computed
    from the parameters (the schedule gives the blocks' extra arguments no gradients), and an
    argument that is not per example but computed from the batch (it could differ between
    microbatches, and the schedule passes one)."""
    array_leaves = jax.tree.leaves(arrays)
    closed = jax.make_jaxpr(lambda a, mb: before(a, mb)[1:])(arrays, microbatch)
    jaxpr = closed.jaxpr
    array_vars = jaxpr.invars[: len(array_leaves)]
    batch_vars = jaxpr.invars[len(array_leaves) :]
    trained = {v for v, a in zip(array_vars, array_leaves) if eqx.is_inexact_array(a)}
    outputs = list(jaxpr.outvars)
    from_parameters = _depends_on(jaxpr, trained, outputs, through_stop_gradient=False)
    from_batch = _depends_on(jaxpr, set(batch_vars), outputs)
    per_layer_batched, shared_batched = recorder.batched
    per_layer, shared = recorder.values[1], recorder.values[2]
    leaf_batched = [
        b
        for entries, flags in ((per_layer, per_layer_batched), (shared, shared_batched))
        for entry, b in zip(entries, flags)
        for _ in jax.tree.leaves(entry)
    ]
    for k, var in enumerate(outputs):
        where = f"argument leaf {k} of the pipelined blocks (beside their input)"
        aval: Any = var.aval
        if jnp.issubdtype(aval.dtype, jnp.inexact) and from_parameters[k]:
            raise ValueError(
                f"value_and_grad: {where} is computed from the model's parameters; a schedule "
                f"that runs the loss inside the pipeline gives the blocks' other arguments no "
                f"gradients. Compute it inside the blocks, or use schedule='gpipe'."
            )
        if from_batch[k] and not leaf_batched[k]:
            raise ValueError(
                f"value_and_grad: {where} is computed from the batch but is not per example, so "
                f"it could differ between microbatches while the schedule passes one. Make it "
                f"per example, or use schedule='gpipe'."
            )


def _assemble(
    model: PyTree, where: Callable, blocks: PipelinedBlocks, grads: PyTree, stage_grads: Any
) -> PyTree:
    """The gradients shaped as `eqx.filter(model, eqx.is_inexact_array)`: those of the code
    around the blocks, and the schedule's for the blocks' stacked layers."""
    layers = stage_grads.stages.layers.block  # through `_LayerCall`, back to the blocks
    pipeline = eqx.tree_at(lambda p: p.stages.layers, blocks.pipeline, layers, is_leaf=_is_none)
    pipeline = eqx.filter(pipeline, eqx.is_inexact_array)
    block_grads = eqx.tree_at(lambda b: b.pipeline, eqx.filter(blocks, eqx.is_inexact_array),
                              pipeline, is_leaf=_is_none)  # fmt: skip
    around = eqx.filter(grads, eqx.is_inexact_array)
    return eqx.tree_at(where, around, block_grads, is_leaf=_is_none)
