"""A quantized linear FSDP2 can shard: its packed weight held as plain tensors, one parameter each.

FSDP2 cuts every parameter along its rows (`torch.chunk`) and gathers it back, which torchao's int8 / fp8 tensors do
not support (no `aten.split`) and which GGUF's `GGUFParameter` would lose its ggml type through. Both are row-wise
formats, though: an int8 / fp8 weight's per-row scale depends on its row only, and a GGUF row is a run of blocks of
its own. So `PackedLinear` holds the inner tensors of the quantized weight as plain parameters of the same rows
(`qdata` int8 with its (rows, 1) `scale`; GGUF's packed bytes), FSDP2 shards and gathers them as it does any
parameter (a unit mixing dtypes is gathered as bytes), and each forward rebuilds the quantized weight from the
gathered rows and computes the very product the unsharded quantized model computes. What the weight is made of and
how it multiplies come from the quantization (`build`, `product`), not from here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class PackedLinear(nn.Module):
    """A linear whose weight is rebuilt at each call, from plain parameters (`parts`: name -> (shape, dtype), each
    with the weight's rows first), by `build(parts) -> weight`, and multiplied by `product(x, weight, bias)`."""

    def __init__(self, in_features: int, out_features: int, parts: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 build: Callable[[dict[str, torch.Tensor]], Any],
                 product: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor],
                 bias: torch.Tensor | None = None, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.part_names = tuple(parts)
        for name, (shape, dtype) in parts.items():
            if shape[0] != out_features:
                raise ValueError(f"PackedLinear part {name!r} has shape {list(shape)}: its first dimension must be "
                                 f"the weight's rows ({out_features}) for FSDP to cut it as it cuts the weight")
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                       requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.build = build
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.build({name: getattr(self, name) for name in self.part_names}), self.bias)

    def fill(self, parts: dict[str, torch.Tensor]) -> None:
        """Copy this rank's rows of each part (as the quantization made them from the rows read) into place."""
        missing = set(self.part_names) - set(parts)
        if missing:
            raise ValueError(f"PackedLinear.fill got {sorted(parts)}, without {sorted(missing)}")
        with torch.no_grad():
            for name in self.part_names:
                held = getattr(self, name)
                local = held.to_local() if hasattr(held, "to_local") else held
                local.copy_(parts[name].reshape(local.shape))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={list(self.part_names)}"


def packed_weight_names(model: nn.Module) -> dict[str, str]:
    """State-dict name of every part of every PackedLinear -> the name of the weight it was made from."""
    return {f"{name}.{part}" if name else part: f"{name}.weight" if name else "weight"
            for name, module in model.named_modules() if isinstance(module, PackedLinear)
            for part in module.part_names}
