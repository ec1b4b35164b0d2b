"""Megatron-style tensor parallelism for the target: how to cut it, and the sums that glue it.

Shard r of N holds
- attention: a contiguous run of key-value heads and the query heads of their groups
  (q/k/v_proj rows, o_proj columns), so grouped-query attention stays inside the shard;
- MLP: a contiguous slice of the intermediate size (gate/up_proj rows, down_proj columns);
- embedding and LM head: a contiguous slice of the vocabulary.
o_proj and down_proj give partial sums that one all-reduce per sub-layer adds up; the embedding
is a masked lookup plus an all-reduce; the logits stay split over the vocabulary, and the
target's token choice is made where they are (`choose`): an argmax needs one small all-gather
of each shard's best (value, id) per row, a seeded draw gathers the rows' logits between the
shards (never through Ray's object store). Norms and rotary tables are replicated.

Slices need not be even: SmolLM2-135M has 3 key-value heads, so at TP=2 shard 0 holds 2 of them
(6 query heads) and shard 1 holds 1 (3 query heads).

Worked example (SmolLM2-135M, TP=2): kv heads [0, 2) and [2, 3); query heads [0, 6) and [6, 9);
intermediate [0, 768) and [768, 1536); vocabulary [0, 24576) and [24576, 49152).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..kernels.sampling import choose_tokens, is_greedy
from .model import ModelConfig, SingleProcess


def _cut(n: int, parts: int, rank: int) -> tuple[int, int]:
    """[begin, end) of part `rank` when n items are cut into `parts` runs differing by at most 1."""
    base, extra = divmod(n, parts)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (rank < extra)


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    size: int  # N, the tensor-parallel degree
    kv_heads: tuple[int, int]  # [begin, end) key-value heads
    heads: tuple[int, int]  # [begin, end) query heads (the groups of those kv heads)
    intermediate: tuple[int, int]  # [begin, end) MLP columns
    vocab: tuple[int, int]  # [begin, end) vocabulary ids
    vocab_size: int  # V, the whole vocabulary

    @classmethod
    def of(cls, config: ModelConfig, size: int, rank: int) -> "ShardSpec":
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"shard rank {rank} of tensor-parallel size {size} does not exist")
        if size > config.num_key_value_heads:
            raise ValueError(
                f"tensor-parallel size {size} exceeds the target's {config.num_key_value_heads} "
                f"key-value heads; use tp <= {config.num_key_value_heads}"
            )
        group = config.num_attention_heads // config.num_key_value_heads
        kv = _cut(config.num_key_value_heads, size, rank)
        return cls(
            rank=rank,
            size=size,
            kv_heads=kv,
            heads=(kv[0] * group, kv[1] * group),
            intermediate=_cut(config.intermediate_size, size, rank),
            vocab=_cut(config.vocab_size, size, rank),
            vocab_size=config.vocab_size,
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shard's own sizes; the shard is a TargetModel built from them."""
        return dataclasses.replace(
            config,
            num_attention_heads=self.heads[1] - self.heads[0],
            num_key_value_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
        )

    def slice_state_dict(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """The shard's part of a full TargetModel state dict (Hugging Face names)."""
        d = config.head_dim
        q = slice(self.heads[0] * d, self.heads[1] * d)
        kv = slice(self.kv_heads[0] * d, self.kv_heads[1] * d)
        mlp = slice(*self.intermediate)
        vocab = slice(*self.vocab)
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
        cols = {"o_proj": q, "down_proj": mlp}
        out = {}
        for name, t in state.items():
            module, _, kind = name.rpartition(".")
            leaf = module.rpartition(".")[2]
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                t = t[vocab]
            elif leaf in rows:
                t = t[rows[leaf]]
            elif leaf in cols and kind == "weight":
                t = t[:, cols[leaf]]
            elif leaf in cols and kind == "bias" and self.rank > 0:
                t = torch.zeros_like(t)  # a bias after the all-reduce is added by one shard only
            out[name] = t.contiguous()
        return out


class TensorParallel(SingleProcess):
    """This process holds shard `spec` and sums with its peers over `group` (gloo or NCCL)."""

    def __init__(self, spec: ShardSpec, group=None):
        self.spec = spec
        self.group = group
        self.vocab_offset = spec.vocab[0]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, table: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_offset
        inside = (local >= 0) & (local < table.num_embeddings)
        x = table(local.clamp(0, table.num_embeddings - 1)) * inside[..., None].to(table.weight.dtype)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V_local] -> [N, V] on every shard (slices may differ by one id: padded)."""
        spec = self.spec
        cuts = [_cut(spec.vocab_size, spec.size, r) for r in range(spec.size)]
        widest = max(end - begin for begin, end in cuts)
        padded = logits.new_zeros(logits.shape[0], widest)
        padded[:, : logits.shape[1]] = logits
        parts = [torch.empty_like(padded) for _ in cuts]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:, : end - begin] for p, (begin, end) in zip(parts, cuts)], dim=-1)

    def choose(self, logits: torch.Tensor, params, seed: int | None, positions: list[int]) -> torch.Tensor:
        """[N] the target's token per row from this shard's logits [N, V_local]; every shard
        returns the same. Greedy: each shard's best (value, id), gathered; the highest value
        wins, ties to the lower id (like argmax). Seeded: the whole rows, gathered."""
        if not is_greedy(params):
            return choose_tokens(self.gather_vocab(logits), params, seed, positions)
        best, at = logits.double().max(dim=-1)  # first maximal id per row, like argmax
        mine = torch.stack([best, (at + self.vocab_offset).double()], dim=-1)  # [N, 2]
        parts = [torch.empty_like(mine) for _ in range(self.spec.size)]
        dist.all_gather(parts, mine, group=self.group)
        values = torch.stack([p[:, 0] for p in parts], dim=-1)  # [N, shards], shards in vocab order
        ids = torch.stack([p[:, 1] for p in parts], dim=-1)
        winner = values.argmax(dim=-1, keepdim=True)  # ties -> the lower shard -> the lower id
        return ids.gather(-1, winner).squeeze(-1).long()
