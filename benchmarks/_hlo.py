"""What a compiled program asks of the interconnect and of memory, read off the compiler.

A support module of `benchmarks/` and `tests/` (not part of the eqpar package: it measures
programs, it does not build them). `tests/conftest.py` and every benchmark put this folder on
`sys.path`, so both import it as `_hlo`:

- `collective_ops(compiled_or_text)`: every collective of a compiled SPMD program with the bytes
  one device receives for it, counting ops inside `while` loops (`lax.scan`, `fori_loop`) once
  per iteration when the compiler knows the trip count;
- `collective_summary(...)` / `collective_bytes(...)`: the same, totalled per kind / overall;
- `memory_figures(compiled)`: `memory_analysis()` per device, with `total` =
  argument + output + temp - alias (on CPU the reported peak ignores temp);
- `compile_timed(jitted, *args)`, `median_seconds(fn, *args)` and
  `paired_median_seconds((fn, args), (baseline, args))` for compile and step times;
- `collective_bytes_by_axes(compiled_or_text, axis_sizes)`: the same bytes per set of mesh axes
  that each collective's device groups span (`device_groups(line)` reads the groups);
- `format_bytes(n)`.

The compiled text of an SPMD program is the program of one device, so every shape in it is a
per-device shape. Bytes per device follow ring algorithms over a replica group of size `g`:
all-gather receives `(g-1)/g` of its result, reduce-scatter `(g-1)/g` of its operand
(`g` x the result), all-to-all `(g-1)/g` of its result, all-reduce twice that of its result
(reduce-scatter then all-gather), and collective-permute its whole block on the devices that
receive one: `pairs / num_partitions` of it on average, from its `source_target_pairs` (a
pipeline's shift that leaves out the wrap-around moves `(S-1)/S` of a full ring's bytes).

```python
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from _hlo import collective_summary, memory_figures
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
f = jax.jit(lambda w: w.sum(0), in_shardings=NamedSharding(mesh, P("data")))
compiled = f.lower(jnp.ones((64, 128))).compile()
summary = collective_summary(compiled)
assert summary.counts == {"all-reduce": 1}
assert summary.bytes["all-reduce"] == 2 * 128 * 4 * 7 / 8
assert memory_figures(compiled)["argument"] == 64 * 128 * 4 // 8
```
"""

import dataclasses
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

ITEMSIZE = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]\w*)\[(?P<dims>[\d,]*)\]")
_CALLEE_SINGLE = re.compile(
    r"\b(?P<attr>body|calls|to_apply|true_computation|false_computation)=%?(?P<name>[^\s,{}()]+)"
)
_CALLEE_LIST = re.compile(r"\b(?P<attr>branch_computations|calls)=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=(?:\(\[[\d,]+\](?:T\([\d,]+\))?\)|\[[\d,]*\]))?"
    r"\s*\{(?P<used>[^}]*)\}"
)
_GROUPS_LIST = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]")
_GROUPS_EMPTY = re.compile(r"replica_groups=\{\}")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled program.

    `array_bytes`: its result on one device (summed over a tuple result); `group_size`: devices
    in its replica group; `bytes_per_device`: what one device receives per execution;
    `executions`: how often it runs per program run (the product of enclosing loop trip counts);
    `in_conditional`: whether it sits in a branch of a `conditional` (`lax.switch`, `lax.cond`),
    at any depth. Such an op is counted as part of its conditional's busiest branch, as if that
    branch ran at every execution (see `collective_ops`), so its `executions` is an upper bound;
    an op with `in_conditional=False` runs exactly `executions` times.
    """

    kind: str
    name: str
    array_bytes: int
    group_size: int
    bytes_per_device: float
    executions: int = 1
    # The devices (partition ids) that exchange data: its replica groups, or for a
    # collective-permute each source-target pair.
    groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), compare=False, repr=False)
    in_conditional: bool = False
    # Whether it sits in the body of a `while` loop whose trip count the compiler does not
    # state (a `fori_loop` with a bound computed at run time), at any depth: counted once.
    in_unknown_loop: bool = False
    # The fraction of its `executions` that run: 1, or for a branch counted at the share of
    # its conditional's executions that take it (`collective_ops(shares=...)`).
    share: float = 1.0


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """Collectives of one program run, per kind: `counts` (executions) and `bytes` (received
    by one device). `loops_without_trip_count` counts `while` loops whose body was counted
    once because the compiler did not state a trip count."""

    counts: dict[str, int]
    bytes: dict[str, float]
    loops_without_trip_count: int = 0

    @property
    def total_count(self) -> int:
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())


def _jax_compiled(compiled: Any) -> Any:
    """Accept `eqx.filter_jit(...).lower(...).compile()` too: it wraps JAX's `Compiled`."""
    inner = getattr(compiled, "compiled", None)
    return inner if inner is not None and hasattr(inner, "as_text") else compiled


def _text(compiled_or_text: Any) -> str:
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    return _jax_compiled(compiled_or_text).as_text()


def _split_type(rest: str) -> tuple[str, str]:
    """`'(f32[2], f32[4]{0}) all-reduce(...), ...'` -> (type text, remainder)."""
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):
            depth += char == "("
            depth -= char == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _array_bytes(type_text: str) -> list[int]:
    sizes = []
    for match in _ARRAY.finditer(type_text):
        count = 1
        for dim in filter(None, match["dims"].split(",")):
            count *= int(dim)
        sizes.append(count * ITEMSIZE.get(match["dtype"], 4))
    return sizes


def _group_size(line: str, num_partitions: int) -> int:
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        sizes = {
            name.strip().strip("'\""): int(size)
            for name, size in (axis.split("=") for axis in mesh["axes"].split(",") if "=" in axis)
        }
        used = [name.strip().strip("'\"") for name in mesh["used"].split(",") if name.strip()]
        group = 1
        for name in used or sizes:
            group *= sizes[name]
        return group
    listed = _GROUPS_LIST.search(line)
    if listed:
        return len([i for i in listed["first"].split(",") if i])
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota["size"])
    if _GROUPS_EMPTY.search(line):
        return num_partitions
    return num_partitions


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _permute_share(line: str, num_partitions: int) -> float:
    """The mean share of devices that receive a block of a collective-permute."""
    pairs = _PAIRS.search(line)
    if not pairs or num_partitions < 1:
        return 1.0
    return min(1.0, pairs.group(1).count("{") / num_partitions)


_LIST_GROUPS = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=(?P<ids>\(\[[\d,]+\](?:T\([\d,]+\))?\)|\[[\d,]*\]))?"
    r"\s*\{(?P<used>[^}]*)\}"
)
_IOTA = re.compile(r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


def _ints(text: str) -> list[int]:
    return [int(i) for i in text.split(",") if i.strip()]


def _iota(dims: list[int], perm: list[int] | None) -> Any:
    """XLA's iota tile assignment: `arange` reshaped to `dims`, transposed by `perm`."""
    import numpy as np

    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def device_groups(line: str, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    """The device groups (partition ids) of one collective instruction of a compiled program.

    Reads the forms XLA prints: listed groups `{{0,1},{2,3}}`, iota groups
    `[2,4]<=[4,2]T(1,0)`, mesh groups `mesh['a'=2,'b'=4], device_ids=(...) {'b'}`, `{}` (all
    devices in one group), and a collective-permute's `source_target_pairs` (each pair a
    group). A line it cannot read gives one group of all `num_partitions` devices.
    """
    import numpy as np

    pairs = _PAIRS.search(line)
    if pairs and "collective-permute" in line:
        return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))
    mesh = _MESH_GROUPS.search(line)
    if mesh:
        named = [axis.split("=") for axis in mesh["axes"].split(",") if "=" in axis]
        names = [name.strip().strip("'\"") for name, _ in named]
        sizes = [int(size) for _, size in named]
        ids_text = mesh["ids"]
        if ids_text is None:
            ids = np.arange(int(np.prod(sizes)))
        elif ids_text.startswith("("):
            iota = _IOTA.search(ids_text)
            assert iota is not None
            perm = _ints(iota["perm"]) if iota["perm"] else None
            ids = _iota(_ints(iota["dims"]), perm)
        else:
            ids = np.array(_ints(ids_text[1:-1]))
        ids = ids.reshape(sizes)
        used = [name.strip().strip("'\"") for name in mesh["used"].split(",") if name.strip()]
        used_axes = [names.index(name) for name in used] if used else list(range(len(sizes)))
        rest = [axis for axis in range(len(sizes)) if axis not in used_axes]
        size = int(np.prod([sizes[axis] for axis in used_axes]))
        ids = ids.transpose(rest + used_axes).reshape(-1, size)
        return tuple(tuple(int(i) for i in row) for row in ids)
    iota = _IOTA_GROUPS.search(line)
    if iota:
        perm = _ints(iota["perm"]) if iota["perm"] else None
        ids = _iota(_ints(iota["dims"]), perm).reshape(int(iota["groups"]), int(iota["size"]))
        return tuple(tuple(int(i) for i in row) for row in ids)
    listed = _LIST_GROUPS.search(line)
    if listed and listed["groups"]:
        return tuple(tuple(_ints(group)) for group in re.findall(r"\{([\d,]*)\}", listed["groups"]))
    return (tuple(range(num_partitions)),)


def group_axes(groups: tuple[tuple[int, ...], ...], axis_sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of `groups` differ, in mesh order.

    Partition id `i` is the device at `numpy.unravel_index(i, sizes)` of a mesh with these
    axis sizes (JAX assigns a mesh's devices to partitions in its row-major order)."""
    import numpy as np

    names, sizes = list(axis_sizes), list(axis_sizes.values())
    varying = np.zeros(len(sizes), bool)
    for group in groups:
        if len(group) > 1:
            coords = np.stack(np.unravel_index(np.array(group), sizes), axis=1)
            varying |= (coords != coords[0]).any(axis=0)
    return tuple(name for name, vary in zip(names, varying) if vary)


def collective_bytes_by_axes(
    compiled_or_text: Any, axis_sizes: dict[str, int]
) -> dict[tuple[str, ...], float]:
    """Bytes one device receives in one run of the program, per set of mesh axes.

    Each collective counts towards the axes its device groups span (`group_axes`): `("data",)`
    for a gradient all-reduce over `data`, `("data", "pipe")` for one over both, `()` for
    groups of one device and for a collective-permute whose devices all send to themselves
    (both move nothing, so count 0 bytes there). Bytes follow the same ring model as
    `collective_ops`, with the group size read from the groups themselves; a
    collective-permute counts its block on the share of devices that receive one.

    **Arguments:**

    - `compiled_or_text`: a compiled program or its `as_text()`.
    - `axis_sizes`: the mesh's axis names and sizes in mesh order, e.g.
      `dict(mesh.shape)` of a `jax.sharding.Mesh`.

    **Returns:** `{axes: bytes}` for every set of axes some collective spans.
    """
    return bytes_by_axes_of(collective_ops(compiled_or_text), axis_sizes)


def bytes_by_axes_of(ops: list[CollectiveOp], axis_sizes: dict[str, int]) -> dict:
    """`collective_bytes_by_axes` of some of a program's collectives (`collective_ops`)."""
    totals: dict[tuple[str, ...], float] = {}
    count = 1
    for size in axis_sizes.values():
        count *= size
    for op in ops:
        axes = group_axes(op.groups, axis_sizes)
        if op.kind == "collective-permute":
            moving = sum(1 for pair in op.groups if pair[0] != pair[1])
            received = op.array_bytes * min(1.0, moving / count) if axes else 0.0
        else:
            group = max((len(g) for g in op.groups), default=count)
            received = _received(op.kind, op.array_bytes, group)
        totals[axes] = totals.get(axes, 0.0) + op.executions * op.share * received
    return totals


def _received(kind: str, result: int, group: int) -> float:
    share = (group - 1) / group if group > 0 else 0.0
    if kind == "collective-permute":
        return float(result)
    if kind == "all-reduce":
        return 2 * result * share
    if kind == "reduce-scatter":
        return result * group * share
    return result * share  # all-gather, all-to-all


def _parse(text: str):
    """Computations as {name: (collectives, [(callees, multiplier, branches)], unknown_loops)}
    and the entry's name; `callees` is one name, or with `branches` a conditional's branches
    (of which one runs: `branch_computations`, or `true_computation` and
    `false_computation`)."""
    partitions = re.search(r"num_partitions=(\d+)", text)
    num_partitions = int(partitions.group(1)) if partitions else 1
    computations: dict[
        str, tuple[list[CollectiveOp], list[tuple[tuple[str, ...], int, bool, bool]], int]
    ] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith((" ", "\t")):
                current = header["name"]
                computations[current] = ([], [], 0)
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction:
            continue
        type_text, remainder = _split_type(instruction["rest"])
        opcode = remainder.split("(", 1)[0].strip()
        ops, callees, unknown = computations[current]
        base = opcode.removesuffix("-start")
        if base in KINDS and not opcode.endswith("-done"):
            sizes = _array_bytes(type_text)
            if opcode.endswith("-start") and len(sizes) > 1 and base != "all-reduce":
                result = sizes[1]  # async start results are (operand, result, ...)
            else:
                result = sum(sizes)
            group = 2 if base == "collective-permute" else _group_size(line, num_partitions)
            received = _received(base, result, group)
            if base == "collective-permute":
                received *= _permute_share(line, num_partitions)
            groups = device_groups(line, num_partitions)
            ops.append(CollectiveOp(base, instruction["name"], result, group, received, 1, groups))
        multiplier, unknown_trip = 1, False
        if opcode == "while":
            trip = _TRIP_COUNT.search(line)
            if trip:
                multiplier = int(trip["n"])
            else:
                unknown += 1
                unknown_trip = True
        predicated = []  # a conditional on a predicate: its true and false computations
        for match in _CALLEE_SINGLE.finditer(line):
            if match["attr"] in ("true_computation", "false_computation"):
                predicated.append(match["name"])
            else:
                body = match["attr"] == "body"
                callees.append(
                    ((match["name"],), multiplier if body else 1, False, body and unknown_trip)
                )
        if predicated:
            callees.append((tuple(predicated), 1, True, False))
        for match in _CALLEE_LIST.finditer(line):
            names = [n.strip().lstrip("%") for n in match["names"].split(",") if n.strip()]
            if match["attr"] == "branch_computations":
                callees.append((tuple(names), 1, True, False))
            else:
                callees.extend(((name,), 1, False, False) for name in names)
        computations[current] = (ops, callees, unknown)
    if entry is None:
        raise ValueError("no ENTRY computation found: pass compiled.as_text() of a program.")
    return computations, entry


def collective_ops(
    compiled_or_text: Any,
    shares: Callable[[list[list[CollectiveOp]]], list[float] | None] | None = None,
) -> list[CollectiveOp]:
    """Every collective of a compiled program (a `Compiled` or its `as_text()`), each with
    `executions` = how often one program run executes it (loop trip counts multiplied in).
    A conditional runs one of its branches, which the program text does not say: its
    collectives are those of the branch that moves the most bytes (an upper bound). A loop
    whose steps take different branches (the pipeline executors send only what each step's
    actions need) is therefore counted as if every step took the busiest one; the ops so
    counted have `in_conditional=True`, the others run exactly as often as counted.

    `shares(branches)`, where the caller knows how often each branch runs (a schedule's
    table does), gives for a conditional's branches (their collectives, in branch order)
    the fraction of its executions that take each one (or `None`: the busiest branch): every
    branch's collectives are then counted, each with that `share`."""
    computations, entry = _parse(_text(compiled_or_text))

    def visit(
        name: str, executions: int, path: tuple[str, ...], in_branch: bool, in_loop: bool
    ) -> list[CollectiveOp]:
        if name not in computations or name in path:
            return []
        ops, callees, _ = computations[name]
        found = [
            dataclasses.replace(
                op, executions=executions, in_conditional=in_branch, in_unknown_loop=in_loop
            )
            for op in ops
        ]
        for names, multiplier, branches, unknown_loop in callees:
            reached = [
                visit(
                    n,
                    executions * multiplier,
                    (*path, name),
                    in_branch or branches,
                    in_loop or unknown_loop,
                )
                for n in names
            ]
            weights = shares(reached) if branches and shares is not None else None
            if weights is None:
                found.extend(max(reached, key=_moved))
                continue
            for ops, weight in zip(reached, weights):
                found.extend(dataclasses.replace(op, share=op.share * weight) for op in ops)
        return found

    return visit(entry, 1, (), False, False)


def _moved(ops: list[CollectiveOp]) -> float:
    return float(sum(op.executions * op.share * op.bytes_per_device for op in ops))


def collective_summary(compiled_or_text: Any) -> CollectiveSummary:
    """Collectives per kind for one run of the program: executions and bytes per device."""
    text = _text(compiled_or_text)
    counts: dict[str, int] = {}
    received: dict[str, float] = {}
    for op in collective_ops(text):
        counts[op.kind] = counts.get(op.kind, 0) + op.executions
        received[op.kind] = received.get(op.kind, 0.0) + op.executions * op.bytes_per_device
    computations, _ = _parse(text)
    unknown = sum(entry[2] for entry in computations.values())
    return CollectiveSummary(counts, received, unknown)


def collective_bytes(compiled_or_text: Any) -> float:
    """Bytes one device receives over the interconnect in one run of the program."""
    return collective_summary(compiled_or_text).total_bytes


def per_device_bytes(tree: Any) -> int:
    """The most any one device holds of the array shards in `tree` (0 for no arrays)."""
    import equinox as eqx
    import jax

    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values(), default=0)


def memory_figures(compiled: Any) -> dict[str, int]:
    """Per-device memory of a compiled program from `compiled.memory_analysis()`: `argument`,
    `output`, `temp`, `alias`, and `total` = argument + output + temp - alias."""
    stats = _jax_compiled(compiled).memory_analysis()
    figures = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
    }
    figures["total"] = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
    return figures


def compile_timed(jitted: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """`jitted.lower(*args, **kwargs).compile()` (a `jax.jit` or `eqx.filter_jit` function) and
    the seconds it took."""
    start = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    return compiled, time.perf_counter() - start


def median_seconds(fn: Callable, *args: Any, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn(*args)` (waiting for its results) over `repeats` runs."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_median_seconds(
    first: tuple[Callable, tuple], second: tuple[Callable, tuple], *, repeats: int = 5
) -> tuple[float, float]:
    """Median wall times of two `(fn, args)` runs measured alternately, so that load from other
    processes falls on both alike; for ratios of one to the other."""
    import jax

    for fn, args in (first, second):
        jax.block_until_ready(fn(*args))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for (fn, args), bucket in zip((first, second), times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def format_bytes(n: int | float) -> str:
    """`1536` -> `'1.50 KiB'`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
