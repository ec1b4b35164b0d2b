"""The soak's short version: 2.5 minutes of benchmarks/soak.py's mixed load (greedy and seeded,
budgets 0/chain/16/auto, lookup on and off, cancelled streams, clients that give up, over-limit
and malformed requests) against a real Serve app of the tiny chat model on 127.0.0.1. The
30-minute figures on SmolLM2 are in benchmarks/RESULTS.md."""

from __future__ import annotations

import asyncio

import pytest

from .helpers import benchmark_script

pytestmark = pytest.mark.slow  # a Serve app under minutes of load (make test runs it)

MINUTES = 2.5


@pytest.fixture(scope="module")
def soak_app(server, tiny_chat_model):
    from ray import serve

    from ddtree.serve.app import build_app

    soak = benchmark_script("soak")
    # the tiny model's context is 256 tokens: prompts up to 160, completions up to 80 (soak's longest)
    limits = {**soak.LIMITS, "max_prompt_tokens": 160}
    config = {"model": str(tiny_chat_model), "model_name": "soak", "budget": 16, "block_size": 4,
              "engine_num_cpus": 0, **limits}
    serve.run(build_app(config), name="soak", route_prefix="/soak")
    yield soak, server["base"] + "/soak", limits
    serve.delete("soak")


def test_a_soak_of_mixed_load_loses_nothing_and_returns_every_page(soak_app):
    """No 5xx, no error event, no truncated stream, every over-limit request a 4xx, every output
    equal to every other of its prompt and sampling whatever its budget, lookup or batch (a
    cancelled stream's text a prefix of it), and once the load stops every KV page back in the
    pool: a leak of pages, state or a request's tokens into another shows here."""
    soak, base, limits = soak_app
    prompts = [p[:200] for p in soak.mixed_prompts(per_file=3)]
    figures, outcomes, samples = asyncio.run(soak.soak(
        base, "soak", "soak", prompts, [0, "chain", 16, "auto"], limits, minutes=MINUTES, concurrency=4,
        seed=7, sample_s=10, window=1, progress=False))
    summary = {k: v for k, v in figures.items() if k != "per_minute"}
    assert figures["ok"], summary
    # the mix ran: every kind of request, and outputs that had others to agree with
    assert set(figures["by_kind"]) == set(soak.MIX), summary
    assert min(figures["by_kind"].values()) >= 3, summary
    assert figures["compared_outputs"] >= 10, summary
    assert figures["over_limit_answered"] == figures["by_kind"]["over"], summary
    assert not figures["refused_other"], summary  # every request of the mix fits the limits
    assert any(o.kind == "cancel" and o.status == 200 and not o.done for o in outcomes), summary
    assert len(samples) >= 10 and all(s.engine_rss_mb > 0 for s in samples), summary
    print(f"soak {MINUTES} min: {figures['requests']} requests, engine RSS {figures['engine_rss_mb_first']:.0f} -> "
          f"{figures['engine_rss_mb_last']:.0f} MB ({figures['engine_rss_slope_mb_per_hour']:+.0f} MB/hour), "
          f"p99 gap {figures['p99_gap_first_s']} -> {figures['p99_gap_last_s']} s")
