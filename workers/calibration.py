"""Timing the target's forward over r rows: T(r), the curve the budget policy prices a step's
verify rows by (workers.policy.CostCurve), measured at start-up (ddtree.calibrate) and again where
the live steps contradict it (workers.policy.BudgetPolicy.misfit).

What T(r) costs does not depend on the token values, so it is timed over random tokens after a
short committed context, through the scheduler's own target backend and KV pool."""

from __future__ import annotations

import random

import torch

from ..config import GREEDY
from .batch_backends import TargetBatch

CALIBRATION_CONTEXT = 64  # committed tokens before the rows `measure_step_cost` times ...
DENSE_COUNT = 17  # ... and the counts up to this many rows (~0.9 s a round for SmolLM2 on 2 cores) ...
DENSE_REPEATS = 9  # ... it times in at least this many rounds: their differences are a few ms
DIP_TOLERANCE = 1.5  # a plausible T(r): no count's forward takes under 1 / this of a smaller count's ...
DIP_JITTER_S = 0.003  # ... less this many seconds, a shared 2-core machine's scheduling jitter


def plausible(seconds: dict[int, float]) -> bool:
    """Whether a measured T(r) could be the machine's: a forward over more rows takes no less than
    1 / DIP_TOLERANCE of one over fewer, less DIP_JITTER_S. The measurement's own noise dips a
    little; another process running during some counts' timings dips a lot, and such a curve,
    made non-decreasing, would price rows at nothing. The absolute slack is for forwards of a
    millisecond (a tiny model), where one descheduled moment doubles a count's timing."""
    slowest = 0.0
    for _, s in sorted(seconds.items()):
        if s * DIP_TOLERANCE + DIP_JITTER_S < slowest:
            return False
        slowest = max(slowest, s)
    return True


def measurable(scheduler, counts: list[int]) -> list[int]:
    """The row counts of `counts` whose rows fit the scheduler's KV pool after the calibration
    context (a small pool cannot hold a step of max_step_tokens rows anyway; the curve goes on
    proportionally past its last point)."""
    context = calibration_context(scheduler.pool)
    fits = [r for r in counts if scheduler.pool.pages_for(context + r) <= scheduler.pool.free_pages]
    return fits or [1]


def calibration_context(pool) -> int:
    """CALIBRATION_CONTEXT, or 0 for a pool too small to hold it beside one row."""
    return CALIBRATION_CONTEXT if pool.pages_for(CALIBRATION_CONTEXT + 1) <= pool.free_pages else 0


def measure_step_cost(scheduler, counts: list[int], repeats: int = 3,
                      dense_repeats: int = DENSE_REPEATS) -> dict[int, float]:
    """Seconds of one target forward over r rows after CALIBRATION_CONTEXT committed tokens (none
    in a pool too small for them), per r in `counts` that fits the KV pool (`measurable`), through
    the scheduler's target backend and pool (its pages go back after): the least of its timings.
    What T(r) costs does not depend on the token values. Timed by the scheduler's clock.

    The counts are timed in rounds, a warm-up round and then `repeats` (the cheap counts, up to
    DENSE_COUNT rows, in at least `dense_repeats`: their differences are a few milliseconds),
    each round in its own shuffled order, so that a slow stretch of a shared machine falls on
    different counts in each round; another process only ever adds time, so the least timing of
    a count is the machine's."""
    target, pool, clock = scheduler.target, scheduler.pool, scheduler.clock
    counts = measurable(scheduler, counts)
    context = calibration_context(pool)
    capture = tuple(scheduler.drafter.target_layer_ids) if scheduler.drafter is not None else ()
    g = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {r: [] for r in counts}
    cheap = [r for r in counts if r <= DENSE_COUNT]
    pages: list[int] = []
    pool.grow(pages, context + max(counts))  # every count's rows go to the same uncommitted slots
    try:
        tokens = torch.randint(0, 32, (1, context + max(counts)), generator=g)
        batch = lambda lo, hi: TargetBatch(  # noqa: E731 -- rows [lo, hi) after lo committed
            tokens=tokens[:, lo:hi], positions=torch.arange(lo, hi)[None],
            mask=torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()[None], tables=[pages], lengths=[lo],
            capture=capture, logits_to_keep=0, sampling=[GREEDY], seeds=[None],
            draw_positions=torch.arange(lo + 1, hi + 1)[None])
        if context:
            target.forward(batch(0, context))
        for round_ in range(max(repeats, dense_repeats if cheap else 0) + 1):  # round 0 warms up
            order = list(counts if round_ <= repeats else cheap)
            random.Random(round_).shuffle(order)
            for r in order:
                start = clock()
                target.forward(batch(context, context + r))
                if round_:
                    times[r].append(clock() - start)
    finally:
        pool.release(pages)
    return {r: min(t) for r, t in times.items()}
