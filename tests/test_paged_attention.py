"""Tree attention over a paged KV pool, in place: the Triton kernel
(kernels.triton_kernels.paged_tree_attention_triton) against its torch reference
(kernels.batched.paged_tree_attention_ref), and the reference against the dense tree attention
the model runs over a KV cache (kernels.batched.tree_attention_ref), so the reference is itself
anchored.

Shapes are chosen to break the kernel's tiling: context lengths at page boundaries (page - 1,
page, page + 1), empty and one-page contexts, trees of 1 ... Q nodes padded to Q in {1, 2, 17,
65}, head widths 64 and 128, grouped-query ratios 1, 4 and 8, pages handed out shuffled, and
contexts split over several programs (flash-decoding). Here the kernel runs on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py); with DDTREE_KERNEL_DEVICE=cuda
the same tests run it compiled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="Triton is a Linux dependency of ddtree")

from ddtree.kernels import batched  # noqa: E402
from ddtree.kernels import triton_kernels as tk  # noqa: E402
from ddtree.kernels.tree import Tree, build_tree  # noqa: E402
from ddtree.kernels.tree_batch import TreeBatch  # noqa: E402

DEVICE = os.environ.get("DDTREE_KERNEL_DEVICE", "cpu")


@dataclass
class Case:
    """One call's shapes: sequence b has lengths[b] committed positions and a tree of sizes[b]
    nodes padded to q_len rows."""

    q_len: int
    head_dim: int
    heads: int
    kv_heads: int
    page: int
    lengths: list[int]
    sizes: list[int]
    split_keys: int | None = None  # None: the wrapper's own choice


CASES = {
    # GQA 4; contexts empty, page - 1, page, page + 1, two pages, under one page
    "q17-d64-gqa4": Case(17, 64, 4, 1, 8, [0, 7, 8, 9, 16, 3], [17, 1, 5, 17, 9, 2]),
    # GQA 1, the largest block; a padded tree of one node
    "q65-d128-gqa1": Case(65, 128, 2, 2, 16, [15, 16, 17, 0], [65, 30, 1, 12]),
    # decode rows (Q = 1), GQA 8
    "q1-d64-gqa8": Case(1, 64, 8, 1, 4, [0, 3, 4, 5, 8, 30], [1] * 6),
    "q2-d128-gqa4": Case(2, 128, 8, 2, 4, [1, 4, 0], [2, 1, 2]),
    # the context split over programs of 32 keys, then combined; lengths 100 and 63 cross splits
    "split-q17-d64-gqa8": Case(17, 64, 8, 1, 8, [100, 7, 63, 64], [17, 4, 1, 9], split_keys=32),
}


def random_tree(size: int, seed: int) -> Tree:
    g = torch.Generator().manual_seed(seed)
    if size == 1:
        return Tree.root_only(3)
    logprobs = torch.log_softmax(torch.randn(6, 40, generator=g, dtype=torch.float64) * 3, -1)
    tree = build_tree(3, logprobs, size - 1)
    assert tree.size == size
    return tree


@dataclass
class PagedInputs:
    q: torch.Tensor  # [B, Hq, Q, D]
    k_pool: torch.Tensor  # [T, Hkv, D]
    v_pool: torch.Tensor  # [T, Hkv, D]
    table: torch.Tensor  # [B, P] int64 page ids, shuffled
    lengths: torch.Tensor  # [B] int64
    bits: torch.Tensor  # [B, Q, W] int32, the trees' ancestor bits
    rows: torch.Tensor  # [B] int64, the trees' sizes
    dense_k: torch.Tensor  # [B, Hkv, S, D]: each sequence's positions laid out as a dense cache row
    dense_v: torch.Tensor


def paged_inputs(case: Case, seed: int = 0) -> PagedInputs:
    """Random keys in a pool whose pages go to the sequences in a random order (a sequence's
    pages are neither contiguous nor ascending), with spare pages no sequence owns."""
    g = torch.Generator().manual_seed(seed)
    b, q_len, page = len(case.lengths), case.q_len, case.page
    need = [-(-(n + q_len) // page) for n in case.lengths]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.zeros(b, max(need), dtype=torch.int64)
    taken = 0
    for seq, n in enumerate(need):
        table[seq, :n] = torch.tensor(order[taken : taken + n])
        taken += n
    k_pool = torch.randn(num_pages * page, case.kv_heads, case.head_dim, generator=g)
    v_pool = torch.randn(num_pages * page, case.kv_heads, case.head_dim, generator=g)
    span = max(case.lengths) + q_len
    dense_k = torch.zeros(b, case.kv_heads, span, case.head_dim)
    dense_v = torch.zeros_like(dense_k)
    for seq, n in enumerate(case.lengths):
        positions = torch.arange(n + q_len)
        slots = table[seq, positions // page] * page + positions % page
        dense_k[seq, :, : n + q_len] = k_pool[slots].transpose(0, 1)
        dense_v[seq, :, : n + q_len] = v_pool[slots].transpose(0, 1)
    lengths = torch.tensor(case.lengths)
    trees = TreeBatch.of([random_tree(n, seed + i) for i, n in enumerate(case.sizes)], q_len)
    bits = batched.tree_metadata_ref(trees, lengths).bits
    q = torch.randn(b, case.heads, q_len, case.head_dim, generator=g)
    return PagedInputs(q, k_pool, v_pool, table, lengths, bits, trees.sizes, dense_k, dense_v)


@pytest.mark.parametrize("name", list(CASES))
def test_paged_reference_is_the_dense_tree_attention(name):
    """With every row real the reference equals the model's dense tree attention over the same
    keys laid out as a dense cache; with the trees' sizes as rows the real rows still do, and a
    padding row is exactly its own value row (it sees only itself)."""
    case = CASES[name]
    x = paged_inputs(case)
    dense = batched.tree_attention_ref(x.q, x.dense_k, x.dense_v, x.lengths, x.bits)
    every_row = batched.paged_tree_attention_ref(x.q, x.k_pool, x.v_pool, x.table, x.lengths, x.bits, case.page)
    torch.testing.assert_close(every_row, dense, atol=1e-6, rtol=1e-6)
    padded = batched.paged_tree_attention_ref(x.q, x.k_pool, x.v_pool, x.table, x.lengths, x.bits, case.page, x.rows)
    group = case.heads // case.kv_heads
    for seq, (n, real) in enumerate(zip(case.lengths, case.sizes)):
        torch.testing.assert_close(padded[seq, :, :real], dense[seq, :, :real], atol=1e-6, rtol=1e-6)
        own = x.dense_v[seq, :, n + real : n + case.q_len].repeat_interleave(group, 0)
        assert torch.equal(padded[seq, :, real:], own)


@pytest.mark.parametrize("with_rows", [True, False], ids=["padded-rows", "all-rows"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_kernel_equals_reference(name, with_rows):
    case = CASES[name]
    x = paged_inputs(case, seed=1)
    rows = x.rows if with_rows else None
    got = tk.paged_tree_attention_triton(
        x.q.to(DEVICE), x.k_pool.to(DEVICE), x.v_pool.to(DEVICE), x.table.to(DEVICE), x.lengths.to(DEVICE),
        x.bits.to(DEVICE), case.page, None if rows is None else rows.to(DEVICE), split_keys=case.split_keys)
    want = batched.paged_tree_attention_ref(x.q, x.k_pool, x.v_pool, x.table, x.lengths, x.bits, case.page, rows)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_split_keys_follow_the_shapes_not_the_lengths():
    """The split plan comes from host shapes alone (no read of the lengths): one split while
    the call has programs enough or the keys are few, else splits of >= 256 keys, block-aligned."""
    assert tk.paged_split_keys(4096, 8, 32) == 256
    assert tk.paged_split_keys(4096, 264, 32) == 4096  # the call fills the GPU already
    assert tk.paged_split_keys(200, 1, 32) == 224  # too few keys to split
    assert tk.paged_split_keys(1000, 100, 64) == 512


def test_paged_view_on_the_kernel_route_gives_the_dense_cache_logits(tmp_path, monkeypatch):
    """The target's forward over a paged pool, attention routed to the paged kernel (as on
    CUDA: here CPU tensors under the interpreter), gives the dense cache's logits: a causal
    prefill block (a bool mask, packed to bits on the device) and then a tree block as TreeBits,
    over rows of different lengths whose pages were handed out high ids first. Given the tree
    sizes (TreeBits.rows), the real rows keep their logits and the padding rows change (they no
    longer read the context)."""
    if DEVICE != "cpu":
        pytest.skip("routes CPU tensors to the kernel; on CUDA the engine takes the route itself")
    from ddtree.workers import model as model_module
    from ddtree.workers.kv_pool import KVStorage, PageAllocator, PagedView
    from ddtree.workers.loading import load_target_weights
    from ddtree.workers.model import KVCache, TreeBits

    from .helpers import make_hf_model

    make_hf_model("qwen3", 97, head_dim=16).save_pretrained(tmp_path)  # a kernel tile is >= 16 wide
    target = load_target_weights(tmp_path, torch.float32)
    monkeypatch.setattr(model_module, "use_triton", lambda t: True)
    monkeypatch.setattr(batched, "use_triton", lambda t: True)
    g = torch.Generator().manual_seed(0)
    pages = PageAllocator(tokens=96, page=4)
    pages._free.reverse()  # high page ids first: the tables are not contiguous
    storage = KVStorage(target.config, pages.num_pages, 4, torch.float32)
    dense = KVCache.allocate(target.config, 2, 40, torch.float32)
    tables, lengths = [[], []], [7, 4]
    for table in tables:
        pages.grow(table, 8 + 5)
    prompts = torch.randint(0, 97, (2, 8), generator=g)
    positions = torch.arange(8)[None].expand(2, -1)
    paged = target(prompts, positions, target.prefill_mask(8), storage.batch(tables, [0, 0]))
    ref = target(prompts, positions, target.prefill_mask(8), dense)
    torch.testing.assert_close(paged.logits, ref.logits, atol=1e-5, rtol=1e-5)
    dense.lengths[:] = torch.tensor(lengths)
    trees = TreeBatch.of([random_tree(5, 1), random_tree(3, 2)], 5)
    meta = batched.tree_metadata_ref(trees, torch.tensor(lengths))
    batch = storage.batch(tables, lengths)
    assert PagedView(batch, TreeBits(meta.bits), 5).kernel
    paged = target(trees.tokens, meta.positions, TreeBits(meta.bits), batch)
    ref = target(trees.tokens, meta.positions, TreeBits(meta.bits), dense)
    torch.testing.assert_close(paged.logits, ref.logits, atol=1e-5, rtol=1e-5)
    # with the tree sizes in the mask, the padding rows (row 1's last two) see only themselves
    sized = target(trees.tokens, meta.positions, TreeBits(meta.bits, trees.sizes), batch)
    torch.testing.assert_close(sized.logits[0], ref.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sized.logits[1, :3], ref.logits[1, :3], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(sized.logits[1, 3:], ref.logits[1, 3:], atol=1e-3)


def test_batched_engine_on_the_paged_kernel_route_gives_the_reference_tokens(tmp_path, monkeypatch):
    """The scheduler's batched steps over the paged pool with attention on the paged kernel
    (CPU tensors routed to it under the interpreter; the CPU packs its forwards, so the kernel
    gets each tree's real rows and its padding rows see only themselves) give the tokens of the
    CPU route: greedy and seeded, budgets 0, 8 and 16 in one batch, pages of 4 tokens."""
    if DEVICE != "cpu":
        pytest.skip("routes CPU tensors to the kernel; on CUDA the engine takes the route itself")
    from ddtree.config import SamplingParams
    from ddtree.workers import model as model_module
    from ddtree.workers.drafter import DFlashDrafter
    from ddtree.workers.loading import load_target_weights
    from ddtree.workers.requests import Request
    from ddtree.workers.scheduler import BatchLimits, Scheduler

    from .helpers import make_hf_model

    make_hf_model("qwen3", 97, head_dim=16).save_pretrained(tmp_path)
    target = load_target_weights(tmp_path, torch.float32)
    drafter = DFlashDrafter.untrained(target, block_size=4)
    limits = BatchLimits(max_num_seqs=3, kv_cache_tokens=256, kv_page_tokens=4)
    requests = [Request([5, 6, 7, 8, 9], 8, budget=16), Request([9, 3], 8, budget=0),
                Request([1, 2, 3], 8, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=4), budget=8)]
    reference = Scheduler.local(target, drafter, 0, limits).generate(requests)
    monkeypatch.setattr(model_module, "use_triton", lambda t: True)
    monkeypatch.setattr(batched, "use_triton", lambda t: True)
    kernel = Scheduler.local(target, drafter, 0, limits).generate(requests)
    assert [r.tokens for r in kernel] == [r.tokens for r in reference]


def test_paged_kernel_in_half_precision_is_the_reference_within_rounding():
    """A serving dtype: half-precision queries and pool, fp32 softmax and accumulation in the
    kernel, against the reference in fp32 over the same rounded values; split and unsplit.
    fp16 under the interpreter (its numpy has no bfloat16: a bf16 tl.dot there gives garbage,
    for the dense kernel too); bf16 where the kernel runs compiled."""
    case = CASES["split-q17-d64-gqa8"]
    x = paged_inputs(case, seed=2)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    q, k_pool, v_pool = (t.to(dtype) for t in (x.q, x.k_pool, x.v_pool))
    want = batched.paged_tree_attention_ref(q.float(), k_pool.float(), v_pool.float(), x.table, x.lengths, x.bits,
                                            case.page, x.rows)
    for split_keys in (32, None):
        got = tk.paged_tree_attention_triton(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE), x.table.to(DEVICE),
                                             x.lengths.to(DEVICE), x.bits.to(DEVICE), case.page, x.rows.to(DEVICE),
                                             split_keys=split_keys)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
