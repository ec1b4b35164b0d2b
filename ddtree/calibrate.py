"""`budget: auto`: choose the tree budget by measurement on the machine it runs on.

Speculation pays only when tau outgrows the verify cost T(budget + 1) / T(1), and both depend
on the drafter and the hardware: on a GPU verification is nearly free, on a 2-core CPU a 17-token
pass costs about two plain steps. So at start-up the engine times a short greedy generation at
each candidate budget, keeps the fastest (budget 0 unless another is clearly faster), and caches
the choice per (target, drafter, dtype, machine) so later starts skip the measurement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from .config import SamplingParams
from .workers.loading import cache_root

logger = logging.getLogger("ddtree")

CANDIDATES = (0, "chain", 8, 16, 32)
PROBE_PROMPTS = (
    "Explain what a binary search does, step by step.",
    "Write a Python function that reverses a string.",
)
PROBE_TOKENS = 32
MIN_GAIN = 1.10  # speculation must be at least this much faster than budget 0 to be chosen


def choose_budget(tokens_per_s: dict) -> int | str:
    """The fastest budget, provided it beats budget 0 by MIN_GAIN; else 0."""
    best = max(tokens_per_s, key=tokens_per_s.get)
    if best != 0 and tokens_per_s[best] < MIN_GAIN * tokens_per_s[0]:
        return 0
    return best


def machine_key(engine, drafter_id: str) -> str:
    cpu = platform.processor() or platform.machine()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu:{cpu}:{torch.get_num_threads()}t"
    raw = json.dumps([str(engine.target.directory), drafter_id, engine.config.dtype, engine.config.weights,
                      engine.config.tp, device, torch.__version__])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def measure(engine, candidates=CANDIDATES) -> dict:
    """tokens/s of a short greedy generation per budget, candidates interleaved per prompt."""
    greedy = SamplingParams()
    prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in PROBE_PROMPTS]
    tokens = dict.fromkeys(candidates, 0)
    seconds = dict.fromkeys(candidates, 0.0)
    for b in candidates:  # warm-up
        engine.generate([engine.request(prompts[0], 4, greedy, budget=b)])
    for prompt in prompts:
        for b in candidates:
            start = time.perf_counter()
            result = engine.generate([engine.request(prompt, PROBE_TOKENS, greedy, budget=b)])[0]
            seconds[b] += time.perf_counter() - start
            tokens[b] += len(result.tokens)
    return {b: tokens[b] / seconds[b] for b in candidates}


def calibrated_budget(engine, drafter_id: str) -> int | str:
    """The cached choice for this engine and machine, or a fresh measurement (then cached)."""
    path = Path(os.environ.get("DDTREE_CALIBRATION", cache_root() / "calibration.json"))
    key = machine_key(engine, drafter_id)
    table = json.loads(path.read_text()) if path.is_file() else {}
    if key in table:
        return table[key]["budget"]
    started = time.perf_counter()
    rates = measure(engine)
    budget = choose_budget(rates)
    logger.info(
        "budget auto: chose %s in %.1f s (tokens/s %s)", budget, time.perf_counter() - started,
        {str(b): round(r, 2) for b, r in rates.items()},
    )
    table[key] = {"budget": budget, "tokens_per_s": {str(b): r for b, r in rates.items()}, "at": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=2))
    tmp.replace(path)
    return budget
