"""The package's layering: its import graph has no cycle, and every module imports on its own.

Modules and their files come from pyproject.toml (`packages` and `package-dir`), so a new
subpackage is walked without editing this test.

The graph is read with `ast`, not by importing. An edge A -> B means module A names module B of
this package in an import: `from .x import f` gives A -> P.x; `from . import x` gives A -> P.x
when x is a submodule, else A -> P (the package's __init__); parent packages that Python runs on
the way are not edges. Two graphs:
- at import time: imports that run when A is imported -- module level, class bodies, module-level
  `try`/`if` -- but not those inside a function, nor under `if TYPE_CHECKING:`. It must have no
  cycle: a cycle here makes a module's names depend on which module of the cycle was imported
  first.
- with lazy imports: the same plus imports inside functions (`tree_ops/batched.py` imports
  `tree_ops/triton_kernels.py` only when a kernel runs, since Triton is optional). It must have no
  cycle either: a lazy import that points back up the graph hides a layering mistake that the
  next refactor turns into an import-time cycle.

Then each module is imported in a process of its own with no module of this package loaded yet
(third-party libraries are imported once in a parent process that forks a child per module, so
the whole check takes seconds, not a torch import per module).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ddtree"


def package_dirs() -> dict[str, Path]:
    """Every package of the project -> its folder, from pyproject.toml (a package not mapped in
    package-dir sits under its parent's folder, as setuptools places it)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = tool.get("package-dir", {})
    dirs: dict[str, Path] = {}
    for name in sorted(tool["packages"], key=lambda n: n.count(".")):
        if name in mapped:
            dirs[name] = ROOT / mapped[name]
        else:
            parent, _, leaf = name.rpartition(".")
            dirs[name] = dirs[parent] / leaf if parent else ROOT / name
    return dirs


def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of every package (a package is its
    __init__.py)."""
    found: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module):
    """Yields (import node, lazy) for every import in a module; lazy: inside a function."""

    def visit(node: ast.AST, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                yield from visit(ast.Module(body=child.orelse, type_ignores=[]), lazy)
            else:
                yield from visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    yield from visit(tree, False)


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(import-time edges, lazy edges): module -> the package's modules it imports."""
    known = modules()
    eager: dict[str, set[str]] = {name: set() for name in known}
    lazy: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        for node, is_lazy in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                for alias in node.names:
                    submodule = f"{base_name}.{alias.name}"
                    targets.append(submodule if submodule in known else base_name)
            for target in targets:
                # `import ddtree.kernels.tree` names the module itself; a name that is no module
                # of ours (a third-party import) is not an edge
                while target and target not in known:
                    target = target.rpartition(".")[0] if target.startswith(PACKAGE + ".") else ""
                if target and target != name:
                    (lazy if is_lazy else eager)[name].add(target)
    return eager, lazy


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_the_whole_package():
    """The walk finds the modules and the edges it should (a walk that found nothing would pass
    the cycle checks below without checking anything)."""
    known = modules()
    assert {"ddtree.cli", "ddtree.config", "ddtree.kernels.batched", "ddtree.kernels.tree_batch",
            "ddtree.kernels.triton_kernels", "ddtree.workers.model", "ddtree.serve.app"} <= set(known)
    eager, lazy = import_graph()
    assert "ddtree.kernels.tree_batch" in eager["ddtree.kernels.triton_kernels"]
    assert "ddtree.kernels.tree_batch" in eager["ddtree.kernels.batched"]
    assert "ddtree.kernels.triton_kernels" in lazy["ddtree.kernels.batched"]
    assert "ddtree.kernels.batched" in eager["ddtree.workers.model"]


def test_find_cycle_names_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_at_import_time():
    eager, _ = import_graph()
    cycle = find_cycle(eager)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_counting_lazy_imports():
    eager, lazy = import_graph()
    both = {name: eager[name] | lazy[name] for name in eager}
    cycle = find_cycle(both)
    assert cycle is None, "import cycle through imports inside functions: " + " -> ".join(cycle)


# Runs in a fresh interpreter: imports the third-party libraries the package imports at import
# time, then forks one child per module (a few at a time); each child starts with no module of
# this package loaded, imports its module and writes a traceback, or nothing, to a file of its
# own. The package comes from this checkout (a finder over pyproject's package-dir, first on
# sys.meta_path), not from wherever it was installed.
_IMPORT_EACH = r"""
import importlib, importlib.util, json, os, shutil, sys, tempfile, traceback
package, names, third_party, package_dirs = json.loads(sys.argv[1])


class CheckoutFinder:
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname not in package_dirs:
            return None  # a module inside a package: found on its package's __path__
        folder = package_dirs[fullname]
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])


sys.meta_path.insert(0, CheckoutFinder)
for lib in third_party:
    try:
        importlib.import_module(lib)
    except Exception:
        pass  # the child whose module needs it reports the error
assert not [m for m in sys.modules if m.split(".")[0] == package], "the parent imported the package"
failures = {}
reports = tempfile.mkdtemp()
running = {}  # pid -> module


def reap():
    pid, status = os.wait()
    name = running.pop(pid, None)
    if name is None:  # not one of ours
        return
    path = os.path.join(reports, name)
    report = open(path).read() if os.path.exists(path) else ""
    if report or status:
        failures[name] = report or f"the child exited with status {status}"


for name in names:
    if len(running) >= min(4, os.cpu_count() or 1):
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            module = importlib.import_module(name)
            report = "" if module.__file__.startswith(os.getcwd()) else f"imported from {module.__file__}"
        except BaseException:
            report = traceback.format_exc()
        with open(os.path.join(reports, name), "w") as out:
            out.write(report)
        os._exit(0)
    running[pid] = name
while running:
    reap()
shutil.rmtree(reports)
print(json.dumps(failures))
"""


def _third_party_imports() -> list[str]:
    """The libraries the package's modules import at import time."""
    names: set[str] = set()
    for path in modules().values():
        for node, lazy in _imports(ast.parse(path.read_text())):
            if lazy:
                continue
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif node.level == 0 and node.module:
                names.add(node.module)
    return sorted(n for n in names if n.split(".")[0] not in (PACKAGE, "__future__"))


def test_every_module_imports_on_its_own():
    """A module that imports only when another module was imported first (a cycle that happens
    to resolve in one order, a name taken from a module that has not run yet) fails here."""
    names = sorted(modules())
    if importlib.util.find_spec("triton") is None:  # Linux-only; tree_ops/batched.py runs without it
        names.remove(f"{PACKAGE}.kernels.triton_kernels")
    dirs = {name: str(folder) for name, folder in package_dirs().items()}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps([PACKAGE, names, _third_party_imports(), dirs])],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failures, "modules that do not import on their own:\n" + "\n".join(
        f"--- {name}\n{report}" for name, report in sorted(failures.items()))


def test_every_package_folder_is_listed_in_pyproject():
    """A folder with an __init__.py that pyproject's `packages` does not list imports from a
    checkout (and from an editable install) but is missing from a built wheel."""
    dirs = package_dirs()
    listed = set(dirs.values())
    unlisted = [str(init.parent.relative_to(ROOT)) for folder in dirs.values() for init in folder.glob("*/__init__.py")
                if init.parent not in listed]
    assert not unlisted, f"add these packages to [tool.setuptools] packages in pyproject.toml: {unlisted}"


def test_no_folder_of_the_root_is_named_like_an_installed_package():
    """Regression: transformers 5.25 made the PyPI package `kernels` a dependency and imports it
    on the first model import. A process started in the repository root (`python -m pytest`, a
    Ray worker, which inherits the driver's cwd) has the root first on sys.path, so `import
    kernels` found this repository's `kernels/` folder (which is `ddtree.kernels`), and `from
    transformers import LlamaConfig` failed with "cannot import name 'CUDAProperties' from
    'kernels'": every test, in CI on a fresh clone. That folder is `tree_ops/` now (its import
    name stays `ddtree.kernels`, through pyproject's package-dir), and no package folder or
    module at the root may take the name of an installed distribution's top-level module."""
    installed = set(importlib.metadata.packages_distributions()) - {PACKAGE}
    importable = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in ROOT.glob("*.py")}
    assert not sorted(importable & installed), "rename these folders (keep their import name in package-dir)"
    assert package_dirs()[f"{PACKAGE}.kernels"] == ROOT / "tree_ops"


def test_transformers_models_import_from_the_repository_root():
    """The same failure as above, end to end, with whatever transformers is installed: a model
    class imports in a process whose sys.path starts at the repository root."""
    proc = subprocess.run([sys.executable, "-c", "from transformers import LlamaConfig, LlamaForCausalLM"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
