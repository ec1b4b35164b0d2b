"""Milliseconds of one plain decoding step of the engine's step loop with B sequences in the
batch: what a busy server pays per token of every stream (on a GPU, the step's host work and
launches, not the model's compute).

Mixed prompts (gsm8k-test / humaneval / vicuna-bench, chat-templated), B requests admitted at
once; `--warm` steps first (their prompts are prefilled 512 tokens a step, ~32 steps for 64
streams), then `--steps` timed steps in which every sequence decodes one token. Prints each
step's milliseconds, the median and the least.

    python benchmarks/plain_step.py [--streams 16,64] [--steps 40] [--warm 45] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from budget_policy import mixed_prompts  # noqa: E402

from ddtree.config import ModelPairConfig, SamplingParams  # noqa: E402
from ddtree.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warm", type=int, default=45)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    engine = Engine.from_config(ModelPairConfig(budget=0, max_num_seqs=max(streams), device=args.device))
    prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in mixed_prompts(24)]
    for b in streams:
        scheduler = engine.scheduler
        for i in range(b):  # no EOS: every sequence decodes through the timed steps
            request = engine.request(prompts[i % len(prompts)], args.warm + args.steps + 8, SamplingParams(), budget=0)
            scheduler.add(dataclasses.replace(request, eos_token_ids=()))
        for _ in range(args.warm):
            scheduler.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            updates = scheduler.step()
            times.append(time.perf_counter() - start)
            if len(updates) != b:
                raise SystemExit(f"{len(updates)} of {b} sequences decoded in a timed step: raise --warm")
        while scheduler.running or scheduler.waiting:  # drain
            scheduler.step()
        print(f"{b} streams: " + " ".join(f"{1000 * t:.0f}" for t in times))
        print(f"{b} streams: median {1000 * statistics.median(times):.1f} ms, least {1000 * min(times):.1f} ms "
              "a plain step", flush=True)


if __name__ == "__main__":
    main()
