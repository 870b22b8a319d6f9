"""Tiny diffusers transformers with random weights, saved as real checkpoints, and inputs for them.

Used by the tests, the demo and the benchmarks: nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

FAMILIES = ("flux", "flux2", "qwenimage", "wan")


def model_class(family: str) -> type:
    import diffusers

    return {
        "flux": diffusers.FluxTransformer2DModel,
        "flux2": diffusers.Flux2Transformer2DModel,
        "qwenimage": diffusers.QwenImageTransformer2DModel,
        "wan": diffusers.WanTransformer3DModel,
    }[family]


def tiny_config(family: str, heads: int = 4, head_dim: int = 16, layers: int = 1, single_layers: int = 1) -> dict:
    """Smallest configs that still exercise every block type (double and single stream, fused projections)."""
    quarter = head_dim // 4
    three_axes = (quarter, (head_dim - quarter) // 2, (head_dim - quarter) // 2)  # rotary dims sum to head_dim
    if family == "flux":
        return dict(
            patch_size=1, in_channels=16, num_layers=layers, num_single_layers=single_layers,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
            pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=three_axes,
        )
    if family == "flux2":
        return dict(
            patch_size=1, in_channels=16, num_layers=layers, num_single_layers=single_layers,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
            timestep_guidance_channels=32, axes_dims_rope=(quarter,) * 4, guidance_embeds=True,
        )
    if family == "qwenimage":
        return dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=layers + single_layers,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32, axes_dims_rope=three_axes,
        )
    if family == "wan":
        return dict(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4,
            out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=layers + single_layers,
            rope_max_seq_len=64,
        )
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def build_model(family: str, seed: int = 0, **config_overrides: Any) -> nn.Module:
    """A model with random weights; biases and norms perturbed too, so a wrong slice cannot hide behind zeros."""
    config = tiny_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = model_class(family)(**config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def save_model(model: nn.Module, folder: Path, sharded: bool = False) -> Path:
    """Save as a diffusers checkpoint: one safetensors file, or an index with several shards."""
    if sharded:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        model.save_pretrained(folder, max_shard_size=max(total // 3, 1024), safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


@dataclass
class Lengths:
    """Sequence sizes of one input set: image tokens are derived from the latent grid."""

    height: int = 4
    width: int = 6
    text: int = 5
    frames: int = 1


def make_inputs(family: str, config: Any, batch: int = 1, lengths: Lengths | None = None, seed: int = 1) -> dict:
    """Forward kwargs for `family` with the given latent grid and text length (any sizes, even or not)."""
    lengths = lengths or Lengths()
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    h, w, t = lengths.height, lengths.width, lengths.text
    timestep = torch.rand(batch, generator=generator)
    if family in ("flux", "flux2"):
        axes = 3 if family == "flux" else 4
        img_ids = torch.zeros(h * w, axes)
        img_ids[:, -2] = torch.arange(h).repeat_interleave(w)
        img_ids[:, -1] = torch.arange(w).repeat(h)
        txt_ids = torch.zeros(t, axes)
        if family == "flux2":
            txt_ids[:, -1] = torch.arange(t)
        inputs = dict(
            hidden_states=randn(batch, h * w, config.in_channels),
            encoder_hidden_states=randn(batch, t, config.joint_attention_dim),
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=torch.full((batch,), 3.5),
        )
        if family == "flux":
            inputs["pooled_projections"] = randn(batch, config.pooled_projection_dim)
        return inputs
    if family == "qwenimage":
        mask = torch.ones(batch, t, dtype=torch.long)
        if t > 2:
            mask[-1, -2:] = 0  # padding at the end of the last prompt: exercises the text mask
        return dict(
            hidden_states=randn(batch, h * w, config.in_channels),
            encoder_hidden_states=randn(batch, t, config.joint_attention_dim),
            encoder_hidden_states_mask=mask,
            timestep=timestep,
            img_shapes=[[(1, h, w)]] * batch,
        )
    if family == "wan":
        p_t, p_h, p_w = config.patch_size
        return dict(
            hidden_states=randn(batch, config.in_channels, lengths.frames * p_t, h * p_h, w * p_w),
            encoder_hidden_states=randn(batch, t, config.text_dim),
            timestep=timestep * 1000,
        )
    raise ValueError(f"unknown family {family!r}")


def run_forward(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


Factory = Callable[[], nn.Module]


def unplanned_transformer_class() -> type:
    """A small DiT that no built-in plan knows (built from diffusers' Attention and FeedForward): the model a user
    brings, for plan='auto', check-plan and the no-plan errors."""
    from diffusers.configuration_utils import ConfigMixin, register_to_config
    from diffusers.models.attention import FeedForward
    from diffusers.models.attention_processor import Attention
    from diffusers.models.modeling_utils import ModelMixin

    class UnplannedBlock(nn.Module):
        def __init__(self, dim: int, heads: int, head_dim: int) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.attn1 = Attention(dim, heads=heads, dim_head=head_dim, qk_norm="rms_norm", bias=True)
            self.norm2 = nn.LayerNorm(dim)
            self.attn2 = Attention(dim, cross_attention_dim=dim, heads=heads, dim_head=head_dim, bias=True)
            self.norm3 = nn.LayerNorm(dim)
            self.ff = FeedForward(dim, mult=2, activation_fn="geglu")

        def forward(self, hidden_states, encoder_hidden_states):
            hidden_states = hidden_states + self.attn1(self.norm1(hidden_states))
            hidden_states = hidden_states + self.attn2(self.norm2(hidden_states), encoder_hidden_states)
            return hidden_states + self.ff(self.norm3(hidden_states))

    class UnplannedTransformer(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, in_channels: int = 8, num_attention_heads: int = 4, attention_head_dim: int = 8,
                     num_layers: int = 2, text_dim: int = 16) -> None:
            super().__init__()
            dim = num_attention_heads * attention_head_dim
            self.proj_in = nn.Linear(in_channels, dim)
            self.text_proj = nn.Linear(text_dim, dim)
            self.blocks = nn.ModuleList(
                UnplannedBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers))
            self.norm_out = nn.LayerNorm(dim)
            self.proj_out = nn.Linear(dim, in_channels)

        def forward(self, hidden_states, encoder_hidden_states, return_dict: bool = True):
            hidden_states = self.proj_in(hidden_states)
            encoder_hidden_states = self.text_proj(encoder_hidden_states)
            for block in self.blocks:
                hidden_states = block(hidden_states, encoder_hidden_states)
            output = self.proj_out(self.norm_out(hidden_states))
            return (output,) if not return_dict else {"sample": output}

    UnplannedTransformer.__module__ = __name__
    return UnplannedTransformer


UnplannedTransformer = unplanned_transformer_class()
