"""The target's verify-cost curve T(q)/T(1): one forward of q tree rows after a 300-token cache,
median over rounds, for each linear backend (ddtree's float_mm, oneDNN, torch's F.linear) and
attention backend (ddtree_cpu.tree_attention, torch's SDPA) interleaved round by round in one
process, so that a busy machine slows all alike.

    python benchmarks/verify_cost.py [--model PATH] [--sizes 1,5,9,17,33] [--rounds 9] [--repeats 1]
                                     [--linear ddtree,onednn,torch] [--attention ddtree,torch]
                                     [--weights float|native] [--build AVX2|AVX512]

--repeats N times N forwards in a row per size and round (after one untimed), as decoding runs
them back to back; with 1, each timed forward follows other sizes' and backends' forwards, and
one row measured up to ~25% slower that way than in a run of one-row forwards.

Where ddtree's CPU kernel is built, the last column is the linears' FMA floor: q rows times the
linears' multiply-adds (nn.Linear and native QuantizedLinear alike), at the rate one thread
retires them in the kernel's vectors with nothing waiting on memory (ddtree_cpu.fma_rate), times
the threads -- what T(q) cannot go below on this machine, however the weights stream.

--build AVX2 runs the kernel's AVX2 build on an AVX-512 machine (workers.cpu_kernels.vector_build);
the native curve of both builds, as an AVX2 machine and this one run it:

    python benchmarks/verify_cost.py --weights native --linear ddtree --sizes 1,5,9,17 --build AVX2
    python benchmarks/verify_cost.py --weights native --linear ddtree --sizes 1,5,9,17
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ddtree.workers import cpu_kernels
from ddtree.workers import model as target_model
from ddtree.workers.loading import load_target
from ddtree.workers.quantized import QuantizedLinear

CONTEXT = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--sizes", default="1,5,9,17,33")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--linear", default="ddtree,onednn", help="linear backends to compare (workers.model.linear)")
    parser.add_argument("--attention", default="ddtree", help="attention backends to compare (workers.model.ATTENTION_BACKEND)")
    parser.add_argument("--weights", default="float", choices=["float", "native"])
    parser.add_argument("--repeats", type=int, default=1, help="timed forwards in a row per size and round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--build", choices=list(cpu_kernels.VECTOR_FLAGS),
                        help="the kernel's vector build (default: the CPU's own; AVX2 on an AVX-512 CPU measures the AVX2 build)")
    args = parser.parse_args()
    if args.build:
        os.environ["DDTREE_CPU_BUILD"] = args.build  # read when the kernels build and load, below
    try:
        cpu_kernels.build_kernels()  # this build (once); the model then loads it
    except cpu_kernels.KernelsNotBuilt as err:
        print(f"verify_cost: measuring without ddtree's CPU kernels: {err}")
    torch.set_num_threads(args.threads)
    sizes = [int(q) for q in args.sizes.split(",")]
    backends = [f"{linear}/{attention}" for linear in args.linear.split(",") for attention in args.attention.split(",")]
    model = load_target(args.model, torch.float32, weights=args.weights).model
    cache = model.new_cache(1, CONTEXT + max(sizes) + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(CONTEXT)[None], model.prefill_mask(CONTEXT), cache)
    cache.lengths += CONTEXT

    times = {(b, q): [] for b in backends for q in sizes}
    for r in range(args.rounds):
        for backend in backends[r % len(backends):] + backends[: r % len(backends)]:  # rotate the order
            target_model.LINEAR_BACKEND, target_model.ATTENTION_BACKEND = backend.split("/")
            for q in sizes:
                tokens = torch.randint(0, model.config.vocab_size, (1, q), generator=torch.Generator().manual_seed(q))
                positions, mask = CONTEXT + torch.arange(q)[None], torch.ones(1, q, q, dtype=torch.bool).tril()
                model(tokens, positions, mask, cache)  # warm: shapes and buffers
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    model(tokens, positions, mask, cache)
                    times[backend, q].append(time.perf_counter() - start)

    floor = fma_floor(model, args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, weights {args.weights}, kernel build {cpu_kernels.vector_build()}, "
          f"{args.rounds} rounds x {args.repeats}, cache {CONTEXT} tokens; median ms and T(q)/T(1)")
    print("| q | " + " | ".join(f"{b} T(q) ms | {b} T(q)/T(1)" for b in backends) + (" | FMA floor ms |" if floor else " |"))
    print("|---|" + "---|---|" * len(backends) + ("---|" if floor else ""))
    for q in sizes:
        cells = []
        for b in backends:
            t, t1 = statistics.median(times[b, q]), statistics.median(times[b, sizes[0]])
            cells += [f"{t * 1000:.1f}", f"{t / t1:.2f}"]
        if floor:
            cells.append(f"{q * floor * 1000:.1f}")
        print(f"| {q} | " + " | ".join(cells) + " |")


def fma_floor(model, threads: int) -> float | None:
    """Seconds per row that the linears' fused multiply-adds take at the cores' measured peak (the
    best of five measurements), or None where ddtree's CPU kernel is not built."""
    if not cpu_kernels.float_kernel():
        return None
    rate = max(torch.ops.ddtree_cpu.fma_rate(20_000_000) for _ in range(5))
    macs = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
    macs += sum(module.in_features * module.out_features for module in model.modules() if isinstance(module, QuantizedLinear))
    print(f"linears: {macs / 1e6:.1f}M multiply-adds per row; one thread retires {rate / 1e9:.1f}G multiply-adds/s")
    return macs / (rate * threads)


if __name__ == "__main__":
    main()
