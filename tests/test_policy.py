"""`budget: auto` (workers.policy): the model's arithmetic on hand-counted cases, the properties
its decisions must have -- more nodes under a flatter cost curve, fewer as acceptance falls,
exploration bounded, a sequence's state dropped when it ends -- and that trees whose budget
changes every round leave every token the target's own (greedy and seeded; tiny float64
targets, so equality is exact)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.kernels.tree import DRAFTER, LOOKUP, Candidates, Lookup, build_tree, grow_tree
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.policy import (BINS, EMA, GROWTH, MIN_WIDTH, MISFIT_STEPS, BudgetPolicy, CostCurve, LinearCost, PlanRow,
                                    RowReport, SEQ_MEMORY, StepReport, _Kept, tree_gains)
from ddtree.workers.requests import Request
from ddtree.workers.scheduler import FEATURE_CHUNKS, BatchLimits, PendingFeatures, Scheduler
from ddtree.workers.solo import SoloLoop

from .drafters import OracleDrafter
from .helpers import hf_greedy

BUCKETS = [1, 2, 3, 5, 9, 17, 33, 65]


def test_cost_curve_interpolates_extrapolates_and_learns():
    curve = CostCurve({1: 1.0, 9: 3.0})
    assert curve.predict(1) == 1.0 and curve.predict(0) == 1.0
    assert curve.predict(5) == pytest.approx(2.0)  # halfway between the points
    assert curve.predict(18) == pytest.approx(6.0)  # past the last point: proportional to the size
    curve.observe(9, 4.0)  # a measured point moves by EMA towards what was measured
    assert 3.0 < curve.points[9] < 4.0
    curve.observe(100, 50.0)  # far from every point: a point of its own
    assert curve.points[100] == 50.0
    before, guess = curve.points[100], curve.predict(90)
    curve.observe(90, 90.0)  # near a point: scales it towards the measurement, and is a point itself
    assert curve.points[100] > before
    assert curve.points[90] == pytest.approx(guess + EMA * (90.0 - guess))
    assert not CostCurve() and CostCurve().predict(7) == 0.0


def test_a_linear_cost_recovers_the_steps_it_is_fitted_to():
    """D and O are least-squares fits: steps that vary in every size give back the line; a size
    that never varied (one stream's B) shares the intercept's part and still predicts its steps."""
    cost = LinearCost(2)
    for b in range(1, 17):
        for n in (0, 3, 20):
            cost.observe(0.002 + 0.001 * b + 0.0001 * n, b, n)
    assert cost.predict(40, 7) == pytest.approx(0.002 + 0.040 + 0.0007, rel=1e-4)
    assert cost.coefficient(1) == pytest.approx(0.0001, rel=1e-3)
    one = LinearCost(2)
    for n in range(10):
        one.observe(0.010 + 0.001 * n, 1, n)
    assert one.predict(1, 5) == pytest.approx(0.015, rel=1e-4) and one.coefficient(1) == pytest.approx(0.001, rel=1e-3)


def worked_tree():
    """kernels.tree.build_tree's worked example: root 7; node 1 (token 0, p .6, depth 1), its
    child node 2 (token 1, p .48), node 3 (token 1, p .3, depth 1)."""
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.8, 0.1]], dtype=torch.float64))
    return build_tree(7, logprobs, budget=3)


def nodes_of(tree):
    return tree.scores[1:].exp().tolist(), tree.depths[1:].tolist(), [False] * (tree.size - 1)


def test_expected_accepted_tokens_of_the_worked_tree():
    tree = worked_tree()
    p, depth, chain = nodes_of(tree)
    assert tree.tokens.tolist() == [7, 0, 1, 1] and tree.parents.tolist() == [-1, 0, 1, 0]
    assert p == pytest.approx([0.6, 0.48, 0.3]) and depth == [1, 2, 1]
    # calibrated: each node adds its p; E(n) sums the first n nodes' chances of being on the path
    assert tree_gains(p, depth, chain, [1.0] * 4) == pytest.approx([0, 0.6, 1.08, 1.38])
    # nodes of p >= .5 right a sixth as often as p says: depth 1 is reached with .1 (+ .3 of
    # node 3), and depth 2 no more often than depth 1 (the path reaches it only via depth 1)
    assert tree_gains(p, depth, chain, [1 / 6, 1.0, 1.0, 1.0]) == pytest.approx([0, 0.1, 0.2, 0.8])
    assert tree_gains(p, depth, chain, [1.0] * 4, scale=3.0) == pytest.approx([0, 1.0, 2.0, 2.0])  # never past certain
    # a lookup chain's nodes: their own class's factor, never the drafter's bins nor the sequence's scale
    chain_only = [0.0] * (len(BINS) + 1) + [0.5, 1.0]  # the drafter's bins, the chain's alone, both
    assert tree_gains(p, depth, [LOOKUP] * 3, chain_only, scale=0.0) == pytest.approx([0, 0.3, 0.54, 0.69])
    assert tree_gains(p, depth, [LOOKUP | DRAFTER] * 3, chain_only, scale=0.0) == pytest.approx([0, 0.6, 1.08, 1.38])


def test_a_kept_tree_resolves_along_the_tokens_committed_after_its_root():
    tree = worked_tree()
    kept = _Kept(tree.tokens.tolist(), tree.parents.tolist(), *nodes_of(tree)[::2])
    assert kept.resolve() is None  # nothing committed yet
    for after, path in (([1], {3}), ([0], None), ([0, 1], {1, 2}), ([0, 5], {1}), ([5], set())):
        kept.after = after
        assert kept.resolve() == path, after


def report(rows, nodes=0, verify_s=0.0, drafting=0, draft_s=0.0, rest_s=0.0, batch=1, q=1) -> StepReport:
    return StepReport(batch, q, nodes, verify_s, drafting, 2 * drafting, draft_s, rest_s, rows)


def test_a_drafted_tree_teaches_its_whole_self_once_the_committed_tokens_decide_it():
    """The target's choice at every position is the token the sequence commits there, so a
    drafted tree's path is known a few steps later through nodes never verified: the whole tree
    teaches the drafter's per-bin factors and the sequence's own, whatever prefix was verified.
    Here the step verified the root alone and the target took token 1: node 3's."""
    policy = BudgetPolicy(CostCurve({1: 1.0}))
    assert policy.curve(5, worked_tree(), 3) == pytest.approx([0, 0.6, 1.08, 1.38])  # nothing learnt: p as is
    policy.observe(report([RowReport(5, [0], False)]))  # token 0: node 1 taken, its child undecided
    assert len(policy.sequences[5].pending) == 1 and policy.bins[0].mass == 0.0
    policy.observe(report([RowReport(5, [9], False)]))  # then 9: node 1 was the path's end
    state = policy.sequences[5]
    assert state.pending == []
    assert [b.hits for b in policy.bins] == pytest.approx([1, 0, 0, 0, 0, 0])  # bins: .6 -> 0; .48 and .3 -> 1
    assert [b.mass for b in policy.bins] == pytest.approx([0.6, 0.78, 0, 0, 0, 0])
    assert state.factor.hits == pytest.approx(1.0) and state.factor.mass == pytest.approx(1.38)
    assert policy.factors()[0] > 1.0 > policy.factors()[1]
    assert policy.curve(5, worked_tree(), 3)[1] > 0.6  # node 1's bin was right more often than p said


def concave(total: float, nodes: int = 64, scale: float = 4.0) -> list[float]:
    """A best-first tree's expected accepted tokens by nodes: each node adds less."""
    return [total * (1 - math.exp(-n / scale)) for n in range(nodes + 1)]


@pytest.mark.parametrize("packed", [True, False])
def test_more_nodes_under_a_flatter_cost_curve(packed):
    """The same trees, on curves whose rows cost less and less past T(1): the granted nodes never
    fall, and where rows are free every tree is granted whole."""
    granted = []
    for slope in (0.004, 0.001, 0.0002, 0.0):  # seconds a verify row adds
        policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.030 + 1023 * slope}), packed=packed)
        granted.append(sum(policy.choose(4, BUCKETS, [concave(3.0)] * 4, 0.010).nodes))
    assert granted == sorted(granted) and granted[0] < granted[-1] == 4 * 64, granted


@pytest.mark.parametrize("packed", [True, False])
def test_fewer_nodes_as_acceptance_falls(packed):
    """The same costs, trees expected to accept less and less: the granted nodes never rise, and
    a tree expected to accept almost nothing is not verified."""
    policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.030 + 1023 * 0.001}), packed=packed)
    granted = [policy.choose(1, BUCKETS, [concave(t)], 0.010).nodes[0] for t in (4.0, 2.0, 1.0, 0.5, 0.05)]
    assert granted == sorted(granted, reverse=True) and granted[0] > 0 and granted[-1] == 0, granted


@pytest.mark.parametrize("packed", [True, False])
def test_sequences_still_prefilling_price_the_step_at_the_batch_they_join(packed):
    """While most of a batch is still prefilling, a second spent on trees now is a second the
    joined batch decodes less: the same trees are granted no more nodes as more sequences are
    joining, and none where the joined batch's plain rate beats what they add."""
    granted = []
    for joining in (0, 6, 62):
        policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.030 + 1023 * 0.002}), packed=packed)
        granted.append(sum(policy.choose(2, BUCKETS, [concave(3.0)] * 2, 0.010, joining=joining).nodes))
    assert granted == sorted(granted, reverse=True) and granted[0] > 0 == granted[-1], granted


def test_a_catch_up_is_priced_over_the_rounds_its_tokens_left_can_use():
    """An idle sequence's catch-up rows buy the rounds after it: spread over SEQ_MEMORY rounds
    where it has many tokens left, but charged whole where it has one round left to draft."""
    policy, curve = BudgetPolicy(), concave(3.0, 8)
    steady = 1 + curve[-1]
    assert policy._priced_context(PlanRow(1, 2), curve) == 2  # a round's own rows: as they are
    assert policy._priced_context(PlanRow(1, 300), curve) == pytest.approx(steady + (300 - steady) / SEQ_MEMORY)
    assert policy._priced_context(PlanRow(1, 300, left=2), curve) == 300
    left = 30  # about 8 rounds of steady tokens
    assert policy._priced_context(PlanRow(1, 300, left=left), curve) == pytest.approx(steady + (300 - steady) * steady / left)


def chain_tree(p: float = 0.8, depth: int = 6):
    """A chain of `depth` nodes, token 0 each, each taken with probability p given its parent."""
    logprobs = torch.full((depth, 4), math.log((1 - p) / 3), dtype=torch.float64)
    logprobs[:, 0] = math.log(p)
    return build_tree(3, logprobs, budget=depth, top_k=1)


def test_a_sequence_whose_trees_are_not_taken_is_granted_fewer_nodes():
    """The sequence's own factor learns from its trees: trees the target never takes are
    expected to accept less step by step, and granted fewer nodes, down to none."""
    policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.030 + 1023 * 0.002}), packed=True)
    granted, expected = [], []
    for _ in range(12):
        curve = policy.curve(1, chain_tree(), 64)
        expected.append(curve[-1])
        granted.append(policy.choose(1, BUCKETS, [curve], 0.010, ids=[1]).nodes[0])
        policy.observe(report([RowReport(1, [9], False)]))  # the target took a token no node holds
    assert expected == sorted(expected, reverse=True) and granted == sorted(granted, reverse=True)
    assert granted[0] > 0 and granted[-1] == 0, granted


def run_one(policy: BudgetPolicy, steps: int, taken: bool) -> list[bool]:
    """A lone sequence for `steps` steps on a CPU-shaped machine (T(1) 30 ms + 2 ms a row, the
    drafter's pass 10 ms, the rest 2 ms): the plan, the draft, the choice, the outcome -- its
    chain trees always taken (`taken`) or never. Returns whether each step drafted."""
    drafted = []
    for _ in range(steps):
        (draft,) = policy.plan(1, BUCKETS, [PlanRow(1, 2)])
        nodes = 0
        if draft is not None:
            nodes = policy.choose(1, BUCKETS, [policy.curve(1, chain_tree(), draft.width)], 0.010, ids=[1]).nodes[0]
        committed = [0] * nodes + [0] if taken else [9]
        policy.observe(report([RowReport(1, committed, False)], nodes, 0.030 + 0.002 * nodes, int(draft is not None),
                              0.010 if draft else 0.0, 0.002))
        drafted.append(draft is not None)
    return drafted


def test_exploration_is_bounded():
    """An unknown sequence drafts to learn its acceptance. One whose trees are never taken drafts a
    bounded number of times -- a few at first, then ever more seldom, as its evidence fades and
    each miss adds more -- while one whose trees are always taken drafts at nearly every step."""
    never = run_one(BudgetPolicy(CostCurve({1: 0.030, 1024: 0.030 + 1023 * 0.002}), packed=True), 600, taken=False)
    at = [i for i, d in enumerate(never) if d]
    assert never[0] and sum(never[:64]) <= 6 and sum(never) <= 12, at
    gaps = [b - a for a, b in zip(at[3:], at[4:])]
    assert gaps == sorted(gaps), at  # tried again ever more seldom
    always = run_one(BudgetPolicy(CostCurve({1: 0.030, 1024: 0.030 + 1023 * 0.002}), packed=True), 200, taken=True)
    assert sum(always) >= 190


def test_the_plan_drafts_the_sequences_whose_trees_pay():
    """Of two sequences the batch knows, the plan drafts the one whose trees are taken, not the
    one whose trees never are; before any tree is seen, the first sequence drafts."""
    policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.030 + 1023 * 0.002}), packed=True)
    first = policy.plan(2, BUCKETS, [PlanRow(1, 2), PlanRow(2, 2)])
    assert first[0] is not None and first[0].explores and first[1] is None
    for _ in range(20):
        curves = [policy.curve(i, chain_tree(), 16) for i in (1, 2)]
        nodes = policy.choose(2, BUCKETS, curves, 0.010, ids=[1, 2]).nodes
        policy.observe(report([RowReport(1, [0] * nodes[0] + [0], False), RowReport(2, [9], False)], sum(nodes),
                              0.032 + 0.002 * sum(nodes), 2, 0.012, 0.002, batch=2))
    plan = policy.plan(2, BUCKETS, [PlanRow(1, 2), PlanRow(2, 2)])
    assert plan[0] is not None and not plan[0].explores and plan[1] is None


def test_the_reported_prediction_is_the_estimate_not_the_optimistic_price():
    """The plan prices a sequence whose acceptance is little known at its factor's optimistic
    bound (exploration), but the accepted tokens a choice reports -- compared with what the
    target accepted -- are the estimator's mean: an optimistic prediction would read high by
    construction wherever evidence is thin."""
    policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.031}))  # rows nearly free: the whole tree is granted
    policy.curve(1, chain_tree(0.5, 6), 64)
    policy.observe(report([RowReport(1, [0, 0, 9], False)]))  # two of six taken: a little evidence, factor != 1
    state = policy.sequences[1]
    mean, bound = state.factor.mean(), state.factor.upper(0.25)
    assert mean != pytest.approx(1.0) and bound > mean
    curve = policy.curve(1, chain_tree(0.5, 6), 64)
    decision = policy.choose(1, BUCKETS, [curve], 0.010, ids=[1])
    p, depth, chain = nodes_of(chain_tree(0.5, 6))
    n = decision.nodes[0]
    assert n == 6
    assert decision.predicted[0] == pytest.approx(tree_gains(p, depth, chain, policy.factors(), mean)[n])
    assert decision.predicted[0] < tree_gains(p, depth, chain, policy.factors(), bound)[n]
    assert policy.expected(1)[n] > decision.predicted[0]  # the plan's price of the next tree: the bound


def merged_tree():
    """A drafted tree with a lookup chain merged in: the drafter proposes token 0 (p .7) or 1 (.2)
    at each of 3 depths; the chain proposes 2, 2, 2, each with its calibrated probability .6 --
    a token the drafter did not propose: the two sources disagree at every depth."""
    candidates = Candidates([[math.log(0.7), math.log(0.2)]] * 3, [[0, 1]] * 3)
    return grow_tree(5, candidates, 12, Lookup([2, 2, 2], [math.log(0.6)] * 3, 3))


def test_where_the_sources_disagree_the_prediction_follows_what_the_target_takes():
    """A merged tree's chain nodes the drafter did not propose are calibrated apart from the
    drafter's nodes: where the target takes the drafter's token and then one no node holds, the
    chain's nodes are never on its path, so their factor falls and the tree's expected accepted
    tokens come down to the one the target accepts -- instead of adding the chain's own
    probabilities, measured over every round it was offered, to the drafter's at every depth."""
    policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.031}))
    tree = merged_tree()
    assert tree.sources[1:].tolist().count(LOOKUP) == 3  # the chain's nodes: the chain's alone
    first = policy.curve(1, tree, 12)[-1]
    for _ in range(40):
        predicted = policy.curve(1, tree, 12)[-1]
        policy.observe(report([RowReport(1, [0, 9], False)]))  # the drafter's 0, then a token no node holds
    assert first > 1.5 and abs(predicted - 1.0) < 0.1, (first, predicted)
    assert policy.factors()[len(BINS) + 1] < 0.2  # the chain's nodes alone: never taken


def test_a_sequences_state_is_dropped_when_it_finishes():
    policy = BudgetPolicy(CostCurve({1: 1.0}))
    policy.curve(5, worked_tree(), 3)
    policy.observe(report([RowReport(5, [0], True)]))  # its last step: undecided trees go with it
    assert 5 not in policy.sequences
    policy.curve(6, worked_tree(), 3)
    policy.drop(6)  # cancelled
    assert policy.sequences == {}


def test_the_draft_grows_from_the_last_granted_tree():
    """A first draft is GROWTH x MIN_WIDTH nodes; each later one GROWTH times the last granted
    tree's nodes (at least MIN_WIDTH, at most what the step may grant), GROWTH depths past it."""
    policy = BudgetPolicy(CostCurve({1: 0.030, 1024: 0.031}))  # rows nearly free: whole trees pay
    draft = policy.draft_of(1, 64)
    assert (draft.width, draft.explores) == (GROWTH * MIN_WIDTH, True)
    curve = policy.curve(1, chain_tree(0.9, 6), 64)
    assert policy.choose(1, BUCKETS, [curve], 0.010, ids=[1]).nodes == [6]
    draft = policy.draft_of(1, 64)
    assert (draft.width, draft.depth, draft.explores) == (MIN_WIDTH, 6 + GROWTH, False)
    assert policy.draft_of(1, 8).width == 8


def test_a_start_up_curve_the_live_steps_contradict_is_measured_again():
    """A start-up curve timed while another process ran said T(1) 1215 ms where the forward took
    30: every node looked free. MISFIT_STEPS steps in a row whose forward the curve mispredicts by
    over 2x ask for T(r) to be measured again (`misfit`), twice as many after each re-measurement;
    one slow step is not a misfit; a measurement that cannot be the machine's is not taken; and
    the points above the re-measured counts keep their shape at the measured level."""
    policy = BudgetPolicy(CostCurve({1: 1.215, 17: 1.245, 65: 2.488, 129: 3.0}), packed=True)
    for step in range(MISFIT_STEPS):
        assert not policy.misfit()
        policy.observe(report([], 8, 0.040 if step else 5.0))  # the first: a slow step, not a misfit streak
    policy.observe(report([], 8, 0.040))
    assert policy.misfit()
    assert not policy.recalibrate(CostCurve({1: 1.215, 17: 1.245, 65: 2.488, 129: 0.623}))  # it dips: not the machine's
    assert policy.recalibrations == 1 and not policy.misfit()
    assert policy.recalibrate(CostCurve({1: 0.030, 17: 0.050, 65: 0.100}))
    assert policy.verify.points == pytest.approx({1: 0.030, 17: 0.050, 65: 0.100, 129: 0.100 * 3.0 / 2.488})
    assert policy.misfits == 0 and policy.recalibrations == 2
    for _ in range(2 * MISFIT_STEPS):  # each re-measurement asks for a longer streak
        policy.observe(report([], 0, 0.001))
        assert not policy.misfit()
    assert policy.misfits == 2 * MISFIT_STEPS


class FixedCosts(BudgetPolicy):
    """The policy over costs the test sets (T(r); D and O as observed on the policy before it
    runs), not learned from this machine's timings; acceptance is learned as ever."""

    def observe(self, step: StepReport) -> None:
        step.verify_s = step.draft_s = step.rest_s = 0.0
        super().observe(step)


class RandomQ(BudgetPolicy):
    """Every auto sequence drafts and each step's Q is a random bucket, each tree its own random
    node count (padded: Q - 1 each): budgets change every round."""

    def __init__(self, seed: int):
        super().__init__(CostCurve({1: 1.0}))
        self.g = random.Random(seed)

    def plan(self, batch, buckets, rows, fixed_drafting=0, fixed_nodes=0, joining=0):
        return [self.draft_of(r.seq_id, buckets[-1] - 1) for r in rows]

    def _allocate(self, batch, buckets, curves, fixed_nodes, fixed_drafting, context, sunk=0.0, joining=0):
        q = self.g.choice(buckets)
        return [min(len(c) - 1, self.g.randrange(q) if self.packed else q - 1) for c in curves], 1.0


def test_every_committed_row_reaches_the_drafter_once_with_its_own_features(tiny_checkpoint):
    """The plan prices the target features an auto sequence gathered since its last draft (its
    whole prompt when new, every token since when idle) from a count it asks for every step
    (`PendingFeatures.rows`; summing tensors each step cost ~130k generator steps a pass at 64
    streams), and the drafter takes them in at its next draft (a list of per-step views whose
    recent ones are joined every 32 steps: joined whole, an idle sequence's context was copied
    again at every join). Every step the count is what the next draft
    takes in; over a sequence's life every committed position reaches the drafter once, in
    order, as the target's own features of that position (a full forward over the committed
    tokens recomputes them)."""
    hf, target, _ = tiny_checkpoint("llama", 97)
    drafter = DFlashDrafter.untrained(target, block_size=8, seed=3)
    scheduler = Scheduler.local(target, drafter, "auto", BatchLimits(max_num_seqs=3, max_step_tokens=3 * 17),
                                policy=RandomQ(5))  # every sequence drafts every step
    handed: dict[int, list[torch.Tensor]] = {}
    propose = scheduler.drafter.propose

    def recording(rows):
        for seq_id, features in zip(rows.ids, rows.features):
            handed.setdefault(seq_id, []).append(features.clone())
        return propose(rows)

    scheduler.drafter.propose = recording
    ids = {scheduler.add(Request(prompt, 20)): prompt for prompt in ([5, 6, 7], [9, 4, 2, 8, 8], [3])}
    pending, results, checked = {}, {}, 0
    while scheduler.has_work:
        for seq in scheduler.running:  # what the plan will price: what its next draft takes in
            pending[seq.id] = seq.features.rows
        drafted_before = {seq.id: len(handed.get(seq.id, ())) for seq in scheduler.running}
        for seq_id, update in scheduler.step():
            if update.result is not None:
                results[seq_id] = update.result
        for seq_id, n in drafted_before.items():
            if len(handed.get(seq_id, ())) > n and pending.get(seq_id):
                assert handed[seq_id][-1].shape[1] == pending[seq_id], seq_id
                checked += 1
    assert checked > 20
    layers = tuple(drafter.target_layer_ids)
    for seq_id, prompt in ids.items():
        tokens = prompt + results[seq_id].tokens[:-1]  # the last, pending, has no features yet
        n = len(tokens)
        full = target(torch.tensor([tokens]), torch.arange(n)[None], target.prefill_mask(n), target.new_cache(1, n),
                      capture_layers=layers).features[0]
        got = torch.cat(handed[seq_id], dim=1)[0]
        assert got.shape[0] <= n and got.shape[0] >= n - 10  # the rows since its last draft are still pending
        torch.testing.assert_close(got, full[: got.shape[0]], rtol=1e-4, atol=1e-4)


def test_pending_features_are_the_rows_added_since_the_last_clear():
    """`PendingFeatures` gives the drafter the rows added since it last took them in, in order,
    as one tensor of its own; an idle sequence's recent steps are joined every FEATURE_CHUNKS
    of them, and no row is copied twice by those joins (the whole context was, every 32 steps)."""
    gen = torch.Generator().manual_seed(0)
    pending, added = PendingFeatures(), []
    prompt = torch.randn(1, 40, 6, generator=gen)
    pending.add(prompt)
    added.append(prompt)
    for step in range(3 * FEATURE_CHUNKS + 5):
        chunk = torch.randn(1, 1 + step % 3, 6, generator=gen)
        pending.add(chunk)
        added.append(chunk)
        assert pending.rows == sum(c.shape[1] for c in added)
        assert len(pending.chunks) <= pending.joined_chunks + FEATURE_CHUNKS
    assert pending.joined_chunks == 3 and len(pending.chunks) == 3 + 6  # three joins (the prompt in the first), six recent
    assert pending.chunks[1].shape[1] == sum(c.shape[1] for c in added[FEATURE_CHUNKS : 2 * FEATURE_CHUNKS])
    whole = pending.joined()
    assert torch.equal(whole, torch.cat(added, dim=1))
    assert whole.untyped_storage().nbytes() == whole.numel() * whole.element_size()  # its own: pickles its rows alone
    pending.clear()
    assert pending.rows == 0 and not pending.chunks
    chunk = torch.randn(1, 2, 6, generator=gen)
    pending.add(chunk)
    assert torch.equal(pending.joined(), chunk)


@pytest.mark.parametrize("drafter_kind", ["untrained", "oracle"])
def test_budgets_changing_every_round_leave_every_token_the_targets(tiny_checkpoint, drafter_kind):
    """Greedy and seeded requests under budget auto, with the step's Q drawn at random every
    round and fixed-budget requests in the same batch: each gets its plain decoding's tokens."""
    hf, target, _ = tiny_checkpoint("llama", 97)
    prompts = [[5, 6, 7], [1], [9, 3, 3, 2, 8], [4, 4]]
    if drafter_kind == "oracle":  # accepts often, so the random Q changes what each round commits
        drafter = OracleDrafter(prompts[0] + hf_greedy(hf, prompts[0], 48), 97, 8, accuracy=0.8)
    else:
        drafter = DFlashDrafter.untrained(target, block_size=8, seed=7)
    requests = []
    for i, prompt in enumerate(prompts * 2):
        sampling = SamplingParams(temperature=0.9, seed=40 + i) if i >= len(prompts) else SamplingParams()
        requests.append(Request(prompt, 20, sampling=sampling, budget="auto" if i % 4 != 3 else 8))
    plain = [SoloLoop.local(target, drafter).generate([Request(r.prompt, 20, sampling=r.sampling, budget=0)])[0].tokens
             for r in requests]
    for r, tokens in zip(requests, plain):
        if r.sampling.temperature == 0:
            assert tokens == hf_greedy(hf, r.prompt, 20)
    scheduler = Scheduler.local(target, drafter, "auto", BatchLimits(max_num_seqs=8, max_step_tokens=8 * 33),
                                policy=RandomQ(seed=1))
    results = scheduler.generate(requests)
    for i, (result, tokens) in enumerate(zip(results, plain)):
        assert result.tokens == tokens, f"request {i} ({requests[i].sampling}) differs from plain decoding"
    granted = {r.budget for result, req in zip(results, requests) if req.budget == "auto" for r in result.rounds}
    assert len(granted) >= 3, f"the rounds' budgets changed: {granted}"
    if drafter_kind == "oracle":
        assert results[0].tau > 1.5, "the oracle's trees were accepted"


def test_the_scheduler_measures_a_contradicted_curve_again_mid_run_and_the_tokens_stay_the_targets(tiny_checkpoint,
                                                                                                     caplog):
    """The scheduler's side of `misfit`: told a curve ~10,000x the tiny target's real costs (and
    flat, so every node looks free), it measures T(r) again between two steps, through its own
    target and pool, and goes on; the measurement's pages go back, and every token is the
    target's own. (On a busy machine a millisecond forward's timings can dip as no machine's
    curve does: such a measurement is not taken, and the log says so.)"""
    hf, target, _ = tiny_checkpoint("llama", 97)
    prompt = [5, 6, 7]
    reference = hf_greedy(hf, prompt, 40)
    drafter = OracleDrafter(prompt + reference + [0] * 16, 97, 8, accuracy=0.8)
    poisoned = {r: 10.0 for r in range(1, 18)} | {65: 20.0, 129: 5.0}  # every count a step may verify: a point
    scheduler = Scheduler.local(target, drafter, "auto", BatchLimits(max_num_seqs=2, max_step_tokens=2 * 65),
                                policy=BudgetPolicy(CostCurve(poisoned)))
    # the sampled request runs on alone at the end (T(1), never seen, contradicts the curve step
    # after step) whichever trees the greedy one got
    results = scheduler.generate([Request(prompt, 40), Request(prompt, 64, sampling=SamplingParams(temperature=0.9, seed=3))])
    assert results[0].tokens == reference
    plain = SoloLoop.local(target, drafter).generate([Request(prompt, 64, sampling=SamplingParams(temperature=0.9, seed=3),
                                                              budget=0)])[0]
    assert results[1].tokens == plain.tokens
    assert scheduler.stats()["recalibrations"] >= 1
    taken = not any("not taken" in r.getMessage() for r in caplog.records)
    assert not taken or all(s < 1.0 for s in scheduler.policy.verify.points.values()), scheduler.policy.verify.points
    assert scheduler.pool.free_pages == scheduler.pool.num_pages


def test_policy_grants_trees_where_rows_are_cheap_and_none_where_they_are_not(tiny_checkpoint):
    """The same requests and a perfect drafter, on two machines the policy is told about: where
    verify rows cost nothing (a GPU below its knee) it grants the widest trees and accepts whole
    blocks; where each row costs a plain step, trees never pay and it decodes plainly after its
    first look. Its predictions are the drafter's own (certain) probabilities, and right. The
    tokens are the target's either way, and no sequence's state outlives it."""
    hf, target, _ = tiny_checkpoint("llama", 97)
    prompt = [5, 6, 7]
    reference = hf_greedy(hf, prompt, 40)
    drafter = OracleDrafter(prompt + reference + [0] * 16, 97, 8, accuracy=1.0)
    limits = BatchLimits(max_num_seqs=2, max_step_tokens=2 * 65)
    runs = {}
    for name, curve in [("flat", {1: 0.01, 130: 0.0101}), ("steep", {1: 0.01, 130: 1.30})]:
        policy = FixedCosts(CostCurve(curve))
        policy.draft.observe(0.002, 1, 0)  # a drafter pass: 2 ms
        scheduler = Scheduler.local(target, drafter, "auto", limits, policy=policy)
        runs[name] = scheduler.generate([Request(prompt, 40), Request(prompt, 40)])
        for result in runs[name]:
            assert result.tokens == reference
        assert policy.sequences == {}
    flat_budgets = [r.budget for r in runs["flat"][0].rounds]
    steep_budgets = [r.budget for r in runs["steep"][0].rounds]
    assert max(flat_budgets) >= 7 and runs["flat"][0].tau > 5  # whole blocks: the 8-token block's 7 drafted depths
    assert steep_budgets.count(0) >= len(steep_budgets) - 2, steep_budgets  # its first look aside: plain
    predicted = sum(r.predicted for r in runs["flat"][0].rounds)
    accepted = sum(r.accepted for r in runs["flat"][0].rounds)
    assert math.isclose(predicted, accepted, rel_tol=0.15), (predicted, accepted)


def test_the_drafter_is_asked_for_the_policys_width_and_depths(tiny_checkpoint):
    """End to end, budgets changing every round (every sequence drafts, each tree a random
    prefix): each draft asks the drafter for the width and depths `draft_of` gives after the
    sequence's last granted tree, and the output is plain decoding's."""
    hf, target, _ = tiny_checkpoint("llama", 97)
    prompt = [5, 6, 7]
    drafter = DFlashDrafter.untrained(target, block_size=16, seed=7)
    scheduler = Scheduler.local(target, drafter, "auto", BatchLimits(max_num_seqs=1, max_step_tokens=65),
                                policy=RandomQ(3))
    asked, propose = [], scheduler.drafter.propose

    def recording(rows):
        asked.append((rows.top_k[0], rows.depths[0]))
        return propose(rows)

    scheduler.drafter.propose = recording
    result = scheduler.generate([Request(prompt, 30)])[0]
    assert result.tokens == hf_greedy(hf, prompt, 30)
    chosen = [(r.tree_size - 1, len(r.drafted_per_depth)) for r in result.rounds]
    assert len(asked) == len(chosen) > 10
    assert asked[0] == (GROWTH * MIN_WIDTH, MIN_WIDTH // GROWTH // GROWTH + GROWTH)
    depth = MIN_WIDTH // GROWTH // GROWTH
    for (width, depths), (nodes, deepest) in zip(asked[1:], chosen):
        depth = deepest if nodes else depth
        assert (width, depths) == (min(64, max(MIN_WIDTH, GROWTH * nodes)), depth + GROWTH), (asked, chosen)
