"""Which activations eqpar has split, recorded while a model is traced.

A dropout or a rotary embedding converted by `eqpar.parallelize` receives this device's block
of an activation the serial layer saw whole. To draw the serial layer's mask (or use the
serial positions) it must know which dimension is split and how: the layers that split
activations say so here while they are traced, in program order. A column-parallel linear
opens a split of the features that the row-parallel linear after it closes;
`scatter_sequence` opens a split of the sequence that `gather_sequence` closes. The record
is a stack per trace (a `contextvars` value that `eqpar.shard_map` starts empty; under
`jax.shard_map` called directly, entries a trace leaves open, such as a column-parallel
head's, stay until the process ends), so a
dropout between the two linears of an MLP sees the feature split, and a dropout between two
sequence-parallel blocks sees the sequence split, even when both use the same mesh axis.

No JAX transformation offers this: the replication types of `shard_map` say that a value
differs between devices, not which of its dimensions is a block of what.
"""

import contextlib
import contextvars
from collections.abc import Hashable, Iterator
from typing import NamedTuple


class Split(NamedTuple):
    """One split activation: dimension `dim` holds `block` of `block * n` entries, device `d`
    of `n` holding entries `[d * block, (d + 1) * block)` (with `layout="balanced"`, the
    entries `eqpar.context.sequence_positions` gives).

    `kind` is `"features"` (`dim=-1`), `"sequence"` (`dim=0`: one example's sequence comes
    first), `"heads"` (the heads of a block under `HeadParallel(fields=...)`, at the
    dimension of that size, found per activation by `split_of`), or `"features_of_tokens"`:
    the output of a sequence-parallel column linear,
    `[n, block]` per token, where row `j` is the token at the same place in device `j`'s
    block of the sequence and the features are split.
    """

    axis_name: Hashable
    kind: str
    dim: int
    block: int
    layout: str = "contiguous"


_OPEN: contextvars.ContextVar[tuple[Split, ...]] = contextvars.ContextVar(
    "eqpar_open_splits", default=()
)


@contextlib.contextmanager
def fresh_record() -> Iterator[None]:
    """An empty record for one trace (what `eqpar.shard_map` opens around the function)."""
    token = _OPEN.set(())
    try:
        yield
    finally:
        _OPEN.reset(token)


@contextlib.contextmanager
def kept_record() -> Iterator[None]:
    """The record as it is now, given back after the block (for an extra trace of code that
    opens and closes splits, such as an abstract trace that only reads the program)."""
    token = _OPEN.set(_OPEN.get())
    try:
        yield
    finally:
        _OPEN.reset(token)


def open_split(split: Split) -> None:
    """Record `split` (once: a second column linear on the same axis, as in a gated MLP,
    opens the same split)."""
    current = _OPEN.get()
    if split not in current:
        _OPEN.set((*current, split))


def close_split(axis_name: Hashable, kinds: tuple[str, ...]) -> None:
    """Forget the open splits of `kinds` on `axis_name` (every one: the queries and the
    smaller keys of grouped-query attention are both closed by the output projection)."""
    current = _OPEN.get()
    kept = tuple(s for s in current if not (s.axis_name == axis_name and s.kind in kinds))
    if kept != current:
        _OPEN.set(kept)


def open_splits() -> tuple[Split, ...]:
    """The open splits, oldest first."""
    return _OPEN.get()


def split_of(shape: tuple[int, ...], axis_name: Hashable) -> Split | None:
    """The most recent open split on `axis_name` that an array of `shape` can be a block of.

    A `"heads"` split (a block whose head counts `HeadParallel(fields=...)` divides: every
    activation of it with a dimension of that many heads holds this device's heads) comes
    first, at the one dimension of its size; two such dimensions cannot be told apart."""
    for split in reversed(_OPEN.get()):
        if split.axis_name != axis_name or split.kind != "heads":
            continue
        dims = [i for i, size in enumerate(shape) if size == split.block]
        if len(dims) > 1:
            raise ValueError(
                f"an activation of shape {shape} inside a block whose heads are split over "
                f"{axis_name!r} ({split.block} here) has several dimensions of that size; "
                f"eqpar cannot tell which holds the heads, to draw this device's block of the "
                f"serial dropout mask. Choose sizes that differ from the local head count "
                f"(e.g. another sequence length), or keep the dropout out of the block."
            )
        if dims:
            return split._replace(dim=dims[0])
    for split in reversed(_OPEN.get()):
        if split.kind == "heads":
            continue
        rank_needed = split.dim + 1 if split.dim >= 0 else -split.dim
        if split.axis_name != axis_name or len(shape) < rank_needed:
            continue
        if shape[split.dim] != split.block:
            continue
        if split.kind == "features_of_tokens" and len(shape) < 3:
            continue
        return split
    return None
