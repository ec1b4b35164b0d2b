"""Traces and their replay (ddtree.trace, ddtree.simulate): the real Scheduler over the replay
backends commits exactly the trace's tokens under every policy, deterministically, and its
virtual seconds are the cost model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.simulate import CostModel, ReplayMismatch, Trace, replay_scheduler, simulate
from ddtree.trace import TraceSequence, trace_of
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.calibration import measure_step_cost
from ddtree.workers.requests import Request
from ddtree.workers.scheduler import BatchLimits, Scheduler, row_counts

from .drafters import OracleDrafter

COSTS = Path(__file__).resolve().parents[1] / "benchmarks" / "costs"
PROMPTS = [[5, 17, 3, 22, 9], [40, 2, 2, 61], [7, 7, 7, 80, 11, 3], [33, 90, 14]]


def steep(packed: bool = True) -> CostModel:
    """A CPU-shaped curve: every row costs."""
    return CostModel("steep", {1: 0.030, 1024: 0.030 + 1023 * 0.002}, {1: 0.010, 64: 0.010 + 63 * 0.001},
                     context_row_s=1e-5, overhead_s=0.002, overhead_seq_s=3e-4, node_s=2e-5, packed=packed)


def flat(packed: bool = True) -> CostModel:
    """A GPU-shaped curve with steep's T(1): flat to 256 rows."""
    return CostModel("flat", {1: 0.030, 256: 0.030, 1024: 0.060}, {1: 0.010, 64: 0.010 + 63 * 0.001},
                     context_row_s=1e-5, overhead_s=0.002, overhead_seq_s=3e-4, node_s=2e-5, packed=packed)


@pytest.fixture(scope="module")
def recorded(tiny_checkpoint):
    """A trace recorded as `ddtree trace` records one, from a tiny random target and an untrained
    drafter: the completions through the real scheduler at budget 16 (one request seeded at
    T 0.8), then the drafter's candidates along each."""
    _, target, _ = tiny_checkpoint("llama")
    drafter = DFlashDrafter.untrained(target, block_size=6, seed=3)
    requests = [Request(p, 20) for p in PROMPTS[:3]] + [Request(PROMPTS[3], 20, sampling=SamplingParams(temperature=0.8, seed=11))]
    results = Scheduler.local(target, drafter, 16, BatchLimits(max_num_seqs=4)).generate(requests)
    return trace_of(target, drafter, requests, [r.tokens for r in results], top_k=16, finish=[r.finish_reason for r in results])


@pytest.fixture(scope="module")
def accepting(tiny_checkpoint):
    """A trace whose candidates come from an oracle drafter that knows the target's continuation
    (accuracy 0.8): deep trees, long accepted paths, every policy drafting."""
    _, target, _ = tiny_checkpoint("llama")
    requests = [Request(p, 24) for p in PROMPTS]
    completions = [r.tokens for r in Scheduler.local(target, None, 0, BatchLimits(max_num_seqs=4)).generate(requests)]
    seqs = []
    for request, completion in zip(requests, completions):
        oracle = OracleDrafter(request.prompt + completion + [0] * 8, 97, block_size=6, accuracy=0.8, seed=1)
        starts = torch.arange(len(request.prompt), len(request.prompt) + len(completion) - 1)
        logprobs = oracle.draft(None, None, torch.tensor(completion[:-1]), starts)
        cands = [oracle_candidates(row, 16) for row in logprobs]
        seqs.append(TraceSequence(request.prompt, completion, request.max_tokens, (), request.sampling, "length",
                                  np.asarray([c[0] for c in cands], np.int32), np.asarray([c[1] for c in cands], np.float32)))
    return Trace(seqs, {"block_size": 6, "top_k": 16})


def oracle_candidates(logprobs: torch.Tensor, k: int) -> tuple[list, list]:
    from ddtree.kernels.tree import Candidates

    c = Candidates.top_k(logprobs, k)
    return c.tokens, c.logprobs


def test_a_trace_replays_to_its_own_tokens_under_every_policy(recorded, accepting):
    """The replay is lossless by construction (the target's choices are the trace's committed
    tokens): `simulate` raises ReplayMismatch where a result differs from the trace, so every
    policy, alone and batched, with and without lookup branches, must commit the trace's tokens
    -- and a recorded trace's tokens are the target's own (the recording ran the engine)."""
    for trace in (recorded, accepting):
        for budget in (0, "chain", 4, 16, 64, "auto"):
            for streams in (1, 3):
                row = simulate(trace, steep(), budget, streams, requests=5)
                assert row.requests == 5 and row.tokens == sum(len(trace.sequences[i % 4].completion) for i in range(5))
        row = simulate(trace, flat(packed=False), 16, 2, lookup=True)
        assert row.requests == 4
    deep = simulate(accepting, steep(), 16, 1)
    assert deep.tau > 2.5  # the oracle's trees are accepted deep: the walk follows long committed paths


def test_a_trace_file_round_trips(recorded, tmp_path):
    recorded.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    assert back.meta["top_k"] == 16 and back.block_size == 6
    for a, b in zip(recorded.sequences, back.sequences):
        assert (a.prompt, a.completion, a.max_tokens, a.sampling, a.finish_reason) == \
               (b.prompt, b.completion, b.max_tokens, b.sampling, b.finish_reason)
        assert np.array_equal(a.cand_tokens, b.cand_tokens) and np.array_equal(a.cand_logprobs, b.cand_logprobs)
    assert recorded.sequences[0].cand_tokens.shape == (len(recorded.sequences[0].completion) - 1, 5, 16)


def test_the_simulation_is_deterministic(accepting):
    """No clock, no randomness: the same cells give the same rows, field for field."""
    for budget, streams in (("auto", 3), (16, 2)):
        first = simulate(accepting, steep(), budget, streams, requests=6).summary()
        assert simulate(accepting, steep(), budget, streams, requests=6).summary() == first


def test_plain_decoding_runs_at_the_cost_models_rate(accepting):
    """Budget 0 at c streams, c sequences of N tokens prefilled together: each prompt's prefill
    costs T(its length), then N - 1 steps of c rows (the first in the prefill's step) cost
    T(c) + O(c) each -- so tokens/s = cN / (sum T(P) + (N - 1)(T(c) + O(c)))."""
    for cost in (steep(), flat(packed=False)):
        row = simulate(accepting, cost, 0, 4, requests=4)
        n = len(accepting.sequences[0].completion)
        assert all(len(s.completion) == n for s in accepting.sequences)
        seconds = sum(cost.T(len(s.prompt)) for s in accepting.sequences) + (n - 1) * (cost.T(4) + cost.O(4))
        assert row.seconds == pytest.approx(seconds, rel=1e-9)
        assert row.tokens_per_s == pytest.approx(4 * n / seconds, rel=1e-9)


def test_a_flatter_curve_never_slows_a_fixed_budget(accepting):
    """Under a curve that costs no more than another at every row count, a fixed budget's
    steps (the same trees, whatever the clock) cost no more, and it gains more over plain
    decoding the more rows it verifies."""
    for streams in (1, 4):
        rows = {(c.name, b): simulate(accepting, c, b, streams) for c in (steep(), flat()) for b in (0, 16, 64)}
        for budget in (16, 64):
            assert rows["flat", budget].tokens_per_s >= rows["steep", budget].tokens_per_s
            assert (rows["flat", budget].tokens_per_s / rows["flat", 0].tokens_per_s
                    > rows["steep", budget].tokens_per_s / rows["steep", 0].tokens_per_s)


def test_calibration_through_the_replay_target_measures_the_cost_models_curve(accepting):
    """The policy's start-up measurement, run through the replay backend on the virtual clock,
    is exactly T(r): what `replay_scheduler` hands the policy without running it."""
    scheduler = replay_scheduler(accepting, steep(), 2, max_step_tokens=40, calibrate=False)
    measured = measure_step_cost(scheduler, row_counts(40))
    assert measured == {r: pytest.approx(steep().T(r), rel=1e-9) for r in row_counts(40)}


def test_a_replay_that_leaves_the_trace_is_caught(accepting):
    """A drafter asked for candidates after a token the trace did not commit means the replay
    (or the scheduler) went wrong: ReplayMismatch, never a silently different run."""
    scheduler = replay_scheduler(accepting, steep(), 1, calibrate=False)
    scheduler.drafter.assign(0, 1)  # sequence 0 will replay trace sequence 0's request, but is told it is 1
    scheduler.add(accepting.sequences[0].request(16))
    with pytest.raises(ReplayMismatch):
        while scheduler.has_work:
            scheduler.step()


def test_the_shipped_cost_models_load():
    """benchmarks/costs/*.json: each a CostModel whose T(r) never falls as rows grow."""
    files = sorted(COSTS.glob("*.json"))
    assert len(files) >= 3
    for f in files:
        cost = CostModel.load(f)
        ts = [cost.T(r) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)]
        assert all(b >= a - 1e-12 for a, b in zip(ts, ts[1:])), f.name
        assert cost.D(1) > 0 and json.loads(f.read_text())["note"]


def test_the_shipped_trace_replays_losslessly():
    """benchmarks/traces/mixed-36x128.npz (SmolLM2 + the shipped drafter): a few of its
    sequences, batched, commit their recorded tokens at a tree budget and under auto."""
    trace = Trace.load(Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "mixed-36x128.npz")
    assert len(trace.sequences) == 36 and trace.block_size == 8 and trace.top_k == 32
    assert trace.meta["prompt_files"] == ["gsm8k-test.jsonl", "humaneval.jsonl", "vicuna-bench.jsonl"]
    few = Trace(trace.sequences[:3], trace.meta)
    for budget in (16, "auto"):
        row = simulate(few, CostModel.load(COSTS / "h200-smollm2.json"), budget, 3, requests=3)
        assert row.requests == 3 and row.tau > 1.5


def test_auto_is_never_below_plain_decoding_but_for_learning_each_sequence(recorded, accepting):
    """Budget auto on a trace whose drafter is untrained (its trees seldom pay) and one whose
    drafter knows the continuation, under a CPU-shaped and a GPU-shaped curve, at one and four
    streams: where trees pay it is well above plain decoding; where they do not, it is below
    plain by no more than what learning that costs -- a few drafter passes a sequence."""
    for trace, name in ((recorded, "untrained"), (accepting, "oracle")):
        for cost in (steep(), flat(packed=False)):
            for streams in (1, 4):
                auto, plain = (simulate(trace, cost, b, streams) for b in ("auto", 0))
                learning = 3 * auto.requests * (cost.D(1) + cost.O(1, 16))
                assert auto.seconds <= plain.seconds + learning, (name, cost.name, streams, auto.seconds, plain.seconds)
                if name == "oracle" and cost.name == "flat":
                    assert auto.tokens_per_s > 1.5 * plain.tokens_per_s


def test_auto_is_not_below_plain_decoding_where_trees_seldom_pay():
    """The shipped trace on the 2-core CPU's cost model at 4 and 16 streams, where plain decoding
    is the best fixed budget: auto ran under plain there (0.999x, 0.995x) because its plan priced
    a step against plain decoding at the step's own batch while most sequences were still
    prefilling to join it (a token drafted then is worth the joined batch's rate), and priced a
    never-drafted sequence's catch-up rows as if they bought SEQ_MEMORY more rounds when the
    sequence had a few tokens left. It must decode at least as fast as plain."""
    trace = Trace.load(Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "mixed-36x128.npz")
    cost = CostModel.load(COSTS / "cpu-epyc-2core.json")
    for streams in (4, 16):
        auto, plain = (simulate(trace, cost, b, streams) for b in ("auto", 0))
        assert auto.tokens_per_s >= plain.tokens_per_s, (streams, auto.tokens_per_s, plain.tokens_per_s)
