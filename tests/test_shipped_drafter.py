"""The drafter shipped for SmolLM2-135M-Instruct: it loads in the published format with its draft
vocabulary, and it still accepts what its model card says it does.

`eval.json` beside the weights records the held-out tau that `ddtree eval-drafter` measured
when the drafter was exported (first 5 prompts of gsm8k-test, 128 new tokens, greedy). Re-running
that evaluation here must land within 10% of it: a drafter that silently stopped matching its
target -- wrong feature layers, a broken draft vocabulary, a changed model path -- drops far
below, while tau itself can move a little with fp32 summation order between machines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree.bench import read_prompts
from ddtree.engine import shipped_drafter
from ddtree.training.evaluate import eval_drafter
from ddtree.workers.drafter import DFlashDrafter

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "gsm8k-test.jsonl"


def recorded() -> dict:
    return json.loads((shipped_drafter() / "eval.json").read_text())["gsm8k-test-5"]


def test_the_shipped_drafter_has_a_draft_vocabulary_and_a_record():
    directory = shipped_drafter()
    assert directory is not None, "the package ships a drafter for its default target"
    config = json.loads((directory / "config.json").read_text())
    assert 0 < config["dflash_config"]["draft_vocab_size"] < config["vocab_size"]
    record = recorded()
    assert record["prompts"] == 5 and record["max_tokens"] == 128 and set(record["tau"]) >= {"chain", "16"}


@pytest.mark.smollm2
def test_the_shipped_drafter_reproduces_its_recorded_tau(smollm2):
    record = recorded()
    drafter = DFlashDrafter.load(shipped_drafter(), smollm2.model)
    assert drafter.draft_vocab is not None and drafter.draft_vocab.dtype == torch.int64
    budgets = ["chain", 16]
    report = eval_drafter(smollm2, drafter, read_prompts(str(DATA), record["prompts"]), record["max_tokens"], budgets)
    print("measured", report["tau"], "recorded", record["tau"])
    for budget in budgets:
        assert report["tau"][str(budget)] == pytest.approx(record["tau"][str(budget)], rel=0.10), budget
