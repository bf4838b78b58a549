"""Comparison helpers for the tests: a parallel computation against its serial twin.

The tolerance comes from the arithmetic, not from the machine. A float32 result is a sum (or a
chain of sums) of many terms, and reordering those terms, as a parallel program does when it
reduces across devices, and as XLA's CPU code generation does differently per instruction set
(SSE4.2, AVX2, AVX-512), changes the result by a few units of the float32 epsilon (1.2e-7) of
the *terms' magnitude*, not of the result's. Where terms cancel, the result is small and its
error is not: an elementwise `rtol` then fails on one machine and passes on another. The
classic case is an SGD step, `w - lr * g`, where `w` and `lr * g` nearly cancel for a few
elements.

So each leaf is compared relative to its scale, its largest magnitude:

    max |actual - expected| <= rtol * max(max |expected|, tiny)

An SGD-updated parameter is compared relative to the parameter's scale; a gradient relative to
the largest gradient of that parameter. Where a leaf's scale is set by other quantities (a
gradient tiny beside the terms summed into it, a result that cancels entirely), pass `scale=`.

Exact checks (bitwise equality on purpose) use `np.testing.assert_array_equal` or
`eqx.tree_equal`, not these helpers.
"""

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

FLOAT32_RTOL = 1e-5  # ~80 float32 epsilons (1.19e-7) of the leaf's scale


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _leaves(actual: Any, expected: Any, what: str) -> Iterator[tuple[str, Any, Any]]:
    """`(path, actual_leaf, expected_leaf)` for two trees with leaves at the same paths. Their
    static parts may differ (a module's remat policy or a parallel layer's axis names): what is
    compared is the leaves."""
    got = jax.tree_util.tree_leaves_with_path(actual)
    want = jax.tree_util.tree_leaves_with_path(expected)
    paths = [jax.tree_util.keystr(path) for path, _ in got]
    expected_paths = [jax.tree_util.keystr(path) for path, _ in want]
    prefix = f"{what}: " if what else ""
    if paths != expected_paths:
        raise AssertionError(
            f"{prefix}the trees hold leaves at different paths:\n"
            f"  actual:   {paths}\n  expected: {expected_paths}"
        )
    for path, (_, a), (_, e) in zip(paths, got, want, strict=True):
        yield f"{prefix}{path or '<root>'}", a, e


def _leaf_error(where: str, a: Any, e: Any, scale: float | None) -> tuple[float, float, str] | None:
    """Check what must be exact (non-array leaves, dtypes, shapes, integer and bool arrays,
    NaN and inf); return `(max |a - e|, scale, where the max is)` for a float leaf, `None` for
    any other."""
    if not (_is_array(a) or _is_array(e)):
        if not (isinstance(a, float) and isinstance(e, float)):
            assert a == e, f"{where}: non-array leaves differ: {a!r} != {e!r}"
            return None
        a, e = np.asarray(a), np.asarray(e)  # Python floats are numbers like any other
    if not (_is_array(a) and _is_array(e)):
        raise AssertionError(f"{where}: array against non-array: {a!r} vs {e!r}")
    assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != expected {e.dtype}"
    assert a.shape == e.shape, f"{where}: shape {a.shape} != expected {e.shape}"
    if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
        a, e = jax.random.key_data(a), jax.random.key_data(e)
    dtype = e.dtype
    a, e = np.asarray(a), np.asarray(e)
    if not jnp.issubdtype(dtype, jnp.inexact):
        np.testing.assert_array_equal(a, e, err_msg=f"{where}: integer/bool leaves differ")
        return None
    wide = np.complex128 if jnp.issubdtype(dtype, jnp.complexfloating) else np.float64
    a, e = a.astype(wide), e.astype(wide)
    finite = np.isfinite(e)
    # NaN and inf are not rounding: they must be where they are expected, and equal there.
    np.testing.assert_array_equal(
        np.where(finite, 0, a), np.where(finite, 0, e), err_msg=f"{where}: NaN/inf differ"
    )
    if a.size == 0:
        return None
    error = np.abs(np.where(finite, a, 0.0) - np.where(finite, e, 0.0))
    if not np.isfinite(error).all():
        raise AssertionError(f"{where}: NaN/inf where finite values are expected")
    if scale is None:
        scale = float(np.max(np.where(finite, np.abs(e), 0.0)))
    worst = np.unravel_index(np.argmax(error), error.shape)
    at = f"at {tuple(map(int, worst))}: {a[worst]:.8g} vs expected {e[worst]:.8g}"
    return float(error[worst]), max(scale, float(jnp.finfo(dtype).tiny)), at


def tree_errors(
    actual: Any, expected: Any, *, scale: float | None = None, what: str = ""
) -> list[tuple[str, float, float]]:
    """`[(path, max |actual - expected|, scale), ...]` for every float leaf (the scale is the
    leaf's largest magnitude, or `scale`, floored at the dtype's smallest normal number); what
    must be exact is asserted on the way."""
    return [row[:3] for row in _float_leaf_errors(actual, expected, scale, what)]


def _float_leaf_errors(actual, expected, scale, what) -> list[tuple[str, float, float, str]]:
    rows = []
    for where, a, e in _leaves(actual, expected, what):
        result = _leaf_error(where, a, e, scale)
        if result is not None:
            rows.append((where, *result))
    return rows


def assert_tree_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float = FLOAT32_RTOL,
    scale: float | None = None,
    what: str = "",
) -> None:
    """Every float leaf of `actual` within `rtol` of `expected`, relative to the leaf's scale:
    `max|actual - expected| <= rtol * max(max|expected|, tiny)` (or `rtol * scale` where
    `scale` is given). The trees must hold leaves at the same paths, non-array leaves must be
    equal, integer and bool arrays exactly equal, shapes and dtypes the same, NaN/inf in the
    same places. Pytrees (Equinox modules too) are compared leaf by leaf; filter out
    non-arrays with `eqx.filter` where they should not count.
    """
    failures = []
    for where, error, leaf_scale, at in _float_leaf_errors(actual, expected, scale, what):
        if not error <= rtol * leaf_scale:
            failures.append(
                f"  {where}: max |actual - expected| = {error:.3e}, scale = {leaf_scale:.3e}, "
                f"ratio = {error / leaf_scale:.3e} > rtol = {rtol:.1e} ({at})"
            )
    if failures:
        raise AssertionError("leaves differ beyond the tolerance:\n" + "\n".join(failures))


def assert_arrays_close(actual: Any, expected: Any, **kwargs) -> None:
    """`assert_tree_close` for the float arrays of two Equinox modules (or pytrees), ignoring
    their non-array leaves (`eqx.filter(tree, eqx.is_inexact_array)`)."""
    assert_tree_close(
        eqx.filter(actual, eqx.is_inexact_array),
        eqx.filter(expected, eqx.is_inexact_array),
        **kwargs,
    )
