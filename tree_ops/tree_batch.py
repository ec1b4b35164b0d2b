"""The data the batched tree ops pass around: a batch of trees (TreeBatch), its mask and
position metadata (TreeMeta), the walks' result (WalkBatch), and the bit layout of the mask.

Both the torch references with their dispatch (tree_ops/batched.py) and the Triton kernels
(tree_ops/triton_kernels.py) import these; neither imports the other for them.

The mask is compact: one bit per (row, column) of the tree block, W = ceil(Q / 32) int32 words
per row, bit j % 32 of word j // 32 set when row i may see column j.

Worked example (Q = 4): rows that see [{0}, {0, 1}, {0, 2}, {3}] pack to
    pack_bits([[1,0,0,0], [1,1,0,0], [1,0,1,0], [0,0,0,1]]) -> [[0b0001], [0b0011], [0b0101], [0b1000]]
and Q = 33 takes W = 2 words per row; bit 31 of a word is its sign bit (0x80000000 -> -2**31).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tree import Tree


@dataclass
class TreeBatch:
    tokens: torch.Tensor  # [B, Q] int64; rows >= sizes[b] are padding (their values are never read)
    parents: torch.Tensor  # [B, Q] int64; -1 for roots and padding rows, parents[b, i] < i
    sizes: torch.Tensor  # [B] int64, real nodes per tree (root included), 1 <= size <= Q

    @classmethod
    def of(cls, trees: list[Tree], q_len: int, device=None) -> "TreeBatch":
        b = len(trees)
        tokens = torch.zeros(b, q_len, dtype=torch.int64)
        parents = torch.full((b, q_len), -1, dtype=torch.int64)
        for row, tree in enumerate(trees):
            if tree.size > q_len:
                raise ValueError(f"tree {row} has {tree.size} nodes; the batch holds {q_len} rows")
            tokens[row, : tree.size] = tree.tokens
            parents[row, : tree.size] = tree.parents
        sizes = torch.tensor([t.size for t in trees], dtype=torch.int64)
        return cls(tokens.to(device), parents.to(device), sizes.to(device))


@dataclass
class TreeMeta:
    depths: torch.Tensor  # [B, Q] int64 (padding: 0)
    positions: torch.Tensor  # [B, Q] int64, start + depth (padding: start)
    bits: torch.Tensor  # [B, Q, W] int32, bit j of row i: j is i or an ancestor of i


@dataclass
class WalkBatch:
    path: torch.Tensor  # [B, Q] int64 accepted node indices, root first, -1 past length
    length: torch.Tensor  # [B] int64, nodes on the path (>= 1: the root)
    bonus: torch.Tensor  # [B] int64, the target's token after the path


def words(q_len: int) -> int:
    """int32 words per mask row of a block of q_len rows."""
    return math.ceil(q_len / 32)


def pack_bits(dense: torch.Tensor) -> torch.Tensor:
    """[..., Q] bool -> [..., ceil(Q/32)] int32 words, bit j % 32 of word j // 32, on dense's
    device (torch ops only: packing a CUDA mask reads nothing back to the host)."""
    q_len = dense.shape[-1]
    padded = torch.zeros(*dense.shape[:-1], words(q_len) * 32, dtype=torch.int64, device=dense.device)
    padded[..., :q_len] = dense.long()
    weights = 2 ** torch.arange(32, dtype=torch.int64, device=dense.device)
    packed = (padded.view(*dense.shape[:-1], -1, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_bits(bits: torch.Tensor, q_len: int) -> torch.Tensor:
    """Inverse of pack_bits: [..., W] int32 -> [..., q_len] bool."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int64)
    expanded = (bits.long()[..., None] >> shifts) & 1
    return expanded.flatten(-2)[..., :q_len].bool()
