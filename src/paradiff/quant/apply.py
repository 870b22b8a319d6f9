"""Quantize, on each rank, the linear weights it holds: its slices of the planned ones and the whole others, each
one as soon as it is read (`ReadQuantizer`), so that a rank never holds more than one weight in the load dtype.

A shard must equal the slice of what the single-device quantized model holds:

- per-row int8 / fp8 (torchao): a row's scale depends only on the row's minimum and maximum. A slice of rows is
  therefore exact on its own; a slice of columns needs the extrema of the whole row. Before the quantizing read,
  each rank reads its column slices once in pieces of rows (`row_extrema` of each piece; nothing is kept), the TP
  group takes one all-reduce(max) of all of them together (`reduce_row_extrema`, a small float32 tensor), and
  torchao's own scale function is run on the whole-row extrema;
- nf4 (bitsandbytes): each block of 64 consecutive elements has its own absmax, so a slice on block boundaries
  (checked before any read, `schemes.check_block_boundaries`) quantizes locally to exactly its blocks.

Until the sharded linears are swapped in, a quantized weight's parameter is a meta placeholder of its logical shape;
`ReadQuantizer.install` then puts the quantized tensors in place. A staged component's re-read (its parameters read
again in the load dtype at its stage) is quantized afterwards, all at once, by `quantize_model`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from paradiff.runtime.patches import replace_module, set_attribute, share_hooks
from paradiff.distributed.comm import all_reduce_row_extrema
from paradiff.quant.schemes import QuantScheme
from paradiff.tensor_parallel.layers import ShardedLinear
from paradiff.tensor_parallel.styles import ShardSpec


def column_split_weights(model: nn.Module, resolved: Any, scheme: QuantScheme) -> dict[str, ShardSpec]:
    """Parameter name -> this rank's slice, for every weight `scheme` quantizes with whole-row scales (int8 / fp8)
    of which this rank holds a slice of the columns (read before the swap: the model still has its nn.Linear
    modules). Every rank of the TP group gets the same names, in the same order, from the agreed plan."""
    if scheme.name not in ("int8", "fp8") or scheme.saved or resolved is None:
        return {}
    out = {}
    for name, linear in resolved.linears.items():
        spec = linear.specs.get("weight")
        if linear.embedding or linear.style.target != "linear" or spec is None or spec.dim != 1:
            continue
        if scheme.quantizes(name, model.get_submodule(name) if name else model):
            out[f"{name}.weight" if name else "weight"] = spec
    return out


def row_extrema(pieces: Iterable[torch.Tensor]) -> torch.Tensor:
    """(rows, 2) float32 [-row minimum, row maximum] of a weight slice given as consecutive pieces of its rows."""
    parts = []
    for piece in pieces:
        piece = piece.float()
        parts.append(torch.stack([-piece.amin(dim=1), piece.amax(dim=1)], dim=1))
    return torch.cat(parts, dim=0)


def reduce_row_extrema(local: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Name -> (rows, 2) float32 [row minimum, row maximum] over the whole row: one all-reduce(max) over the TP group
    of every column-split weight's local extrema together. Every rank of `group` calls it with the same names."""
    if not local:
        return {}
    packed = torch.cat(list(local.values()), dim=0).contiguous()
    if group is not None and dist.get_world_size(group) > 1:
        all_reduce_row_extrema(packed, group)
    out, offset = {}, 0
    for name, part in local.items():
        both = packed[offset:offset + part.shape[0]]
        out[name] = torch.stack([-both[:, 0], both[:, 1]], dim=1)
        offset += part.shape[0]
    return out


class ReadQuantizer:
    """Quantizes each weight `scheme` covers as the read hands it over, and holds the result until `install`.

    `extrema`: the whole-row extrema of the column-split weights (`reduce_row_extrema`), needed by int8 / fp8."""

    def __init__(self, scheme: QuantScheme, extrema: dict[str, torch.Tensor] | None = None) -> None:
        self.scheme = scheme
        self.extrema = extrema or {}
        self.held: dict[str, Any] = {}  # parameter name -> torchao tensor, or (packed, quant state) for nf4
        self.filled = {"quantized": 0, "quantized_bytes": 0}  # weights quantized into FSDP's packed rows

    def covers(self, model: nn.Module, name: str) -> bool:
        module_name, _, leaf = name.rpartition(".")
        return leaf == "weight" and self.scheme.quantizes(module_name, model.get_submodule(module_name)
                                                          if module_name else model)

    def quantize(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """Quantize the weight just read (this rank's slice, in the load dtype, on its device) and keep it; returns
        the meta placeholder the model holds until `install`. The caller drops `weight` at once."""
        if self.scheme.name == "nf4":
            import bitsandbytes.functional as bnb_functional

            self.held[name] = bnb_functional.quantize_4bit(
                weight.contiguous(), blocksize=self.scheme.block, quant_type="nf4", compress_statistics=False,
                quant_storage=torch.uint8)
        else:
            self.held[name] = _to_torchao(weight, self.scheme, self.extrema.get(name))
        return torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def quantize_rows(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inner tensors (`packed_layout`'s parts) of rows of a weight, quantized on their own: per-row int8 /
        fp8 scales depend on their row only, so FSDP's rows of a weight quantize to the rows of the whole's."""
        quantized = _to_torchao(weight, self.scheme, None)
        parts = {name: getattr(quantized, name) for name in _data_names(quantized)}
        self.filled["quantized"] += 1
        self.filled["quantized_bytes"] += quantized_nbytes(quantized)
        return parts

    def hold(self, name: str, held: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Keep a weight read already quantized (a pre-quantized checkpoint's slice, `quant/saved.py`); returns the
        meta placeholder of its logical `shape` the model holds until `install`."""
        self.held[name] = held
        return torch.empty(shape, dtype=dtype, device="meta")

    def install(self, model: nn.Module) -> dict[str, int]:
        """Put every held weight in its module (after the swap); returns {"quantized": n, "quantized_bytes": b}."""
        nbytes = 0
        for name, held in self.held.items():
            module_name = name.rpartition(".")[0]
            module = model.get_submodule(module_name) if module_name else model
            if isinstance(held, tuple):  # bitsandbytes 4-bit: (packed codes, quant state)
                nbytes += _install_nf4(model, module_name, module, *held, self.scheme)
            else:
                module.weight = nn.Parameter(held, requires_grad=False)
                nbytes += quantized_nbytes(held)
        count = len(self.held)
        self.held = {}
        return {"quantized": count + self.filled["quantized"], "quantized_bytes": nbytes + self.filled["quantized_bytes"]}


def quantize_model(model: nn.Module, scheme: QuantScheme, group: dist.ProcessGroup | None) -> dict[str, int]:
    """Quantize, in place, every linear `scheme` covers whose weight the model holds in the load dtype (a staged
    component's re-read, `api/pipeline_wiring.py`; GGUF weights are wrapped as read); returns {"quantized": n,
    "quantized_bytes": b}. `group`: the TP group whose ranks hold slices of the planned linears (None: nothing is
    split); every rank of it runs this over the same plan after the ranks agreed the read, so the one all-reduce of
    the column slices' row extrema is issued alike on all."""
    if scheme.name == "gguf":
        return hold_gguf_weights(model, scheme)
    targets = [(f"{name}.weight" if name else "weight", module)
               for name, module in model.named_modules() if scheme.quantizes(name, module)]
    local = {}
    if scheme.name in ("int8", "fp8"):
        local = {name: row_extrema([module.weight.detach()]) for name, module in targets
                 if isinstance(module, ShardedLinear) and module.weight_spec.dim == 1}
    quantizer = ReadQuantizer(scheme, reduce_row_extrema(local, group))
    for name, module in targets:
        quantizer.quantize(name, module.weight.detach())
    return quantizer.install(model)


def packed_layout(scheme: QuantScheme, in_features: int, out_features: int, dtype: torch.dtype,
                  type_id: int | None = None) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Any, Any]:
    """(parts, build, product) of a quantized linear whose weight FSDP shards as plain tensors (`fsdp/packed.py`):
    the inner tensors of the weight `scheme` makes (name -> (shape, dtype), rows first), how the weight is rebuilt
    from them, and its product, the one the unsharded quantized linear computes. int8 / fp8: torchao's tensor of a
    probe row gives the parts and attributes; GGUF (`type_id`, its ggml type): the packed bytes of each row."""
    import torch.nn.functional as F

    if scheme.name == "gguf":
        import gguf
        from diffusers.quantizers.gguf.utils import GGUFParameter

        quant_type = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[quant_type]

        def build_gguf(parts: dict[str, torch.Tensor]) -> Any:
            return GGUFParameter(parts["packed"], requires_grad=False, quant_type=quant_type)

        return ({"packed": ((out_features, in_features // block * type_size), torch.uint8)}, build_gguf,
                partial(gguf_linear, compute_dtype=scheme.compute_dtype))
    probe = _to_torchao(torch.zeros(1, in_features, dtype=dtype), scheme, None)
    parts = {name: ((out_features, *getattr(probe, name).shape[1:]), getattr(probe, name).dtype)
             for name in _data_names(probe)}
    attributes = {name: getattr(probe, name) for name in [*probe.tensor_attribute_names,
                                                          *getattr(probe, "optional_tensor_attribute_names", [])]}
    kind = type(probe)

    def build(held: dict[str, torch.Tensor]) -> torch.Tensor:
        return kind(**held, **attributes)

    return parts, build, F.linear


def _data_names(tensor: Any) -> list[str]:
    """The names of a torchao tensor's inner tensors it holds (the optional ones only when set)."""
    names = [*tensor.tensor_data_names, *getattr(tensor, "optional_tensor_data_names", [])]
    return [name for name in names if getattr(tensor, name, None) is not None]


def _to_torchao(weight: torch.Tensor, scheme: QuantScheme, extrema: torch.Tensor | None) -> torch.Tensor:
    """torchao's tensor for `weight` (a whole weight or a slice of rows: torchao's own `from_hp`; a slice of columns:
    the scale of the whole row, computed by torchao's scale functions from the row's extrema)."""
    from torchao.quantization import Float8Tensor, Int8Tensor, PerRow

    if scheme.name == "int8":
        if extrema is None:
            return Int8Tensor.from_hp(weight, granularity=PerRow())
        from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine

        scale, zero_point = choose_qparams_affine(
            input=extrema.to(weight.dtype), mapping_type=MappingType.SYMMETRIC, block_size=[1, 2],
            target_dtype=torch.int8, quant_min=-128, quant_max=127, scale_dtype=torch.float32,
            zero_point_dtype=torch.int8, keepdim=True, eps=torch.finfo(torch.float32).eps,
        )
        return Int8Tensor.from_hp(weight, granularity=PerRow(), scale=scale, zero_point=zero_point)
    if extrema is None:
        return Float8Tensor.from_hp(weight, float8_dtype=scheme.float8_dtype, granularity=PerRow())
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    scale = _choose_scale_float8(extrema.to(weight.dtype), block_size=[1, 2], float8_dtype=scheme.float8_dtype)
    data = _quantize_affine_float8(weight, scale, scheme.float8_dtype)
    return Float8Tensor(data, scale, block_size=[1, weight.shape[1]], dtype=weight.dtype)


def _install_nf4(model: nn.Module, name: str, module: nn.Module, packed: torch.Tensor, state: Any,
                 scheme: QuantScheme) -> int:
    """bitsandbytes' 4-bit weight for the slice held. A whole linear becomes bitsandbytes' Linear4bit, as diffusers
    makes it; a sharded one keeps its class and computes through bitsandbytes' 4-bit product."""
    import bitsandbytes as bnb

    param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=state.blocksize,
                              compress_statistics=state.nested, quant_type=state.quant_type,
                              quant_storage=torch.uint8, bnb_quantized=True)
    if isinstance(module, ShardedLinear):
        module.weight = param
        set_attribute(module, "weight_linear", partial(nf4_linear, compute_dtype=scheme.compute_dtype), by="quant")
    elif isinstance(module, bnb.nn.Linear4bit):  # read again at its stage: quantized in place
        module.weight = param
        param.module = module
        module.quant_state = state
    else:
        linear = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                   compute_dtype=scheme.compute_dtype, compress_statistics=state.nested,
                                   quant_type=state.quant_type, quant_storage=torch.uint8, device="meta")
        float32_4bit_products(linear)
        linear.weight = param
        param.module = linear
        linear.quant_state = state
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
        _replace(model, name, module, linear)
    nested = [state.state2.absmax] if state.nested else []
    return sum(t.numel() * t.element_size() for t in [packed, state.absmax, *nested])


def float32_4bit_products(module: nn.Module) -> nn.Module:
    """Every bitsandbytes Linear4bit in `module` computes its product in the compute dtype on every CPU. On a CPU
    with AVX512-BF16 (Intel Xeon since Cooper Lake) bitsandbytes 0.50 repacks the weight at the first eval forward
    and multiplies with the input and scales cast to bfloat16, whatever the compute dtype: transformers' NF4 Mistral-3
    differed by 8.5e-3 from the float32 product there, so a model and its split would agree only to bf16 rounding,
    and on one CPU kind only. The repacking also fails for in_features below a block (a timestep MLP), and would leave
    the held bytes unlike the single-device slice. paradiff's own Linear4bit and the references it compares against
    (`--compare`) are made so."""
    import bitsandbytes as bnb

    for linear in module.modules():
        if isinstance(linear, bnb.nn.Linear4bit):
            linear.support_avx512bf16_for_cpu = False
    return module


def nf4_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None,
               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The product of `x` with a bitsandbytes 4-bit slice, as Linear4bit computes it (input cast to the compute
    dtype, output back to the input's)."""
    import bitsandbytes as bnb

    out_dtype = x.dtype
    if compute_dtype is not None:
        x = x.to(compute_dtype)
    bias = None if bias is None else bias.to(x.dtype)
    return bnb.matmul_4bit(x, weight, bias=bias, quant_state=weight.quant_state).to(out_dtype)


def hold_gguf_weights(model: nn.Module, scheme: QuantScheme) -> dict[str, int]:
    """Wrap the packed GGUF bytes each linear holds (its slice, read from the file) as diffusers' GGUFParameter. A
    whole linear becomes diffusers' GGUFLinear, as diffusers' GGUF loading makes it; a sharded one keeps its class,
    takes the logical width of its slice and computes through the same dequantize-then-linear product."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    nbytes = 0
    for param_name, type_id in scheme.packed.items():
        name = param_name.rpartition(".")[0]
        module = model.get_submodule(name)
        if "weight" not in module._parameters:  # FSDP's PackedLinear (fsdp/packed.py): its packed rows, read in place
            nbytes += sum(_local(getattr(module, part)).nbytes for part in module.part_names)
            continue
        data = module.weight.data
        weight = GGUFParameter(data, requires_grad=False, quant_type=gguf.GGMLQuantizationType(type_id))
        nbytes += data.numel() * data.element_size()
        if isinstance(module, ShardedLinear):
            module.weight = weight
            module.out_features, module.in_features = weight.quant_shape
            set_attribute(module, "weight_linear", partial(gguf_linear, compute_dtype=scheme.compute_dtype), by="quant")
            continue
        if isinstance(module, GGUFLinear):  # read again at its stage
            module.weight = weight
            continue
        with torch.device("meta"):
            linear = GGUFLinear(weight.quant_shape[1], weight.quant_shape[0], module.bias is not None,
                                compute_dtype=scheme.compute_dtype)
        linear.source_cls = type(module)
        linear.weight = weight
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
        linear.requires_grad_(False)
        _replace(model, name, module, linear)
    return {"quantized": len(scheme.packed), "quantized_bytes": nbytes}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (DTensor) parameter this rank holds."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# the forward hooks a module carries (context parallelism's token split / gather, a stage's hooks): they move whole
# to the module that replaces it, so every RemovableHandle still finds its hook


def _replace(model: nn.Module, name: str, module: nn.Module, linear: nn.Module) -> None:
    """Put the quantized `linear` in the place of `module` (named `name` in `model`), with its mode and hooks: a
    staged component is quantized after its hooks were placed."""
    linear.train(module.training)
    share_hooks(module, linear, by="quant")
    parent_name, _, leaf = name.rpartition(".")
    replace_module(model.get_submodule(parent_name) if parent_name else model, leaf, linear, by="quant",
                   release=True)


def gguf_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None,
                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The product of `x` with a GGUF slice, as diffusers' GGUFLinear computes it on every device without its
    optional CUDA kernels: the weight dequantized block by block, cast to the compute dtype, then F.linear."""
    import torch.nn.functional as F
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    dense = dequantize_gguf_tensor(weight).to(compute_dtype)
    return F.linear(x, dense, None if bias is None else bias.to(compute_dtype))


def quantized_nbytes(tensor: Any) -> int:
    """Bytes of a quantized weight's data and scales (torchao tensors list their inner tensors by name)."""
    names = list(getattr(tensor, "tensor_data_names", [])) + list(getattr(tensor, "optional_tensor_data_names", []))
    inner = [getattr(tensor, name, None) for name in names]
    return sum(t.numel() * t.element_size() for t in inner if t is not None)


def is_quantized_weight(param: Any) -> bool:
    """Whether a parameter holds quantized data: torchao's tensors, bitsandbytes' 4-bit weights, GGUF's packed ones."""
    return param is not None and (getattr(param, "quant_state", None) is not None
                                  or hasattr(param, "tensor_data_names")
                                  or getattr(param, "quant_type", None) is not None)


def quantization_summary(model: nn.Module) -> dict[str, int]:
    """What a rank holds of `model`: quantized linears, their bytes (data and scales), and the bytes of every other
    parameter (full precision: the load dtype). Counted from the module tree, so it holds for any load path."""
    quantized, quantized_bytes, other_bytes = 0, 0, 0
    seen = set()
    for module in model.modules():
        packed = getattr(module, "part_names", ())  # FSDP's PackedLinear (fsdp/packed.py): its rows, packed
        if packed:
            quantized += 1
            quantized_bytes += sum(_local(getattr(module, part)).nbytes for part in packed)
            seen.update(id(getattr(module, part)) for part in packed)
        for leaf, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            param = _local(param)
            state = getattr(param, "quant_state", None)
            if leaf == "weight" and state is not None:
                quantized += 1
                quantized_bytes += param.data.numel() * param.data.element_size()
                quantized_bytes += state.absmax.numel() * state.absmax.element_size()
                if state.nested:
                    quantized_bytes += state.state2.absmax.numel() * state.state2.absmax.element_size()
            elif leaf == "weight" and hasattr(param, "tensor_data_names"):
                quantized += 1
                quantized_bytes += quantized_nbytes(param)
            elif leaf == "weight" and getattr(param, "quant_type", None) is not None:  # GGUF, packed bytes
                quantized += 1
                quantized_bytes += param.numel() * param.element_size()
            else:
                other_bytes += param.numel() * param.element_size()
    return {"quantized_linears": quantized, "quantized_bytes": quantized_bytes, "full_precision_bytes": other_bytes}
