"""What a stage does, read off its jaxpr: primitives used, mesh axes of its collectives."""

from typing import Any


def _equations(jaxpr: Any) -> Any:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in getattr(inner, "eqns", ()):
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, list | tuple) else (value,):
                if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                    yield from _equations(item)


def uses_primitive(jaxpr: Any, name: str) -> bool:
    """Whether `name` is a primitive of `jaxpr` or of any jaxpr nested in its equations."""
    return any(eqn.primitive.name == name for eqn in _equations(jaxpr))


# Primitives that move data between the devices of the mesh axes they name.
_COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
    "reduce_scatter", "ppermute", "all_to_all",
})  # fmt: skip


def collective_axes(jaxpr: Any) -> frozenset:
    """The mesh axes the collectives of `jaxpr` (nested jaxprs included) run over."""
    axes: set = set()
    for eqn in _equations(jaxpr):
        if eqn.primitive.name in _COLLECTIVES:
            named = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes.update(named if isinstance(named, tuple | list) else (named,))
    return frozenset(axes)
