"""`budget: auto` against the fixed budgets and another revision's auto, replayed (ddtree.simulate)
under every shipped cost model: the table that judges the budget policy without a clock.

For each cost model and concurrency: plain decoding (budget 0), the fixed budgets, this tree's
auto, and auto as git revision REV's scheduler and policy have it (benchmarks/policy_revision.py)
-- each on a fresh scheduler over the trace, max(2 x streams, the trace's sequences) requests.
Reported: tokens/s (virtual, the same on every machine and every run), each auto over the best
fixed budget and over plain, its predicted / realized accepted tokens, and the drafted nodes a
round it granted to the sequences that accept well (the top half of the trace's sequences by
their tokens per round at the largest fixed budget, on that cost model at one stream).

    python benchmarks/simulate_policies.py [--trace benchmarks/traces/mixed-36x128.npz]
        [--costs cpu-epyc-2core,h200-smollm2,qwen3-8b-gpu] [--concurrency 1,4,16,64]
        [--budgets 0,chain,16,64] [--against main] [--out benchmarks/results/simulate-v2-DATE]
        [--fixed benchmarks/results/simulate-mixed-36x128-2026-12-07.json]

`--fixed FILE` takes the fixed budgets' cells from an earlier `ddtree simulate --json` of the same
trace (replays are deterministic, and a fixed budget's steps do not depend on the policy), so only
the autos replay, and the largest fixed budget at one stream (for the well-accepting sequences).
`--lookup`: every policy but plain and the chain with lookup branches in its trees (workers.lookup),
as the judged A/B on a real machine runs (benchmarks/budget_policy.py --lookup); its fixed cells
replay too (a `--fixed` file holds cells without lookup).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from ddtree.config import parse_budget
from ddtree.simulate import CostModel, SimRow, Trace, replay_scheduler, simulate


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from policy_revision import scheduler_at  # noqa: E402


def cell(trace, cost, budget, streams, scheduler_class=None, lookup=False):
    """One replayed cell -> (SimRow, per trace sequence [drafted nodes, drafted rounds, tokens, rounds])."""
    per: dict[int, list[int]] = {}

    def seen(i, result):
        p = per.setdefault(i, [0, 0, 0, 0])
        for r in result.rounds:
            if r.tree_size > 1:
                p[0] += r.tree_size - 1
                p[1] += 1
        p[2] += len(result.tokens)
        p[3] += len(result.rounds)

    scheduler = None
    if scheduler_class is not None:
        scheduler = replay_scheduler(trace, cost, streams, lookup=lookup, calibrate=True,
                                     scheduler_class=scheduler_class)
    return simulate(trace, cost, budget, streams, lookup=lookup, scheduler=scheduler, on_result=seen), per


def recorded(rows: list[dict], budget, streams: int) -> SimRow:
    """The cell of an earlier `ddtree simulate --json` (its SimRow summaries)."""
    r = next(r for r in rows if str(r["budget"]) == str(budget) and r["concurrency"] == streams)
    row = SimRow(budget, streams, cost=r["cost"])
    for name in ("requests", "tokens", "seconds", "rounds", "round_tokens", "drafted_rounds", "drafted_nodes",
                 "predicted", "accepted", "busy_tokens", "busy_seconds"):
        setattr(row, name, r[name])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(ROOT / "benchmarks/traces/mixed-36x128.npz"))
    parser.add_argument("--costs", default="cpu-epyc-2core,h200-smollm2,qwen3-8b-gpu")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--budgets", default="0,chain,16,64")
    parser.add_argument("--against", default="main", help="a git revision whose auto runs beside (empty: none)")
    parser.add_argument("--fixed", help="an earlier `ddtree simulate --json` of this trace: its fixed budgets' cells")
    parser.add_argument("--lookup", action="store_true", help="lookup branches in the trees (not with --fixed)")
    parser.add_argument("--out", default=str(ROOT / f"benchmarks/results/simulate-v2-{datetime.date.today()}"))
    args = parser.parse_args()
    if args.lookup and args.fixed:
        parser.error("--fixed cells were replayed without lookup: with --lookup every cell replays")

    trace = Trace.load(args.trace)
    levels = [int(c) for c in args.concurrency.split(",")]
    fixed = [parse_budget(b) for b in args.budgets.split(",")]
    other = scheduler_at(args.against) if args.against else None
    label = f"auto@{args.against}"
    out, lines = [], []
    for name in args.costs.split(","):
        cost = CostModel.load(ROOT / "benchmarks/costs" / f"{name}.json")
        rows, well = {}, None
        earlier = [r for r in json.loads(Path(args.fixed).read_text()) if r["cost"] == name] if args.fixed else None
        for c in levels:
            for budget in fixed:
                if earlier is not None and not (c == levels[0] and budget == fixed[-1]):
                    rows[budget, c] = recorded(earlier, budget, c)
                    continue
                rows[budget, c], per = cell(trace, cost, budget, c, lookup=args.lookup)
                if c == levels[0] and budget == fixed[-1]:  # the sequences that accept well: top half by tau
                    ranked = sorted(per, key=lambda i: per[i][2] / per[i][3], reverse=True)
                    well = set(ranked[: len(ranked) // 2])
            autos = [("auto", None)] + ([(label, other)] if other else [])
            for tag, cls in autos:
                rows[tag, c], per = cell(trace, cost, "auto", c, cls, lookup=args.lookup)
                rows[tag, c].budget = tag
                mine = [per[i] for i in well or () if i in per]
                rows[tag, c].well_nodes = (sum(p[0] for p in mine) / max(1, sum(p[1] for p in mine)))
                print(f"{name} x{c} {tag}: {rows[tag, c].tokens_per_s:.1f} tokens/s", file=sys.stderr, flush=True)
        for c in levels:
            best = max((rows[b, c] for b in fixed), key=lambda r: r.tokens_per_s)
            plain = rows[0, c] if 0 in fixed else None
            for tag in ["auto"] + ([label] if other else []):
                r = rows[tag, c]
                out.append({"cost": name, "streams": c, "policy": tag, "tokens_per_s": r.tokens_per_s,
                            "best_fixed": str(best.budget), "best_fixed_tokens_per_s": best.tokens_per_s,
                            "over_best_fixed": r.tokens_per_s / best.tokens_per_s,
                            "over_plain": r.tokens_per_s / plain.tokens_per_s if plain else None,
                            "predicted_over_realized": r.predicted / r.accepted if r.accepted else None,
                            "tau": r.tau, "mean_nodes": r.mean_nodes, "well_accepting_nodes": r.well_nodes})
            for b in fixed:
                out.append({"cost": name, "streams": c, "policy": str(b), "tokens_per_s": rows[b, c].tokens_per_s,
                            "tau": rows[b, c].tau, "mean_nodes": rows[b, c].mean_nodes})
    autos = ["auto"] + ([label] if other else [])
    lines = [f"# `budget: auto` replayed: {Path(args.trace).name}, {datetime.date.today()}", "",
             "```bash", "python benchmarks/simulate_policies.py " + " ".join(sys.argv[1:]), "```", "",
             "auto over the best fixed budget (" + ", ".join(map(str, fixed)) + "), auto over plain in brackets; "
             "pred/real: predicted over realized accepted tokens; nodes: drafted nodes a drafted round (to the "
             "sequences that accept well, the top half by tau at the largest fixed budget at one stream)", "",
             "| cost model | policy | " + " | ".join(f"{c} streams" for c in levels) + " |",
             "| --- | --- |" + " --- |" * len(levels)]
    for name in args.costs.split(","):
        for tag in autos:
            cells = []
            for c in levels:
                r = next(x for x in out if x["cost"] == name and x["streams"] == c and x["policy"] == tag)
                cells.append(f"{r['over_best_fixed']:.3f}x ({r['over_plain']:.2f}x); pred/real "
                             f"{r['predicted_over_realized'] or 0:.2f}; nodes {r['mean_nodes']:.1f} "
                             f"({r['well_accepting_nodes']:.1f})")
            lines.append(f"| {name} | {tag} | " + " | ".join(cells) + " |")
    lines += ["", "tokens/s (virtual):", "", "| cost model | policy | " + " | ".join(f"{c} streams" for c in levels) + " |",
              "| --- | --- |" + " --- |" * len(levels)]
    for name in args.costs.split(","):
        for tag in autos + [str(b) for b in fixed]:
            cells = [next(f"{x['tokens_per_s']:.1f}" for x in out if x["cost"] == name and x["streams"] == c
                          and x["policy"] == tag) for c in levels]
            lines.append(f"| {name} | {tag} | " + " | ".join(cells) + " |")
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
