"""Code prompts in HumanEval's shape for the drafter's training data, from Python's own standard
library: each public function with a docstring becomes a stub -- its signature and its docstring,
no body -- for the target to complete, as HumanEval asks it to complete its stubs.

The drafter's self-written code prompts are short requests (at most SELF_PROMPT_TOKENS tokens: "write
a function that ..."); HumanEval gives a signature and a docstring. Stubs of the standard library
are that shape, written by many hands, and on every machine with Python (PSF licence). None is a
HumanEval prompt (the data stage refuses the judged files' prompts all the same).

    python benchmarks/stdlib_prompts.py --out runs/stdlib-code.jsonl [--limit 3000] [--seed 0]
    ddtree train-drafter --workdir W --stage data --prompts runs/stdlib-code.jsonl ...
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
import sysconfig
from pathlib import Path

from ddtree.bench import write_prompts

MIN_DOC_CHARS = 40  # a docstring shorter than this says too little to complete the function from
MAX_DOC_CHARS = 1200  # ... and one longer is a manual page, not a task


def stub(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """`def name(args) -> ret:` and its docstring (cleaned, indented one level); None without a fitting docstring."""
    doc = ast.get_docstring(node, clean=True)
    if not doc or not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS or '"""' in doc:
        return None
    head = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
    return f'{head} {node.name}({ast.unparse(node.args)}){returns}:\n    """{body.lstrip()}\n    """\n'


def stubs(root: Path) -> list[str]:
    """Every fitting stub of the public functions in the modules under `root`: top-level ones and
    the methods of top-level public classes (as written, `self` included)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(("_", "test", "idlelib", "site-packages", "lib2to3")) for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [n for top in tree.body if isinstance(top, ast.ClassDef) and not top.name.startswith("_")
                 for n in top.body]
        for node in tree.body + nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                text = stub(node)
                if text is not None:
                    out.append(text)
    return list(dict.fromkeys(out))  # the same stub in two modules once


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSONL to write ({\"prompt\": stub} rows)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many stubs (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    found = stubs(Path(sysconfig.get_paths()["stdlib"]))
    random.Random(args.seed).shuffle(found)
    found = found[: args.limit] if args.limit else found
    write_prompts(args.out, found)
    print(f"{len(found)} stubs from Python {sys.version.split()[0]}'s standard library written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
