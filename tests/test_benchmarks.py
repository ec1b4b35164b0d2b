"""Every script in benchmarks/ runs: its `--help` exits 0 and prints its usage.

The scripts are run rarely and by hand, so an import or a helper they use can go without a
failing test; `--help` imports the whole script and builds its parser. They start at once, each
in a process of its own (most import torch and ddtree: seconds each), and are awaited together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
TIMEOUT_S = 300


def test_every_benchmark_script_answers_help():
    assert len(SCRIPTS) >= 10, f"benchmarks/ lost its scripts: {SCRIPTS}"
    running = {script.name: subprocess.Popen([sys.executable, str(script), "--help"], cwd=BENCHMARKS.parent,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for script in SCRIPTS}
    failed = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=TIMEOUT_S)
        if process.returncode != 0 or "usage:" not in out:
            failed[name] = f"exit {process.returncode}: {(err or out)[-800:]}"
    assert not failed, "\n".join(f"benchmarks/{name}: {why}" for name, why in failed.items())
