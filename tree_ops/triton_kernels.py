"""Triton kernels of the tree ops; their torch references and the dispatch are in
tree_ops/batched.py, the batch dataclasses both use in tree_ops/tree_batch.py. Each kernel is
followed by its wrapper, which checks shapes, allocates the outputs and launches an explicit
grid. Imported only when a kernel runs (Triton is optional on CPU machines); tests run these on
CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .tree_batch import TreeBatch, TreeMeta, WalkBatch, words
from .triton_support import ATTENTION_HEAD_DIMS, next_pow2


# --- 1. mask / position metadata from the parent array ------------------------------------------


@triton.jit
def _tree_metadata_kernel(
    parents_ptr, sizes_ptr, start_ptr, depths_ptr, positions_ptr, bits_ptr,
    stride_pb, stride_db, stride_bb, stride_bq,
    BLOCK_W: tl.constexpr,
):
    """One program per (tree b, row i): climb from i to the root, setting one bit per node."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    size = tl.load(sizes_ptr + b).to(tl.int32)
    start = tl.load(start_ptr + b)
    offs_w = tl.arange(0, BLOCK_W)
    mask_words = tl.zeros([BLOCK_W], dtype=tl.int32)
    depth = i * 0
    if i < size:
        node = i
        while node >= 0:
            mask_words = mask_words | tl.where(offs_w == node // 32, 1 << (node % 32), 0)
            node = tl.load(parents_ptr + b * stride_pb + node).to(tl.int32)
            depth += 1
        depth -= 1
    else:  # a padding row sees only itself
        mask_words = tl.where(offs_w == i // 32, 1 << (i % 32), 0)
    tl.store(depths_ptr + b * stride_db + i, depth.to(tl.int64))
    tl.store(positions_ptr + b * stride_db + i, start + depth)
    tl.store(bits_ptr + b * stride_bb + i * stride_bq + offs_w, mask_words, mask=offs_w < stride_bq)


def tree_metadata_triton(batch: TreeBatch, start: torch.Tensor) -> TreeMeta:
    b, q_len = batch.parents.shape
    assert batch.sizes.shape == (b,) and start.shape == (b,)
    dev = batch.parents.device
    parents = batch.parents.contiguous()
    depths = torch.empty(b, q_len, dtype=torch.int64, device=dev)
    positions = torch.empty(b, q_len, dtype=torch.int64, device=dev)
    w = words(q_len)
    bits = torch.empty(b, q_len, w, dtype=torch.int32, device=dev)
    _tree_metadata_kernel[(b, q_len)](
        parents, batch.sizes, start.to(torch.int64).contiguous(), depths, positions, bits,
        parents.stride(0), depths.stride(0), bits.stride(0), bits.stride(1),
        BLOCK_W=next_pow2(w),
    )
    return TreeMeta(depths, positions, bits)


# --- 2. tree attention over [committed prefix ; tree block] --------------------------------------


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b, in IEEE fp32 when IEEE (TF32 would round fp32 inputs)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of the online softmax: s [M, N] fp32 scores (-inf where a row does not see
    the key), v [N, D] the tile's values; the running row max m_i [M], normalizer l_i [M] and
    output acc [M, D] after it. A row that has seen nothing keeps m_i -inf, l_i 0, acc 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, prefix_ptr, bits_ptr,
    stride_qb, stride_qh, stride_qq,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_oq,
    stride_bb, stride_bq,
    Q, HQ, GROUP, scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per (block of BLOCK_M tree rows, batch row b x query head h); flash-style
    online softmax over key slots [0, prefix + Q); a block slot's visibility is one bit."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m < Q
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qq + offs_d[None, :],
                mask=rows[:, None], other=0.0)
    prefix = tl.load(prefix_ptr + b).to(tl.int32)
    end = prefix + Q
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keys = offs_n < end
        k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=keys[None, :], other=0.0)
        s = _dot(q, k, IEEE).to(tl.float32) * scale
        col = offs_n - prefix
        in_block = (col >= 0) & (col < Q)
        word = tl.load(bits_ptr + b * stride_bb + offs_m[:, None] * stride_bq + (col // 32)[None, :],
                       mask=rows[:, None] & in_block[None, :], other=0)
        bit = (word >> (col % 32)[None, :]) & 1
        visible = (offs_n < prefix)[None, :] | (in_block[None, :] & (bit != 0))
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=keys[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_oq + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rows[:, None])


def tree_attention_triton(q, k, v, prefix: torch.Tensor, bits: torch.Tensor, block_m: int = 16, block_n: int = 32):
    """q [B, Hq, Q, D]; k, v [B, Hkv, S, D] with the block's keys at slots prefix[b] + j;
    bits [B, Q, W] int32 -> [B, Hq, Q, D]. The last dimension of every tensor is contiguous."""
    b, hq, q_len, d = q.shape
    hkv = k.shape[1]
    assert k.shape[0] == b and v.shape == k.shape and k.shape[3] == d and hq % hkv == 0
    assert bits.shape == (b, q_len, words(q_len)) and bits.dtype == torch.int32
    assert d in ATTENTION_HEAD_DIMS, f"head_dim {d} is not a supported tile width"
    assert q.stride(3) == k.stride(3) == v.stride(3) == 1 and bits.stride(2) == 1
    out = torch.empty_like(q)
    grid = (triton.cdiv(q_len, block_m), b * hq)
    _tree_attention_kernel[grid](
        q, k, v, out, prefix.contiguous(), bits,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        bits.stride(0), bits.stride(1),
        q_len, hq, hq // hkv, 1.0 / math.sqrt(d),
        D=d, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
    )
    return out


# --- 2b. tree attention over a paged KV pool, in place -------------------------------------------


@triton.jit
def _paged_tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, bits_ptr, rows_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qq,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_tb, stride_bb, stride_bq,
    stride_ob, stride_oh, stride_oq, stride_os,
    stride_lb, stride_lh, stride_lq,
    Q, HKV, SPLIT_KEYS, scale,
    PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ROWS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per (tile of BLOCK_M query rows x heads, sequence b x key-value head, split
    of the keys). The tile flattens (tree row i, head g of the group) as m = i * GROUP + g, so
    each key/value tile is loaded once for the GROUP query heads that share it. Keys are the
    sequence's positions [split * SPLIT_KEYS, + SPLIT_KEYS) within [0, length + Q), read from
    slot table[b, p // PAGE] * PAGE + p % PAGE of the pool. A real row sees every position below
    the length and block position length + j when bit j of its row is set; a padding row
    (i >= rows[b]) sees only its own position. Without SPLIT the tile's normalized output is the
    result; with it, the output and log-sum-exp of this split go to the partials."""
    pid_m = tl.program_id(0)
    bk = tl.program_id(1)
    split = tl.program_id(2)
    b = bk // HKV
    kvh = bk % HKV
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    in_q = row < Q
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + row[:, None] * stride_qq + offs_d[None, :],
                mask=in_q[:, None], other=0.0)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    if HAS_ROWS:
        real = tl.load(rows_ptr + b).to(tl.int32)
    else:
        real = Q
    is_real = row < real
    end = length + Q
    lo = split * SPLIT_KEYS
    hi = tl.minimum(lo + SPLIT_KEYS, end)
    lo = tl.where(pid_m * BLOCK_M // GROUP < real, lo, tl.maximum(lo, length))  # a tile of padding rows skips the context
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keys = offs_n < hi
        page_id = tl.load(table_ptr + b * stride_tb + offs_n // PAGE, mask=keys, other=0).to(tl.int64)
        slot = page_id * PAGE + offs_n % PAGE
        k = tl.load(k_base + slot[None, :] * stride_kt + offs_d[:, None], mask=keys[None, :], other=0.0)
        s = _dot(q, k, IEEE).to(tl.float32) * scale
        col = offs_n - length
        in_block = keys & (col >= 0)
        col = tl.where(in_block, col, 0)
        word = tl.load(bits_ptr + b * stride_bb + row[:, None] * stride_bq + (col // 32)[None, :],
                       mask=in_q[:, None] & in_block[None, :], other=0)
        bit = ((word >> (col % 32)[None, :]) & 1) != 0
        sees_block = tl.where(is_real[:, None], bit, col[None, :] == row[:, None])
        visible = (is_real[:, None] & (keys & (offs_n < length))[None, :]) | (in_block[None, :] & sees_block)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_base + slot[:, None] * stride_vt + offs_d[None, :], mask=keys[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = o_ptr + b * stride_ob + head[:, None] * stride_oh + row[:, None] * stride_oq + split * stride_os
    tl.store(o_rows + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=in_q[:, None])
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + b * stride_lb + head * stride_lh + row * stride_lq + split, lse, mask=in_q)


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, o_ptr,
    stride_pb, stride_ph, stride_pq, stride_ps,
    stride_lb, stride_lh, stride_lq,
    stride_ob, stride_oh, stride_oq,
    Q, HQ, SPLITS,
    D: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """One program per (block of BLOCK_Q rows, sequence b x query head h): the splits' outputs
    weighed by exp(lse_s - max lse), in split order (an empty split weighs exactly 0)."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, D)
    rows = offs_q < Q
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    for s in range(SPLITS):
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_q * stride_lq + s, mask=rows, other=float("-inf"))
        part = tl.load(part_ptr + b * stride_pb + h * stride_ph + offs_q[:, None] * stride_pq + s * stride_ps
                       + offs_d[None, :], mask=rows[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * part
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_q[:, None] * stride_oq + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rows[:, None])


PAGED_SPLIT_MIN_KEYS = 256  # a split covers at least this many keys (fewer leave its program mostly launch cost)
PAGED_TARGET_PROGRAMS = 264  # splits are added until a call has about this many programs (2 per SM of an H100)
INVARIANT_SPLIT_KEYS = 512  # batch_invariant: each sequence's keys split every this many positions, whatever the batch


def paged_split_keys(max_keys: int, programs: int, block_n: int) -> int:
    """Keys per split for a call of `programs` (row tile x sequence x key-value head) programs
    whose sequences hold at most `max_keys` positions (the block tables' width x page: host
    shapes, not the lengths): one split when the call already fills the GPU or the keys are
    few, else enough splits of >= PAGED_SPLIT_MIN_KEYS keys to approach PAGED_TARGET_PROGRAMS.
    A multiple of block_n. Example: 4096 keys, 8 programs, block_n 32 -> 16 splits of 256."""
    splits = max(1, min(max_keys // PAGED_SPLIT_MIN_KEYS, PAGED_TARGET_PROGRAMS // max(programs, 1)))
    return triton.cdiv(triton.cdiv(max_keys, splits), block_n) * block_n


def paged_tree_attention_triton(q, k_pool, v_pool, table: torch.Tensor, lengths: torch.Tensor, bits: torch.Tensor,
                                page: int, rows: torch.Tensor | None = None, split_keys: int | None = None,
                                block_n: int = 32, batch_invariant: bool = False):
    """q [B, Hq, Q, D]; k_pool, v_pool [T, Hkv, D] (one layer of the pool, the block's keys
    already written at positions lengths[b] + j); table [B, P] page ids covering positions
    [0, lengths[b] + Q); lengths [B]; bits [B, Q, W] int32; rows [B] real rows per block (the
    rest padding) or None (every row real) -> [B, Hq, Q, D]. Reads nothing back to the host:
    the grid follows the shapes alone. `split_keys` (a multiple of block_n) fixes the keys per
    split; by default paged_split_keys picks it from the call's programs (so from the batch).
    `batch_invariant` (`deterministic: true`): the row tile is the widest for the head width
    whatever Q, and the keys per split INVARIANT_SPLIT_KEYS unless given, so a sequence's splits
    and each row's arithmetic are the same whatever the batch, its Q and its block tables'
    width (a split past a sequence's end weighs exactly 0 in the combine, and one split's
    combined output is its own)."""
    b, hq, q_len, d = q.shape
    t, hkv = k_pool.shape[:2]
    assert k_pool.shape == (t, hkv, d) and v_pool.shape == k_pool.shape and hq % hkv == 0
    assert table.dim() == 2 and table.shape[0] == b and lengths.shape == (b,)
    assert bits.shape == (b, q_len, words(q_len)) and bits.dtype == torch.int32
    assert rows is None or rows.shape == (b,)
    assert d in ATTENTION_HEAD_DIMS, f"head_dim {d} is not a supported tile width"
    assert q.stride(3) == k_pool.stride(2) == v_pool.stride(2) == 1 and bits.stride(2) == 1 and table.stride(1) == 1
    group = hq // hkv
    widest = 64 if d <= 128 else 32
    block_m = widest if batch_invariant else min(widest, max(16, next_pow2(q_len * group)))  # (row, head) pairs a tile
    tiles = triton.cdiv(q_len * group, block_m)
    max_keys = table.shape[1] * page
    if split_keys is None:
        split_keys = INVARIANT_SPLIT_KEYS if batch_invariant else paged_split_keys(max_keys, tiles * b * hkv, block_n)
    assert split_keys % block_n == 0 and split_keys > 0
    splits = max(1, triton.cdiv(max_keys, split_keys))
    out = torch.empty_like(q)
    lengths = lengths.contiguous()
    rows_arg = lengths if rows is None else rows.to(lengths.device).contiguous()
    if splits == 1:
        part, lse = out, out  # written directly; no log-sum-exp
        part_strides = (*out.stride()[:3], 0)
        lse_strides = (0, 0, 0)
    else:
        part = torch.empty(b, hq, q_len, splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, hq, q_len, splits, dtype=torch.float32, device=q.device)
        part_strides = part.stride()[:4]
        lse_strides = lse.stride()[:3]
    _paged_tree_attention_kernel[(tiles, b * hkv, splits)](
        q, k_pool, v_pool, table, lengths, bits, rows_arg, part, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        table.stride(0), bits.stride(0), bits.stride(1),
        *part_strides, *lse_strides,
        q_len, hkv, split_keys, 1.0 / math.sqrt(d),
        PAGE=page, GROUP=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_ROWS=rows is not None, SPLIT=splits > 1, IEEE=q.dtype == torch.float32,
    )
    if splits > 1:
        block_q = min(64, next_pow2(q_len))
        _combine_splits_kernel[(triton.cdiv(q_len, block_q), b * hq)](
            part, lse, out,
            *part.stride()[:4], *lse.stride()[:3], *out.stride()[:3],
            q_len, hq, splits,
            D=d, BLOCK_Q=block_q,
        )
    return out


# --- 3. the walk over a batch of trees ------------------------------------------------------------


@triton.jit
def _walk_kernel(
    tokens_ptr, parents_ptr, sizes_ptr, choices_ptr, path_ptr, length_ptr, bonus_ptr,
    stride_tb, stride_pb, stride_cb, stride_wb,
    BLOCK_Q: tl.constexpr,
):
    """One program per tree: from the root, the first child holding the target's choice."""
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_Q)
    n = tl.load(sizes_ptr + b).to(tl.int32)
    valid = offs < n
    toks = tl.load(tokens_ptr + b * stride_tb + offs, mask=valid, other=-1)
    pars = tl.load(parents_ptr + b * stride_pb + offs, mask=valid, other=-2)
    tl.store(path_ptr + b * stride_wb, 0)
    length = n * 0 + 1
    choice = tl.load(choices_ptr + b * stride_cb)
    nxt = tl.min(tl.where(valid & (pars == 0) & (toks == choice), offs, BLOCK_Q), 0)
    while nxt < BLOCK_Q:
        tl.store(path_ptr + b * stride_wb + length, nxt.to(tl.int64))
        length += 1
        choice = tl.load(choices_ptr + b * stride_cb + nxt)
        nxt = tl.min(tl.where(valid & (pars == nxt) & (toks == choice), offs, BLOCK_Q), 0)
    tl.store(length_ptr + b, length.to(tl.int64))
    tl.store(bonus_ptr + b, choice.to(tl.int64))


def walk_batch_triton(batch: TreeBatch, choices: torch.Tensor) -> WalkBatch:
    b, q_len = batch.tokens.shape
    assert choices.shape == (b, q_len)
    dev = choices.device
    tokens, parents, choices = batch.tokens.contiguous(), batch.parents.contiguous(), choices.to(torch.int64).contiguous()
    path = torch.full((b, q_len), -1, dtype=torch.int64, device=dev)
    length = torch.empty(b, dtype=torch.int64, device=dev)
    bonus = torch.empty(b, dtype=torch.int64, device=dev)
    _walk_kernel[(b,)](
        tokens, parents, batch.sizes, choices, path, length, bonus,
        tokens.stride(0), parents.stride(0), choices.stride(0), path.stride(0),
        BLOCK_Q=next_pow2(q_len),
    )
    return WalkBatch(path, length, bonus)


# --- 4. the seeded draw per node (the sampled walk's choices) ----------------------------------


@triton.jit
def _splitmix64(x):
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _draw_kernel(
    probs_ptr, seeds_ptr, positions_ptr, out_ptr, V,
    stride_pb, stride_pq, stride_sb, stride_ob,
    BLOCK_V: tl.constexpr,
):
    """One program per node: u = SplitMix64(SplitMix64(seed) ^ position) as 53 bits (the
    reference's uniform), then the first id whose cumulative probability exceeds u x total."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    row = probs_ptr + b * stride_pb + i * stride_pq
    seed = tl.load(seeds_ptr + b).to(tl.uint64, bitcast=True)
    position = tl.load(positions_ptr + b * stride_sb + i).to(tl.uint64, bitcast=True)
    mixed = _splitmix64(_splitmix64(seed) ^ position)
    u = (mixed >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2 ** -53
    offs = tl.arange(0, BLOCK_V)
    total = tl.zeros([], dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        total += tl.sum(tl.load(row + start + offs, mask=start + offs < V, other=0.0).to(tl.float64), 0)
    threshold = u * total
    seen = tl.zeros([], dtype=tl.float64)
    chosen = V - 1  # like the reference's clamp
    found = V * 0
    for start in range(0, V, BLOCK_V):
        p = tl.load(row + start + offs, mask=start + offs < V, other=0.0).to(tl.float64)
        cdf = seen + tl.cumsum(p, 0)
        first = tl.min(tl.where((cdf > threshold) & (start + offs < V), start + offs, V), 0)
        take = (found == 0) & (first < V)
        chosen = tl.where(take, first, chosen)
        found = tl.where(take, 1, found)
        seen += tl.sum(p, 0)
    tl.store(out_ptr + b * stride_ob + i, chosen.to(tl.int64))


def sampled_choices_triton(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, block_v: int = 4096):
    b, q_len, vocab = probs.shape
    assert seeds.shape == (b,) and positions.shape == (b, q_len) and probs.stride(2) == 1
    out = torch.empty(b, q_len, dtype=torch.int64, device=probs.device)
    positions = positions.to(torch.int64).contiguous()
    _draw_kernel[(b, q_len)](
        probs, seeds.to(torch.int64).contiguous(), positions, out, vocab,
        probs.stride(0), probs.stride(1), positions.stride(0), out.stride(0),
        BLOCK_V=min(block_v, next_pow2(vocab)),
    )
    return out


# --- 5. KV compaction of the accepted paths -------------------------------------------------------


@triton.jit
def _compact_kernel(
    cache_ptr, start_ptr, path_ptr, length_ptr, B,
    stride_l, stride_b, stride_h, stride_s, stride_pb,
    D: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """One program per (layer, batch row, head): load every accepted row, then store them at
    start, start + 1, ... (a path's source slot may be another path row's destination, so all
    loads come before any store, inside one program)."""
    lb = tl.program_id(0)
    h = tl.program_id(1)
    layer = lb // B
    b = lb % B
    n = tl.load(length_ptr + b).to(tl.int32)
    start = tl.load(start_ptr + b)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, D)
    on_path = offs_q < n
    src = tl.load(path_ptr + b * stride_pb + offs_q, mask=on_path, other=0)
    base = cache_ptr + layer * stride_l + b * stride_b + h * stride_h
    rows = tl.load(base + (start + src)[:, None] * stride_s + offs_d[None, :], mask=on_path[:, None])
    tl.store(base + (start + offs_q)[:, None] * stride_s + offs_d[None, :], rows, mask=on_path[:, None])


def compact_kv_batch_triton(k, v, start: torch.Tensor, walk: WalkBatch) -> None:
    layers, b, h, _, d = k.shape
    assert v.shape == k.shape and k.stride(4) == 1 and v.stride(4) == 1
    path = walk.path.contiguous()
    block_q = next_pow2(path.shape[1])
    for cache in (k, v):
        _compact_kernel[(layers * b, h)](
            cache, start.to(torch.int64).contiguous(), path, walk.length, b,
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), path.stride(0),
            D=d, BLOCK_Q=block_q,
        )


# --- 6. top-K log-probs per drafted position ------------------------------------------------------
# K is a runtime loop bound, not a tl.constexpr: `budget: auto` asks for a different K nearly
# every step (the tree's nodes), and a constexpr K compiled a kernel for each one, stalling every
# stream on the JIT. The kernels compile once per vocabulary tiling, and the merge once per
# power-of-two bucket of its candidates (BLOCK_C = next_pow2(blocks x K): 7 sizes for K <= 64).


@triton.jit(do_not_specialize=["K"])
def _topk_blocks_kernel(
    logits_ptr, cand_val_ptr, cand_id_ptr, block_max_ptr, block_sum_ptr, V, NB, K,
    stride_lr, BLOCK_V: tl.constexpr,
):
    """Stage 1, one program per (row, vocabulary block): the block's max and sum of exp (for
    the log-sum-exp) and its K best logits (equal values: lower id first)."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    ids = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + r * stride_lr + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    tl.store(block_max_ptr + r * NB + blk, top)
    tl.store(block_sum_ptr + r * NB + blk, tl.sum(tl.exp(x - top), 0))
    for j in range(K):
        best = tl.max(x, 0)
        at = tl.min(tl.where(x == best, ids, 2147483647), 0)
        tl.store(cand_val_ptr + (r * NB + blk) * K + j, best)
        tl.store(cand_id_ptr + (r * NB + blk) * K + j, at)
        x = tl.where(ids == at, float("-inf"), x)


@triton.jit(do_not_specialize=["K"])
def _topk_merge_kernel(
    cand_val_ptr, cand_id_ptr, block_max_ptr, block_sum_ptr, out_val_ptr, out_id_ptr, NB, K,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Stage 2, one program per row: log-sum-exp over the blocks, the K best candidates."""
    r = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    bm = tl.load(block_max_ptr + r * NB + offs_b, mask=offs_b < NB, other=float("-inf"))
    bs = tl.load(block_sum_ptr + r * NB + offs_b, mask=offs_b < NB, other=0.0)
    top = tl.max(bm, 0)
    lse = top + tl.log(tl.sum(bs * tl.exp(bm - top), 0))
    offs_c = tl.arange(0, BLOCK_C)
    n = NB * K
    vals = tl.load(cand_val_ptr + r * n + offs_c, mask=offs_c < n, other=float("-inf"))
    cids = tl.load(cand_id_ptr + r * n + offs_c, mask=offs_c < n, other=2147483647)
    for j in range(K):
        best = tl.max(vals, 0)
        at = tl.min(tl.where(vals == best, cids, 2147483647), 0)
        tl.store(out_val_ptr + r * K + j, best - lse)
        tl.store(out_id_ptr + r * K + j, at.to(tl.int64))
        vals = tl.where(cids == at, float("-inf"), vals)


def topk_tiles(vocab: int, k: int, block_v: int = 4096) -> tuple[int, int, int]:
    """(BLOCK_V, BLOCK_C, BLOCK_B): the top-K kernels' compile-time tiles for a vocabulary and K.
    Only BLOCK_C follows K, by powers of two.

    Example: vocab 151936, k 1 ... 64 -> BLOCK_V 4096 (38 blocks); BLOCK_C 64, 128, ..., 4096."""
    block_v = min(block_v, next_pow2(vocab))
    nb = triton.cdiv(vocab, block_v)
    return block_v, next_pow2(nb * k), next_pow2(nb)


def topk_logprobs_triton(logits: torch.Tensor, k: int, block_v: int = 4096):
    rows, vocab = logits.shape
    assert 1 <= k <= vocab and logits.stride(1) == 1
    block_v, block_c, block_b = topk_tiles(vocab, k, block_v)
    nb = triton.cdiv(vocab, block_v)
    dev = logits.device
    cand_val = torch.empty(rows, nb, k, dtype=torch.float32, device=dev)
    cand_id = torch.empty(rows, nb, k, dtype=torch.int32, device=dev)
    block_max = torch.empty(rows, nb, dtype=torch.float32, device=dev)
    block_sum = torch.empty(rows, nb, dtype=torch.float32, device=dev)
    _topk_blocks_kernel[(rows, nb)](logits, cand_val, cand_id, block_max, block_sum, vocab, nb, k,
                                    logits.stride(0), BLOCK_V=block_v)
    values = torch.empty(rows, k, dtype=torch.float32, device=dev)
    ids = torch.empty(rows, k, dtype=torch.int64, device=dev)
    _topk_merge_kernel[(rows,)](cand_val, cand_id, block_max, block_sum, values, ids, nb, k,
                                BLOCK_C=block_c, BLOCK_B=block_b)
    return values, ids
