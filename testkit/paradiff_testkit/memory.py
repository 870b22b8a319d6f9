"""Peak memory of the tensors a piece of code creates, measured on any device (CPUs have no allocator statistics).

`PeakTensorMemory` is a TorchDispatchMode: every tensor an operator returns while it is active is recorded with the
size of its storage, and released when the last recorded tensor sharing that storage is garbage collected. The peak
of the live total is the activation memory of the code: parameters and inputs made before are not counted, views
and in-place results are not counted twice.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTensorMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors recorded on it]
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._record(value)
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        size, address = storage.nbytes(), storage.data_ptr()
        if size == 0:
            return
        entry = self._live.get(address)
        if entry is None:
            self._live[address] = [size, 1]
            self.current += size
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        weakref.finalize(tensor, self._release, address)

    def _release(self, address: int) -> None:
        entry = self._live.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[address]
