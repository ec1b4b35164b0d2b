"""Every Triton kernel against its torch reference (tree_ops/batched.py), on shapes chosen to
break tiling: tree sizes 1, 2, 17, 33 and 65 in one batch, vocabularies 49152 and 151936,
context lengths that are not a multiple of the key block, padded trees. Exact for integer
outputs, allclose for attention and log-probs.

Here the kernels run on CPU through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py); `make gpu-check` runs this file compiled on CUDA (DDTREE_KERNEL_DEVICE=cuda).
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is a Linux dependency of ddtree")

from ddtree.kernels import batched  # noqa: E402
from ddtree.kernels.tree_batch import TreeBatch, WalkBatch, pack_bits, unpack_bits  # noqa: E402
from ddtree.kernels.sampling import processed_probs  # noqa: E402
from ddtree.kernels.tree import Tree, build_tree  # noqa: E402
from ddtree.kernels import triton_kernels as tk  # noqa: E402

DEVICE = os.environ.get("DDTREE_KERNEL_DEVICE", "cpu")
SIZES = [1, 2, 17, 33, 65]
Q_LEN = 65


def random_tree(size: int, vocab: int, seed: int) -> Tree:
    """A DDTree of exactly `size` nodes from random drafter distributions."""
    g = torch.Generator().manual_seed(seed)
    if size == 1:
        return Tree.root_only(int(torch.randint(vocab, (), generator=g)))
    logprobs = torch.log_softmax(torch.randn(7, vocab, generator=g, dtype=torch.float64) * 3, -1)
    tree = build_tree(int(torch.randint(vocab, (), generator=g)), logprobs, size - 1)
    assert tree.size == size
    return tree


@pytest.fixture(scope="module")
def mixed_batch():
    """One batch mixing every tree size, padded to 65 rows (so the smaller trees are padded)."""
    trees = [random_tree(n, 50, seed=n) for n in SIZES]
    return trees, TreeBatch.of(trees, Q_LEN, DEVICE)


def test_pack_bits_round_trips():
    dense = torch.rand(3, 65, 65) < 0.5
    assert torch.equal(unpack_bits(pack_bits(dense), 65), dense)


def test_tree_metadata_kernel_equals_reference(mixed_batch):
    _, batch = mixed_batch
    start = torch.tensor([0, 5, 31, 100, 7], device=DEVICE)
    got, want = tk.tree_metadata_triton(batch, start), batch_ref(batched.tree_metadata_ref, batch, start)
    assert torch.equal(got.depths.cpu(), want.depths.cpu())
    assert torch.equal(got.positions.cpu(), want.positions.cpu())
    assert torch.equal(got.bits.cpu(), want.bits.cpu())


def batch_ref(fn, batch, *args):
    cpu = TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu())
    return fn(cpu, *[a.cpu() for a in args])


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 2), (128, 2, 1)])
def test_tree_attention_kernel_equals_reference(mixed_batch, head_dim, heads, kv_heads):
    """Grouped-query attention of each tree's rows over its own committed prefix (lengths 0, 37,
    5, 70 and 1: not multiples of the 32-key block) plus the tree block, under the ancestor bits."""
    _, batch = mixed_batch
    prefix = torch.tensor([0, 37, 5, 70, 1], device=DEVICE)
    meta = batched.tree_metadata_ref(TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu()), prefix.cpu())
    bits = meta.bits.to(DEVICE)
    g = torch.Generator().manual_seed(head_dim)
    slots = int(prefix.max()) + Q_LEN + 3
    q = torch.randn(5, heads, Q_LEN, head_dim, generator=g).to(DEVICE)
    k = torch.randn(5, kv_heads, slots, head_dim, generator=g).to(DEVICE)
    v = torch.randn(5, kv_heads, slots, head_dim, generator=g).to(DEVICE)
    got = tk.tree_attention_triton(q, k, v, prefix, bits)
    want = batched.tree_attention_ref(q.cpu(), k.cpu(), v.cpu(), prefix.cpu(), bits.cpu())
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [8, 80])
def test_head_widths_the_kernel_has_no_tile_for_attend_through_the_reference(mixed_batch, monkeypatch, head_dim):
    """Regression, from the first `make gpu-check` on an H200: the engine on CUDA sent every tree
    attention to the Triton kernel, which tiles head widths 16, 32, ..., 256 only, so a model
    of another width (the published-checkpoint fixture's 8; Phi's 80) crashed at the kernel's
    assert on its first tree. The dispatch now runs the torch reference for such a width. On
    CPU the CUDA branch is taken by routing CPU tensors to the kernels (as the engine test
    below does); under the interpreter a kernel call for these widths would raise."""
    if DEVICE == "cpu":
        monkeypatch.setattr(batched, "use_triton", lambda t: True)
    _, batch = mixed_batch
    prefix = torch.tensor([0, 37, 5, 70, 1], device=DEVICE)
    bits = batched.tree_metadata_ref(TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu()), prefix.cpu()).bits
    g = torch.Generator().manual_seed(head_dim)
    slots = int(prefix.max()) + Q_LEN + 3
    q = torch.randn(5, 4, Q_LEN, head_dim, generator=g)
    k = torch.randn(5, 2, slots, head_dim, generator=g)
    v = torch.randn(5, 2, slots, head_dim, generator=g)
    got = batched.tree_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), prefix, bits.to(DEVICE))
    want = batched.tree_attention_ref(q, k, v, prefix.cpu(), bits)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_tree_attention_on_a_cache_layer_view():
    """The engine passes cache.k[layer]: a strided view of [L, B, Hkv, S, D]."""
    tree = random_tree(17, 50, seed=3)
    batch = TreeBatch.of([tree], 17, DEVICE)
    prefix = torch.tensor([40], device=DEVICE)
    bits = batched.tree_metadata_ref(TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu()), prefix.cpu()).bits.to(DEVICE)
    cache = torch.randn(3, 1, 2, 64, 64).to(DEVICE)
    q = torch.randn(1, 4, 17, 64).to(DEVICE)
    got = tk.tree_attention_triton(q, cache[1, :, :, :57], cache[2, :, :, :57], prefix, bits)
    want = batched.tree_attention_ref(q.cpu(), cache[1, :, :, :57].cpu(), cache[2, :, :, :57].cpu(), prefix.cpu(), bits.cpu())
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_the_references_give_a_batch_of_mostly_plain_rows_each_trees_own_metadata_and_walk():
    """The CPU references set every row up as a root alone and build only the trees with nodes
    (a busy batch is mostly plain rows: the loop over all of them cost ~5 ms a 64-stream step).
    Each row is what its tree alone gives: depths and positions, the mask from its ancestors
    (padding rows seeing themselves), the walk along the target's choices."""
    from ddtree.kernels.tree import ancestor_mask, walk_tree

    trees = [random_tree(n, 50, seed=40 + i) for i, n in enumerate([1, 1, 9, 1, 1, 1, 5, 1, 17, 1])]
    q_len = 17
    batch = TreeBatch.of(trees, q_len)
    start = torch.arange(len(trees)) * 7 + 3
    meta = batched.tree_metadata_ref(batch, start)
    g = torch.Generator().manual_seed(1)
    choices = torch.randint(50, (len(trees), q_len), generator=g)
    for row, tree in enumerate(trees):  # follow each tree one level deeper for every other row
        kids = (tree.parents == 0).nonzero().flatten()
        if len(kids) and row % 2 == 0:
            choices[row, 0] = tree.tokens[kids[0]]
    walk = batched.walk_batch_ref(batch, choices)
    for row, tree in enumerate(trees):
        n = tree.size
        dense = torch.eye(q_len, dtype=torch.bool)
        dense[:n, :n] = ancestor_mask(tree.parents)
        assert torch.equal(meta.depths[row, :n], tree.depths) and not meta.depths[row, n:].any()
        assert torch.equal(meta.positions[row], start[row] + meta.depths[row])
        assert torch.equal(meta.bits[row], pack_bits(dense))
        alone = walk_tree(tree, choices[row, :n])
        assert walk.path[row, : len(alone.path)].tolist() == list(alone.path) and (walk.path[row, len(alone.path):] == -1).all()
        assert int(walk.length[row]) == len(alone.path) and int(walk.bonus[row]) == alone.bonus
    assert int(walk.length.max()) > 1


def test_greedy_walk_kernel_equals_reference(mixed_batch):
    """Choices that follow each tree for a few levels, then leave it: every walk length occurs."""
    trees, batch = mixed_batch
    g = torch.Generator().manual_seed(0)
    choices = torch.randint(50, (len(trees), Q_LEN), generator=g)
    for row, tree in enumerate(trees):  # make the target agree with the first child of each node
        for node in range(tree.size):
            kids = (tree.parents == node).nonzero().flatten()
            if len(kids) and (node + row) % 4:
                choices[row, node] = tree.tokens[kids[-1]]
    choices = choices.to(DEVICE)
    got, want = tk.walk_batch_triton(batch, choices), batch_ref(batched.walk_batch_ref, batch, choices)
    for field in ("path", "length", "bonus"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), field
    assert int(want.length.max()) > 2, "some walk should go deep"


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_sampled_draw_kernel_equals_reference(vocab):
    """The seeded inverse-CDF draw of every node of two trees (sizes 17 and 2, padded to 17),
    from nucleus-filtered probabilities, same SplitMix64 draws as kernels.sampling."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(2, 17, vocab, generator=g, dtype=torch.float64) * 4
    params = type("P", (), {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "min_p": 0.0})()
    probs = processed_probs(logits.view(-1, vocab), params).view(2, 17, vocab)
    seeds = torch.tensor([12345, 2**62 + 7])
    positions = torch.arange(34).view(2, 17) + 100
    got = tk.sampled_choices_triton(probs.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE))
    want = batched.sampled_choices_ref(probs, seeds, positions)
    assert torch.equal(got.cpu(), want)


def test_sampled_walk_is_the_walk_over_drawn_choices(mixed_batch):
    trees, batch = mixed_batch
    vocab = 50
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(len(trees), Q_LEN, vocab, generator=g, dtype=torch.float64), -1)
    seeds = torch.tensor([1, 2, 3, 4, 5])
    meta = batched.tree_metadata_ref(TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu()), torch.zeros(5, dtype=torch.int64))
    draws = tk.sampled_choices_triton(probs.to(DEVICE), seeds.to(DEVICE), (meta.positions + 1).to(DEVICE))
    got = tk.walk_batch_triton(batch, draws)
    want = batched.walk_batch_ref(TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu()),
                                  batched.sampled_choices_ref(probs, seeds, meta.positions + 1))
    assert torch.equal(got.path.cpu(), want.path) and torch.equal(got.bonus.cpu(), want.bonus)


def test_compact_kv_kernel_equals_reference(mixed_batch):
    """Paths whose source slots are other rows' destinations (path [0, 2, 5] moves 12 -> 11 while
    11 ... ) must read every source before writing."""
    trees, batch = mixed_batch
    g = torch.Generator().manual_seed(2)
    choices = torch.randint(50, (len(trees), Q_LEN), generator=g)
    for row, tree in enumerate(trees):
        for node in range(tree.size):
            kids = (tree.parents == node).nonzero().flatten()
            if len(kids):
                choices[row, node] = tree.tokens[kids[-1]]  # the last child: a path that skips slots
    walk = batched.walk_batch_ref(TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu()), choices)
    start = torch.tensor([0, 3, 10, 40, 1])
    k = torch.randn(2, 5, 3, 120, 64, generator=g)
    v = torch.randn(2, 5, 3, 120, 64, generator=g)
    k_want, v_want = k.clone(), v.clone()
    batched.compact_kv_batch_ref(k_want, v_want, start, walk)
    k_got, v_got = k.to(DEVICE), v.to(DEVICE)
    walk_dev = WalkBatch(walk.path.to(DEVICE), walk.length.to(DEVICE), walk.bonus.to(DEVICE))
    tk.compact_kv_batch_triton(k_got, v_got, start.to(DEVICE), walk_dev)
    assert torch.equal(k_got.cpu(), k_want) and torch.equal(v_got.cpu(), v_want)
    assert any(p != i for row in walk.path.tolist() for i, p in enumerate(row) if p >= 0), "no slot moved"


@pytest.mark.parametrize("vocab,k", [(49152, 16), (151936, 8), (151936, 1)])
def test_topk_logprobs_kernel_equals_reference(vocab, k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(7, vocab, generator=g) * 3
    logits[3, 1000:1010] = 50.0  # ten equal best logits: lower ids first
    got_v, got_i = tk.topk_logprobs_triton(logits.to(DEVICE), k)
    want_v, want_i = batched.topk_logprobs_ref(logits, k)
    assert torch.equal(got_i.cpu(), want_i)
    torch.testing.assert_close(got_v.cpu(), want_v, atol=1e-4, rtol=1e-5)
    assert got_i[3, : min(k, 10)].tolist() == list(range(1000, 1000 + min(k, 10)))


class LaunchRecorder:
    """A Triton kernel that runs as it is and records the compile-time arguments (the
    tl.constexpr keywords) of every launch."""

    def __init__(self, kernel):
        self.kernel, self.constexprs = kernel, set()

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **constexprs):
            self.constexprs.add(tuple(sorted(constexprs.items())))
            return launch(*args, **constexprs)

        return run


def test_topk_kernel_equals_reference_for_every_k_and_compiles_a_bounded_set(monkeypatch):
    """`budget: auto` asks the drafter's top-K for a different K nearly every step, and the
    kernel unrolled K as a compile-time constant: a JIT compile for each new K, stalling every
    stream. For every K in 1 ... 64 the kernels give the reference's ids and log-probs (ties:
    the lower id first, within a vocabulary block and across blocks), over a vocabulary of 300
    in blocks of 128 (the last one partial), while K is no compile-time argument: the launches'
    constexprs take at most one set per power-of-two bucket of K."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 300, generator=g) * 3
    logits[0, 120:140] = 40.0  # 20 equal best logits across the boundary of blocks 0 and 1
    logits[0, 290:300] = 40.0  # and 10 more in the partial last block
    logits[0, 60:100] = 30.0  # the next 40 equal, and 10 more of them in block 1
    logits[0, 200:210] = 30.0
    blocks = LaunchRecorder(tk._topk_blocks_kernel)
    merge = LaunchRecorder(tk._topk_merge_kernel)
    monkeypatch.setattr(tk, "_topk_blocks_kernel", blocks)
    monkeypatch.setattr(tk, "_topk_merge_kernel", merge)
    for k in range(1, 65):
        got_v, got_i = tk.topk_logprobs_triton(logits.to(DEVICE), k, block_v=128)
        want_v, want_i = batched.topk_logprobs_ref(logits, k)
        assert torch.equal(got_i.cpu(), want_i), k
        torch.testing.assert_close(got_v.cpu(), want_v, atol=1e-4, rtol=1e-5)
    assert len(blocks.constexprs) == 1 and len(merge.constexprs) <= 8, (blocks.constexprs, merge.constexprs)
    for kernel in (tk._topk_blocks_kernel.kernel, tk._topk_merge_kernel.kernel):
        assert "constexpr" not in str(inspect.signature(kernel.fn).parameters["K"].annotation)
    for vocab in (49152, 151936):  # the real vocabularies' tiles over K = 1 ... 64
        assert len({tk.topk_tiles(vocab, k) for k in range(1, 65)}) <= 8


def test_dispatch_uses_the_reference_for_cpu_tensors(mixed_batch, monkeypatch):
    """CPU behaviour is unchanged: with CPU tensors the dispatch never reaches a kernel."""
    if DEVICE != "cpu":
        pytest.skip("CPU dispatch only")
    _, batch = mixed_batch

    def boom(*a, **k):
        raise AssertionError("a Triton kernel ran for CPU tensors")

    monkeypatch.setattr(tk, "tree_metadata_triton", boom)
    meta = batched.tree_metadata(batch, torch.zeros(5, dtype=torch.int64))
    assert meta.bits.shape == (5, Q_LEN, 3)


@pytest.mark.parametrize("budget", [0, "chain", 16])
def test_engine_on_the_kernel_path_gives_the_reference_path_tokens(tmp_path, monkeypatch, budget):
    """The CUDA path of the engine (TreeBits into the model, tree attention, the walk, the seeded
    draws, KV compaction, the drafter's top-K -- all Triton) run here under the interpreter by
    routing CPU tensors to the kernels: greedy and seeded tokens equal the reference path's."""
    if DEVICE != "cpu":
        pytest.skip("the GPU check runs the engine on CUDA itself")
    from ddtree.config import SamplingParams
    from ddtree.workers import model as model_module
    from ddtree.workers import sessions
    from ddtree.workers.requests import Request
    from ddtree.workers.solo import SoloLoop
    from ddtree.workers.drafter import DFlashDrafter
    from ddtree.workers.loading import load_target_weights

    from .helpers import make_hf_model

    make_hf_model("qwen3", 97, head_dim=16).save_pretrained(tmp_path)  # a kernel tile is >= 16 wide
    target = load_target_weights(tmp_path, torch.float32)
    drafter = DFlashDrafter.untrained(target, block_size=4)
    requests = [Request([5, 6, 7, 8], 10, budget=budget),
                Request([9, 3], 10, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=4), budget=budget)]
    reference = SoloLoop.local(target, drafter).generate(requests)
    for module in (sessions, model_module, batched):
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    kernels = SoloLoop.local(target, drafter).generate(requests)
    assert [r.tokens for r in kernels] == [r.tokens for r in reference]
