"""Reliability and security of the real Serve app on 127.0.0.1, probed as an attacker and a crowd
would: raw httpx and the official `openai` client, no mocks.

Beside the test run's `server` app, this module deploys two more from the same tiny chat model:
`guarded` (API keys, small limits, one sequence at a time: the bad-input battery, schemathesis,
401 and 429) and `fragile` (its engine replica is killed mid-stream, then it is drained).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import threading
import time

import httpx
import openai
import pytest

from .helpers import CHAT_SAMPLE, CONTEXT, MODEL

pytestmark = pytest.mark.slow  # a Ray cluster and Serve apps: minutes on 2 cores (make test runs it)

KEYS = ["sk-ddtree-test-one", "sk-ddtree-test-two"]
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
GUARDED_LIMITS = {
    "max_request_bytes": 4096,
    "max_messages": 8,
    "max_prompt_tokens": 64,
    "max_output_tokens": 48,
    "max_budget": 8,
    "default_max_tokens": 4,
    "max_num_seqs": 1,
    "max_waiting": 1,  # admission: 2 generation requests in flight
    "retry_after_s": 2,
}
CHAT = CHAT_SAMPLE


@pytest.fixture(scope="module")
def apps(server, tiny_chat_model):
    from ray import serve

    from ddtree.serve.app import build_app

    base = {"model": str(tiny_chat_model), "budget": 0, "block_size": 4, "engine_num_cpus": 0}
    serve.run(build_app({**base, "model_name": "guarded", "api_key": KEYS, **GUARDED_LIMITS}),
              name="guarded", route_prefix="/guarded")
    serve.run(build_app({**base, "model_name": "fragile"}), name="fragile", route_prefix="/fragile")
    yield {"guarded": server["base"] + "/guarded", "fragile": server["base"] + "/fragile", "ddtree": server["base"]}
    serve.delete("guarded")
    serve.delete("fragile")


def assert_openai_error(response: httpx.Response, status: int | None = None, param: str | None = None):
    """A 4xx (or the given status) whose body is OpenAI's error shape and names no exception."""
    assert 400 <= response.status_code < 500 if status is None else response.status_code == status, (
        response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:  # the parameter, or a part of it (`messages.0.role`)
        assert error["param"] == param or str(error["param"]).startswith(param + "."), error
    for leak in ("Traceback", "Error(", "Exception", "RayTask"):
        assert leak not in response.text, response.text
    return error


def good_request(base: str, headers: dict | None = None):
    """The server still serves: one short chat completion through the official client."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=(headers or {}).get("Authorization", "Bearer x")[7:],
                           max_retries=0, timeout=60)
    model = base.rsplit("/", 1)[-1] if base.endswith(("guarded", "fragile", "gated", "probed")) else MODEL
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, temperature=0)
    assert reply.usage.completion_tokens == 1


# --- the bad-input battery ---------------------------------------------------------------------

GOOD_CHAT = {"model": "guarded", "messages": CHAT, "max_tokens": 2, "temperature": 0}
GOOD_COMPLETION = {"model": "guarded", "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
LONE_SURROGATE = '"a\\ud800b"'  # raw JSON: decodes to a str that no tokenizer can encode

# (field, bad values, expected param): every value is a 400 on both routes, streaming or not
BAD_FIELDS = [
    ("temperature", [-0.5, 2.5, "hot", True, [], {}], "temperature"),
    ("top_p", [0, 1.5, "x", True, -1], "top_p"),
    ("top_k", [-2, 1.5, True, "3", 2**40], "top_k"),
    ("min_p", [-0.1, 1.1, True, "0.1"], "min_p"),
    ("seed", [-1, 1.5, True, "7", 2**64], "seed"),
    ("max_tokens", [0, -1, True, False, 1.5, "8", 10**12, GUARDED_LIMITS["max_output_tokens"] + 1], "max_tokens"),
    ("n", [2, 0, True, "1", 1.0], "n"),
    ("stream", ["yes", 1, "true", 0], "stream"),
    ("stream_options", [{"include_usage": "yes"}, {"include_usage": 1}, "x"], "stream_options"),
    ("stop", [["a", "b", "c", "d", "e"], 123, [1], {"s": 1}], "stop"),
    ("speculation", [{"budget": -1}, {"budget": True}, {"budget": 9}, {"budget": 10**12}, {"budget": "wide"},
                     {"budget": 1.5}, {"budget": "16"}], "speculation.budget"),
    ("speculation", [{"extra": 1}, "chain", 16], "speculation"),  # {"extra": 1}: speculation.extra
    ("model", [5, None, ["guarded"]], "model"),
]
UNSUPPORTED = [
    ("logprobs", True), ("top_logprobs", 3), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("response_format", {"type": "json_object"}), ("logit_bias", {"50": 100}),
    ("presence_penalty", 0.5), ("frequency_penalty", 1), ("functions", [{"name": "f"}]),
    ("function_call", "auto"), ("best_of", 2), ("echo", True), ("suffix", "x"), ("modalities", ["audio"]),
    ("logprobs", 1), ("best_of", True),  # True is not 1
]
BAD_MESSAGES = [
    [], "hi", None, [{"role": "robot", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": "hi"}] * 9,
    [{"role": "user", "content": "tree " * 200}],  # more prompt tokens than max_prompt_tokens
]
BAD_PROMPTS = [[], ["a", "b"], "", 5, [1, 2, 3], None, {"text": "x"}, "tree " * 200]
RAW_BODIES = [  # (body bytes, content type, status)
    (b"{not json", "application/json", 400),
    (b"\xff\xfe\x00", "application/json", 400),
    (b"", "application/json", 400),
    (b"[]", "application/json", 400),
    (b"null", "application/json", 400),
    (b"123", "application/json", 400),
    (b'"just a string"', "application/json", 400),
    (b"[" * 2000 + b"]" * 2000, "application/json", 400),  # nesting past the JSON parser's recursion
    (json.dumps(GOOD_CHAT).encode(), "text/plain", 400),
    (b'{"model": "guarded", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "pad": "'
     + b"x" * 5000 + b'"}', "application/json", 413),
]


def battery() -> list[dict]:
    """>= 120 bad requests, each {route, body | raw, status, param, stream}; seeded, so a failure
    names the same case on every run."""
    rng = random.Random(15)
    cases = []

    def add(route, body=None, status=400, param=None, raw=None, content_type="application/json", method="POST"):
        cases.append({"route": route, "body": body, "raw": raw, "content_type": content_type,
                      "status": status, "param": param, "method": method})

    for field, values, param in BAD_FIELDS:
        for value in values:
            route = rng.choice(["chat", "completion"])
            body = dict(GOOD_CHAT if route == "chat" else GOOD_COMPLETION)
            if field not in ("stream", "stream_options"):
                body["stream"] = rng.random() < 0.5
            if field == "model" and value is None:
                del body["model"]
            else:
                body[field] = value
            add(route, body, param=param)
    for name, value in UNSUPPORTED:
        route = "completion" if name in ("best_of", "echo", "suffix") else rng.choice(["chat", "completion"])
        body = {**(GOOD_CHAT if route == "chat" else GOOD_COMPLETION), name: value, "stream": rng.random() < 0.5}
        add(route, body, param=name)
    for messages in BAD_MESSAGES:
        add("chat", {**GOOD_CHAT, "messages": messages, "stream": rng.random() < 0.5}, param="messages")
    for prompt in BAD_PROMPTS:
        add("completion", {**GOOD_COMPLETION, "prompt": prompt, "stream": rng.random() < 0.5}, param="prompt")
    for stream in (False, True):
        add("chat", {**GOOD_CHAT, "model": "gpt-4o", "stream": stream}, status=404, param="model")
        add("completion", {**GOOD_COMPLETION, "max_tokens": CONTEXT, "stream": stream}, param="max_tokens")
        add("chat", {**GOOD_CHAT, "max_completion_tokens": 0, "stream": stream}, param="max_completion_tokens")
        add("chat", {**GOOD_CHAT, "max_completion_tokens": True, "stream": stream}, param="max_completion_tokens")
        # lone surrogates, raw, wherever text goes
        s = "true" if stream else "false"
        for raw, param in [
            (f'{{"model": "guarded", "messages": [{{"role": "user", "content": {LONE_SURROGATE}}}], "stream": {s}}}', "messages.0.content"),
            (f'{{"model": "guarded", "messages": [{{"role": "user", "content": [{{"type": "text", "text": {LONE_SURROGATE}}}]}}], "stream": {s}}}', "messages.0.content"),
            (f'{{"model": "guarded", "messages": [{{"role": "user", "content": "x"}}], "stop": [{LONE_SURROGATE}], "stream": {s}}}', "stop"),
            (f'{{"model": {LONE_SURROGATE}, "messages": [{{"role": "user", "content": "x"}}], "stream": {s}}}', "model"),
            # found by schemathesis: a lone surrogate in a field name, repeated in the error's param,
            # made the 400 itself unencodable (a 500)
            (f'{{"model": "guarded", "messages": [{{"role": "user", "content": "x"}}], "speculation": {{{LONE_SURROGATE}: 1}}, "stream": {s}}}', "speculation"),
        ]:
            add("chat", raw=raw.encode(), param=param)
        for raw, param in [
            (f'{{"model": "guarded", "prompt": {LONE_SURROGATE}, "stream": {s}}}', "prompt"),
            (f'{{"model": "guarded", "prompt": [{LONE_SURROGATE}], "stream": {s}}}', "prompt"),
        ]:
            add("completion", raw=raw.encode(), param=param)
    for raw, content_type, status in RAW_BODIES:
        add(rng.choice(["chat", "completion"]), raw=raw, content_type=content_type, status=status)
    add("chat", method="GET", status=405)
    add("completion", method="PUT", status=405)
    add("nowhere", GOOD_CHAT, status=404)
    return cases


ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "nowhere": "/v1/nowhere"}
BATTERY = battery()


def test_the_battery_is_big_enough():
    assert len(BATTERY) >= 120, len(BATTERY)


@pytest.mark.parametrize("case", BATTERY, ids=[f"{i}-{c['route']}-{c['param']}" for i, c in enumerate(BATTERY)])
def test_bad_input_is_a_4xx_in_openai_shape_and_the_server_keeps_serving(apps, case):
    """The probe that opened issue 15: `"budget": 100000` ran out of memory and took the engine,
    the ingress and the controller down; a lone surrogate was a 500 `RayTaskError(TypeError)`;
    `true` passed as max_tokens 1 and `"yes"` as stream; `logprobs` and `tools` were silently
    ignored. Each case here is one such input: a 4xx in OpenAI's shape, then a good request."""
    url = apps["guarded"] + ROUTES[case["route"]]
    headers = {**AUTH, "content-type": case["content_type"]}
    content = case["raw"] if case["raw"] is not None else json.dumps(case["body"]).encode()
    r = httpx.request(case["method"], url, content=content, headers=headers, timeout=60)
    assert_openai_error(r, case["status"], case["param"])
    good_request(apps["guarded"], AUTH)


def test_unsupported_parameters_through_the_official_client(apps):
    client = openai.OpenAI(base_url=apps["guarded"] + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    calls = {
        "logprobs": dict(logprobs=True, top_logprobs=2),
        "tools": dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        "response_format": dict(response_format={"type": "json_object"}),
        "logit_bias": dict(logit_bias={"50": 100}),
    }
    for param, kwargs in calls.items():
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="guarded", messages=CHAT, max_tokens=2, **kwargs)
        assert raised.value.body["param"] == param
    # their defaults are fine: what the client sends when a caller spells them out
    reply = client.chat.completions.create(model="guarded", messages=CHAT, max_tokens=2, logprobs=False,
                                           presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"})
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_body_over_the_limit_is_refused_before_it_is_read(apps):
    """A 10 MB body used to be read, tokenized (2.6 M tokens) and refused 19.5 s later while
    /health stopped answering. Now its Content-Length alone refuses it: the client's upload is
    cut short, and the server answers 413 (httpx may see the refusal or the closed connection)."""
    url = apps["guarded"] + "/v1/chat/completions"

    def chunks():
        yield b'{"model": "guarded", "messages": [{"role": "user", "content": "'
        for _ in range(10 * 1024):
            yield b"x" * 1024
        yield b'"}]}'

    try:  # chunked: no Content-Length, so the size is counted while it arrives
        r = httpx.post(url, content=chunks(), headers=AUTH, timeout=60)
        assert_openai_error(r, 413)
    except httpx.TransportError:
        pass  # the server answered and closed while the client was still sending
    declared = httpx.post(url, content=b"x" * (GUARDED_LIMITS["max_request_bytes"] + 1), headers=AUTH, timeout=60)
    assert_openai_error(declared, 413)
    assert httpx.get(apps["guarded"] + "/health", timeout=30).status_code == 200
    good_request(apps["guarded"], AUTH)


# --- security ----------------------------------------------------------------------------------


def test_api_key_required_on_every_route_but_health(apps):
    base = apps["guarded"]
    for method, route in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                          ("GET", "/openapi.json"), ("GET", "/docs")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]},
                        {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": f"Bearer {KEYS[0]}x"}):
            r = httpx.request(method, base + route, json=GOOD_CHAT, headers=headers, timeout=30)
            error = assert_openai_error(r, 401)
            assert error["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    for key in KEYS:  # either key of the list
        good_request(base, {"Authorization": f"Bearer {key}"})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_api_keys_from_the_environment_and_the_cli(monkeypatch):
    from ddtree.cli import _serve_config, build_parser
    from ddtree.serve.launch import ray_init_options
    from ddtree.serve.config import ServeConfig
    from ddtree.serve.openai_api import Guard

    monkeypatch.setenv("DDTREE_API_KEY", "env-one, env-two")
    guard = Guard(ServeConfig(api_key="cfg"))
    assert guard.authorized({b"authorization": b"Bearer env-two"})
    assert guard.authorized({b"authorization": b"bearer cfg"})
    assert not guard.authorized({b"authorization": b"Bearer env-one,"})
    assert not guard.authorized({})

    def serve_args(*flags):
        """The namespace `ddtree serve` itself parses (a hand-made stand-in once lacked a new flag)."""
        return build_parser().parse_args(["serve", *flags])

    config = _serve_config(serve_args("--api-key", "flag"))
    assert [k.get_secret_value() for k in config.api_key] == ["flag", "env-one", "env-two"]
    assert "flag" not in repr(config) and "env-one" not in str(config.model_dump())
    def init_options(args):  # from the flags `ddtree serve` parsed
        return ray_init_options(args.host, args.metrics_host, args.metrics_port)

    # Ray's metrics endpoint follows the API onto loopback unless told otherwise
    assert init_options(serve_args())["_node_ip_address"] == "127.0.0.1"
    assert "_node_ip_address" not in init_options(serve_args("--host", "0.0.0.0"))
    exposed_api = serve_args("--host", "0.0.0.0", "--metrics-host", "127.0.0.1")
    assert init_options(exposed_api)["_node_ip_address"] == "127.0.0.1"
    with pytest.raises(ValueError, match="max_budget"):
        ServeConfig(budget=100)


def test_errors_name_no_exception_class(apps):
    """`_unexpected` used to answer `internal error (TypeError)`; the engine's failures travelled
    as `RayTaskError(RuntimeError)`. The battery checks every 4xx; here the 5xx message itself."""
    from ddtree.serve.openai_api import engine_failure

    from ray.exceptions import ActorDiedError

    status, message = engine_failure(TypeError("boom"))
    assert status == 500 and "TypeError" not in message and "boom" not in message
    status, message = engine_failure(ActorDiedError())
    assert status == 503 and "Error" not in message


# --- schemathesis ------------------------------------------------------------------------------

SCHEMATHESIS_CASES = 1000


def test_schemathesis_finds_no_5xx(apps):
    """Every operation of the served OpenAPI document, positive and negative cases, `model` fixed
    to the served one so the cases reach the engine: no 5xx, every 4xx in OpenAI's shape."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation.modes import GenerationMode

    raw = httpx.get(apps["guarded"] + "/openapi.json", headers=AUTH, timeout=30).json()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        raw["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": ["guarded"]}
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    generation = [op for op in operations if op.path in ROUTES.values()]
    assert len(generation) == 2
    plan = [(op, mode, 260) for op in generation for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    plan += [(op, GenerationMode.POSITIVE, 20) for op in operations if op not in generation]
    assert sum(n for _, _, n in plan) >= SCHEMATHESIS_CASES
    counts, failures = {"cases": 0, "2xx": 0, "4xx": 0}, []
    http = httpx.Client(timeout=60)

    for op, mode, examples in plan:
        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            # schemathesis serializes the case; httpx sends it (schemathesis' own requests transport
            # trips over this urllib3)
            sent = case.as_transport_kwargs(base_url=apps["guarded"], headers=AUTH)
            content = json.dumps(sent["json"]).encode() if "json" in sent else sent.get("data")
            response = http.request(sent["method"], sent["url"], params=sent.get("params"), content=content,
                                    headers={k: str(v) for k, v in (sent.get("headers") or {}).items()})
            counts["cases"] += 1
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
            elif response.status_code >= 400:
                counts["4xx"] += 1
                body = response.json()
                if set(body.get("error", {})) != {"message", "type", "param", "code"}:
                    failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
            else:
                counts["2xx"] += 1

        run()
    print(f"\nschemathesis: {counts['cases']} cases, {counts['2xx']} 2xx, {counts['4xx']} 4xx, {len(failures)} failures")
    assert not failures, "\n".join(repr(f)[:800] for f in failures[:5])
    assert counts["cases"] >= SCHEMATHESIS_CASES
    good_request(apps["guarded"], AUTH)


# --- load and back-pressure --------------------------------------------------------------------


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> dict:
    """One SSE stream: {status, ttft_s, events, done, error, finish}."""
    started = time.perf_counter()
    out = {"status": None, "ttft_s": None, "events": 0, "done": False, "error": None, "finish": None}
    async with client.stream("POST", url, json=body, headers=headers or {}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            text = (await r.aread()).decode()
            out["error"] = json.loads(text) if text.startswith("{") else text
            out["retry_after"] = r.headers.get("retry-after")
            return out
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                continue
            assert not out["done"], "nothing after [DONE]"
            event = json.loads(data)
            out["events"] += 1
            if "error" in event:
                out["error"] = event
            elif event["choices"]:
                choice = event["choices"][0]
                if out["ttft_s"] is None and (choice.get("delta", {}).get("content") or choice.get("text")):
                    out["ttft_s"] = time.perf_counter() - started
                out["finish"] = choice["finish_reason"] or out["finish"]
    return out


def run_streams(url: str, bodies: list[dict], headers: dict | None = None) -> list[dict]:
    async def main():
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, url, b, headers) for b in bodies))

    return asyncio.run(main())


def test_64_concurrent_streams_all_finish(apps):
    """64 streams at once used to leave 49 clients without a byte for 300 s: the ingress ran 5
    (Serve's default max_ongoing_requests) and queued the rest silently. All 64 now end with
    [DONE] after a finish reason, none cut short."""
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about tree number {i}."}],
               "max_tokens": 8, "temperature": 0, "stream": True} for i in range(64)]
    results = run_streams(apps["ddtree"] + "/v1/chat/completions", bodies)
    errors = [r for r in results if r["status"] != 200 or r["error"]]
    truncated = [r for r in results if not r["done"]]
    assert not errors and not truncated, (errors[:3], truncated[:3])
    assert all(r["finish"] in ("length", "stop") for r in results)
    ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    print(f"\n64 streams: 0 errors, 0 truncated; TTFT p50 {statistics.median(ttfts):.3f} s, p99 {p99:.3f} s")


def test_a_full_server_answers_429_with_retry_after_and_keeps_serving(apps):
    """Admission is bounded (here 2 in flight: one running, one waiting): the rest are told to
    come back (429, Retry-After, OpenAI's shape) instead of waiting in a silent queue."""
    bodies = [{**GOOD_CHAT, "max_tokens": GUARDED_LIMITS["max_output_tokens"], "stream": True} for _ in range(12)]
    results = run_streams(apps["guarded"] + "/v1/chat/completions", bodies, AUTH)
    refused = [r for r in results if r["status"] == 429]
    served = [r for r in results if r["status"] == 200]
    assert refused and served and len(refused) + len(served) == len(results), [r["status"] for r in results]
    for r in refused:
        assert r["retry_after"] == "2" and r["error"]["error"]["type"] == "rate_limit_error"
    assert all(r["done"] and not r["error"] and r["finish"] == "length" for r in served)
    good_request(apps["guarded"], AUTH)


# --- faults ------------------------------------------------------------------------------------


def _engine_replicas(app: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#DDTreeEngine#")]


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_event(apps):
    """A killed engine replica used to cut the SSE stream with neither an error nor [DONE], and
    requests in the next ~34 s timed out, /health included. Now the stream ends with an error
    event in OpenAI's shape and [DONE]; /health says 503 until a new replica runs; recovery time
    (kill to the first good request) is printed."""
    import ray

    base = apps["fragile"]
    url = base + "/v1/chat/completions"
    body = {"model": "fragile", "messages": CHAT, "max_tokens": 200, "temperature": 0, "stream": True,
            "speculation": {"budget": 64}}  # the untrained drafter: 1 token per 65-row verify, slow on purpose
    lines: list[str] = []
    first_content = threading.Event()

    def read():
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if '"content"' in line and '"content": ""' not in line:
                        first_content.set()
        first_content.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first_content.wait(120)
    [replica] = _engine_replicas("fragile")
    killed = time.perf_counter()
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
    reader.join(120)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][6:])
    assert last["error"]["type"] == "internal_error" and last["error"]["code"] is None, last
    assert "Error" not in last["error"]["message"]
    # recovery: /health is 503 (never a hang) until a new replica answers; then requests succeed
    health = []
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    while True:
        r = httpx.get(base + "/health", timeout=30)
        health.append(r.json()["status"])
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.json()["status"] in ("loading", "unavailable")
        assert time.perf_counter() - killed < 300, health
        time.sleep(0.5)
    reply = client.chat.completions.create(model="fragile", messages=CHAT, max_tokens=2, temperature=0)
    recovered = time.perf_counter() - killed
    assert reply.usage.completion_tokens == 2
    print(f"\nreplica killed mid-stream: error event + [DONE]; /health {' -> '.join(dict.fromkeys(health))}; "
          f"recovered in {recovered:.1f} s")


def test_a_non_stream_request_whose_replica_dies_is_a_503(apps):
    import ray

    base = apps["fragile"]
    result: dict = {}

    def call():
        result["r"] = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "fragile", "messages": CHAT, "max_tokens": 200, "temperature": 0, "speculation": {"budget": 64}})

    caller = threading.Thread(target=call)
    caller.start()
    [replica] = _engine_replicas("fragile")
    handle = ray.get_actor(replica, namespace="serve")
    time.sleep(1.0)  # let the request reach the engine (it runs for seconds)
    ray.kill(handle, no_restart=True)
    caller.join(120)
    error = assert_openai_error(result["r"], 503) if result["r"].status_code == 503 else None
    assert error is not None, (result["r"].status_code, result["r"].text)
    assert result["r"].headers["retry-after"]
    while httpx.get(base + "/health", timeout=30).status_code != 200:
        time.sleep(0.5)
    good_request(base)


@contextlib.contextmanager
def gated_app(server, model, gate, name: str):
    """A real Serve app whose engine's construction waits for the file `gate` (a large model's
    loading). Yields its base URL as soon as the ingress answers (the engine still loading);
    serve.run, which returns once the engine runs, waits meanwhile in a thread."""
    from ray import serve

    from ddtree.serve.config import ServeConfig
    from ddtree.serve.engine_server import EngineServer
    from ddtree.serve.openai_api import OpenAIIngress

    class GatedEngineServer(EngineServer):
        def __init__(self, config: dict, gate: str):
            while not os.path.exists(gate):
                time.sleep(0.1)
            super().__init__(config)

    config = ServeConfig(model=str(model), budget=0, block_size=4, engine_num_cpus=0, model_name=name).model_dump()
    engine = serve.deployment(GatedEngineServer).options(name="DDTreeEngine").bind(config, str(gate))
    app = OpenAIIngress.options(ray_actor_options={"num_cpus": 0}).bind(config, engine)
    deploy = threading.Thread(target=serve.run, args=(app,), kwargs={"name": name, "route_prefix": f"/{name}"})
    deploy.start()
    base = server["base"] + f"/{name}"
    try:
        # the ingress answers (a bad body's 400 asks no engine): a 404 until the route is there
        while httpx.post(base + "/v1/chat/completions", json={}, timeout=60).status_code == 404:
            time.sleep(0.2)
        yield base, deploy
    finally:
        gate.touch()
        deploy.join(300)
        serve.delete(name)


def assert_loading(r: httpx.Response):
    assert r.status_code == 503 and r.headers["retry-after"], (r.status_code, r.text)
    body = r.json()
    assert body["status"] == "loading" and body["error"]["code"] == "engine_loading", body
    assert body["error"]["type"] == "internal_error" and "loading" in body["error"]["message"]


def test_health_says_loading_at_once_while_the_engine_starts(server, tiny_chat_model, tmp_path):
    """/health used to say nothing quickly during a first start (minutes for a large model): each
    probe waited HEALTH_TIMEOUT_S (5 s) for an engine replica, then read Serve's status, before
    its 503. Now the ingress, which Serve starts without waiting for the engine's constructor,
    answers 503 "loading" in OpenAI's error shape at once, and 200 once the engine runs. The
    engine here is the real one, whose construction waits for a file: a large model's loading."""
    gate = tmp_path / "loaded"
    with gated_app(server, tiny_chat_model, gate, "gated") as (base, deploy):
        for _ in range(4):
            started = time.perf_counter()
            r = httpx.get(base + "/health", timeout=60)
            seconds = time.perf_counter() - started
            assert_loading(r)
            assert seconds < 4, f"/health took {seconds:.1f} s to say loading"
        gate.touch()
        deploy.join(300)
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        good_request(base)


def test_health_probes_that_give_up_during_start_up_do_not_break_it(server, tiny_chat_model, tmp_path):
    """A load balancer's or Kubernetes' probe gives up after its timeout (Kubernetes' default is
    1 s). /health used to start its wait for the engine's first answer inside the first probe's
    own request: when that client gave up, Serve cancelled the request and the engine call with
    it, and from then on every probe read the cancelled call and answered 500 Internal Server
    Error (plain text), for good, while completions worked -- a replica every orchestrator would
    mark unhealthy. Now the ingress learns the engine's readiness outside any request: probes
    that give up at 0.1-2 s while the engine loads change nothing, the ones that wait get 503
    "loading", and /health says 200 once the engine runs."""
    gate = tmp_path / "loaded"
    with gated_app(server, tiny_chat_model, gate, "probed") as (base, deploy):
        gave_up = 0
        for timeout in (0.001, 0.1, 0.3, 0.5, 0.8, 1.0, 2.0) * 2:
            try:
                r = httpx.get(base + "/health", timeout=timeout)
            except httpx.TimeoutException:
                gave_up += 1
                continue
            assert_loading(r)
        gate.touch()
        deploy.join(300)
        # ready: the first probe that waits says so, and probes that give up now break nothing either
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        for _ in range(3):
            try:
                httpx.get(base + "/health", timeout=0.001)
            except httpx.TimeoutException:
                gave_up += 1
        r = httpx.get(base + "/health", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        good_request(base)
    print(f"\n{gave_up} probes gave up; /health said loading, then ok")
    assert gave_up >= 2  # the probes did give up: a millisecond is too short for any answer


def test_drain_finishes_in_flight_requests_and_refuses_new_ones(apps):
    """What `ddtree serve` does on SIGTERM: the ingress stops admitting (503, /health "draining")
    while the requests in flight run to their end."""
    from ray import serve

    base = apps["fragile"]
    body = {"model": "fragile", "messages": CHAT, "max_tokens": 60, "temperature": 0, "stream": True,
            "speculation": {"budget": 64}}
    results: list[dict] = []
    reader = threading.Thread(target=lambda: results.extend(run_streams(base + "/v1/chat/completions", [body])))
    reader.start()
    ingress = serve.get_app_handle("fragile")
    while ingress.in_flight.remote().result() == 0:
        time.sleep(0.05)
    assert ingress.drain.remote().result() == 1
    refused = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
    assert assert_openai_error(refused, 503)["code"] == "draining"
    health = httpx.get(base + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    reader.join(120)
    [streamed] = results
    assert streamed["done"] and not streamed["error"] and streamed["finish"] == "length"
    assert ingress.in_flight.remote().result() == 0


# --- `ddtree serve` itself ---------------------------------------------------------------------


@pytest.mark.ray  # its own, in the `ddtree serve` subprocess
def test_ddtree_serve_keys_metrics_binding_and_sigterm_drain(tiny_chat_model, tmp_path):
    """`ddtree serve` as an operator runs it, on its own Ray: a key from DDTREE_API_KEY; Ray's
    metrics endpoint on 127.0.0.1 like the API (it used to listen on every interface); SIGTERM
    while a stream runs drains (the stream finishes, a new request gets 503) and exits 0 (it
    used to stop only on Ctrl-C, cutting what was in flight)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from .helpers import free_port

    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ddtree"), "serve", "--model", str(tiny_chat_model), "--budget", "0",
         "--port", str(port), "--metrics-port", str(metrics_port)],
        env={**os.environ, "DDTREE_API_KEY": "sk-from-env"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        while "ddtree serves" not in (tmp_path / "serve.log").read_text():  # its ready line
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        assert httpx.get(base + "/health", timeout=30).status_code == 200  # needs no key
        auth = {"Authorization": "Bearer sk-from-env"}
        assert_openai_error(httpx.get(base + "/v1/models", timeout=30), 401)
        [model] = [m["id"] for m in httpx.get(base + "/v1/models", headers=auth, timeout=30).json()["data"]]
        with socket.create_connection(("127.0.0.1", metrics_port), timeout=10):
            pass
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((address, metrics_port), timeout=5).close()
        body = {"model": model, "messages": CHAT, "max_tokens": 200, "temperature": 0, "stream": True,
                "speculation": {"budget": 64}}  # the untrained drafter: slow on purpose
        lines: list[str] = []
        first_content = threading.Event()

        def read():
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=auth, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_content.set()
            first_content.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first_content.wait(120)
        proc.send_signal(signal.SIGTERM)
        while True:  # new requests are refused once the drain begins
            refused = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1},
                                 headers=auth, timeout=30)
            if refused.status_code != 200:
                break
            time.sleep(0.2)
        assert assert_openai_error(refused, 503)["code"] == "draining"
        reader.join(120)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:  # a failed check: stop it the way an operator would, then harder
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        log.close()
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length", lines[-3:]
