"""The tree ops over a batch of trees, each a torch reference beside its Triton kernel
(tree_ops/triton_kernels.py), behind one dispatch: Triton for CUDA tensors, the reference
otherwise (kernels.triton_support.use_triton).

A batch holds B trees of different sizes, padded to Q rows each (tree_ops/tree_batch.py holds
the batch dataclasses and the mask's bit layout). The mask travels as compact metadata -- one
bit per (row, column) of the tree block, W = ceil(Q / 32) int32 words per row -- never as a
dense [Q, past + Q] float mask; it is built on the device from the parent array.

Worked example (one tree, Q = 4, start 10): parents [-1, 0, 0, -1], size 3 (row 3 pads) ->
    depths    [0, 1, 1, 0]
    positions [10, 11, 11, 10]
    bits      [0b0001, 0b0011, 0b0101, 0b1000]   (row i: bit j set when j is i or its ancestor;
                                                  a padding row sees only itself)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .sampling import inverse_cdf, uniforms
from .tree import Candidates, Tree, ancestor_mask, compact_kv, walk_tree
from .tree_batch import TreeBatch, TreeMeta, WalkBatch, pack_bits, unpack_bits
from .triton_support import ATTENTION_HEAD_DIMS, use_triton


# --- 1. mask / position metadata ---------------------------------------------------------------


def tree_metadata(batch: TreeBatch, start: torch.Tensor) -> TreeMeta:
    if use_triton(batch.parents):
        from .triton_kernels import tree_metadata_triton

        return tree_metadata_triton(batch, start)
    return tree_metadata_ref(batch, start)


def tree_metadata_ref(batch: TreeBatch, start: torch.Tensor) -> TreeMeta:
    """Every row starts as a root alone (depth 0, each row of the block seeing only itself: what
    a root-only tree and its padding are); only the trees with nodes are built row by row (a busy
    batch is mostly plain rows: at 64 streams the loop over all of them was ~2.6 ms a step)."""
    b, q_len = batch.parents.shape
    depths = torch.zeros(b, q_len, dtype=torch.int64)
    dense = torch.eye(q_len, dtype=torch.bool).expand(b, q_len, q_len).clone()
    for row in (batch.sizes.cpu() > 1).nonzero().flatten().tolist():
        n = int(batch.sizes[row])
        tree_mask = ancestor_mask(batch.parents[row, :n].cpu())
        dense[row, :n, :n] = tree_mask
        depths[row, :n] = tree_mask.sum(-1) - 1
    return TreeMeta(depths.to(batch.parents.device), (start.cpu()[:, None] + depths).to(batch.parents.device),
                    pack_bits(dense).to(batch.parents.device))


# --- 2. tree attention: over a dense cache, and over a paged pool in place ------------------------


def tree_attention(q, k, v, prefix: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    if use_triton(q) and q.shape[-1] in ATTENTION_HEAD_DIMS:
        from .triton_kernels import tree_attention_triton

        return tree_attention_triton(q, k, v, prefix, bits)
    return tree_attention_ref(q, k, v, prefix, bits)


def tree_attention_ref(q, k, v, prefix: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, Q, D]; k, v [B, Hkv, S, D] (a layer of the KV cache: the committed prefix in
    slots [0, prefix[b]), the tree block's own keys in slots prefix[b] + j); bits [B, Q, W].
    Query i sees every prefix slot and block slot prefix[b] + j when bit j of its row is set."""
    b, _, q_len, _ = q.shape
    span = k.shape[2]
    mask = torch.zeros(b, q_len, span, dtype=torch.bool, device=q.device)
    block = unpack_bits(bits, q_len)
    for row, at in enumerate(prefix.tolist()):
        mask[row, :, :at] = True
        mask[row, :, at : at + q_len] = block[row]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.shape[1] != k.shape[1])


def paged_tree_attention(q, k_pool, v_pool, table: torch.Tensor, lengths: torch.Tensor, bits: torch.Tensor,
                         page: int, rows: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """`batch_invariant`: the kernel's tiles and splits fixed whatever the batch (the reference
    ignores it)."""
    if use_triton(q) and q.shape[-1] in ATTENTION_HEAD_DIMS:
        from .triton_kernels import paged_tree_attention_triton

        return paged_tree_attention_triton(q, k_pool, v_pool, table, lengths, bits, page, rows,
                                           batch_invariant=batch_invariant)
    return paged_tree_attention_ref(q, k_pool, v_pool, table, lengths, bits, page, rows)


def paged_tree_attention_ref(q, k_pool, v_pool, table: torch.Tensor, lengths: torch.Tensor, bits: torch.Tensor,
                             page: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, Q, D]; k_pool, v_pool [T, Hkv, D] (one layer of a paged pool, workers.kv_pool:
    position p of sequence b in slot table[b, p // page] * page + p % page; its committed
    context is positions [0, lengths[b]), its tree block's keys positions lengths[b] + j);
    table [B, P]; bits [B, Q, W]; rows [B] real rows per block or None (all real).
    A real row sees the whole context and block position lengths[b] + j when bit j of its row is
    set; a padding row (i >= rows[b]) sees only its own position, so it is exactly v's own row.

    Example (page 2, Q 2): table [[3, 0]], lengths [1], bits [[0b01], [0b11]] -> row 0 sees
    positions 0 and 1 (slots 6, 7), row 1 positions 0, 1 and 2 (slots 6, 7, 0)."""
    b, _, q_len, _ = q.shape
    block = unpack_bits(bits, q_len).cpu()
    rows = torch.full((b,), q_len) if rows is None else rows.cpu()
    out = torch.empty_like(q)
    for seq, (n, real) in enumerate(zip(lengths.tolist(), rows.tolist())):
        positions = torch.arange(n + q_len)
        slots = (table[seq].cpu().long()[positions // page] * page + positions % page).to(k_pool.device)
        keys, values = k_pool[slots].transpose(0, 1)[None], v_pool[slots].transpose(0, 1)[None]  # [1, Hkv, n + Q, D]
        mask = torch.zeros(q_len, n + q_len, dtype=torch.bool)
        mask[:real, :n] = True
        mask[:real, n:] = block[seq, :real]
        mask[real:, n:] = torch.eye(q_len, dtype=torch.bool)[real:]
        out[seq] = F.scaled_dot_product_attention(q[seq : seq + 1], keys.to(q.dtype), values.to(q.dtype),
                                                  attn_mask=mask.to(q.device)[None, None],
                                                  enable_gqa=q.shape[1] != k_pool.shape[1])[0]
    return out


# --- 3 and 4. walks -------------------------------------------------------------------------------


def walk_batch(batch: TreeBatch, choices: torch.Tensor) -> WalkBatch:
    """choices [B, Q]: the target's token at each node (argmax, or the seeded draw). From each
    root, follow the first child (lowest index) holding the choice at the current node."""
    if use_triton(choices):
        from .triton_kernels import walk_batch_triton

        return walk_batch_triton(batch, choices)
    return walk_batch_ref(batch, choices)


def walk_batch_ref(batch: TreeBatch, choices: torch.Tensor) -> WalkBatch:
    """A root alone accepts the root and takes its choice as the bonus (set for every row at
    once); the trees with nodes are walked one by one."""
    b, q_len = batch.tokens.shape
    path = torch.full((b, q_len), -1, dtype=torch.int64)
    path[:, 0] = 0
    length = torch.ones(b, dtype=torch.int64)
    bonus = choices[:, 0].cpu().to(torch.int64, copy=True)
    for row in (batch.sizes.cpu() > 1).nonzero().flatten().tolist():
        n = int(batch.sizes[row])
        tree = Tree(batch.tokens[row, :n].cpu(), batch.parents[row, :n].cpu(), torch.zeros(n, dtype=torch.int64))
        walk = walk_tree(tree, choices[row, :n].cpu())
        path[row, : len(walk.path)] = torch.tensor(walk.path)
        length[row], bonus[row] = len(walk.path), walk.bonus
    dev = choices.device
    return WalkBatch(path.to(dev), length.to(dev), bonus.to(dev))


def sampled_choices(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """probs [B, Q, V] processed probabilities (kernels.sampling.processed_probs), seeds [B]
    int64, positions [B, Q]: the position each node's token would take (start + depth + 1) ->
    [B, Q] the seeded inverse-CDF draw per node, the same as kernels.sampling.choose_tokens."""
    if use_triton(probs):
        from .triton_kernels import sampled_choices_triton

        return sampled_choices_triton(probs, seeds, positions)
    return sampled_choices_ref(probs, seeds, positions)


def sampled_choices_ref(probs, seeds, positions) -> torch.Tensor:
    b, q_len, vocab = probs.shape
    u = uniforms(seeds.to(probs.device), positions.to(probs.device))
    return inverse_cdf(probs.reshape(-1, vocab).double(), u.reshape(-1)).view(b, q_len)


# --- 5. KV compaction -----------------------------------------------------------------------------


def compact_kv_batch(k, v, start: torch.Tensor, walk: WalkBatch) -> None:
    """k, v [L, B, Hkv, S, D]: row b's slots start[b] + path[b, i] move to start[b] + i."""
    if use_triton(k):
        from .triton_kernels import compact_kv_batch_triton

        return compact_kv_batch_triton(k, v, start, walk)
    return compact_kv_batch_ref(k, v, start, walk)


def compact_kv_batch_ref(k, v, start, walk: WalkBatch) -> None:
    for row in range(k.shape[1]):
        n = int(walk.length[row])
        compact_kv(k, v, row, int(start[row]), walk.path[row, :n].tolist())


# --- 6. top-K log-probs ---------------------------------------------------------------------------


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (log-probs [R, k] descending, ids [R, k]); equal values rank by id.
    The drafter's candidates per depth, without a [R, V] softmax leaving the device."""
    if use_triton(logits):
        from .triton_kernels import topk_logprobs_triton

        return topk_logprobs_triton(logits, k)
    return topk_logprobs_ref(logits, k)


def top_k_candidates(logprobs: torch.Tensor, k: int) -> Candidates:
    """The drafter's top-k per depth from its log-probs [D, V]: on CUDA the top-K kernel (only
    [D, k] leaves the device; the log-softmax of log-probs is themselves), else Candidates.top_k."""
    if not use_triton(logprobs):
        return Candidates.top_k(logprobs, k)
    values, ids = topk_logprobs(logprobs.float(), min(k, logprobs.shape[-1]))
    return Candidates(values.double().tolist(), ids.tolist())


def topk_logprobs_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.arange(logits.shape[-1], device=logits.device).expand_as(logprobs)
    # stable descending sort: ties keep ascending ids
    values, order = logprobs.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids.gather(-1, order[:, :k])
