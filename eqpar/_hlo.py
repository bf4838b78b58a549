"""What a compiled program asks the interconnect and memory to do, read off its HLO.

Used by the tests (the collectives move what they should) and by `benchmarks/`.
"""

import dataclasses
import re
from typing import Any

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<type>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(_KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective in a compiled program.

    `bytes_per_device` is what each participating device receives for it over the
    interconnect, using ring algorithms: `(g - 1) / g` of the gathered result for all-gather,
    of the operand for reduce-scatter and all-to-all, twice that for all-reduce, and the whole
    block for a collective-permute (`g` is the replica group size).
    """

    kind: str
    array_bytes: int
    group_size: int
    bytes_per_device: float


def _array_bytes(type_text: str) -> list[int]:
    sizes = []
    for dtype, dims in _ARRAY.findall(type_text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        sizes.append(count * _ITEMSIZE.get(dtype, 4))
    return sizes


def _group_size(line: str) -> int:
    listed = _GROUPS_LIST.search(line)
    if listed:
        return len(listed.group(1).split("}")[0].strip("{").split(","))
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(2))
    return 1


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """Every collective of a compiled HLO module (`compiled.as_text()`), in program order."""
    ops = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if not match:
            continue
        kind, sizes = match["op"], _array_bytes(match["type"])
        if not sizes:
            continue
        # async "-start" results are tuples (operand, result, ...); plain ops give the result
        operand = sizes[0]
        result = sizes[1] if match["start"] and len(sizes) > 1 else sizes[0]
        if kind == "collective-permute":
            group, moved = 2, float(operand)
        else:
            group = _group_size(line)
            share = (group - 1) / group
            if kind == "all-gather":
                moved = result * share
            elif kind == "all-reduce":
                moved = 2 * result * share
            elif kind == "reduce-scatter":
                moved = result * group * share
            else:  # all-to-all
                moved = result * share
        ops.append(CollectiveOp(kind, result, group, moved))
    return ops


def collective_bytes(hlo_text: str) -> float:
    """Bytes each device receives over the interconnect for one run of the program."""
    return sum(op.bytes_per_device for op in collective_ops(hlo_text))


def memory_figures(compiled: Any) -> dict[str, int]:
    """Per-device memory of a compiled program from `compiled.memory_analysis()`.

    `total` is argument + output + temp - alias: on CPU the reported peak ignores temp.
    """
    stats = compiled.memory_analysis()
    figures = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
    }
    figures["total"] = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
    return figures
