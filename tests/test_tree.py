"""Tree ops against brute force and against the model's own plain decoding."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ddtree.kernels.tree import (
    Candidates,
    Tree,
    ancestor_mask,
    build_tree,
    chain_tree,
    compact_kv,
    walk_tree,
    verify_block,
)


def brute_force_prefixes(logprobs: torch.Tensor, budget: int):
    """Every token prefix of depth 1..D with its summed log-prob, best `budget` first."""
    depths, vocab = logprobs.shape
    scored = []
    for d in range(1, depths + 1):
        for seq in itertools.product(range(vocab), repeat=d):
            scored.append((sum(float(logprobs[i, t]) for i, t in enumerate(seq)), seq))
    scored.sort(key=lambda p: -p[0])
    return scored[:budget]


def tree_prefixes(tree: Tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for node in range(1, tree.size):
        seq, n = [], node
        while n > 0:
            seq.append(tokens[n])
            n = parents[n]
        out.append(tuple(reversed(seq)))
    return out


@pytest.mark.parametrize("depths,vocab,budget", [(1, 5, 3), (3, 3, 7), (3, 4, 16), (4, 3, 33), (2, 2, 50), (3, 5, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_build_tree_matches_brute_force(depths, vocab, budget, seed):
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(depths, vocab, generator=g, dtype=torch.float64) * 2, -1)
    tree = build_tree(42, logprobs, budget)
    expected = brute_force_prefixes(logprobs, budget)
    got = tree_prefixes(tree)
    # continuous random scores: no ties, so the set is unique
    assert set(got) == {seq for _, seq in expected}
    assert tree.size - 1 == min(budget, sum(vocab**d for d in range(1, depths + 1)))
    assert tree.tokens[0] == 42 and tree.parents[0] == -1 and tree.depths[0] == 0
    parents = tree.parents.tolist()
    assert all(parents[i] < i for i in range(1, tree.size)), "parents precede children"
    assert all(tree.depths[i] == tree.depths[parents[i]] + 1 for i in range(1, tree.size))
    # scores come out best-first
    scores = [sum(float(logprobs[i, t]) for i, t in enumerate(seq)) for seq in got]
    assert all(a >= b - 1e-12 for a, b in zip(scores, scores[1:]))


def test_build_tree_worked_example():
    """The example in build_tree's docstring."""
    logprobs = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.8, 0.1]]).log()
    tree = build_tree(7, logprobs, budget=3)
    assert tree.tokens.tolist() == [7, 0, 1, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert tree.depths.tolist() == [0, 1, 2, 1]


def test_chain_is_top1_per_depth():
    logprobs = torch.log_softmax(torch.randn(5, 11, dtype=torch.float64), -1)
    tree = chain_tree(3, logprobs)
    assert tree.tokens.tolist() == [3] + logprobs.argmax(-1).tolist()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


def test_build_tree_is_deterministic_under_equal_logprobs():
    """Equal log-probs rank by token id; the same input builds the same tree every time."""
    logprobs = torch.full((3, 6), -math.log(6), dtype=torch.float64)
    trees = [build_tree(0, logprobs, 9) for _ in range(3)]
    for t in trees[1:]:
        assert torch.equal(t.tokens, trees[0].tokens) and torch.equal(t.parents, trees[0].parents)
    assert trees[0].tokens[1:7].tolist() == [0, 1, 2, 3, 4, 5]


def test_ancestor_mask_equals_ancestor_relation():
    g = torch.Generator().manual_seed(1)
    logprobs = torch.log_softmax(torch.randn(4, 4, generator=g, dtype=torch.float64), -1)
    tree = build_tree(0, logprobs, 20)
    mask = ancestor_mask(tree.parents)
    parents = tree.parents.tolist()
    for i in range(tree.size):
        ancestors, n = {i}, i
        while parents[n] >= 0:
            n = parents[n]
            ancestors.add(n)
        assert {j for j in range(tree.size) if mask[i, j]} == ancestors


def test_padded_verify_block_rows():
    tree = build_tree(5, torch.log_softmax(torch.randn(3, 4, dtype=torch.float64), -1), 6)
    block = verify_block(tree, start=10, pad_to=12)
    n = tree.size
    assert block.num_nodes == n
    assert block.positions[:n].tolist() == (10 + tree.depths).tolist()
    assert block.positions[n:].tolist() == [10] * (12 - n), "padding rows get a valid position"
    assert torch.equal(block.mask[n:], torch.eye(12, dtype=torch.bool)[n:]), "padding sees itself only"
    assert not block.mask[:n, n:].any(), "no tree row sees padding"


def test_reused_block_forgets_the_previous_round():
    """Regression: a static buffer refilled with a smaller tree must not keep rows of the
    bigger tree of the round before (the "garbled output once the tree shrinks" bug of other
    ports). A refilled block equals a freshly built one."""
    g = torch.Generator().manual_seed(3)
    big = build_tree(1, torch.log_softmax(torch.randn(4, 6, generator=g, dtype=torch.float64), -1), 16)
    small = build_tree(2, torch.log_softmax(torch.randn(4, 6, generator=g, dtype=torch.float64), -1), 3)
    reused = verify_block(big, 7, pad_to=17).fill(small, 9)
    fresh = verify_block(small, 9, pad_to=17)
    assert reused.num_nodes == fresh.num_nodes == small.size
    for name in ("tokens", "positions", "mask"):
        assert torch.equal(getattr(reused, name), getattr(fresh, name)), name


def test_greedy_walk_worked_example():
    tree = Tree(torch.tensor([7, 0, 1, 1]), torch.tensor([-1, 0, 1, 0]), torch.tensor([0, 1, 2, 1]))
    walk = walk_tree(tree, torch.tensor([0, 5, 9, 9]))
    assert walk.path == [0, 1] and walk.bonus == 5
    walk = walk_tree(tree, torch.tensor([1, 5, 9, 4]))
    assert walk.path == [0, 3] and walk.bonus == 4
    walk = walk_tree(tree, torch.tensor([0, 1, 8, 9]))
    assert walk.path == [0, 1, 2] and walk.bonus == 8


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", range(3))
def test_compact_kv_equals_plain_decoding_cache(tiny_checkpoint, family, seed):
    """Verify a random tree, keep a random root-to-node path, compact: the cache must equal the
    cache that plain decoding of prompt + path tokens builds."""
    _, model, _ = tiny_checkpoint(family)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 97, (1, 9), generator=g)
    logprobs = torch.log_softmax(torch.randn(5, 97, generator=g, dtype=torch.float64), -1)
    tree = build_tree(int(torch.randint(0, 97, (), generator=g)), logprobs, 20)
    start = prompt.shape[1]

    cache = model.new_cache(1, 64)
    model(prompt, torch.arange(start)[None], model.prefill_mask(start), cache)
    cache.lengths += start
    block = verify_block(tree, start, pad_to=24)
    model(block.tokens[None], block.positions[None], block.mask[None], cache)
    leaf = int(torch.randint(1, tree.size, (), generator=g))
    path, n = [], leaf
    while n >= 0:
        path.append(n)
        n = int(tree.parents[n])
    path.reverse()
    compact_kv(cache.k, cache.v, 0, start, path)
    kept = start + len(path)

    plain = model.new_cache(1, 64)
    seq = torch.cat([prompt, tree.tokens[path][None]], dim=1)
    model(seq, torch.arange(kept)[None], model.prefill_mask(kept), plain)
    torch.testing.assert_close(cache.k[:, :, :, :kept], plain.k[:, :, :, :kept], rtol=0, atol=1e-12)
    torch.testing.assert_close(cache.v[:, :, :, :kept], plain.v[:, :, :, :kept], rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_candidates_equal_the_first_k_of_a_stable_descending_sort(seed):
    """Candidates.top_k takes torch.topk's pick and orders it by (value, id); rows with a tie
    at the k-th value take the exact route. Both must equal the full stable sort, ties inside
    the top-k and across its boundary included."""
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(5, 300, generator=g, dtype=torch.float64), -1)
    best = logprobs.max(-1, keepdim=True).values
    logprobs[1, [3, 17, 250]] = best[1] + 0.5  # a three-way tie at the top
    order = logprobs[2].argsort(descending=True)
    logprobs[2, order[6:12]] = logprobs[2, order[7]].item()  # a tie that straddles k = 8
    logprobs[3] = -5.0  # everything tied
    for k in (1, 8, 16, 300):
        got = Candidates.top_k(logprobs, k)
        top, ids = logprobs.sort(dim=-1, descending=True, stable=True)
        assert got.tokens == ids[:, :k].tolist()
        assert got.logprobs == top[:, :k].tolist()
