"""benchmarks/gsm8k_variants.py and benchmarks/chat_prompts.py: training prompts in the judged
domains' shapes (grade-school word problems, open assistant questions) that are not judged prompts."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

from ddtree.bench import read_prompts
from ddtree.training.data import DEFAULT_HELD_OUT, _normal, held_out_texts

from .helpers import BENCHMARKS, benchmark_script

# Word problems written for this test (not GSM8K's): each exercises one rule of the variant.
PROBLEMS = [
    "Mara bakes 24 rolls and sells 24 of them at $1.50 each to 3 friends. Then she bakes 24 more. How many are left?",
    "A tank holds 250 litres and is 40% full at 7:30 in the morning of 2019. How much water is in it after 1 hour?",
    "Tom reads 3/4 of a 120-page book on his 2nd day. How many pages are left?",
    "Nobody knows how many there are.",
]


def test_a_variant_draws_each_integer_afresh_near_its_size_and_keeps_the_rest():
    script = benchmark_script("gsm8k_variants")
    rng = random.Random(0)
    for _ in range(50):
        mara = script.variant(PROBLEMS[0], rng)
        first, second, friends, more = (int(n) for n in re.findall(r"(?<![\d.])\d+(?![.\d])", mara))
        assert first == second == more != 24  # one old number, one new one, everywhere in the problem
        assert 12 <= first <= 48  # within a factor of two of 24
        assert "$1.50" in mara  # a decimal stays
        assert 2 <= friends <= 12 and friends != 3  # a small count stays small
        tank = script.variant(PROBLEMS[1], rng)
        litres, share = (int(n) for n in re.match(r"A tank holds (\d+) litres and is (\d+)% full", tank).groups())
        assert 125 <= litres <= 500 and litres % 10 == 0 and litres != 250  # a round number stays round
        assert 5 <= share <= 95 and share % 5 == 0 and share != 40  # a share stays a share
        assert "at 7:30 in the morning of 2019" in tank and "after 1 hour" in tank  # time, year and 1 stay
        tom = script.variant(PROBLEMS[2], rng)
        assert tom.startswith("Tom reads 3/4 of a ") and "on his 2nd day" in tom  # a fraction and an ordinal stay
        assert re.search(r"a (\d+)-page", tom).group(1) != "120"
    assert script.variant(PROBLEMS[3], rng) == PROBLEMS[3]


def test_the_variants_script_writes_only_problems_it_changed(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": q, "answer": "#### 0"}) + "\n" for q in PROBLEMS))
    out = tmp_path / "variants.jsonl"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "gsm8k_variants.py"), "--train", str(train),
                          "--out", str(out), "--rows", "0:4", "--seed", "3"], check=True, capture_output=True, text=True)
    prompts = read_prompts(out, None)  # as the data stage reads a prompt file
    assert len(prompts) == 3 and not set(prompts) & set(PROBLEMS)  # the numberless one is no variant
    assert "3 variants of 4 training problems" in run.stdout


def test_the_chat_prompts_are_many_distinct_one_line_questions_none_a_judged_one():
    prompts = benchmark_script("chat_prompts").prompts()
    assert len(prompts) > 1000 and len(set(prompts)) == len(prompts)
    assert all("\n" not in p and "  " not in p and p[-1] in ".?" and p[0].isupper() for p in prompts)
    judged = held_out_texts(DEFAULT_HELD_OUT)  # every judged file's user messages, as the data stage refuses them
    assert len(judged) > 1000
    assert not any(q in _normal(p) for p in prompts for q in judged)


GENERIC = {"describe", "explain", "write", "what", "which", "when", "where", "with", "from", "that", "this", "into",
           "your", "about", "after", "before", "their", "there", "would", "could", "should", "other", "some", "more",
           "most", "very"}


def _stems(text: str) -> set[str]:
    """Content words of four letters or more, cut to six letters (vaccines ~ vaccinations)."""
    return {w[:6] for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4 and w not in GENERIC}


def _is_about(topic: set[str], judged: set[str]) -> bool:
    """A topic (its stems) is a judged prompt's subject: all its content words are in it, or two are."""
    return bool(topic) and (topic <= judged or len(topic & judged) >= 2)


def test_no_chat_topic_is_the_subject_of_a_judged_chat_prompt():
    """An earlier chat_prompts.py had topics that are judged vicuna-bench prompts' subjects:
    "Python" and "JavaScript" compared (judged prompt 2), "critical thinking" (6), "vaccines"
    (16), "natural selection" (19), "working from home" (3), "a recession" (12), among the first
    20 that eval-drafter judges. No prompt was a judged one word for word, but the target answers
    "Explain natural selection in simple terms." much as it answers the judged question about
    natural selection, so training on it drafts that judged answer: a leak of the judged file by
    topic (measured on 2026-12-05). A topic is a
    judged prompt's subject when every content word of it is in that prompt, or two of them are
    (by six-letter stems); no template's topic may be one for any judged chat prompt."""
    script = benchmark_script("chat_prompts")
    judged = [(i, _stems(q)) for i, q in enumerate(read_prompts(BENCHMARKS / "data" / "vicuna-bench.jsonl", None))]
    assert len(judged) == 80
    # the rule finds each subject the earlier topic lists shared with a judged prompt
    for topic, i in [("natural selection", 19), ("vaccines", 16), ("critical thinking", 6), ("JavaScript", 2),
                     ("a blog post", 76)]:
        assert _is_about(_stems(topic), judged[i][1]), topic
    shared = []
    for kinds in script.TEMPLATES.values():
        for _, topics in kinds:
            for topic in topics:
                for words in topic if isinstance(topic, tuple) else (topic,):
                    shared += [(words, i) for i, theirs in judged if _is_about(_stems(words), theirs)]
    assert not shared, f"chat topics that are judged prompts' subjects (topic, judged prompt number): {shared}"
