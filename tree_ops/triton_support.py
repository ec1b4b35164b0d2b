"""One dispatch for the tree ops: Triton kernels for CUDA tensors, torch references otherwise.

Triton is imported lazily (the kernels live in `tree_ops/triton_kernels.py`), so a machine
without it runs the references. Tests call the kernels' wrappers directly: on CPU under the
interpreter (`TRITON_INTERPRET=1`, which tests/conftest.py sets before anything imports Triton),
compiled on CUDA in `make gpu-check`.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# The kernels for CPU tensors too: the engine's device path (the tree ops, the paged attention,
# the seeded draws and the walk as Triton runs them on a GPU) on a machine without one, under
# Triton's interpreter (TRITON_INTERPRET=1, read before Triton is imported). Tests set it.
KERNELS_ON_CPU = False


def use_triton(t: torch.Tensor) -> bool:
    """The engine's dispatch: Triton for CUDA tensors (and CPU ones under KERNELS_ON_CPU), the
    torch reference for the rest."""
    return (t.is_cuda or (KERNELS_ON_CPU and t.device.type == "cpu")) and triton_available()


# The head widths the tree-attention kernel has a tile for (one power of two a tile row); a
# model with another (Phi's 80, say, or a tiny test model's 8) attends through the reference.
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
