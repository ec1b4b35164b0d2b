"""Instructions that blocks_mm retires over one SmolLM2 layer's native matrices (q/k/v fused
[960, 576], o [576, 576], gate/up fused [3072, 576], down [576, 1536]; K-quants round the input
size up to 768) at M rows, one thread, counted by callgrind: a repeatable signal of the kernel's
T(M)/T(1) on a machine too busy to time, not a time. Valgrind runs the kernel's AVX2 build (it
has no AVX-512).

    valgrind --tool=callgrind --callgrind-out-file=/tmp/native/run.out \\
        '--dump-before=ddtree_cpu::blocks_mm(*' \\
        .venv/bin/python benchmarks/native_instructions.py --kinds Q4_1,Q4_K --rows 1,5,9,17
    python benchmarks/native_instructions.py --report /tmp/native --kinds Q4_1,Q4_K --rows 1,5,9,17

The first runs the calls (every input made before the first; a last small call closes the last
one's part of the profile); the second reads the parts: callgrind starts one before each call.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K] of one SmolLM2 layer


def run(kinds: list[str], rows: list[int]) -> None:
    from ddtree.workers.cpu_kernels import build_kernels, load_kernels
    from ddtree.workers.quantized import BLOCK_VALUES, QuantizedLinear, random_blocks

    build_kernels()
    load_kernels()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    calls = []
    for kind in kinds:
        values = BLOCK_VALUES[kind]
        layers = [QuantizedLinear(kind, random_blocks(kind, n, (k + values - 1) // values * values, gen)) for n, k in SHAPES]
        for m in rows:
            calls += [(torch.randn(m, layer.in_features, generator=gen), layer.blocks, kind) for layer in layers]
    calls.append((torch.randn(1, 32), random_blocks("Q8_0", 1, 32, gen), "Q8_0"))  # closes the last part
    for x, blocks, kind in calls:
        torch.ops.ddtree_cpu.blocks_mm(x, blocks, kind)


def report(directory: Path, kinds: list[str], rows: list[int]) -> None:
    parts = sorted(directory.glob("*.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
    counts = [int(re.search(r"^totals:\s+(\d+)", p.read_text(), re.M).group(1)) for p in parts][1:]  # part i + 1: call i
    per_call = iter(counts)
    print("| kind | " + " | ".join(f"M={m} instructions (x M=1)" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for kind in kinds:
        totals = [sum(next(per_call) for _ in SHAPES) for _ in rows]
        print(f"| {kind} | " + " | ".join(f"{t / 1e6:.2f}M ({t / totals[0]:.2f}x)" for t in totals) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="Q4_1,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--rows", default="1,5,9,17")
    parser.add_argument("--report", type=Path, help="read the callgrind parts in this folder instead of running")
    args = parser.parse_args()
    kinds, rows = args.kinds.split(","), [int(m) for m in args.rows.split(",")]
    if args.report:
        report(args.report, kinds, rows)
    else:
        run(kinds, rows)


if __name__ == "__main__":
    main()
