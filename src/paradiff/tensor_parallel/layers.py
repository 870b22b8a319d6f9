"""Linear layers that run on a shard. They keep the `weight` / `bias` names so state_dict keys do not change."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import CommStats, all_reduce_tp
from .styles import ShardSpec, Style


class ShardedLinear(nn.Linear):
    """Base for both kinds: remembers the full shape and the slice held, for saving and inspection."""

    def __init__(
        self,
        local_weight: torch.Tensor,
        bias: torch.Tensor | None,
        style: Style,
        weight_spec: ShardSpec,
        full_features: tuple[int, int],
        group: dist.ProcessGroup,
    ) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = local_weight.shape
        self.weight = nn.Parameter(local_weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.style = style
        self.weight_spec = weight_spec
        self.full_out_features, self.full_in_features = full_features
        self.group = group
        self.comm_stats: CommStats | None = None

    def extra_repr(self) -> str:
        return (
            f"{self.style.kind}, local=({self.out_features}, {self.in_features}), "
            f"full=({self.full_out_features}, {self.full_in_features})"
        )


class ColwiseLinear(ShardedLinear):
    """Computes a slice of the output features; no communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowwiseLinear(ShardedLinear):
    """Computes a partial sum over its slice of the input features, then one all-reduce, then the bias.

    With `split_input` the input arrives replicated (full width) and each rank first takes its own slice of it.
    """

    def __init__(self, *args, split_input: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.split_input = split_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = torch.cat([x.narrow(-1, start, length) for start, length in self.weight_spec.pieces], dim=-1)
        out = F.linear(x, self.weight)
        all_reduce_tp(out, self.group, self.comm_stats)
        if self.bias is not None:
            out = out + self.bias
        return out


def make_sharded_linear(
    style: Style,
    local_weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_spec: ShardSpec,
    full_features: tuple[int, int],
    group: dist.ProcessGroup,
) -> ShardedLinear:
    if style.kind == "colwise":
        return ColwiseLinear(local_weight, bias, style, weight_spec, full_features, group)
    return RowwiseLinear(
        local_weight, bias, style, weight_spec, full_features, group, split_input=style.kind == "rowwise_split_input"
    )
