"""Tokens/s of one streaming chat request against a running `ddtree serve`, budget 0 against
other budgets, interleaved in one run (the machine is shared and noisy: compare ratios).

    python benchmarks/serve_stream.py --base-url http://127.0.0.1:8000/v1 --budgets 0,16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from openai import OpenAI

PROMPTS = [
    "Explain how a hash map works.",
    "Write a short poem about the sea.",
    "What are the benefits of regular exercise?",
]


def one(client: OpenAI, model: str, prompt: str, budget, max_tokens: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = None
    usage = None
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"speculation": {"budget": budget}},
    ):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.usage:
            usage = chunk.usage
    total = time.perf_counter() - start
    return usage.completion_tokens / total, first or total, usage.completion_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--budgets", default="0,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    budgets = [b if b == "chain" else int(b) for b in args.budgets.split(",")]
    one(client, model, PROMPTS[0], budgets[0], 8)  # warm-up
    rates = {b: [] for b in budgets}
    ttfts = {b: [] for b in budgets}
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            for b in budgets:  # interleaved, so drift hits every budget alike
                rate, ttft, _ = one(client, model, prompt, b, args.max_tokens)
                rates[b].append(rate)
                ttfts[b].append(ttft)
    base = statistics.median(rates[budgets[0]])
    print(f"model {model}, {args.repeats} x {len(PROMPTS)} streaming requests per budget, {args.max_tokens} max tokens")
    print("| budget | median tokens/s | median TTFT s | vs budget %s |" % budgets[0])
    print("| --- | --- | --- | --- |")
    for b in budgets:
        med = statistics.median(rates[b])
        print(f"| {b} | {med:.2f} | {statistics.median(ttfts[b]):.3f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
