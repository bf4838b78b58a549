"""How `PipelinedBlocks` records the author's calls of its blocks and runs them: the stand-ins
that the blocks' calls return, the per-layer arguments' layout, the stacked layer call that
picks each block's own arguments, and the pipeline's run, in a region of its own outside
`shard_map` (see `eqpar.nn.pipelined`). The `PipelinedBlocks` that a stand-in refers to is
typed `Any` here: importing its class would make an import cycle with `pipelined.py`."""

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._axes import bound_axis_size
from .._paths import path_to_str
from ..pipeline._microbatch import Microbatched
from ._block_outputs import (
    BlockOutputs,
    Later,
    aux_buffers,
    join_output,
    later_outputs,
    split_output,
    write_row,
)
from ._own_region import (
    axis_names_of,
    batch_axes,
    call_in_own_region,
    manual_specs,
    region_mesh,
)
from ._plan_blocks import compiler_axes
from .pipeline import PipelineModule
from .stacks import ScannedLayers

_OWNER = "PipelinedBlocks"


def unwrap_microbatched(tree: PyTree) -> PyTree:
    """`tree` with each `Microbatched` argument's whole value in its place."""
    is_microbatched = lambda node: isinstance(node, Microbatched)
    return jax.tree.map(
        lambda v: v.value if is_microbatched(v) else v, tree, is_leaf=is_microbatched
    )


def by_block(how: BlockOutputs, buffers: list, num_layers: int, *, axis: int) -> list | None:
    """Each block's auxiliary output leaves, read out of the rows (`axis`) of the buffers the
    pipeline filled."""
    if not how.has_aux:
        return None
    return [
        [jax.lax.index_in_dim(b, i, axis=axis, keepdims=False) for b in buffers]
        for i in range(num_layers)
    ]


def refuse_state(blocks: Sequence[Any]) -> None:
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


def is_abstract(tree: PyTree) -> bool:
    """Whether `tree` holds abstract arrays (`jax.ShapeDtypeStruct`, as
    `eqx.filter_eval_shape` gives)."""
    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tree))


class BlockCall:
    """Block `index` of a `PipelinedBlocks`: calling it records the call (and the last block's
    call runs them all); its attributes are the block's settings (static fields; its arrays
    are held stacked over the stages)."""

    def __init__(self, owner: Any, index: int):
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
            chain = Chain(x, input_name)
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


class Chain:
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


HELD = _Held()


class _Pending(_StandIn):
    """The output of a pipelined block before the last: only the next block can take it, as
    it is or added to the block's input (`x = x + block(x)`, a residual the pipeline then
    runs inside every stage). Its shape and dtype are known (every block keeps those of its
    input); its values are not."""

    def __init__(self, owner: Any, chain: Chain, index: int, given: Any, added: bool = False):
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


class ArgumentLayout(NamedTuple):
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
    ) -> tuple["ArgumentLayout", list, list]:
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
                if any(not same_static(values[0], v) for v in values[1:]):
                    index = next(i for i, v in enumerate(values) if not same_static(values[0], v))
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


def same_static(a: object, b: object) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # an object whose == is not a plain bool
        return False


def _argument_path(path: tuple) -> str:
    head, rest = path[0], path[1:]
    name = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    inner = path_to_str(rest)
    return f"`{name}{'/' + inner if inner else ''}`"


class LayerCall(eqx.Module):
    """One block as a stage layer: takes `(x, layer)` (the activation and the number of the
    block in the model, per example), gives the block's output and the next number. Where the
    blocks return auxiliary outputs, the carry holds a third item, their rows for every
    block (`[batch, blocks, ...]` per leaf), and each block writes its own row."""

    block: Any
    layout: ArgumentLayout = eqx.field(static=True)
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
            out = call_block(self.block, name, h, args, kwargs)
            h_out, aux = split_output(self.how, h, out)
        else:

            def one(h: PyTree, rows: list, shared_values: list) -> tuple[PyTree, list]:
                args, kwargs = arguments(rows, shared_values)
                return split_output(self.how, h, call_block(self.block, name, h, args, kwargs))

            assert per_layer_batched is not None and shared_batched is not None
            rows = [v[:, layer] if b else v[layer] for v, b in zip(per_layer, per_layer_batched)]
            row_axes = [0 if b else None for b in per_layer_batched]
            shared_axes = [0 if b else None for b in shared_batched]
            h_out, aux = jax.vmap(one, in_axes=(0, row_axes, shared_axes))(h, rows, shared)
        if len(carry) == 2:
            return h_out, number + 1
        return h_out, number + 1, write_row(list(carry[2]), aux, layer)


def call_block(block: Any, input_name: str | None, x: PyTree, args: tuple, kwargs: dict) -> Any:
    """`block(x, *args, **kwargs)`, the input passed as the author's code passed it."""
    if input_name is None:
        return block(x, *args, **kwargs)
    return block(*args, **{input_name: x}, **kwargs)


def run_pipeline(
    pipeline: PipelineModule,
    layout: ArgumentLayout,
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
    flags = tuple(tuple(flag(b) for b in group) for group in flags)
    per_example = batched is not None
    runnable, arguments = runnable_for(pipeline, layout, per_example, flags, per_layer, shared, how)
    number = jnp.zeros((size,), jnp.int32) if per_example else _batch_counter(x)
    if not how.has_aux:
        out, _ = call_pipeline(runnable, (x, number), arguments)
        return out, []
    buffers = aux_buffers(
        how, x, num_layers, per_example=per_example, recorded_rows=size,
        pipeline_axis=pipeline.axis_name,
    )  # fmt: skip
    out, _, buffers = call_pipeline(runnable, (x, number, buffers), arguments)
    return out, list(buffers)


def placed_for_pipe(pipeline: PipelineModule) -> bool:
    """Whether the stacked blocks are placed on a mesh with the pipe axis (else they run in
    order, as on one device: a parallelized model not placed)."""
    try:
        region_mesh(_OWNER, pipeline, pipeline.axis_name)
    except ValueError:
        return False
    return True


def call_pipeline(runnable: PipelineModule, carry: tuple, arguments: tuple) -> tuple:
    """`runnable(carry, *arguments)`: inside `shard_map` over the pipe axis as it is, and
    outside (the one-device step on a placed model) in a region of its own, so that the
    blocks run as the pipeline they are (each device its stage, activations sent between
    stages) rather than as stacked arrays the compiler would bring to every device for each
    block.

    The region is manual over the pipe axis, the axes the blocks' converted layers work over
    and the data axes (every other mesh axis but those `Sharded` keys leave to the
    compiler), over which, and over the experts' axes, the batch is split as the `shard_map`
    route splits it: the carry's
    leading axis and that of the block arguments with rows of their own (`Microbatched`);
    other arguments cross whole."""
    axis_name = runnable.axis_name
    if bound_axis_size(axis_name) is not None:
        return runnable(carry, *arguments)
    mesh = region_mesh(_OWNER, runnable, axis_name)
    manual = frozenset(mesh.axis_names) - compiler_axes(runnable)
    axes = tuple(n for n in mesh.axis_names if n in manual)
    data = batch_axes(mesh, manual, runnable, frozenset(axis_names_of(axis_name)))
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


def runnable_for(
    pipeline: PipelineModule,
    layout: ArgumentLayout,
    per_example: bool,
    flags: tuple,
    per_layer: list,
    shared: list,
    how: BlockOutputs,
) -> tuple[PipelineModule, tuple[list, list]]:
    """`pipeline` with each of its stacked blocks called through `LayerCall` (its own
    arguments picked out, per example or on the whole microbatch), and the two argument
    lists its stages take: the per-layer and the shared values, those flagged per example
    in `flags` wrapped in `Microbatched`."""
    stack = pipeline.stages
    assert isinstance(stack, ScannedLayers)
    layer = LayerCall(
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


def whole_batch(x: PyTree, batched: PyTree, size: int) -> PyTree:
    """`x` in a batching rule with its unbatched leaves broadcast over the batch of `size`."""
    return jax.tree.map(
        lambda leaf, b: leaf if b else jnp.broadcast_to(leaf, (size, *jnp.shape(leaf))), x, batched
    )


def _check_whole_arguments(
    layout: ArgumentLayout, per_layer: list, shared: list, size: int
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


HIDDEN_VMAP = "a `jax.vmap` that a `jax.jit` or `jax.checkpoint`"
HIDDEN_VMAP_FIX = (
    f"the blocks ran without a `jax.vmap` around them, so the first axis of block 0's input "
    f"is taken for the batch. If the model is called one example at a time under "
    f"{HIDDEN_VMAP} (or their Equinox filters) between the vmap and the blocks hides, put "
    f"the jit or checkpoint outside the vmap (or remat the blocks with `Pipeline(remat=...)`)."
)


def no_vmap_error() -> ValueError:
    """Blocks called on one example without a `jax.vmap` the pipeline can see."""
    return ValueError(
        f"{_OWNER}: the blocks were called without a `jax.vmap` around them, but "
        f"the pipeline expects the model to run one example per call under "
        f"`jax.vmap` (Pipeline(batch_axis=None)), which gives it the whole batch. "
        f"If the model takes the whole batch itself (its leading axis), pass "
        f"Pipeline(..., batch_axis=0). If it is called per example under "
        f"`lax.map` / `lax.scan`, or under {HIDDEN_VMAP} between the vmap and the "
        f"blocks hides, call it under `jax.vmap` directly (remat the blocks with "
        f"Pipeline(remat=...))."
    )


@_unbatched_counter.def_vmap
def _refuse_hidden_vmap(size: int, in_batched: list, leaf: jax.Array) -> Any:
    raise ValueError(
        f"{_OWNER}: the blocks were called under {HIDDEN_VMAP} inside it hid from them, so the "
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


def flag(batched: Any) -> bool:
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
