"""Reading the collectives out of a compiled (partitioned) HLO module's text.

Used to check a plan's predicted collectives against what XLA compiled. Byte counts follow
the HLO result shape of each collective, per device (for an asynchronous `*-start` op, the
result buffer of its tuple).
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
