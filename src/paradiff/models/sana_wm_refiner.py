"""SANA-WM refiner's rotary tables for absolute frame positions, as its pipeline builds them, for the example
inputs plans/sana_wm_refiner.py declares."""

from types import SimpleNamespace

import torch


def video_rotary_emb(config, batch: int, frames: list[int], height: int, width: int, fps: float) -> tuple:
    """The model's own rotary embedder, built from `config`, at the absolute `frames` of the source video."""
    from diffusers import SanaWMLTX2RefinerTransformer3DModel as Model
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2AudioVideoRotaryPosEmbed

    rope = SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=config.num_attention_heads * config.attention_head_dim, patch_size=config.patch_size,
        patch_size_t=config.patch_size_t, base_num_frames=config.pos_embed_max_pos, base_height=config.base_height,
        base_width=config.base_width, scale_factors=config.vae_scale_factors, theta=config.rope_theta,
        causal_offset=config.causal_offset, modality="video", double_precision=config.rope_double_precision,
        rope_type=config.rope_type, num_attention_heads=config.num_attention_heads)
    return Model.build_rotary_emb_for_absolute_positions(SimpleNamespace(rope=rope), batch, frames, height, width,
                                                         torch.device("cpu"), fps=fps)
