"""Batching behind the real Serve app: concurrent clients share one step loop and get exactly
what they would alone; a client that leaves frees its sequence; a full engine answers 429.

Apps on the session's Serve instance (127.0.0.1), the official `openai` client and raw httpx.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from ray import serve

from ddtree.serve.app import build_app

from .helpers import CHAT_SAMPLE, MODEL, copy_tokenizer, make_hf_model

pytestmark = pytest.mark.slow  # a Ray cluster and Serve apps: minutes on 2 cores (make test runs it)

WAIT_S = 60  # bound on polling for something that happens within a step or a metrics push


@pytest.fixture(scope="module")
def slow_chat_model(tiny_chat_model, tmp_path_factory):
    """A wider random llama (hidden 512, 20 layers, 1024 positions) with SmolLM2's tokenizer:
    steps slow enough that a 960-token completion is still running when its client goes away.
    (With 10 layers and the AVX-512 GEMMs, a full `make test` once saw all 400 tokens of the
    completion then asked for finish before the hang-up reached the engine: no cancellation
    counted; with 20 layers, once more on the AVX2 machine. A longer completion widens the
    margin without slowing the test: a cancelled one stops at once. With 960 tokens CI saw it
    again: the client hangs up after the role chunk, and a hang-up that reached the engine while
    its stream still stood at the start event cancelled nothing -- the bug that
    test_batching's closed-stream test pins down.)"""
    directory = tmp_path_factory.mktemp("slow-chat")
    hf = make_hf_model("llama", vocab=49152, layers=20, hidden_size=512, intermediate_size=2048,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)
    hf.to(torch.float32).save_pretrained(directory)
    copy_tokenizer(tiny_chat_model, directory)
    return directory


@pytest.fixture(scope="module")
def small_engine(server, slow_chat_model):
    """An engine that runs at most 2 sequences and lets 1 wait."""
    config = {"model": str(slow_chat_model), "model_name": "small-engine", "budget": 0, "block_size": 4,
              "engine_num_cpus": 0, "max_num_seqs": 2, "max_waiting": 1}
    serve.run(build_app(config), name="small-engine", route_prefix="/small")
    yield {"base": server["base"] + "/small", "metrics": server["metrics"],
           "engine": serve.get_deployment_handle("DDTreeEngine", app_name="small-engine")}
    serve.delete("small-engine")


def test_concurrent_clients_get_their_solo_tokens(server):
    """Eight different requests at once (greedy, seeded, budgets 0 / chain / 16) through one
    replica's batch give what each gives alone."""
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    cases = [
        dict(messages=[{"role": "user", "content": f"Question {i}: {'why ' * i}trees?"}], max_tokens=20 + i,
             temperature=0.0 if i % 2 == 0 else 0.9, seed=i, extra_body={"speculation": {"budget": [0, "chain", 16][i % 3]}})
        for i in range(8)
    ]

    def ask(case):
        return client.chat.completions.create(model=MODEL, **case).choices[0].message.content

    alone = [ask(case) for case in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(ask, cases))
    assert together == alone


def _running(metrics_url: str, model: str) -> float | None:
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("ray_ddtree_requests_running{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_until_idle(engine) -> None:
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        stats = engine.batch_stats.remote().result()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return
        time.sleep(0.2)


def test_a_client_that_leaves_frees_its_sequence(small_engine):
    """A streaming client reads one chunk of a 960-token completion and hangs up: the engine
    cancels its sequence (it leaves at the next step; its pages go back) -- the running-requests
    metric returns to 0 and the scheduler counts a cancellation, not a completion."""
    engine = small_engine["engine"]
    before = engine.batch_stats.remote().result()
    body = {"model": "small-engine", "messages": CHAT_SAMPLE, "max_tokens": 960, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", small_engine["base"] + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and "content" in line:
                    break
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        stats = engine.batch_stats.remote().result()
        if stats["running"] == 0 and stats["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.2)
    assert stats["cancelled"] == before["cancelled"] + 1, stats
    assert stats["running"] == 0 and stats["free_pages"] == stats["pages"], stats
    deadline = time.time() + WAIT_S
    while time.time() < deadline and _running(small_engine["metrics"], "small-engine") != 0:
        time.sleep(1)
    assert _running(small_engine["metrics"], "small-engine") == 0


def test_a_full_engine_answers_429_and_keeps_serving(small_engine):
    """Two running and one waiting fill the small engine: the next request is refused at once
    with 429 in OpenAI's error shape, and once the load is gone the engine answers again.
    The refusal comes from the ingress's admission or the engine's queue, whichever is reached
    first: both say "capacity". (If a holding stream happened to finish before the extra
    request arrived, the round is tried again, up to three times.)"""
    url = small_engine["base"] + "/v1/chat/completions"
    body = {"model": "small-engine", "messages": CHAT_SAMPLE, "max_tokens": 200, "temperature": 0}
    refused, seen = None, []
    for _ in range(3):
        with httpx.Client(timeout=120) as http:
            streams = [http.stream("POST", url, json={**body, "stream": True}) for _ in range(3)]
            opened = [s.__enter__() for s in streams]
            try:
                extra = httpx.post(url, json={**body, "max_tokens": 4}, timeout=60)
                seen.append(([r.status_code for r in opened], extra.status_code))
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        if extra.status_code == 429 and all(r.status_code == 200 for r in opened):
            refused = extra
            break
        wait_until_idle(small_engine["engine"])
    assert refused is not None, f"the fourth request was never refused: (holders, extra) statuses {seen}"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and "capacity" in error["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        again = httpx.post(url, json={**body, "max_tokens": 4}, timeout=60)
        if again.status_code == 200:
            break
        time.sleep(0.5)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4, again.text


def test_load_bench_against_a_running_server(server):
    """`ddtree bench --concurrency --url`: closed-loop streams through the official client count
    every completion's tokens and time their first tokens (no figure is judged here)."""
    from ddtree.load_bench import markdown, run_url

    texts = ["Name a tree.", "Name a river.", "Name a mountain."]
    row = run_url(server["base"], MODEL, texts, 0, concurrency=2, requests=3, max_tokens=6)
    assert row.requests == 3 and row.tokens == 18, "every completion ran to max_tokens"
    assert len(row.ttft_s) == 3
    assert "| 0 | 2 | 3 |" in markdown([row])


def test_bench_runs_a_server_beside_its_engine_in_process(server, tmp_path, capsys):
    """`ddtree bench --concurrency --url URL --beside-engine --server-config FILE`: every cell
    runs through the server, then by the same engine (built from the server's config) in this
    process, and the JSON holds both, the same tokens on each side, and their ratio (no figure is
    judged here: the machine is shared)."""
    import json

    import yaml

    from ddtree.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("Name a tree.", "Name a river.", "Name a sea.")))
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump(server["config"]))
    out = tmp_path / "beside.json"
    assert main(["bench", "--prompts", str(prompts), "--concurrency", "1,2", "--budgets", "0,16", "--max-tokens", "6",
                 "--url", server["base"], "--beside-engine", "--server-config", str(config), "--json", str(out)]) == 0
    cells = json.loads(out.read_text())
    assert [(c["budget"], c["concurrency"]) for c in cells] == [(0, 1), (0, 2), (16, 1), (16, 2)]
    for c in cells:
        assert c["served"]["tokens"] == c["engine"]["tokens"] == 18, "3 completions of 6 tokens on each side"
        assert c["served_over_engine"] == pytest.approx(c["served"]["tokens_per_s"] / c["engine"]["tokens_per_s"])
    assert "| 16 | 2 | 3 |" in capsys.readouterr().out
