"""Reading collectives out of HLO text: which all-reduces, all-gathers, reduce-scatters,
all-to-alls and collective-permutes a step issues, of which dtypes and sizes, over which
device groups, and whether any sits inside a loop (where it would run once per
iteration, e.g. once per accumulation micro-batch).

Works on compiled HLO (`compiled.as_text()`) and on the program as lowered, before
XLA's optimisations (`lowered.as_text(dialect="hlo")`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

Shape = tuple[str, tuple[int, ...]]  # (dtype, dims)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES_PER_ELEMENT = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                      "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
                      "c64": 8, "c128": 16}
# Sub-byte integers count as one byte each (XLA's unpacked layout); every f8 variant is 1.
_SHAPE = re.compile(r"\b(pred|[su](?:2|4|8|16|32|64)|bf16|f16|f32|f64|c64|c128|f8e\w+?)"
                    r"\[([0-9,]*)\]")
# A computation header: `%name (params) -> type {` (compiled) or `name {` (as lowered).
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
# `[ROOT] %name = shape opcode(operands), attributes`; the shape may be a tuple.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COLLECTIVE_OPCODE = re.compile(rf"^({'|'.join(KINDS)})(-start|-done)?$")
_LOOP_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-,% ]+)")
_COMMENT = re.compile(r"/\*.*?\*/")
_INTS = re.compile(r"-?\d+")
# replica_groups in its three printed forms: a list of lists, an iota `[groups,size]<=[dims]`
# with an optional transpose `T(perm)`, and a mesh `mesh['a'=2,'b'=4][, device_ids=(..)] {'a'}`.
_GROUPS_LISTED = re.compile(r"replica_groups=(\{(?:\{[0-9,\s]*\},?\s*)*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([\w.\-]+)'?\s*=\s*(\d+)")


def _shapes_bytes(shapes: tuple[Shape, ...]) -> int:
    return sum(math.prod(dims) * _BYTES_PER_ELEMENT.get(dtype, 1) for dtype, dims in shapes)


def _parse_shapes(text: str) -> tuple[Shape, ...]:
    return tuple((dtype, tuple(int(d) for d in dims.split(",") if d))
                 for dtype, dims in _SHAPE.findall(text))


@dataclasses.dataclass(frozen=True)
class AllReduce:
    computation: str
    shapes: tuple[Shape, ...]  # (dtype, dims) of each operand
    in_loop: bool

    @property
    def bytes(self) -> int:
        return _shapes_bytes(self.shapes)

    @property
    def dtypes(self) -> set[str]:
        return {dtype for dtype, _ in self.shapes}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the program (an async `-start`/`-done` pair counts once).

    `shapes` are the op's result; for the async forms they are read from the `-done`,
    since a `-start` result also carries the operand and scratch buffers.
    `operand_shapes` are its inputs, found by name in the same computation; None when an
    operand could not be resolved. `replica_groups` lists the device ids of each group;
    None when the op lists none (collective-permute has source-target pairs instead, and
    `replica_groups={}` means "every device") or uses a form this reader does not expand
    (mesh sub-axes). `name` is the instruction's, e.g. `all-reduce.3`.
    """

    kind: str
    computation: str
    shapes: tuple[Shape, ...]
    replica_groups: tuple[tuple[int, ...], ...] | None
    in_loop: bool
    operand_shapes: tuple[Shape, ...] | None = None
    name: str = ""
    op_name: str = ""  # the JAX source scope from the metadata, e.g. '.../gradient_all_reduce/psum'

    @property
    def bytes(self) -> int:
        """Bytes of the result on one device."""
        return _shapes_bytes(self.shapes)

    @property
    def operand_bytes(self) -> int | None:
        """Bytes of the inputs on one device: for a reduce-scatter, group size x result."""
        return None if self.operand_shapes is None else _shapes_bytes(self.operand_shapes)

    @property
    def scalar_bytes(self) -> int:
        """Bytes of the rank-0 results, e.g. metric scalars riding along with gradients."""
        return _shapes_bytes(tuple(shape for shape in self.shapes if not shape[1]))

    @property
    def dtypes(self) -> set[str]:
        return {dtype for dtype, _ in self.shapes}

    @property
    def group_size(self) -> int | None:
        """Devices per replica group, when the groups are known and all the same size."""
        sizes = {len(group) for group in self.replica_groups or ()}
        return sizes.pop() if len(sizes) == 1 else None

    def ring_bytes_sent(self, device_count: int) -> float:
        """Bytes each device sends for this op with ring algorithms, bandwidth-bound: an
        all-reduce 2 (N-1)/N of its buffer, an all-gather (N-1)/N of its result, a
        reduce-scatter (N-1)/N of its input. N is the group size (`device_count` when the
        op lists no groups); other kinds count their result once."""
        n = self.group_size or device_count
        share = (n - 1) / n
        if self.kind == "all-reduce":
            return 2 * share * self.bytes
        if self.kind == "all-gather":
            return share * self.bytes
        if self.kind == "reduce-scatter":
            return share * (self.operand_bytes or n * self.bytes)
        if self.kind == "all-to-all":
            return share * self.bytes
        return float(self.bytes)

    def traffic(self, host_of: dict[int, int]) -> Traffic:
        """Where this op's bytes go, with devices on hosts as `host_of` (a device's position
        in the mesh -> host) says, for ring algorithms with each group's devices in host
        order.

        A group within one host sends only inside it. A ring through a group on h > 1
        hosts leaves each of those hosts over one link, which carries what one device
        sends; the group's other links stay inside hosts. An all-to-all sends each
        member its share directly, across hosts to the members on other hosts.
        """
        groups = self.replica_groups or (tuple(sorted(host_of)),)
        hosts = sorted(set(host_of.values()))
        intra = {host: 0.0 for host in hosts}  # the busiest device's sends inside its host
        cross = {host: 0.0 for host in hosts}  # sends leaving the host, all its devices
        for group in groups:
            n = len(group)
            if n < 2:
                continue
            on = [host_of[device] for device in group]
            per_device = self.ring_bytes_sent(n)
            for host in set(on):
                if self.kind == "all-to-all":
                    members, others = on.count(host), n - on.count(host)
                    cross[host] += members * self.bytes * others / n
                    intra[host] = max(intra[host], self.bytes * (members - 1) / n)
                elif len(set(on)) > 1:
                    cross[host] += per_device
                    if on.count(host) > 1:
                        intra[host] = max(intra[host], per_device)
                else:
                    intra[host] = max(intra[host], per_device)
        return Traffic(intra_device_bytes=max(intra.values()),
                       cross_host_bytes=max(cross.values()), kind=self.kind)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One collective's bytes on the busiest device inside its host, and leaving the
    busiest host."""

    intra_device_bytes: float
    cross_host_bytes: float
    kind: str = ""  # the collective's (`KINDS`)

    def time_s(self, intra_bytes_per_s: float, cross_bytes_per_s: float) -> float:
        """Modelled time: the slower of the two kinds of link, each at its bandwidth
        (a device's within the host, the host's across hosts)."""
        return max(self.intra_device_bytes / intra_bytes_per_s,
                   self.cross_host_bytes / cross_bytes_per_s)


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


def _split_operands(rest: str) -> list[str]:
    """The top-level comma-separated operands of `rest`, the text after `opcode(`."""
    operands, depth, start = [], 0, 0
    for i, char in enumerate(rest):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                operands.append(rest[start:i])
                break
            depth -= 1
        elif char == "," and depth == 0:
            operands.append(rest[start:i])
            start = i + 1
    return [op.strip() for op in operands if op.strip()]


def _operand_shapes(rest: str, defined: dict[str, tuple[Shape, ...]]
                    ) -> tuple[Shape, ...] | None:
    shapes: list[Shape] = []
    for operand in _split_operands(_COMMENT.sub("", rest)):
        name = operand.split()[-1].lstrip("%")  # some printers write `f32[8]{0} %x`
        if name not in defined:
            return None
        shapes.extend(defined[name])
    return tuple(shapes)


def _iota(reshape_dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in _INTS.findall(text or "")]


def _mesh_groups(axes_text: str, device_ids_text: str | None, grouped_text: str
                 ) -> np.ndarray | None:
    """Groups of `mesh[...] {axes}`: devices that differ only along the grouped axes."""
    axes = _MESH_AXIS.findall(axes_text)
    names = [name for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    grouped = [g.strip().strip("'") for g in grouped_text.split(",") if g.strip()]
    if any(g not in names for g in grouped):
        return None  # a sub-axis such as 'a':(1)2
    if device_ids_text is None:
        ids = np.arange(math.prod(sizes))
    elif match := re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", device_ids_text):
        ids = _iota(_ints(match.group(1)), _ints(match.group(2)) or None)
    else:
        ids = np.array(_ints(device_ids_text))
    if ids.size != math.prod(sizes):
        return None
    grouped_axes = [names.index(g) for g in grouped]
    others = [i for i in range(len(names)) if i not in grouped_axes]
    group_size = math.prod(sizes[i] for i in grouped_axes)
    return ids.reshape(sizes).transpose(others + grouped_axes).reshape(-1, group_size)


def parse_replica_groups(attributes: str) -> tuple[tuple[int, ...], ...] | None:
    """The device groups in an instruction's `replica_groups=...`, expanded to id lists."""
    if match := _GROUPS_LISTED.search(attributes):
        inner = match.group(1)[1:-1]  # `{}` alone: every device, not listed
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,\s]*)\}", inner))
        return groups or None
    if match := _GROUPS_IOTA.search(attributes):
        shape = _ints(match.group(1))
        array = _iota(_ints(match.group(2)), _ints(match.group(3)) or None).reshape(shape)
    elif match := _GROUPS_MESH.search(attributes):
        array = _mesh_groups(*match.groups())
        if array is None:
            return None
    else:
        return None
    return tuple(tuple(int(i) for i in row) for row in array.reshape(array.shape[0], -1))


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op in `hlo_text`, in program order within each computation."""
    bodies = _computations(hlo_text)
    in_loops = _inside_loops(bodies)
    found = []
    for computation, lines in bodies.items():
        parsed = [m.groups() for m in map(_INSTRUCTION.match, lines) if m]
        defined = {name: _parse_shapes(shape) for name, shape, _, _ in parsed}
        done_shapes = {}  # -start name -> result shapes of its -done
        for _, shape, opcode, rest in parsed:
            if opcode.endswith("-done"):
                operands = _split_operands(_COMMENT.sub("", rest))
                if operands:
                    done_shapes[operands[0].split()[-1].lstrip("%")] = _parse_shapes(shape)
        for name, shape, opcode, rest in parsed:
            match = _COLLECTIVE_OPCODE.match(opcode)
            if not match or match.group(2) == "-done":
                continue
            shapes = done_shapes.get(name, _parse_shapes(shape))
            found.append(Collective(
                kind=match.group(1), computation=computation, shapes=shapes,
                replica_groups=parse_replica_groups(rest), in_loop=computation in in_loops,
                operand_shapes=_operand_shapes(rest, defined), name=name,
                op_name=next(iter(_OP_NAME.findall(rest)), "")))
    return found


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def all_reduces(hlo_text: str) -> list[AllReduce]:
    """The all-reduces of `hlo_text` (async ones once)."""
    return [AllReduce(c.computation, c.shapes, c.in_loop)
            for c in collectives(hlo_text) if c.kind == "all-reduce"]
