"""ddtree's fp32 CPU GEMM (workers/cpu_kernels/gemm.cpp, float_mm), which serves every fp32 linear on the
CPU (workers.model.linear): against float64 on shapes that break its tiling, batch-invariant
rows, and the routing of `linear` (bias, any leading shape, F.linear when gradients are on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.workers import cpu_kernels, model

pytestmark = pytest.mark.skipif(not cpu_kernels.float_kernel(), reason="float_mm serves AVX2 and AVX-512 CPUs only")

# The kernel's tiling: 12 output columns per task step; with AVX2 rows in groups of 4 and 3 (2
# when M is 2 or 5) in register tiles of 4 x 3, 3 x 4 and 2 x 6 columns, steps of 8 inputs;
# with AVX-512 up to 9 rows in one group (tiles of R x 6, 4, 3 or 2 columns) and more in
# groups of at most 5 (3, 4 or 5 rows), steps of 16 inputs, the lanes summed 16 outputs at a
# time (then 8, 4, 1); columns past a multiple of a tile's one by one, a tail of K
# mod the lanes added one by one; one row (4 columns at a time) has its own loop. These shapes
# and row counts land in every branch of either build.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 33, 65]
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


def test_a_narrower_build_is_chosen_by_name_and_a_wider_or_unknown_one_refused(monkeypatch):
    """DDTREE_CPU_BUILD picks the kernel's vector build (benchmarks measure the AVX2 build on an
    AVX-512 machine with it); a build this CPU cannot run, or a name that is none, says which
    builds it can."""
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.delenv("DDTREE_CPU_BUILD", raising=False)
    assert cpu_kernels.vector_build() == capability
    monkeypatch.setenv("DDTREE_CPU_BUILD", "AVX2")
    assert cpu_kernels.vector_build() == "AVX2"
    monkeypatch.setenv("DDTREE_CPU_BUILD", "SSE42")
    with pytest.raises(RuntimeError, match="choose one of"):
        cpu_kernels.vector_build()
    if capability == "AVX2":
        monkeypatch.setenv("DDTREE_CPU_BUILD", "AVX512")
        with pytest.raises(RuntimeError, match="this CPU reports AVX2"):
            cpu_kernels.vector_build()


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


# --- tree_attention ---------------------------------------------------------------------------


def random_tree_mask(q_len: int, gen: torch.Generator) -> torch.Tensor:
    """[Q, Q] ancestor-or-self mask of a random tree (parents[i] < i)."""
    from ddtree.kernels.tree import ancestor_mask

    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)])
    return ancestor_mask(parents)


def pool_case(lengths: list[int], q_len: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64, seed: int = 0):
    """A paged-pool layout: storage [T, Hkv, D], every sequence's positions at shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    batch, span = len(lengths), max(lengths) + q_len
    slots = torch.randperm(batch * span + 7, generator=gen)[: batch * span].view(batch, span)
    k = torch.randn(batch * span + 7, kv_heads, head_dim, generator=gen)
    v = torch.randn(batch * span + 7, kv_heads, head_dim, generator=gen)
    q = torch.randn(batch, heads, q_len, head_dim, generator=gen) * 2
    mask = torch.stack([random_tree_mask(q_len, gen) for _ in lengths])
    return q, k, v, slots, torch.tensor(lengths), mask


def attention(q, k, v, slots, lengths, mask):
    kv_heads, head_dim = k.shape[1], k.shape[2]
    return torch.ops.ddtree_cpu.tree_attention(q, k, v, slots * (kv_heads * head_dim), kv_heads, head_dim, lengths, mask,
                                               1.0 / head_dim ** 0.5)


def reference_attention(q, k, v, slots, lengths, mask) -> torch.Tensor:
    """float64, one row at a time: softmax over the context and the visible block keys."""
    batch, heads, q_len, head_dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        for i in range(q_len):
            positions = list(range(int(lengths[b]))) + [int(lengths[b]) + j for j in range(q_len) if mask[b, i, j]]
            for h in range(heads):
                keys = k[slots[b, positions], h // group].double()
                values = v[slots[b, positions], h // group].double()
                weights = torch.softmax(keys @ q[b, h, i].double() / head_dim ** 0.5, dim=0)
                out[b, h, i] = weights @ values
    return out


# head dimensions: 64 (4 vectors of 16 or 8 lanes at a time), 24 and 72 (one 16-lane vector and
# then 8 lanes left over with AVX-512), 80 (four vectors and one more)
@pytest.mark.parametrize("head_dim", [64, 24, 72, 80])
@pytest.mark.parametrize("lengths,q_len", [([0], 1), ([5], 9), ([37, 0, 300], 5), ([1, 64], 17), ([3], 65)])
def test_tree_attention_equals_float64_softmax(lengths, q_len, head_dim):
    case = pool_case(lengths, q_len, head_dim=head_dim, seed=q_len)
    got, want = attention(*case), reference_attention(*case)
    assert got.dtype == torch.float32 and got.shape == case[0].shape
    assert (got.double() - want).abs().max() < 2e-5


@pytest.mark.parametrize("head_dim", [64, 72])
def test_a_tree_row_is_bitwise_plain_decoding_of_its_token(head_dim):
    """The lossless property the kernel is for: a verify row sees its context and then its
    ancestors in depth order; once the path is accepted, plain decoding of the same token sees
    the same keys as context. Both compute bitwise the same output (and a sequence's rows do not
    depend on the other sequences of the step or the thread count)."""
    q, k, v, slots, lengths, mask = pool_case([41, 7, 0], 9, head_dim=head_dim, seed=3)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            tree = attention(q, k, v, slots, lengths, mask)
            for b in range(3):
                alone = attention(q[b : b + 1], k, v, slots[b : b + 1], lengths[b : b + 1], mask[b : b + 1])
                assert torch.equal(alone[0], tree[b]), (b, t)
                for i in range(9):
                    path = [j for j in range(9) if mask[b, i, j]]  # ancestors then the node itself
                    ancestors, base = path[:-1], int(lengths[b])
                    # plain decoding: the ancestors committed as context, the node its only block row
                    row_slots = torch.cat([slots[b, :base], slots[b, [base + j for j in ancestors]], slots[b, [base + i]]])
                    plain = attention(q[b : b + 1, :, i : i + 1], k, v, row_slots[None],
                                      torch.tensor([base + len(ancestors)]), torch.ones(1, 1, 1, dtype=torch.bool))
                    assert torch.equal(plain[0, :, 0], tree[b, :, i]), (b, i, t)
    finally:
        torch.set_num_threads(threads)


def test_padding_rows_are_skipped_and_real_rows_unchanged():
    """A step pads every sequence's tree to the step's Q rows; on the CPU only the real rows are
    computed (`rows`): each real row is bitwise what the padded call gives it, padding rows
    come back zero, and a sequence of no rows is all zero."""
    q, k, v, slots, lengths, mask = pool_case([41, 7, 0, 12], 9, seed=5)
    kv_heads, head_dim = k.shape[1], k.shape[2]
    padded = attention(q, k, v, slots, lengths, mask)
    rows = torch.tensor([9, 1, 4, 0])
    packed = torch.ops.ddtree_cpu.tree_attention(q, k, v, slots * (kv_heads * head_dim), kv_heads, head_dim, lengths,
                                                 mask, 1.0 / head_dim ** 0.5, rows)
    for b, n in enumerate(rows.tolist()):
        assert torch.equal(packed[b, :, :n], padded[b, :, :n]), b
        assert not packed[b, :, n:].any(), b
    with pytest.raises(RuntimeError, match="rows of a 9-row block"):
        torch.ops.ddtree_cpu.tree_attention(q, k, v, slots * (kv_heads * head_dim), kv_heads, head_dim, lengths,
                                            mask, 0.125, torch.tensor([10, 1, 1, 1]))
    # the real rows alone as queries ([N, Hq, D], sequence after sequence): the same rows back,
    # in that order (what a packed forward's attention asks of the paged pool)
    real = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(rows.tolist())])
    alone = torch.ops.ddtree_cpu.tree_attention(real, k, v, slots * (kv_heads * head_dim), kv_heads, head_dim, lengths,
                                                mask, 1.0 / head_dim ** 0.5, rows, True)
    assert torch.equal(alone, torch.cat([padded[b, :, :n].transpose(0, 1) for b, n in enumerate(rows.tolist())]))
    # read in place where each row's heads lie contiguous: the query heads of a wider tensor
    # (as attention splits them from the rotated queries and keys of one op), its rows strided
    wide = torch.cat([real, torch.randn(real.shape[0], 2, real.shape[2])], dim=1)[:, : real.shape[1]]
    assert not wide.is_contiguous()
    assert torch.equal(torch.ops.ddtree_cpu.tree_attention(wide, k, v, slots * (kv_heads * head_dim), kv_heads, head_dim,
                                                           lengths, mask, 1.0 / head_dim ** 0.5, rows, True), alone)
    with pytest.raises(RuntimeError, match="rows sum to 14"):
        torch.ops.ddtree_cpu.tree_attention(real[1:], k, v, slots * (kv_heads * head_dim), kv_heads, head_dim,
                                            lengths, mask, 0.125, rows, True)
    with pytest.raises(RuntimeError, match="packed queries need rows"):
        torch.ops.ddtree_cpu.tree_attention(real, k, v, slots * (kv_heads * head_dim), kv_heads, head_dim, lengths,
                                            mask, 0.125, None, True)


def test_tree_attention_refuses_what_it_cannot_read():
    q, k, v, slots, lengths, mask = pool_case([4], 3)
    with pytest.raises(RuntimeError, match="exceed"):
        attention(q, k, v, slots, torch.tensor([5]), mask)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        torch.ops.ddtree_cpu.tree_attention(q, k, v, slots, 2, 64, lengths, mask, 0.125)


def test_attention_routes_only_what_the_kernel_computes():
    """fp32 CPU blocks of decode and verify size with a head dimension of 8-lane multiples take
    tree_attention; long prefill chunks, other dtypes and other head dimensions take SDPA."""
    from ddtree.workers.model import ATTENTION_MAX_ROWS, cpu_attention

    assert cpu_attention(torch.zeros(2, 3, 64), 9)
    assert not cpu_attention(torch.zeros(2, 3, 64), ATTENTION_MAX_ROWS + 1)
    assert not cpu_attention(torch.zeros(2, 3, 60), 9)
    assert not cpu_attention(torch.zeros(2, 3, 64, dtype=torch.float64), 9)


# --- row-wise ops -------------------------------------------------------------------------------

ROW_SHAPES = [(1, 8), (3, 13), (9, 576), (17, 64), (300, 100)]  # 13 and 100: a tail past the 8 partial sums; 300 rows split over threads


def rows_alone_and_together(op, *inputs):
    """Each row's result of one call on every row, against the 1-row calls, with 1 and 2
    threads: bitwise the same (batch invariance, as float_mm's)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [op(*(t[i : i + 1] for t in inputs)) for i in range(len(inputs[0]))]
        for t in (1, 2):
            torch.set_num_threads(t)
            together = op(*inputs)
            for i, one in enumerate(alone):
                for a, b in zip(together if isinstance(together, tuple) else (together,),
                                one if isinstance(one, tuple) else (one,)):
                    assert torch.equal(a[i : i + 1], b), (i, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows,d", ROW_SHAPES)
def test_rms_norm_and_add_rms_norm_equal_float64_and_do_not_depend_on_their_batch(rows, d):
    gen = torch.Generator().manual_seed(rows * 1000 + d)
    x, r, w = torch.randn(rows, d, generator=gen), torch.randn(rows, d, generator=gen), torch.randn(d, generator=gen)
    want = F.rms_norm(x.double(), (d,), w.double(), 1e-5)
    got = torch.ops.ddtree_cpu.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    total, normed = torch.ops.ddtree_cpu.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)
    torch.testing.assert_close(normed.double(), F.rms_norm((x + r).double(), (d,), w.double(), 1e-5), rtol=1e-5, atol=1e-6)
    rows_alone_and_together(lambda a: torch.ops.ddtree_cpu.rms_norm(a, w, 1e-5), x)
    rows_alone_and_together(lambda a, b: torch.ops.ddtree_cpu.add_rms_norm(a, b, w, 1e-5), x, r)


@pytest.mark.parametrize("rows,d", ROW_SHAPES)
def test_silu_mul_equals_float64_on_the_views_of_one_fused_output(rows, d):
    """gate and up as the MLP has them: the two halves of one [rows, 2I] GEMM output (row
    stride 2I), read in place; gates far past exp's range (-100, 100) included."""
    gen = torch.Generator().manual_seed(rows + d)
    fused = torch.randn(rows, 2 * d, generator=gen) * 4
    fused[0, 0], fused[-1, d - 1] = -100.0, 100.0  # the first row's first gate, the last row's last
    gate, up = fused.split(d, dim=-1)
    want = F.silu(gate.double()) * up.double()
    got = torch.ops.ddtree_cpu.silu_mul(gate, up)
    assert got.shape == gate.shape and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.ops.ddtree_cpu.silu_mul(gate.contiguous(), up.contiguous()), got)
    rows_alone_and_together(torch.ops.ddtree_cpu.silu_mul, gate, up)


@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 9, 3, 64), (5, 4, 2, 8), (300, 2, 1, 16)])
def test_rope_qk_is_apply_rope_of_both_on_the_views_of_one_fused_output(rows, heads, kv_heads, d):
    """q and k as attention has them: views of one [rows, (Hq + 2 Hkv) D] GEMM output; cos and
    sin [rows, 1, D] as the forward makes them (a transposed view): the rotated [rows, Hq + Hkv, D]
    that apply_rope of their concatenation gives, to float rounding."""
    gen = torch.Generator().manual_seed(rows + heads + d)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(rows, heads, d), k.view(rows, kv_heads, d)
    angles = torch.rand(1, 1, rows, d // 2, generator=gen, dtype=torch.float64) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).float()[0].transpose(0, 1) for f in (torch.cos, torch.sin))
    want = model.apply_rope(torch.cat([q, k], dim=-2).double(), cos.double(), sin.double())
    got = torch.ops.ddtree_cpu.rope_qk(q, k, cos, sin)
    assert got.shape == (rows, heads + kv_heads, d)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    rows_alone_and_together(torch.ops.ddtree_cpu.rope_qk, q, k, cos, sin)


def test_row_ops_serve_inference_and_gradients_take_torch():
    """The model's norm, gating and rotation take the one-op kernels in inference (each within
    float rounding of torch's ops); with gradients on (training a drafter) they are torch's, and
    the gradient flows."""
    norm = model.RMSNorm(16, 1e-6)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    with torch.inference_mode():
        assert model.row_ops(x, norm.weight)
        total, normed = norm.add_forward(x, r)
        torch.testing.assert_close(normed, F.rms_norm(x + r, (16,), norm.weight, 1e-6))
        assert torch.equal(normed, torch.ops.ddtree_cpu.rms_norm(total, norm.weight, 1e-6))
        assert not model.row_ops(x.double())
        gate, up = torch.randn(3, 8), torch.randn(3, 8)
        assert torch.equal(model.silu_mul(gate, up), torch.ops.ddtree_cpu.silu_mul(gate, up))
        q, k, cos, sin = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
        rotated = torch.ops.ddtree_cpu.rope_qk(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(model.rope_qk(q, k, cos, sin), (rotated[:, :4], rotated[:, 4:])))
    assert not model.row_ops(x)  # gradients on
    assert torch.equal(model.silu_mul(gate, up), F.silu(gate) * up)
    assert all(torch.equal(a, b) for a, b in zip(model.rope_qk(q, k, cos, sin),
                                                 model.apply_rope(torch.cat([q, k], dim=-2), cos, sin).split([4, 2], dim=-2)))
    norm.add_forward(x, r)[1].sum().backward()
    assert norm.weight.grad is not None
