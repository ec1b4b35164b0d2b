"""Tree ops: building a draft tree, its attention mask and positions, tree attention, the greedy
and seeded walks, KV compaction and the drafter's top-K. Each is a plain torch reference (the
CPU path, and the oracle in tests) and, over a batch of trees, a Triton kernel that CUDA tensors
are dispatched to."""

if __name__ == "kernels":
    # This folder is `ddtree.kernels`. It is imported as plain `kernels` only when the repository
    # root is on sys.path (`python -m pytest` there, a Ray worker inheriting that path), and then
    # it shadows the PyPI package `kernels` that transformers (>= 5.25, a hard dependency) imports
    # on its first model import. Hand the name to the installed package when there is one.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    # (realpath: the root reached through a link is still the root, not a second copy to run)
    if _spec is not None and _spec.loader is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
