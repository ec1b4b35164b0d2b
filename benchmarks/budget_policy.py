"""`budget: auto` against every fixed budget, at several numbers of concurrent streams.

Prompts: the first N of gsm8k-test, humaneval and vicuna-bench (benchmarks/data), interleaved
(math, code, chat, math, ...), so every table is a mixed workload. For each number of streams
c, c closed-loop greedy streams run `requests` completions through the engine's step loop
(ddtree.load_bench.run_inprocess); the budgets run one after another, in `--passes` passes per
concurrency whose order is rotated and then reversed (so drift on a shared machine favours none;
each cell sums its passes), in one process, one engine (budget auto: the policy keeps what it
learned, as a server would).

With one max tokens for every request (the default), plain decoding's streams all finish at the
same step and its batch never drains, while any budget that speeds some sequences more than
others ends each pass in a ragged drain of small batches; `--length-spread s` gives request i
its own max tokens, drawn (seed 7) from max-tokens x [1 - s, 1 + s], the same for every budget.

Reported per table: aggregate tokens/s per budget, auto / best fixed budget, auto / plain, the
same over the steps that began with every stream busy (ddtree.load_bench: the drain at the end of
a pass, fewer than c streams, left out), auto's granted-budget distribution and predicted vs
realized accepted tokens.

    python benchmarks/budget_policy.py [--concurrency 1,4,16,64] [--budgets 0,4,8,16,chain]
        [--per-file 4] [--max-tokens 64] [--requests-per-stream 2] [--min-requests 12]
        [--max-requests 64] [--warm-up 12] [--settle 0] [--lookup] [--files a.jsonl,b.jsonl]
        [--length-spread 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from ddtree import load_bench
from ddtree.bench import read_prompts
from ddtree.config import ModelPairConfig, parse_budget
from ddtree.engine import Engine

DATA = Path(__file__).parent / "data"
FILES = ("gsm8k-test.jsonl", "humaneval.jsonl", "vicuna-bench.jsonl")


def mixed_prompts(per_file: int, files: tuple[str, ...] = FILES) -> list[str]:
    sets = [read_prompts(DATA / f, per_file) for f in files]
    return [p for group in zip(*sets) for p in group]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--budgets", default="0,4,8,16,chain", help="the fixed budgets auto is compared with")
    parser.add_argument("--per-file", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=float, default=2.0)
    parser.add_argument("--min-requests", type=int, default=12)
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--warm-up", type=int, default=12,
                        help="auto requests run first, 4 streams, 32 tokens: the policy's state is a running server's")
    parser.add_argument("--settle", type=int, default=0,
                        help="per concurrency, this many unmeasured passes of auto first (one request per stream): "
                             "the policy learns that batch size's costs and probe yield as a server under that load has")
    parser.add_argument("--max-step-tokens", type=int, default=1024)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=False,
                        help="the engine's lookup-branch default, for auto and every fixed budget alike")
    parser.add_argument("--files", default=",".join(FILES),
                        help="the prompt files the tables run (interleaved; the warm-up takes all three): one file "
                             "shows what `auto` does on one domain")
    parser.add_argument("--length-spread", type=float, default=0.0,
                        help="each request's max tokens drawn (seed 7) from max-tokens x [1 - s, 1 + s], the same "
                             "lengths for every budget: with one length for all, plain decoding's streams finish in "
                             "lockstep and its batch never drains, which no server's mixed lengths give it")
    parser.add_argument("--json")
    args = parser.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    budgets = ["auto"] + [parse_budget(b) for b in args.budgets.split(",")]
    config = ModelPairConfig(model=args.model, budget="auto", max_num_seqs=max(levels),
                             max_step_tokens=args.max_step_tokens, lookup=args.lookup)
    started = time.perf_counter()
    engine = Engine.from_config(config)
    print(f"engine ready in {time.perf_counter() - started:.1f} s; T(r) ms: "
          + ", ".join(f"{r}: {1000 * s:.0f}" for r, s in engine.scheduler.policy.verify.points.items()), flush=True)
    render = lambda texts: [engine.render_chat([{"role": "user", "content": t}]) for t in texts]  # noqa: E731
    # warm-up: kernels, and the policy's first look
    load_bench.run_inprocess(engine, render(mixed_prompts(args.per_file)), "auto", 4, args.warm_up, 32)
    files = tuple(args.files.split(","))
    prompts = render(mixed_prompts(args.per_file, files))

    tables = []
    for i, c in enumerate(levels):
        requests = min(args.max_requests, max(args.min_requests, int(round(c * args.requests_per_stream))))
        lengths = spread_lengths(args.max_tokens, args.length_spread, requests)
        order = budgets[i % len(budgets):] + budgets[: i % len(budgets)]
        rows = {}
        for _ in range(args.settle):
            load_bench.run_inprocess(engine, prompts, "auto", c, c, lengths)
        for p in range(args.passes):
            for budget in (order if p % 2 == 0 else order[::-1]):
                r = load_bench.run_inprocess(engine, prompts, budget, c, requests, lengths)
                print(f"  streams {c} budget {budget} pass {p + 1}: {r.tokens_per_s:.1f} tok/s "
                      f"(every stream busy: {r.busy_tokens_per_s:.1f}), tau {r.tau or 0:.2f}",
                      flush=True)
                rows[budget] = merge(rows[budget], r) if budget in rows else r
        requests *= args.passes
        tables.append((c, requests, [rows[b] for b in budgets]))
        print(table(c, requests, [rows[b] for b in budgets]), flush=True)

    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {engine.config.dtype}, "
          f"weights {engine.config.weights}; {len(prompts)} prompts ({' / '.join(files)} "
          f"interleaved), {args.max_tokens} new tokens"
          + (f" (each request's drawn from x [{1 - args.length_spread:g}, {1 + args.length_spread:g}])"
             if args.length_spread else "") + ", greedy")
    for c, requests, rows in tables:
        print(table(c, requests, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"streams": c, "requests": n, "rows": [r.summary() for r in rows]} for c, n, rows in tables], indent=2))


def spread_lengths(max_tokens: int, spread: float, requests: int) -> int | list[int]:
    """Each request's max tokens: `max_tokens` for all, or drawn uniformly (seed 7) from
    max_tokens x [1 - spread, 1 + spread], one list that every budget runs alike."""
    if not spread:
        return max_tokens
    rng = random.Random(7)
    low, high = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))
    return [rng.randint(low, high) for _ in range(requests)]


def merge(a: load_bench.LoadRow, b: load_bench.LoadRow) -> load_bench.LoadRow:
    """One cell of two passes: their tokens over their seconds."""
    for name in ("requests", "tokens", "seconds", "rounds", "round_tokens", "predicted", "accepted", "busy_tokens",
                 "busy_seconds"):
        setattr(a, name, getattr(a, name) + getattr(b, name))
    a.ttft_s += b.ttft_s
    a.itl_s += b.itl_s
    for budget, n in b.granted.items():
        a.granted[budget] = a.granted.get(budget, 0) + n
    return a


def table(streams: int, requests: int, rows: list[load_bench.LoadRow]) -> str:
    auto = rows[0]
    fixed = rows[1:]
    best = max(fixed, key=lambda r: r.tokens_per_s)
    busiest = max(fixed, key=lambda r: r.busy_tokens_per_s)
    plain = next((r for r in fixed if r.budget == 0), None)
    lines = [f"\n{streams} streams, {requests} requests: auto = {auto.tokens_per_s / best.tokens_per_s:.2f}x the best "
             f"fixed budget ({best.budget})" + (f", {auto.tokens_per_s / plain.tokens_per_s:.2f}x plain" if plain else "")
             + f"; every stream busy: {auto.busy_tokens_per_s / busiest.busy_tokens_per_s:.2f}x ({busiest.budget})",
             "| budget | tokens/s | vs best fixed | every stream busy: tokens/s | vs best fixed | tau "
             "| granted budgets (rounds) | predicted / realized accepted |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        granted = ", ".join(f"{b}: {n}" for b, n in sorted(r.granted.items(), key=lambda kv: str(kv[0])))
        ratio = f"{r.predicted:.0f} / {r.accepted} = {r.predicted / r.accepted:.2f}" if r.accepted else "-"
        lines.append(f"| {r.budget} | {r.tokens_per_s:.1f} | {r.tokens_per_s / best.tokens_per_s:.2f}x | "
                     f"{r.busy_tokens_per_s:.1f} | {r.busy_tokens_per_s / busiest.busy_tokens_per_s:.2f}x | "
                     f"{r.tau or 0:.2f} | {granted} | {ratio if r.budget == 'auto' else '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
