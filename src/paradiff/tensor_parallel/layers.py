"""Linear layers that run on a shard. They keep the `weight` / `bias` names so state_dict keys do not change."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paradiff.distributed.comm import CommStats, all_gather_uneven, all_reduce_tp
from paradiff.runtime.patches import set_attribute, swap_class
from paradiff.tensor_parallel.styles import ShardSpec, Style


class ShardedLinear(nn.Linear):
    """Base for both kinds: remembers the full shape and the slice held, for saving and inspection.

    `weight_linear(x, weight, bias)` is the product with the local weight: `F.linear`, which tensor-subclass weights
    (torchao's int8 / fp8) dispatch themselves; a quantized weight that needs its own kernel (bitsandbytes 4-bit)
    replaces it on the instance (`paradiff.quant`).
    """

    weight_linear = staticmethod(F.linear)

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
        # per-sample adapters (tensor_parallel/lora_slots.py): a rowwise layer adds their partial sum before its
        # all-reduce; any other layer gets them from a forward hook
        self.lora_slots: nn.Module | None = None

    def extra_repr(self) -> str:
        return (
            f"{self.style.kind}, local=({self.out_features}, {self.in_features}), "
            f"full=({self.full_out_features}, {self.full_in_features})"
        )


class ColwiseLinear(ShardedLinear):
    """Computes a slice of the output features; no communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight_linear(x, self.weight, self.bias)


class RowwiseLinear(ShardedLinear):
    """Computes a partial sum over its slice of the input features, then one all-reduce, then the bias.

    With `split_input` the input arrives replicated (full width) and each rank first takes its own slice of it.
    """

    def __init__(self, *args, split_input: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.split_input = split_input

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input features this rank's weight columns multiply (a LoRA adapter's A reads the same ones)."""
        if self.split_input:
            return torch.cat([x.narrow(-1, start, length) for start, length in self.weight_spec.pieces], dim=-1)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local_input(x)
        out = self.weight_linear(local, self.weight, None)
        if self.lora_slots is not None:
            out = self.lora_slots.add_to(out, local)
        out = all_reduce_tp(out, self.group, self.comm_stats)
        if self.bias is not None:
            out = out + self.bias
        return out


class ShardedNorm(nn.Module):
    """RMSNorm or LayerNorm over features split across the TP group: the statistics are summed over the group.

    RMS: one all-reduce of the per-token sum of squares. LayerNorm: the mean first, then the sum of squared
    deviations (two passes, as exact as the single-device norm). Computed in fp32 like diffusers' and torch's norms.
    """

    def __init__(self, source: nn.Module, weight, bias, style: Style, weight_spec: ShardSpec, full_features: int,
                 group: dist.ProcessGroup, replicas: int = 1) -> None:
        super().__init__()
        self.rms = not isinstance(source, nn.LayerNorm)
        eps = getattr(source, "eps", None)
        self.eps = torch.finfo(torch.float32).eps if eps is None else float(eps)
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.style = style
        self.weight_spec = weight_spec
        self.full_features = full_features
        self.group = group
        self.comm_stats: CommStats | None = None
        # K heads held by several ranks (fewer K/V heads than ranks): each holder adds 1/replicas of its sums
        self.replicas = replicas

    def _share(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.replicas == 1 else partial / self.replicas

    def extra_repr(self) -> str:
        kind = "rms" if self.rms else "layer"
        local = sum(length for _, length in self.weight_spec.pieces)
        return f"{kind}, local={local}, full={self.full_features}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if not self.rms:
            total = self._share(x.sum(-1, keepdim=True))
            all_reduce_tp(total, self.group, self.comm_stats)
            x = x - total / self.full_features
        square_sum = self._share(x.pow(2).sum(-1, keepdim=True))
        all_reduce_tp(square_sum, self.group, self.comm_stats)
        x = x * torch.rsqrt(square_sum / self.full_features + self.eps)
        if self.weight is not None:
            if self.weight.dtype in (torch.float16, torch.bfloat16):
                x = x.to(self.weight.dtype)
            x = x * self.weight
        if self.bias is not None:
            x = x + self.bias
        return x.to(dtype)


CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_FUNCTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


def is_depthwise(conv: nn.Module) -> bool:
    return conv.groups > 1 and conv.groups == conv.in_channels == conv.out_channels


class ShardedConv(nn.Module):
    """A convolution split over its channels like a Linear over its features (1x1 convolutions are Linears over
    channels; Sana's GLUMBConv feed-forward is made of them). Colwise holds a slice of the output channels; a
    depthwise convolution (one group per channel) keeps one group per local channel. Rowwise holds a slice of the
    input channels and all-reduces its partial output, adding the bias once after; with `split_input` it first
    takes its slice of a replicated input's channels (dim 1)."""

    def __init__(self, source: nn.Module, local_weight: torch.Tensor, bias: torch.Tensor | None, style: Style,
                 weight_spec: ShardSpec, full_shape: tuple[int, ...], group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(local_weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.style = style
        self.weight_spec = weight_spec
        self.full_shape = tuple(full_shape)
        self.group = group
        self.comm_stats: CommStats | None = None
        self.stride, self.padding, self.dilation = source.stride, source.padding, source.dilation
        self.groups = local_weight.shape[0] if is_depthwise(source) else 1
        # the channels of the output this rank computes: models size their work by it (SANA-WM's conv chunks)
        self.out_channels, self.kernel_size = local_weight.shape[0], source.kernel_size
        self.function = next(fn for cls, fn in _CONV_FUNCTIONS.items() if isinstance(source, cls))

    def extra_repr(self) -> str:
        return f"{self.style.kind}, local={tuple(self.weight.shape)}, full={self.full_shape}, groups={self.groups}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style.kind == "colwise":
            return self.function(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if self.style.kind == "rowwise_split_input":
            x = torch.cat([x.narrow(1, start, length) for start, length in self.weight_spec.pieces], dim=1)
        out = self.function(x, self.weight, None, self.stride, self.padding, self.dilation, self.groups)
        all_reduce_tp(out, self.group, self.comm_stats)
        if self.bias is not None:
            out = out + self.bias.view((1, -1) + (1,) * (out.dim() - 2))
        return out


NORM_TYPES = (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))


def is_norm(module: nn.Module) -> bool:
    """LayerNorm / RMSNorm from torch, or any norm module with a 1-D weight over the last dim and an `eps`
    (diffusers' RMSNorm), which is how this style recognises what it can split."""
    if isinstance(module, NORM_TYPES):
        return True
    weight = getattr(module, "weight", None)
    return hasattr(module, "eps") and "Norm" in type(module).__name__ and (weight is None or weight.dim() == 1)


class VocabLinear(ShardedLinear):
    """An LM head holding a slice of the vocabulary rows: computes its logits, then all-gathers the full vocabulary
    (slices may differ by one row; `gather_sizes` lists every rank's)."""

    def __init__(self, *args, gather_sizes: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gather_sizes = list(gather_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_linear(x, self.weight, self.bias)
        return all_gather_uneven(out, -1, self.gather_sizes, self.group, self.comm_stats)


class VocabParallelEmbedding:
    """Mixed into an nn.Embedding (or a subclass, e.g. Gemma's scaled one, whose forward still runs) that holds rows
    [vocab_start, vocab_start + rows) of the table: ids outside the slice look up row 0 and are zeroed, so the
    all-reduce adds exactly one non-zero vector per id."""

    vocab_start: int
    group: dist.ProcessGroup
    comm_stats: CommStats | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = super().forward(local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce_tp(out, self.group, self.comm_stats)


def make_vocab_parallel(module: nn.Embedding, spec: ShardSpec, group: dist.ProcessGroup) -> None:
    """Turn `module` (already holding its slice) into a vocab-parallel embedding in place, keeping its class's forward
    and its state_dict keys."""
    (start, rows), = spec.pieces
    base = type(module)
    swap_class(module, type(f"VocabParallel{base.__name__}", (VocabParallelEmbedding, base), {}), by="tp")
    set_attribute(module, "vocab_start", start, by="tp")
    set_attribute(module, "group", group, by="tp")
    # num_embeddings keeps the full vocabulary: callers read it as the vocabulary size
    # padding_idx only shapes gradients, but F.embedding checks it against the local row count
    if module.padding_idx is not None:
        local = module.padding_idx - start
        set_attribute(module, "padding_idx", local if 0 <= local < rows else None, by="tp")


def make_sharded_module(
    style: Style,
    source: nn.Module,
    local_weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_spec: ShardSpec,
    full_shape: tuple[int, ...],
    group: dist.ProcessGroup,
    gather_sizes: tuple[int, ...] = (),
    replicas: int = 1,
) -> nn.Module:
    if style.target == "norm":
        return ShardedNorm(source, local_weight, bias, style, weight_spec, full_shape[0], group, replicas)
    if isinstance(source, CONV_TYPES):
        return ShardedConv(source, local_weight, bias, style, weight_spec, full_shape, group)
    return make_sharded_linear(style, local_weight, bias, weight_spec, (full_shape[0], full_shape[1]), group,
                               gather_sizes)


def make_sharded_linear(
    style: Style,
    local_weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_spec: ShardSpec,
    full_features: tuple[int, int],
    group: dist.ProcessGroup,
    gather_sizes: tuple[int, ...] = (),
) -> ShardedLinear:
    if style.kind == "colwise":
        return ColwiseLinear(local_weight, bias, style, weight_spec, full_features, group)
    if style.kind == "vocab":
        return VocabLinear(local_weight, bias, style, weight_spec, full_features, group, gather_sizes=gather_sizes)
    return RowwiseLinear(
        local_weight, bias, style, weight_spec, full_features, group, split_input=style.kind == "rowwise_split_input"
    )
