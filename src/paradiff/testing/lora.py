"""Random LoRA adapters for the tiny models, saved as real safetensors files (diffusers / peft keys with diffusers'
adapter metadata, or kohya's `lora_unet_*` keys for FLUX.1), and the targets each family's tests use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

# per family: attention (joint and single stream), feed-forward, AdaLN modulation, and the top-level projection
# where context parallelism gathers the tokens
TARGETS = {
    "flux": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
             "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_k_proj",
             "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.ff.net.0.proj",
             "transformer_blocks.0.ff.net.2", "transformer_blocks.0.norm1.linear",
             "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out",
             "single_transformer_blocks.0.norm.linear", "single_transformer_blocks.0.attn.to_q", "proj_out",
             "context_embedder", "norm_out.linear"),
    "flux2": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0",
              "transformer_blocks.0.attn.add_v_proj", "transformer_blocks.0.ff.linear_in",
              "transformer_blocks.0.ff.linear_out", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
              "single_transformer_blocks.0.attn.to_out", "double_stream_modulation_img.linear", "proj_out"),
    "qwenimage": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v",
                  "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_q_proj",
                  "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.img_mlp.net.0.proj",
                  "transformer_blocks.0.img_mlp.net.2", "transformer_blocks.0.img_mod.1",
                  "transformer_blocks.1.txt_mod.1", "proj_out"),
    "wan": ("blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_out.0", "blocks.0.attn2.to_v",
            "blocks.0.attn2.to_out.0", "blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2",
            "condition_embedder.time_proj", "proj_out"),
}


def random_lora(model: nn.Module, targets: tuple[str, ...], rank: int, seed: int, scale: float = 0.2,
                prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """peft-format factors (`{prefix}.{module}.lora_A.weight` r x in, `lora_B.weight` out x r), both non-zero."""
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name in targets:
        module = model.get_submodule(name)
        state_dict[f"{prefix}.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * scale
        state_dict[f"{prefix}.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * scale
    return state_dict


def save_lora(path: Path, state_dict: dict[str, torch.Tensor], rank: int, alpha: float) -> Path:
    """A diffusers LoRA file: the factors plus the adapter metadata diffusers' save_lora_weights writes (r,
    lora_alpha and target modules, under each component's prefix: `transformer`, `text_encoder`, ...), so the
    loaders build the same LoraConfig."""
    from safetensors.torch import save_file

    metadata = {}
    for prefix in sorted({key.split(".", 1)[0] for key in state_dict}):
        targets = sorted({key[len(prefix) + 1:].split(".lora_")[0] for key in state_dict if key.startswith(f"{prefix}.")})
        config = {"r": rank, "lora_alpha": alpha, "target_modules": targets}
        metadata.update({f"{prefix}.{k}": v for k, v in config.items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path),
              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(metadata)})
    return path


def first_block_targets(model: nn.Module) -> tuple[str, ...]:
    """Every Linear of the first block of each block stack (attention, feed-forward, AdaLN modulation), and the
    model's top-level Linears (embedders, `proj_out`) and output modulation (`norm_out.linear`)."""
    return tuple(name for name, module in model.named_modules() if isinstance(module, nn.Linear) and (
        re.match(r"^[a-z_]*blocks\.0\.", name) or "." not in name or name == "norm_out.linear"))


def text_encoder_targets(encoder: nn.Module) -> tuple[str, ...]:
    """Every Linear of a text encoder's first layer (attention q / k / v / out and the MLP, for CLIP)."""
    return tuple(name for name, module in encoder.named_modules()
                 if isinstance(module, nn.Linear) and ".layers.0." in f".{name}")


# kohya (sd-scripts) names of FLUX.1 modules in BFL's layout, for block 0; qkv is one fused projection there, split
# in three by the converter. (The single blocks' fused linear1 is left out: diffusers' converter splits it by
# FLUX.1-dev's fixed widths, 3 x 3072 + 12288, which a tiny model does not have.)
def save_kohya_flux_lora(path: Path, config, rank: int, alpha: float, seed: int, scale: float = 0.2,
                         clip_width: int | None = None) -> Path:
    """A kohya-format FLUX.1 LoRA (`lora_unet_*.lora_down/lora_up.weight` and `.alpha`), for diffusers' converter;
    with `clip_width`, also `lora_te1_*` tensors on the first layer of a CLIP text encoder that wide (its MLP 2x)."""
    from safetensors.torch import save_file

    dim = config.num_attention_heads * config.attention_head_dim
    shapes = {  # (in, out) in BFL's layout
        "unet_double_blocks_0_img_attn_qkv": (dim, 3 * dim), "unet_double_blocks_0_img_attn_proj": (dim, dim),
        "unet_double_blocks_0_img_mlp_0": (dim, 4 * dim), "unet_double_blocks_0_img_mlp_2": (4 * dim, dim),
        "unet_double_blocks_0_img_mod_lin": (dim, 6 * dim), "unet_double_blocks_0_txt_attn_proj": (dim, dim),
        "unet_double_blocks_0_txt_attn_qkv": (dim, 3 * dim), "unet_single_blocks_0_linear2": (dim + 4 * dim, dim),
        "unet_single_blocks_0_modulation_lin": (dim, 3 * dim),
    }
    if clip_width is not None:
        layer = "te1_text_model_encoder_layers_0"
        shapes.update({f"{layer}_self_attn_{name}": (clip_width, clip_width)
                       for name in ("q_proj", "k_proj", "v_proj", "out_proj")})
        shapes.update({f"{layer}_mlp_fc1": (clip_width, 2 * clip_width), f"{layer}_mlp_fc2": (2 * clip_width, clip_width)})
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        tensors[f"lora_{name}.lora_down.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
        tensors[f"lora_{name}.lora_up.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
        tensors[f"lora_{name}.alpha"] = torch.tensor(float(alpha))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def save_original_hunyuan_video_lora(path: Path, config, rank: int, seed: int, scale: float = 0.2) -> Path:
    """A HunyuanVideo LoRA in the original repository's layout (`diffusion_model.double_blocks.0.img_attn_qkv...`,
    q / k / v fused), for diffusers' converter: block 0's attention, MLP and modulation, and the single block's
    output projection, which reads [attention, MLP] (paradiff splits it as two packed blocks). (The single blocks'
    fused linear1 is left out: diffusers' converter splits it by HunyuanVideo's fixed width, 3072.)"""
    from safetensors.torch import save_file

    dim = config.num_attention_heads * config.attention_head_dim
    mlp = int(dim * config.mlp_ratio)
    shapes = {  # (in, out)
        "double_blocks.0.img_attn_qkv": (dim, 3 * dim), "double_blocks.0.img_attn_proj": (dim, dim),
        "double_blocks.0.txt_attn_qkv": (dim, 3 * dim), "double_blocks.0.txt_attn_proj": (dim, dim),
        "double_blocks.0.img_mlp.fc1": (dim, mlp), "double_blocks.0.img_mlp.fc2": (mlp, dim),
        "double_blocks.0.img_mod.linear": (dim, 6 * dim), "single_blocks.0.linear2": (dim + mlp, dim),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        tensors[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
        tensors[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path
