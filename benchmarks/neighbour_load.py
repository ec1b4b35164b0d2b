"""What a neighbour's bursts of CPU cost the engine in process: aggregate tokens/s of `--streams`
closed-loop streams (`--requests` completions, ddtree.load_bench.run_inprocess) alone, beside a process that keeps `--duty` of one core busy in bursts of
`--burst-ms` at nice 0, beside the same process at nice 19, and beside the same bursts run by a
Python thread of the engine's own process (which hold its GIL), the four alternated `--rounds`
times. On a machine whose cores the engine's threads all use, this is what the serving path's
own work (ingress, proxy, client, Ray's daemons) can cost a step beyond its CPU time: the step's
threads meet at a barrier after every parallel region, so a neighbour that takes one of them
stops both (docs/deployment.md, "Cores"). The thread against the nice-0 process tells whether
sharing the step's process (its GIL) costs more than sharing its cores.

    python benchmarks/neighbour_load.py [--streams 8] [--requests 40] [--duty 0.15] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from budget_policy import mixed_prompts  # noqa: E402

from ddtree.config import ModelPairConfig  # noqa: E402
from ddtree.engine import Engine  # noqa: E402
from ddtree.load_bench import run_inprocess  # noqa: E402

# a busy loop of `duty` of each `period` seconds, asleep the rest
BURNER = """import sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < duty * period:
        pass
    time.sleep(period * (1 - duty))
"""


def burn(duty: float, period: float, stop: threading.Event) -> None:
    """BURNER's loop on a thread of this process: its busy bursts hold the GIL."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < duty * period:
            pass
        time.sleep(period * (1 - duty))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=40, help="completions per measurement")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budget", default="0", help="the engine's budget: 0 (plain decoding), chain, N or auto")
    parser.add_argument("--duty", type=float, default=0.15, help="the neighbour's busy share of one core")
    parser.add_argument("--burst-ms", type=float, default=1.5, help="the neighbour's bursts, milliseconds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    budget = args.budget if args.budget in ("auto", "chain") else int(args.budget)
    engine = Engine.from_config(ModelPairConfig(budget=budget, max_num_seqs=max(16, args.streams)))
    prompts = [engine.render_chat([{"role": "user", "content": t}]) for t in mixed_prompts(24)]
    run_inprocess(engine, prompts, budget, args.streams, args.streams, args.max_tokens)  # warm
    period = args.burst_ms / 1000 / args.duty
    rates: dict[str, list[float]] = {"alone": [], "nice 0": [], "nice 19": [], "a thread": []}
    for _ in range(args.rounds):
        for name in rates:
            neighbour, stop = None, threading.Event()
            if name.startswith("nice"):
                nice = int(name.split()[1])
                neighbour = subprocess.Popen([sys.executable, "-c", BURNER, str(args.duty), str(period)],
                                             preexec_fn=lambda n=nice: os.nice(n))
            elif name == "a thread":
                neighbour = threading.Thread(target=burn, args=(args.duty, period, stop), daemon=True)
                neighbour.start()
            try:
                rates[name].append(run_inprocess(engine, prompts, budget, args.streams, args.requests,
                                                               args.max_tokens).tokens_per_s)
            finally:
                stop.set()
                if isinstance(neighbour, subprocess.Popen):
                    neighbour.kill()
                    neighbour.wait()
                elif neighbour is not None:
                    neighbour.join()
            print(f"{name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    alone = statistics.median(rates["alone"])
    print(f"\n{args.streams} streams, budget {args.budget}, a neighbour busy {args.duty:.0%} of a core in "
          f"{args.burst_ms:g} ms bursts; medians of {args.rounds}")
    print("| neighbour | tokens/s | vs alone |\n| --- | --- | --- |")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / alone:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rates": rates}, indent=1))


if __name__ == "__main__":
    main()
