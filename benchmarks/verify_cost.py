"""The target's verify-cost curve T(q)/T(1) after a 300-token cache (median of repeats).

    python benchmarks/verify_cost.py [--model PATH] [--sizes 1,9,17,33,65] [--repeats 9]
"""

from __future__ import annotations

import argparse

import torch

from ddtree.bench import verify_costs
from ddtree.config import ModelPairConfig
from ddtree.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--sizes", default="1,9,17,33,65")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engine = Engine.from_config(ModelPairConfig(model=args.model, budget=0, dtype=args.dtype))
    sizes = [int(q) for q in args.sizes.split(",")]
    costs = verify_costs(engine, sizes, repeats=args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print("| q | T(q) ms | T(q)/T(1) |\n| --- | --- | --- |")
    for q in sizes:
        print(f"| {q} | {costs[q] * 1000:.1f} | {costs[q] / costs[1]:.2f} |")


if __name__ == "__main__":
    main()
