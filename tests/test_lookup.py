"""Lookup branches (workers.lookup, kernels.tree.grow_tree with a Lookup): the n-gram index
against a brute-force search, the merged tree against a brute-force best-first selection over
both sources, the calibration's counting, and the tokens -- trees with lookup branches, greedy
and seeded, fixed budgets and budgets changing every round, equal plain decoding exactly on a
tiny float64 target."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.kernels.tree import DRAFTER, LOOKUP, Candidates, Lookup, grow_tree
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.lookup import LookupCalibration, NgramIndex, PRIOR, PRIOR_WEIGHT, SequenceLookup, chain_outcome
from ddtree.workers.policy import CostCurve
from ddtree.workers.requests import Request
from ddtree.workers.scheduler import BatchLimits, Scheduler
from ddtree.workers.solo import SoloLoop

from .drafters import OracleDrafter
from .helpers import hf_greedy
from .test_policy import FixedCosts, RandomQ


def naive_propose(stream: list[int], length: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """The longest suffix (n <= max_ngram) that occurred earlier; what followed its latest
    earlier occurrence, continuing into the proposal itself past the stream's end."""
    last = len(stream) - 1
    for n in range(min(max_ngram, last), 0, -1):
        suffix = stream[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if stream[end - n + 1 : end + 1] == suffix:
                extended = list(stream)
                for i in range(length):
                    extended.append(extended[end + 1 + i])
                return extended[last + 1 :], n
    return [], 0


def test_ngram_index_worked_examples():
    assert NgramIndex([5, 6, 7, 1, 5, 6]).propose(3) == ([7, 1, 5], 2)
    assert NgramIndex([4, 4, 4]).propose(4) == ([4, 4, 4, 4], 2)  # a repeat proposes itself
    assert NgramIndex([1, 2, 3]).propose(4) == ([], 0)
    assert NgramIndex([9]).propose(4) == ([], 0)


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_ngram_index_equals_a_brute_force_search_as_the_stream_grows(vocab):
    rng = random.Random(vocab)
    stream = [rng.randrange(vocab) for _ in range(3)]
    index = NgramIndex(stream)
    for _ in range(150):
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        stream += new
        index.extend(new)
        length = rng.randint(1, 10)
        assert index.propose(length) == naive_propose(stream, length), stream


def brute_force_tree(root: int, candidates: Candidates, lookup: Lookup, budget: int) -> dict[tuple, float]:
    """Every path of the union of both sources (the drafter's top-K at each depth under any
    node, the chain below the root) with its score -- the best over the ways it is proposed:
    parent's score + log-probability of its source -- then the `budget` best."""
    depth_count = len(candidates.tokens)
    scores: dict[tuple, float] = {(): 0.0}
    frontier = [()]
    while frontier:
        nxt = []
        for path in frontier:
            d = len(path)
            options = {}
            if d < depth_count:
                for lp, t in zip(candidates.logprobs[d], candidates.tokens[d]):
                    options[t] = max(options.get(t, -math.inf), scores[path] + lp)
            if d < len(lookup.tokens) and list(path) == lookup.tokens[:d]:
                t = lookup.tokens[d]
                options[t] = max(options.get(t, -math.inf), scores[path] + lookup.logprobs[d])
            for t, score in options.items():
                scores[path + (t,)] = score
                nxt.append(path + (t,))
        frontier = nxt
    best = sorted((p for p in scores if p), key=lambda p: -scores[p])[:budget]
    return {p: scores[p] for p in best}


def tree_paths(tree) -> dict[tuple, float]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = {0: ()}
    for i in range(1, tree.size):
        paths[i] = paths[parents[i]] + (tokens[i],)
    return {paths[i]: float(tree.scores[i]) for i in range(1, tree.size)}


def test_merged_tree_worked_example():
    c = Candidates([[math.log(.6), math.log(.3)], [math.log(.8), math.log(.1)]], [[4, 5], [9, 4]])
    tree = grow_tree(7, c, 3, Lookup([5, 6], [math.log(.9), math.log(.5)], ngram=2))
    assert tree.tokens.tolist() == [7, 5, 9, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert tree.sources.tolist() == [0, DRAFTER | LOOKUP, DRAFTER, DRAFTER]
    assert torch.allclose(tree.scores.exp(), torch.tensor([1, .9, .72, .6], dtype=torch.float64))


def test_max_children_keeps_each_nodes_best_children_whichever_source():
    """A request's topk bounds every node's children, the lookup branch's included: in the worked
    example with one child a node, the root keeps the chain's 5 (.9) over the drafter's 4 (.6),
    5 keeps the drafter's 9 (.72) over the chain's 6 (.45), and the tree ends short of its budget
    rather than give a node a second child. With two, it is the unbounded tree."""
    c = Candidates([[math.log(.6), math.log(.3)], [math.log(.8), math.log(.1)]], [[4, 5], [9, 4]])
    lookup = Lookup([5, 6], [math.log(.9), math.log(.5)], ngram=2)
    one = grow_tree(7, c, 3, lookup, max_children=1)
    assert one.tokens.tolist() == [7, 5, 9] and one.parents.tolist() == [-1, 0, 1]
    assert grow_tree(7, c, 3, lookup, max_children=2).tokens.tolist() == grow_tree(7, c, 3, lookup).tokens.tolist()
    wide = grow_tree(7, c, 6, lookup, max_children=2)
    assert int(torch.bincount(wide.parents[1:]).max()) == 2 and wide.size - 1 == 6


@pytest.mark.parametrize("seed", range(6))
def test_merged_tree_is_the_best_first_tree_of_both_sources(seed):
    """The tree grown with a lookup branch holds exactly the `budget` best paths of the union
    of both sources (scored as a brute-force enumeration scores them), parents first, scores
    non-increasing in node order, each (parent, token) once; a smaller budget is its prefix;
    without the branch it is the drafter's own tree."""
    g = torch.Generator().manual_seed(seed)
    vocab, depths, k = 6, 4, 3
    logprobs = torch.log_softmax(torch.randn(depths, vocab, generator=g, dtype=torch.float64) * 2, -1)
    c = Candidates.top_k(logprobs, k)
    chain = torch.randint(0, vocab, (5,), generator=g).tolist()  # deeper than the drafter's block
    if seed % 2:  # a chain that starts on the drafter's own picks: shared nodes
        chain[:2] = [c.tokens[0][0], c.tokens[1][1]]
    lookup = Lookup(chain, torch.rand(5, generator=g, dtype=torch.float64).clamp(min=0.05).log().tolist(), 2)
    for budget in (1, 3, 7, 12, 30):
        tree = grow_tree(1, c, budget, lookup)
        got, want = tree_paths(tree), brute_force_tree(1, c, lookup, budget)
        assert got.keys() == want.keys()
        assert all(math.isclose(got[p], want[p], abs_tol=1e-12) for p in got)
        parents, scores = tree.parents.tolist(), tree.scores.tolist()
        assert all(parents[i] < i and scores[i] <= scores[parents[i]] for i in range(1, tree.size))
        assert all(scores[i] <= scores[i - 1] + 1e-12 for i in range(2, tree.size))
        pairs = list(zip(parents[1:], tree.tokens.tolist()[1:]))
        assert len(set(pairs)) == len(pairs)
        small = grow_tree(1, c, (budget + 1) // 2, lookup)
        assert torch.equal(tree.prefix((budget + 1) // 2).tokens, small.tokens)
        assert torch.equal(tree.prefix((budget + 1) // 2).sources, small.sources)
    plain = grow_tree(1, c, 12)
    assert plain.sources is None and tree_paths(plain) == brute_force_tree(1, c, Lookup([], []), 12)


def test_a_lookup_branch_alone_grows_its_chain():
    tree = grow_tree(3, None, 8, Lookup([5, 6, 7], [-0.1, -0.2, -0.3]))
    assert tree.tokens.tolist() == [3, 5, 6, 7] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.sources.tolist() == [0, LOOKUP, LOOKUP, LOOKUP]
    assert grow_tree(3, None, 8, None).size == 1


def test_calibration_counts_a_depth_only_once_the_depth_above_was_reached():
    engine_wide = LookupCalibration(decay=1.0)
    seq = LookupCalibration(decay=1.0, prior=engine_wide)
    prior = PRIOR[2]
    assert seq.probability(2, 1) == pytest.approx(prior)
    seq.observe(2, offered=4, followed=1)  # depth 1 taken, depth 2 missed, depths 3-4 never tried
    assert engine_wide.trials[2] == [1, 1, 0, 0] and engine_wide.hits[2] == [1, 0, 0, 0]
    assert engine_wide.probability(2, 1) == pytest.approx((1 + PRIOR_WEIGHT * prior) / (1 + PRIOR_WEIGHT))
    assert engine_wide.probability(2, 3) == pytest.approx(prior)
    for _ in range(200):
        seq.observe(2, offered=1, followed=1)
    assert seq.probability(2, 1) > 0.98 and seq.probability(3, 1) == pytest.approx(PRIOR[3])


def test_a_sequence_indexes_its_context_only_once_a_branch_could_pass_the_floor():
    """Indexing every new sequence's prompt on arrival took ~90 ms of a 20 s pass at 64
    streams, where a busy batch's floor (BudgetPolicy.lookup_floor) lets no chain through. A
    sequence indexes its context at the first branch asked for whose best first node (any
    n-gram length's) could beat the floor, and then proposes what an index kept from the
    start would: the tokens after the latest earlier match of its longest suffix."""
    prompt, output = [4, 8, 15, 16, 23, 42, 4, 8], [15, 16, 99, 4, 8]
    seq = SequenceLookup(prompt, LookupCalibration(decay=1.0))
    high = max(PRIOR.values())  # no n-gram length's first node beats this
    for n in range(1, len(output) + 1):
        assert seq.propose(output[:n], floor=high) is None
    assert seq.index is None
    branch = seq.propose(output, length=4, floor=min(PRIOR.values()) / 2)
    eager = NgramIndex(prompt + output)
    tokens, ngram = eager.propose(4)
    assert seq.index is not None and seq.index.tokens == prompt + output
    assert branch is not None and branch.tokens == tokens == [15, 16, 99, 4] and branch.ngram == ngram == 2
    assert seq.propose(output + [15], length=4) is not None and seq.index.tokens == prompt + output + [15]


def test_chain_outcome_reads_the_branch_off_the_tree():
    c = Candidates([[math.log(.6), math.log(.3)], [math.log(.8), math.log(.1)]], [[4, 5], [9, 4]])
    tree = grow_tree(7, c, 6, Lookup([5, 6], [math.log(.9), math.log(.5)]))
    six = tree.tokens.tolist().index(6)
    assert chain_outcome(tree, [0, 1, six]) == (2, 2)
    assert chain_outcome(tree, [0, 1]) == (2, 1)
    assert chain_outcome(tree, [0, tree.tokens.tolist().index(4)]) == (2, 0)


def repetitive_requests(vocab: int) -> list[Request]:
    """Prompts that repeat themselves (so the index matches from the first round), greedy and
    seeded, at fixed budgets and auto."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 1, 2, 1], [9, 3, 3, 2, 8, 9, 3, 3], [4, 4, 4]]
    requests = []
    for i, prompt in enumerate(prompts * 2):
        sampling = SamplingParams(temperature=0.9, seed=70 + i) if i >= len(prompts) else SamplingParams()
        budget = ["auto", 8, 3, "auto"][i % 4]
        requests.append(Request(prompt, 24, sampling=sampling, budget=budget, lookup=True))
    return requests


@pytest.mark.parametrize("policy", ["random-q", "steep"])
def test_trees_with_lookup_branches_leave_every_token_the_targets(tiny_checkpoint, policy):
    """Greedy and seeded requests with lookup branches, beside fixed budgets, with the step's Q
    drawn at random every round (random-q), or on a machine where drafting never pays (steep:
    auto sequences then verify lookup branches alone, no drafter work): every request gets its
    plain decoding's tokens, and lookup branches were accepted."""
    hf, target, _ = tiny_checkpoint("llama", 97)
    drafter = DFlashDrafter.untrained(target, block_size=8, seed=7)
    requests = repetitive_requests(97)
    plain = [SoloLoop.local(target, drafter).generate([Request(r.prompt, 24, sampling=r.sampling, budget=0)])[0].tokens
             for r in requests]
    for r, tokens in zip(requests, plain):
        if r.sampling.temperature == 0:
            assert tokens == hf_greedy(hf, r.prompt, 24)
    chosen = RandomQ(seed=3) if policy == "random-q" else FixedCosts(CostCurve({1: 0.01, 200: 0.05}))
    if policy == "steep":
        chosen.draft.observe(10.0, 1, 0)  # a drafter pass costs 10 s: the policy never drafts after its first look
    scheduler = Scheduler.local(target, drafter, "auto", BatchLimits(max_num_seqs=8, max_step_tokens=8 * 33),
                                policy=chosen)
    results = scheduler.generate(requests)
    for i, (result, tokens) in enumerate(zip(results, plain)):
        assert result.tokens == tokens, f"request {i} ({requests[i].sampling}, budget {requests[i].budget}) differs"
    sources = [sum(r.accepted_sources[j] for res in results for r in res.rounds) for j in range(3)]
    assert sources[1] + sources[2] > 0, f"no lookup node was accepted: {sources}"
    assert sum(sources) == sum(r.accepted for res in results for r in res.rounds)
    if policy == "steep":
        undrafted = [r for res, req in zip(results, requests) if req.budget == "auto"
                     for r in res.rounds if r.tree_size > 1 and r.draft_s == 0]
        assert undrafted, "auto sequences verified lookup branches without drafting"


def test_lookup_off_gives_the_drafters_trees(tiny_checkpoint):
    """lookup=False (a request's or the engine's default) leaves the trees the drafter's alone."""
    hf, target, _ = tiny_checkpoint("llama", 97)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    drafter = OracleDrafter(prompt + hf_greedy(hf, prompt, 40), 97, 8, accuracy=0.5)
    for engine_default, asked in itertools.product([False, True], [None, False]):
        scheduler = Scheduler.local(target, drafter, 8, lookup=engine_default)
        (result,) = scheduler.generate([Request(prompt, 20, lookup=asked)])
        on = engine_default if asked is None else asked
        lookup_accepted = sum(r.accepted_sources[1] + r.accepted_sources[2] for r in result.rounds)
        if not on:
            assert lookup_accepted == 0
        assert result.tokens == hf_greedy(hf, prompt, 20)
