"""The CPU kernels' build and fallback rule (docs/cpu-kernels.md): `ddtree build-kernels` builds
them, nothing else compiles them (a process with an empty cache runs the oneDNN / SDPA fallback
and says so), and `deterministic: true` refuses to start without them, saying how to build them.
Each check runs in a fresh process whose DDTREE_CACHE is a temporary folder: a library that is
loaded stays loaded, and the user's cache is not touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.workers import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
needs_kernels = pytest.mark.skipif(not cpu_kernels.float_kernel(), reason="ddtree's CPU kernels serve AVX2 and AVX-512 CPUs")

# In a process whose cache holds no build: what loading says, which backends a forward takes, and
# whether a forward's first linear compiled anything.
_EMPTY_CACHE_PROBE = r"""
import json, os, torch
from ddtree.workers import cpu_kernels, model
try:
    cpu_kernels.load_kernels()
    error = None
except cpu_kernels.KernelsNotBuilt as err:
    error = str(err)
x, w = torch.randn(3, 64), torch.randn(16, 64)
model.linear(x, w)  # the first fp32 linear of a forward
backends = model.kernel_backends(torch.float32, "cpu")
cache = os.path.join(os.environ["DDTREE_CACHE"], "kernels")
print(json.dumps({"error": error, "backends": backends.as_dict(),
                  "cache": sorted(os.listdir(cache)) if os.path.isdir(cache) else []}))
"""

_BUILT_PROBE = r"""
import json, torch
from ddtree.config import ModelPairConfig
from ddtree.engine import check_kernels
from ddtree.workers import cpu_kernels
print(json.dumps({"library": str(cpu_kernels.load_kernels()),
                  "backends": check_kernels(ModelPairConfig(deterministic=True, device="cpu")).as_dict()}))
"""


def run(args: list[str], cache, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "DDTREE_CACHE": str(cache)}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def probe(script: str, cache) -> dict:
    proc = run([sys.executable, "-c", script], cache)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_empty_cache_falls_back_and_says_so_without_compiling(tmp_path):
    """Loading never compiles: with no build in the cache it raises "not built" with the command
    that builds, the first linear runs through oneDNN, the backends say so and why, and the cache
    stays empty (a forward that compiled would take 15-60 s and leave a library there)."""
    found = probe(_EMPTY_CACHE_PROBE, tmp_path)
    assert found["error"] and "not built" in found["error"] and "ddtree build-kernels" in found["error"]
    backends = found["backends"]
    assert backends["bitwise"] is False and backends["attention"] == "sdpa"
    assert backends["linear"] in ("onednn", "torch")
    if cpu_kernels.vector_build() in cpu_kernels.VECTOR_FLAGS:  # elsewhere the reason is the CPU
        assert "ddtree build-kernels" in backends["reason"]
    assert found["cache"] == []


@needs_kernels
def test_a_built_library_loads_without_compiling_and_allows_deterministic(tmp_path):
    """The library `ddtree build-kernels` leaves in a cache (here: this session's build, copied)
    is what a fresh process loads, and then the backends are the bitwise kernels, so
    `deterministic: true` starts."""
    built = cpu_kernels.library_path()
    (tmp_path / "kernels").mkdir()
    shutil.copy(built, tmp_path / "kernels" / built.name)
    found = probe(_BUILT_PROBE, tmp_path)
    assert found["library"] == str(tmp_path / "kernels" / built.name)
    assert found["backends"] == {"linear": "float_mm", "attention": "tree_attention", "bitwise": True, "reason": None}
    assert sorted(os.listdir(tmp_path / "kernels")) == [built.name]


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_deterministic_refuses_to_start_without_the_kernels_and_says_how_to_build_them(tmp_path, command):
    """`--deterministic` with no build in the cache: the command stops before loading a model or
    starting Ray, exit status 2, with a message that names the fallback it refuses and the
    command that builds the kernels."""
    proc = run([sys.executable, "-m", "ddtree.cli", *command, "--deterministic"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "deterministic: true" in proc.stderr and "ddtree build-kernels" in proc.stderr, proc.stderr
    assert "make install" in proc.stderr
    assert not (tmp_path / "kernels").exists() or not os.listdir(tmp_path / "kernels")


@needs_kernels
def test_build_kernels_says_where_the_library_is_and_for_which_instructions():
    """`ddtree build-kernels` on a machine where the build is already in the cache (conftest
    built it, as `make install` does): it compiles nothing and names the library and the
    instruction set this CPU runs."""
    proc = subprocess.run([sys.executable, "-m", "ddtree.cli", "build-kernels"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert str(cpu_kernels.library_path()) in proc.stdout
    assert f"this CPU runs the {cpu_kernels.vector_build()} build" in proc.stdout
