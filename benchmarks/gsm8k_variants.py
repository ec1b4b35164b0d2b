"""Math prompts in GSM8K's shape for the drafter's training data: grade-school word problems from
GSM8K's *training* split with their numbers changed, so the target answers a new problem of the
judged domain's shape and the drafter learns how the target works through one.

The drafter's first six training runs took all 7,473 training problems once; the self-written math prompts
that followed are short and bought little on gsm8k-test (measured 2026-12-05). A variant keeps a
problem's story and wording and draws each integer afresh near its old size (the same old number
becomes the same new one everywhere in the problem, so a problem that names 48 twice names its
new number twice); fractions, decimals, times, years, ordinals and 0/1 stay. The answers change
with the numbers: the target's own greedy answer is what the drafter trains on, right or wrong.

Only the training split is read (from a path: this project does not ship it); no test problem can
come out, and the data stage refuses the judged files' prompts all the same.

    python benchmarks/gsm8k_variants.py --train gsm8k-train.jsonl --out runs/gsm8k-variants.jsonl \\
        [--rows 0:4400] [--limit 2500] [--seed 0]
    ddtree train-drafter --workdir W --stage data --prompts runs/gsm8k-variants.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import random
import re

from ddtree.bench import write_prompts

# An integer standing alone: not inside a decimal, fraction, time, thousands group or word ("3rd").
NUMBER = re.compile(r"(?<![\d.,:/])\d+(?![\d.,:/]?\d|st\b|nd\b|rd\b|th\b)")
PERCENT_AFTER = re.compile(r"\s*(%|percent)")


def fresh(old: int, percent: bool, rng: random.Random) -> int:
    """A new integer of `old`'s kind: a share stays a share, a small count a small count, a round
    number round, a large one within a factor of two."""
    if percent:
        return rng.choice([p for p in range(5, 100, 5) if p != old])
    if old <= 1 or 1900 <= old <= 2100:  # "1 hour", "0 left", a year: their meaning is the number
        return old
    if old <= 12:
        return rng.choice([n for n in range(2, 13) if n != old])
    step = 10 if old % 10 == 0 else 5 if old % 5 == 0 else 1
    lo = -(-max(2, (old + 1) // 2) // step) * step  # the first multiple of step from half of old up
    return rng.choice([n for n in range(lo, 2 * old + 1, step) if n != old])  # never empty: old >= 13


def variant(question: str, rng: random.Random) -> str:
    """`question` with each standalone integer drawn afresh (consistently: one old value, one new)."""
    new: dict[tuple[str, bool], int] = {}

    def swap(match: re.Match) -> str:
        percent = PERCENT_AFTER.match(question, match.end()) is not None
        key = (match.group(), percent)
        if key not in new:
            new[key] = fresh(int(match.group()), percent, rng)
        return str(new[key])

    return NUMBER.sub(swap, question)


def parse_rows(text: str) -> slice:
    start, _, stop = text.partition(":")
    return slice(int(start) if start else None, int(stop) if stop else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", required=True, help="GSM8K's training split as JSONL ({\"question\": ...} rows)")
    parser.add_argument("--out", required=True, help="the JSONL to write ({\"prompt\": variant} rows)")
    parser.add_argument("--rows", type=parse_rows, default=slice(None), help="which training rows, start:stop")
    parser.add_argument("--limit", type=int, default=None, help="at most this many variants (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.train) as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()][args.rows]
    rng = random.Random(args.seed)
    rng.shuffle(questions)
    originals = set(questions)
    out = [v for v in (variant(q, rng) for q in questions) if v not in originals]  # no number to change: no variant
    out = out[: args.limit] if args.limit else out
    write_prompts(args.out, out)
    print(f"{len(out)} variants of {len(questions)} training problems written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
