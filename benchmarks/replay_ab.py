"""The judged A/B's workload (benchmarks/budget_policy.py), replayed (ddtree.simulate): `budget:
auto`'s tokens/s and predicted over realized accepted tokens where the machine measured them,
without a clock.

budget_policy.py runs the first `--per-file` prompts of gsm8k-test, humaneval and vicuna-bench,
interleaved -- the trace's first 3 x per-file sequences, recorded in the same order -- with
lookup on, c x `--requests-per-stream` requests at c streams (12 to 64), each request's max
tokens drawn (seed 7) from max-tokens x [1 - spread, 1 + spread]. Greedy, so a request of max
tokens L commits the first L tokens of its trace sequence. Each concurrency replays those
requests on a fresh scheduler; `--warm`: one policy through the A/B's warm-up (12 auto requests
at 4 streams, 32 tokens) and then every concurrency in turn, as the A/B's one engine keeps it.

Beside each concurrency's totals: predicted / realized over a sequence's drafted rounds 1-3,
4-10 and past 10, where a short request (the A/B's: 32-96 tokens) spends most of its rounds
early and the replayed table's 128-token ones (simulate_policies.py) the most late. A round
counts if it verified any node: its tree was drafted (priced at the drafter's calibrated
probabilities and the sequence's factor, `BudgetPolicy.curve`), or the plan left the sequence
out and it verified its lookup chain alone (priced at the chain's own probabilities,
`BudgetPolicy.chain_curve`); each age's two kinds are reported apart after it.

    python benchmarks/replay_ab.py [--cost cpu-epyc-2core] [--concurrency 1,4,16,64] [--warm]
        [--per-file 4] [--max-tokens 64] [--length-spread 0.5] [--requests-per-stream 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ddtree.simulate import CostModel, Trace, replay_scheduler, simulate
from ddtree.workers.policy import BudgetPolicy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from budget_policy import spread_lengths  # noqa: E402

AGES = ((3, "rounds 1-3"), (10, "rounds 4-10"), (1 << 30, "rounds 11+"))  # a sequence's drafted rounds, by its count
KINDS = ("drafted", "chain alone")  # a round's tree: the drafter's (lookup merged in), or the lookup chain alone


def workload(trace: Trace, prompts: int, requests: int, lengths: int | list[int]) -> tuple[Trace, Trace]:
    """The A/B's requests as two traces, request j the trace's sequence j mod `prompts`: what they
    commit (completions cut to their max tokens), and the sequences the replay target and drafter
    answer from (whole: a request's prompt is matched to the longest continuation it has)."""
    lengths = lengths if isinstance(lengths, list) else [lengths] * requests
    whole = [trace.sequences[j % prompts] for j in range(requests)]
    cut = [dataclasses.replace(s, completion=s.completion[:n], max_tokens=n) for s, n in zip(whole, lengths)]
    return Trace(cut, trace.meta), Trace(whole, trace.meta)


def replay(trace: Trace, prompts: int, cost: CostModel, streams: int, requests: int, lengths, policy: BudgetPolicy):
    """One A/B cell of auto -> (SimRow, {(age label, kind): [predicted, accepted]})."""
    committed, answered = workload(trace, prompts, requests, lengths)
    by_age = {(label, kind): [0.0, 0] for _, label in AGES for kind in KINDS}

    def seen(i, result):
        drafted = 0
        for r in result.rounds:
            if r.predicted is None or r.tree_size <= 1:
                continue
            drafted += 1
            label = next(label for most, label in AGES if drafted <= most)
            kind = KINDS[0] if r.draft_s > 0 else KINDS[1]  # a chain alone had no drafter pass
            by_age[label, kind][0] += r.predicted
            by_age[label, kind][1] += r.accepted

    scheduler = replay_scheduler(answered, cost, streams, lookup=True, policy=policy)
    return simulate(committed, cost, "auto", streams, requests, lookup=True, scheduler=scheduler,
                    on_result=seen), by_age


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(ROOT / "benchmarks/traces/mixed-36x128.npz"))
    parser.add_argument("--cost", default="cpu-epyc-2core")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--per-file", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--length-spread", type=float, default=0.5)
    parser.add_argument("--requests-per-stream", type=float, default=2.0)
    parser.add_argument("--warm", action="store_true", help="one policy through the warm-up and every concurrency")
    args = parser.parse_args()

    trace = Trace.load(args.trace)
    prompts = 3 * args.per_file
    longest = round(args.max_tokens * (1 + args.length_spread))
    if any(s.finish_reason == "length" and len(s.completion) < longest for s in trace.sequences[:prompts]):
        parser.error(f"the trace's completions stop short of {longest} tokens")
    cost = CostModel.load(ROOT / "benchmarks/costs" / f"{args.cost}.json")
    policy = BudgetPolicy()
    if args.warm:  # the A/B's warm-up
        replay(trace, prompts, cost, 4, 12, 32, policy)
    print(f"{args.cost}, {prompts} prompts, {args.max_tokens} x [{1 - args.length_spread:g}, "
          f"{1 + args.length_spread:g}] tokens, lookup, {'one warm policy' if args.warm else 'a fresh policy a cell'}")
    print(f"rounds by age: predicted / realized (accepted tokens), all / {KINDS[0]} / {KINDS[1]}")
    print("| streams | tokens/s | tau | predicted / realized | " + " | ".join(label for _, label in AGES) + " |")
    print("| --- | --- | --- | --- |" + " --- |" * len(AGES))
    for c in (int(x) for x in args.concurrency.split(",")):
        requests = min(64, max(12, round(c * args.requests_per_stream)))
        lengths = spread_lengths(args.max_tokens, args.length_spread, requests)
        row, by_age = replay(trace, prompts, cost, c, requests, lengths, policy if args.warm else BudgetPolicy())
        ages = []
        for _, label in AGES:
            parts = [by_age[label, kind] for kind in KINDS]
            ages.append(" / ".join(f"{p / a:.2f} ({a})" if a else "-" for p, a in
                                   [[sum(x[0] for x in parts), sum(x[1] for x in parts)]] + parts))
        print(f"| {c} | {row.tokens_per_s:.1f} | {row.tau or 0:.2f} | {row.predicted / max(row.accepted, 1):.3f} | "
              + " | ".join(ages) + " |")


if __name__ == "__main__":
    main()
