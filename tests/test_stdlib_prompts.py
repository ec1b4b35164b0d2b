"""benchmarks/stdlib_prompts.py: HumanEval-shaped training prompts from the standard library."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "stdlib_prompts.py"


def load_script():
    spec = importlib.util.spec_from_file_location("stdlib_prompts_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stub_is_the_signature_and_docstring_without_the_body():
    script = load_script()
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
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--limit", "200", "--seed", "1"],
                   check=True, capture_output=True)
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == 200 and len(set(prompts)) == 200
    for text in prompts:
        ast.parse(text)
    judged = {json.loads(line)["prompt"].strip() for line in
              (ROOT / "benchmarks" / "data" / "humaneval.jsonl").read_text().splitlines() if line.strip()}
    assert not judged & {p.strip() for p in prompts}
