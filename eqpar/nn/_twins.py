"""What the tensor-parallel twins of `eqx.nn` layers share: building a twin from the original's
fields, and the checks of local blocks and of sequence layouts that name the fix."""

import dataclasses
import inspect
from collections.abc import Hashable

import equinox as eqx
from jax import lax
from jaxtyping import Array, PyTree

from .._vma import varies_over


def copy_fields(source: eqx.Module, target: eqx.Module, cls: type) -> None:
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        object.__setattr__(target, field.name, getattr(source, field.name))


def rebuilt(layer: eqx.Module, cls: type) -> PyTree:
    """`layer`'s fields of `cls` in a new `cls` instance (no initialisation, no key)."""
    new = object.__new__(cls)
    copy_fields(layer, new, cls)
    return new


def instance_with(cls: type, fields: dict) -> PyTree:
    """A `cls` instance holding `fields` (no initialisation: the author's `__init__` may take
    arguments eqpar does not have)."""
    new = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(new, name, value)
    return new


def active_dropout(
    layer: eqx.nn.Dropout,
    inference: bool | None,
    deterministic: bool | None,
    key: object,
    owner: str,
) -> bool:
    """Whether a dropout twin draws a mask on this call, read as `eqx.nn.Dropout` reads its
    arguments (`deterministic` is the older name of `inference`; `p == 0` never drops)."""
    if deterministic is not None:
        inference = deterministic
    if inference is None:
        inference = layer.inference
    if isinstance(layer.p, int | float) and layer.p == 0:
        inference = True
    if inference:
        return False
    if key is None:
        raise RuntimeError(f"{owner} requires a key when running in non-deterministic mode.")
    return True


def check_divides(owner: str, label: str, size: int, n: int, axis_name: Hashable) -> None:
    if size % n:
        raise ValueError(
            f"{owner}: {label}={size} does not divide by the size of axis {axis_name!r} ({n}). "
            f"Choose a model whose {label} is a multiple of {n}, or a smaller axis."
        )


def check_block(owner: str, name: str, got: tuple, expected: tuple) -> None:
    if got == expected:
        return
    if len(got) > len(expected):
        raise ValueError(
            f"{owner}: the local block of {name} has shape {got}, with leading dimensions "
            f"beyond the layer's own {expected}: a stack of layers called as one. Keep stacks "
            f"in `eqpar.nn.ScannedLayers` or `PipelineModule.from_layers` (or unstack them with "
            f"`eqpar.nn.unstack_layers`), which index one layer per call and shift its layout."
        )
    raise ValueError(
        f"{owner}: the local block of {name} has shape {got} but {expected} was expected. "
        f"Pass the model into `eqpar.shard_map` with the specs of "
        f"`eqpar.partition_specs(model)` as its in_specs."
    )


def check_sequence_layout(
    owner: str, name: str, x: Array, axis_name: Hashable, sequence_parallel: bool
) -> None:
    """Refuse an input split over the sequence where the whole one belongs, and the reverse,
    which would otherwise mix tokens of different devices silently."""
    sharded = varies_over(x, axis_name)
    if sharded is None or sharded == sequence_parallel:
        return
    if sequence_parallel:
        raise ValueError(
            f"{owner}: sequence_parallel=True, but `{name}` is the same on every device of axis "
            f"{axis_name!r}, not split over the sequence. Put `eqpar.SplitSequence("
            f"{axis_name!r})` on the model's list of blocks in the plan (or call "
            f"`eqpar.nn.scatter_sequence` where the sequence-parallel part of the model "
            f"begins, after the embeddings), or drop sequence_parallel=True from this layer's "
            f"style."
        )
    raise ValueError(
        f"{owner}: `{name}` differs between the devices of axis {axis_name!r} (split over the "
        f"sequence by `eqpar.nn.scatter_sequence`?), but this layer takes the whole input on "
        f"every device. Set sequence_parallel=True on its style and on the rest of its block, "
        f"or call `eqpar.nn.gather_sequence` before it."
    )


_GATHER_TAKES_TO = "to" in inspect.signature(lax.all_gather).parameters


def gather_replicated(x: Array, axis_name: Hashable, axis: int) -> Array:
    """All-gather blocks into the whole array, typed as the same on every device.

    A plain `all_gather` result is typed as varying over the axis, which a later
    `out_specs=P()` would refuse; newer JAX can state the result is replicated.
    """
    if _GATHER_TAKES_TO:
        try:
            return lax.all_gather(x, axis_name, axis=axis, tiled=True, to="invarying")  # type: ignore[call-arg]
        except ValueError:  # JAX 0.9 takes `to`, but only "varying" or "reduced"
            pass
    gather_invariant = getattr(lax, "all_gather_invariant", None)
    if gather_invariant is not None:
        return gather_invariant(x, axis_name, axis=axis, tiled=True)
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def adopt(target: eqx.Module, source: PyTree, cls: type, axis_name: Hashable) -> None:
    """Make `target` (a twin of `cls` under construction) hold `source`'s fields and the axis."""
    if not isinstance(source, cls):
        raise TypeError(
            f"{type(target).__name__}: expected an eqx.nn.{cls.__name__}; got "
            f"{type(source).__name__}."
        )
    copy_fields(source, target, cls)
    object.__setattr__(target, "axis_name", axis_name)
