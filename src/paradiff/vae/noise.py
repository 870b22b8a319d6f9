"""Noise drawn for a whole frame inside a split region: `torch.randn((rows, columns))` issued by a declared module
right after one of its convolutions draws the full frame's noise and keeps this rank's rows.

Every rank draws the whole frame, so the generator advances exactly as in a single-device call and the rows match
it, provided the ranks' generators agree (seed them alike: a single-device call needs a seed to be reproducible too).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from paradiff.vae.runtime import VaeRuntime


class FrameNoise(TorchFunctionMode):
    def __init__(self, runtime: VaeRuntime) -> None:
        super().__init__()
        self.runtime = runtime

    def enter(self, _module, _args) -> None:
        if self.runtime.active is not None:
            self.__enter__()

    def leave(self, _module, _args, _output) -> None:
        if self.runtime.active is not None:
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn and self.runtime.active is not None:
            size = tuple(args[0]) if len(args) == 1 and not isinstance(args[0], int) else tuple(args)
            rows = self.runtime.active.last_conv_rows
            if len(size) == 2 and rows is not None and size[0] == rows[1] - rows[0]:
                full = func((rows[2], size[1]), **kwargs)
                return full.narrow(0, rows[0], size[0])
        return func(*args, **kwargs)
