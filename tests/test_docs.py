"""README.md and docs/: every relative link resolves (file and heading), every command the README
shows runs as written or is listed here with the reason it cannot run in a test, every `ddtree`
command of the docs and results parses with the CLI's own parser, and every section of
benchmarks/RESULTS.md gives its date and command."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ddtree.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# README commands that a test cannot run as written, and why. A README command that is neither
# here nor run below fails test_every_readme_command_is_run_or_listed.
NOT_RUN_HERE = {
    "make serve": "installs, then serves until stopped; tests/test_serve.py runs the same app",
    "make test": "the whole suite, of which this test is a part",
    "curl": "needs a running server; tests/test_serve.py sends the same request with the openai client",
    ".venv/bin/ddtree bench": "minutes of SmolLM2 decoding (the figures in RESULTS.md); parsed below, not run",
    "ray start": "starts a Ray cluster until stopped; tests/test_deploy.py starts one the same way",
    "RAY_AUTH_MODE=token serve": "needs that cluster; tests/test_deploy.py deploys and reads status the same way",
    ".venv/bin/ddtree audit": "minutes of SmolLM2 decoding; tests/test_audit.py runs the same command on a tiny pair",
}
RUN_HERE = {".venv/bin/ddtree generate"}


def outside_code(text: str) -> list[str]:
    """The lines of a Markdown text outside its fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def commands(path: Path) -> list[str]:
    """The shell commands of a page's bash blocks: continuations joined, comments dropped."""
    found = []
    for block in code_blocks(path.read_text(), "bash"):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line + "\n"
            try:  # a quoted argument may span lines (curl's JSON body)
                words = shlex.split(pending, comments=True)
            except ValueError:
                continue
            pending = ""
            if words:
                found.append(shlex.join(words))
        assert not pending, f"{path.name}: unclosed quote in {pending!r}"
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in outside_code(path.read_text()) if re.match(r"#{1,6} ", line)}


def test_slug_matches_githubs_rule():
    assert slug("Batching and `budget: auto`, 1 to 64 streams") == "batching-and-budget-auto-1-to-64-streams"
    assert slug("Native weights against llama.cpp") == "native-weights-against-llamacpp"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    links = [target for line in outside_code(page.read_text())
             for target in re.findall(r"\]\(([^)\s]+)\)", line)]
    assert page == README or links, f"{page.name} links to nothing"
    broken = []
    for target in links:
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_page_under_docs_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", README.read_text()))
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked


def test_every_readme_command_is_run_or_listed():
    unplaced = [c for c in commands(README)
                if not any(c.startswith(prefix) for prefix in (*NOT_RUN_HERE, *RUN_HERE))]
    assert not unplaced, f"README commands neither run by tests/test_docs.py nor listed in NOT_RUN_HERE: {unplaced}"
    for prefix in (*NOT_RUN_HERE, *RUN_HERE):  # no stale entry
        assert any(c.startswith(prefix) for c in commands(README)), f"README no longer shows {prefix!r}"


def test_every_ddtree_command_shown_parses():
    """Every `ddtree ...` command of the README, docs/ and RESULTS.md names flags the CLI has (a
    renamed flag breaks a copied command long before anyone runs it)."""
    shown = [c for page in (*PAGES, RESULTS) for c in commands(page)]
    ddtree = [shlex.split(c) for c in shown if re.match(r"(\.venv/bin/)?ddtree ", c)]
    assert len(ddtree) >= 8
    parser = build_parser()
    for argv in ddtree:
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"does not parse: {shlex.join(argv)}")


def test_the_readme_python_example_compiles():
    for block in code_blocks(README.read_text(), "python"):
        compile(block, "README.md", "exec")


def test_every_results_section_has_a_date_and_a_command():
    sections = re.split(r"^## ", RESULTS.read_text(), flags=re.M)[1:]
    assert len(sections) >= 5
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), f"RESULTS.md, {title!r}: no date"
        assert "```bash" in section, f"RESULTS.md, {title!r}: no command"


@pytest.mark.smollm2
def test_the_readme_generate_command_runs_as_written(request):
    """The README's `ddtree generate` on the default pair (SmolLM2 and the shipped drafter), run as
    a user would from the repository root: one JSON object with the completion. Its step-cost
    measurement (`budget: auto`, once per machine) is kept in pytest's cache, not the user's."""
    generate = [c for c in commands(README) if c.startswith(".venv/bin/ddtree generate")]
    assert generate
    env = {**os.environ, "DDTREE_CALIBRATION": str(request.config.cache.mkdir("ddtree") / "calibration.json")}
    for command in generate:
        done = subprocess.run(shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["text"] and result["finish_reason"] in ("stop", "length")
        assert len(result["tokens"]) <= 64


# A sitting named by its number (the word session or sitting with a number after it, or an
# ordinal before it) or a file named by one (a `-s` and a number before its suffix): the
# repository speaks of the project and dates, not of the sittings that built it.
SITTING_WORDS = "session|sitting"
NUMBERED_SITTING = re.compile(rf"\b({SITTING_WORDS})s? ?#?\d+\b|\b\d+(st|nd|rd|th) ({SITTING_WORDS})\b", re.I)
SITTING_FILE = re.compile(r"-s\d+\.[a-z]+$")


def test_no_text_or_file_name_speaks_of_numbered_sittings():
    for word in SITTING_WORDS.split("|"):  # the patterns catch what they are for, and not a word alone
        assert NUMBERED_SITTING.search(f"{word.title()} 35 had") and NUMBERED_SITTING.search(f"the 46th {word}")
        assert not NUMBERED_SITTING.search(f"a {word} fixture") and SITTING_FILE.search(f"policy-{word}-s66.json")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = [f for f in files if SITTING_FILE.search(f)]
    assert not named, named
    spoken = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".txt", ".toml", ".cpp", ".h", ".json", ""}:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        spoken += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                   if NUMBERED_SITTING.search(line)]
    assert not spoken, spoken
