"""`ddtree bench` bookkeeping on a tiny model (never its timings)."""

from __future__ import annotations

import json

import pytest

from ddtree.bench import json_rows, markdown, plot, read_prompts, run_bench
from ddtree.config import ModelPairConfig
from ddtree.engine import Engine


@pytest.fixture(scope="module")
def bench_rows(tiny_chat_model):
    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4))
    prompts = ["Tell me about trees.", "What is a cache?", "Count to five."]
    return run_bench(engine, prompts, [0, "chain", 4], max_tokens=10, peers=True)


def test_a_row_for_every_setting(bench_rows):
    assert [(r.mode, r.budget) for r in bench_rows] == [
        ("ddtree", 0), ("ddtree", "chain"), ("ddtree", 4), ("hf-generate", None), ("hf-prompt-lookup", None)
    ]


def test_tau_is_round_tokens_over_rounds(bench_rows):
    for row in bench_rows[:3]:
        assert row.rounds > 0 and row.tau == pytest.approx(row.round_tokens / row.rounds)
        assert row.round_tokens == row.tokens - 3, "every request's first token comes from its prefill"
    assert bench_rows[0].tau == 1.0 and bench_rows[0].verify_cost_ratio == 1.0


def test_every_setting_generates_the_same_greedy_tokens(bench_rows):
    """Lossless, so every ddtree budget and transformers itself emit the same number of tokens."""
    assert len({r.tokens for r in bench_rows}) == 1


def test_ratios_are_relative_to_budget_0_and_hf_generate(bench_rows):
    ar, hf = bench_rows[0], bench_rows[3]
    for row in bench_rows:
        assert row.speedup_vs_ar == pytest.approx(row.tokens_per_s / ar.tokens_per_s)
        assert row.speedup_vs_hf == pytest.approx(row.tokens_per_s / hf.tokens_per_s)


def test_outputs(bench_rows, tmp_path):
    table = markdown(bench_rows).splitlines()
    assert len(table) == 2 + len(bench_rows) and table[0].startswith("| setting | tau | tokens/s")
    rows = json.loads(json.dumps(json_rows(bench_rows)))
    for row in rows:
        assert {"mode", "budget", "tau", "tokens_per_s", "speedup_vs_ar"} <= set(row)
    plot(bench_rows, tmp_path / "bench.png", "test")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_prompts_takes_question_turns_or_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "a"}\n{"turns": ["b", "x"]}\n\n{"prompt": "c"}\n{"prompt": "d"}\n')
    assert read_prompts(path, 3) == ["a", "b", "c"]
    path.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="no question"):
        read_prompts(path, None)
