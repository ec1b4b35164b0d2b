"""`ddtree bench` bookkeeping on a tiny model (never its timings)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from ddtree.bench import json_rows, markdown, plot, read_prompts, run_bench
from ddtree.config import ModelPairConfig
from ddtree.engine import Engine

from .helpers import hf_greedy

PROMPTS = ["Tell me about trees.", "What is a cache?", "Count to five."]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def bench_rows(tiny_chat_model):
    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4, dtype="float64"))
    return run_bench(engine, PROMPTS, [0, "chain", 4], max_tokens=MAX_TOKENS, peers=True, lookup=True)


@pytest.fixture(scope="module")
def greedy_reference(tiny_chat_model):
    """The target's own plain greedy decoding of each bench prompt, by the transformers model
    recomputing every step (no ddtree model code, cache, loop or bench), cut after EOS."""
    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4))
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype="float64").eval()
    out = []
    for text in PROMPTS:
        tokens = hf_greedy(hf, engine.render_chat([{"role": "user", "content": text}]), MAX_TOKENS)
        ends = [i for i, t in enumerate(tokens) if t in engine.eos_token_ids]
        out.append(tokens[: ends[0] + 1] if ends else tokens)
    return out


def test_a_row_for_every_setting(bench_rows):
    assert [(r.mode, r.budget) for r in bench_rows] == [
        ("ddtree", 0), ("ddtree", "chain"), ("ddtree", 4), ("ddtree-lookup", 4), ("hf-generate", None),
        ("hf-prompt-lookup", None)
    ]
    assert bench_rows[3].label == "ddtree budget 4 + lookup"


def test_every_setting_generates_the_targets_greedy_tokens(bench_rows, greedy_reference):
    """Lossless: every ddtree budget and transformers' own generate emit, prompt by prompt, the
    tokens of plain greedy decoding; `tokens` counts them."""
    for row in bench_rows:
        assert row.outputs == greedy_reference, row.label
        assert row.tokens == sum(len(t) for t in greedy_reference), row.label


def test_tau_counts_round_tokens_per_round(accepting_model):
    """A hand-countable case. The accepting model's target and drafter both always pick token 0,
    so a chain round of block 4 accepts 3 drafts plus the bonus: 4 tokens. With 13 new tokens,
    the prefill gives the first, then 3 chain rounds give 12 (tau 4), or 12 plain rounds give
    one each (tau 1). Two prompts: twice the tokens and rounds, the same tau."""
    engine = Engine.from_config(ModelPairConfig(model=str(accepting_model), budget=0, block_size=4))
    plain, chain = run_bench(engine, PROMPTS[:2], [0, "chain"], max_tokens=13, peers=False)
    assert plain.outputs == chain.outputs == [[0] * 13] * 2
    assert (plain.tokens, plain.round_tokens, plain.rounds, plain.tau) == (26, 24, 24, 1.0)
    assert (chain.tokens, chain.round_tokens, chain.rounds, chain.tau) == (26, 24, 6, 4.0)


def test_ratios_are_relative_to_budget_0_and_hf_generate(bench_rows):
    """Each reference scores exactly 1 against itself, and every row is measured against the
    same two references: its two ratios differ by one factor, hf-generate's speed over budget 0's."""
    ar, hf = bench_rows[0], bench_rows[4]
    assert ar.speedup_vs_ar == 1.0 and hf.speedup_vs_hf == 1.0
    for row in bench_rows:
        assert row.speedup_vs_ar == pytest.approx(row.speedup_vs_hf * hf.speedup_vs_ar), row.label


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
