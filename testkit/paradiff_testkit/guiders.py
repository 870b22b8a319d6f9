"""Tiny, random-weight, fully local standard pipelines that guide through a guider component (diffusers' guiders,
as Modular Diffusers pipelines do): HunyuanVideo15Pipeline.

    folder = save_guided_pipeline("hunyuanvideo15", "/tmp/tiny-hv15")
    pipe = DiffusionPipeline.from_pretrained(folder)
    frames = pipe(**guided_call_kwargs("hunyuanvideo15"), generator=torch.Generator().manual_seed(0)).frames

Sizes follow diffusers' own HunyuanVideo 1.5 test (2 heads of 8, a factor-4 VAE), with 2 transformer blocks.
(A note for the generic tiny-pipeline builder: this family guides through `guider`; its folder is written here.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paradiff_testkit.pipelines import _QWEN3_CHAT_TEMPLATE, _qwen2_tokenizer, _seeded, save_pipeline_folder

GUIDED_FAMILIES = ("hunyuanvideo15",)


def build_guided_pipeline(family: str = "hunyuanvideo15", seed: int = 0, guidance_scale: float = 4.0):
    import diffusers
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    if family not in GUIDED_FAMILIES:
        raise ValueError(f"unknown guided family {family!r}; known: {GUIDED_FAMILIES}")
    tokenizer = _qwen2_tokenizer()
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    with _seeded(seed, 1):
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [1, 1, 2]},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        )).eval()
    tokenizer_2 = ByT5Tokenizer()
    with _seeded(seed, 2):
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="relu", dropout_rate=0.0,
        )).eval()
    with _seeded(seed, 0):
        transformer = diffusers.HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
            text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v",
        ).eval()
        with torch.no_grad():  # diffusers zero-initialises some projections: perturb everything
            for param in transformer.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    with _seeded(seed, 3):
        vae = diffusers.AutoencoderKLHunyuanVideo15(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
            spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
            upsample_match_channel=False,
        ).eval()
    pipe = diffusers.HunyuanVideo15Pipeline(
        transformer=transformer, vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_guided_pipeline(family: str, folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny pipeline of `family` as a pipeline folder; does nothing if `folder/model_index.json` exists."""
    return save_pipeline_folder(folder, lambda: build_guided_pipeline(family, seed=seed))


def shorten_text(pipe) -> None:
    """HunyuanVideo 1.5 pads every prompt to 1000 Qwen tokens (after its 108-token system part) and 256 ByT5 ones:
    the pipeline's own `tokenizer_max_length` / `tokenizer_2_max_length`, set shorter here for quick tests (do the
    same on every pipeline compared)."""
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 24, 8


def guided_call_kwargs(family: str = "hunyuanvideo15") -> dict[str, Any]:
    """A quick generation: 5 frames of 16 x 16 (3 x 4 x 4 latents, 48 tokens), the guider's guidance scale."""
    return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                height=16, width=16, num_frames=5, num_inference_steps=2, output_type="np")
