"""Held-out tau against training steps and data: every snapshot a `train-drafter` run kept
(WORKDIR/train/snapshots/step-N, one per TrainConfig.snapshot_every = 1000 steps), and the
drafter it started from when it continued one (`--init-from`), on the same prompts and the same
reference continuations, per prompt file (one domain each), plus the training-set accuracy the
run logged at those steps.

    python benchmarks/drafter_scaling.py --workdir runs/smollm2 --prompts benchmarks/data/gsm8k-test.jsonl \
        [--prompts benchmarks/data/humaneval.jsonl ...] [--limit 20] [--max-tokens 128] [--budgets chain,8,16] \
        [--prior-steps 4200 --prior-tokens 276017] [--start DRAFTER_DIR] [--json OUT] [--plot OUT.png]
    python benchmarks/drafter_scaling.py --replot OUT.json --plot OUT.png   # draw a saved run again

A continued run's steps count from the drafter it continued (`--prior-steps`, and the tokens it
had trained on, `--prior-tokens`, both from its model card): the x axis is every step the
drafter has taken, and each point says how many tokens of data it had seen by then. A curve still
climbing at the last step says the drafter is short of steps; a training accuracy far above the
held-out one says it is short of data; a jump where new data came in says more data pays.

Step 0 is the drafter the run continued, read from where the checkpoint says it was saved; if a
newer drafter has been saved there since (the run's own export, shipped in its place), give the
old one with `--start` (e.g. `git show` the previous commit's files into a folder).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ddtree.bench import read_prompts
from ddtree.config import parse_budget
from ddtree.training.data import load_sequences
from ddtree.training.evaluate import drafts_report, reference_continuations
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir")
    parser.add_argument("--prompts", action="append", help="a held-out JSONL (repeatable: one domain each)")
    parser.add_argument("--model")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="chain,8,16,32,64")
    parser.add_argument("--prior-steps", type=int, default=0, help="steps the continued drafter had taken")
    parser.add_argument("--prior-tokens", type=int, default=0, help="tokens of data the continued drafter had seen")
    parser.add_argument("--start", help="the drafter the run continued (default: where its checkpoint says)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from a saved --json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot)
        return
    if not (args.workdir and args.prompts):
        parser.error("--workdir and --prompts are required (or --replot)")
    target = load_target(args.model, torch.float32)
    budgets = [parse_budget(b.strip()) for b in args.budgets.split(",")]
    work = Path(args.workdir)
    state = torch.load(work / "train" / "checkpoint.pt", weights_only=False)["state"]
    points = [(int(s.name.split("-")[1]), s) for s in sorted((work / "train" / "snapshots").glob("step-*"))]
    if args.start or state.get("init_from"):
        points.insert(0, (0, Path(args.start or state["init_from"])))
    if not points:
        raise SystemExit(f"no snapshots under {work}/train/snapshots")
    sequences = load_sequences(work)
    tokens = sum(len(t) for t, _, _ in sequences[state["held_out"]:])  # this run's training data
    train_acc = {step: acc for step, _, acc in state["history"]}
    references = {Path(p).stem: reference_continuations(target, read_prompts(p, args.limit), args.max_tokens)
                  for p in args.prompts}
    rows = []
    for step, directory in points:
        drafter = DFlashDrafter.load(directory, target.model)
        row = {"step": args.prior_steps + step, "tokens": args.prior_tokens + (tokens if step else 0),
               "train_acc1": train_acc.get(step), "tau": {}, "accuracy": {}}
        for domain, (requests, outputs) in references.items():
            report = drafts_report(target, drafter, requests, outputs, budgets)
            row["tau"][domain], row["accuracy"][domain] = report["tau"], report["accuracy"]
        rows.append(row)
    print(f"first {args.limit} prompts of each file, {args.max_tokens} tokens, greedy")
    names = [f"{d} tau {b}" for d in references for b in map(str, budgets)]
    print("| step | data tokens | " + " | ".join(names) + " | train acc@1 (EMA) |")
    print("| --- | --- |" + " --- |" * (len(names) + 1))
    for r in rows:
        train = f"{r['train_acc1']:.2f}" if r["train_acc1"] is not None else "-"
        taus = [f"{r['tau'][d][b]:.2f}" for d in references for b in map(str, budgets)]
        print(f"| {r['step']} | {r['tokens']} | " + " | ".join(taus) + f" | {train} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    """tau at the widest tree budget per domain against all steps, each point labelled with the
    data seen by then; held-out and training accuracy at block position 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(rows[0]["tau"])
    budgets = list(rows[0]["tau"][domains[0]])
    widest = max((b for b in budgets if b != "chain"), key=int, default="chain")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    for domain in domains:
        ax1.plot(steps, [r["tau"][domain][widest] for r in rows], marker="o", label=f"{domain}, budget {widest}")
        ax2.plot(steps, [r["accuracy"][domain][0] for r in rows], marker="o", label=f"held-out {domain}")
    for r in rows:
        ax1.annotate(f"{r['tokens'] / 1e3:.0f}k tok", (r["step"], r["tau"][domains[0]][widest]),
                     textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
    ax1.set(xlabel="training steps (all training runs)", ylabel="held-out tau", title="tau against steps and data")
    ax1.legend(fontsize=8)
    trained = [(r["step"], r["train_acc1"]) for r in rows if r["train_acc1"] is not None]
    if trained:
        ax2.plot(*zip(*trained), marker="s", label="training batches (EMA)")
    ax2.set(xlabel="training steps (all training runs)", ylabel="top-1 accuracy, block position 1")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
