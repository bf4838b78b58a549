"""Argument checks shared by every public function: one rule, one wording.

An integer argument is a Python `int` or a NumPy integer, never a `bool` (`True` is an `int` to
Python, and a flag passed where a count belongs is a mistake, not the count 1).
"""

from collections.abc import Hashable

import jax.numpy as jnp
import numpy as np


def check_int(value: object, *, name: str, owner: str, minimum: int | None = 1) -> int:
    """`value` as an `int`: a `TypeError` unless it is one, a `ValueError` below `minimum`.

    Messages name the owner (the public function or class) and the argument:
    "`owner`: \\`name\\` must be an int, got float 2.0." / "... must be at least 1, got 0."
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{owner}: `{name}` must be an int, got {type(value).__name__} {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: `{name}` must be at least {minimum}, got {value}.")
    return int(value)


def check_column_options(owner: str, gather_output: bool, sequence_parallel: bool) -> None:
    """Shared by `ColumnParallelLinear` and the `ColumnParallel` style."""
    if gather_output and sequence_parallel:
        raise ValueError(
            f"{owner}: gather_output=True and sequence_parallel=True do not go together: under "
            f"sequence parallelism the block ends in a RowParallelLinear (sequence_parallel="
            f"True), which scatters the output back over the sequence."
        )


def columns_in_a_row_fix(second: str, first: str) -> str:
    """The fix for a column-parallel linear given the block of features another one left
    (shared by `parallelize`'s check and the layer's own)."""
    return (
        f"Give {second} RowParallel() (it takes the block and returns the whole output), "
        f"narrow the key so it names only {first}, or set gather_output=True on the first."
    )


def per_token_sequence_fix(axis_name: Hashable) -> str:
    """Why a sequence-parallel column linear's per-token output cannot be reshaped or mixed
    across tokens, and the route that works (shared by the block conversion's check and
    the row-parallel partner's)."""
    return (
        f"A ColumnParallel(sequence_parallel=True) linear called per token on this device's "
        f"block of the sequence (`jax.vmap(self.linear)(x)`) gives [n, out / n] per token: "
        f"the token at the same place in each of the {axis_name!r} devices' blocks, this "
        f"device's features. Only elementwise code may use that before a "
        f"RowParallel(sequence_parallel=True) linear brings it back to the token's [out]; "
        f"code that reshapes it (into attention heads) or mixes tokens (attention written by "
        f"hand) needs the whole sequence, which a block under SplitSequence does not hold. "
        f"For such a block use tensor parallelism without sequence parallelism: "
        f"ColumnParallel() / RowParallel() without sequence_parallel=True and no "
        f"SplitSequence on its list (or eqx.nn.MultiheadAttention with "
        f"HeadParallel(sequence_parallel=True), which gathers the sequence itself)."
    )


def check_context_options(
    owner: str, layout: str, strategy: str, axis_name: Hashable, head_axis_name: Hashable | None
) -> None:
    """Shared by `ContextParallelAttention` and the `ContextParallel` style."""
    if layout not in ("contiguous", "balanced"):
        raise ValueError(f"{owner}: layout must be 'contiguous' or 'balanced'; got {layout!r}.")
    if strategy not in ("ring", "all_gather", "ulysses"):
        raise ValueError(
            f"{owner}: strategy must be 'ring', 'all_gather' or 'ulysses'; got {strategy!r}."
        )
    if head_axis_name is not None and head_axis_name == axis_name:
        raise ValueError(
            f"{owner}: head_axis_name={head_axis_name!r} is the context axis itself; heads and "
            f"the sequence must be split over different mesh axes (e.g. 'model' and 'context')."
        )


def check_bool_mask(owner: str, name: str, mask: object) -> None:
    """Refuse a mask that is not boolean (`None` passes), as `jax.nn.dot_product_attention`
    does. Every attention in eqpar reads a mask with `where(mask, scores, -inf)`, so an additive
    float mask (0 to attend, -inf to hide) would be read inverted: -inf is truthy, 0 falsy."""
    if mask is None:
        return
    dtype = jnp.result_type(mask)  # type: ignore[arg-type]
    if dtype != jnp.bool_:
        raise TypeError(
            f"{owner}: `{name}` must be a bool mask (True = attend to / keep this key); got "
            f"dtype {dtype.name}. Convert an additive mask (0 = attend, -inf = hide) with "
            f"`{name} == 0`, a 0/1 mask with `{name}.astype(bool)`."
        )


def check_nonempty_sequence(owner: str, lengths: str, *sizes: int) -> None:
    """Refuse attention over a zero-length sequence, which has no softmax to take, before it
    fails deep inside (a division by zero, a reshape of nothing). `lengths` says which
    arguments' lengths `sizes` are, for the message."""
    if 0 in sizes:
        raise ValueError(
            f"{owner}: zero-length sequence ({lengths}); attention needs at least one token on "
            f"each side. Drop empty examples, or pad them to one token and keep the padding out "
            f"of the loss (and out of the keys, with a mask where the layer takes one)."
        )
