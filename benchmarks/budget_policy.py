"""`budget: auto` against every fixed budget, at several numbers of concurrent streams.

Prompts: the first N of gsm8k-test, humaneval and vicuna-bench (benchmarks/data), interleaved
(math, code, chat, math, ...), so every table is a mixed workload. For each number of streams
c, c closed-loop greedy streams run `requests` completions through the engine's step loop
(ddtree.load_bench.run_inprocess); the budgets run one after another, in `--passes` passes per
concurrency whose order is rotated and then reversed (so drift on a shared machine favours none;
each cell sums its passes), in one process, one engine (budget auto: the policy keeps what it
learned, as a server would).

This host's speed drifts by a quarter within a minute (a GEMM loop timed every 2 s here ran
36-63 sweeps/s), and a pass of five budgets at one stream spans ~2.5 minutes, so two budgets'
passes met different hosts. `--slices k` cuts each pass's requests into k runs of consecutive
requests (at least 3c each at c streams, so the drain of a closed loop stays a small share) and
runs every budget's slice s before any budget's slice s + 1: each budget still runs the same
requests, but the budgets are compared within tens of seconds. `--race r`: after
`--race-after` passes, a fixed budget under r x the best fixed budget's tokens/s so far runs no
more passes (plain decoding always runs, auto too): the time goes to the budgets that are
close, and the table says how many passes each cell sums.

With one max tokens for every request (the default), plain decoding's streams all finish at the
same step and its batch never drains, while any budget that speeds some sequences more than
others ends each pass in a ragged drain of small batches; `--length-spread s` gives request i
its own max tokens, drawn (seed 7) from max-tokens x [1 - s, 1 + s], the same for every budget.

Reported per table: aggregate tokens/s per budget, auto / best fixed budget, auto / plain, the
same over the steps that began with every stream busy (ddtree.load_bench: the drain at the end of
a pass, fewer than c streams, left out), auto's granted-budget distribution and predicted vs
realized accepted tokens; and for the whole run, each budget's seconds for every concurrency's
tokens at its own tokens/s there (`whole_run`: the policy against one fixed budget for every load).

`--against REV` also runs `budget: auto` as git revision REV's scheduler and policy have it
(benchmarks/policy_revision.py: their modules loaded from `git show`, over the same engine's
models and start-up T(r)), as one more budget "auto@REV" in the same rotation: the policy against
another revision's in one run, on one machine's drifts alike.

    python benchmarks/budget_policy.py [--concurrency 1,4,16,64] [--budgets 0,4,8,16,chain] [--against main]
        [--per-file 4] [--max-tokens 64] [--requests-per-stream 2] [--min-requests 12]
        [--max-requests 64] [--warm-up 12] [--settle 0] [--lookup] [--files a.jsonl,b.jsonl]
        [--length-spread 0.5] [--slices 4] [--race 0.8] [--race-after 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

from ddtree import load_bench
from ddtree.bench import MIXED_FILES, interleaved_prompts
from ddtree.config import ModelPairConfig, parse_budget
from ddtree.engine import Engine, freeze_startup

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).parent))
from policy_revision import beside, running, scheduler_at  # noqa: E402


def mixed_prompts(per_file: int, files: tuple[str, ...] = MIXED_FILES) -> list[str]:
    return interleaved_prompts([DATA / f for f in files], per_file)


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
    parser.add_argument("--files", default=",".join(MIXED_FILES),
                        help="the prompt files the tables run (interleaved; the warm-up takes all three): one file "
                             "shows what `auto` does on one domain")
    parser.add_argument("--length-spread", type=float, default=0.0,
                        help="each request's max tokens drawn (seed 7) from max-tokens x [1 - s, 1 + s], the same "
                             "lengths for every budget: with one length for all, plain decoding's streams finish in "
                             "lockstep and its batch never drains, which no server's mixed lengths give it")
    parser.add_argument("--slices", type=int, default=1,
                        help="each pass's requests cut into this many runs (each at least 3 x streams requests), "
                             "every budget's slice s run before any budget's slice s + 1: a finer interleave")
    parser.add_argument("--race", type=float, default=0.0,
                        help="after --race-after passes, a fixed budget under this share of the best fixed "
                             "budget's tokens/s so far runs no more passes (plain and auto always run)")
    parser.add_argument("--race-after", type=int, default=2)
    parser.add_argument("--against", help="a git revision whose budget policy (and scheduler) also runs, as auto@REV")
    parser.add_argument("--json")
    args = parser.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    budgets = ["auto"] + ([f"auto@{args.against}"] if args.against else []) + [parse_budget(b) for b in args.budgets.split(",")]
    config = ModelPairConfig(model=args.model, budget="auto", max_num_seqs=max(levels),
                             max_step_tokens=args.max_step_tokens, lookup=args.lookup)
    started = time.perf_counter()
    engine = Engine.from_config(config)
    print(f"engine ready in {time.perf_counter() - started:.1f} s; T(r) ms: "
          + ", ".join(f"{r}: {1000 * s:.0f}" for r, s in engine.scheduler.policy.verify.points.items()), flush=True)
    others = {}  # label -> a scheduler of another revision
    if args.against:
        others[f"auto@{args.against}"] = beside(engine, scheduler_at(args.against), engine.scheduler.policy.verify.points)
    render = lambda texts: [engine.render_chat([{"role": "user", "content": t}]) for t in texts]  # noqa: E731
    # warm-up: kernels, and the policy's first look
    load_bench.run_inprocess(engine, render(mixed_prompts(args.per_file)), "auto", 4, args.warm_up, 32)
    for other in others.values():
        with running(engine, other):
            load_bench.run_inprocess(engine, render(mixed_prompts(args.per_file)), "auto", 4, args.warm_up, 32)
    freeze_startup()  # as a replica does: one engine for the process's life
    files = tuple(args.files.split(","))
    prompts = render(mixed_prompts(args.per_file, files))

    tables = []
    for i, c in enumerate(levels):
        requests = min(args.max_requests, max(args.min_requests, int(round(c * args.requests_per_stream))))
        lengths = spread_lengths(args.max_tokens, args.length_spread, requests)
        cuts = slices(requests, c, args.slices)
        runs, active, turn = {b: [] for b in budgets}, list(budgets), i  # runs: each budget's row per pass
        for _ in range(args.settle):
            for label in ["auto", *others]:
                run(engine, others, prompts, label, c, c, lengths)
        for p in range(args.passes):
            if args.race and p >= args.race_after:
                active = raced(active, {b: total(runs[b]) for b in active}, args.race)
            done = {}
            for lo, hi in cuts:
                order = active[turn % len(active):] + active[: turn % len(active)]
                for budget in (order if turn % 2 == 0 else order[::-1]):
                    r = run(engine, others, [prompts[j % len(prompts)] for j in range(lo, hi)], budget,
                            c, hi - lo, lengths[lo:hi] if isinstance(lengths, list) else lengths)
                    done[budget] = merge(done[budget], r) if budget in done else r
                turn += 1
            for budget in active:
                r = done[budget]
                print(f"  streams {c} budget {budget} pass {p + 1}: {r.tokens_per_s:.1f} tok/s "
                      f"(every stream busy: {r.busy_tokens_per_s:.1f}), tau {r.tau or 0:.2f}", flush=True)
                runs[budget].append(r)
        tables.append((c, runs, [total(runs[b]) for b in budgets]))
        print(table(*tables[-1]), flush=True)

    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {engine.config.dtype}, "
          f"weights {engine.config.weights}; {len(prompts)} prompts ({' / '.join(files)} "
          f"interleaved), {args.max_tokens} new tokens"
          + (f" (each request's drawn from x [{1 - args.length_spread:g}, {1 + args.length_spread:g}])"
             if args.length_spread else "") + ", greedy")
    for c, runs, rows in tables:
        print(table(c, runs, rows))
    if len(tables) > 1:
        print(whole_run(tables))
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"streams": c, "rows": [dict(r.summary(), passes=len(runs[r.budget])) for r in rows]}
             for c, runs, rows in tables], indent=2))


def run(engine, others: dict, prompts, budget, streams: int, requests: int, max_tokens) -> load_bench.LoadRow:
    """load_bench.run_inprocess at `budget`, or as "auto" on another revision's scheduler where
    `budget` names one of `others` (the row keeps that name)."""
    if budget not in others:
        return load_bench.run_inprocess(engine, prompts, budget, streams, requests, max_tokens)
    with running(engine, others[budget]):
        row = load_bench.run_inprocess(engine, prompts, "auto", streams, requests, max_tokens)
    row.budget = budget
    return row


def whole_run(tables: list) -> str:
    """Every concurrency's load in turn, as one server meets them: each budget's seconds for the
    tokens auto emitted at each concurrency, at that budget's own tokens/s there (one raced out
    early: at the rate of its passes), and auto against it -- the policy against one fixed
    budget for every load. `tables`: (streams, runs, rows) per concurrency, auto's row first."""
    work = {c: rows[0].tokens for c, _, rows in tables}
    seconds: dict = {}
    for c, _, rows in tables:
        for r in rows:
            seconds[r.budget] = seconds.get(r.budget, 0.0) + work[c] / r.tokens_per_s
    tokens = sum(work.values())
    lines = [f"\nthe whole run ({', '.join(str(c) for c in work)} streams in turn; each budget at its own tokens/s "
             "at each):", "| budget | seconds | tokens/s | auto vs it |", "| --- | --- | --- | --- |"]
    for budget, s in seconds.items():
        lines.append(f"| {budget} | {s:.1f} | {tokens / s:.1f} | {s / seconds['auto']:.2f}x |")
    return "\n".join(lines)


def spread_lengths(max_tokens: int, spread: float, requests: int) -> int | list[int]:
    """Each request's max tokens: `max_tokens` for all, or drawn uniformly (seed 7) from
    max_tokens x [1 - spread, 1 + spread], one list that every budget runs alike."""
    if not spread:
        return max_tokens
    rng = random.Random(7)
    low, high = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))
    return [rng.randint(low, high) for _ in range(requests)]


def slices(requests: int, streams: int, k: int) -> list[tuple[int, int]]:
    """A pass's requests 0 .. requests - 1 as at most k runs of consecutive requests, each at
    least 3 x streams long (fewer runs where the pass is too short), as even as they divide."""
    k = max(1, min(k, requests // (3 * streams)))
    cuts = [round(requests * j / k) for j in range(k + 1)]
    return list(zip(cuts, cuts[1:]))


def raced(active: list, rows: dict, share: float) -> list:
    """The budgets that run the next pass: auto, plain decoding, and each fixed budget whose
    tokens/s so far is at least `share` of the best fixed budget's."""
    best = max(rows[b].tokens_per_s for b in active if not _auto(b))
    return [b for b in active if _auto(b) or b == 0 or rows[b].tokens_per_s >= share * best]


def _auto(budget) -> bool:
    """auto, or another revision's auto."""
    return isinstance(budget, str) and budget.startswith("auto")


def total(passes: list[load_bench.LoadRow]) -> load_bench.LoadRow:
    """One cell of several passes (left as they are): their tokens over their seconds."""
    cell = copy.deepcopy(passes[0])
    for later in passes[1:]:
        merge(cell, later)
    return cell


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


def table(streams: int, runs: dict, rows: list[load_bench.LoadRow]) -> str:
    """The cells as a markdown table. "Best fixed" is the best of the fixed budgets that ran every
    pass; one raced out after n passes is weighed against auto's first n passes, on a line below."""
    auto, passes = rows[0], {b: len(r) for b, r in runs.items()}
    fixed = [r for r in rows[1:] if passes[r.budget] == passes["auto"] and not _auto(r.budget)]
    against = [r for r in rows[1:] if _auto(r.budget)]
    best = max(fixed, key=lambda r: r.tokens_per_s)
    busiest = max(fixed, key=lambda r: r.busy_tokens_per_s)
    plain = next((r for r in fixed if r.budget == 0), None)
    lines = [f"\n{streams} streams, {auto.requests} requests in {passes['auto']} passes: auto = "
             f"{auto.tokens_per_s / best.tokens_per_s:.2f}x the best fixed budget ({best.budget})"
             + (f", {auto.tokens_per_s / plain.tokens_per_s:.2f}x plain" if plain else "")
             + f"; every stream busy: {auto.busy_tokens_per_s / busiest.busy_tokens_per_s:.2f}x ({busiest.budget})"
             + "".join(f"; {auto.tokens_per_s / r.tokens_per_s:.2f}x {r.budget} (every stream busy: "
                       f"{auto.busy_tokens_per_s / r.busy_tokens_per_s:.2f}x)" for r in against),
             "| budget | passes | tokens/s | vs best fixed | every stream busy: tokens/s | vs best fixed | tau "
             "| granted budgets (rounds) | predicted / realized accepted |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        granted = ", ".join(f"{b}: {n}" for b, n in sorted(r.granted.items(), key=lambda kv: str(kv[0])))
        ratio = f"{r.predicted:.0f} / {r.accepted} = {r.predicted / r.accepted:.2f}" if r.accepted else "-"
        lines.append(f"| {r.budget} | {passes[r.budget]} | {r.tokens_per_s:.1f} | {r.tokens_per_s / best.tokens_per_s:.2f}x | "
                     f"{r.busy_tokens_per_s:.1f} | {r.busy_tokens_per_s / busiest.busy_tokens_per_s:.2f}x | "
                     f"{r.tau or 0:.2f} | {granted} | {ratio if _auto(r.budget) else '-'} |")
    for r in rows[1:]:
        n = passes[r.budget]
        if n < passes["auto"]:
            same = total(runs["auto"][:n])
            lines.append(f"- budget {r.budget} raced out after {n} passes: auto over those passes "
                         f"{same.tokens_per_s / r.tokens_per_s:.2f}x it")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
