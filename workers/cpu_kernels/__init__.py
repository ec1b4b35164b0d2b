"""ddtree's C++ kernels for the CPU, one shared library built once per machine and loaded into
torch as `torch.ops.ddtree_cpu.*` (docs/cpu-kernels.md):

    gemm.cpp       float_mm(x [M, K] float32, w [N, K] float32) -> [M, N]: every fp32 linear
                   blocks_mm(x [M, K] float32, blocks [N, K / block values, bytes] uint8, kind) -> [M, N]:
                   GGUF weights kept native (workers.quantized)
                   fma_rate(iterations) -> multiply-adds per second (the benchmarks' floor)
    attention.cpp  tree_attention(q, k, v, offsets, ...): decode and verify rows over the KV cache
    rowops.cpp     rms_norm, add_rms_norm, silu_mul, rope_qk: the row-wise steps between GEMMs
    ops.cpp        the schema of every op above (common.h and ops.h: what the files share)

Every op computes each output row with one fixed order of float operations, whatever the number
of rows (`row r of an M-row call is bitwise the 1-row call on that row`).

`ddtree build-kernels` (`make install` and cluster/Dockerfile run it) compiles the library into
ddtree's cache. A server or a forward never compiles: `load_kernels` loads what was built and
raises KernelsNotBuilt otherwise, and `float_kernel` then says so once and answers False, so the
model's routes fall back to oneDNN and SDPA (workers.model.kernel_backends reports which run).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from ...config import cache_root

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = tuple(SOURCE_DIR / name for name in ("gemm.cpp", "attention.cpp", "rowops.cpp", "ops.cpp"))
HEADERS = tuple(SOURCE_DIR / name for name in ("common.h", "ops.h"))
LIBRARY_STEM = "ddtree_cpu"
# AVX512 as torch reports it (F, BW, VL and DQ): with VL the 8-lane code (tree attention) has 32
# registers too -- 0.84x its time at 17 rows over a 300-token context
VECTOR_FLAGS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"],
                "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]}
BUILD_COMMAND = "ddtree build-kernels"  # what a message that finds no library tells the user to run


class KernelsNotBuilt(RuntimeError):
    """The library for this source, compiler line and torch is not in the cache (or cannot be
    built here); the message says how to build it."""


def build_command(output: Path, vector: str | None = None) -> list[str]:
    """The compiler line of the library for the `vector` build (default: vector_build(), this
    process's): the C++ compiler ($CXX, else g++), torch's headers and libraries, OpenMP (torch's
    intra-op threads), and AVX2/FMA where torch itself uses them, plus AVX-512 where torch reports it (float_mm's 16-lane tiles: 0.7x the time of the AVX2 build's
    at 5 rows, 0.96x at 9, 0.97x at 17 on a 2-core AVX-512 machine; benchmarks/RESULTS.md)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise KernelsNotBuilt(
            f"ddtree's CPU kernels are built once with a C++ compiler, and {compiler!r} is not on PATH: "
            f"install g++ (or set CXX) and run `{BUILD_COMMAND}`"
        )
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = VECTOR_FLAGS.get(vector or vector_build(), [])
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = [arg for p in cpp_extension.library_paths() for arg in (f"-L{p}", f"-Wl,-rpath,{p}")]
    return [compiler, "-O3", "-std=gnu++17", "-shared", "-fPIC", "-fopenmp", *flags,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES), "-o", str(output),
            *libraries, "-lc10", "-ltorch_cpu"]


def vector_build() -> str:
    """The vector instructions the library is built for: torch's CPU capability, or the narrower
    build that $DDTREE_CPU_BUILD names ("AVX2" on an AVX-512 machine: to measure or test the
    build that AVX2 machines run)."""
    capability = torch.backends.cpu.get_cpu_capability()
    wanted = os.environ.get("DDTREE_CPU_BUILD")
    if not wanted:
        return capability
    order = list(VECTOR_FLAGS)  # narrower first
    if wanted not in order or capability not in order or order.index(wanted) > order.index(capability):
        raise RuntimeError(f"DDTREE_CPU_BUILD={wanted!r}: this CPU reports {capability}; "
                           f"choose one of {order[: order.index(capability) + 1] if capability in order else []}")
    return wanted


def kernel_dir() -> Path:
    return cache_root() / "kernels"


def kernel_key(vector: str | None = None) -> str:
    """The identity of the `vector` build (default: this process's): the sources and headers, the
    compiler line (vector flags included) and torch's version. Names the library, and keys what
    was measured through it (ddtree.calibrate)."""
    return _kernel_key(vector or vector_build())


@functools.cache
def _kernel_key(vector: str) -> str:
    probe = build_command(Path("out.so"), vector)
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        key.update(path.name.encode() + path.read_bytes())
    key.update(" ".join(probe[:-1]).encode() + torch.__version__.encode())
    return key.hexdigest()[:16]


def library_path(cache_dir: Path | None = None, vector: str | None = None) -> Path:
    """Where the `vector` build's library lies (or would): `cache_dir` (default: the kernels
    folder of ddtree's cache) / ddtree_cpu-<kernel_key>.so."""
    cache_dir = Path(cache_dir) if cache_dir is not None else kernel_dir()
    return cache_dir / f"{LIBRARY_STEM}-{kernel_key(vector)}.so"


def build_kernels(cache_dir: Path | None = None, vector: str | None = None) -> Path:
    """Compiles the library for the `vector` build (default: this process's; any of
    VECTOR_FLAGS compiles here, for an image whose nodes' CPUs differ from this one) into
    `cache_dir` unless it is there, and returns its path (15-60 s once per machine; keyed by the
    sources, torch's version and the vector flags, so an upgrade or another CPU gets its own
    build). KernelsNotBuilt when it cannot be built."""
    library = library_path(cache_dir, vector)
    if library.is_file():
        return library
    log.info("building ddtree's CPU kernels (%s) into %s", ", ".join(p.name for p in SOURCES), library)
    library.parent.mkdir(parents=True, exist_ok=True)
    staging = library.with_name(f".{library.name}.{os.getpid()}")
    done = subprocess.run(build_command(staging, vector), capture_output=True, text=True)
    if done.returncode != 0:
        raise KernelsNotBuilt(f"building ddtree's CPU kernels failed:\n{done.stderr[-4000:]}")
    staging.rename(library)  # atomic: another process never loads a half-written library
    return library


@functools.cache
def load_kernels(cache_dir: Path | None = None) -> Path:
    """Registers torch.ops.ddtree_cpu.* from the library `build_kernels` made, and returns its
    path. Never compiles: KernelsNotBuilt (saying to run `ddtree build-kernels`) when this build
    is not in the cache."""
    library = library_path(cache_dir)
    if not library.is_file():
        raise KernelsNotBuilt(f"ddtree's CPU kernels are not built for this source, torch {torch.__version__} and "
                              f"{vector_build()} (no {library}): run `{BUILD_COMMAND}` (`make install` does)")
    torch.ops.load_library(str(library))
    return library


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernels serve this process's fp32 work: the CPU has AVX2 (elsewhere oneDNN's
    GEMMs beat the kernels' scalar fallback) and the library is built and loads. Otherwise why
    not, said once in the log."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VECTOR_FLAGS:
        reason = f"this CPU reports {capability}; ddtree's CPU kernels are written for AVX2 and AVX-512"
    else:
        try:
            load_kernels()
            return None
        except (KernelsNotBuilt, RuntimeError, OSError) as error:
            reason = str(error)
    log.warning("ddtree's CPU kernels do not serve this process (fp32 linears fall back to oneDNN, "
                "attention to SDPA): %s", reason)
    return reason


def float_kernel() -> bool:
    """Whether ddtree's kernels serve this process's fp32 linears, attention and row-wise ops."""
    return unavailable_reason() is None
