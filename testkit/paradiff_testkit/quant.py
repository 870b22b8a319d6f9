"""Pre-quantized checkpoints written the way diffusers writes them, without a GPU.

diffusers saves a bitsandbytes 4-bit model only from a GPU load (its quantizer refuses a CPU-only machine); the
file it writes is `model.state_dict()` of the model whose linears diffusers replaced by bitsandbytes' `Linear4bit`
(`replace_with_bnb_linear`): bitsandbytes' own `_save_to_state_dict` adds each weight's quant state
(`weight.absmax`, `weight.quant_map`, `weight.nested_*`, `weight.quant_state.bitsandbytes__nf4`), saved with
safetensors' `save_file` and metadata {"format": "pt"}, and config.json gains the config's `to_dict()` as
`quantization_config`. This writes the same, with the weights quantized on CPU by bitsandbytes' `quantize_4bit`.
torchao checkpoints need no helper: diffusers loads and saves them on CPU itself.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn


def save_bnb_4bit(model: nn.Module, folder: Path, config: Any, dtype: torch.dtype = torch.float32) -> Path:
    """Save `model` (a diffusers model with real weights) as diffusers saves it loaded with `config` (a
    BitsAndBytesConfig with load_in_4bit) in `dtype`: the linears diffusers would convert stored 4-bit."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional
    import safetensors.torch
    from diffusers.quantizers.bitsandbytes.utils import replace_with_bnb_linear

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    quantized = copy.deepcopy(model).to(dtype)
    skip = list(config.llm_int8_skip_modules or []) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    replace_with_bnb_linear(quantized, modules_to_not_convert=skip, quantization_config=config)
    for name, linear in quantized.named_modules():
        if not isinstance(linear, bnb.nn.Linear4bit):
            continue
        source = model.get_submodule(name)
        packed, state = bnb_functional.quantize_4bit(
            source.weight.detach().to(dtype).contiguous(), blocksize=64,
            compress_statistics=config.bnb_4bit_use_double_quant, quant_type=config.bnb_4bit_quant_type,
            quant_storage=torch.uint8)
        linear.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=64,
                                          compress_statistics=config.bnb_4bit_use_double_quant,
                                          quant_type=config.bnb_4bit_quant_type, quant_storage=torch.uint8,
                                          bnb_quantized=True, module=linear)
        if source.bias is not None:
            linear.bias = nn.Parameter(source.bias.detach().to(dtype), requires_grad=False)
    state_dict = {name: tensor.detach().contiguous() for name, tensor in quantized.state_dict().items()}
    safetensors.torch.save_file(state_dict, str(folder / "diffusion_pytorch_model.safetensors"),
                                metadata={"format": "pt"})
    model.save_config(folder)
    config_path = folder / "config.json"
    record = json.loads(config_path.read_text())
    record["quantization_config"] = config.to_dict()
    config_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return folder


def reference_bnb_4bit(model_cls: type, folder: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """What diffusers' `from_pretrained` builds from a bitsandbytes 4-bit checkpoint, on CPU: the model with the
    config's linears replaced by `replace_with_bnb_linear` and each weight restored by bitsandbytes'
    `Params4bit.from_prequantized` from its stored parts, as diffusers' quantizer restores them (its GPU check
    aside); the other tensors loaded as stored, in `dtype`."""
    import bitsandbytes as bnb
    import safetensors.torch
    from diffusers import BitsAndBytesConfig
    from diffusers.quantizers.bitsandbytes.utils import replace_with_bnb_linear

    folder = Path(folder)
    record = json.loads((folder / "config.json").read_text())
    config = BitsAndBytesConfig.from_dict(record.pop("quantization_config"))
    model = model_cls.from_config(record).to(dtype).eval()
    skip = list(config.llm_int8_skip_modules or []) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config)
    stored = safetensors.torch.load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    # fresh storage for every tensor (safetensors' load_file gives views into one buffer, 8-byte aligned: a GEMM
    # over an unaligned weight may round differently, which is no property of the weights)
    stored = {name: tensor.clone() for name, tensor in stored.items()}
    restored = set()
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            key = f"{name}.weight"
            stats = {k: v for k, v in stored.items() if k.startswith(key + ".")}
            module.weight = bnb.nn.Params4bit.from_prequantized(data=stored[key], quantized_stats=stats,
                                                                requires_grad=False, device="cpu", module=module)
            module.support_avx512bf16_for_cpu = False  # bitsandbytes' portable CPU product, as paradiff's
            restored.add(key)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in list(module._parameters.items()):
            if param is not None and f"{prefix}{leaf}" not in restored:
                module._parameters[leaf] = nn.Parameter(stored[f"{prefix}{leaf}"].to(dtype), requires_grad=False)
        for leaf in list(module._buffers):
            if f"{prefix}{leaf}" in stored:
                module._buffers[leaf] = stored[f"{prefix}{leaf}"]
    return model
