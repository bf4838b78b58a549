"""Context parallelism for hand-written attention blocks, with no model edit.

A block that attends by calling `jax.nn.dot_product_attention` (as most hand-written
attention in Equinox code does) can run on a sequence split over a context axis if that one
call becomes ring attention (`eqpar.context.ring_attention`, which takes the same
`[..., seq, heads, size]` layout), or Ulysses attention (`ulysses_attention`, which also
takes keys and values with fewer heads, as `jax.nn.dot_product_attention` does).
`ContextParallel(...)` keyed by such a block does exactly that: the block's `__call__` runs
as a copy of the author's function whose globals see `jax.nn.dot_product_attention` (by any
of the names the module imported it under: `jax`, `jax.nn`, the function itself) as that
attention over the axis. Nothing process-wide
changes: the copy has its own globals, and other code calling `jax.nn.dot_product_attention`
meanwhile gets JAX's own. JAX has no hook on a function called inside traced code, so this is
the smallest change that reaches it.

Attention the block does not reach through those names (an einsum and a softmax, or a helper
function of its own module) cannot be split this way: the call is refused, naming this route.
"""

import types
from collections.abc import Callable, Hashable
from typing import Any, cast

import jax

from ..context import ring_attention, ulysses_attention

_TARGET = jax.nn.dot_product_attention


class _NnView:
    """`jax.nn` as the block's code sees it: the one attention function replaced."""

    def __init__(self, attention: Callable):
        self.dot_product_attention = attention

    def __getattr__(self, name: str) -> Any:
        return getattr(jax.nn, name)


class _JaxView:
    """`jax` as the block's code sees it (its `nn` a `_NnView`)."""

    def __init__(self, attention: Callable):
        self.nn = _NnView(attention)

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)


def context_attention(
    owner: str, axis_name: Hashable, layout: str, strategy: str, calls: list
) -> Callable:
    """`jax.nn.dot_product_attention`'s signature, computed by ring (or Ulysses, by
    `strategy`) attention over `axis_name` on this device's block of the sequence (`calls`
    counts the calls)."""
    attend = ulysses_attention if strategy == "ulysses" else ring_attention

    def attention(
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        *,
        scale: float | None = None,
        is_causal: bool = False,
        **options: Any,
    ) -> jax.Array:
        unsupported = [name for name, v in options.items() if v not in (None, False)]
        if bias is not None or mask is not None or unsupported:
            given = [n for n, v in (("bias", bias), ("mask", mask)) if v is not None]
            raise ValueError(
                f"{owner}: ContextParallel runs this block's jax.nn.dot_product_attention as "
                f"{strategy} attention over {axis_name!r}, which takes `is_causal` and "
                f"`scale`, but the call passes {given + unsupported}: a mask or bias over the "
                f"whole sequence has no block per device. Express padding with "
                f"`eqpar.context.{attend.__name__}(..., key_mask=...)` in the block, or keep "
                f"the sequence whole (no ContextParallel key)."
            )
        calls.append(None)
        return attend(
            query,
            key,
            value,
            axis_name=axis_name,
            causal=is_causal,
            layout=cast(Any, layout),
            scale=scale,
        )

    return attention


def _names_of_attention(fn: types.FunctionType) -> tuple[str, ...]:
    return tuple(
        name
        for name, value in fn.__globals__.items()
        if value is jax or value is jax.nn or value is _TARGET
    )


def rebound_call(
    owner: str, fn: Callable, axis_name: Hashable, layout: str, strategy: str = "ring"
) -> tuple[Callable, list]:
    """A copy of the author's `fn` whose globals see `jax.nn.dot_product_attention` as ring
    (or Ulysses) attention over `axis_name`, and the list its calls are counted in."""
    calls: list = []
    if not isinstance(fn, types.FunctionType) or not _names_of_attention(fn):
        return fn, calls
    attention = context_attention(owner, axis_name, layout, strategy, calls)
    names = dict(fn.__globals__)
    for name in _names_of_attention(fn):
        value = names[name]
        names[name] = (
            _JaxView(attention)
            if value is jax
            else _NnView(attention)
            if value is jax.nn
            else attention
        )
    copy = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy, calls


def refuse_unreached(owner: str, axis_name: Hashable) -> None:
    raise ValueError(
        f"{owner}: ContextParallel(axis_name={axis_name!r}) on this block splits its "
        f"sequence, but its __call__ attended without calling jax.nn.dot_product_attention "
        f"(an einsum and a softmax, or a helper function): eqpar can only make that one call "
        f"ring (or Ulysses) attention over the whole sequence. Call "
        f"jax.nn.dot_product_attention (or eqpar.context.ring_attention) in the block's "
        f"__call__; otherwise keep the sequence "
        f"whole on this block (no ContextParallel or SplitSequence over {axis_name!r})."
    )
