"""`deterministic: true` on the GPU: the batch-invariant kernels (kernels.batch_invariant, and
the paged tree-attention kernel with `batch_invariant`) give each row bitwise the result it gets
alone, whatever rows share its call -- the property cuBLAS's shape-dependent tiles and split-K,
and the paged kernel's batch-dependent splits, do not have. Checked under Triton's interpreter
(TRITON_INTERPRET=1, conftest.py) on shapes that break the tiles (K, N, H not multiples of a
tile; M 1 ... 65), against torch references within rounding; a tiny model's forward routed as
on CUDA (CPU tensors on the Triton route) gives each row's logits bitwise its lone run's.
Under the interpreter bf16 cannot go through `tl.dot` (numpy has no bfloat16): fp16 stands in
for the GEMM and attention there; with DDTREE_KERNEL_DEVICE=cuda these tests run compiled, bf16
too, and `deterministic_check` (benchmarks/gpu_check.py's hook) checks bf16 at Qwen3-8B's shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is a Linux dependency of ddtree")

from ddtree.kernels import batched  # noqa: E402
from ddtree.kernels import batch_invariant as bi  # noqa: E402
from ddtree.kernels import triton_kernels as tk  # noqa: E402
from ddtree.kernels.tree import Tree, build_tree  # noqa: E402
from ddtree.kernels.tree_batch import TreeBatch, pack_bits  # noqa: E402

# ~40 s under the interpreter on 2 cores: `make test` runs them, `make test-fast` (kept under 5
# minutes) leaves them to it -- the deterministic route serves CUDA only.
pytestmark = pytest.mark.slow

DEVICE = os.environ.get("DDTREE_KERNEL_DEVICE", "cpu")
ROW_COUNTS = (1, 2, 7, 17, 65)
# tl.dot in bf16 runs compiled only (the interpreter's numpy has no bfloat16)
DOT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE != "cpu" else [])


def assert_rows_alone(call, x: torch.Tensor) -> None:
    """call(x[:m]) row r == call(x[r:r+1]) bitwise, for every m in ROW_COUNTS and every r < m."""
    lone = torch.cat([call(x[r : r + 1]) for r in range(max(ROW_COUNTS))])
    for m in ROW_COUNTS:
        got = call(x[:m])
        for r in range(m):
            assert torch.equal(got[r], lone[r]), f"row {r} of a {m}-row call differs from the row alone"


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("k, n, bias", [(200, 150, False), (64, 130, True), (70, 64, False)])
def test_invariant_linear_rows_are_bitwise_their_lone_rows(dtype, k, n, bias):
    """Row r of an M-row GEMM (M 1 ... 65: inside one row tile, across several) is bitwise the
    1-row call's, and the result is F.linear's in fp32 within rounding; K and N off the tiles."""
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(max(ROW_COUNTS), k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    assert_rows_alone(lambda rows: bi.invariant_linear(rows, w, b), x)
    got = bi.invariant_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float().cpu(), bi.invariant_linear_ref(x, w, b).float().cpu(), atol=tol, rtol=tol)
    # a [B, Q, K] block and a strided view of the rows: the same rows, the same bits
    block = x[:64].view(4, 16, k)
    assert torch.equal(bi.invariant_linear(block, w, b).view(64, n), got[:64])
    assert torch.equal(bi.invariant_linear(x[::2], w, b), got[::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [72, 1100])  # 1100: two chunks of NORM_BLOCK lanes, the second partial
def test_invariant_rms_norm_rows_are_bitwise_their_lone_rows(dtype, hidden):
    """Each row's norm is bitwise the same alone as among 1 ... 65 rows, and the model's
    RMSNorm arithmetic (fp16 / bf16 normalized in fp32, rounded, then times the weight) within
    rounding."""
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(max(ROW_COUNTS), hidden, generator=g) * 3).to(dtype).to(DEVICE)
    w = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    assert_rows_alone(lambda rows: bi.invariant_rms_norm(rows, w, 1e-6), x)
    got = bi.invariant_rms_norm(x, w, 1e-6)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float().cpu(), bi.invariant_rms_norm_ref(x, w, 1e-6).float().cpu(),
                               atol=tol, rtol=tol)


def random_tree(size: int, seed: int) -> Tree:
    if size == 1:
        return Tree.root_only(3)
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(6, 40, generator=g, dtype=torch.float64) * 3, -1)
    return build_tree(3, logprobs, size - 1)


class Sequences:
    """Sequences in one paged pool, each with its pages (shuffled ids), committed length, tree
    and query rows; `call` runs any subset of them in one batch at any Q >= their trees, with
    block tables as wide as the longest length + Q needs."""

    def __init__(self, lengths, sizes, page, hq, hkv, d, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.page, self.lengths, self.sizes = page, lengths, sizes
        need = [-(-(n + s) // page) for n, s in zip(lengths, sizes)]
        ids = torch.randperm(sum(need) + 3, generator=g)
        self.pages, at = [], 0
        for n in need:
            self.pages.append(ids[at : at + n])
            at += n
        slots = (sum(need) + 3) * page
        self.k_pool = torch.randn(slots, hkv, d, generator=g).to(dtype)
        self.v_pool = torch.randn(slots, hkv, d, generator=g).to(dtype)
        self.q = [torch.randn(hq, s, d, generator=g).to(dtype) for s in sizes]
        self.trees = [random_tree(s, seed + i) for i, s in enumerate(sizes)]

    def inputs(self, which: list[int], q_len: int):
        b = len(which)
        # the tables cover [0, length + Q) (padding rows' positions past a sequence's own pages: page 0)
        width = max(-(-(self.lengths[i] + q_len) // self.page) for i in which)
        table = torch.zeros(b, width, dtype=torch.int64)
        q = torch.randn(b, self.q[0].shape[0], q_len, self.q[0].shape[2]).to(self.q[0].dtype)  # padding rows: noise
        for row, i in enumerate(which):
            table[row, : len(self.pages[i])] = self.pages[i]
            q[row, :, : self.sizes[i]] = self.q[i]
        trees = TreeBatch.of([self.trees[i] for i in which], q_len)
        lengths = torch.tensor([self.lengths[i] for i in which])
        bits = batched.tree_metadata_ref(trees, lengths).bits
        return q, table, lengths, bits, trees.sizes

    def call(self, which: list[int], q_len: int, split_keys: int | None):
        q, table, lengths, bits, rows = (t.to(DEVICE) for t in self.inputs(which, q_len))
        return tk.paged_tree_attention_triton(q, self.k_pool.to(DEVICE), self.v_pool.to(DEVICE), table, lengths,
                                              bits, self.page, rows, split_keys=split_keys, batch_invariant=True).cpu()

    def reference(self, which: list[int], q_len: int):
        q, table, lengths, bits, rows = self.inputs(which, q_len)
        return batched.paged_tree_attention_ref(q.float(), self.k_pool.float(), self.v_pool.float(), table, lengths,
                                                bits, self.page, rows)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("split_keys", [32, None])  # None: INVARIANT_SPLIT_KEYS
def test_paged_attention_rows_are_bitwise_alone_whatever_the_batch(dtype, split_keys):
    """With `batch_invariant`, a sequence's tree rows are bitwise the same alone (its own Q, its
    own table width) as in batches of other sequences at Q 17 and 33, whose longer tables add
    splits past its end: the row tile and the keys per split no longer follow the call's shape
    (by default both do, through paged_split_keys' program count). GQA 4, head width 64,
    contexts across split and page boundaries; the reference within rounding."""
    seqs = Sequences(lengths=[100, 7, 63, 0, 31], sizes=[17, 4, 1, 9, 12], page=8, hq=8, hkv=2, d=64, dtype=dtype)
    alone = [seqs.call([i], seqs.sizes[i], split_keys)[0] for i in range(5)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for which, q_len in (([0, 1, 2, 3, 4], 17), ([2, 0], 33), ([3, 1, 4], 12)):
        got = seqs.call(which, q_len, split_keys)
        want = seqs.reference(which, q_len)
        for row, i in enumerate(which):
            size = seqs.sizes[i]
            assert torch.equal(got[row, :, :size], alone[i][:, :size]), f"sequence {i} in batch {which} at Q {q_len}"
            torch.testing.assert_close(got[row, :, :size].float(), want[row, :, :size], atol=tol, rtol=tol)


def test_the_invariant_tiles_do_not_follow_the_call():
    """The default split rule follows the call's programs (so its batch); the invariant one a
    fixed number of keys."""
    assert tk.paged_split_keys(4096, 8, 32) != tk.paged_split_keys(4096, 64, 32)
    assert tk.INVARIANT_SPLIT_KEYS % 32 == 0


def test_the_gpu_check_of_deterministic_mode_runs_and_passes_here():
    """`deterministic_check` (what `make gpu-check` runs compiled at Qwen3-8B's shapes) at tiny
    shapes under the interpreter: every kernel's rows bitwise alone, values within rounding."""
    got = bi.deterministic_check(device=DEVICE, dtype=torch.float16, hidden=72, intermediate=130, head_dim=64,
                                 heads=4, kv_heads=1, row_counts=(1, 2, 7), contexts=(40, 7, 0))
    assert got["ok"], got
    assert got["linear"]["max_abs_err"] < 1e-2 and got["rms_norm"]["max_abs_err"] < 1e-2
    assert got["attention"]["max_abs_err"] < 2e-2


def test_deterministic_on_cuda_selects_the_triton_kernels_and_refuses_what_they_cannot_run():
    """`deterministic: true` with `device: cuda` (checked here without a GPU: the choice reads
    the config and Triton's presence only) names the batch-invariant Triton kernels, bitwise;
    off by default; refused at tp 2 (the shards do not take them) and for float64."""
    from ddtree.config import ModelPairConfig
    from ddtree.engine import KernelsUnavailable, check_kernels

    backends = check_kernels(ModelPairConfig(deterministic=True, device="cuda", dtype="bfloat16"))
    assert backends.as_dict() == {"linear": "invariant_mm", "attention": "paged_invariant", "bitwise": True,
                                  "reason": None}
    assert backends.triton_invariant
    default = check_kernels(ModelPairConfig(device="cuda", dtype="bfloat16"))
    assert not default.bitwise and not default.triton_invariant
    with pytest.raises(KernelsUnavailable, match="tp: 1"):
        check_kernels(ModelPairConfig(deterministic=True, device="cuda", tp=2))
    with pytest.raises(KernelsUnavailable, match="float64"):
        check_kernels(ModelPairConfig(deterministic=True, device="cuda", dtype="float64"))


# --- a tiny model's forward on the route CUDA takes --------------------------------------------


def triton_route_on_cpu(monkeypatch) -> None:
    """CPU tensors take the Triton route CUDA tensors take (`use_triton` where the model and the
    tree ops dispatch): the kernels then run under the interpreter."""
    from ddtree.workers import model as model_module

    monkeypatch.setattr(model_module, "use_triton", lambda t: True)
    monkeypatch.setattr(batched, "use_triton", lambda t: True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_tiny_models_rows_are_bitwise_their_lone_runs(tmp_path, monkeypatch, dtype):
    """A tiny qwen3 target with its batch-invariant kernels on (linears, norms and the paged
    attention on the Triton route, as `deterministic: true` runs on CUDA): a prefill of two
    70-token prompts (a block longer than ATTENTION_MAX_ROWS, which takes the kernel too) and
    verify blocks of trees of 17, 1 and 5 nodes padded to one Q give each row's logits bitwise
    as the same sequence run alone, at its own Q; and within rounding the model's default route
    (the same weights and cache through torch)."""
    if DEVICE != "cpu":
        pytest.skip("routes CPU tensors to the kernels; on CUDA the model takes the route itself")
    from ddtree.workers.kv_pool import KVStorage, PageAllocator, PagedView
    from ddtree.workers.loading import load_target_weights
    from ddtree.workers.model import TreeBits

    from .helpers import make_hf_model

    make_hf_model("qwen3", 97, layers=2, hidden_size=72, intermediate_size=136, head_dim=16).save_pretrained(tmp_path)
    target = load_target_weights(tmp_path, dtype)
    target.use_batch_invariant_kernels()
    triton_route_on_cpu(monkeypatch)
    g = torch.Generator().manual_seed(0)
    pages = PageAllocator(tokens=512, page=8)
    pages._free.reverse()  # high page ids first: the tables are not contiguous
    storage = KVStorage(target.config, pages.num_pages, 8, dtype)
    tables = [[], [], []]
    for table in tables:
        pages.grow(table, 70 + 33)  # the longest context and the widest block

    # prefill: sequences 0 and 1 together, then each alone (writing the same keys and values)
    prompts = torch.randint(0, 97, (2, 70), generator=g)
    positions = torch.arange(70)[None].expand(2, -1)
    assert PagedView(storage.batch(tables[:2], [0, 0]), target.prefill_mask(70), 70, batch_invariant=True).kernel
    both = target(prompts, positions, target.prefill_mask(70), storage.batch(tables[:2], [0, 0])).logits
    for i in range(2):
        lone = target(prompts[i : i + 1], positions[:1], target.prefill_mask(70), storage.batch([tables[i]], [0]))
        assert torch.equal(both[i], lone.logits[0]), f"prefill of sequence {i}"
    target(torch.randint(0, 97, (1, 9), generator=g), torch.arange(9)[None], target.prefill_mask(9),
           storage.batch([tables[2]], [0]))

    # verify: trees of 17, 1 and 5 nodes over contexts of 70, 70 and 9
    lengths = [70, 70, 9]
    trees = [random_tree(17, 1), Tree.root_only(5), random_tree(5, 2)]

    def forward(which: list[int], q_len: int):
        batch = TreeBatch.of([trees[i] for i in which], q_len)
        meta = batched.tree_metadata_ref(batch, torch.tensor([lengths[i] for i in which]))
        return target(batch.tokens, meta.positions, TreeBits(meta.bits, batch.sizes),
                      storage.batch([tables[i] for i in which], [lengths[i] for i in which])).logits

    alone = [forward([i], trees[i].size)[0] for i in range(3)]
    for which, q_len in (([0, 1, 2], 17), ([2, 1], 5), ([1, 0], 33)):
        got = forward(which, q_len)
        for row, i in enumerate(which):
            size = trees[i].size
            assert torch.equal(got[row, :size], alone[i][:size]), f"sequence {i} in {which} at Q {q_len}"

    # the kernels compute the model: the default route over the same cache within rounding
    target.use_batch_invariant_kernels(False)
    monkeypatch.undo()
    default = forward([0, 1, 2], 17)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for row in range(3):
        size = trees[row].size
        torch.testing.assert_close(alone[row][:size].float(), default[row, :size].float(), atol=tol, rtol=tol)
