"""`budget: auto`'s start-up measurement: T(r), the seconds of one target forward over r rows.

The budget policy (workers.policy) weighs every tree against what its verify rows cost, and
that cost is the machine's: flat up to a knee on a GPU, steep on a 2-core CPU. At start-up the
engine times one forward through the scheduler's own target backend (in process, or the
tensor-parallel shards) at row counts from 1 to `max_step_tokens`, and caches the curve per
(target, weights, dtype, tp, machine, row limit) so later starts skip it. The live steps refine
the curve from then on (workers.policy.CostCurve).
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
from .workers.policy import CostCurve, measurable, measure_step_cost
from .workers.scheduler import row_counts

logger = logging.getLogger("ddtree")


def machine_key(engine, counts: list[int]) -> str:
    cpu = platform.processor() or platform.machine()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu:{cpu}:{torch.get_num_threads()}t"
    raw = json.dumps([str(engine.target.directory), engine.config.dtype, engine.config.weights, engine.config.tp,
                      counts, device, torch.__version__, linear_route(), "step-cost-v2"])  # v2: timed in rounds
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def step_costs(engine) -> CostCurve:
    """The cached T(r) of this engine and machine, or a fresh measurement (then cached)."""
    path = Path(os.environ.get("DDTREE_CALIBRATION", cache_root() / "calibration.json"))
    counts = measurable(engine.scheduler, row_counts(engine.scheduler.limits.max_step_tokens))
    key = machine_key(engine, counts)
    table = json.loads(path.read_text()) if path.is_file() else {}
    if key in table and "step_seconds" in table[key]:
        return CostCurve({int(r): s for r, s in table[key]["step_seconds"].items()})
    started = time.perf_counter()
    seconds = measure_step_cost(engine.scheduler, counts)
    logger.info("budget auto: measured the target's step cost in %.1f s: %s", time.perf_counter() - started,
                {r: f"{1000 * s:.1f} ms" for r, s in seconds.items()})
    table[key] = {"step_seconds": {str(r): s for r, s in seconds.items()}, "at": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=2))
    tmp.replace(path)
    return CostCurve(seconds)
