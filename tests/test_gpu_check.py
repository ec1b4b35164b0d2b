"""`make gpu-check` (benchmarks/gpu_check.py) runs only where a GPU is lent, rarely and for
minutes, so what can break it is checked here, on the CPU: the ddtree names it imports exist,
and what it runs needs no package a bare GPU machine lacks (Ray, the web stack)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"

# What the H200 lent on 2026-12-04 lacked of ddtree's dependencies (pydantic and gguf travelled
# as wheels): nothing gpu-check runs may import these.
ABSENT = ("ray", "fastapi", "starlette", "uvicorn", "openai", "grafana_client", "grafana_foundation_sdk")

BLOCKER = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)")
sys.meta_path.insert(0, Absent())
"""


def test_every_ddtree_name_the_gpu_check_imports_exists():
    """Its sections import inside their functions, so a renamed function fails only there: on
    the GPU, minutes into a lease."""
    tree = ast.parse(GPU_CHECK.read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddtree")]
    assert len(imports) >= 10
    for node in imports:
        module = importlib.import_module(node.module)
        for alias in node.names:
            if not hasattr(module, alias.name):  # a submodule (`from ddtree.kernels import batched`)
                importlib.util.find_spec(f"{node.module}.{alias.name}") or pytest.fail(
                    f"benchmarks/gpu_check.py:{node.lineno}: {node.module}.{alias.name} is gone")


def test_what_the_gpu_check_runs_needs_no_ray_or_web_stack(tmp_path):
    """Regression, from the first `make gpu-check` on an H200 (no Ray there): its first run lost
    section 1 -- every kernel test errored in tests/conftest.py's autouse fixture, which imported
    Ray to guard ray.init -- and section 5 -- the engine imported Ray to count the CPUs Ray
    reserved. With those packages made unimportable: the engine's modules import, an engine's
    thread count is found, and the kernel test files collect and run their fixtures."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"}
    code = ("import ddtree.engine, ddtree.workers.solo, ddtree.workers.sessions, ddtree.workers.loading, "
            "ddtree.kernels.triton_kernels\n"
            "from ddtree.config import ModelPairConfig\n"
            "from ddtree.engine import engine_threads\n"
            "print(engine_threads(ModelPairConfig())[1])\n"
            "import ray\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert "the cores this process may run on" in proc.stdout, proc.stderr
    assert "absent on the GPU machine" in proc.stderr  # the blocker works: the last line failed
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
                           "-k", "pack_bits or metadata_kernel"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "2 passed" in proc.stdout.splitlines()[-1], proc.stdout[-3000:]


@pytest.mark.slow
def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    """`make gpu-check DRY_RUN=1`: the same script, every section on the CPU with tiny random
    models (the kernels under the interpreter), without Ray or the web stack, writes its JSON
    and text, and every check in them passes: the kernels' tests, every output plain decoding's
    at 1 and 16 streams, the 16-stream outputs the lone ones under deterministic: true, the
    graphed steps' tokens the eager ones', a T(q) row per q, an oracle row per (streams, tau,
    budget), the nucleus's two paths keeping the same ids. What breaks the script breaks here, not minutes into a GPU lease."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads((out / "gpu-check.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["kernels", "lossless", "deterministic", "graphs", "verify_cost", "oracle", "nucleus"]
    assert results["dry_run"] and results["failed"] == [] and all(s["ok"] for s in sections.values())
    assert "passed" in sections["kernels"]["summary"]
    assert [(r["streams"], r["budget"]) for r in sections["lossless"]["rows"]] == [
        (s, b) for s in (1, 16) for b in (0, 16, 64, "auto")]
    assert all(r["same"] == r["outputs"] for r in sections["lossless"]["rows"] + sections["deterministic"]["rows"])
    assert sections["graphs"]["captured"] == 14  # 5 batch x 3 row buckets, but not 16 x 65 > max_step_tokens and sections["graphs"]["replays"] > 0
    assert [r["q"] for r in sections["verify_cost"]["rows"]] == [1, 2, 3, 5, 9, 17, 33, 65, 129]
    assert len(sections["oracle"]["rows"]) == 2 * 2 * 3
    assert [(r["logits"], r["same"]) for r in sections["nucleus"]["rows"]] == [("sharp", True), ("flat", True)]
    assert sections["nucleus"]["rows"][1]["undecided"] > 0  # the flat rows take the whole-vocabulary path
    assert "every section passed" in (out / "gpu-check.txt").read_text()
