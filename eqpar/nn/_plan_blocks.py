"""The model's own blocks, changed by a plan without changing their code.

A plan entry on a block of the author's model (an `eqx.Module` with a `__call__`), or on a
list of them, says how the block runs: rematerialized (`Remat`), or with the sequence split
over a mesh axis on entry to the list and gathered on exit (`SplitSequence`); and how its
raw array leaves are laid out (`Sharded`: the block declares their specs). The block keeps
its fields (the same arrays) and its author's `__call__`; its class becomes a subclass of the
author's made for those options (one class per combination, cached), so `isinstance` holds
and `serial_block` gives the author's class back.
"""

import dataclasses
from collections.abc import Hashable
from typing import Any, NamedTuple

import equinox as eqx
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

from .._axes import bound_axis_size
from .._declare import declared_partition_specs
from ._twins import instance_with
from .attention_calls import rebound_call, refuse_unreached
from .heads import check_head_reshapes, head_splits, int_fields, localized
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

    @property
    def changes_call(self) -> bool:
        return (
            self.remat != "none"
            or self.split_on_entry is not None
            or (self.gather_on_exit is not None)
            or bool(self.local_fields)
            or bool(self.head_check)
            or bool(self.context)
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
        if options.split_on_entry is not None:
            if not args:
                raise TypeError(
                    f"{base.__name__}: the plan splits the sequence of this block's first "
                    f"positional argument, but it was called without one; pass the sequence "
                    f"`[seq, ...]` positionally."
                )
            args = (scatter_sequence(args[0], options.split_on_entry), *args[1:])
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
        with head_splits(self, options.local_fields):
            out = run(self, args, kwargs, call)
        if attention_calls is not None and not attention_calls:
            refuse_unreached(base.__name__, options.context[0])
        if options.gather_on_exit is not None:
            out = gather_sequence(out, options.gather_on_exit)
        return out

    __call__.__doc__ = base_call.__doc__
    return __call__


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
                        f"in_specs), or run the step under `jax.jit` without shard_map."
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
    time (`eqpar.nn.heads`). Equinox's and eqpar's own modules are left as they are: they
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
