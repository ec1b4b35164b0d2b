"""The loop is lossless: every budget and drafter emits the target's own greedy tokens.

Tiny random float64 targets; the oracle is transformers' own model decoding greedily with a
full recompute per step (no ddtree code involved).
"""

from __future__ import annotations

import pytest
import torch

from ddtree.workers.requests import Request, check_stop
from ddtree.workers.solo import SoloLoop
from ddtree.workers.drafter import DFlashDrafter

from .helpers import hf_greedy
from .drafters import OracleDrafter

BUDGETS = [0, "chain", 1, 3, 8, 16, 33]
# (vocab, block size): 97 makes full trees; 2 with block 4 has only 2 + 4 + 8 = 14 prefixes, so
# the heap runs dry below budgets 16 and 33 and the padded verify path runs.
SHAPES = [(97, 8), (2, 4)]
MAX_TOKENS = 41


def make_drafter(kind: str, target, sequence, vocab: int, block: int):
    if kind == "untrained":
        return DFlashDrafter.untrained(target, block_size=block, seed=7)
    return OracleDrafter(sequence, vocab, block, accuracy={"perfect": 1.0, "noisy": 0.5}[kind])


@pytest.fixture(scope="module")
def cases(tiny_checkpoint):
    """(family, vocab) -> (target, prompt, greedy continuation long enough for the oracles)."""
    made = {}

    def get(family, vocab, block):
        if (family, vocab) not in made:
            hf, target, _ = tiny_checkpoint(family, vocab)
            prompt = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(vocab)).tolist()
            made[family, vocab] = (target, prompt, hf_greedy(hf, prompt, MAX_TOKENS + 2 * block))
        return made[family, vocab]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("vocab,block", SHAPES, ids=["vocab97", "vocab2-dry-heap"])
@pytest.mark.parametrize("kind", ["perfect", "noisy", "untrained"])
@pytest.mark.parametrize("budget", BUDGETS, ids=[str(b) for b in BUDGETS])
def test_greedy_output_equals_plain_decoding(cases, family, vocab, block, kind, budget):
    target, prompt, reference = cases(family, vocab, block)
    drafter = make_drafter(kind, target, prompt + reference, vocab, block)
    request = Request(prompt=prompt, max_tokens=MAX_TOKENS)
    runs = [SoloLoop.local(target, drafter, budget).generate([request])[0] for _ in range(2)]
    assert runs[0].tokens == reference[:MAX_TOKENS]
    assert runs[1].tokens == runs[0].tokens, "repeated runs give identical tokens"
    assert runs[0].finish_reason == "length"
    if budget not in (0, "chain"):
        assert all(r.tree_size <= budget + 1 for r in runs[0].rounds)


@pytest.mark.parametrize("budget", ["chain", 7, 16, 33])
def test_perfect_drafter_accepts_the_whole_block(cases, budget):
    block = 8
    target, prompt, reference = cases("llama", 97, block)
    drafter = OracleDrafter(prompt + reference, 97, block, accuracy=1.0)
    result = SoloLoop.local(target, drafter, budget).generate([Request(prompt, max_tokens=MAX_TOKENS)])[0]
    assert [r.accepted for r in result.rounds] == [block - 1] * 5
    assert result.tau == block


def test_padded_and_unpadded_verify_agree_where_trees_run_dry(cases):
    """Regression for the failure other ports hit: once the tree is smaller than its padded
    budget, padding rows leaked into the walk and garbled greedy output. Here the vocabulary is
    so small that every tree is smaller than the budget, and the padded (static-shape) path
    must give the unpadded path's tokens, which are the target's."""
    vocab, block, budget = 2, 4, 33
    target, prompt, reference = cases("llama", vocab, block)
    drafter = OracleDrafter(prompt + reference, vocab, block, accuracy=0.5)
    request = Request(prompt=prompt, max_tokens=MAX_TOKENS)
    padded = SoloLoop.local(target, drafter, budget, static_shapes=True).generate([request])[0]
    unpadded = SoloLoop.local(target, drafter, budget, static_shapes=False).generate([request])[0]
    assert all(r.tree_size < budget + 1 for r in padded.rounds), "every round ran padded"
    assert padded.tokens == unpadded.tokens == reference[:MAX_TOKENS]


def test_stops_at_eos_and_stop_strings(cases):
    target, prompt, reference = cases("llama", 97, 8)
    drafter = OracleDrafter(prompt + reference, 97, 8, accuracy=0.5)
    eos = reference[10]
    cut = reference.index(eos)
    result = SoloLoop.local(target, drafter, 16).generate([Request(prompt, 40, eos_token_ids=(eos,))])[0]
    assert result.tokens == reference[: cut + 1] and result.finish_reason == "stop"

    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    stop = f" {reference[5]} {reference[6]}"
    result = SoloLoop.local(target, drafter, 16, decode=decode).generate([Request(prompt, 40, stop=(stop,))])[0]
    full = decode(reference[:40])
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    assert decode(result.tokens).startswith(result.text + stop) and len(result.tokens) <= 7


def test_the_text_is_decoded_each_step_only_for_stop_strings():
    """Every step decoded every sequence's whole output for its text, which only the result
    reads: ~2 ms of a 64-stream step. Without stop strings the text now comes once, at the end,
    and is the same."""
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return " ".join(map(str, ids))

    out = [5, 6, 7]
    assert check_stop(Request([1], 10, eos_token_ids=(9,)), out, decode) == (None, None) and calls == []
    out += [8, 9, 4]
    assert check_stop(Request([1], 10, eos_token_ids=(9,)), out, decode) == ("stop", "5 6 7 8 9")
    assert out == [5, 6, 7, 8, 9] and calls == [5]
    assert check_stop(Request([1], 4), [5, 6, 7, 8, 1], decode) == ("length", "5 6 7 8")
    calls.clear()
    assert check_stop(Request([1], 10, stop=("8",)), [5, 6, 7], decode) == (None, "5 6 7") and calls == [3]


def test_rejects_bad_requests(cases):
    target, *_ = cases("llama", 97, 8)
    with pytest.raises(ValueError, match="needs a drafter"):
        SoloLoop.local(target, None, 16)
    with pytest.raises(ValueError, match="prompt is empty"):
        SoloLoop.local(target).generate([Request(prompt=[])])
