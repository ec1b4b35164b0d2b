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
