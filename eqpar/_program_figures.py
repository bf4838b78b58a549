"""Per-device memory and traffic of a traced program, read off its jaxpr (no compiling).

`program_figures(closed_jaxpr, in_axes, sizes)` walks the jaxpr of a whole step once and
returns, per device: the bytes of each input, the outputs, a predicted temporary peak, the
collective bytes by kind and mesh axes, and the FLOPs of its matrix products. JAX has no public
figure of this kind before XLA compiles (`memory_analysis()` needs a compiled executable), so
eqpar owns this walk; `eqpar.estimate` builds on it.

The model of the compiler, stated so its errors can be read:

- **Shapes per device.** Inside a `shard_map` region shapes are already per device over its
  manual axes. Outside (and over a region's automatic axes) a value is split over the mesh
  axes the walk can name: its input sharding, a sharding constraint, a region's `out_specs`,
  else those of its largest operand of the same shape (or of the same leading dimension, the
  batch a global view splits), else none (replicated).
- **Memory.** Values live from the equation that makes them to their last use (inputs that are
  not donated live throughout); equations nothing depends on are dropped, as the compiler
  drops them. Elementwise, broadcast, reshape and convert results used once by another such
  equation or by a reduction are fused into it and never stored; `pvary`, reshapes and
  regions or calls that return an operand as it came are views of its buffer. A result may
  take the buffer of an operand of its size that dies there (in-place updates). A loop's
  body counts once, its stacked outputs whole, its carries in place (copied where their
  operand lives on); a conditional at its largest branch; a call or region at its own peak
  beyond its operands, which it may free early where they die at the call.
- **Collectives.** The ring cost that `benchmarks/_hlo.py` reads from compiled programs:
  all-reduce `2 (g-1)/g` of the operand, all-gather `(g-1)/g` of the result, reduce-scatter
  and all-to-all `(g-1)/g` of the operand, a permutation its operand on the devices that
  receive one; inside a loop, once per iteration (a `while` loop's unknown trip count as
  one); a conditional at its busiest branch. Besides those the program names, the ones the
  compiler inserts: a region's operand split over a manual axis that its `in_specs` leave
  whole is all-gathered on entry; a value resharded to fewer axes is all-gathered; a matrix
  product contracting two operands split over the same automatic axes, a reduction over a
  split batch and a scatter-add of split updates into a whole table are all-reduced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import PartitionSpec

from ._axes import axis_names
from ._specs import entry_names

# Results XLA fuses into their consumer instead of storing (when used once).
_FUSIBLE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh broadcast_in_dim cbrt ceil clamp
    convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expand_dims expm1
    floor ge gt imag integer_pow iota is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or pow real reduce_precision rem reshape round rsqrt select_n sign sin sinh sqrt
    square squeeze stop_gradient sub tan tanh xor pvary transpose""".split()
)
_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)
# Results that are their operand's buffer, seen another way (no copy in XLA).
_VIEWS = frozenset({"pvary", "reshape", "squeeze", "expand_dims"})
_ALL_REDUCE = frozenset({"psum", "psum_invariant", "pmax", "pmin"})
_ALL_GATHER = frozenset({"all_gather", "all_gather_invariant"})
_REDUCE_SCATTER = frozenset({"reduce_scatter", "psum_scatter"})


@dataclasses.dataclass
class ProgramFigures:
    """What `program_figures` found; every figure per device, in bytes (FLOPs for `flops`)."""

    inputs: list[int]
    outputs: list[int]
    aliased: int
    temp: int
    collectives: dict[tuple[str, tuple[str, ...]], float]
    flops: float


@functools.cache
def _itemsize(dtype: Any) -> int:
    """Bytes per element; a PRNG key's are those of its key data (8 for threefry)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * np.dtype(data.dtype).itemsize
    return np.dtype(dtype).itemsize


def _nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * _itemsize(dtype)


def spec_axes(spec: Any) -> frozenset[str]:
    """The mesh axes a `PartitionSpec` splits over."""
    names: frozenset[Any] = frozenset(n for entry in spec or () for n in entry_names(entry))
    return names


def _sharding_axes(sharding: Any) -> frozenset[str]:
    spec = getattr(sharding, "spec", None)
    return spec_axes(spec) if isinstance(spec, PartitionSpec) else frozenset()


class _Walk:
    """One walk of a program: the state shared by its nested jaxprs."""

    def __init__(self, sizes: Mapping[str, int]):
        self.sizes = dict(sizes)
        self.collectives: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
        self.flops = 0.0
        self.handed: list[bool] = []
        self._views: dict[int, tuple[Any, dict[Any, Any]]] = {}

    def group(self, axes: Sequence[str]) -> int:
        return math.prod(self.sizes.get(a, 1) for a in axes)

    def per_device(self, aval: Any, axes: frozenset[str]) -> int:
        return _nbytes(aval) // max(1, self.group(sorted(axes)))

    def add(self, kind: str, axes: tuple[str, ...], amount: float, trips: float) -> None:
        g = self.group(axes)
        if g <= 1 or amount <= 0:
            return
        named = tuple(sorted(a for a in axes if self.sizes.get(a, 1) > 1))
        self.collectives[(kind, named)] += amount * trips

    # --- one jaxpr ---------------------------------------------------------------------------

    def run(
        self,
        jaxpr: Any,
        in_axes: list[frozenset[str]],
        *,
        trips: float,
        manual: frozenset[str],
        owned: Sequence[bool] | None = None,
    ) -> tuple[list[frozenset[str]], int]:
        """Walk `jaxpr`; returns its outputs' split axes and its peak bytes beyond its inputs
        (inputs marked `owned` are freed at their last use and count from the start)."""
        axes_of: dict[Any, frozenset[str]] = {}
        for var, axes in zip(jaxpr.invars, in_axes, strict=True):
            axes_of[var] = axes
        for var in jaxpr.constvars:
            axes_of[var] = frozenset()
        root = self.views(jaxpr)  # a view -> the value whose buffer it is
        needed = _needed(jaxpr)
        uses: dict[Any, int] = defaultdict(int)
        last_use: dict[Any, int] = {}  # by buffer: the last use of it or of any view of it
        consumers: dict[Any, list[str]] = defaultdict(list)
        for i, eqn in enumerate(jaxpr.eqns):
            if i not in needed:
                continue
            for v in eqn.invars:
                if isinstance(v, jex.Var):
                    uses[v] += 1
                    last_use[root.get(v, v)] = i
                    consumers[v].append(eqn.primitive.name)
        outvars = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
        for v in outvars:
            last_use[root.get(v, v)] = len(jaxpr.eqns)
            uses[v] += 1

        def stored(v: Any, name: str) -> bool:
            if v in root:
                return False  # a view of a buffer counted already
            if v in outvars or name not in _FUSIBLE:
                return True
            if uses[v] != 1:
                return True
            return not all(c in _FUSIBLE or c in _REDUCTIONS for c in consumers[v])

        size: dict[Any, int] = {}
        live = 0
        if owned is not None:
            for var, own in zip(jaxpr.invars, owned, strict=True):
                if own:
                    size[var] = self.per_device(var.aval, axes_of[var])
                    live += size[var]
        peak = live
        for i, eqn in enumerate(jaxpr.eqns):
            if i not in needed:
                continue  # dead code, which the compiler removes (a gradient's unused primal)
            in_split = [
                axes_of.get(v, frozenset()) if isinstance(v, jex.Var) else frozenset()
                for v in eqn.invars
            ]
            # Operands that die here pass their buffers into a call, which may free them
            # early (an optimizer's update written over the donated state it reads).
            counted = [v for v in eqn.invars if isinstance(v, jex.Var)]
            handed = [
                isinstance(v, jex.Var)
                and v not in root
                and last_use.get(v) == i
                and v in size
                and counted.count(v) == 1
                for v in eqn.invars
            ]
            self.handed = handed
            out_split, inner = self.equation(eqn, in_split, trips=trips, manual=manual)
            made = 0
            new_sizes = []
            for v, axes in zip(eqn.outvars, out_split, strict=True):
                axes_of[v] = axes
                if isinstance(v, jex.Var) and not isinstance(v, jex.DropVar):
                    if stored(v, eqn.primitive.name):
                        size[v] = self.per_device(v.aval, axes)
                        made += size[v]
                        new_sizes.append(size[v])
            # A result may take the buffer of an operand this equation last uses, if the
            # sizes agree (XLA updates in place: loop carries, elementwise fusions).
            buffers = {root.get(v, v) for v in eqn.invars if isinstance(v, jex.Var)}
            dying = sorted(size[b] for b in buffers if last_use.get(b) == i and b in size)
            reused = 0
            for b in sorted(new_sizes, reverse=True):
                if b in dying:
                    dying.remove(b)
                    reused += b
            peak = max(peak, live + max(inner, made - reused))
            live += made
            for b in buffers:
                if last_use.get(b) == i and b in size:
                    live -= size.pop(b)
            for v in eqn.outvars:
                if v in size and v not in last_use:
                    live -= size.pop(v)  # made and never used
            peak = max(peak, live)
        outs = [
            axes_of.get(v, frozenset()) if isinstance(v, jex.Var) else frozenset()
            for v in jaxpr.outvars
        ]
        return outs, peak

    # --- one equation ------------------------------------------------------------------------

    def equation(
        self, eqn: Any, in_split: list[frozenset[str]], *, trips: float, manual: frozenset[str]
    ) -> tuple[list[frozenset[str]], int]:
        name = eqn.primitive.name
        params = eqn.params
        outs = eqn.outvars
        handed = self.handed  # before nested walks overwrite it
        if name == "shard_map":
            return self.region(eqn, in_split, trips=trips, manual=manual)
        called = _called(eqn)
        if called is not None:
            # A call (jit, remat, custom derivatives): its own peak beyond its operands.
            return self.call(called, in_split, trips=trips, manual=manual)
        if name == "scan":
            body = params["jaxpr"].jaxpr
            length = params["length"]
            num_consts, num_carry = _scan_counts(params)
            carry = range(num_consts, num_consts + num_carry)
            # The carries are the loop's own buffers: counted in the body, updated in place.
            split, peak = self.run(
                body,
                in_split,
                trips=trips * length,
                manual=manual,
                owned=[i in carry for i in range(len(in_split))],
            )
            # A carry whose operand lives on after the loop is copied into the loop's buffer;
            # one that dies here is updated in place.
            peak -= sum(
                self.per_device(eqn.invars[i].aval, in_split[i]) for i in carry if handed[i]
            )
            # Stacked outputs are allocated whole; the body's peak rides on top of them.
            stacked = sum(
                self.per_device(v.aval, axes)
                for v, axes in zip(outs[num_carry:], split[num_carry:], strict=False)
            )
            return split, peak + stacked
        if name == "while":
            body = params["body_jaxpr"].jaxpr
            cond_nconsts = params["cond_nconsts"]
            body_nconsts = params["body_nconsts"]
            operands = in_split[cond_nconsts:]
            num_carry = len(operands) - body_nconsts
            # As for a scan: the carries are the loop's own buffers, updated in place. The
            # trip count is not known from the program: the body counts once.
            split, peak = self.run(
                body,
                operands,
                trips=trips,
                manual=manual,
                owned=[i >= body_nconsts for i in range(len(operands))],
            )
            first = cond_nconsts + body_nconsts
            peak -= sum(
                self.per_device(v.aval, a)
                for v, a, own in zip(
                    eqn.invars[first:], operands[body_nconsts:], handed[first:], strict=True
                )
                if own
            )
            return split[-num_carry:] if num_carry else [], peak
        if name == "cond":
            best_peak = 0
            best: list[frozenset[str]] = [frozenset()] * len(outs)
            saved = dict(self.collectives)
            flops = self.flops
            branch_collectives = []
            branch_flops = []
            handed = self.handed[1:]  # the operands after the branch index
            for branch in params["branches"]:
                self.collectives = defaultdict(float)
                self.flops = 0.0
                self.handed = handed
                split, peak = self.call(branch.jaxpr, in_split[1:], trips=trips, manual=manual)
                branch_collectives.append(dict(self.collectives))
                branch_flops.append(self.flops)
                if peak >= best_peak:
                    best_peak, best = peak, split
            # The busiest branch per kind and axes, as the compiled program's bound counts it.
            merged: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float, saved)
            keys = {k for c in branch_collectives for k in c}
            for k in keys:
                merged[k] += max(c.get(k, 0.0) for c in branch_collectives)
            self.collectives = merged
            self.flops = flops + max(branch_flops, default=0.0)
            return best, best_peak
        if name in _ALL_REDUCE | _ALL_GATHER | _REDUCE_SCATTER or name in (
            "all_to_all",
            "ppermute",
        ):
            self.collective(eqn, in_split, trips)
            return [in_split[0] if in_split else frozenset()] * len(outs), 0
        if name == "dot_general":
            (lc, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            k = math.prod(lhs.shape[d] for d in lc)
            out = outs[0].aval
            split = self.largest_split(in_split)
            both = in_split[0] & in_split[1]
            (_, _), (lhs_batch, _) = params["dimension_numbers"]
            if both and lc and not lhs_batch:
                # Both operands split over the same automatic axes, contracted: each device
                # holds a partial product, summed by an all-reduce the compiler inserts (a
                # replicated weight's gradient under a split batch).
                split = (in_split[0] | in_split[1]) - both
                partial = self.per_device(out, split)
                group = self.group(sorted(both))
                self.add("all-reduce", tuple(sorted(both)), 2 * (1 - 1 / group) * partial, trips)
                flops = trips * 2.0 * k * math.prod(out.shape) / max(1, self.group(sorted(split)))
                self.flops += flops / group
                return [split] * len(outs), partial  # the partial sums, before the reduction
            self.flops += trips * 2.0 * k * math.prod(out.shape) / max(1, self.group(sorted(split)))
            return [split] * len(outs), 0
        if name in _REDUCTIONS and in_split and in_split[0] and 0 in params.get("axes", ()):
            # A reduction over the leading (batch) dimension of a split operand: partial
            # results, all-reduced by the compiler (a bias's gradient, a loss's mean).
            partial = self.per_device(outs[0].aval, frozenset())
            group = self.group(sorted(in_split[0]))
            self.add("all-reduce", tuple(sorted(in_split[0])), 2 * (1 - 1 / group) * partial, trips)
            return [frozenset()] * len(outs), partial
        if name == "scatter-add" and len(in_split) > 2 and in_split[2] and not in_split[0]:
            # Split updates into a whole operand (an embedding's gradient): each device adds
            # its rows, the compiler all-reduces the table.
            partial = self.per_device(outs[0].aval, frozenset())
            group = self.group(sorted(in_split[2]))
            self.add("all-reduce", tuple(sorted(in_split[2])), 2 * (1 - 1 / group) * partial, trips)
            return [frozenset()] * len(outs), partial
        if name in ("sharding_constraint", "reshard"):
            target = _sharding_axes(params.get("sharding"))
            gathered = tuple(sorted(in_split[0] - target - manual)) if in_split else ()
            if gathered:
                # Split where the target is whole: the compiler all-gathers it.
                group = self.group(gathered)
                result = self.per_device(outs[0].aval, target)
                self.add("all-gather", gathered, result * (1 - 1 / group), trips)
            return [target] * len(outs), 0
        return [self.same_shape_split(eqn, in_split, v) for v in outs], 0

    def views(self, jaxpr: Any) -> dict[Any, Any]:
        """The values of `jaxpr` that are views of another's buffer (through `_VIEWS` and
        calls or regions that return an operand as it came), each mapped to that value."""
        key = id(jaxpr)
        if key in self._views:
            return self._views[key][1]
        root: dict[Any, Any] = {}
        for eqn in jaxpr.eqns:
            operands = eqn.invars
            if eqn.primitive.name in _VIEWS:
                if operands and isinstance(operands[0], jex.Var):
                    root[eqn.outvars[0]] = root.get(operands[0], operands[0])
                continue
            sub = _called(eqn)
            if sub is None:
                continue
            for index, out in enumerate(eqn.outvars):
                source = self.forwarded(sub).get(index)
                if source is None or not isinstance(operands[source], jex.Var):
                    continue
                if eqn.primitive.name == "shard_map" and spec_axes(
                    eqn.params["in_specs"][source]
                ) != spec_axes(eqn.params["out_specs"][index]):
                    continue  # the region changes where it lives: a new buffer
                root[out] = root.get(operands[source], operands[source])
        self._views[key] = (jaxpr, root)  # the jaxpr is kept so its id stays its own
        return root

    def forwarded(self, jaxpr: Any) -> dict[int, int]:
        """Output index -> input index, for the outputs of `jaxpr` that are its inputs."""
        root = self.views(jaxpr)
        where = {v: i for i, v in enumerate(jaxpr.invars)}
        out = {}
        for index, v in enumerate(jaxpr.outvars):
            if isinstance(v, jex.Var) and root.get(v, v) in where:
                out[index] = where[root.get(v, v)]
        return out

    def call(
        self, jaxpr: Any, in_split: list[frozenset[str]], *, trips: float, manual: frozenset[str]
    ) -> tuple[list[frozenset[str]], int]:
        """`run` for a call whose operands that die at the call are handed to it."""
        handed = self.handed
        owned = [
            h and self.per_device(v.aval, a) > 0
            for h, v, a in zip(handed, jaxpr.invars, in_split, strict=True)
        ]
        split, peak = self.run(jaxpr, in_split, trips=trips, manual=manual, owned=owned)
        peak -= sum(
            self.per_device(v.aval, a)
            for own, v, a in zip(owned, jaxpr.invars, in_split, strict=True)
            if own
        )
        return split, peak

    @staticmethod
    def largest_split(in_split: list[frozenset[str]]) -> frozenset[str]:
        """The split over the most axes among the operands'."""
        return max(in_split, key=len, default=frozenset())

    def same_shape_split(
        self, eqn: Any, in_split: list[frozenset[str]], out: Any
    ) -> frozenset[str]:
        shape = getattr(out.aval, "shape", None)
        best: frozenset[str] | None = None
        for v, axes in zip(eqn.invars, in_split, strict=True):
            if getattr(v.aval, "shape", None) == shape and (best is None or len(axes) > len(best)):
                best = axes
        if best is not None:
            return best
        # A different shape (a reshape, a slice, keys split per example): the split of the
        # largest operand, where the result keeps its leading dimension (the batch, as a
        # model's global view splits it) or its number of dimensions.
        shape = tuple(shape or ())
        largest = max(
            zip(eqn.invars, in_split, strict=True),
            key=lambda pair: _nbytes(pair[0].aval),
            default=None,
        )
        if largest is None:
            return frozenset()
        operand = tuple(getattr(largest[0].aval, "shape", ()))
        if len(operand) == len(shape) or (operand and shape and operand[0] == shape[0]):
            return largest[1]
        return frozenset()

    def collective(self, eqn: Any, in_split: list[frozenset[str]], trips: float) -> None:
        name = eqn.primitive.name
        params = eqn.params
        axes = axis_names(params.get("axes", params.get("axis_name")))
        g = self.group(axes)
        share = (g - 1) / g if g > 0 else 0.0
        # In a region manual over some axes only, a value is still split over the others.
        operand = sum(self.per_device(v.aval, a) for v, a in zip(eqn.invars, in_split))
        result = sum(self.per_device(v.aval, a) for v, a in zip(eqn.outvars, in_split))
        if name in _ALL_REDUCE:
            self.add("all-reduce", axes, 2 * operand * share, trips)
        elif name in _ALL_GATHER:
            self.add("all-gather", axes, result * share, trips)
        elif name in _REDUCE_SCATTER:
            self.add("reduce-scatter", axes, operand * share, trips)
        elif name == "all_to_all":
            self.add("all-to-all", axes, operand * share, trips)
        elif name == "ppermute":
            pairs = len(params.get("perm", ()))
            self.add("collective-permute", axes, operand * pairs / max(1, g), trips)

    def region(
        self, eqn: Any, in_split: list[frozenset[str]], *, trips: float, manual: frozenset[str]
    ) -> tuple[list[frozenset[str]], int]:
        params = eqn.params
        newly = frozenset(params.get("newly_manual_axes", ()) or ())
        if not newly:
            newly = frozenset(params["mesh"].axis_names)
        inside_manual = manual | newly
        body = params["jaxpr"]
        body = body.jaxpr if isinstance(body, jex.ClosedJaxpr) else body
        inner_split = []
        for v, outer, spec in zip(eqn.invars, in_split, params["in_specs"], strict=True):
            wanted = spec_axes(spec)
            gathered = (outer & newly) - wanted
            if gathered:
                # Split over a manual axis the region wants whole: gathered on entry.
                local = _nbytes(v.aval) // max(1, self.group(sorted(wanted)))
                self.add(
                    "all-gather",
                    tuple(sorted(gathered)),
                    local * (1 - 1 / self.group(sorted(gathered))),
                    trips,
                )
            inner_split.append(outer - newly)
        split, peak = self.call(body, inner_split, trips=trips, manual=inside_manual)
        outs = [
            inner | (spec_axes(spec) & newly)
            for inner, spec in zip(split, params["out_specs"], strict=True)
        ]
        return outs, peak


def _scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """A scan's numbers of constants and carries (JAX >= 0.11 states them as flat trees)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _needed(jaxpr: Any) -> set[int]:
    """The equations of `jaxpr` that its outputs depend on, or that have effects."""
    wanted = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
    needed = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in wanted for v in eqn.outvars):
            needed.add(i)
            wanted.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return needed


def _called(eqn: Any) -> Any:
    """The jaxpr a call-like equation runs with its operands as they are (jit, remat,
    custom derivatives, `shard_map`), or None (loops, conditionals, other primitives)."""
    if eqn.primitive.name in ("scan", "while", "cond"):
        return None
    subs = list(jex.jaxprs_in_params(eqn.params))
    if len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
        return subs[0]
    return None


def program_figures(
    closed_jaxpr: Any,
    in_axes: Sequence[frozenset[str]],
    sizes: Mapping[str, int],
    *,
    donated: Sequence[bool],
) -> ProgramFigures:
    """Per-device figures of `closed_jaxpr`, whose flat inputs are split over `in_axes`
    (mesh axes of `sizes`), the inputs marked `donated` reusable for outputs."""
    walk = _Walk(sizes)
    jaxpr = closed_jaxpr.jaxpr
    in_axes = [frozenset(a) for a in in_axes]
    out_axes, peak = walk.run(jaxpr, in_axes, trips=1.0, manual=frozenset(), owned=donated)
    inputs = [walk.per_device(v.aval, a) for v, a in zip(jaxpr.invars, in_axes, strict=True)]
    outputs = [walk.per_device(v.aval, a) for v, a in zip(jaxpr.outvars, out_axes, strict=True)]
    # Outputs reuse donated inputs of the same size (as XLA aliases them).
    free = sorted(b for b, d in zip(inputs, donated, strict=True) if d)
    aliased = 0
    for b in sorted(outputs, reverse=True):
        if b in free:
            free.remove(b)
            aliased += b
    donated_bytes = sum(b for b, d in zip(inputs, donated, strict=True) if d)
    # `peak` counts donated inputs and everything made; temp is what is neither an input
    # nor an output.
    temp = max(0, peak - donated_bytes - sum(outputs) + aliased)
    return ProgramFigures(
        inputs=inputs,
        outputs=outputs,
        aliased=aliased,
        temp=temp,
        collectives=dict(walk.collectives),
        flops=walk.flops,
    )
