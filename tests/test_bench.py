"""`ddtree bench` bookkeeping on a tiny model (never its timings)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from ddtree.bench import json_rows, markdown, plot, read_prompts, run_bench
from ddtree.config import ModelPairConfig
from ddtree.engine import Engine

from .helpers import benchmark_script, hf_greedy

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


def test_a_pass_is_sliced_into_runs_long_enough_for_its_streams():
    """The host's speed drifts by a quarter within a minute, so benchmarks/budget_policy.py runs
    every budget's slice of a pass before any budget's next slice. A slice too short for its
    streams would be all drain (a closed loop's last, shrinking batches), so each holds at least
    3 x streams requests, and the slices cover the pass's requests exactly once, in order."""
    slices = benchmark_script("budget_policy").slices
    assert slices(12, 1, 4) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert slices(12, 4, 4) == [(0, 12)]  # 12 requests at 4 streams: too few to cut
    assert slices(64, 16, 4) == [(0, 64)]
    for requests, streams, k in ((13, 1, 4), (100, 4, 7), (50, 2, 3)):
        cuts = slices(requests, streams, k)
        assert [lo for lo, _ in cuts] == [0] + [hi for _, hi in cuts[:-1]] and cuts[-1][1] == requests
        assert len(cuts) <= k and all(hi - lo >= 3 * streams for lo, hi in cuts)


def test_a_race_keeps_auto_plain_and_the_close_budgets():
    """--race r drops a fixed budget whose tokens/s so far is under r x the best fixed one's; auto
    and plain decoding always run on (plain is what auto must never lose to)."""
    from ddtree.load_bench import LoadRow

    def row(budget, tokens):
        r = LoadRow(budget, 4)
        r.tokens, r.seconds = tokens, 10.0
        return r

    rows = {"auto": row("auto", 100), 0: row(0, 50), 4: row(4, 100), 8: row(8, 81), "chain": row("chain", 79)}
    assert benchmark_script("budget_policy").raced(list(rows), rows, 0.8) == ["auto", 0, 4, 8]


def test_the_whole_run_prices_every_concurrencys_tokens_at_each_budgets_own_rate():
    """One fixed budget for every load against the policy: each budget's seconds for the tokens
    auto emitted at each concurrency, at that budget's tokens/s there. Here budget 4 is twice
    auto's speed at 1 stream and half at 64: 50 + 400 seconds against auto's 100 + 200."""
    from ddtree.load_bench import LoadRow

    def row(budget, streams, tokens, seconds):
        r = LoadRow(budget, streams)
        r.tokens, r.seconds = tokens, seconds
        return r

    tables = [(1, {}, [row("auto", 1, 1000, 100.0), row(4, 1, 500, 25.0)]),
              (64, {}, [row("auto", 64, 4000, 200.0), row(4, 64, 4000, 400.0)])]
    text = benchmark_script("budget_policy").whole_run(tables)
    assert "| auto | 300.0 | 16.7 | 1.00x |" in text
    assert "| 4 | 450.0 | 11.1 | 1.50x |" in text


def test_served_beside_in_process_gives_the_ratio_and_each_sides_scaling():
    """`bench --url --beside-engine`'s table: per cell both aggregate tokens/s, served over in
    process, and each side's tokens/s over its own at the fewest streams (the judged figures:
    served / in process at 1..64 streams, served at 8 streams over 1)."""
    from ddtree.load_bench import LoadRow, ServedBeside, markdown_beside

    def row(streams, tokens):
        r = LoadRow(0, streams, requests=8)
        r.tokens, r.seconds = tokens, 10.0
        return r

    cells = [ServedBeside(row(1, 90), row(1, 100)), ServedBeside(row(8, 450), row(8, 500))]
    assert [c.ratio for c in cells] == [0.9, 0.9]
    text = markdown_beside(cells)
    assert "| 0 | 1 | 8 | 9.0 | 10.0 | 0.90x | 1.00x | 1.00x |" in text
    assert "| 0 | 8 | 8 | 45.0 | 50.0 | 0.90x | 5.00x | 5.00x |" in text
    assert cells[1].summary()["served_over_engine"] == 0.9
