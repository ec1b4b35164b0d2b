"""Placement planning: from a model's size and a node's GPU topology, how to cut the target
(tensor parallel TP x pipeline stages PP), how many replicas fit, which GPUs each one uses, and
the Ray placement-group bundles that reserve them.

Rules, in order:
1. A replica needs `need` GPUs: weights (plus headroom for activations), its KV cache and the
   drafter, over the usable memory per GPU.
2. Tensor parallelism all-reduces twice per layer, so a TP group stays inside one NVLink island:
   the smallest power of two >= need that fits an island (and the target's key-value heads).
3. Where no island is big enough (PCIe-only links, small NVLink islands), the replica uses the
   widest TP an island allows and pipeline stages across the slower links (one activation send
   per stage boundary instead of two all-reduces per layer), stages on the same NUMA node first.
4. The remaining GPUs become more replicas (a model that fits one GPU runs TP=1, one replica per
   GPU: on PCIe more replicas beat wide TP).

Worked example: a 65 GB bf16 target on 80 GB GPUs needs 2 GPUs. On an 8-GPU NVSwitch node that
is TP=2, PP=1, 4 replicas on GPUs (0,1) (2,3) (4,5) (6,7). On an 8-GPU PCIe node it is TP=1,
PP=2: stages (0)(1), (2)(3), ... each replica inside one NUMA node, 4 replicas.

What reaches the engine: `Plan.placement()` is a config.Placement (`placement` in a
ModelPairConfig / ServeConfig), and the distributed engine makes exactly that placement group
and puts shard r in bundle r. Ray chooses which GPUs of the node fill the bundles; the GPU
indices of `replicas` are the planner's grouping, which Ray does not enforce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Placement
from .topology import Topology

GIB = 2**30
CPUS_PER_GPU = 2  # CPUs each GPU's bundle reserves (the shard's process and its host-side work)


@dataclass(frozen=True)
class Footprint:
    """What placement needs to know about a model pair."""

    weight_bytes: int  # the target's weights in the serving dtype
    kv_heads: int  # key-value heads: the widest useful tensor-parallel degree
    drafter_bytes: int = 0  # lives on the first GPU of each replica
    kv_bytes: int = 0  # the KV cache one replica must hold (tokens in flight x bytes per token)

    @classmethod
    def from_hf_config(cls, hf: dict, dtype_bytes: int = 2, drafter_bytes: int = 0, kv_tokens: int = 0) -> "Footprint":
        """Parameter count of a llama / qwen3 config.json times the dtype's bytes, plus the KV
        cache of `kv_tokens` tokens (keys and values of every layer's key-value heads)."""
        h, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        d = hf.get("head_dim") or h // heads
        vocab = hf["vocab_size"]
        attention = h * heads * d * 2 + h * kv * d * 2  # q, o; k, v
        per_layer = attention + 3 * h * inter + 2 * h
        embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
        params = embeddings + layers * per_layer + h
        kv_per_token = 2 * layers * kv * d * dtype_bytes
        return cls(params * dtype_bytes, kv, drafter_bytes, kv_tokens * kv_per_token)


@dataclass(frozen=True)
class Replica:
    stages: tuple[tuple[int, ...], ...]  # [PP][TP] GPU indices; stage s runs the s-th run of layers

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(g for stage in self.stages for g in stage)


@dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    replicas: tuple[Replica, ...]
    need: int  # GPUs one replica needs by memory
    reason: str  # one line: why this shape

    def placement(self) -> Placement:
        """The placement group of one replica: a bundle per GPU, STRICT_PACK (one node). The
        coordinator and the drafter share bundle 0 with the first shard."""
        return Placement(bundles=[{"CPU": CPUS_PER_GPU, "GPU": 1} for _ in range(self.tp * self.pp)], strategy="STRICT_PACK")

    def to_dict(self) -> dict:
        """What `ddtree plan` prints; `placement` goes as it is into a Serve config's args."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "need": self.need,
            "replicas": [[list(s) for s in r.stages] for r in self.replicas],
            "placement": self.placement().model_dump(),
            "reason": self.reason,
        }


def plan(
    footprint: Footprint,
    gpu_bytes: int,
    topology: Topology,
    memory_fraction: float = 0.9,
    headroom: float = 0.25,
    max_replicas: int | None = None,
) -> Plan:
    usable = gpu_bytes * memory_fraction
    total = footprint.weight_bytes * (1 + headroom) + footprint.kv_bytes + footprint.drafter_bytes
    need = max(1, math.ceil(total / usable))
    gpus = len(topology.gpus)
    if need > gpus:
        raise ValueError(
            f"the model needs {need} GPUs of {gpu_bytes / GIB:.0f} GiB "
            f"({footprint.weight_bytes / GIB:.1f} GiB of weights + {headroom:.0%}, "
            f"{footprint.kv_bytes / GIB:.1f} GiB of KV cache); "
            f"this node has {gpus}"
        )
    islands = topology.islands()
    widest_island = max(len(i) for i in islands)
    powers = [2**k for k in range(int(math.log2(max(gpus, 1))) + 1)]
    fitting = [t for t in powers if t >= need and t <= widest_island and t <= footprint.kv_heads]
    if fitting:
        tp, pp = fitting[0], 1
    else:
        tp = max(t for t in powers if t <= widest_island and t <= footprint.kv_heads)
        pp = math.ceil(need / tp)

    # TP groups: consecutive GPUs inside one island.
    units = [tuple(island[k : k + tp]) for island in islands for k in range(0, len(island) - tp + 1, tp)]
    replicas = _stack_stages(units, pp, topology)
    if max_replicas is not None:
        replicas = replicas[:max_replicas]
    if not replicas:
        raise ValueError(f"no replica of TP={tp} x PP={pp} fits this topology")

    links = "NVLink islands of " + "/".join(str(len(i)) for i in islands) if widest_island > 1 else "PCIe only"
    how = f"TP={tp} inside an NVLink island" if pp == 1 and tp > 1 else (
        f"TP={tp} x PP={pp}: stages across {topology.worst_link(list(replicas[0].gpus)).name} links"
        if pp > 1 else "TP=1, one GPU per replica"
    )
    reason = (
        f"needs {need} GPU(s) ({footprint.weight_bytes / GIB:.1f} GiB weights + {headroom:.0%}, "
        f"{footprint.kv_bytes / GIB:.1f} GiB KV, "
        f"{gpu_bytes / GIB:.0f} GiB GPUs); {links}: {how}; {len(replicas)} replica(s)"
    )
    return Plan(tp, pp, tuple(replicas), need, reason)


def _stack_stages(units: list[tuple[int, ...]], pp: int, topology: Topology) -> list[Replica]:
    """Groups TP units into replicas of `pp` stages, each replica on the best-linked units:
    units of one NUMA node together first, then whatever is left."""
    if pp == 1:
        return [Replica((u,)) for u in units]
    by_numa: dict[int, list[tuple[int, ...]]] = {}
    for u in units:
        by_numa.setdefault(topology.numa.get(u[0], 0), []).append(u)
    replicas, leftover = [], []
    for node in sorted(by_numa):
        group = _order_by_links(by_numa[node], topology)
        while len(group) >= pp:
            replicas.append(Replica(tuple(group[:pp])))
            group = group[pp:]
        leftover += group
    while len(leftover) >= pp:
        replicas.append(Replica(tuple(leftover[:pp])))
        leftover = leftover[pp:]
    return replicas


def _order_by_links(units: list[tuple[int, ...]], topology: Topology) -> list[tuple[int, ...]]:
    """Units in an order where neighbours share the best links (a greedy chain from the first)."""
    rest, chain = list(units[1:]), [units[0]]
    while rest:
        last = chain[-1][-1]
        best = min(rest, key=lambda u: (topology.link(last, u[0]).kind, u[0]))
        rest.remove(best)
        chain.append(best)
    return chain

