"""Checksums of checkpointed arrays, computed where the data lives (one reduction per array
under `jax.jit`, no gather) and independent of the sharding, so that a checkpoint saved under
one layout verifies under any other (and, read in its saved shape, under another stacking:
see `eqpar.checkpoint.Checkpointer.restore(reshape=True)`). Private to `eqpar.checkpoint`.

eqpar owns this because neither orbax nor JAX checksums a sharded array's values
independently of its layout."""

import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

# Rule 3 (format version 3): each element's bits, as uint32 words, are mixed with its C-order
# linear index by a bijective 32-bit mixer (murmur3's finalizer), and the mixed values are
# summed modulo 2**32. A sum is exact in any order, so the sharding does not matter; the mixer
# makes every element contribute a pseudo-random value, so constant arrays no longer cancel
# out, and a change of one element of up to 4 bytes (one word) always changes the checksum
# (the mixer is a bijection of each word, the others fixed). Rule 2 (checkpoints of format
# version 2, kept so that they still verify): the sum of each element's words, xor-ed
# together, times an odd weight of its index; it cancels out for many constant arrays (0 for
# any constant float32 array whose length is a multiple of 512).

_MULTIPLIER, _OFFSET = 0x9E3779B1, 0x7F4A7C15
CHECKSUM_RULE = 3  # the rule of the checkpoints this version writes (its format version)


def digestible(dtype: Any) -> bool:
    """Whole-byte dtypes get a checksum; sub-byte ones (int4, float4, ...) are stored packed."""
    dtype = np.dtype(dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    return bits == 8 * dtype.itemsize and (bits <= 64 or dtype.kind == "c")


def _words(x: PyTree, xp: PyTree, bitcast: Callable) -> list:
    """The bits of `x` as uint32 words of `x`'s shape: one array for elements of up to 4 bytes,
    two (low and high half) for 8-byte ones, the real part's then the imaginary part's for
    complex numbers."""
    if x.dtype.kind == "c":
        return _words(xp.real(x), xp, bitcast) + _words(xp.imag(x), xp, bitcast)
    if x.dtype == np.bool_:
        return [x.astype(xp.uint32)]
    bits = bitcast(x, np.dtype(f"uint{8 * x.dtype.itemsize}"))
    if x.dtype.itemsize == 8:
        return [(bits & 0xFFFFFFFF).astype(xp.uint32), (bits >> 32).astype(xp.uint32)]
    return [bits.astype(xp.uint32)]


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection of uint32 that spreads every input bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@functools.partial(jax.jit, static_argnames="rule")
def _combine(words: tuple[jax.Array, ...], rule: int) -> jax.Array:
    """The checksum of an array given as its uint32 words. The C-order linear index comes
    from broadcast iotas, not a reshape, so the sharding is kept as is (nothing is gathered)."""
    shape = words[0].shape
    index, stride = jnp.zeros((), jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index, stride = index + iota * jnp.uint32(stride % 2**32), stride * shape[axis]
    if rule == 2:
        weights = (index * jnp.uint32(_MULTIPLIER) + jnp.uint32(_OFFSET)) | jnp.uint32(1)
        return jnp.sum(functools.reduce(operator.xor, words) * weights, dtype=jnp.uint32)
    mixed = _mix(index * jnp.uint32(_MULTIPLIER) + jnp.uint32(_OFFSET))
    for word in words:
        mixed = _mix(mixed ^ word)
    return jnp.sum(mixed, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnames="rule")
def _device_digest(x: jax.Array, rule: int) -> jax.Array:
    return _combine(tuple(_words(x, jnp, jax.lax.bitcast_convert_type)), rule)


def digest(value: PyTree, rule: int = CHECKSUM_RULE) -> int | None:
    """The checksum of `value` (a jax or NumPy array) by checksum `rule` (the format version
    of the checkpoint; 2 or 3); `None` where the dtype has none. Host values are turned into
    their uint32 words by NumPy first, so 64-bit values need no x64."""
    if not digestible(value.dtype):
        return None
    if isinstance(value, jax.Array):
        summed = _device_digest(value, rule=2 if rule <= 2 else 3)
    else:
        view = lambda x, dtype: np.ascontiguousarray(x).view(dtype)
        words = _words(np.asarray(value), np, view)
        summed = _combine(tuple(jnp.asarray(w) for w in words), rule=2 if rule <= 2 else 3)
    return int(np.asarray(summed.addressable_data(0)))  # replicated scalar
