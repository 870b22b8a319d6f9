"""LoRA factors on a split Linear: which slice of each factor a rank holds, and how the adapted layer runs.

A LoRA adapter adds `scaling * B @ A` to a weight W (out x in), A being r x in and B out x r. A rank holding rows
of W (colwise, packed colwise, whole heads) needs the same rows of B and all of A: its output slice is
`W_rows x + B_rows (A x)`. A rank holding columns of W (rowwise, rowwise on a replicated input) needs the same
columns of A and all of B: `B (A_cols x_cols)` is its share of the adapter's output, a partial sum like
`W_cols x_cols`, so both join before the layer's one all-reduce and the adapter costs no extra collective. Every
slice is the base weight's own `ShardSpec` (`ResolvedLinear.specs`), so uneven or packed splits carry over.

The adapted layer is peft's `lora.Linear` (so diffusers' set_adapters / disable / delete / fuse keep working on
it) with a forward for column-split bases and an exact merge: fusing adds each rank's slice of `B @ A` to its
shard in fp32 and keeps the original shard, so unfusing restores it bit for bit. A staged pipeline frees and reads
the shard again between its stages: the layer then drops the copy and fuses again into what was read, with the
scalings it fused with (`weights_dropped` / `weights_read`); fusing while the shard is freed is applied at the read.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

from paradiff.distributed.comm import all_reduce_tp
from paradiff.errors import AdapterError
from paradiff.runtime.patches import swap_class
from paradiff.tensor_parallel.layers import RowwiseLinear
from paradiff.tensor_parallel.styles import ShardSpec

# the LoRA tensors of one target module, as peft names them after the module path
FACTORS = ("lora_A.weight", "lora_B.weight", "lora_B.bias")


def factor_specs(module_name: str, linear) -> dict[str, ShardSpec | None]:
    """This rank's slice of each factor of an adapter on the planned module `linear` (a ResolvedLinear)."""
    style = linear.style
    weight = linear.specs.get("weight")
    if style.target != "linear" or linear.embedding or weight is None:
        raise AdapterError(
            f"A LoRA adapter targets {module_name!r}, which the tensor-parallel plan splits as {style.kind!r} "
            f"({type(style).__name__}); LoRA on a split module works on Linears split colwise or rowwise only. "
            "Leave this module out of the adapter, or load without tensor parallelism."
        )
    if style.kind == "colwise":
        rows = ShardSpec(dim=0, pieces=weight.pieces)
        return {"lora_A.weight": None, "lora_B.weight": rows, "lora_B.bias": rows}
    if style.kind in ("rowwise", "rowwise_split_input"):
        return {"lora_A.weight": ShardSpec(dim=1, pieces=weight.pieces), "lora_B.weight": None, "lora_B.bias": None}
    raise AdapterError(
        f"A LoRA adapter targets {module_name!r}, split as {style.kind!r} ({type(style).__name__}): its output is "
        "gathered across the ranks inside the layer, where an adapter cannot join it exactly. Leave this module out "
        "of the adapter, or load without tensor parallelism."
    )


@functools.cache
def sharded_lora_class() -> type:
    """peft's LoRA Linear for a ShardedLinear base (built on first use: peft is imported only with LoRA)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class ShardedLoraLinear(LoraLinear):
        """A LoRA Linear over a colwise or rowwise shard (see the module docstring)."""

        # the shard (and bias) before fusing, and the adapters fused with the scalings they had then
        _paradiff_original: tuple[torch.Tensor, torch.Tensor | None] | None = None
        _paradiff_fused: dict[str, float] | None = None

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            base = self.get_base_layer()
            if not isinstance(base, RowwiseLinear) or self.disable_adapters or self.merged:
                return super().forward(x, *args, **kwargs)
            if kwargs.get("adapter_names") is not None:
                raise AdapterError("Per-sample adapter_names are not supported on a tensor-parallel rowwise layer.")
            self._check_forward_args(x, *args, **kwargs)
            local = base.local_input(x)
            out = base.weight_linear(local, base.weight, None)
            if base.lora_slots is not None:  # per-sample adapters beside peft's (tensor_parallel/lora_slots.py)
                out = base.lora_slots.add_to(out, local)
            dtype = out.dtype
            biases = []
            for name in self.active_adapters:
                if name not in self.lora_A.keys():
                    continue
                lora_A, lora_B = self.lora_A[name], self.lora_B[name]
                hidden = lora_A(self.lora_dropout[name](self._cast_input_dtype(local, lora_A.weight.dtype)))
                out = out + F.linear(hidden, lora_B.weight) * self.scaling[name]
                if lora_B.bias is not None:  # whole on every rank: added once, after the sum
                    biases.append(lora_B.bias * self.scaling[name])
            out = all_reduce_tp(out.to(dtype), base.group, base.comm_stats)
            if base.bias is not None:
                out = out + base.bias
            for bias in biases:
                out = out + bias.to(dtype)
            return out

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            names = [n for n in check_adapters_to_merge(self, adapter_names) if n in self.lora_A.keys()]
            if not names:
                return
            fused = dict(self._paradiff_fused or {})
            fused.update({name: _number(self.scaling[name]) for name in names})
            if not self.weights_freed():
                self._fuse(fused, safe_merge)
            self._paradiff_fused = fused
            self.merged_adapters.extend(names)

        def weights_freed(self) -> bool:
            """True while a staged pipeline has dropped this layer's weights (its stage is not running)."""
            weight = self.get_base_layer().weight
            return weight.numel() == 0 and self.out_features * self.in_features > 0

        def _fuse(self, fused: dict[str, float], safe_merge: bool = False) -> None:
            """The shard (kept as it was, the first time) plus the fp32 sum of every fused adapter's delta with the
            scaling it had when it was fused, cast once."""
            base = self.get_base_layer()
            if type(base.weight.data) is not torch.Tensor or not base.weight.dtype.is_floating_point:
                # quantized data (torchao, bitsandbytes, GGUF): api/lora.py refuses the fuse before any layer
                raise AdapterError(f"cannot fuse a LoRA adapter into the quantized weight of "
                                   f"{type(base).__name__} ({type(base.weight).__name__}); keep it unfused.")
            if self._paradiff_original is None:
                bias = None if base.bias is None else base.bias.data.clone()
                self._paradiff_original = (base.weight.data.clone(), bias)
            original_weight, original_bias = self._paradiff_original
            weight = original_weight.float()
            bias = None if original_bias is None else original_bias.float()
            for name, scaling in fused.items():
                weight = weight + self.get_delta_weight(name, scaling)
                lora_bias = self.lora_B[name].bias
                if lora_bias is not None:
                    if bias is None:
                        raise AdapterError(f"{name}: a LoRA with lora_bias needs a base layer with a bias to fuse.")
                    bias = bias + lora_bias.float() * scaling
            if safe_merge and not (torch.isfinite(weight).all() and (bias is None or torch.isfinite(bias).all())):
                raise ValueError(f"NaNs detected in the merged weights; the adapter(s) {list(fused)} seem broken.")
            base.weight.data = weight.to(original_weight.dtype)
            if bias is not None:
                base.bias.data = bias.to(original_bias.dtype)

        def unmerge(self) -> None:
            if not self.merged:
                return
            if self._paradiff_original is not None:
                base = self.get_base_layer()
                weight, bias = self._paradiff_original
                base.weight.data = weight
                if bias is not None:
                    base.bias.data = bias
            self._paradiff_original = None
            self._paradiff_fused = None
            self.merged_adapters.clear()

        def weights_dropped(self) -> None:
            """The stage freed the shard: the copy kept for unfusing goes too (the stage reads the shard again)."""
            self._paradiff_original = None

        def weights_read(self) -> None:
            """The stage read the original shard again: fuse the fused adapters into it again, exactly as before."""
            if self._paradiff_fused:
                self._paradiff_original = None
                self._fuse(self._paradiff_fused)

        def get_delta_weight(self, adapter: str, scaling: float | None = None) -> torch.Tensor:
            # in fp32 whatever the factors' dtype: the fused shard is cast once, after the sum
            weight_A = self.lora_A[adapter].weight.float()
            weight_B = self.lora_B[adapter].weight.float()
            return (weight_B @ weight_A) * (self.scaling[adapter] if scaling is None else scaling)

    return ShardedLoraLinear


def _number(scaling) -> float:
    # a hot-swap-ready layer keeps its scalings as tensors that a swap overwrites in place: fuse with today's value
    return float(scaling) if torch.is_tensor(scaling) else scaling


def adopt(layer) -> None:
    """Make a peft LoRA Linear on a paradiff model run as a ShardedLoraLinear (a class swap: its state stays as it
    is). Unsplit Linears get it too, for the exact fuse / unfuse; other peft layers (convolutions) stay peft's."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora.torchao import TorchaoLoraLinear

    # peft's torchao layer (chosen for a torchao-quantized base) computes like its plain Linear; only its merge
    # differs (re-quantizing), which paradiff refuses on a quantized base
    if type(layer) in (LoraLinear, TorchaoLoraLinear) and isinstance(layer.get_base_layer(), nn.Linear):
        swap_class(layer, sharded_lora_class(), by="lora")


# peft's adapter layers on a model a staged run frees and reads again (io/weights.py, api/pipeline_wiring.py)

def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if is_lora_layer(module)]


def is_lora_layer(module: nn.Module) -> bool:
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # no adapter layer exists before peft is imported
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer) and "base_layer" in module._modules


def adapter_layout(model: nn.Module) -> tuple[set[str], dict[str, str]]:
    """For a staged pipeline's free / re-read of a model carrying adapters: (the state_dict names of the adapter
    tensors, which stay resident: they are not in the model's checkpoint; each LoRA-wrapped base tensor's state_dict
    name -> its name without the adapter, as the checkpoint and the plan know it)."""
    resident, renamed = set(), {}
    for path, layer in model.named_modules():
        if not is_lora_layer(layer):
            continue
        for name, _ in [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]:
            full = f"{path}.{name}" if path else name
            if name.startswith("base_layer."):
                renamed[full] = f"{path}.{name.removeprefix('base_layer.')}" if path else name.removeprefix("base_layer.")
            else:
                resident.add(full)
    return resident, renamed


def weights_dropped(model: nn.Module) -> None:
    """A stage freed the model's weights: fused layers drop the shard copy they keep for unfusing (read again)."""
    for layer in lora_layers(model):
        if hasattr(layer, "weights_dropped"):
            layer.weights_dropped()


def weights_read(model: nn.Module) -> None:
    """A stage read the model's weights again (the originals): fused adapters are fused into them again."""
    for layer in lora_layers(model):
        if hasattr(layer, "weights_read"):
            layer.weights_read()
        elif layer.merged:  # peft's own layers (convolutions): merged again by peft, with today's scalings
            names = list(layer.merged_adapters)
            layer.merged_adapters.clear()
            layer.merge(adapter_names=names)
