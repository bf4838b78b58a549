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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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
from .._schedule_tables import check_stages_per_device
from .._tracing import under_vmap
from .._typing import AxisName
from .._vma import varying_axes
from ..pipeline._microbatch import Microbatched
from ..schedule import SCHEDULES
from ._accumulate import accumulated_value_and_grad, split_microbatches
from ._block_calls import (
    HELD,
    HIDDEN_VMAP,
    HIDDEN_VMAP_FIX,
    ArgumentLayout,
    BlockCall,
    Chain,
    by_block,
    call_block,
    flag,
    is_abstract,
    no_vmap_error,
    placed_for_pipe,
    refuse_state,
    run_pipeline,
    runnable_for,
    same_static,
    unwrap_microbatched,
    whole_batch,
)
from ._block_outputs import (
    BlockOutputs,
    aux_buffers,
    field_path_str,
    free_static_fields,
    get_at,
    outputs_of,
    program_of,
    same_program,
    split_output,
    with_values,
)
from ._own_region import (
    axis_names_of,
    batch_axes,
    call_in_own_region,
    manual_specs,
    region_mesh,
)
from ._plan_blocks import compiler_axes
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
        refuse_state(blocks)
        if is_abstract(blocks):
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
            jax.tree.map(lambda leaf: HELD if eqx.is_array(leaf) else leaf, block)
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

    def __iter__(self) -> Iterator["BlockCall"]:
        return (BlockCall(self, index) for index in range(self.num_layers))

    def __getitem__(self, index: int | slice) -> "BlockCall":
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
        return BlockCall(self, index % self.num_layers)

    def blocks(self) -> list[Any]:
        """The blocks as separate modules, in model order (the arrays indexed out of the
        stack; static fields that differ by block are each block's own values again)."""
        if is_abstract(self):
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
            args, kwargs = unwrap_microbatched((args, kwargs))
            return call_block(block, input_name, x, args, kwargs)

        return outputs_of(call, self._one_layer(), x, args, kwargs)

    def _check_program(self, index: int, chain: "Chain", args: tuple, kwargs: dict) -> None:
        """Refuse block `index` if a static field it holds apart from block 0 (its own value
        of a field that differs by block) changes what its call computes."""
        if not self.free_fields or index == 0 or self._replaying():
            return
        mine = [get_at(self.skeletons[index], path) for path in self.free_fields]
        theirs = [get_at(self.skeletons[0], path) for path in self.free_fields]
        if all(a is b or same_static(a, b) for a, b in zip(mine, theirs)):
            return
        name = chain.input_name

        def call(block: PyTree, x: PyTree, args: tuple, kwargs: dict) -> PyTree:
            args, kwargs = unwrap_microbatched((args, kwargs))
            return call_block(block, name, x, args, kwargs)

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
                if not same_static(a, b)
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
        # pipeline in a region of their own (`call_pipeline`); a training schedule's region
        # is opened by `eqpar.value_and_grad`, around the loss.
        if bound_axis_size(self.pipeline.axis_name) is None and (
            self.schedule in TRAINING_SCHEDULES or not placed_for_pipe(self.pipeline)
        ):
            stack = self.pipeline.to_layers()  # one device: the blocks in order
            aux_blocks: list = []
            for index, (args, kwargs) in enumerate(calls):
                block = map_arrays(lambda a, i=index: a[i], stack)
                # A `Microbatched` argument is passed whole, as the pipeline's serial twin does.
                args, kwargs = unwrap_microbatched((args, kwargs))
                out = call_block(block, input_name, x, args, kwargs)
                x, aux = split_output(how, x, out)
                aux_blocks.append(aux)
            return x, aux_blocks if how.has_aux else None
        layout, per_layer_values, shared_values = ArgumentLayout.of(calls, input_name)
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
                raise no_vmap_error()
            try:
                h, buffers = run_pipeline(
                    self.pipeline, layout, how, x, per_layer_values, shared_values, None,
                    num_layers=num_layers,
                )  # fmt: skip
            except (TypeError, ValueError) as error:
                if HIDDEN_VMAP not in str(error):
                    error.add_note(f"{_OWNER}: {HIDDEN_VMAP_FIX}")
                raise
            return h, by_block(how, buffers, num_layers, axis=1)
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
            x = whole_batch(x, x_batched, size)
            pipeline = eqx.combine(params, pipeline_static)
            batched = (per_layer_batched, shared_batched)
            out = run_pipeline(
                pipeline, layout, how, x, per_layer, shared, batched, num_layers=num_layers
            )
            return out, jax.tree.map(lambda _: True, out)

        h, buffers = pipelined(params, x, per_layer_values, shared_values)
        return h, by_block(how, buffers, num_layers, axis=0)


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
        self.layout: ArgumentLayout | None = None
        self.how = how or BlockOutputs()  # how the blocks' outputs are read
        self.per_example = False
        self.batched: tuple = ((), ())  # per entry of the per-layer and shared arguments
        self.values: tuple = ()  # captured: (x, per_layer, shared) for the whole microbatch

    def mark(
        self,
        blocks: PipelinedBlocks,
        layout: ArgumentLayout,
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
                raise no_vmap_error()
            flags = (
                tuple(False for _ in per_layer),
                tuple(isinstance(v, Microbatched) for v in shared),
            )
            h, buffers = self._at_batch_level(x, per_layer, shared, flags)
            return h, by_block(how, buffers, num_layers, axis=1)
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
            x = whole_batch(x, x_batched, size)
            flags = (
                tuple(flag(b) for b in per_layer_batched),
                tuple(flag(b) for b in shared_batched),
            )
            out = self._at_batch_level(x, per_layer, shared, flags)
            return out, jax.tree.map(lambda _: True, out)

        h, buffers = marked(x, per_layer, shared, output)
        return h, by_block(how, buffers, num_layers, axis=0)

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
    that neither the pipeline nor a converted layer works over (the data axes) and over the
    experts' axes."""
    owner = "value_and_grad"
    pipe = frozenset(axis_names_of(blocks.pipeline.axis_name))
    mesh = region_mesh(owner, model, blocks.pipeline.axis_name)
    compiler = compiler_axes(model)
    manual = frozenset(mesh.axis_names) - compiler
    data = batch_axes(mesh, manual, model, pipe)
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
    runnable, arguments = runnable_for(
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
    layers = stage_grads.stages.layers.block  # through `LayerCall`, back to the blocks
    pipeline = eqx.tree_at(lambda p: p.stages.layers, blocks.pipeline, layers, is_leaf=_is_none)
    pipeline = eqx.filter(pipeline, eqx.is_inexact_array)
    block_grads = eqx.tree_at(lambda b: b.pipeline, eqx.filter(blocks, eqx.is_inexact_array),
                              pipeline, is_leaf=_is_none)  # fmt: skip
    around = eqx.filter(grads, eqx.is_inexact_array)
    return eqx.tree_at(where, around, block_grads, is_leaf=_is_none)
