"""Batch-invariant kernels for `deterministic: true` on the GPU: a row's result is bitwise the
same whatever rows share its call.

cuBLAS picks its tiles, split-K and reduction order from the whole call's shape, so a row of an
M-row matmul can round differently from the same row alone -- and a tree node's logits from
plain decoding's, so a near-tie can break differently. These kernels fix every choice that
decides a row's arithmetic independently of M:

- `invariant_linear`: x @ weight.T with one tile shape (INVARIANT_BLOCK_M x _N x _K) and no
  split-K: each output element is one program's K loop, in ascending K tiles, accumulated in
  fp32; the row count only decides how many row tiles run.
- `invariant_rms_norm`: a fixed number of rows a program (from the hidden size), each row's
  sum of squares over the hidden size in fixed chunks of at most NORM_BLOCK lanes, then one
  fixed reduction of the lanes.

Attention is the paged tree-attention kernel with `batch_invariant=True`
(kernels.triton_kernels.paged_tree_attention_triton): its row tile and its keys per split fixed,
so a sequence's splits are the same whatever the batch.

Each kernel has a torch reference here (`*_ref`), equal within rounding; tests run the kernels
on the CPU under the interpreter (TRITON_INTERPRET=1), where bf16 cannot go through `tl.dot`
(numpy has no bfloat16): fp16 stands in there, bf16 is checked compiled (`deterministic_check`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .batched import paged_tree_attention_ref
from .tree_batch import pack_bits
from .triton_kernels import paged_tree_attention_triton
from .triton_support import next_pow2

# One tile shape for every call, whatever its rows: a row's products and their order depend on
# BLOCK_N and BLOCK_K only, and the compiled tile (its MMA instructions) on all three.
INVARIANT_BLOCK_M = 32
INVARIANT_BLOCK_N = 64
INVARIANT_BLOCK_K = 64
NORM_BLOCK = 1024  # the hidden size is summed in chunks of at most this many lanes


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, o_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (BLOCK_N output columns, BLOCK_M rows): the whole K loop, in order, into
    an fp32 accumulator. M is not specialized (a 1-row call compiles the M-row call's kernel)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m = offs_m < M
    in_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        in_k = ks < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=in_m[:, None] & in_k[None, :], other=0.0)
        b = tl.load(w_ptr + ks[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=in_k[:, None] & in_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(o_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, fp32 accumulation;
    row r of the result is bitwise the same for any number of rows around it."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.shape == (n, k) and x.dtype == weight.dtype, (x.shape, x.dtype, weight.shape, weight.dtype)
    assert bias is None or bias.shape == (n,)
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(n, INVARIANT_BLOCK_N), triton.cdiv(m, INVARIANT_BLOCK_M))
        _invariant_matmul_kernel[grid](
            rows, weight, weight if bias is None else bias, out,
            m, n, k,
            rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
            BLOCK_M=INVARIANT_BLOCK_M, BLOCK_N=INVARIANT_BLOCK_N, BLOCK_K=INVARIANT_BLOCK_K,
        )
    return out.view(*x.shape[:-1], n)


def invariant_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """invariant_linear's value, through F.linear in fp32 (equal within rounding, not bitwise)."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _invariant_rms_norm_kernel(
    x_ptr, w_ptr, o_ptr,
    M, H, stride_xm, stride_om, eps,
    HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per ROWS rows: each row's mean of squares in fp32 over chunks of BLOCK lanes
    in ascending order, one tl.sum over the lanes, then x * rsqrt(mean + eps) * weight. HALF: the
    normalized row is rounded to the output dtype before the weight multiplies it (the model's
    RMSNorm for fp16 / bf16)."""
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    in_m = offs_m < M
    lanes = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + offs
        inside = in_m[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        lanes += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(lanes, 1) / H + eps)
    for h0 in range(0, H, BLOCK):
        cols = h0 + offs
        inside = in_m[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        y = x * rstd[:, None]
        if HALF:
            y = y.to(o_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_ptr + offs_m[:, None] * stride_om + cols[None, :], (y * w[None, :]).to(o_ptr.dtype.element_ty),
                 mask=inside)


def norm_tile(hidden: int) -> tuple[int, int]:
    """(rows a program, lanes a chunk) of the norm for a hidden size: the hidden size's alone,
    never the row count's. Example: 128 -> (16, 128); 4096 -> (2, 1024)."""
    block = min(NORM_BLOCK, next_pow2(hidden))
    return max(1, min(16, 2048 // block)), block


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] by weight [H] (workers.model.RMSNorm's arithmetic: fp16 / bf16
    normalized in fp32 and rounded before the weight multiplies), each row reduced in one fixed
    order -> [..., H] in x's dtype."""
    h = x.shape[-1]
    assert weight.shape == (h,), (x.shape, weight.shape)
    rows = x.reshape(-1, h)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if m:
        per_program, block = norm_tile(h)
        _invariant_rms_norm_kernel[(triton.cdiv(m, per_program),)](
            rows, weight, out, m, h, rows.stride(0), out.stride(0), eps,
            HALF=x.dtype in (torch.float16, torch.bfloat16), ROWS=per_program, BLOCK=block,
        )
    return out.view(x.shape)


def invariant_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """invariant_rms_norm's value through torch (equal within rounding)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


# --- a check for a GPU run (benchmarks/gpu_check.py calls it) ------------------------------------


def _rows_bitwise(call, x: torch.Tensor, counts: tuple[int, ...]) -> bool:
    """call(x[:m]) row r == call(x[r:r+1]) bitwise for every m in counts, r < m."""
    lone = torch.cat([call(x[r : r + 1]) for r in range(max(counts))])
    return all(torch.equal(call(x[:m]), lone[:m]) for m in counts)


def _ms(fn, repeats: int = 20) -> float:
    """Milliseconds per call of fn on CUDA (events around `repeats` calls, after a warm-up)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _chain_attention(seq_lengths: list[int], q_len: int, page: int, heads: int, kv_heads: int, head_dim: int,
                     dtype, device, seed: int):
    """A paged pool holding sequences of `seq_lengths` committed positions, each with a chain
    block of up to q_len rows: (call(which, rows, batch_invariant), reference(which)) over any
    subset, at any block length `rows` <= q_len (a chain's row i is the same at any length > i)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + q_len) // page) for n in seq_lengths]
    ids = torch.randperm(sum(need), generator=g)
    pages = list(ids.split(need))
    k_pool = torch.randn(sum(need) * page, kv_heads, head_dim, generator=g).to(dtype).to(device)
    v_pool = torch.randn(sum(need) * page, kv_heads, head_dim, generator=g).to(dtype).to(device)
    q_rows = torch.randn(len(seq_lengths), heads, q_len, head_dim, generator=g).to(dtype).to(device)

    def inputs(which, rows=q_len):
        table = torch.zeros(len(which), max(need[i] for i in which), dtype=torch.int64)
        for row, i in enumerate(which):
            table[row, : need[i]] = pages[i]
        lengths = torch.tensor([seq_lengths[i] for i in which])
        bits = pack_chain_bits(rows).expand(len(which), -1, -1).contiguous()
        return q_rows[which, :, :rows].contiguous(), table.to(device), lengths.to(device), bits.to(device)

    def call(which, rows=q_len, batch_invariant=True):
        q, table, lengths, bits = inputs(which, rows)
        return paged_tree_attention_triton(q, k_pool, v_pool, table, lengths, bits, page,
                                           batch_invariant=batch_invariant)

    def reference(which):
        q, table, lengths, bits = inputs(which)
        return paged_tree_attention_ref(q.float(), k_pool.float(), v_pool.float(), table, lengths, bits, page)

    return call, reference


def pack_chain_bits(q_len: int) -> torch.Tensor:
    """[1, Q, W] int32 mask bits of a causal chain block (row i sees rows 0 ... i)."""
    return pack_bits(torch.ones(q_len, q_len, dtype=torch.bool).tril()[None])


def deterministic_check(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, hidden: int = 4096,
                        intermediate: int = 12288, head_dim: int = 128, heads: int = 32, kv_heads: int = 8,
                        row_counts: tuple[int, ...] = (1, 2, 7, 17, 65), contexts: tuple[int, ...] = (3000, 40, 700, 0),
                        timed_rows: tuple[int, ...] = (1, 17, 65, 1040), seed: int = 0) -> dict:
    """Batch invariance of the `deterministic: true` kernels on `device`, compiled, at a
    target's shapes (default: Qwen3-8B's), as a JSON-able dict:

    - "linear", "rms_norm": {"rows_bitwise": row r of every m-row call (m in row_counts) equals
      the 1-row call, "max_abs_err": against the torch reference}; "linear" also
      "cublas_rows_bitwise", the same check of F.linear (cuBLAS: expected false somewhere);
    - "attention": the paged kernel with batch_invariant over sequences of `contexts` committed
      positions (crossing INVARIANT_SPLIT_KEYS) with 17-row chain blocks, each sequence alone
      vs together, and its first row alone in a 1-row block (Q 1, as plain decoding):
      "rows_bitwise", "max_abs_err", and "default_rows_bitwise" (the same without
      batch_invariant, where the row tile follows Q and the split count the batch);
    - "linear_ms" (CUDA only): {rows: {"invariant": ms, "cublas": ms}} for the
      hidden -> intermediate GEMM at `timed_rows` rows -- the cost of the mode;
    - "ok": every "rows_bitwise" true.

    On the CPU under TRITON_INTERPRET=1 it runs too (small shapes, fp16: tests)."""
    g = torch.Generator().manual_seed(seed)
    m = max(row_counts)
    x = torch.randn(m, hidden, generator=g).to(dtype).to(device)
    w = (torch.randn(intermediate, hidden, generator=g) / hidden**0.5).to(dtype).to(device)
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else device,
                 "dtype": str(dtype).removeprefix("torch.")}
    out["linear"] = {
        "rows_bitwise": _rows_bitwise(lambda rows: invariant_linear(rows, w), x, row_counts),
        "max_abs_err": float((invariant_linear(x, w).float() - invariant_linear_ref(x, w).float()).abs().max()),
        "cublas_rows_bitwise": _rows_bitwise(lambda rows: F.linear(rows, w), x, row_counts),
    }
    norm_w = torch.randn(hidden, generator=g).to(dtype).to(device)
    out["rms_norm"] = {
        "rows_bitwise": _rows_bitwise(lambda rows: invariant_rms_norm(rows, norm_w, 1e-6), x, row_counts),
        "max_abs_err": float((invariant_rms_norm(x, norm_w, 1e-6).float()
                              - invariant_rms_norm_ref(x, norm_w, 1e-6).float()).abs().max()),
    }
    call, reference = _chain_attention(list(contexts), 17, 16, heads, kv_heads, head_dim, dtype, device, seed)
    together = list(range(len(contexts)))

    def alone_and_together(invariant: bool) -> bool:
        both = call(together, batch_invariant=invariant)
        return all(torch.equal(both[i], call([i], batch_invariant=invariant)[0])
                   and torch.equal(both[i, :, :1], call([i], 1, batch_invariant=invariant)[0]) for i in together)

    out["attention"] = {
        "rows_bitwise": alone_and_together(True),
        "max_abs_err": float((call(together).float().cpu() - reference(together).cpu()).abs().max()),
        "default_rows_bitwise": alone_and_together(False),
    }
    if device == "cuda":
        out["linear_ms"] = {}
        for rows in timed_rows:
            a = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
            out["linear_ms"][rows] = {"invariant": _ms(lambda: invariant_linear(a, w)), "cublas": _ms(lambda: F.linear(a, w))}
    out["ok"] = all(out[k]["rows_bitwise"] for k in ("linear", "rms_norm", "attention"))
    return out
