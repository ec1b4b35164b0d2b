"""Does `budget: auto` price the trees it leaves out as well as the ones it verifies? After auto has
learned on the mixed prompts, a fixed budget runs (every sequence drafts that many nodes every
round) and each of its rounds' trees is priced by auto's own model -- the batch-wide factors per
node class (workers.policy: `tree_gains`, `factors`), at the batch's factor 1 -- beside
auto's own trees, priced alike. Predicted against realized accepted tokens,
binned by the predicted, split by whether the tree holds a lookup chain, with the accepted
tokens by source (drafter / lookup / both).

The policy learns its factors from every node of the trees it drafts (once the committed tokens
decide their paths), so the fixed budget's trees should take what they are priced at; a bin
where they take more is a gain the plan never sees. Nothing in the policy's decisions changes: the
pricing wraps `accepted_sources`, which the scheduler calls once a round.

Same engine and prompts as benchmarks/budget_policy.py (mixed gsm8k-test / humaneval /
vicuna-bench, lookup on, each request's max tokens drawn from 64 x [0.5, 1.5]).

    python benchmarks/policy_calibration.py [--concurrency 4] [--budget 4] [--requests 24] [--repeats 2]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from budget_policy import mixed_prompts, spread_lengths  # noqa: E402

from ddtree import load_bench  # noqa: E402
from ddtree.config import ModelPairConfig, parse_budget  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.workers import policy as policy_module  # noqa: E402
from ddtree.workers import scheduler as scheduler_module  # noqa: E402

EDGES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, float("inf"))  # upper edges of the predicted accepted tokens' bins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--budget", default="4", help="the fixed budget whose trees auto prices")
    parser.add_argument("--requests", type=int, default=24, help="requests per run (each budget, each repeat)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    engine = Engine.from_config(ModelPairConfig(budget="auto", max_num_seqs=64, lookup=True))
    policy = engine.scheduler.policy
    prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in mixed_prompts(4)]
    lengths = spread_lengths(64, 0.5, args.requests)

    pricing: dict = {"budget": None}  # the budget whose rounds are priced now (None: none)
    priced = collections.defaultdict(list)  # budget -> (predicted, realized, nodes, has a chain, sources)
    sources = scheduler_module.accepted_sources

    def priced_sources(tree, path):
        out = sources(tree, path)
        if pricing["budget"] is not None and tree.size > 1:
            chain = tree.on_chain()
            chain = chain[1:].tolist() if chain is not None else [False] * (tree.size - 1)
            source = tree.sources[1:].tolist() if tree.sources is not None else [0] * (tree.size - 1)
            predicted = policy_module.tree_gains(tree.scores[1:].exp().tolist(), tree.depths[1:].tolist(), source,
                                                 policy.factors())[-1]
            priced[pricing["budget"]].append((predicted, len(path) - 1, tree.size - 1, any(chain), out))
        return out

    scheduler_module.accepted_sources = priced_sources
    load_bench.run_inprocess(engine, prompts, "auto", 4, 12, 32)  # warm-up: kernels, and the policy's first look
    fixed = parse_budget(args.budget)
    for repeat in range(args.repeats):
        load_bench.run_inprocess(engine, prompts, "auto", args.concurrency, args.requests, lengths)  # auto learns
        for budget in ("auto", fixed):
            pricing["budget"] = budget
            r = load_bench.run_inprocess(engine, prompts, budget, args.concurrency, args.requests, lengths)
            pricing["budget"] = None
            print(f"repeat {repeat + 1} budget {budget}: {r.tokens_per_s:.1f} tokens/s, tau {r.tau or 0:.2f}", flush=True)

    for budget, rows in priced.items():
        for chained in (False, True):
            group = [row for row in rows if row[3] == chained]
            if not group:
                continue
            print(f"\nbudget {budget}, trees {'with' if chained else 'without'} a lookup chain: {len(group)}, accepted "
                  f"predicted {sum(row[0] for row in group):.0f}, realized {sum(row[1] for row in group)}")
            print("| predicted | trees | mean nodes | mean predicted | mean realized | realized / predicted | "
                  "accepted: drafter / lookup / both |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            low = 0.0
            for high in EDGES:
                cell = [row for row in group if low <= row[0] < high]
                if cell:
                    predicted = sum(row[0] for row in cell) / len(cell)
                    realized = sum(row[1] for row in cell) / len(cell)
                    by_source = " / ".join(str(sum(row[4][j] for row in cell)) for j in range(3))
                    print(f"| {low:g}-{high:g} | {len(cell)} | {sum(row[2] for row in cell) / len(cell):.1f} | "
                          f"{predicted:.2f} | {realized:.2f} | {realized / max(predicted, 1e-9):.2f} | {by_source} |")
                low = high
    print("\nbatch-wide factors per bin (p >= .5, .2-.5, .05-.2, below): "
          + ", ".join(f"{f:.2f}" for f in policy.factors()))


if __name__ == "__main__":
    main()
