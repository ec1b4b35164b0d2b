"""ddtree's C++ GEMMs for the CPU (workers/cpu_gemm.cpp), compiled once per machine and loaded.

    torch.ops.ddtree_cpu.float_mm(x [M, K] float32, w [N, K] float32) -> [M, N]
    torch.ops.ddtree_cpu.blocks_mm(x [M, K] float32, blocks [N, K / block values, bytes] uint8, kind) -> [M, N]

Both compute each output with one fixed order of float sums, whatever the number of rows
(`row r of an M-row call is bitwise the 1-row call on that row`). float_mm serves every fp32
linear on the CPU (workers.model.linear) where it could be built; blocks_mm serves GGUF weights
kept native (workers.quantized).

`python -m ddtree.workers.cpu_gemm` builds it ahead (`make install` does), so that no server or
test compiles it on its first forward.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ..config import cache_root

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
# AVX512 as torch reports it (F, BW, VL and DQ): with VL the 8-lane code (tree attention) has 32
# registers too -- 0.84x its time at 17 rows over a 300-token context
VECTOR_FLAGS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"],
                "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]}


def kernel_build_command(output: Path) -> list[str]:
    """The compiler line of the kernel: the C++ compiler ($CXX, else g++), torch's headers and
    libraries, OpenMP (torch's intra-op threads), and AVX2/FMA where torch itself uses them, plus
    AVX-512 where torch reports it (float_mm's 16-lane tiles: 0.7x the time of the AVX2 build's
    at 5 rows, 0.96x at 9, 0.97x at 17 on a 2-core AVX-512 machine; benchmarks/RESULTS.md)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"ddtree's CPU GEMM kernel is built once with a C++ compiler, and {compiler!r} is not on PATH: "
            "install g++ (or set CXX); weights='native' needs it, float weights fall back to oneDNN"
        )
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    vector = VECTOR_FLAGS.get(vector_build(), [])
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = [arg for p in cpp_extension.library_paths() for arg in (f"-L{p}", f"-Wl,-rpath,{p}")]
    return [compiler, "-O3", "-std=gnu++17", "-shared", "-fPIC", "-fopenmp", *vector,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(KERNEL_SOURCE), "-o", str(output),
            *libraries, "-lc10", "-ltorch_cpu"]


def vector_build() -> str:
    """The vector instructions the kernel is built for: torch's CPU capability, or the narrower
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


@functools.cache
def kernel_key() -> str:
    """The build's identity: the source, the compiler line (vector flags included) and torch's
    version. Names the library, and keys what was measured through it (ddtree.calibrate)."""
    probe = kernel_build_command(Path("out.so"))
    key = hashlib.sha256(KERNEL_SOURCE.read_bytes() + " ".join(probe[:-1]).encode() + torch.__version__.encode())
    return key.hexdigest()[:16]


@functools.cache
def load_kernel(cache_dir: Path | None = None) -> None:
    """Registers torch.ops.ddtree_cpu.*, compiling them into `cache_dir` (default: the kernels
    folder of ddtree's cache) the first time on this machine (15-60 s; keyed by the source,
    torch's version and the CPU's vector capability, so an upgrade or another CPU gets its own
    build)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else kernel_dir()
    library = cache_dir / f"cpu_gemm-{kernel_key()}.so"
    if not library.is_file():
        log.info("building %s into %s (once on this machine)", KERNEL_SOURCE.name, library)
        library.parent.mkdir(parents=True, exist_ok=True)
        staging = library.with_name(f".{library.name}.{os.getpid()}")
        done = subprocess.run(kernel_build_command(staging), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {KERNEL_SOURCE.name} failed:\n{done.stderr[-4000:]}")
        staging.rename(library)  # atomic: another process never loads a half-written library
    torch.ops.load_library(str(library))


@functools.cache
def float_kernel() -> bool:
    """Whether float_mm serves this process's fp32 linears: the CPU has AVX2 (elsewhere oneDNN's
    GEMMs beat the kernel's scalar fallback) and the kernel is built or can be. Says why once
    when it cannot."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VECTOR_FLAGS:
        log.info("fp32 linears use oneDNN: this CPU reports %s, the float kernel is written for AVX2", capability)
        return False
    try:
        load_kernel()
    except RuntimeError as error:
        log.warning("fp32 linears use oneDNN (slower at the few rows of decoding): %s", error)
        return False
    return True


def main() -> None:
    """Builds (or finds) the kernel and says where it is."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        load_kernel()
    except RuntimeError as error:  # a machine without a compiler still installs and serves
        print(f"ddtree: CPU GEMM kernel not built ({error})", file=sys.stderr)
        return
    print(f"ddtree: CPU GEMM kernel ready in {kernel_dir()}")


if __name__ == "__main__":
    main()
