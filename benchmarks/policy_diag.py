"""Where `budget: auto` misjudges a step: per step, the policy's predicted seconds (verify, draft,
the rest) and accepted tokens for what it chose, against the realized ones, grouped by batch size,
tree size and whether the step drafted, with each group's step-level tokens/s.

Same engine and prompts as benchmarks/budget_policy.py (mixed gsm8k-test / humaneval /
vicuna-bench, lookup on, the same warm-up); the policy's own methods are wrapped to record what
it predicted, nothing in its decisions changes.

    python benchmarks/policy_diag.py [--concurrency 1,64] [--budgets auto,0] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from budget_policy import FILES, mixed_prompts  # noqa: E402

from ddtree import load_bench  # noqa: E402
from ddtree.config import ModelPairConfig, parse_budget  # noqa: E402
from ddtree.engine import Engine  # noqa: E402


SIZES = ((0, "0"), (3, "1-3"), (9, "4-9"), (15, "10-15"), (float("inf"), "16+"))  # (most nodes, group)
ORDER = [name for _, name in SIZES]


def size_group(nodes: int) -> str:
    return next(name for most, name in SIZES if nodes <= most)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--budgets", default="auto,0", help="auto's groups are printed; the others for their tokens/s")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--files", default=",".join(FILES), help="the prompt files (benchmarks/data), mixed")
    args = parser.parse_args()
    engine = Engine.from_config(ModelPairConfig(budget="auto", max_num_seqs=64, lookup=True))
    policy = engine.scheduler.policy
    prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in mixed_prompts(4, tuple(args.files.split(",")))]
    load_bench.run_inprocess(engine, prompts, "auto", 4, 12, 32)

    step: dict = {}  # what the policy predicted for the step under way
    groups = collections.defaultdict(list)
    plan, choose, observe_round, observe_step = policy.plan, policy.choose, policy.observe_round, policy.observe_step
    rest = policy.rest

    def rested(estimates):  # a plain step that measures T(B) (`baseline_due`), not a plan's choice
        out = rest(estimates)
        step.clear()
        step["why"] = "baseline"
        return out

    def planned(batch, fixed_drafting, buckets, estimates, fixed_nodes=0):
        out = plan(batch, fixed_drafting, buckets, estimates, fixed_nodes)
        step.clear()
        context = sum(e.context for e, d in zip(estimates, out) if d)
        step["draft"] = policy.draft.predict(sum(out)) + policy.context_row_s * context if any(out) else 0.0
        step["why"] = ("probe" if len(policy.probed) == sum(out) else "plan+probe" if policy.probed else "plan") if any(out) else "-"
        return out

    def chosen(batch, buckets, curves, draft_s, fixed_nodes=0):
        decision = choose(batch, buckets, curves, draft_s, fixed_nodes)
        nodes = sum(decision.nodes)
        step["verify"] = policy.verify_s(batch, 2, nodes) if nodes else policy.verify.predict(batch)
        step["other"] = policy._other(2 if nodes else 1).predict(batch)
        return decision

    def rounded(estimate, tree, gains, path):
        predicted = observe_round(estimate, tree, gains, path)
        step["accepted"] = step.get("accepted", 0) + len(path) - 1
        step["predicted"] = step.get("predicted", 0.0) + predicted
        return predicted

    def observed(batch, q, verify_s, drafting, draft_s, other_s, nodes=0, context=0):
        key = (batch, size_group(nodes), step.get("why", "-"))
        groups[key].append((step.get("verify", policy.verify.predict(batch)), verify_s, step.get("draft", 0.0), draft_s,
                            step.get("other", policy._other(q).predict(batch)), other_s,
                            step.get("predicted", 0.0), step.get("accepted", 0), batch))
        step.clear()
        return observe_step(batch, q, verify_s, drafting, draft_s, other_s, nodes, context)

    policy.plan, policy.choose, policy.observe_round, policy.observe_step = planned, chosen, rounded, observed
    policy.rest = rested
    med = statistics.median
    for c in (int(x) for x in args.concurrency.split(",")):
        for budget in (parse_budget(b) for b in args.budgets.split(",")):
            groups.clear()
            r = load_bench.run_inprocess(engine, prompts, budget, c, max(12, 4 * c) if c < 16 else 2 * c, args.max_tokens)
            print(f"streams {c} budget {budget}: {r.tokens_per_s:.1f} tok/s, tau {r.tau or 0:.2f}, "
                  f"accepted predicted / realized {r.predicted:.0f} / {r.accepted}", flush=True)
            print(f"  row factors (B = 1 / 4 / 16) {policy.row_factor(1):.2f} / {policy.row_factor(4):.2f} / "
                  f"{policy.row_factor(16):.2f}, bias drafted / lookup alone {policy.bias():.2f} / "
                  f"{policy.bias(drafted=False):.2f}, D(1) {policy.draft.predict(1) * 1e3:.1f} ms, "
                  f"c {policy.context_row_s * 1e6:.1f} us a context row, trees weighed at (B = 1 / 4 / 16 / 64) "
                  + " / ".join(f"{policy.tree_rate(b):.2f}" for b in (1, 4, 16, 64)))
            print("  | B | nodes | drafted (why) | steps | verify ms | draft ms | rest ms | accepted | tokens/s |")
            for (batch, nodes, drafted), v in sorted(groups.items(), key=lambda kv: (kv[0][0], ORDER.index(kv[0][1]), kv[0][2])):
                if len(v) < 3 and drafted == "-" and nodes == "0":  # the steps with trees are few and each worth seeing
                    continue
                pair = lambda i: f"{med(x[i] for x in v) * 1e3:.1f} / {med(x[i + 1] for x in v) * 1e3:.1f}"  # noqa: E731
                seconds = sum(x[1] + x[3] + x[5] for x in v)
                print(f"  | {batch} | {nodes} | {drafted} | {len(v)} | {pair(0)} | {pair(2)} | {pair(4)} | "
                      f"{sum(x[6] for x in v) / len(v):.2f} / {sum(x[7] for x in v) / len(v):.2f} | "
                      f"{sum(x[8] + x[7] for x in v) / seconds:.1f} |")
            # every step, the small groups too: where the pass's step time went, by why it drafted
            totals = collections.defaultdict(lambda: [0, 0.0, 0.0])
            for (batch, nodes, drafted), v in groups.items():
                kind = drafted if drafted != "-" else ("plain" if nodes == "0" else "lookup alone")
                for x in v:
                    totals[kind][0] += 1
                    totals[kind][1] += x[1] + x[3] + x[5]
                    totals[kind][2] += x[8] + x[7]
            print("  all steps by why: " + ", ".join(
                f"{kind} {n} steps {s:.2f} s {t / s:.1f} tok/s" for kind, (n, s, t) in sorted(totals.items())))


if __name__ == "__main__":
    main()
