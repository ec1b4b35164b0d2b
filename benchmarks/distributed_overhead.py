"""Per-round cost of the distributed engine against the in-process one, same prompts, same run.

    .venv/bin/python benchmarks/distributed_overhead.py [--tokens 48] [--prompts 3] [--budgets 0,16]

For each budget: the in-process step loop (workers.scheduler), the distributed engine at TP=1
(the same loop in a Ray actor over actor backends, no collectives) and at TP=2 (two shards
summing over gloo), interleaved prompt by prompt after a warm-up; one request at a time. Prints
a Markdown table of median ms per round. Greedy, SmolLM2-135M fp32, shipped drafter.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import ray
import torch

from ddtree.config import parse_budget
from ddtree.engine import shipped_drafter
from ddtree.workers.distributed import RayInstance, WorkerSpec
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target
from ddtree.workers.requests import Request
from ddtree.workers.scheduler import Scheduler

DATA = Path(__file__).resolve().parent / "data" / "gsm8k-test.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--budgets", default="0,16")
    args = ap.parse_args()
    budgets = [parse_budget(b) for b in args.budgets.split(",")]

    torch.set_num_threads(2)
    target = load_target(None, torch.float32)
    drafter_dir = shipped_drafter()
    local = Scheduler.local(target.model, DFlashDrafter.load(drafter_dir, target.model))
    ray.init(num_cpus=6, include_dashboard=False)
    engines = {
        f"ray tp={tp}": RayInstance(
            WorkerSpec(str(target.directory), str(drafter_dir), 8, "float32", tp, threads_per_worker=2 // tp)
        )
        for tp in (1, 2)
    }
    runners = {"in-process": local.generate, **{name: e.generate for name, e in engines.items()}}

    tok = target.tokenizer
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[: args.prompts]]
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for r in rows
    ]
    for run in runners.values():  # warm-up: workers up, first calls paid
        run([Request(prompts[0], 4, budget=budgets[-1])])

    round_ms = {(n, b): [] for n in runners for b in budgets}
    for prompt in prompts:
        for b in budgets:
            for name, run in runners.items():
                result = run([Request(prompt, args.tokens, eos_token_ids=(tok.eos_token_id,), budget=b)])[0]
                wall = result.decode_s / max(len(result.rounds), 1)
                round_ms[name, b].append(1000 * wall)

    print("| engine | budget | median ms / round | vs in-process |")
    print("|---|---|---|---|")
    for b in budgets:
        base = statistics.median(round_ms["in-process", b])
        for name in runners:
            ms = statistics.median(round_ms[name, b])
            print(f"| {name} | {b} | {ms:.1f} | {ms / base:.2f}x |")
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
