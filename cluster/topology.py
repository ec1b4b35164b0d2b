"""GPU topology: which GPUs talk over NVLink and which only over PCIe.

Read from `nvidia-smi topo -m`, whose matrix names the link between every pair of GPUs:

    NV#   a bonded set of # NVLinks (NVSwitch nodes show NV18 between every pair of H100s)
    PIX   at most one PCIe bridge            (same switch)
    PXB   several PCIe bridges, no host bridge
    PHB   through a PCIe host bridge (the CPU)
    NODE  across host bridges inside one NUMA node
    SYS   across the SMP interconnect between NUMA nodes (QPI / UPI)

from the best link to the worst. An *NVLink island* is a set of GPUs joined by NVLink paths:
tensor parallelism (an all-reduce per sub-layer) belongs inside one.

Example: the matrix of a node whose GPUs are NVLink-bridged in pairs (0-1, 2-3) gives
    Topology(gpus=[0, 1, 2, 3], links={(0, 1): NV4, (0, 2): PXB, ...}) -> islands [[0, 1], [2, 3]]
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from enum import IntEnum


class LinkKind(IntEnum):
    """Link kinds, best first (a smaller value is a faster link)."""

    NVLINK = 0
    PIX = 1
    PXB = 2
    PHB = 3
    NODE = 4
    SYS = 5

    @classmethod
    def parse(cls, cell: str) -> tuple["LinkKind", int]:
        """A matrix cell -> (kind, NVLink count; 0 for PCIe kinds)."""
        cell = cell.strip()
        if m := re.fullmatch(r"NV(\d+)", cell):
            return cls.NVLINK, int(m.group(1))
        if cell in cls.__members__:
            return cls[cell], 0
        raise ValueError(f"unknown link {cell!r} in the topology matrix")


@dataclass(frozen=True)
class Link:
    kind: LinkKind
    nvlinks: int = 0  # bonded NVLinks (NV#), 0 for PCIe

    def __str__(self) -> str:
        return f"NV{self.nvlinks}" if self.kind is LinkKind.NVLINK else self.kind.name


@dataclass
class Topology:
    gpus: list[int]  # GPU indices as nvidia-smi numbers them
    links: dict[tuple[int, int], Link]  # (i, j), i != j, both orders
    numa: dict[int, int] = field(default_factory=dict)  # GPU -> NUMA node (when known)

    def link(self, a: int, b: int) -> Link:
        return self.links[a, b]

    def islands(self) -> list[list[int]]:
        """NVLink islands: connected components of the NVLink graph, GPUs without NVLink alone."""
        seen: set[int] = set()
        out = []
        for g in self.gpus:
            if g in seen:
                continue
            group, todo = [], [g]
            seen.add(g)
            while todo:
                a = todo.pop()
                group.append(a)
                for b in self.gpus:
                    if b not in seen and self.links[a, b].kind is LinkKind.NVLINK:
                        seen.add(b)
                        todo.append(b)
            out.append(sorted(group))
        return out

    def worst_link(self, group: list[int]) -> LinkKind:
        """The slowest link between any two GPUs of `group` (NVLINK for a single GPU)."""
        kinds = [self.links[a, b].kind for a in group for b in group if a != b]
        return max(kinds, default=LinkKind.NVLINK)

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """Parses the matrix `nvidia-smi topo -m` prints (legend and NIC rows are skipped)."""
        lines = [line for line in text.splitlines() if line.strip()]
        header_at = next((i for i, line in enumerate(lines) if re.match(r"\s+GPU0\b", line)), None)
        if header_at is None:
            raise ValueError("no GPU matrix found (expected the output of `nvidia-smi topo -m`)")
        columns = [c.strip() for c in lines[header_at].split("\t")[1:]]
        n = sum(1 for c in columns if re.fullmatch(r"GPU\d+", c))
        affinity_at = columns.index("CPU Affinity") if "CPU Affinity" in columns else None
        links, numa = {}, {}
        for line in lines[header_at + 1 :]:
            cells = line.split("\t")
            row = re.fullmatch(r"GPU(\d+)", cells[0].strip())
            if not row:
                continue  # NIC rows, legend
            i = int(row.group(1))
            for j, cell in enumerate(cells[1 : n + 1]):
                if i != j:
                    links[i, j] = Link(*LinkKind.parse(cell))
            if affinity_at is not None:  # CPU Affinity, NUMA Affinity, (GPU NUMA ID)
                rest = [c.strip() for c in cells[1 + affinity_at :] if c.strip()]
                if len(rest) >= 2 and rest[1].isdigit():
                    numa[i] = int(rest[1])
        gpus = list(range(n))
        for i in gpus:
            for j in gpus:
                if i != j and (i, j) not in links:
                    raise ValueError(f"the matrix has no link between GPU{i} and GPU{j}")
        return cls(gpus, links, numa)


def read_topology() -> Topology | None:
    """This machine's GPU topology from `nvidia-smi topo -m`; None where there is no NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return None
    return Topology.parse(out.stdout)
