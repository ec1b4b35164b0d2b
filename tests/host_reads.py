"""Counting the device -> host reads of code that runs the engine's device path on the CPU.

On a GPU a read of device memory by the host (`.cpu()`, `.tolist()`, `.item()`, `int(t)`, a
mask or `nonzero` whose result's shape depends on the values) waits for every launched kernel:
a step with several stalls several times. On the CPU the "device" is the host, so nothing
stalls and no op tells a device tensor from a host one: `DeviceReads` tells them apart by
where each tensor came from. A tensor is on the device when it was given to the counter as
such (the model's weights, the KV pool), made by a factory with a `device=` argument, moved
with `.to(...)`, or computed from a device tensor; `.cpu()` gives a host copy. A read counts
when its tensor is on the device: the reads a GPU would make, whatever the CPU does.

The Triton interpreter's own copies (it runs a kernel on host copies of its arguments, which
a GPU launch does not make) are not counted.
"""

from __future__ import annotations

import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# methods and functions that hand tensor values to Python, or size their result by the values
READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__", "__complex__", "nonzero",
         "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose"}


def _mask_index(index) -> bool:
    """Whether an index holds a bool tensor (its selection's size is the mask's count)."""
    flat, _ = tree_flatten(index)
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in flat)


def _in_interpreter() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "triton" in frame.f_code.co_filename and "interpreter" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class DeviceReads(TorchFunctionMode):
    """`with DeviceReads(tensors_on_the_device) as reads:` ... `reads.count`, and `reads.where`
    the stack of each read (what a failing test prints)."""

    def __init__(self, on_device=()):
        super().__init__()
        self.device = WeakIdKeyDictionary()
        self.count = 0
        self.where: list[str] = []
        self.mark(on_device)

    def mark(self, tensors) -> None:
        for t in tensors:
            self.device[t] = True

    def _on_device(self, *values) -> bool:
        flat, _ = tree_flatten(values)
        return any(isinstance(t, torch.Tensor) and t in self.device for t in flat)

    def _read(self, name: str) -> None:
        if _in_interpreter():
            return
        self.count += 1
        self.where.append(f"{name}:\n" + "".join(traceback.format_stack(sys._getframe(2), limit=6)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        source = args[0] if args else None
        from_device = self._on_device(args, kwargs)
        if name in READS and isinstance(source, torch.Tensor) and source in self.device:
            self._read(name)
        elif name == "__getitem__" and source in self.device and _mask_index(args[1]):
            self._read("__getitem__ with a mask")
        elif name in ("__setitem__", "copy_") and isinstance(source, torch.Tensor):
            if source not in self.device and self._on_device(args[1:], kwargs):
                self._read(f"{name} into a host tensor")  # a device tensor's values copied to the host
            elif source in self.device and name == "__setitem__" and _mask_index(args[1]):
                self._read("__setitem__ with a mask")
        out = func(*args, **kwargs)
        if name == "cpu":
            return out.clone() if out is source else out  # the host's own copy
        moved = name == "cuda" or (name == "to" and any(isinstance(a, (torch.device, str)) for a in args[1:]))
        if from_device or moved or kwargs.get("device") is not None:
            flat, _ = tree_flatten(out)
            self.mark(t for t in flat if isinstance(t, torch.Tensor))
        return out
