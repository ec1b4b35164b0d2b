"""blocks_mm of another git revision against this worktree's, in one process: the revision's
kernel sources are compiled into a library whose ops register as torch.ops.ddtree_ab.* (the
namespace renamed, so both load), then the two kernels are called in alternation on one SmolLM2
layer's native matrices (q/k/v fused [960, 576], o [576, 576], gate/up fused [3072, 576], down
[576, 1536]) at each row count, and the median of the per-round time ratios is printed. Every
output is checked bitwise equal between the two first (a kernel change must not move a bit).
A busy machine slows both alike, so the ratio is a direction even where times are not.

    python benchmarks/native_ab.py --base HEAD~2 [--rows 1,5,9,17] [--kinds Q4_1,Q8_0]
                                   [--rounds 40] [--threads 1] [--build AVX2|AVX512]

--build AVX2 compares the AVX2 builds on an AVX-512 machine (this worktree's is built first, as
`DDTREE_CPU_BUILD=AVX2 ddtree build-kernels` does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K] of one SmolLM2 layer
NAMESPACE = "ddtree_ab"


def build_revision(revision: str, directory: Path, vector: str) -> Path:
    """The library of `revision`'s kernel sources with their ops under torch.ops.ddtree_ab."""
    from ddtree.workers import cpu_kernels

    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cpu_kernels.SOURCE_DIR,
                               capture_output=True, text=True, check=True).stdout.strip())
    copies = {}
    for path in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        name = path.relative_to(root).as_posix()
        text = subprocess.run(["git", "show", f"{revision}:{name}"], cwd=root, capture_output=True, text=True,
                              check=True).stdout
        copy = directory / path.name
        copy.write_text(text.replace("ddtree_cpu", NAMESPACE))
        copies[str(path)] = str(copy)
    library = directory / f"{NAMESPACE}.so"
    command = [copies.get(arg, arg) for arg in cpu_kernels.build_command(library, vector)]
    subprocess.run(command, check=True, capture_output=True)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--rows", default="1,5,9,17")
    parser.add_argument("--kinds", default="Q4_1,Q8_0")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--build", choices=["AVX2", "AVX512"], help="the kernels' vector build (default: the CPU's)")
    args = parser.parse_args()
    if args.build:
        os.environ["DDTREE_CPU_BUILD"] = args.build
    from ddtree.workers import cpu_kernels
    from ddtree.workers.quantized import BLOCK_VALUES, random_blocks

    cpu_kernels.build_kernels()
    cpu_kernels.load_kernels()
    with tempfile.TemporaryDirectory() as directory:
        torch.ops.load_library(str(build_revision(args.base, Path(directory), cpu_kernels.vector_build())))
    kernels = {"base": getattr(torch.ops, NAMESPACE).blocks_mm, "here": torch.ops.ddtree_cpu.blocks_mm}
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"blocks_mm: this worktree against {args.base}, build {cpu_kernels.vector_build()}, {args.threads} threads, "
          f"{args.rounds} rounds; median over rounds of (time here / time at base) over one layer's matrices")
    print("| kind | rows | base us | here us | here / base |")
    print("|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        values = BLOCK_VALUES[kind]
        layers = [random_blocks(kind, n, (k + values - 1) // values * values, gen) for n, k in SHAPES]
        for rows in [int(m) for m in args.rows.split(",")]:
            xs = [torch.randn(rows, blocks.shape[1] * values, generator=gen) for blocks in layers]
            for x, blocks in zip(xs, layers):
                if not torch.equal(kernels["base"](x, blocks, kind), kernels["here"](x, blocks, kind)):
                    raise SystemExit(f"{kind}, {rows} rows, {tuple(blocks.shape)}: outputs differ from {args.base}'s")
            times = {name: [] for name in kernels}
            for r in range(args.rounds):
                for name in (["base", "here"] if r % 2 == 0 else ["here", "base"]):
                    start = time.perf_counter()
                    for x, blocks in zip(xs, layers):
                        kernels[name](x, blocks, kind)
                    times[name].append(time.perf_counter() - start)
            ratio = statistics.median(h / b for h, b in zip(times["here"], times["base"]))
            print(f"| {kind} | {rows} | {statistics.median(times['base']) * 1e6:.0f} | "
                  f"{statistics.median(times['here']) * 1e6:.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
