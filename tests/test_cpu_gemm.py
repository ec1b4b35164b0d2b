"""ddtree's fp32 CPU GEMM (workers/cpu_gemm.cpp, float_mm), which serves every fp32 linear on the
CPU (workers.model.linear): against float64 on shapes that break its tiling, batch-invariant
rows, and the routing of `linear` (bias, any leading shape, F.linear when gradients are on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.workers import cpu_gemm, model

pytestmark = pytest.mark.skipif(not cpu_gemm.float_kernel(), reason="float_mm serves AVX2 CPUs only")

# The kernel's tiling: 12 output columns per task step, rows in groups of 4 and 3 (2 when M is 2
# or 5) in register tiles of 4 x 3, 3 x 4 and 2 x 6 columns (columns past a multiple of those one
# by one), steps of 8 inputs and a tail of K mod 8 added one by one; one row (4 columns at a
# time) has its own loop. These shapes and row counts land in every branch.
ROWS = [1, 2, 3, 4, 5, 7, 9, 17, 33, 65]
SHAPES = [(1, 8), (5, 7), (11, 64), (12, 100), (13, 576), (25, 1), (130, 96), (50, 1537)]


def float_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.ddtree_cpu.float_mm(x, w)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_float_mm_equals_float64_product(rows, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    want = x.double() @ w.double().T
    # float32 sums of k products in another order: within a few ulps of the sum of |products|
    bound = 1e-6 * k ** 0.5 * (x.abs().double() @ w.abs().double().T) + 1e-30
    got = float_mm(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("n,k", [(25, 100), (130, 576)])
def test_float_mm_rows_do_not_depend_on_their_batch(n, k):
    """Batch invariance: row r of an M-row call is bitwise the 1-row call on that row, for every M
    and with 1 or 2 threads. oneDNN's and MKL's GEMMs are not (row 0 of a 9-row product differed
    from the 1-row product by 6e-7 here): a tree's rows, verified together, computed other
    values than plain decoding of the same tokens, and a near-tie could go the other way."""
    gen = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(max(ROWS), k, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([float_mm(x[i : i + 1], w) for i in range(len(x))])
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in ROWS:
                assert torch.equal(float_mm(x[:rows], w), alone[:rows]), (rows, t)
            assert torch.equal(float_mm(x[3:12], w), alone[3:12]), t  # rows in other tile positions
    finally:
        torch.set_num_threads(threads)


def test_float_mm_refuses_what_it_does_not_compute():
    with pytest.raises(RuntimeError, match="float32"):
        float_mm(torch.ones(2, 4, dtype=torch.float64), torch.ones(3, 4))
    with pytest.raises(RuntimeError, match="inputs"):
        float_mm(torch.ones(2, 4), torch.ones(3, 5))


def test_linear_routes_fp32_through_the_kernel_with_bias_and_any_shape():
    """`linear` on [B, Q, K] with a bias: the kernel's rows plus the bias, the shape kept; a
    transposed (non-contiguous) input gives the same values."""
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(30, 40, generator=gen), torch.randn(30, generator=gen)
    x = torch.randn(2, 3, 40, generator=gen)
    with torch.inference_mode():
        out = model.linear(x, w, bias)
        assert torch.equal(out, (float_mm(x.reshape(6, 40), w) + bias).view(2, 3, 30))
        assert torch.equal(model.linear(x.transpose(0, 1), w, bias), out.transpose(0, 1))
    torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_linear_with_gradients_is_f_linear():
    """Training a drafter through the target's LM head needs a backward: the C++ op has none, so
    with gradients on `linear` is F.linear and the gradient flows."""
    w = torch.randn(6, 8, requires_grad=True)
    out = model.linear(torch.randn(3, 8), w)
    out.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
