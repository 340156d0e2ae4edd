"""Reading the collectives out of a compiled (partitioned) HLO module's text.

Used to check a plan's predicted collectives against what XLA compiled. Byte counts follow
the HLO result shape of each collective, per device (for an asynchronous `*-start` op, the
result buffer of its tuple).

`entry_schedule` reads the order a compiled module runs its entry computation in (a
compiled module is scheduled: its entry's instructions are listed in execution order),
so a test can see where each collective sits among the backward's operators.
"""

from __future__ import annotations

import dataclasses
import math
import re

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+"
                   r"(?P<op>" + "|".join(_KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")


@dataclasses.dataclass(frozen=True)
class HloCollective:
    kind: str
    nbytes: int          # per device, result shape (summed over a tuple result)
    num_results: int     # tuple arity (a combined all-reduce carries several tensors)
    group_size: int = 0  # devices per replica group; 0 when the HLO does not say

    def sent_bytes(self, num_devices: int) -> float:
        """Bytes one device sends for this op with ring algorithms (all-reduce 2(n-1)/n of
        its buffer, all-gather and all-to-all (n-1)/n of their result, reduce-scatter
        (n-1) times its result); `num_devices` is the group size when the HLO gives none."""
        n = self.group_size or num_devices
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
                  "all-to-all": (n - 1) / n, "reduce-scatter": n - 1,
                  "collective-permute": 1.0}[self.kind]
        return factor * self.nbytes


def _group_size(line: str) -> int:
    m = _GROUPS_LIST.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = _GROUPS_IOTA.search(line)
    return int(m.group(2)) if m else 0


def _shape_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in _ITEMSIZE:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * _ITEMSIZE[dtype])
    return out


def collectives_in_hlo(hlo_text: str) -> list[HloCollective]:
    """Every collective op in a compiled HLO module (done-ops are not counted twice)."""
    found = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        sizes = _shape_bytes(m.group("shape"))
        if m.group("start") and m.group("op") in ("all-gather", "collective-permute",
                                                  "all-to-all", "reduce-scatter") \
                and len(sizes) >= 2:
            sizes = sizes[len(sizes) // 2:]   # (operands..., results...)
        found.append(HloCollective(m.group("op"), sum(sizes), len(sizes), _group_size(line)))
    return found


def bytes_by_kind(collectives) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.nbytes
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class CompiledCollective:
    """Collectives of one kind and size in one compiled program, and how many times one
    step runs them (`count` = ops in the program x runs of the program per step)."""
    program: str         # e.g. "step", "stage 0 backward"
    kind: str
    nbytes: int          # per device, per op
    count: int


def compiled_collectives(hlo_text: str, program: str, runs: int = 1
                         ) -> tuple[CompiledCollective, ...]:
    """The collectives of `hlo_text`, grouped by kind and size, counted `runs` times."""
    groups: dict[tuple[str, int], int] = {}
    for c in collectives_in_hlo(hlo_text):
        groups[(c.kind, c.nbytes)] = groups.get((c.kind, c.nbytes), 0) + runs
    return tuple(CompiledCollective(program, k, n, cnt) for (k, n), cnt in sorted(groups.items()))


# One instruction: "%name = shape opcode(" where a tuple shape is parenthesised.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Operators that do the work of a backward (everything else moves or views data).
COMPUTE_OPCODES = frozenset({"fusion", "dot", "convolution", "custom-call", "reduce",
                             "reduce-window", "select-and-scatter", "sort", "scatter"})


@dataclasses.dataclass(frozen=True)
class ScheduledOp:
    """One instruction of a compiled entry computation, in execution order.

    Attributes:
      position: its place in the schedule (0 first).
      name: the HLO instruction name.
      opcode: e.g. "fusion", "dot", "all-reduce", "all-reduce-start".
      nbytes: its result's bytes per device (summed over a tuple).
      op_name: the JAX operation it came from (metadata; "" where none), which carries
        "transpose(jvp(...))" for the backward's operators.
    """
    position: int
    name: str
    opcode: str
    nbytes: int
    op_name: str

    @property
    def is_backward_compute(self) -> bool:
        """A compute operator (`COMPUTE_OPCODES`) of the backward pass."""
        return self.opcode in COMPUTE_OPCODES and "transpose(" in self.op_name


def _split_shape(rest: str) -> tuple[str, str]:
    """(shape text, what follows it) of an instruction's right-hand side."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i + 1], rest[i + 1:].lstrip()
    return rest, ""


def entry_schedule(hlo_text: str) -> tuple[ScheduledOp, ...]:
    """The entry computation of a compiled module, instruction by instruction in the order
    it runs (parameters, tuples and constants left out)."""
    lines = hlo_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
    if start is None:
        raise ValueError("no ENTRY computation in this HLO text; pass a compiled module's "
                         "as_text()")
    ops = []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        shape, tail = _split_shape(m.group("rest"))
        opcode = tail.partition("(")[0].strip()
        if opcode in ("parameter", "constant", "tuple", "get-tuple-element", ""):
            continue
        meta = _OP_NAME.search(tail)
        ops.append(ScheduledOp(len(ops), m.group("name"), opcode, sum(_shape_bytes(shape)),
                               meta.group(1) if meta else ""))
    return tuple(ops)
