"""A soak: minutes (30 by default) of mixed load against a real ddtree Serve app on 127.0.0.1,
checked for what hours of traffic break -- and plotted.

    python benchmarks/soak.py --minutes 30 --concurrency 4 --out soak.json --plot soak.png

It starts a local Ray, deploys the app (the default model pair unless `--model`/`--drafter`, with
the limits below so that over-limit requests exist) and runs `--concurrency` closed-loop clients.
Each client draws its next request from a seeded mix:

- `stream`     a streaming chat completion read to its end (greedy, or seeded at T > 0), budget
               drawn from `--budgets`, lookup branches on or off;
- `whole`      the same, not streamed;
- `cancel`     a stream the client closes after a few content events;
- `disconnect` a non-streamed request whose client gives up (a read timeout) mid-generation;
- `over`       a request past a limit (max_tokens, prompt length, budget) or malformed: a 4xx.

What it checks, and what `ok` requires:
- no 5xx and no error event (nothing in the mix is an engine fault);
- no truncated stream: every stream the client did not close ended with a finish_reason and
  `[DONE]`;
- lossless under load: the requests with the same prompt and sampling (greedy, or the same seed
  and temperature) got the same text, whatever their budget, lookup or batch; a cancelled
  stream's text is a prefix of it;
- every `over` request answered 4xx;
- once the load stops and the batch drains, every KV page is back in the pool (`free_pages ==
  pages` of the engine's Scheduler.stats).

And what it reports: the engine replica's resident memory over time and its slope (MB/hour,
least squares after the first tenth of the run), and the p99 inter-token latency (the gap between
a stream's content events) of the first and the last `--window` minutes. JSON with `--out`, a
plot with `--plot`. The short version runs in `make test` (tests/test_soak.py) on a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from ddtree.bench import MIXED_FILES, interleaved_prompts
from ddtree.load_bench import percentile

DATA = Path(__file__).parent / "data"
APP = "soak"
ENGINE = "DDTreeEngine"  # serve.app.build_app's engine deployment
# The app's limits: requests past them are the mix's `over` requests.
LIMITS = {"max_output_tokens": 96, "max_prompt_tokens": 1024, "max_budget": 64, "max_num_seqs": 16, "max_waiting": 16}
MIX = {"stream": 45, "whole": 15, "cancel": 15, "disconnect": 10, "over": 15}
SEEDS = (1, 2, 3)  # few seeds, so that seeded requests repeat and can be compared
TEMPERATURE = 0.8


@dataclass
class Outcome:
    """One request of the mix, as its client saw it."""

    kind: str  # a MIX key
    started: float  # seconds since the soak began
    seconds: float = 0.0
    status: int | None = None  # HTTP status (None: the client gave up before one)
    key: tuple | None = None  # (prompt index, max_tokens, seed or None): requests that must agree
    budget: int | str | None = None
    text: str = ""
    finish: str | None = None  # the last finish_reason seen
    done: bool = False  # a stream's `[DONE]`
    error_event: str | None = None  # a stream's error event, its message
    gaps: list[float] = field(default_factory=list)  # a stream's gaps between content events, s
    note: str = ""


@dataclass
class Sample:
    at: float  # seconds since the soak began
    engine_rss_mb: float
    others_rss_mb: float  # the ingress's and the proxy's
    running: int
    waiting: int
    free_pages: int


class Client:
    """One closed-loop client: draws requests from the mix until `until`."""

    def __init__(self, model: str, prompts: list[str], budgets: list, limits: dict, rng: random.Random):
        self.model, self.prompts, self.budgets, self.limits, self.rng = model, prompts, budgets, limits, rng

    def body(self, index: int, seeded: bool, stream: bool) -> tuple[dict, tuple]:
        max_tokens = 16 + 16 * (index % 5)  # fixed per prompt: its requests are comparable
        seed = self.rng.choice(SEEDS) if seeded else None
        budget = self.rng.choice(self.budgets)
        body = {
            "model": self.model, "messages": [{"role": "user", "content": self.prompts[index]}],
            "max_tokens": max_tokens, "temperature": TEMPERATURE if seeded else 0, "stream": stream,
            "speculation": {"budget": budget, "lookup": self.rng.random() < 0.5},
        }
        if seeded:
            body["seed"] = seed
        return body, (index, max_tokens, seed)

    def over_limit(self) -> dict:
        base = {"model": self.model, "messages": [{"role": "user", "content": self.prompts[0]}], "max_tokens": 8}
        return self.rng.choice([
            {**base, "max_tokens": self.limits["max_output_tokens"] + 1},
            {**base, "messages": [{"role": "user", "content": "tree " * (2 * self.limits["max_prompt_tokens"])}]},
            {**base, "speculation": {"budget": self.limits["max_budget"] + 1}},
            {**base, "temperature": -1},
            {**base, "messages": []},
        ])

    async def run(self, http: httpx.AsyncClient, t0: float, until: float, out: list[Outcome]) -> None:
        kinds, weights = zip(*MIX.items())
        while time.perf_counter() < until:
            kind = self.rng.choices(kinds, weights)[0]
            o = Outcome(kind, time.perf_counter() - t0)
            try:
                await getattr(self, kind)(http, o)
            except (httpx.TimeoutException, httpx.TransportError) as err:
                o.note = f"{type(err).__name__}"
            o.seconds = time.perf_counter() - t0 - o.started
            out.append(o)

    async def stream(self, http: httpx.AsyncClient, o: Outcome, close_after: int | None = None) -> None:
        body, o.key = self.body(self.rng.randrange(len(self.prompts)), self.rng.random() < 0.5, stream=True)
        o.budget = body["speculation"]["budget"]
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            o.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            last = None
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    o.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    o.error_event = event["error"].get("message", "error")
                    continue
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is not None:
                            o.gaps.append(now - last)
                        last = now
                        o.text += text
                        events += 1
                    if choice.get("finish_reason"):
                        o.finish = choice["finish_reason"]
                if close_after is not None and events >= close_after:
                    return  # leaving the block closes the connection mid-stream

    async def whole(self, http: httpx.AsyncClient, o: Outcome, timeout: float | None = None) -> None:
        body, o.key = self.body(self.rng.randrange(len(self.prompts)), self.rng.random() < 0.5, stream=False)
        o.budget = body["speculation"]["budget"]
        response = await http.post("/v1/chat/completions", json=body,
                                   **({"timeout": httpx.Timeout(timeout)} if timeout else {}))
        o.status = response.status_code
        if response.status_code == 200:
            choice = response.json()["choices"][0]
            o.text, o.finish = choice["message"]["content"], choice["finish_reason"]

    async def cancel(self, http: httpx.AsyncClient, o: Outcome) -> None:
        await self.stream(http, o, close_after=self.rng.randint(1, 4))

    async def disconnect(self, http: httpx.AsyncClient, o: Outcome) -> None:
        try:
            await self.whole(http, o, timeout=self.rng.uniform(0.05, 1.0))
        except httpx.TimeoutException:
            o.note = "gave up"

    async def over(self, http: httpx.AsyncClient, o: Outcome) -> None:
        response = await http.post("/v1/chat/completions", json=self.over_limit())
        o.status = response.status_code


def engine_processes(app: str) -> tuple[list, list]:
    """The app's engine replica processes, and its ingress's and the proxies' (psutil)."""
    import psutil

    engines, others = [], []
    for p in psutil.process_iter(["cmdline"]):
        title = " ".join(p.info["cmdline"] or [])
        if title.startswith(f"ray::ServeReplica:{app}:{ENGINE}"):
            engines.append(p)
        elif title.startswith((f"ray::ServeReplica:{app}:", "ray::ProxyActor")):
            others.append(p)
    return engines, others


def rss_mb(processes) -> float:
    total = 0
    for p in processes:
        try:
            total += p.memory_info().rss
        except Exception:  # a process gone between the listing and the read
            pass
    return total / 2**20


def batch_stats(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(ENGINE, app_name=app).batch_stats.remote().result(timeout_s=30)


async def sample_loop(app: str, t0: float, until: float, every: float, samples: list[Sample]) -> None:
    engines, others = engine_processes(app)
    while True:
        stats = await asyncio.to_thread(batch_stats, app)
        samples.append(Sample(time.perf_counter() - t0, rss_mb(engines), rss_mb(others), stats["running"],
                              stats["waiting"], stats["free_pages"]))
        if time.perf_counter() >= until:
            return
        await asyncio.sleep(min(every, max(0.0, until - time.perf_counter())))


def slope_mb_per_hour(samples: list[Sample]) -> float | None:
    """Least-squares slope of the engine's resident memory, after the first tenth of the run."""
    if len(samples) < 3:
        return None
    start = samples[0].at + (samples[-1].at - samples[0].at) / 10
    points = [(s.at, s.engine_rss_mb) for s in samples if s.at >= start]
    if len(points) < 3:
        return None
    return statistics.linear_regression(*zip(*points)).slope * 3600


def judge(outcomes: list[Outcome], samples: list[Sample], drained: dict, minutes: float, window: float) -> dict:
    """The soak's figures and whether it held (`ok`, with the reasons it did not)."""
    by_kind = Counter(o.kind for o in outcomes)
    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
    error_events = [o for o in outcomes if o.error_event]
    streams = [o for o in outcomes if o.kind == "stream" and o.status == 200]
    truncated = [o for o in streams if not (o.done and o.finish) and not o.error_event]
    over_answered = [o for o in outcomes if o.kind == "over" and o.status is not None]
    over_not_4xx = [o for o in over_answered if not 400 <= o.status < 500]
    refused = Counter(o.status for o in outcomes if o.kind != "over" and o.status is not None and 400 <= o.status < 500)
    # lossless: every finished text of a key the same; a cancelled stream's text a prefix of it
    finished = defaultdict(set)
    for o in outcomes:
        if o.kind in ("stream", "whole", "disconnect") and o.status == 200 and o.finish:
            finished[o.key].add(o.text)
    mismatched = {str(k): sorted(v) for k, v in finished.items() if len(v) > 1}
    not_prefix = [o for o in outcomes if o.kind == "cancel" and len(finished.get(o.key, ())) == 1
                  and not next(iter(finished[o.key])).startswith(o.text)]
    # the requests that had another of their key to agree with (a cancelled one: a whole one)
    per_key = Counter(o.key for o in outcomes if o.status == 200 and (o.finish or o.kind == "cancel"))
    compared = sum(n for k, n in per_key.items() if n > 1 and k in finished)

    def p99_gap(lo: float, hi: float) -> float | None:
        return percentile([g for o in outcomes if o.kind in ("stream", "cancel") and lo <= o.started < hi
                           for g in o.gaps], 99)

    span = minutes * 60
    per_minute = []
    for m in range(int(-(-span // 60))):
        inside = [o for o in outcomes if m * 60 <= o.started < (m + 1) * 60]
        per_minute.append({"minute": m, "requests": len(inside), "p50_gap_s": percentile(
            [g for o in inside for g in o.gaps], 50), "p99_gap_s": percentile([g for o in inside for g in o.gaps], 99),
            "tokens_text_chars": sum(len(o.text) for o in inside)})
    figures = {
        "requests": len(outcomes), "by_kind": dict(by_kind), "server_errors": len(server_errors),
        "error_events": len(error_events), "streams_read": len(streams), "truncated_streams": len(truncated),
        "over_limit_answered": len(over_answered), "over_limit_not_4xx": len(over_not_4xx),
        "refused_other": {str(k): v for k, v in refused.items()},  # e.g. 429s when the queue is full
        "compared_outputs": compared, "mismatched_keys": mismatched, "cancelled_not_prefix": len(not_prefix),
        "pages_after": drained, "engine_rss_mb_first": samples[0].engine_rss_mb if samples else None,
        "engine_rss_mb_last": samples[-1].engine_rss_mb if samples else None,
        "engine_rss_slope_mb_per_hour": slope_mb_per_hour(samples),
        "p99_gap_first_s": p99_gap(0, window * 60), "p99_gap_last_s": p99_gap(span - window * 60, span + 1e9),
        "per_minute": per_minute,
    }
    reasons = []
    if server_errors:
        reasons.append(f"{len(server_errors)} 5xx ({Counter(o.status for o in server_errors)})")
    if error_events:
        reasons.append(f"{len(error_events)} error events, e.g. {error_events[0].error_event!r}")
    if truncated:
        reasons.append(f"{len(truncated)} truncated streams")
    if over_not_4xx:
        reasons.append(f"{len(over_not_4xx)} over-limit requests not answered 4xx")
    if mismatched:
        reasons.append(f"{len(mismatched)} prompts whose outputs differ under one sampling")
    if not_prefix:
        reasons.append(f"{len(not_prefix)} cancelled streams whose text is not a prefix of the whole output")
    if drained.get("free_pages") != drained.get("pages") or drained.get("running") or drained.get("waiting"):
        reasons.append(f"the pool after the load: {drained}")
    figures["ok"], figures["reasons"] = not reasons, reasons
    return figures


async def soak(base: str, app: str, model: str, prompts: list[str], budgets: list, limits: dict, minutes: float,
               concurrency: int, seed: int = 0, sample_s: float = 10.0, window: float = 5.0,
               progress: bool = True) -> tuple[dict, list[Outcome], list[Sample]]:
    """Runs the mix against the app at `base` (deployed as `app` on this driver's Ray, with
    `limits`) and judges it."""
    rng = random.Random(seed)
    clients = [Client(model, prompts, budgets, limits, random.Random(rng.random())) for _ in range(concurrency)]
    outcomes: list[Outcome] = []
    samples: list[Sample] = []
    t0 = time.perf_counter()
    until = t0 + minutes * 60
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0), limits=limits) as http:
        tasks = [asyncio.create_task(c.run(http, t0, until, outcomes)) for c in clients]
        sampler = asyncio.create_task(sample_loop(app, t0, until, sample_s, samples))
        if progress:
            reporter = asyncio.create_task(report_progress(t0, until, outcomes))
        await asyncio.gather(*tasks)
        await sampler
        if progress:
            reporter.cancel()
    drained = await asyncio.to_thread(wait_drained, app)
    return judge(outcomes, samples, drained, minutes, window), outcomes, samples


async def report_progress(t0: float, until: float, outcomes: list[Outcome]) -> None:
    while True:
        await asyncio.sleep(30)
        errors = sum(1 for o in outcomes if (o.status or 0) >= 500 or o.error_event)
        print(f"  soak {(time.perf_counter() - t0) / 60:5.1f} / {(until - t0) / 60:.1f} min: "
              f"{len(outcomes)} requests, {errors} 5xx or error events", flush=True)


def wait_drained(app: str, timeout_s: float = 60.0) -> dict:
    """The engine's batch once nothing runs or waits (or after `timeout_s`)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        stats = batch_stats(app)
        if (not stats["running"] and not stats["waiting"]) or time.perf_counter() > deadline:
            return {k: stats[k] for k in ("running", "waiting", "free_pages", "pages", "cancelled", "preemptions")}
        time.sleep(0.5)


def plot(figures: dict, samples: list[Sample], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, gaps, load) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    minutes = [s.at / 60 for s in samples]
    mem.plot(minutes, [s.engine_rss_mb for s in samples], label="engine replica")
    mem.plot(minutes, [s.others_rss_mb for s in samples], label="ingress + proxy")
    mem.set_ylabel("resident memory, MB")
    slope = figures["engine_rss_slope_mb_per_hour"]
    mem.set_title(f"{title}\nengine RSS slope {slope:+.1f} MB/hour" if slope is not None else title)
    mem.legend()
    rows = [m for m in figures["per_minute"] if m["p99_gap_s"] is not None]
    gaps.plot([m["minute"] + 0.5 for m in rows], [1000 * m["p99_gap_s"] for m in rows], "o-", label="p99")
    gaps.plot([m["minute"] + 0.5 for m in rows], [1000 * m["p50_gap_s"] for m in rows], "o-", label="p50")
    gaps.set_ylabel("inter-token gap, ms")
    gaps.legend()
    load.plot(minutes, [s.running for s in samples], label="running")
    load.plot(minutes, [s.waiting for s in samples], label="waiting")
    load.plot([m["minute"] + 0.5 for m in figures["per_minute"]], [m["requests"] for m in figures["per_minute"]],
              "o-", label="requests / minute")
    load.set_xlabel("minutes")
    load.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def mixed_prompts(per_file: int) -> list[str]:
    return interleaved_prompts([DATA / f for f in MIXED_FILES], per_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--budgets", default="0,chain,16,64,auto")
    parser.add_argument("--per-file", type=int, default=4, help="prompts from each of %s" % ", ".join(MIXED_FILES))
    parser.add_argument("--model", help="target checkpoint (default: the default pair's)")
    parser.add_argument("--drafter", help="drafter checkpoint (default: the default pair's)")
    parser.add_argument("--config", default="{}", help="more ServeConfig fields, JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory/batch samples")
    parser.add_argument("--window", type=float, default=5.0, help="minutes of the first/last p99 windows")
    parser.add_argument("--out", help="JSON figures and samples")
    parser.add_argument("--outcomes", help="JSON: every request as its client saw it (~250 bytes each)")
    parser.add_argument("--plot", help="PNG: memory, inter-token gaps and load over time")
    args = parser.parse_args()

    import ray
    from ray import serve

    from ddtree.serve.app import build_app

    config = {**LIMITS, "model_name": APP, **json.loads(args.config)}
    for name in ("model", "drafter"):
        if getattr(args, name):
            config[name] = getattr(args, name)
    budgets = [b if b in ("chain", "auto") else int(b) for b in args.budgets.split(",")]
    ray.init(include_dashboard=False)
    port = 8000 + random.Random().randrange(1000)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print(f"deploying {config} on 127.0.0.1:{port} ...", flush=True)
    serve.run(build_app(config), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    prompts = mixed_prompts(args.per_file)
    print(f"soak: {args.minutes} min, {args.concurrency} clients, budgets {budgets}, {len(prompts)} prompts", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    figures, outcomes, samples = asyncio.run(soak(base, APP, APP, prompts, budgets, config, args.minutes, args.concurrency,
                                                  args.seed, args.sample_s, args.window))
    serve.shutdown()
    ray.shutdown()
    summary = {k: v for k, v in figures.items() if k != "per_minute"}
    print(json.dumps(summary, indent=1, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "started": started, "command": "python benchmarks/soak.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k not in ("out", "plot", "outcomes")),
            "config": config, "budgets": budgets, "figures": figures, "samples": [asdict(s) for s in samples],
        }, indent=1, default=str))
    if args.outcomes:
        Path(args.outcomes).write_text(json.dumps([asdict(o) for o in outcomes], default=str))
    if args.plot:
        plot(figures, samples, args.plot, f"ddtree soak {started}: {args.concurrency} clients, {args.minutes:g} min")
    raise SystemExit(0 if figures["ok"] else 1)


if __name__ == "__main__":
    main()
