"""Will it fit, and which plan: `eqpar.estimate` and `eqpar.search`, before anything compiles.

`estimate(step, *args)` traces the training step the user would `jax.jit` (nothing is
allocated and nothing compiles: the arguments may be `jax.ShapeDtypeStruct`s carrying their
`NamedSharding`s) and reads per device off the traced program: each argument's bytes, the
outputs, a predicted temporary peak, the collective bytes per step by kind and mesh axes, and
the FLOPs of its matrix products (`eqpar._program_figures` states the model of the compiler it
uses). With `compile=True` it also compiles the same step ahead of time and returns the
compiler's own `memory_analysis()` beside the prediction.

`search(build, candidates, ...)` estimates every candidate plan, drops those whose predicted
peak exceeds the memory per device, and ranks the rest by a stated step-time model.

JAX states memory only after XLA compiles (`Compiled.memory_analysis()`), which takes minutes
for a large model on a pipeline schedule and needs the devices' platform; eqpar owns this
estimate because no library predicts it from the program.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._program_figures import ProgramFigures, program_figures, spec_axes

__all__ = [
    "DEVICES",
    "CompiledMemory",
    "DeviceFigures",
    "Estimate",
    "Ranked",
    "SearchResult",
    "abstract_arrays",
    "estimate",
    "search",
]

_UNITS = {"B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3,
          "MB": 10**6, "GB": 10**9, "TB": 10**12}  # fmt: skip


def parse_bytes(value: int | float | str, *, name: str = "memory_per_device") -> int:
    """`16GiB`, `80 GB`, `1.5e9` or a number of bytes, as bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}.")
        return int(value)
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                number = text[: -len(unit)]
                try:
                    amount = float(number)
                except ValueError:
                    break
                if amount > 0:
                    return int(amount * _UNITS[unit])
                break
        else:
            try:
                amount = float(text)
            except ValueError:
                amount = -1.0
            if amount > 0:
                return int(amount)
    raise ValueError(
        f"{name} must be a positive number of bytes or a size such as '16GiB' or '80GB', "
        f"got {value!r}."
    )


class CompiledMemory(NamedTuple):
    """The compiler's per-device memory of the same step (`memory_analysis()`); `total` is
    argument + output + temp - alias (on CPU the reported peak leaves out temp).

    ```python
    import jax.numpy as jnp
    import eqpar

    estimate = eqpar.estimate(lambda x: x * 2, jnp.ones((4, 4)), compile=True)
    assert estimate.compiled is not None and estimate.compiled.argument == 4 * 4 * 4
    ```
    """

    argument: int
    output: int
    temp: int
    alias: int
    total: int
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What one step of a program needs per device, predicted from its trace.

    **Fields** (bytes per device unless stated):

    - `arguments`: each positional argument's bytes (its shards), in order;
    - `outputs`, `aliased`: the outputs' bytes, and how much of them reuses donated arguments;
    - `temp`: predicted temporaries (activations kept for the backward pass, gradients,
      workspace);
    - `peak`: `sum(arguments) + outputs + temp - aliased`, the figure to hold against the
      device's memory;
    - `collectives`: bytes one device receives per step, keyed by `(kind, axes)`: kind one of
      `all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all`, `collective-permute`,
      axes the mesh axes of the group (sorted);
    - `flops`: FLOPs of the step's matrix products on one device (loops counted per
      iteration, conditionals at their busiest branch);
    - `trace_seconds`: how long tracing and reading the program took;
    - `compiled`: with `compile=True`, the compiler's figures of the same step.

    ```python
    import jax.numpy as jnp
    import eqpar

    estimate = eqpar.estimate(lambda x: x * 2, jnp.ones((4, 4)))
    assert estimate.arguments == (64,) and estimate.outputs == 64
    assert estimate.peak == 64 + 64 + estimate.temp - estimate.aliased
    ```
    """

    arguments: tuple[int, ...]
    outputs: int
    aliased: int
    temp: int
    peak: int
    collectives: Mapping[tuple[str, tuple[str, ...]], float]
    flops: float
    trace_seconds: float
    compiled: CompiledMemory | None = None

    def collective_bytes(self, axis: str | None = None) -> float:
        """Bytes received per step over all collectives, or over those spanning `axis`."""
        return sum(b for (_, axes), b in self.collectives.items() if axis is None or axis in axes)

    def ratios(self) -> dict[str, float]:
        """Prediction / compiler for `peak` and `temp` (empty without `compile=True`)."""
        if self.compiled is None:
            return {}
        out = {"peak": self.peak / max(1, self.compiled.total)}
        out["temp"] = self.temp / max(1, self.compiled.temp)
        return out

    def table(self) -> str:
        """A Markdown table of the estimate (and the compiler's figures, if there)."""
        gib = 2**30
        rows = [("arguments", sum(self.arguments)), ("outputs", self.outputs),
                ("temp", self.temp), ("peak", self.peak)]  # fmt: skip
        compiled = self.compiled
        given = {"arguments": compiled.argument, "outputs": compiled.output,
                 "temp": compiled.temp, "peak": compiled.total} if compiled else {}  # fmt: skip
        head = "| per device | predicted GiB |" + (" compiled GiB | ratio |" if compiled else "")
        lines = [head, "|---|---:|" + ("---:|---:|" if compiled else "")]
        for name, value in rows:
            line = f"| {name} | {value / gib:.3f} |"
            if compiled:
                c = given[name]
                line += f" {c / gib:.3f} | {value / max(1, c):.2f} |"
            lines.append(line)
        for (kind, axes), amount in sorted(self.collectives.items()):
            lines.append(f"| {kind} over {','.join(axes)} | {amount / gib:.3f} |"
                         + (" | |" if compiled else ""))  # fmt: skip
        return "\n".join(lines)


def abstract_arrays(tree: Any, specs: Any, mesh: Any) -> Any:
    """`tree` with each array leaf a `jax.ShapeDtypeStruct` laid out by `specs` on `mesh`:
    the arguments `estimate` reads, with nothing allocated.

    **Arguments:**

    - `tree`: a pytree of arrays or `ShapeDtypeStruct`s (a model, e.g. from
      `eqx.filter_eval_shape`, an optimizer state, a batch); other leaves stay as they are.
    - `specs`: its layout: a pytree of `PartitionSpec`s of the same structure (`None` or
      a missing spec for a replicated leaf), e.g. `eqpar.partition_specs(model)`.
    - `mesh`: a `DeviceMesh`, a `jax.sharding.Mesh`, or a `jax.sharding.AbstractMesh`
      (axis sizes only: a mesh larger than this machine).

    **Returns:** the pytree of `ShapeDtypeStruct`s with their `NamedSharding`s.

    ```python
    import equinox as eqx, jax
    from jax.sharding import AbstractMesh, AxisType
    import eqpar

    mesh = AbstractMesh((16, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    model = eqpar.parallelize(eqx.nn.MLP(64, 64, 256, depth=2, key=jax.random.key(0)),
                              {"layers/0": eqpar.ColumnParallel("model"),
                               "layers/1": eqpar.RowParallel("model")})
    arrays = eqpar.planning.abstract_arrays(
        eqx.filter(model, eqx.is_array), eqpar.partition_specs(model), mesh
    )
    assert arrays.layers[0].weight.sharding.shard_shape((256, 64)) == (64, 64)
    ```
    """
    from .layout import named_shardings  # the layout room: specs -> shardings

    def is_array(leaf: Any) -> bool:
        return hasattr(leaf, "shape") and hasattr(leaf, "dtype")

    def placed(leaf: Any, spec: Any) -> Any:
        if not is_array(leaf):
            return leaf
        sharding = named_shardings(spec if isinstance(spec, PartitionSpec) else
                                   PartitionSpec(), mesh)  # fmt: skip
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(
        placed, tree, specs, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)
    )


def _axis_sizes(leaves: Sequence[Any], mesh: Any) -> dict[str, int]:
    if mesh is not None:
        if isinstance(mesh, Mapping):
            return {str(k): int(v) for k, v in mesh.items()}
        mesh = getattr(mesh, "jax_mesh", mesh)
        return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
    return {}


def _leaf_axes(leaf: Any, path: str) -> frozenset[str]:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or isinstance(sharding, NamedSharding):
        return spec_axes(sharding.spec) if sharding is not None else frozenset()
    if getattr(sharding, "is_fully_replicated", False):
        return frozenset()
    raise ValueError(
        f"estimate: the argument at {path} has a {type(sharding).__name__}; give it a "
        "NamedSharding (e.g. `jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, "
        "spec))`) so its shards can be counted."
    )


def estimate(
    step: Callable[..., Any],
    *args: Any,
    donate_argnums: int | Sequence[int] = (),
    mesh: Any = None,
    compile: bool = False,
) -> Estimate:
    """Predict what `step` needs per device, from its trace.

    **Arguments:**

    - `step`: the function you would `jax.jit` (an `eqx.filter_jit` step works too: pass its
      arrays as arguments and close over the rest).
    - `*args`: its positional arguments: pytrees of `jax.Array`s or `jax.ShapeDtypeStruct`s,
      each leaf carrying its `NamedSharding` (`sharding=`; `abstract_arrays` lays a pytree
      out by its specs); a leaf without one is taken as replicated. The shardings may be
      over a `jax.sharding.AbstractMesh`, axis sizes without devices, to size a mesh larger
      than this machine (`eqpar.shard_map` takes one as its `mesh`).
    - `donate_argnums`: the arguments whose buffers the step may reuse, as for `jax.jit`.
    - `mesh`: the mesh, or its axis sizes as a dict; by default the mesh of the arguments'
      shardings.
    - `compile`: also compile the step ahead of time and return the compiler's figures in
      `Estimate.compiled` (takes what compiling takes).

    **Returns:** an `Estimate`; `print(estimate(...).table())` shows it.

    ```python
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import eqpar

    mesh = jax.make_mesh((8,), ("data",))
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=NamedSharding(mesh, P()))
    est = eqpar.estimate(lambda w, x: jax.grad(lambda w: jnp.tanh(x @ w).sum())(w), w, x)
    est.collectives  # {('all-reduce', ('data',)): 2 * 512 * 512 * 4 * 7 / 8}
    ```
    """
    if not callable(step):
        raise TypeError(f"estimate: `step` must be callable, got {type(step).__name__}.")
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    for index in donate:
        if not 0 <= index < len(args):
            raise ValueError(
                f"estimate: donate_argnums names argument {index}, but step gets {len(args)}."
            )
    started = time.perf_counter()
    jitted = jax.jit(step, donate_argnums=donate)
    traced = jitted.trace(*args)
    flat_with_paths = []
    donated = []
    counts = []
    for index, arg in enumerate(args):
        leaves = jax.tree_util.tree_leaves_with_path(arg)
        counts.append(len(leaves))
        for path, leaf in leaves:
            where = f"args[{index}]" + jax.tree_util.keystr(path, simple=True, separator="/")
            flat_with_paths.append((where, leaf))
            donated.append(index in donate)
    leaves = [leaf for _, leaf in flat_with_paths]
    sizes = _axis_sizes(leaves, mesh)
    in_axes = [_leaf_axes(leaf, where) for where, leaf in flat_with_paths]
    if len(in_axes) != len(traced.jaxpr.jaxpr.invars):
        # Non-array leaves (Python scalars) are static to the trace: count only arrays.
        keep = [hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in leaves]
        in_axes = [a for a, k in zip(in_axes, keep, strict=True) if k]
        donated = [d for d, k in zip(donated, keep, strict=True) if k]
        counts = [sum(1 for leaf in jax.tree.leaves(arg) if hasattr(leaf, "shape")) for arg in args]
    figures: ProgramFigures = program_figures(traced.jaxpr, in_axes, sizes, donated=donated)
    seconds = time.perf_counter() - started
    per_argument = []
    offset = 0
    for count in counts:
        per_argument.append(sum(figures.inputs[offset : offset + count]))
        offset += count
    outputs = sum(figures.outputs)
    result = Estimate(
        arguments=tuple(per_argument),
        outputs=outputs,
        aliased=figures.aliased,
        temp=figures.temp,
        peak=sum(per_argument) + outputs + figures.temp - figures.aliased,
        collectives=figures.collectives,
        flops=figures.flops,
        trace_seconds=seconds,
    )
    if compile:
        started = time.perf_counter()
        stats = traced.lower().compile().memory_analysis()
        if stats is None:
            raise ValueError(
                "estimate(compile=True): this backend's compiler states no memory_analysis(); "
                "use the prediction alone (compile=False)."
            )
        compile_seconds = time.perf_counter() - started
        argument = int(stats.argument_size_in_bytes)
        output = int(stats.output_size_in_bytes)
        temp = int(stats.temp_size_in_bytes)
        alias = int(stats.alias_size_in_bytes)
        compiled = CompiledMemory(
            argument, output, temp, alias, argument + output + temp - alias, compile_seconds
        )
        result = dataclasses.replace(result, compiled=compiled)
    return result


# --- search ----------------------------------------------------------------------------------


class DeviceFigures(NamedTuple):
    """What the step-time model needs of a device: dense matrix-product FLOP/s at the step's
    precision, and bytes per second one device receives over a mesh axis (`bytes_per_s`, or
    per axis name in `axis_bytes_per_s`, e.g. slower for an axis that crosses hosts).

    ```python
    from eqpar.planning import DEVICES, DeviceFigures

    mine = DeviceFigures(flops_per_s=100e12, bytes_per_s=50e9, memory=24 * 2**30,
                         axis_bytes_per_s={"data": 12.5e9})
    assert mine.axis_rate(("data", "model")) == 12.5e9  # the slowest axis of the group
    assert DEVICES["h100-sxm"].memory == 80 * 2**30
    ```
    """

    flops_per_s: float
    bytes_per_s: float
    memory: int
    axis_bytes_per_s: Mapping[str, float] = {}

    def axis_rate(self, axes: Sequence[str]) -> float:
        rates = [self.axis_bytes_per_s.get(a, self.bytes_per_s) for a in axes]
        return min(rates) if rates else self.bytes_per_s


# Vendor peak figures (dense bf16 matrix FLOP/s; per-device interconnect bandwidth one way).
# Real steps reach a fraction of them; the ranking uses them as ratios.
DEVICES: dict[str, DeviceFigures] = {
    "a100-80gb": DeviceFigures(312e12, 300e9, 80 * 2**30),
    "h100-sxm": DeviceFigures(989e12, 450e9, 80 * 2**30),
    "h200": DeviceFigures(989e12, 450e9, 141 * 10**9),
    "tpu-v5e": DeviceFigures(197e12, 200e9, 16 * 2**30),
    "tpu-v5p": DeviceFigures(459e12, 600e9, 95 * 2**30),
}


@dataclasses.dataclass(frozen=True)
class Ranked:
    """One candidate of `search`: its estimate, whether it fits, and its modelled step time
    (`compute_s` + `communication_s`).

    ```python
    import jax.numpy as jnp
    import eqpar

    result = eqpar.search(lambda n: (lambda x: x @ x, (jnp.ones((n, n)),)), [64, 128],
                          memory_per_device="1MiB")
    best = result.ranked[0]
    assert best.candidate == 64 and best.fits
    assert best.step_s == best.compute_s + best.communication_s
    ```
    """

    candidate: Any
    estimate: Estimate
    fits: bool
    compute_s: float
    communication_s: float

    @property
    def step_s(self) -> float:
        """The modelled step time, seconds."""
        return self.compute_s + self.communication_s


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """`search`'s answer: every candidate, those that fit first, fastest first.

    ```python
    import jax.numpy as jnp
    import eqpar

    def build(n):  # a candidate: the matrix size
        return (lambda x: x @ x), (jnp.ones((n, n)),)

    result = eqpar.search(build, [256, 64], memory_per_device="300KiB")
    assert result.best.candidate == 64  # 256 x 256 floats do not fit
    assert [r.fits for r in result.ranked] == [True, False]
    print(result.table())
    ```
    """

    ranked: tuple[Ranked, ...]
    memory_per_device: int
    device: DeviceFigures
    seconds: float

    @property
    def best(self) -> Ranked:
        """The fastest candidate that fits (`ValueError` if none does)."""
        if not self.ranked or not self.ranked[0].fits:
            raise ValueError(
                "search: no candidate fits in "
                f"{self.memory_per_device / 2**30:.2f} GiB per device; the smallest needs "
                f"{min(r.estimate.peak for r in self.ranked) / 2**30:.2f} GiB. Add devices, "
                "FSDP, a remat policy or more microbatches to the candidates."
                if self.ranked
                else "search: no candidates were given."
            )
        return self.ranked[0]

    def table(self) -> str:
        """A Markdown table: each candidate's peak, whether it fits, its modelled time and
        why the winner wins (the fastest that fits)."""
        mib = 2**20
        lines = [
            "| rank | candidate | peak MiB/device | fits | compute ms | communication ms "
            "| step ms |",
            "|---:|---|---:|---|---:|---:|---:|",
        ]
        for i, r in enumerate(self.ranked, 1):
            lines.append(
                f"| {i} | {r.candidate} | {r.estimate.peak / mib:.1f} | "
                f"{'yes' if r.fits else 'no'} | {r.compute_s * 1e3:.3f} | "
                f"{r.communication_s * 1e3:.3f} | {r.step_s * 1e3:.3f} |"
            )
        fitting = [r for r in self.ranked if r.fits]
        if fitting:
            best = fitting[0]
            why = f"Chosen: {best.candidate}, the fastest modelled step of {len(fitting)} that fit"
            if len(fitting) > 1:
                runner = fitting[1]
                why += f" ({runner.step_s / best.step_s:.2f}x faster than {runner.candidate})"
            lines.append("")
            lines.append(why + ".")
        return "\n".join(lines)


def search(
    build: Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]],
    candidates: Iterable[Any],
    *,
    memory_per_device: int | float | str | None = None,
    device: str | DeviceFigures = "h100-sxm",
    donate_argnums: int | Sequence[int] = (),
) -> SearchResult:
    """Rank plans by a step-time model, keeping those whose predicted peak fits.

    **Arguments:**

    - `build`: `candidate -> (step, args)`: the training step for that plan and its arguments
      laid out by the plan (arrays or `jax.ShapeDtypeStruct`s with shardings), as for
      `estimate`.
    - `candidates`: the plans to try (anything `build` understands: mesh sizes, a plan dict,
      a config); each is shown with `str` in the table.
    - `memory_per_device`: bytes or a size such as `"16GiB"`; default the device's.
    - `device`: a name of `eqpar.planning.DEVICES` or a `DeviceFigures`.
    - `donate_argnums`: as for `estimate`.

    **Returns:** a `SearchResult`: `.best` is the fastest candidate that fits, `.table()`
    explains the choice.

    **The step-time model:** `flops / flops_per_s + sum(bytes / rate(axes))` over the
    step's collectives, nothing overlapped (an upper bound where the compiler overlaps).
    A pipeline's bubble is in it: the schedule's loop runs every step at its busiest
    branch, as devices in lock step do.

    ```python
    import jax, jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import eqpar

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def build(spec):  # one candidate: where the weight lives
        w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=NamedSharding(mesh, spec))
        x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        return (lambda w, x: jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)), (w, x)

    result = eqpar.search(build, [P(), P(None, "data")], memory_per_device="2MiB")
    assert result.best.candidate == P(None, "data")  # the replicated weight does not fit
    ```
    """
    figures = DEVICES[device] if isinstance(device, str) and device in DEVICES else device
    if not isinstance(figures, DeviceFigures):
        raise ValueError(
            f"search: device must be one of {sorted(DEVICES)} or a DeviceFigures, got {device!r}."
        )
    limit = figures.memory if memory_per_device is None else parse_bytes(memory_per_device)
    started = time.perf_counter()
    ranked = []
    for candidate in candidates:
        step, args = build(candidate)
        est = estimate(step, *args, donate_argnums=donate_argnums)
        compute = float(est.flops) / figures.flops_per_s
        communication = float(
            sum(amount / figures.axis_rate(axes) for (_, axes), amount in est.collectives.items())
        )
        ranked.append(Ranked(candidate, est, est.peak <= limit, compute, communication))
    ranked.sort(key=lambda r: (not r.fits, r.step_s if r.fits else r.estimate.peak))
    return SearchResult(tuple(ranked), limit, figures, time.perf_counter() - started)
