"""Sampling at temperature > 0: seeded draws make speculation lossless token for token, and
unseeded draws follow the target's distribution."""

from __future__ import annotations

import itertools
import multiprocessing
import math

import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.kernels import sampling
from ddtree.kernels.sampling import inverse_cdf, processed_probs, uniform
from ddtree.workers.requests import Request
from ddtree.workers.solo import SoloLoop
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target_weights

from .helpers import make_hf_model
from .drafters import OracleDrafter

# --- the pieces -----------------------------------------------------------------------------


def test_uniform_is_a_pure_function_of_seed_and_position():
    draws = [uniform(7, p) for p in range(20000)]
    assert draws == [uniform(7, p) for p in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert uniform(7, 3) != uniform(8, 3) and uniform(7, 3) != uniform(7, 4)
    # roughly uniform: each decile holds 10% +- 1%
    counts = torch.histc(torch.tensor(draws), bins=10, min=0, max=1)
    assert ((counts / len(draws) - 0.1).abs() < 0.01).all(), counts


def test_processed_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    base = torch.softmax(logits.double() / 0.5, -1)
    torch.testing.assert_close(processed_probs(logits, SamplingParams(temperature=0.5)), base)
    for off in (0, -1):
        torch.testing.assert_close(processed_probs(logits, SamplingParams(temperature=0.5, top_k=off)), base)
    top2 = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[0] > 0).tolist() == [True, False, False, False, True]
    # top_p: the docstring's example
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    torch.testing.assert_close(
        processed_probs(p, SamplingParams(temperature=1.0, top_p=0.7)),
        torch.tensor([[0.625, 0.375, 0.0, 0.0]], dtype=torch.float64),
    )
    assert processed_probs(p, SamplingParams(temperature=1.0, top_p=1e-9))[0].tolist() == [1.0, 0, 0, 0]
    torch.testing.assert_close(processed_probs(p, SamplingParams(temperature=1.0, top_p=1.0)), p.exp().double())
    # min_p 0.2: keep tokens with at least 0.2 x 0.5 = 0.1
    kept = processed_probs(p, SamplingParams(temperature=1.0, min_p=0.2))
    assert (kept[0] > 0).tolist() == [True, True, True, False]


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 4, dtype=torch.float64)
    u = torch.tensor([0.0, 0.2499, 0.25, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]


def test_uniforms_are_uniform_bit_for_bit():
    """The batched generator (int64 tensors) gives `uniform`'s numbers, at the edges of 64 bits."""
    seeds = torch.tensor([0, 1, 7, 2**63 - 1, -1, -(2**63), 123456789123])
    positions = torch.tensor([[0, 1, 2**40, 2**63 - 1, -5]]).expand(len(seeds), -1)
    got = sampling.uniforms(seeds, positions)
    assert got.dtype == torch.float64
    assert got.tolist() == [[uniform(s, p) for p in row] for s, row in zip(seeds.tolist(), positions.tolist())]


BATCH_SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.5, top_p=0.3),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=3000, top_p=0.999),  # top_k past the vocabulary: off
    SamplingParams(temperature=2.0, top_p=0.05),
]


@pytest.mark.parametrize("vocab", [2000, 700], ids=["candidates", "vocab-below-candidates"])
def test_processed_probs_rows_are_each_rows_own_bit_for_bit(vocab):
    """A step's seeded nodes are processed at once, each under its request's parameters: every
    row equals processed_probs of that row alone, bit for bit (so every draw is the one plain
    seeded sampling makes), including rows whose nucleus reaches past the top candidates, rows
    with ties at the last candidate, and rows of equal logits."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(BATCH_SETTINGS) * 3, vocab, generator=g, dtype=torch.float64) * 4
    logits[1, :] = 0.5  # every logit equal
    logits[4, 100:1500] = logits[4, 100]  # many ties, across the candidates' boundary
    logits[8] = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.01  # flat: the nucleus is wide
    params = [BATCH_SETTINGS[i % len(BATCH_SETTINGS)] for i in range(len(logits))]
    got = sampling.processed_probs_rows(logits.float(), sampling.RowSampling.of(params, vocab))
    for i, p in enumerate(params):
        want = processed_probs(logits[i : i + 1].float(), p)
        assert torch.equal(got[i : i + 1], want), (i, p)


def test_the_device_nucleus_keeps_the_hosts_ids(monkeypatch):
    """The nucleus without a host read (_nucleus_rows' device path: every row's whole vocabulary
    ranked, kept where the candidates cannot decide) keeps bitwise the ids the host path keeps
    (which reads the undecided rows back and ranks those alone): random rows, rows whose mass
    sits below top_p within the candidates (flat ones), ties across the last candidate, equal
    rows, top_p 1 beside tiny ones; rows in sorts of 3 (NUCLEUS_SORT_ROWS), the last one short."""
    monkeypatch.setattr(sampling, "NUCLEUS_SORT_ROWS", 3)
    vocab = 2000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(11, vocab, generator=g, dtype=torch.float64) * 3
    logits[1] = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.01  # flat: the nucleus is wide
    logits[2] = 0.5  # every probability equal
    logits[3, 50:1500] = logits[3].max()  # ties across the candidates' boundary, at the top
    logits[4, :] = logits[4].round()  # many ties everywhere
    logits[5] = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.3  # wide, below top_p within 1024
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.3, 0.99, 0.97, 1.0, 1e-9, 0.6, 0.999, 0.7], dtype=torch.float64)
    k = sampling.NUCLEUS_CANDIDATES
    assert (probs.topk(k, dim=-1).values.sum(-1) < top_p).sum() >= 3  # undecided by the candidates
    host = sampling._nucleus_rows(probs, top_p, on_device=False)
    device = sampling._nucleus_rows(probs, top_p, on_device=True)
    assert torch.equal(device, host)
    for i in range(len(probs)):  # and each is the one-request rule's nucleus
        assert torch.equal(host[i] > 0, sampling._nucleus(probs[i : i + 1], float(top_p[i]))[0] > 0), i


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_steps_seeded_nodes_are_drawn_at_once(monkeypatch, packed):
    """The step's choice drew each seeded row's nodes in a Python loop over rows, with host reads
    per row. Now every seeded node of a step is processed and drawn in one call (padded [B, K]
    logits, or a packed step's real rows), and each node still gets the rule's token for its own
    request: kernels.sampling.choose_tokens of that request's seed at that node's position."""
    from ddtree.workers import model as target_model
    from ddtree.workers.model import Packing, SingleProcess

    draws = []
    real_draw = target_model.sampled_choices
    monkeypatch.setattr(target_model, "sampled_choices", lambda *a: draws.append(a[0].shape) or real_draw(*a))
    b, q, vocab = 5, 4, 300
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, q, vocab, generator=g, dtype=torch.float64) * 3
    rules = [BATCH_SETTINGS[1], SamplingParams(), BATCH_SETTINGS[2], BATCH_SETTINGS[0], SamplingParams(temperature=0.9, top_k=1)]
    seeds = [11, None, 2**62 + 5, 7, None]
    positions = torch.arange(b * q).view(b, q) + 30
    rows = torch.tensor([4, 2, 1, 3, 4])
    packing = Packing.of(rows, q) if packed else None
    flat_logits = packing.pack(logits) if packed else logits
    got = SingleProcess().choose_rows(flat_logits, rules, seeds, positions, packing)
    assert len(draws) == 1, f"{len(draws)} draw calls for one step"
    for r, rule in enumerate(rules):
        n = int(rows[r]) if packed else q
        want = sampling.choose_tokens(logits[r, :n], rule, seeds[r], positions[r, :n].tolist())
        assert got[r, :n].tolist() == want.tolist(), r


# --- lossless, seeded -----------------------------------------------------------------------

SETTINGS = {
    "T1": SamplingParams(temperature=1.0),
    "filtered": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
}
BUDGETS = [0, "chain", 4, 16, 33]
MAX_TOKENS = 24


@torch.no_grad()
def plain_seeded_sampling(hf, prompt, params: SamplingParams, n: int) -> list[int]:
    """The target alone (transformers, full recompute): the token at position t is the inverse-CDF
    draw of u(seed, t) from the processed distribution there."""
    ids = list(prompt)
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1:]
        u = torch.tensor([uniform(params.seed, len(ids))], dtype=torch.float64)
        ids.append(int(inverse_cdf(processed_probs(logits, params), u)[0]))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def sampled_cases(tiny_checkpoint):
    cache = {}

    def get(vocab, block, setting, seed):
        key = (vocab, setting, seed)
        if key not in cache:
            hf, target, _ = tiny_checkpoint("llama", vocab)
            prompt = torch.randint(0, vocab, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
            params = SETTINGS[setting].model_copy(update={"seed": 1000 + seed})
            cache[key] = (hf, target, prompt, params, plain_seeded_sampling(hf, prompt, params, MAX_TOKENS + 2 * block))
        return cache[key]

    return get


@pytest.mark.parametrize("vocab,block", [(97, 8), (4, 4)], ids=["vocab97", "vocab4-dry-heap"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", range(10))
def test_seeded_output_equals_plain_seeded_sampling(sampled_cases, vocab, block, setting, seed):
    """20 seeds (10 per setting) x budgets {0, chain, 4, 16, 33} x drafters {perfect, noisy,
    untrained}: the tokens are plain seeded sampling's tokens."""
    hf, target, prompt, params, reference = sampled_cases(vocab, block, setting, seed)
    drafters = {
        "perfect": OracleDrafter(prompt + reference, vocab, block, accuracy=1.0),
        "noisy": OracleDrafter(prompt + reference, vocab, block, accuracy=0.5, seed=seed),
        "untrained": DFlashDrafter.untrained(target, block_size=block, seed=seed),
    }
    request = Request(prompt, MAX_TOKENS, sampling=params)
    for (name, drafter), budget in itertools.product(drafters.items(), BUDGETS):
        result = SoloLoop.local(target, drafter, budget).generate([request])[0]
        assert result.tokens == reference[:MAX_TOKENS], (name, budget)
        assert result.seed == params.seed
        if name == "perfect" and budget not in (0, 4):
            assert all(r.accepted == block - 1 for r in result.rounds[:-1]), "whole blocks accepted"


def test_unseeded_request_reports_a_seed_that_reproduces_it(tiny_checkpoint):
    _, target, _ = tiny_checkpoint("llama")
    drafter = DFlashDrafter.untrained(target, block_size=4)
    request = Request([1, 2, 3], 20, sampling=SamplingParams(temperature=1.0))
    first = SoloLoop.local(target, drafter, 16).generate([request])[0]
    assert first.seed is not None
    again = Request([1, 2, 3], 20, sampling=SamplingParams(temperature=1.0, seed=first.seed))
    assert SoloLoop.local(target).generate([again])[0].tokens == first.tokens
    other = SoloLoop.local(target, drafter, 16).generate([request])[0]
    assert other.seed != first.seed


def test_temperature_zero_ignores_the_seed_and_top_k_1_is_greedy(tiny_checkpoint):
    _, target, _ = tiny_checkpoint("llama")
    drafter = DFlashDrafter.untrained(target, block_size=4)
    greedy = SoloLoop.local(target).generate([Request([5, 6, 7], 30)])[0].tokens
    for params in (
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=0.0, seed=2),
        SamplingParams(temperature=1.3, top_k=1, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-9, seed=4),
    ):
        for budget in (0, 16):
            result = SoloLoop.local(target, drafter, budget).generate([Request([5, 6, 7], 30, sampling=params)])[0]
            assert result.tokens == greedy, params
    assert SoloLoop.local(target).generate([Request([5, 6, 7], 3, sampling=SamplingParams(seed=9))])[0].seed is None


# --- distribution ---------------------------------------------------------------------------

VOCAB, DRAWS, FIRST, WORKERS = 6, 20_000, 3, 2


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    hf = make_hf_model("llama", vocab=VOCAB, layers=1, seed=3, logit_scale=30.0)
    directory = tmp_path_factory.mktemp("vocab6")
    hf.save_pretrained(directory)
    return hf, load_target_weights(directory, torch.float64)


@torch.no_grad()
def exact_first_tokens(hf, prompt) -> dict[tuple[int, ...], float]:
    """P(first three tokens) under the target, by enumeration with transformers' model."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=FIRST):
        ids = torch.tensor([prompt + list(seq)])
        logp = torch.log_softmax(hf(ids).logits[0].double(), -1)
        out[seq] = math.exp(sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq)))
    return out


def chi_square_p(counts: dict, expected: dict, total: int) -> float:
    """Pearson's test; bins with fewer than 5 expected draws are pooled."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0.0, 0.0, 0
    for key, p in expected.items():
        e, o = p * total, counts.get(key, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    dof = bins - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def empirical_first_tokens(target, budget: int) -> dict:
    """Counts of the first FIRST tokens over DRAWS unseeded requests, drawn by two forked
    processes (one per core; each request is tiny, so one torch thread each). The fork carries
    the target and any patched draw function; the draws' seeds come from os.urandom."""
    global _JOB
    _JOB = (target, budget)
    with multiprocessing.get_context("fork").Pool(WORKERS) as pool:
        parts = pool.map(_draw, [DRAWS // WORKERS] * WORKERS)
    counts: dict = {}
    for part in parts:
        for key, n in part.items():
            counts[key] = counts.get(key, 0) + n
    return counts


_JOB = None


def _draw(n: int) -> dict:
    torch.set_num_threads(1)
    target, budget = _JOB
    drafter = DFlashDrafter.untrained(target, block_size=4, seed=1) if budget else None
    solo = SoloLoop.local(target, drafter, budget)
    request = Request([1, 4, 2], FIRST, sampling=SamplingParams(temperature=1.0))
    counts: dict = {}
    for _ in range(n):
        key = tuple(solo.generate([request])[0].tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 16])
def test_unseeded_sampling_follows_the_target_distribution(small_vocab_target, budget):
    hf, target = small_vocab_target
    expected = exact_first_tokens(hf, [1, 4, 2])
    p = chi_square_p(empirical_first_tokens(target, budget), expected, DRAWS)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


@pytest.mark.slow
def test_the_distribution_check_catches_a_small_bias(small_vocab_target, monkeypatch):
    """The same check, with draws skewed slightly towards low token ids (u -> u ** 1.1), fails:
    the chi-square test has the power to see a sampler bug of that size."""
    hf, target = small_vocab_target
    fair = sampling.uniform
    monkeypatch.setattr(sampling, "uniform", lambda seed, pos: fair(seed, pos) ** 1.1)
    expected = exact_first_tokens(hf, [1, 4, 2])
    p = chi_square_p(empirical_first_tokens(target, 0), expected, DRAWS)
    assert p < 1e-3, f"a biased sampler went unnoticed (p = {p:.2e})"
