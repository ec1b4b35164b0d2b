"""Candidate routes for multiplying with GGUF low-bit weights, timed against today's fp32 F.linear.

For each of SmolLM2-135M's linear shapes (hidden 576, intermediate 1536, 9 heads x 64, 3 KV
heads, the 49152 x 576 tied LM head) and M rows of activations, the weights are random,
quantized as the shipped GGUF quantizes them (Q4_1 layers, a Q8_0 embedding / LM head; Q4_0 as
well), and each route runs interleaved with the fp32 reference in one process. Reported: the
median time of the reference and each route's median ratio route / reference (< 1 = faster),
and each route's max |difference| from F.linear over the de-quantized fp32 weights. Each route
cycles through copies of its weights adding up to --working-set-mb of fp32 weights, so that, as
in the model (30 layers, 540 MB), the weights come from memory, not from the CPU's caches.

Routes:
  float        F.linear with the de-quantized fp32 weights (today)
  int4pack     torch.ops.aten._weight_int4pack_mm_for_cpu: 4-bit codes, one (scale, zero) per
               32 weights as fp32 -- Q4_0 (zero 0) and Q4_1 (scale d, zero m + 8d) exactly
  int4pack-2x  Q8_0 as two 4-bit halves (q = 16 hi + lo) in ONE int4pack call over [x, x]:
               the hi half has scale 16d, zero 0; the lo half scale d, zero 8d
  int8-blocks  Q8_0 through torch.ops.aten._weight_int8pack_mm, one call per 32-column block
               (the op takes one scale per output channel, Q8_0 has one per 32 weights)
  int8-channel _weight_int8pack_mm with one scale per row: NOT Q8_0 (its scales differ per
               block), timed only as the bound of an int8 route; its difference is not reported
  chunked      Q8_0 de-quantized 4096 rows at a time into a reused fp32 buffer, then F.linear
  kernel       ddtree's C++ kernel (workers/cpu_gemm.cpp, torch.ops.ddtree_cpu.blocks_mm) over the
               GGUF blocks as stored: tiles of 12 rows x <= 256 inputs decoded exactly into an
               L1 buffer once per 64 activation rows and multiplied into all of them (one row:
               decoded in registers); built once on first use, cached under $DDTREE_CACHE/kernels

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lowbit_gemm.py [--rows 1,9,17] [--rounds 15] [--threads 1]
        [--routes kernel,int4pack,...]   (default: all; the torch int4/int8 routes are slow to time)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ddtree.workers.cpu_gemm import load_kernel
from ddtree.workers.quantized import GROUP, BlockWeights, QuantizedLinear, quantize_for_test

SHAPES = {  # name: (N out, K in, GGUF type of the shipped file)
    "q_proj / o_proj 576x576": (576, 576, "Q4_1"),
    "k_proj / v_proj 192x576": (192, 576, "Q4_1"),
    "gate / up 1536x576": (1536, 576, "Q4_1"),
    "down 576x1536": (576, 1536, "Q4_1"),
    "gate (as Q4_0) 1536x576": (1536, 576, "Q4_0"),
    "lm_head 49152x576": (49152, 576, "Q8_0"),
}


def int4pack_route(w: BlockWeights):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
    scale_zero = torch.stack([w.scale, w.offset + 8 * w.scale], dim=-1).transpose(0, 1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


def int4pack_halves_route(w: BlockWeights):
    codes = w.codes.to(torch.int32)
    hi, lo = (codes >> 4) + 8, codes & 15  # codes = 16 (hi - 8) + lo
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat([hi, lo], dim=1), 1)
    zero = torch.zeros_like(w.scale)
    halves = torch.cat([torch.stack([16 * w.scale, zero], -1), torch.stack([w.scale, 8 * w.scale], -1)], dim=1)
    scale_zero = halves.transpose(0, 1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat([x, x], dim=-1), packed, GROUP, scale_zero)


def int8_blocks_route(w: BlockWeights):
    n, k = w.codes.shape
    blocks = [w.codes[:, b * GROUP : (b + 1) * GROUP].contiguous() for b in range(k // GROUP)]
    scales = [w.scale[:, b].contiguous() for b in range(k // GROUP)]

    def run(x):
        out = torch.ops.aten._weight_int8pack_mm(x[:, :GROUP].contiguous(), blocks[0], scales[0])
        for b in range(1, k // GROUP):
            out += torch.ops.aten._weight_int8pack_mm(x[:, b * GROUP : (b + 1) * GROUP].contiguous(), blocks[b], scales[b])
        return out

    return run


def int8_channel_route(w: BlockWeights):
    scale = w.scale[:, 0].contiguous()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, w.codes, scale)


def chunked_route(w: BlockWeights, rows: int = 4096):
    n, k = w.codes.shape
    buffer = torch.empty(rows, k)
    scale = w.scale.repeat_interleave(GROUP, dim=1)

    def run(x):
        out = torch.empty(x.shape[0], n)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            chunk = torch.mul(w.codes[start:stop], scale[start:stop], out=buffer[: stop - start])
            torch.mm(x, chunk.T, out=out[:, start:stop])
        return out

    return run


def kernel_route(w: BlockWeights):
    layer = QuantizedLinear.from_weights(w)
    return lambda x: torch.ops.ddtree_cpu.blocks_mm(x, layer.blocks, layer.kind)


def float_route(w: BlockWeights):
    dense = w.dequantize()
    return lambda x: F.linear(x, dense)


def route_makers(kind: str, w: BlockWeights, names: set[str] | None) -> dict:
    """{route: (its function over w, its maker for copies of w)}, float first."""
    if kind in ("Q4_0", "Q4_1"):
        makers = {"kernel": kernel_route, "int4pack": int4pack_route}
    else:
        makers = {"kernel": kernel_route, "int4pack-2x": int4pack_halves_route, "int8-blocks": int8_blocks_route,
                  "int8-channel": int8_channel_route, "chunked": chunked_route}
    chosen = {name: make for name, make in makers.items() if names is None or name in names}
    return {name: (make(w), make) for name, make in {"float": float_route, **chosen}.items()}


def cycle(functions: list):
    """One function that calls the next of `functions` each time (the first on its first call)."""
    turn = iter(range(1 << 62))
    return lambda x: functions[next(turn) % len(functions)](x)


def time_once(fn, x, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,9,17", help="activation rows M, comma-separated")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (the medians are over these)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--routes", help="comma-separated routes to time (default: all)")
    parser.add_argument("--working-set-mb", type=float, default=128, help="fp32 MB of weight copies cycled per route")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_kernel()
    names = set(args.routes.split(",")) if args.routes else None
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    print("| shape | type | M | float ms | route | route / float | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (n, k, kind) in SHAPES.items():
        w = quantize_for_test(torch.randn(n, k, generator=gen) * 0.05, kind)
        dense = w.dequantize()
        copies = max(1, round(args.working_set_mb * 2**20 / (n * k * 4)))
        routes = {route: cycle([fn] + [make(w) for _ in range(copies - 1)])
                  for route, (fn, make) in route_makers(kind, w, names).items()}
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, generator=gen)
            want = F.linear(x, dense)
            calls = max(1, int(2e8 // (n * k * 4)))  # ~200 MB of fp32 weights read per timing
            times = {r: [] for r in routes}
            for fn in routes.values():
                fn(x)  # warm-up
            for _ in range(args.rounds):
                for r, fn in routes.items():
                    times[r].append(time_once(fn, x, calls))
            base = statistics.median(times["float"])
            for r, fn in routes.items():
                if r == "float":
                    continue
                ratio = statistics.median(t / f for t, f in zip(times[r], times["float"]))
                diff = "n/a (not Q8_0)" if r == "int8-channel" else f"{(fn(x) - want).abs().max().item():.2e}"
                print(f"| {name} | {kind} | {m} | {base * 1e3:.3f} | {r} | {ratio:.2f} | {diff} |")


if __name__ == "__main__":
    main()
