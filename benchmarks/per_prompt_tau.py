"""tau per prompt for one or more drafters on the same reference continuations, and over two
groups of the prompts: the ones given with --mark and the rest. What it is for: telling whether a
drafter's gain on a judged file comes from a few prompts -- e.g. judged prompts whose topic a
training prompt shared (RESULTS.md, 2026-12-05, thirty-sixth session) -- or from all of them.

    python benchmarks/per_prompt_tau.py --drafter runs/s36-export --drafter ddtree/drafters/smollm2-135m-instruct \
        --prompts benchmarks/data/vicuna-bench.jsonl --limit 20 --budget 16 --mark 2,6,16,19 [--json OUT]

Prompt numbers count from 0 in file order. A group's tau is its tokens over its rounds (as
`eval-drafter` computes a file's), not a mean of per-prompt taus.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ddtree.bench import read_prompts
from ddtree.config import parse_budget
from ddtree.training.evaluate import _drafts_along, _rounds, reference_continuations
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, help="a drafter folder (repeatable)")
    parser.add_argument("--prompts", required=True, help="a held-out JSONL")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget", default="16")
    parser.add_argument("--mark", default="", help="comma-separated prompt numbers (from 0) to total apart")
    parser.add_argument("--model")
    parser.add_argument("--json")
    args = parser.parse_args()
    target = load_target(args.model, torch.float32)
    budget = parse_budget(args.budget)
    marked = {int(i) for i in args.mark.split(",") if i.strip()}
    requests, outputs = reference_continuations(target, read_prompts(args.prompts, args.limit), args.max_tokens)
    if bad := marked - set(range(len(requests))):
        parser.error(f"--mark {sorted(bad)}: only prompts 0-{len(requests) - 1} are measured")
    k = 1 if budget == "chain" else budget
    rounds = {}  # drafter -> rounds per prompt
    for directory in args.drafter:
        drafter = DFlashDrafter.load(directory, target.model)
        rounds[directory] = [_rounds(_drafts_along(target, drafter, r.prompt, o, k), o, budget)
                             for r, o in zip(requests, outputs)]
    emitted = [len(o) - 1 for o in outputs]

    def tau(directory: str, which) -> float:
        n = sum(rounds[directory][i] for i in which)
        return sum(emitted[i] for i in which) / n if n else 0.0

    def change(taus: list[float]) -> str:  # the last drafter against the first
        return f"{taus[-1] / taus[0] - 1:+.1%}" if taus[0] else "-"

    names = [Path(d).name for d in args.drafter]
    print(f"tau at budget {args.budget}, greedy, {args.max_tokens} tokens; marked: {sorted(marked)}")
    print("| prompt | tokens | " + " | ".join(names) + " | change |")
    print("| --- | --- |" + " --- |" * (len(names) + 1))
    every = range(len(requests))
    for i in every:
        taus = [tau(d, [i]) for d in args.drafter]
        print(f"| {i}{' *' if i in marked else ''} | {emitted[i]} | " + " | ".join(f"{t:.2f}" for t in taus)
              + f" | {change(taus)} |")
    groups = {"all": list(every), "marked": sorted(marked), "the rest": [i for i in every if i not in marked]}
    report = {}
    for name, which in groups.items():
        if not which:
            continue
        taus = [tau(d, which) for d in args.drafter]
        report[name] = dict(zip(args.drafter, taus))
        print(f"| **{name}** ({len(which)}) | {sum(emitted[i] for i in which)} | "
              + " | ".join(f"{t:.2f}" for t in taus) + f" | {change(taus)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"budget": args.budget, "prompts": args.prompts, "limit": args.limit,
                                               "marked": sorted(marked), "emitted": emitted, "rounds": rounds,
                                               "tau": report}, indent=2) + "\n")


if __name__ == "__main__":
    main()
