"""The real Serve app on 127.0.0.1, driven by the official `openai` client.

A local Ray cluster, the ddtree application built by `build_app` from a ServeConfig, and a tiny
random llama that uses SmolLM2's tokenizer and chat template (so the chat path is the real one).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch
import yaml

from ddtree.config import ModelPairConfig, SamplingParams
from ddtree.engine import Engine
from ddtree.serve.app import build_app
from ddtree.serve.config import ServeConfig
from ddtree.workers.model import kernel_backends

from .helpers import CHAT_SAMPLE, CONTEXT, MODEL

pytestmark = pytest.mark.slow  # a Ray cluster and Serve apps: minutes on 2 cores (make test runs it)

@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def in_process(tiny_chat_model):
    return Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=16, block_size=4))


CHAT = CHAT_SAMPLE


def test_health_and_models(server, client):
    """/health's details say which backends run the replica's linears and attention: the tiny
    fp32 model on the CPU runs ddtree's bitwise kernels where they are built (conftest builds
    them, as `make install` does), the float64 app the torch fallback, and says why; and that
    the CPU replica captured no CUDA graphs (`cuda_graphs: auto`)."""
    health = httpx.get(server["base"] + "/health")
    assert health.status_code == 200
    assert health.json()["details"]["kernels"] == kernel_backends(torch.float32, "cpu").as_dict()
    assert health.json()["details"]["cuda_graphs"] is None
    sharded = httpx.get(server["base"] + "/sharded/health").json()["details"]["kernels"]
    assert sharded["bitwise"] is False and sharded["linear"] == "torch" and "float64" in sharded["reason"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_greedy_chat_equals_the_in_process_engine(client, in_process):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    expected = in_process.generate(
        [in_process.request(in_process.render_chat(CHAT), 24, SamplingParams())]
    )[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    usage = reply.usage.model_dump()
    assert usage["completion_tokens"] == len(expected.tokens)
    assert usage["prompt_tokens"] == len(in_process.render_chat(CHAT))
    spec = usage["speculation"]
    assert spec["budget"] == 16 and spec["rounds"] == len(expected.rounds)
    assert spec["tau"] == pytest.approx(expected.tau, abs=1e-3)


def test_streaming_chat_equals_non_streaming(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_completions_streaming_and_not(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 16
    assert whole.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_max_tokens_and_stop_strings(client):
    kwargs = dict(model=MODEL, messages=CHAT, temperature=0)
    long = client.chat.completions.create(max_tokens=30, **kwargs)
    assert long.usage.completion_tokens == 30 and long.choices[0].finish_reason == "length"
    text = long.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.chat.completions.create(max_completion_tokens=30, stop=[stop], **kwargs)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        max_tokens=30, stop=stop, stream=True, **kwargs) if c.choices)
    assert streamed == cut.choices[0].message.content, "no part of the stop string is streamed"


def test_seed_reproduces_sampled_output(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=7, **kwargs)
    b = client.chat.completions.create(seed=7, **kwargs)
    c = client.chat.completions.create(seed=8, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert c.choices[0].message.content != a.choices[0].message.content
    unseeded = client.chat.completions.create(**kwargs).model_dump()
    again = client.chat.completions.create(seed=unseeded["seed"], **kwargs)
    assert again.choices[0].message.content == unseeded["choices"][0]["message"]["content"]


def test_speculation_override_per_request(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    plain = client.chat.completions.create(extra_body={"speculation": {"budget": 0}}, **kwargs)
    chain = client.chat.completions.create(extra_body={"speculation": {"budget": "chain"}}, **kwargs)
    auto = client.chat.completions.create(extra_body={"speculation": {"budget": "auto"}}, **kwargs)
    default = client.chat.completions.create(**kwargs)
    spec = plain.usage.model_dump()["speculation"]
    assert spec["budget"] == 0 and spec["tau"] == 1.0 and spec["drafted_tokens"] == 0
    assert chain.usage.model_dump()["speculation"]["budget"] == "chain"
    assert auto.usage.model_dump()["speculation"]["budget"] == "auto"
    texts = {r.choices[0].message.content for r in (plain, chain, auto, default)}
    assert len(texts) == 1, texts


def test_lookup_branches_per_request_on_the_accepting_model(server):
    """speculation.lookup turns lookup branches on for one request. On the accepting model the
    output is all token 0, so once two tokens are out the context's last n-gram recurs and the
    branch proposes 0s -- the drafter's own top-1 -- and usage says the accepted tokens came from
    both sources; without lookup they are the drafter's alone. A non-boolean is a 400 naming it."""
    accepting = openai.OpenAI(base_url=server["base"] + "/accepting/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="accepting", messages=CHAT, max_tokens=24, temperature=0)
    on = accepting.chat.completions.create(extra_body={"speculation": {"budget": 8, "lookup": True}}, **kwargs)
    off = accepting.chat.completions.create(extra_body={"speculation": {"budget": 8, "lookup": False}}, **kwargs)
    assert on.choices[0].message.content == off.choices[0].message.content
    spec_on, spec_off = on.usage.model_dump()["speculation"], off.usage.model_dump()["speculation"]
    assert spec_on["lookup"] is True and spec_off["lookup"] is False
    for spec in (spec_on, spec_off):
        assert sum(spec["accepted_tokens_by_source"].values()) == spec["accepted_tokens"] > 0
    assert spec_on["accepted_tokens_by_source"]["both"] > 0
    assert spec_off["accepted_tokens_by_source"] == {"drafter": spec_off["accepted_tokens"], "lookup": 0, "both": 0}
    r = httpx.post(server["base"] + "/accepting/v1/chat/completions", timeout=120,
                   json={**kwargs, "speculation": {"lookup": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.lookup", r.text


def test_topk_per_request_on_the_accepting_model(server):
    """speculation.topk bounds a node's children whatever the budget: budget 16 with topk 1 (lookup off) runs
    the accepting drafter's chain padded to 17 rows and accepts it; the text is the plain one and
    usage says the topk it ran with. A topk below 1 is a 400 naming it."""
    accepting = openai.OpenAI(base_url=server["base"] + "/accepting/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="accepting", messages=CHAT, max_tokens=24, temperature=0)
    chain = accepting.chat.completions.create(extra_body={"speculation": {"budget": 16, "topk": 1, "lookup": False}},
                                              **kwargs)
    plain = accepting.chat.completions.create(extra_body={"speculation": {"budget": 0}}, **kwargs)
    assert chain.choices[0].message.content == plain.choices[0].message.content
    spec = chain.usage.model_dump()["speculation"]
    assert spec["topk"] == 1 and spec["budget"] == 16 and spec["accepted_tokens"] > 0
    assert spec["drafted_tokens"] <= spec["rounds"] * 3  # a chain: one node per drafted depth (block 4) at most
    for bad in (0, "one"):
        r = httpx.post(server["base"] + "/accepting/v1/chat/completions", timeout=120,
                       json={**kwargs, "speculation": {"budget": 16, "topk": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.topk", r.text


BAD_REQUESTS = [
    ({"temperature": -0.5}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"messages": []}, 400, "messages"),
    ({"n": 2}, 400, "n"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": CONTEXT}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "tree " * CONTEXT}]}, 400, "messages"),
    ({"speculation": {"budget": -1}}, 400, "speculation.budget"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"return_token_ids": True, "stream": True}, 400, "return_token_ids"),
]


@pytest.mark.parametrize("change,status,param", BAD_REQUESTS, ids=[p for _, _, p in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, change, status, param):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **change}
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert "Traceback" not in r.text
    standard = {k: v for k, v in body.items() if k not in ("speculation", "return_token_ids")}
    extra = {k: body[k] for k in ("speculation", "return_token_ids") if k in body} or None  # ddtree's own
    with pytest.raises(openai.APIStatusError) as raised:  # the official client sees the same
        client.chat.completions.create(**standard, extra_body=extra)
    assert raised.value.status_code == status
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_invalid_json_body(server):
    r = httpx.post(server["base"] + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_metrics_reach_prometheus_endpoint(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    accepting = openai.OpenAI(base_url=server["base"] + "/accepting/v1", api_key="unused", max_retries=0)
    reply = accepting.chat.completions.create(
        model="accepting", messages=CHAT, max_tokens=13, temperature=0, extra_body={"speculation": {"budget": "chain"}})
    assert reply.usage.model_dump()["speculation"]["tau"] == 4.0, "the whole block of 4 every round"
    accepting.chat.completions.create(
        model="accepting", messages=CHAT, max_tokens=13, temperature=0, extra_body={"speculation": {"budget": "auto"}})
    wanted = [
        "ray_ddtree_granted_budget_bucket", "ray_ddtree_policy_predicted_accepted_sum",
        "ray_ddtree_policy_accepted_sum",
        "ray_ddtree_drafted_tokens_total", "ray_ddtree_accepted_tokens_total",
        "ray_ddtree_accepted_length_bucket", "ray_ddtree_time_to_first_token_seconds_bucket",
        "ray_ddtree_inter_token_latency_seconds_bucket", "ray_ddtree_round_phase_seconds_bucket",
        "ray_ddtree_requests_running", "ray_ddtree_requests_queued", "ray_ddtree_output_tokens_total",
        "ray_ddtree_accepted_tokens_by_source_total", "ray_ddtree_policy_probes_total",
        "ray_ddtree_policy_recalibrations", "ray_ddtree_kernel_backend_info",
        "ray_ddtree_cuda_graphs_captured", "ray_ddtree_cuda_graphs_capture_seconds",
        "ray_ddtree_cuda_graphs_memory_bytes", "ray_ddtree_cuda_graphs_eager_steps",
    ]
    deadline, text = time.time() + 90, ""
    while time.time() < deadline:
        text = httpx.get(server["metrics"], timeout=10).text
        if all(name in text for name in wanted):
            break
        time.sleep(3)
    missing = [name for name in wanted if name not in text]
    exported = sorted({line.split("{")[0] for line in text.splitlines() if "ddtree" in line and not line.startswith("#")})
    assert not missing, f"not exported: {missing}; exported: {exported}"
    assert 'depth="1"' in text and 'phase="verify"' in text
    # which backends run the engine, minutes after start-up: set once at start-up, the gauge had
    # left Ray's endpoint (its agent keeps a value two report intervals) before the first scrape
    backends = kernel_backends(torch.float32, "cpu")
    info = [line for line in text.splitlines() if line.startswith("ray_ddtree_kernel_backend_info{")
            and f'model="{MODEL}"' in line]
    assert info and all(f'linear="{backends.linear}"' in line and f'attention="{backends.attention}"' in line
                        and float(line.rsplit(" ", 1)[1]) == 1 for line in info), info


def test_serve_config_file_builds_the_app():
    """cluster/serve-config.yaml: its args are a valid ServeConfig, and the app the builder makes
    of them is the ingress in front of an engine deployment that holds the YAML's batch plus its
    queue and scales as the YAML says."""
    from pathlib import Path

    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "cluster" / "serve-config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(raw)
    app = schema.applications[0]
    assert app.import_path == "ddtree.serve.app:build_app"
    ServeConfig.model_validate(app.args)
    ingress = build_app(app.args)._bound_deployment  # a Serve Application keeps its deployment there
    engine = ingress.init_args[1]._bound_deployment
    assert (ingress.name, engine.name) == ("OpenAIIngress", "DDTreeEngine")
    assert engine.init_args[0]["block_size"] == app.args["block_size"]
    assert engine.max_ongoing_requests == app.args["max_num_seqs"] + app.args["max_waiting"]
    scaling = engine._deployment_config.autoscaling_config
    assert scaling.model_dump(include=set(app.args["autoscaling"])) == app.args["autoscaling"]


def test_a_tp2_app_serves_what_the_in_process_engine_decodes(server, tiny_chat_model):
    """`tp: 2` in the application's args: its engine replica places a Coordinator, a Drafter and
    two TargetShard actors in a placement group. float64, so the streamed text equals the
    in-process engine's exactly."""
    sharded = openai.OpenAI(base_url=server["base"] + "/sharded/v1", api_key="unused", max_retries=0, timeout=120)
    engine = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=16, block_size=4, dtype="float64"))
    expected = engine.generate([engine.request(engine.render_chat(CHAT), 16, SamplingParams())])[0]
    chunks = sharded.chat.completions.create(model="sharded", messages=CHAT, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text


def test_audit_of_a_running_server(server, tiny_chat_model, tmp_path):
    """`ddtree audit --url`: the server's outputs (non-streamed, with `return_token_ids`; a
    setting's streams as concurrent requests) against the target's plain decoding here. The
    server of the tiny model passes; the accepting app (the same tokenizer, a zero LM head) audited
    against the tiny model's decoding is caught: exit 1, its differences real."""
    from ddtree.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Count to five.", "Name a colour.")))
    grid = ["--prompts", str(prompts), "--max-tokens", "6", "--budgets", "0,16", "--sampling", "greedy,seeded",
            "--streams", "1,2", "--model", str(tiny_chat_model)]
    out = tmp_path / "served.json"
    assert main(["audit", *grid, "--url", server["base"], "--json", str(out)]) == 0, out.read_text()
    summary = json.loads(out.read_text())
    assert summary["audited"] == server["base"] + "/v1"
    assert summary["compared"] == 2 * 8 and summary["real"] == 0

    out = tmp_path / "accepting.json"
    assert main(["audit", *grid, "--sampling", "greedy", "--url", server["base"] + "/accepting",
                 "--json", str(out)]) == 1
    summary = json.loads(out.read_text())
    assert summary["compared"] == 2 * 4 and summary["real"] >= 1


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="tp"):
        ServeConfig(tp=0)
    with pytest.raises(ValueError, match="min_replicas"):
        ServeConfig(autoscaling={"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValueError, match="upscale_dealy_s"):  # Ray's own model would drop it unseen
        ServeConfig(autoscaling={"upscale_dealy_s": 5})
