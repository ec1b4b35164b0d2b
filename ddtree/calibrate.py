"""`budget: auto`'s start-up measurement: T(r), the seconds of one target forward over r rows.

The budget policy (workers.policy) weighs every tree against what its verify rows cost, and
that cost is the machine's: flat up to a knee on a GPU, steep on a 2-core CPU. At start-up the
engine times one forward through the scheduler's own target backend (in process, or the
tensor-parallel shards) at row counts from 1 to `max_step_tokens`, and caches the curve per
(target, weights, dtype, tp, machine, row limit) so later starts skip it. The live steps refine
the curve from then on (workers.policy.CostCurve), and measure it again where they contradict it
(workers.policy.BudgetPolicy.misfit).

A curve timed while another process ran on the machine is wrong for good once cached: one entry
said T(1) 1215 ms and T(129) 623, where the forward took 30 and 174, and `auto` ran 0.53x budget
4 on it. So a measured curve must be plausible (`plausible`: a forward over more rows does not take
much less time) before it is cached -- else it is measured again -- and a cached one is checked at
each start against a quick timing of a few of its counts (`SPOT_COUNTS`, ~0.2 s for SmolLM2).
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

from .config import cache_root
from .workers.model import linear_route
from .workers.calibration import measurable, measure_step_cost, plausible
from .workers.policy import CostCurve
from .workers.scheduler import row_counts

logger = logging.getLogger("ddtree")


def machine_key(engine, counts: list[int]) -> str:
    cpu = platform.processor() or platform.machine()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu:{cpu}:{torch.get_num_threads()}t"
    backends = getattr(engine, "backends", None)
    invariant = "+batch-invariant" if backends is not None and backends.triton_invariant else ""  # deterministic on CUDA
    # v4: each count the least of shuffled rounds. v2 and v3 (the median of rotated rounds) are both
    # taken: a build that briefly named its curves v3 cached one with T(1) 71 ms on a 34 ms machine
    raw = json.dumps([str(engine.target.directory), engine.config.dtype, engine.config.weights, engine.config.tp,
                      counts, device, torch.__version__, linear_route() + invariant, "step-cost-v4"])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


SPOT_COUNTS = (1, 17)  # the row counts a cached curve is checked at, each start ...
SPOT_TOLERANCE = 2.0  # ... and how far off (either way) its points there may be before it is measured again
ATTEMPTS = 3  # an implausible measurement (workers.calibration.plausible) is taken again, this many times at most


def agrees(cached: dict[int, float], spot: dict[int, float]) -> bool:
    """Whether a quick timing of a few counts agrees with the cached curve there (within
    SPOT_TOLERANCE either way)."""
    curve = CostCurve(cached)
    return all(1 / SPOT_TOLERANCE <= s / max(curve.predict(r), 1e-12) <= SPOT_TOLERANCE for r, s in spot.items())


def step_costs(engine) -> CostCurve:
    """The cached T(r) of this engine and machine, if a quick timing agrees with it, or a fresh
    measurement (cached when plausible)."""
    path = Path(os.environ.get("DDTREE_CALIBRATION", cache_root() / "calibration.json"))
    counts = measurable(engine.scheduler, row_counts(engine.scheduler.limits.max_step_tokens))
    key = machine_key(engine, counts)
    table = json.loads(path.read_text()) if path.is_file() else {}
    if key in table and "step_seconds" in table[key]:
        cached = {int(r): s for r, s in table[key]["step_seconds"].items()}
        spot = measure_step_cost(engine.scheduler, [r for r in SPOT_COUNTS if r <= max(counts)], repeats=2)
        if agrees(cached, spot):
            return CostCurve(cached)
        logger.warning("budget auto: the cached step cost (%s) disagrees with a timing now (%s); measuring again",
                       CostCurve(cached), CostCurve(spot))
    started = time.perf_counter()
    for attempt in range(1, ATTEMPTS + 1):
        seconds = measure_step_cost(engine.scheduler, counts)
        if plausible(seconds):
            break
        logger.warning("budget auto: a step-cost measurement that cannot be the machine's (is another process "
                       "running?), attempt %d of %d: %s", attempt, ATTEMPTS, CostCurve(seconds))
    logger.info("budget auto: measured the target's step cost in %.1f s: %s", time.perf_counter() - started,
                CostCurve(seconds))
    if not plausible(seconds):
        return CostCurve(seconds)  # the live steps measure it again if it is wrong (BudgetPolicy.misfit)
    table[key] = {"step_seconds": {str(r): s for r, s in seconds.items()}, "at": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=2))
    tmp.replace(path)
    return CostCurve(seconds)
