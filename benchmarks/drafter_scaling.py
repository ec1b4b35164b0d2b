"""Held-out tau against training steps: every snapshot a `train-drafter` run kept
(WORKDIR/train/snapshots/step-N, one per TrainConfig.snapshot_every = 1000 steps), on the same prompts and the
same reference continuations, plus the training-set accuracy the run logged at those steps.

    python benchmarks/drafter_scaling.py --workdir runs/smollm2 --prompts benchmarks/data/gsm8k-test.jsonl \
        [--limit 20] [--max-tokens 128] [--budgets chain,8,16,32,64] [--json OUT] [--plot OUT.png]

A curve still climbing at the last step says the drafter is short of steps; a training accuracy
far above the held-out one says it is short of data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ddtree.bench import read_prompts
from ddtree.config import parse_budget
from ddtree.training.evaluate import drafts_report, reference_continuations
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--model")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="chain,8,16,32,64")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    target = load_target(args.model, torch.float32)
    budgets = [parse_budget(b.strip()) for b in args.budgets.split(",")]
    snapshots = sorted((Path(args.workdir) / "train" / "snapshots").glob("step-*"))
    if not snapshots:
        raise SystemExit(f"no snapshots under {args.workdir}/train/snapshots")
    requests, outputs = reference_continuations(target, read_prompts(args.prompts, args.limit), args.max_tokens)
    history = torch.load(Path(args.workdir) / "train" / "checkpoint.pt", weights_only=False)["state"]["history"]
    train_acc = {step: acc for step, _, acc in history}
    rows = []
    for snap in snapshots:
        step = int(snap.name.split("-")[1])
        report = drafts_report(target, DFlashDrafter.load(snap, target.model), requests, outputs, budgets)
        rows.append({"step": step, "tau": report["tau"], "accuracy": report["accuracy"], "train_acc1": train_acc.get(step)})
    print(f"{len(requests)} prompts from {args.prompts}, {args.max_tokens} tokens, greedy")
    print("| step | " + " | ".join(f"tau {b}" for b in map(str, budgets)) + " | held-out acc@1 | train acc@1 (EMA) |")
    print("| --- |" + " --- |" * (len(budgets) + 2))
    for r in rows:
        train = f"{r['train_acc1']:.2f}" if r["train_acc1"] is not None else "-"
        print(f"| {r['step']} | " + " | ".join(f"{t:.2f}" for t in r["tau"].values()) + f" | {r['accuracy'][0]:.2f} | {train} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        steps = [r["step"] for r in rows]
        for b in map(str, budgets):
            ax1.plot(steps, [r["tau"][b] for r in rows], marker="o", label=f"budget {b}")
        ax1.set(xlabel="training step", ylabel="held-out tau", title=Path(args.prompts).stem)
        ax1.legend()
        ax2.plot(steps, [r["accuracy"][0] for r in rows], marker="o", label="held-out (eval prompts)")
        ax2.plot(steps, [r["train_acc1"] for r in rows], marker="s", label="training batches (EMA)")
        ax2.set(xlabel="training step", ylabel="top-1 accuracy, block position 1")
        ax2.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
