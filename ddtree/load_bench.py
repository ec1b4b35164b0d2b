"""`ddtree bench --concurrency 1,4,16,64`: aggregate throughput and latency under concurrent load.

For each budget and each concurrency c, c closed-loop streams each send a prompt, read its
completion to the end and send the next, until `requests` completions are done (prompts taken
in turn). In process, the streams feed the engine's Scheduler directly (one step loop, no HTTP);
with `url`, they are concurrent streaming requests through the official `openai` client
against a running server. Reported per cell: aggregate output tokens/s, time to first token and
inter-token latency (p50 / p99), tau. Cells run one after another in one process; compare
within a table (the machine is shared and noisy). With both (`--url URL --beside-engine`),
each cell runs through the server and then in process, one right after the other, and the
table gives served over in-process tokens/s (`ServedBeside`): what the serving path costs.

In process, a cell also counts its *busy* window: the steps that began with every one of its c
streams holding a request (`busy_tokens_per_s`). Once the prompts run out the streams finish one
by one and the last steps decode fewer than c sequences; plain decoding's streams all finish at
the same step, a tree budget's do not (each accepts a different number of tokens a step). With 3
requests a stream, at 4 streams auto spent 10-19 steps of ~220 at 2 sequences and ~10 at one:
~7% of a pass that is not 4 concurrent streams.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from .config import SamplingParams


@dataclass
class Throughput:
    """One cell's counts: a budget at a concurrency, its completions, tokens and rounds."""

    budget: int | str
    concurrency: int
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    round_tokens: int = 0
    # where the step loop is seen (in process, or replayed; not through a server):
    granted: dict = field(default_factory=dict)  # granted budget -> rounds
    predicted: float = 0.0  # budget auto: accepted tokens the policy expected ...
    accepted: int = 0  # ... and what those rounds accepted
    busy_tokens: int = 0  # the tokens of the steps that began with every stream busy ...
    busy_seconds: float = 0.0  # ... and their seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def busy_tokens_per_s(self) -> float:
        return self.busy_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def tau(self) -> float | None:
        return self.round_tokens / self.rounds if self.rounds else None

    def summary(self) -> dict:
        d = asdict(self)
        d["granted"] = {str(b): n for b, n in self.granted.items()}
        d.update(tokens_per_s=self.tokens_per_s, busy_tokens_per_s=self.busy_tokens_per_s, tau=self.tau)
        return d


@dataclass
class LoadRow(Throughput):
    """A measured cell, with its latencies."""

    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        d = super().summary()
        d.pop("ttft_s"), d.pop("itl_s")
        d.update(ttft_p50_s=percentile(self.ttft_s, 50), ttft_p99_s=percentile(self.ttft_s, 99),
                 itl_p50_s=percentile(self.itl_s, 50), itl_p99_s=percentile(self.itl_s, 99))
        return d


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_inprocess(engine, prompts: list[list[int]], budget, concurrency: int, requests: int,
                  max_tokens: int | list[int]) -> LoadRow:
    """Closed-loop streams over the engine's Scheduler: a finished stream sends its next prompt
    before the next step. `max_tokens`: one for every request, or the i-th request's at i modulo
    its length."""
    scheduler = engine.scheduler
    row = LoadRow(budget, concurrency)
    lengths = [max_tokens] if isinstance(max_tokens, int) else max_tokens
    todo = deque((prompts[i % len(prompts)], lengths[i % len(lengths)]) for i in range(requests))
    live: dict[int, list[float]] = {}  # sequence id -> [sent at, last update at]
    start = time.perf_counter()

    def send():
        prompt, most = todo.popleft()
        seq_id = scheduler.add(engine.request(prompt, most, SamplingParams(), budget=budget))
        live[seq_id] = [time.perf_counter(), None]

    while todo and len(live) < concurrency:
        send()
    now = start
    while live:
        busy, before = len(live) == concurrency, now
        updates = scheduler.step()
        now = time.perf_counter()
        if busy:
            row.busy_seconds += now - before
            row.busy_tokens += sum(len(update.new_tokens) for _, update in updates)
        for seq_id, update in updates:
            sent, last = live[seq_id]
            if update.new_tokens:
                if last is None:
                    row.ttft_s.append(now - sent)
                else:
                    row.itl_s.extend([(now - last) / len(update.new_tokens)] * len(update.new_tokens))
                live[seq_id][1] = now
            if update.result is not None:
                del live[seq_id]
                result = update.result
                row.requests += 1
                row.tokens += len(result.tokens)
                row.rounds += len(result.rounds)
                row.round_tokens += len(result.tokens) - 1
                for r in result.rounds:
                    row.granted[r.budget] = row.granted.get(r.budget, 0) + 1
                    if r.predicted is not None:
                        row.predicted += r.predicted
                        row.accepted += r.accepted
                if todo:
                    send()
    row.seconds = time.perf_counter() - start
    return row


async def _run_url(url: str, model: str, texts: list[str], budget, concurrency: int, requests: int,
                   max_tokens: int, api_key: str | None) -> LoadRow:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0, timeout=600)
    row = LoadRow(budget, concurrency)
    todo = deque(texts[i % len(texts)] for i in range(requests))

    async def stream_loop():
        while todo:
            text = todo.popleft()
            sent = last = time.perf_counter()
            first = True
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"speculation": {"budget": budget}},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    if first:
                        row.ttft_s.append(now - sent)
                        first = False
                    else:
                        row.itl_s.append(now - last)
                    last = now
                if chunk.usage is not None:
                    row.tokens += chunk.usage.completion_tokens
                    spec = (chunk.usage.model_extra or {}).get("speculation") or {}
                    row.rounds += spec.get("rounds", 0)
                    row.round_tokens += max(chunk.usage.completion_tokens - 1, 0)
            row.requests += 1

    start = time.perf_counter()
    await asyncio.gather(*(stream_loop() for _ in range(concurrency)))
    row.seconds = time.perf_counter() - start
    await client.close()
    return row


def run_url(url: str, model: str, texts: list[str], budget, concurrency: int, requests: int, max_tokens: int,
            api_key: str | None = None) -> LoadRow:
    return asyncio.run(_run_url(url, model, texts, budget, concurrency, requests, max_tokens, api_key))


def served_model(url: str, api_key: str | None = None) -> str:
    """The model a running server serves (the first of GET /v1/models)."""
    from openai import OpenAI

    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0, timeout=60)
    return client.models.list().data[0].id


@dataclass
class ServedBeside:
    """One cell run twice, one run right after the other: through a running server (`served`)
    and by the same engine in process (`engine`), with the same prompts, requests and tokens."""

    served: LoadRow
    engine: LoadRow

    @property
    def ratio(self) -> float:
        """Served aggregate tokens/s over the engine's in process."""
        return self.served.tokens_per_s / self.engine.tokens_per_s if self.engine.tokens_per_s else 0.0

    def summary(self) -> dict:
        return {"budget": self.served.budget, "concurrency": self.served.concurrency,
                "served_over_engine": self.ratio, "served": self.served.summary(), "engine": self.engine.summary()}


def markdown_beside(cells: list[ServedBeside]) -> str:
    """Served against in process per cell: aggregate tokens/s of both, their ratio, each one's
    scaling over its fewest streams at the same budget, and the served streams' latencies."""

    def ms(v):
        return f"{1000 * v:.0f}" if v is not None else "-"

    fewest = min(c.served.concurrency for c in cells)
    base = {(c.served.budget, side): getattr(c, side).tokens_per_s
            for c in cells if c.served.concurrency == fewest for side in ("served", "engine")}

    def scaling(cell, side):
        one = base.get((cell.served.budget, side))
        return f"{getattr(cell, side).tokens_per_s / one:.2f}x" if one else "-"

    lines = [
        f"| budget | streams | requests | served tokens/s | in process tokens/s | served / in process | "
        f"served vs {fewest} stream{'s' if fewest != 1 else ''} | in process vs {fewest} | "
        f"served TTFT p50 / p99 ms | served inter-token p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cells:
        s = c.served
        lines.append(
            f"| {s.budget} | {s.concurrency} | {s.requests} | {s.tokens_per_s:.1f} | {c.engine.tokens_per_s:.1f} | "
            f"{c.ratio:.2f}x | {scaling(c, 'served')} | {scaling(c, 'engine')} | "
            f"{ms(percentile(s.ttft_s, 50))} / {ms(percentile(s.ttft_s, 99))} | "
            f"{ms(percentile(s.itl_s, 50))} / {ms(percentile(s.itl_s, 99))} |"
        )
    return "\n".join(lines)


def markdown(rows: list[LoadRow]) -> str:
    def ms(v):
        return f"{1000 * v:.0f}" if v is not None else "-"

    base = {r.budget: r.tokens_per_s for r in rows if r.concurrency == min(x.concurrency for x in rows)}
    lines = [
        "| budget | streams | requests | tokens/s (all streams) | vs 1 stream | tau | TTFT p50 / p99 ms | inter-token p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = r.tokens_per_s / base[r.budget] if base.get(r.budget) else 0.0
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        lines.append(
            f"| {r.budget} | {r.concurrency} | {r.requests} | {r.tokens_per_s:.1f} | {ratio:.2f}x | {tau} | "
            f"{ms(percentile(r.ttft_s, 50))} / {ms(percentile(r.ttft_s, 99))} | "
            f"{ms(percentile(r.itl_s, 50))} / {ms(percentile(r.itl_s, 99))} |"
        )
    return "\n".join(lines)


def plot(rows: list[LoadRow], path, title: str) -> None:
    """Aggregate tokens/s and inter-token p50 against the number of streams, one line per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .bench import save_figure

    fig, (ax_rate, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    for budget in dict.fromkeys(r.budget for r in rows):
        mine = [r for r in rows if r.budget == budget]
        streams = [r.concurrency for r in mine]
        ax_rate.plot(streams, [r.tokens_per_s for r in mine], "o-", label=f"budget {budget}")
        ax_itl.plot(streams, [1000 * (percentile(r.itl_s, 50) or 0) for r in mine], "o-", label=f"budget {budget}")
    ax_rate.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s (all streams)", title="throughput")
    ax_itl.set(xscale="log", xlabel="concurrent streams", ylabel="inter-token latency p50 (ms)", title="latency")
    save_figure(fig, (ax_rate, ax_itl), title, path)
