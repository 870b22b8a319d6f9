"""Tiny GGUF files for tests: a diffusers model saved under its original-format names, each tensor in a chosen
ggml type, with the `gguf` package's own writer.

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and BF16 are quantized from the model's weights with gguf-py's quantizers. gguf-py
0.19 has no K-quant quantizer, so Q4_K / Q5_K / Q6_K tensors are random codes (seeded) with small fp16 super-block
scales: valid blocks whose dequantized values are as random as the rest of the tiny model. The model built from the
file is then whatever diffusers' own GGUF loading makes of it, which is what every test compares against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

# K-quants: (byte offsets of the fp16 super-block scales in each block, the scale that keeps values below ~0.2)
_K_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((208,), 2.5e-5)}
_QUANTIZED_BY_GGUF = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16")


def flux2_original_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A Flux2Transformer2DModel's weights under BFL's original names: the inverse of diffusers'
    convert_flux2_transformer_checkpoint_to_diffusers (fused QKV per stream, (shift, scale) final modulation)."""
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    renames = {
        "x_embedder": "img_in", "context_embedder": "txt_in",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin",
        "proj_out": "final_layer.linear",
    }
    double = {
        "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
        "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
        "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
        "attn.to_add_out": "txt_attn.proj", "ff_context.linear_in": "txt_mlp.0",
        "ff_context.linear_out": "txt_mlp.2",
    }
    single = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
              "attn.norm_k": "norm.key_norm"}
    out: dict[str, torch.Tensor] = {}
    for name in list(state):
        module, _, leaf = name.rpartition(".")
        if module in renames:
            out[f"{renames[module]}.{leaf}"] = state.pop(name)
        elif module == "norm_out.linear":
            scale, shift = state.pop(name).chunk(2, dim=0)
            out[f"final_layer.adaLN_modulation.1.{leaf}"] = torch.cat([shift, scale], dim=0)
    blocks = sorted({int(name.split(".")[1]) for name in state if name.startswith("transformer_blocks.")})
    for index in blocks:
        prefix = f"transformer_blocks.{index}."
        for stream, parts in (("img", ("to_q", "to_k", "to_v")), ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
            out[f"double_blocks.{index}.{stream}_attn.qkv.weight"] = torch.cat(
                [state.pop(f"{prefix}attn.{part}.weight") for part in parts], dim=0)
        for module, original in double.items():
            for leaf in ("weight", "bias"):
                if f"{prefix}{module}.{leaf}" in state:
                    stored = "scale" if "norm" in original else leaf
                    out[f"double_blocks.{index}.{original}.{stored}"] = state.pop(f"{prefix}{module}.{leaf}")
    singles = sorted({int(name.split(".")[1]) for name in state if name.startswith("single_transformer_blocks.")})
    for index in singles:
        prefix = f"single_transformer_blocks.{index}."
        for module, original in single.items():
            for leaf in ("weight", "bias"):
                if f"{prefix}{module}.{leaf}" in state:
                    stored = "scale" if "norm" in original else leaf
                    out[f"single_blocks.{index}.{original}.{stored}"] = state.pop(f"{prefix}{module}.{leaf}")
    if state:
        raise ValueError(f"no original name for {sorted(state)}")
    return out


def encode(tensor: torch.Tensor, type_name: str, seed: int = 0):
    """(numpy array to write, raw ggml type or None) for `tensor` stored as `type_name`."""
    import gguf

    array = tensor.detach().float().contiguous().numpy()
    if type_name == "F32":
        return array.astype(np.float32), None
    if type_name == "F16":
        return array.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in _QUANTIZED_BY_GGUF:
        return gguf.quants.quantize(array, qtype), qtype
    if type_name not in _K_SCALES:
        raise ValueError(f"the test writer cannot encode {type_name}; it writes F32, F16, "
                         f"{', '.join(_QUANTIZED_BY_GGUF)} and {', '.join(_K_SCALES)}")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, columns = array.reshape(-1, array.shape[-1]).shape
    generator = np.random.default_rng(seed)
    codes = generator.integers(0, 256, size=(rows, columns // block, type_size), dtype=np.uint8)
    offsets, scale = _K_SCALES[type_name]
    for offset in offsets:
        scales = (scale * generator.uniform(0.5, 1.5, size=(rows, columns // block))).astype(np.float16)
        codes[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, columns // block, 2)
    return codes.reshape(*array.shape[:-1], columns // block * type_size), qtype


def write_gguf(path: Path, tensors: dict[str, torch.Tensor], type_of: Callable[[str, torch.Tensor], str],
               arch: str = "flux") -> dict[str, str]:
    """Write `tensors` to `path`, each as `type_of(name, tensor)`; returns name -> type written."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    types = {}
    for index, (name, tensor) in enumerate(tensors.items()):
        types[name] = type_of(name, tensor)
        array, raw = encode(tensor, types[name], seed=index)
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def save_flux2_gguf(model: nn.Module, path: Path, type_of: Callable[[str, torch.Tensor], str]) -> dict[str, str]:
    """A tiny Flux2Transformer2DModel as an original-format GGUF file, each tensor (by its original name) in
    `type_of(name, tensor)` (GGUF converters keep 1-D tensors F32); returns original name -> type written."""
    return write_gguf(path, flux2_original_state_dict(model), type_of)
