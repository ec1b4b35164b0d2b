"""Today's budget policy beside another revision's, in one process: the Scheduler class (and the
workers/policy.py it imports) of a git revision, loaded from `git show` as modules of the
installed ddtree.workers package, so that one engine's models run either step loop.

    python benchmarks/policy_revision.py REV  # checks that REV's scheduler and policy load

    Old = scheduler_at("main")
    old = beside(engine, Old)  # a scheduler of that revision over the engine's target and drafter
    with running(engine, old):  # engine.scheduler is `old` inside
        load_bench.run_inprocess(engine, prompts, "auto", streams, requests, max_tokens)

Every module but the revision's policy and scheduler is the working tree's (their imports must
still resolve there); a revision whose policy keeps `measure_step_cost` itself needs nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, source: str, folder: Path):
    path = folder / f"{name.rsplit('.', 1)[1]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def scheduler_at(rev: str):
    """The Scheduler class of revision `rev` (its workers/scheduler.py over its workers/policy.py)."""
    tag = re.sub(r"\W", "_", rev)
    show = lambda path: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True,  # noqa: E731
                                       capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix=f"ddtree-{tag}-"))
    policy = _load(f"ddtree.workers._rev_{tag}_policy", show("workers/policy.py"), folder)
    source = show("workers/scheduler.py").replace("from .policy import", f"from .{policy.__name__.rsplit('.', 1)[1]} import")
    return _load(f"ddtree.workers._rev_{tag}_scheduler", source, folder).Scheduler


def beside(engine, cls, step_seconds: dict[int, float]):
    """A scheduler of class `cls` over the engine's target and drafter, with the engine's
    scheduler's budget, limits and lookup default, its policy's T(r) `step_seconds` (the
    engine's start-up measurement). It allocates the target's KV storage afresh (same size):
    only one of the two may hold sequences at a time (`running`)."""
    s = engine.scheduler
    other = cls(s.target, s.drafter, s.budget, s.limits, s.decode, None, s.lookup, s.topk)
    curve = sys.modules[cls.__module__.replace("_scheduler", "_policy")].CostCurve
    other.policy.calibrate(curve(dict(step_seconds)))
    return other


@contextlib.contextmanager
def running(engine, scheduler):
    """engine.scheduler is `scheduler` inside (each holds the target's KV storage as its own pool
    maps it: the pool of the one not running is empty)."""
    before = engine.scheduler
    engine.scheduler = scheduler
    try:
        yield scheduler
    finally:
        engine.scheduler = before


if __name__ == "__main__":  # a check that a revision loads: python benchmarks/policy_revision.py main
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="a git revision")
    cls = scheduler_at(parser.parse_args().rev)
    print(f"{cls.__module__}.{cls.__name__} over {sys.modules[cls.__module__.replace('_scheduler', '_policy')].__file__}")
