"""Reading collectives out of HLO text: how many all-reduces a step issues,
of which dtypes and sizes, and whether any sits inside a loop (where it would
run once per iteration, e.g. once per accumulation micro-batch).

Works on compiled HLO (`compiled.as_text()`) and on the program as lowered,
before XLA's optimisations (`lowered.as_text(dialect="hlo")`).
"""

from __future__ import annotations

import dataclasses
import re

_BYTES_PER_ELEMENT = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                      "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[([0-9,]*)\]")
# A computation header: `%name (params) -> type {` (compiled) or `name {` (as lowered).
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")
_LOOP_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-,% ]+)")


@dataclasses.dataclass(frozen=True)
class AllReduce:
    computation: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each operand
    in_loop: bool

    @property
    def bytes(self) -> int:
        total = 0
        for dtype, dims in self.shapes:
            count = 1
            for d in dims:
                count *= d
            total += count * _BYTES_PER_ELEMENT[dtype]
        return total

    @property
    def dtypes(self) -> set[str]:
        return {dtype for dtype, _ in self.shapes}


def _computations(hlo_text: str) -> dict[str, list[str]]:
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line.strip())
        if match and not line.startswith(" "):
            current = match.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    return bodies


def _inside_loops(bodies: dict[str, list[str]]) -> set[str]:
    """Computations that run inside a while loop, directly or through calls."""
    inside = {name for lines in bodies.values() for line in lines
              for name in _LOOP_BODY.findall(line)}
    frontier = list(inside)
    while frontier:
        for line in bodies.get(frontier.pop(), []):
            for group in _CALLS.findall(line):
                for name in re.split(r"[,\s%]+", group):
                    if name and name in bodies and name not in inside:
                        inside.add(name)
                        frontier.append(name)
    return inside


def all_reduces(hlo_text: str) -> list[AllReduce]:
    bodies = _computations(hlo_text)
    in_loops = _inside_loops(bodies)
    found = []
    for name, lines in bodies.items():
        for line in lines:
            match = _ALL_REDUCE.search(line)
            if match:
                shapes = tuple((dtype, tuple(int(d) for d in dims.split(",") if d))
                               for dtype, dims in _SHAPE.findall(match.group(1)))
                found.append(AllReduce(name, shapes, name in in_loops))
    return found
