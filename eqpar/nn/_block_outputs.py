"""What a pipelined block gives besides the activation, and what its author's loop does around
the call: the machinery of `PipelinedBlocks` for blocks that return `(x, aux...)`, for a
residual written around the call, and for blocks whose static fields differ while their
computations do not.

- **Outputs.** A block returns its input's shape (one activation), or a tuple whose first
  item is the next block's input and whose other items are auxiliary outputs (a cache, an
  auxiliary loss, attention weights). `BlockOutputs` says which, read off the block's output
  type once (`outputs_of`); the pipeline carries the activation from stage to stage and the
  auxiliary outputs with it, one row per block, so they reach the last stage (and the loss a
  training schedule runs there) with the microbatch they belong to.
- **Later values.** The author's loop receives a block's auxiliary outputs when it calls the
  block, but the pipeline runs every block at once, at the last call. Until then each is a
  `Later`: it can be collected (appended to a list) and combined with plain arithmetic
  (`aux_loss += aux`); it becomes its value when the last block is called, after which it
  behaves as that array (NumPy functions, attributes, returned from the model as an array).
- **Free static fields.** Static fields that differ by block but that the block's
  computation never reads (`cache_key = str(id(self))`) do not prevent stacking: the stack
  keeps block 0's value, each block keeps its own outside the stack, and the first run checks
  that every block traces to the same program as block 0 (`same_program`), refusing with the
  field's path where it does not.
"""

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._paths import children, path_to_str
from .._vma import cast_varying, varying_axes

_OWNER = "PipelinedBlocks"


# --------------------------------------------------------------------------------------
# The block's output: one activation, or the activation and auxiliary outputs.


class BlockOutputs(NamedTuple):
    """How a block's output is read: `container` is `None` for one activation (the input's
    type), else the tuple or list type of `(activation, aux...)`; `aux_def` and `aux_shapes`
    are the structure and types of the auxiliary items (as the recorded call gave them: one
    example's under a per-example `jax.vmap`, the whole batch's otherwise); `residual` says
    that the author's loop adds each block's input to its output (`x = x + block(x)`)."""

    container: type | None = None
    aux_def: Any = None
    aux_shapes: tuple = ()
    residual: bool = False

    @property
    def has_aux(self) -> bool:
        return self.container is not None and bool(self.aux_shapes)


def _types(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.result_type(a)), tree)


def outputs_of(call: Callable, block: PyTree, x: PyTree, args: tuple, kwargs: dict) -> BlockOutputs:
    """The `BlockOutputs` of `call(block, x, args, kwargs)` (traced for its output type only).

    Refuses an output that is neither the input's type nor a tuple led by it."""
    out = eqx.filter_eval_shape(call, block, x, args, kwargs)
    if jax.tree.structure(out) == jax.tree.structure(x) and _types(out) == _types(x):
        return BlockOutputs()
    if isinstance(out, tuple | list) and not hasattr(out, "_fields") and out:
        first = out[0]
        if jax.tree.structure(first) == jax.tree.structure(x) and _types(first) == _types(x):
            aux = tuple(out[1:])
            leaves, aux_def = jax.tree.flatten(aux)
            for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
                if not isinstance(leaf, jax.ShapeDtypeStruct):
                    raise TypeError(
                        f"{_OWNER}: the blocks return {_describe(out)}; item "
                        f"{_aux_path(path)} is {type(leaf).__name__}, not an array. A "
                        f"pipeline carries arrays from stage to stage: return only arrays "
                        f"beside the activation."
                    )
            return BlockOutputs(type(out), aux_def, tuple(leaves))
    raise ValueError(
        f"{_OWNER}: a pipelined block must return what it takes ({_describe(x)}), the next "
        f"block's input, or a tuple whose first item is that and whose other items are "
        f"auxiliary outputs, `(x, cache)` or `(x, aux_loss)`; the blocks return "
        f"{_describe(out)}. Return the activation first (it is what the pipeline carries from "
        f"block to block)."
    )


def _describe(tree: PyTree) -> str:
    if isinstance(tree, jax.ShapeDtypeStruct) or eqx.is_array(tree):
        return f"{jnp.result_type(tree).name}{list(jnp.shape(tree))}"
    if isinstance(tree, tuple | list):
        inner = ", ".join(_describe(item) for item in tree)
        return f"({inner})" if isinstance(tree, tuple) else f"[{inner}]"
    return type(tree).__name__


def _aux_path(path: tuple) -> str:
    """`out[k]...` for a path into the auxiliary items `out[1:]`."""
    head, rest = path[0], path[1:]
    inner = path_to_str(rest)
    return f"`out[{getattr(head, 'idx', 0) + 1}]{'/' + inner if inner else ''}`"


def split_output(how: BlockOutputs, h: PyTree, out: PyTree) -> tuple[PyTree, list]:
    """`(next activation, aux leaves)` of one block's output `out` on input `h`."""
    if how.container is None:
        carried, aux = out, []
    else:
        carried, aux = out[0], jax.tree.leaves(tuple(out[1:]))
    if how.residual:
        carried = jax.tree.map(operator.add, h, carried)
    return carried, aux


def join_output(how: BlockOutputs, carried: Any, aux_leaves: Sequence) -> Any:
    """The block's output as the author's code receives it."""
    if how.container is None:
        return carried
    aux = jax.tree.unflatten(how.aux_def, list(aux_leaves))
    return how.container((carried, *aux))


def aux_buffers(
    how: BlockOutputs,
    x: PyTree,
    num_layers: int,
    *,
    per_example: bool,
    recorded_rows: int,
    pipeline_axis: Any,
) -> list:
    """Zeros for the auxiliary outputs of every block, `[batch, num_layers, ...]` per leaf,
    which the pipeline carries with the activation `x` (each block fills its row), typed as
    varying over the mesh axes `x` and the outputs vary over (but `pipeline_axis`, which the
    pipeline's own loop adds: its input is the same on every device of it). Outputs of a
    block that takes the whole batch (recorded on `recorded_rows` rows) must be per example
    (those rows as their leading axis), to be cut into microbatches and put back together."""
    leaves = [leaf for leaf in jax.tree.leaves(x) if jnp.ndim(leaf)]
    size = jnp.shape(leaves[0])[0]
    axes = frozenset().union(*(varying_axes(leaf) for leaf in leaves))
    pipe = frozenset(pipeline_axis if isinstance(pipeline_axis, tuple) else (pipeline_axis,))
    buffers = []
    for k, shape in enumerate(how.aux_shapes):
        row = shape.shape
        if not per_example:
            if not row or row[0] != recorded_rows:
                raise ValueError(
                    f"{_OWNER}: the blocks take the whole batch ({recorded_rows} rows) and "
                    f"return an auxiliary output (leaf {k} beside the activation) of shape "
                    f"{list(row)}, which has not the batch as its leading axis. The pipeline "
                    f"runs each block on microbatches, and can put per-example outputs back "
                    f"together but not a value over the whole batch (a mean, a sum): return "
                    f"it per example (one row per example) and reduce it after the loop, or "
                    f"run the model one example per call under `jax.vmap` "
                    f"(Pipeline(batch_axis=None))."
                )
            row = row[1:]
        zeros = jnp.zeros((size, num_layers, *row), shape.dtype)
        buffers.append(cast_varying(zeros, (axes | varying_axes(shape)) - pipe))
    return buffers


def write_row(buffers: list, aux: list, layer: jax.Array) -> list:
    """`buffers` with row `layer` (of axis 1) set to this block's auxiliary outputs.

    A select against the row number rather than an update at a traced index: a training
    schedule's backward replays the layer's pullback with cotangents typed as varying over
    more mesh axes than the forward's index was, which an update's transpose refuses."""
    rows = []
    for b, a in zip(buffers, aux, strict=True):
        here = jnp.arange(b.shape[1]) == layer
        here = here.reshape(1, b.shape[1], *([1] * (b.ndim - 2)))
        rows.append(jnp.where(here, jnp.expand_dims(a.astype(b.dtype), 1), b))
    return rows


# --------------------------------------------------------------------------------------
# Auxiliary outputs before the pipeline has run.


class Later:
    """An auxiliary output of a pipelined block, given to the author's loop when the block
    is called and computed when the last block is: it can be collected and combined with
    arithmetic until then (the results are `Later` too), and behaves as its array after."""

    __slots__ = ("_compute", "_operands", "_value", "_where", "dtype", "shape")

    def __init__(
        self,
        where: str,
        shape: tuple = (),
        dtype: Any = None,
        compute: Callable | None = None,
        operands: tuple = (),
    ):
        self._where, self.shape, self.dtype = where, shape, dtype
        self._compute, self._operands = compute, operands
        self._value: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def resolve(self, value: Any) -> None:
        self._value = value

    def value(self) -> Any:
        if self._value is None:
            if self._compute is None:
                raise _not_yet(self._where)
            operands = [o.value() if isinstance(o, Later) else o for o in self._operands]
            self._value = self._compute(*operands)
        return self._value

    def _ready(self) -> bool:
        if self._value is not None:
            return True
        return self._compute is not None and all(
            o._ready() for o in self._operands if isinstance(o, Later)
        )

    def _apply(self, compute: Callable, *operands: Any) -> Any:
        if all(o._ready() for o in operands if isinstance(o, Later)):
            return compute(*[o.value() if isinstance(o, Later) else o for o in operands])
        shapes = [jnp.shape(o) if not isinstance(o, Later) else o.shape for o in operands]
        dtypes = [jnp.result_type(o) if not isinstance(o, Later) else o.dtype for o in operands]
        try:
            abstract = jax.eval_shape(
                compute, *[jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]
            )
            shape, dtype = abstract.shape, abstract.dtype
        except Exception:  # the value tells, once it exists
            shape, dtype = (), None
        return Later(self._where, tuple(shape), dtype, compute, operands)

    @property
    def __jax_array__(self) -> Callable | None:  # type: ignore[override]
        # JAX reads this attribute with `getattr(x, "__jax_array__", None)`: `None` until the
        # value can be computed, so that `array + later` defers to `later.__radd__` (lazy)
        # instead of asking for the value.
        return self.value if self._ready() else None

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return np.asarray(self.value(), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.value(), name)

    def __getitem__(self, index: Any) -> Any:
        return self._apply(lambda a: a[index], self)

    def __repr__(self) -> str:
        state = "computed" if self._value is not None else "computed when the last block is called"
        return f"<{_OWNER}: {self._where}, {state}>"

    def __bool__(self) -> bool:
        return bool(self.value())

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a scalar")
        return self.shape[0]

    def __iter__(self) -> Any:
        return iter(self.value())


def _binary(op: Callable) -> tuple[Callable, Callable]:
    def forward(self: Later, other: Any) -> Any:
        return self._apply(op, self, other)

    def reverse(self: Later, other: Any) -> Any:
        return self._apply(lambda a, b: op(b, a), self, other)

    return forward, reverse


for _name, _op in [
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("floordiv", operator.floordiv),
    ("pow", operator.pow),
    ("matmul", operator.matmul),
    ("mod", operator.mod),
]:
    _forward, _reverse = _binary(_op)
    setattr(Later, f"__{_name}__", _forward)
    setattr(Later, f"__r{_name}__", _reverse)
for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs)]:
    setattr(Later, f"__{_name}__", lambda self, op=_op: self._apply(op, self))


def _not_yet(where: str) -> ValueError:
    return ValueError(
        f"{_OWNER}: {where} was used before the last block was called. The pipeline runs "
        f"every block at once, at the last block's call, so until then the auxiliary outputs "
        f"of the blocks can only be collected (appended to a list, added up with `+`); read "
        f"them after the loop over the blocks (or do that work inside the block)."
    )


def _flatten_later(later: Later) -> tuple[tuple, None]:
    return (later.value(),), None


def _unflatten_later(_: None, children: tuple) -> Any:
    # A `Later` flattens to its value, and a tree rebuilt from the leaves holds the value
    # itself: what the model returns through `jax.vmap` or `jax.jit` is an array.
    return children[0]


jax.tree_util.register_pytree_node(Later, _flatten_later, _unflatten_later)


def later_outputs(how: BlockOutputs, index: int) -> list[Later]:
    """`Later`s for block `index`'s auxiliary outputs (the leaves, in order)."""
    return [
        Later(f"the auxiliary output {k} of block {index}", tuple(s.shape), s.dtype)
        for k, s in enumerate(how.aux_shapes)
    ]


# --------------------------------------------------------------------------------------
# Static fields that differ by block while the computation does not read them.

FieldPath = tuple  # steps ("attr", name) through modules, ("item", key) through containers


def free_static_fields(blocks: Sequence[Any]) -> tuple[FieldPath, ...]:
    """The static fields (module fields marked `static=True`) whose values differ by block
    and which stacking cannot hold as arrays (anything but ints and bools)."""
    found: list[FieldPath] = []

    def walk(nodes: list, path: FieldPath) -> None:
        first = nodes[0]
        if any(type(node) is not type(first) for node in nodes):
            return
        if isinstance(first, eqx.Module):
            for field in dataclasses.fields(first):
                values = [getattr(node, field.name, None) for node in nodes]
                step = (*path, ("attr", field.name))
                if field.metadata.get("static", False):
                    kinds = {type(v) for v in values}
                    stackable = len(kinds) == 1 and kinds <= {int, bool}
                    if not stackable and any(not _same(values[0], v) for v in values[1:]):
                        found.append(step)
                else:
                    walk(values, step)
            return
        flats = [children(node) for node in nodes]
        if jax.tree_util.treedef_is_leaf(flats[0][1]) or any(f[1] != flats[0][1] for f in flats):
            return
        for i in range(len(flats[0][0])):
            walk([f[0][i][1] for f in flats], (*path, ("item", i)))

    walk(list(blocks), ())
    return tuple(found)


def _same(a: object, b: object) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:
        return False


def field_path_str(path: FieldPath) -> str:
    return "/".join(str(key) for _, key in path)


def get_at(tree: Any, path: FieldPath) -> Any:
    for kind, key in path:
        tree = getattr(tree, key) if kind == "attr" else children(tree)[0][key][1]
    return tree


def set_at(tree: Any, path: FieldPath, value: Any) -> Any:
    """`tree` with the field (or item) at `path` replaced by `value` (a new tree)."""
    if not path:
        return value
    (kind, key), rest = path[0], path[1:]
    if kind == "attr":
        fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
        fields[key] = set_at(fields[key], rest, value)
        new = object.__new__(type(tree))
        for name, item in fields.items():
            object.__setattr__(new, name, item)
        return new
    flat, treedef = children(tree)
    items = [child for _, child in flat]
    items[key] = set_at(items[key], rest, value)
    return jax.tree_util.tree_unflatten(treedef, items)


def with_values(tree: Any, paths: tuple[FieldPath, ...], values: Sequence[Any]) -> Any:
    for path, value in zip(paths, values, strict=True):
        tree = set_at(tree, path, value)
    return tree


def program_of(call: Callable, block: PyTree, *inputs: Any) -> tuple[str, list]:
    """The traced program of `call(block, *inputs)` (the values traced for their types, with
    the mesh axes they vary over): its text and its constants, what two blocks must share
    to run as one stacked program."""
    closed = eqx.filter_make_jaxpr(call)(block, *inputs)[0]
    return str(closed.jaxpr), list(closed.consts)


def same_program(a: tuple[str, list], b: tuple[str, list]) -> bool:
    (text_a, consts_a), (text_b, consts_b) = a, b
    if text_a != text_b or len(consts_a) != len(consts_b):
        return False
    for x, y in zip(consts_a, consts_b):
        if x is y:
            continue
        try:
            if np.shape(x) != np.shape(y) or not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        except Exception:  # a traced constant: only the same one is the same
            return False
    return True
