"""benchmarks/stdlib_prompts.py: HumanEval-shaped training prompts from the standard library."""

from __future__ import annotations

import ast
import subprocess
import sys

from ddtree.bench import read_prompts
from ddtree.training.data import DEFAULT_HELD_OUT, _normal, held_out_texts

from .helpers import BENCHMARKS, benchmark_script


def test_a_stub_is_the_signature_and_docstring_without_the_body():
    script = benchmark_script("stdlib_prompts")
    source = '''
def clamp(value: float, low: float = 0.0, *, high: float = 1.0) -> float:
    """Return value limited to the closed interval [low, high].

    >>> clamp(2.5)
    1.0
    """
    return max(low, min(high, value))


def tiny(x):
    """Too short."""
    return x
'''
    tree = ast.parse(source)
    text = script.stub(tree.body[0])
    assert text.startswith("def clamp(value: float, low: float=0.0, *, high: float=1.0) -> float:\n")
    parsed = ast.parse(text).body[0]  # a valid function whose whole body is its docstring
    assert [type(n) for n in parsed.body] == [ast.Expr]
    assert ast.get_docstring(parsed) == ast.get_docstring(tree.body[0])
    assert "return" not in text
    assert script.stub(tree.body[1]) is None  # a docstring under MIN_DOC_CHARS says too little


def test_the_script_writes_distinct_prompts_none_of_them_a_judged_one(tmp_path):
    out = tmp_path / "code.jsonl"
    subprocess.run([sys.executable, str(BENCHMARKS / "stdlib_prompts.py"), "--out", str(out), "--limit", "200", "--seed", "1"],
                   check=True, capture_output=True)
    prompts = read_prompts(out, None)  # as the data stage reads a prompt file
    assert len(prompts) == 200 and len(set(prompts)) == 200
    for text in prompts:
        ast.parse(text)
    judged = held_out_texts(DEFAULT_HELD_OUT)  # every judged file's user messages, as the data stage refuses them
    assert len(judged) > 1000
    assert not any(q in _normal(text) for text in prompts for q in judged)
