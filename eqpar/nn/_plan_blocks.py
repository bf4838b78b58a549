"""The model's own blocks, changed by a plan without changing their code.

A plan entry on a block of the author's model (an `eqx.Module` with a `__call__`), or on a
list of them, says how the block runs: rematerialized (`Remat`), or with the sequence split
over a mesh axis on entry to the list and gathered on exit (`SplitSequence`); and how its
raw array leaves are laid out (`Sharded`: the block declares their specs). The block keeps
its fields (the same arrays) and its author's `__call__`; its class becomes a subclass of the
author's made for those options (one class per combination, cached), so `isinstance` holds
and `serial_block` gives the author's class back.

The sequence split has two routes. Inside `shard_map` over its axis (the manual route) each
block runs on this device's tokens: the first block's input is scattered, the last block's
output gathered, and a block that returns `(x, aux...)` has its per-token auxiliary outputs
(a cache) gathered on exit too, so the author's loop collects the serial ones. Called
outside `shard_map`, a block whose converted layers work over the axis opens a region of
its own and runs the manual route inside (`_in_own_sequence_region`). Where the axis is
left to the compiler (the compiled route of raw arrays laid out by `Sharded`, under
`jax.jit`), the split is a layout: a sharding constraint on the sequence axis on entry and
on exit, which the compiler's partitioner honours (the numbers are the serial program's).
"""

import dataclasses
import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jax.custom_batching import custom_vmap
from jax.sharding import AxisType, PartitionSpec
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .._axes import bound_axis_size
from .._checks import per_token_sequence_fix
from .._declare import declared_partition_specs
from .._splits import Split, open_split, open_splits
from .._tracing import under_vmap
from .._vma import varies_over
from ._attention_calls import rebound_call, refuse_unreached
from ._heads import check_head_reshapes, head_splits, int_fields, localized
from ._own_region import (
    axis_names_of,
    call_in_own_region,
    manual_specs,
    modules_in,
    needs_own_region,
    placed_mesh,
    region_axes,
    region_mesh,
)
from ._twins import gather_replicated, instance_with
from .sequence import gather_sequence, scatter_sequence
from .stacks import REMAT_POLICIES

_OPTIONS = "__eqpar_block_options__"
_CLASSES: dict[tuple[type, "BlockOptions"], type] = {}


class BlockOptions(NamedTuple):
    """How a block runs: `remat` (a `REMAT_POLICIES` name), and the mesh axis the sequence
    is split over on entry (`split_on_entry`) and gathered from on exit (`gather_on_exit`)."""

    remat: str = "none"
    split_on_entry: Hashable | None = None
    gather_on_exit: Hashable | None = None
    specs: tuple[tuple[str, PartitionSpec], ...] = ()  # for its raw array leaves (`Sharded`)
    # Int fields seen divided by an axis's size inside a region manual over it
    # (`HeadParallel(fields=...)`), as `(field, axis)` pairs.
    local_fields: tuple[tuple[str, Hashable], ...] = ()
    # The axes of the column-parallel linears the block holds: its head reshapes are checked.
    head_check: tuple[Hashable, ...] = ()
    # `(axis, layout)`: the block's jax.nn.dot_product_attention runs as ring attention over
    # the axis where it is manual (`ContextParallel` keyed by a hand-written attention block).
    context: tuple = ()
    # The axis a list's sequence is split over: every block of it gathers the per-token
    # auxiliary outputs it returns beside the activation (`(x, cache)`) on exit.
    gather_aux: Hashable | None = None

    @property
    def changes_call(self) -> bool:
        return (
            self.remat != "none"
            or self.split_on_entry is not None
            or (self.gather_on_exit is not None)
            or bool(self.local_fields)
            or bool(self.head_check)
            or bool(self.context)
            or (self.gather_aux is not None)
        )


def block_options(block: object) -> BlockOptions | None:
    """The options a block was converted with, or `None` for a block as its author wrote it."""
    found = getattr(type(block), _OPTIONS, None)
    return None if found is None else found[1]


def _author_class(block: object) -> type:
    found = getattr(type(block), _OPTIONS, None)
    return type(block) if found is None else found[0]


def _block_class(base: type, options: BlockOptions) -> type:
    cached = _CLASSES.get((base, options))
    if cached is not None:
        return cached
    namespace: dict[str, Any] = {
        "__module__": base.__module__,
        "__reduce__": lambda self: _reduce_block(self, base, options),
        _OPTIONS: (base, options),
    }
    if options.changes_call or options.specs:
        namespace["__call__"] = _block_call(base, options)
    if options.specs:
        namespace["__partition_specs__"] = lambda self: _block_specs(self, base, options)
    cls = type(base.__name__, (base,), namespace)
    _CLASSES[(base, options)] = cls
    return cls


def _reduce_block(block: PyTree, base: type, options: BlockOptions) -> tuple:
    # The class has the author's name but is not the author's class: pickle rebuilds it.
    fields = {f.name: getattr(block, f.name) for f in dataclasses.fields(base)}
    return _restore_block, (base, options, fields)


def _block_specs(block: PyTree, base: type, options: BlockOptions) -> dict[str, PartitionSpec]:
    """What the block declares: what the modules inside it declare (the outermost declaring
    module speaks for those below it), and the specs the plan gave its raw arrays."""
    specs = author_declared_specs(block)
    if not hasattr(base, "__partition_specs__"):
        for field in dataclasses.fields(base):
            inner = declared_partition_specs(getattr(block, field.name))
            specs.update({f"{field.name}/{path}": spec for path, spec in inner.items()})
    specs.update(options.specs)
    return specs


def author_declared_specs(block: PyTree) -> dict[str, PartitionSpec]:
    """What the author's class of `block` declares itself (`__partition_specs__`), if
    anything; an author who declares speaks for the modules inside."""
    declare = getattr(_author_class(block), "__partition_specs__", None)
    return dict(declare(block)) if declare is not None else {}


def _block_call(base: type, options: BlockOptions) -> Any:
    base_call = base.__call__

    def run(block: PyTree, args: tuple, kwargs: dict, call: Any) -> PyTree:
        return call(block, *args, **kwargs)

    if options.remat != "none":
        run = eqx.filter_checkpoint(run, policy=REMAT_POLICIES[options.remat])

    def __call__(self: PyTree, *args: Any, **kwargs: Any) -> PyTree:
        _check_compiler_axes(base, options)
        owner = base.__name__
        if _needs_sequence_region(self, options):
            return _in_own_sequence_region(self, base, options, args, kwargs)
        if options.split_on_entry is not None:
            if not args:
                raise _no_sequence_error(owner)
            args = (_split(args[0], options.split_on_entry, owner, self), *args[1:])
        if options.local_fields:
            self = localized(self, base, options.local_fields)
        if options.head_check:
            local = tuple(name for name, _ in options.local_fields)
            check_head_reshapes(
                base, self, base_call, args, kwargs, axes=options.head_check, local_fields=local
            )
        call, attention_calls = base_call, None
        if options.context and bound_axis_size(options.context[0]) is not None:
            call, attention_calls = rebound_call(base.__name__, base_call, *options.context)
        axis = options.gather_aux or options.gather_on_exit
        manual = axis is not None and bound_axis_size(axis) is not None
        before = open_splits()
        try:
            with head_splits(self, options.local_fields):
                out = run(self, args, kwargs, call)
        except (TypeError, ValueError) as error:
            if manual and _per_token_columns_left_open(before, axis):
                error.add_note(f"{owner}: {per_token_sequence_fix(axis)}")
            raise
        if attention_calls is not None and not attention_calls:
            refuse_unreached(base.__name__, options.context[0])
        if manual and _per_token_columns_left_open(before, axis):
            raise ValueError(
                f"{owner}: a ColumnParallel(sequence_parallel=True) linear in this block has "
                f"no RowParallel(sequence_parallel=True) partner before the block returns. "
                f"{per_token_sequence_fix(axis)}"
            )
        if _is_tuple(out) and (options.gather_on_exit or options.gather_aux):
            first, aux = out[0], tuple(out[1:])
            if options.gather_on_exit is not None:
                first = _gather(first, options.gather_on_exit, owner, self)
            if options.gather_aux is not None and manual and args:
                aux = _gather_aux(aux, args[0], options.gather_aux, owner)
            return type(out)((first, *aux))
        if options.gather_on_exit is not None:
            out = _gather(out, options.gather_on_exit, owner, self)
        return out

    __call__.__doc__ = base_call.__doc__
    return __call__


def compiler_axes(tree: PyTree) -> frozenset:
    """The mesh axes that `Sharded` keys lay raw arrays of blocks in `tree` out over: the
    compiler's, never a region's."""
    found: set = set()
    for module in modules_in(tree):
        options = block_options(module)
        for _, spec in options.specs if options is not None else ():
            for entry in spec:
                if entry is not None and entry is not PartitionSpec.UNCONSTRAINED:
                    found.update(axis_names_of(entry))
    return frozenset(found)


def _no_sequence_error(owner: str) -> TypeError:
    """A block whose sequence the plan splits, called without a positional argument."""
    return TypeError(
        f"{owner}: the plan splits the sequence of this block's first positional argument, "
        f"but it was called without one; pass the sequence `[seq, ...]` positionally."
    )


def _sequence_axis(options: BlockOptions) -> Hashable | None:
    """The axis a `SplitSequence` list (or block) splits the sequence over, if any."""
    for axis in (options.split_on_entry, options.gather_on_exit, options.gather_aux):
        if axis is not None:
            return axis
    return None


def _needs_sequence_region(block: PyTree, options: BlockOptions) -> bool:
    """Whether a block of a `SplitSequence` list runs in a region of its own: called outside
    `shard_map` over the sequence axis while converted layers inside it work over that axis
    (`sequence_parallel=True` styles, context-parallel attention), which need the manual
    route's per-device tokens. Blocks of raw arrays stay on the compiled route."""
    axis = _sequence_axis(options)
    return (
        axis is not None
        and needs_own_region(axis)
        and set(axis_names_of(axis)) <= region_axes(block)
    )


def _in_own_sequence_region(
    block: PyTree, base: type, options: BlockOptions, args: tuple, kwargs: dict
) -> PyTree:
    """The block called outside `shard_map`, in a region of its own manual over the sequence
    axis, the axes of its converted layers and, under the author's per-example `jax.vmap`,
    the data axes (every other axis of the mesh), with the batch split over them: XLA does
    not split a batch over axes left to it inside a region whose tokens move between
    devices, and would gather it whole around every block. Inside, the block runs as on the
    manual route, on this device's tokens: the first block scatters the whole sequence, the
    last one gathers it, and between blocks the sequence crosses the regions' boundaries
    split over the axis (no communication; on an Explicit axis its type says so).
    Per-token auxiliary outputs (a cache) come back whole, as the block gathers them.

    The batch is seen through a `jax.custom_batching.custom_vmap` function, whose batching
    rule gets every example's values (as `PipelinedBlocks` gets them); without a `vmap`
    around the block (one example), the region leaves the data axes to the compiler."""
    owner = base.__name__
    axis = _sequence_axis(options)
    if not args:
        raise _no_sequence_error(owner)
    mesh = region_mesh(owner, block, axis)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    count = lambda names: math.prod(sizes[name] for name in names)
    n = count(axis_names_of(axis))
    x = args[0]
    if not eqx.is_array(x) or jax.numpy.ndim(x) == 0:
        raise TypeError(
            f"{owner}: SplitSequence({axis!r}) splits the first positional argument's first "
            f"axis, the sequence `[seq, ...]`, over {axis!r}; got "
            f"{type(x).__name__ if not eqx.is_array(x) else 'a scalar'}. Pass the sequence "
            f"as one array, first."
        )
    if jax.numpy.shape(x)[0] % n:
        raise ValueError(
            f"{owner}: SplitSequence({axis!r}) splits the first positional argument's first "
            f"axis (the sequence) over {axis!r} ({n} devices); got shape "
            f"{tuple(jax.numpy.shape(x))}. Pad the sequence to a multiple of {n} and mask the "
            f"padding."
        )
    layers = region_axes(block) | set(axis_names_of(axis))
    compiler = compiler_axes(block)
    data = tuple(n for n in mesh.axis_names if n not in layers and n not in compiler)
    output_kind: list = []

    def call(block: PyTree, x: Any, rest: tuple, kwargs: dict) -> tuple:
        if options.split_on_entry is None:
            # What the first block's scatter recorded: the split a dropout draws its block by.
            open_split(Split(axis, "sequence", 0, jax.numpy.shape(x)[0]))
        out = block(x, *rest, **kwargs)
        if _is_tuple(out):
            output_kind.append(type(out))
            return out[0], tuple(out[1:])
        output_kind.append(None)
        return out, ()

    sequence_in = None if options.split_on_entry is not None else axis
    sequence_out = None if options.gather_on_exit is not None else axis

    def region(dynamic: tuple, batch: tuple, batched: tuple | None) -> tuple:
        """The block in a region manual over its axes and `batch` (the data axes, `()` for
        one example); `batched` says which leaves of `(x, rest, kwargs)` carry the batch
        first (`None`: one example)."""
        block, x, rest, kwargs = eqx.combine(dynamic, static)
        axes = tuple(n for n in mesh.axis_names if n in layers or n in batch)
        rows = batch if batch else None
        in_axes = None if batched is None else jax.tree.map(lambda b: 0 if b else None, batched)

        def run(block: PyTree, *inputs: Any) -> tuple:
            if in_axes is None:
                return call(block, *inputs)
            # This device's examples, one at a time, as the author's vmap runs them.
            arrays, others = eqx.partition(inputs, eqx.is_array)
            one = lambda arrays: call(block, *eqx.combine(arrays, others))
            return jax.vmap(one, in_axes=(in_axes,))(arrays)

        if batched is None:
            arg_specs, out_specs = (P(sequence_in), P(), P()), (P(sequence_out), P())
        else:
            arg_specs = jax.tree.map(lambda b: P(rows) if b else P(), batched)
            arg_specs = (P(rows, sequence_in), *arg_specs[1:])
            out_specs = (P(rows, sequence_out), P(rows))
        return call_in_own_region(
            owner,
            axes,
            block,
            run,
            (x, rest, kwargs),
            arg_specs=arg_specs,
            out_specs=out_specs,
            specs=manual_specs(block, frozenset(axes)),
            arg_names=("the sequence", "arguments", "keyword arguments"),
        )

    dynamic, static = eqx.partition((block, x, args[1:], kwargs), eqx.is_array)
    if not under_vmap(dynamic[1:]):
        first, aux = region(dynamic, (), None)
    else:

        @custom_vmap
        def per_example(dynamic: tuple) -> tuple:
            return region(dynamic, (), None)

        @per_example.def_vmap
        def whole_batch(size: int, in_batched: list, dynamic: tuple) -> tuple:
            block_batched, x_batched, rest_batched, kwargs_batched = in_batched[0]
            if any(jax.tree.leaves(block_batched)):
                raise ValueError(
                    f"{owner}: the block's parameters are batched by a `jax.vmap` around the "
                    f"model (a vmap over models); SplitSequence runs one model. vmap over "
                    f"the examples only."
                )
            block, x, rest, kwargs = dynamic
            if not x_batched:  # the same sequence for every example
                x = jax.numpy.broadcast_to(x, (size, *jax.numpy.shape(x)))
            # The data axes: the Auto ones, and the Explicit ones the batch's type splits
            # it over (the output's type keeps the input's); all, where the batch divides
            # over their devices, else those its type splits it over (which divide it).
            spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
            typed = set(axis_names_of(spec[0])) if spec and spec[0] is not None else set()
            batch = tuple(n for n in data if types[n] != AxisType.Explicit or n in typed)
            if size % count(batch):
                batch = tuple(n for n in batch if n in typed)
            batched = (True, rest_batched, kwargs_batched)
            out = region((block, x, rest, kwargs), batch, batched)
            return out, jax.tree.map(lambda _: True, out)

        first, aux = per_example(dynamic)
    kind = output_kind[-1]
    return first if kind is None else kind((first, *aux))


def _is_tuple(out: object) -> bool:
    return isinstance(out, tuple | list) and not hasattr(out, "_fields") and bool(out)


def _split(x: Any, axis: Hashable, owner: str, block: PyTree) -> Any:
    """This device's block of the sequence `x` (inside `shard_map` over `axis`), or `x` laid
    out split over `axis` for the compiler (where `axis` is left to it)."""
    if bound_axis_size(axis) is not None:
        return scatter_sequence(x, axis)
    return _lay_out(x, axis, owner, block, split=True)


def _gather(x: Any, axis: Hashable, owner: str, block: PyTree) -> Any:
    if bound_axis_size(axis) is not None:
        return gather_sequence(x, axis)
    return _lay_out(x, axis, owner, block, split=False)


def _lay_out(x: Any, axis: Hashable, owner: str, block: PyTree, *, split: bool) -> Any:
    """The compiled route: the sequence axis (`x`'s first) constrained to be split over `axis`
    (or whole), on the mesh in context or else the one the block's arrays are placed on (an
    Auto axis); the other axes as the compiler has them."""
    names = axis_names_of(axis)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(name not in mesh.axis_names for name in names):
        placed = placed_mesh(block, names)
        if placed is not None:
            with jax.sharding.use_abstract_mesh(getattr(placed, "abstract_mesh", placed)):
                return _lay_out(x, axis, owner, block, split=split)
        raise ValueError(
            f"{owner}: SplitSequence({axis!r}) runs outside `shard_map` over {axis!r}, so it "
            f"lays the sequence out over {axis!r} for the compiler (the compiled route, as "
            f"for raw arrays laid out by `Sharded`), which needs the mesh: place the model "
            f"on it (`eqpar.parallelize(model, plan, mesh=mesh)`), or run the step under "
            f"`jax.jit` inside `with jax.set_mesh(mesh):` (the mesh's `.jax_mesh` for an "
            f"`eqpar.DeviceMesh`). Blocks of eqpar's converted layers (ColumnParallel, "
            f"HeadParallel, ...) open a region of their own on the mesh they are placed on."
        )
    if jax.numpy.ndim(x) == 0:
        raise ValueError(f"{owner}: SplitSequence needs a sequence axis first; got a scalar.")
    types = {mesh.axis_types[mesh.axis_names.index(name)] for name in names}
    if AxisType.Explicit in types:
        raise ValueError(
            f"{owner}: SplitSequence({axis!r}) lays the sequence out over {axis!r} for the "
            f"compiler, but {axis!r} is an Explicit mesh axis, where every operation's output "
            f"sharding is typed and the block's own code (a matmul with weights split over "
            f"{axis!r}) would have to choose one. Make {axis!r} an Auto axis "
            f"(`eqpar.DeviceMesh`, or `jax.make_mesh(..., axis_types=...)` with "
            f"`AxisType.Auto` for it), where the compiler chooses."
        )
    first = axis if split else None
    rest = (PartitionSpec.UNCONSTRAINED,) * (jax.numpy.ndim(x) - 1)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(first, *rest))


def _gather_aux(aux: tuple, x: Any, axis: Hashable, owner: str) -> tuple:
    """The auxiliary outputs of a block that runs on this device's tokens, gathered into the
    whole sequence's (a cache, `[seq / n, ...]` per leaf, becomes `[seq, ...]`): per token
    is what eqpar can put back together; anything else is refused with the fix."""
    local = jax.numpy.shape(x)[0] if jax.numpy.ndim(x) else None
    flat, treedef = jax.tree_util.tree_flatten_with_path(aux)
    gathered = []
    for path, leaf in flat:
        where = f"out[{getattr(path[0], 'idx', 0) + 1}]{jax.tree_util.keystr(path[1:])}"
        if not eqx.is_array(leaf):
            gathered.append(leaf)
            continue
        if jax.numpy.ndim(leaf) == 0 or leaf.shape[0] != local or varies_over(leaf, axis) is False:
            raise ValueError(
                f"{owner}: under SplitSequence({axis!r}) the block runs on this device's "
                f"{local} tokens and returns `{where}` of shape {list(jax.numpy.shape(leaf))}"
                f"{'' if varies_over(leaf, axis) is not False else ', the same on every device'}"
                f", which is not per token (the block's tokens as its leading axis), so eqpar "
                f"cannot put the serial value together from the devices' pieces. Return it "
                f"per token (a cache, `[seq, ...]`), or compute it after the list of blocks."
            )
        gathered.append(gather_replicated(leaf, axis, 0))
    return jax.tree_util.tree_unflatten(treedef, gathered)


def _per_token_columns_left_open(before: tuple, axis: Hashable) -> bool:
    """Whether a sequence-parallel column linear called (per token) since `before` has not
    met its row-parallel partner."""
    return any(
        split.kind == "features_of_tokens" and split.axis_name == axis and split not in before
        for split in open_splits()
    )


def _check_compiler_axes(base: type, options: BlockOptions) -> None:
    """Refuse a block whose raw arrays `Sharded` keys lay out over an axis that is manual
    here (inside `shard_map` over it): the block would see its local piece of each array,
    and the author's code, written for whole arrays, would run on the wrong shapes."""
    for path, spec in options.specs:
        for entry in spec:
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if axis is not None and bound_axis_size(axis) is not None:
                    raise ValueError(
                        f"{base.__name__}: Sharded keys lay out `{path}` over {axis!r} for the "
                        f"compiler, but {axis!r} is a manual axis of the shard_map this block "
                        f"runs in, where it would see its local piece of the array. Leave "
                        f"{axis!r} to the compiler: `eqpar.shard_map(..., axis_names=...)` "
                        f"with the other axes only (the model's whole layout still serves as "
                        f"in_specs), or run the step under `jax.jit` without shard_map (where "
                        f"the plan splits the sequence, inside `with jax.set_mesh(mesh):`: "
                        f"SplitSequence then lays the sequence out for the compiler)."
                    )


def _restore_block(base: type, options: BlockOptions, fields: dict) -> PyTree:
    return instance_with(_block_class(base, options), fields)


def convert_block(block: PyTree, owner: str, **changes: Any) -> PyTree:
    """`block` with its options updated by `changes` (fields of `BlockOptions`): the same
    fields, in the subclass of the author's class made for those options (the author's class
    itself when every option is off)."""
    base = _author_class(block)
    options = (block_options(block) or BlockOptions())._replace(**changes)
    if not isinstance(block, eqx.Module) or (options.changes_call and not callable(block)):
        raise TypeError(
            f"{owner} applies to a block of the model (an eqx.Module with a __call__) or a "
            f"list of them; got {type(block).__name__}."
        )
    cls = base if options == BlockOptions() else _block_class(base, options)
    return instance_with(cls, {f.name: getattr(block, f.name) for f in dataclasses.fields(base)})


def serial_block(block: PyTree) -> PyTree:
    """The block in its author's class (the same fields)."""
    return convert_block(block, "serial_block", **BlockOptions()._asdict())


def mark_head_checks(model: PyTree) -> PyTree:
    """Every block of the author's that holds column-parallel linears (as fields, or in
    lists and dicts of them) and int fields, converted to check its head reshapes at trace
    time (`eqpar.nn._heads`). Equinox's and eqpar's own modules are left as they are: they
    read no head count from a field."""
    from .linear import ColumnParallelLinear

    def column_axes(node: PyTree) -> tuple:
        axes: dict = {}

        def visit(child: object) -> None:
            if isinstance(child, ColumnParallelLinear):
                axes[child.axis_name] = None
            elif isinstance(child, list | tuple | dict) and not isinstance(child, eqx.Module):
                for item in child.values() if isinstance(child, dict) else child:
                    visit(item)

        for field in dataclasses.fields(node):
            visit(getattr(node, field.name, None))
        return tuple(axes)

    def convert(node: PyTree) -> PyTree:
        if isinstance(node, eqx.Module) and callable(node):
            base = _author_class(node)
            own = base.__module__.split(".")[0] not in ("equinox", "eqpar")
            if own and int_fields(node):
                axes = column_axes(node)
                if axes:
                    node = convert_block(node, "parallelize", head_check=axes)
        return node

    def walk(node: PyTree) -> PyTree:
        if isinstance(node, ColumnParallelLinear):
            return node
        if isinstance(node, eqx.Module):
            rebuilt = instance_with(
                type(node),
                {f.name: walk(getattr(node, f.name)) for f in dataclasses.fields(node)},
            )
            return convert(rebuilt)
        if isinstance(node, list | tuple):
            items = [walk(item) for item in node]
            return type(node)(items) if not hasattr(node, "_fields") else type(node)(*items)
        if isinstance(node, dict):
            return type(node)({k: walk(v) for k, v in node.items()})
        return node

    return walk(model)
