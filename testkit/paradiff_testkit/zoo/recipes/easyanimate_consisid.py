"""EasyAnimate (a Qwen2-VL text encoder, the Magvit VAE; control and inpaint latents concatenated to the noise along
the channels) and ConsisID (CogVideoX's components and blocks, an image's latents beside the noise, perceiver
cross-attention to face features): batch CFG, one transformer call on [uncond, cond]."""

import torch

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily

TEXT_WIDTH = 32
PROMPT = dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality")
# Qwen2-VL's chat layout, text parts only (EasyAnimate formats every prompt as one user turn)
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# 48 x 48 pixels are 6 x 6 latents (8 in space), 2 x 2 patches: 9 tokens a frame; 9 frames are 3 latent frames (4 in
# time): 27 video tokens, which 2 and 4 ranks do not divide
EASYANIMATE_SIZE = dict(height=48, width=48, num_frames=9)


def _seeded_video(channels: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """A (1, channels, frames, height, width) video in [0, scale], EasyAnimate's tensor inputs."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, channels, EASYANIMATE_SIZE["num_frames"], EASYANIMATE_SIZE["height"], EASYANIMATE_SIZE["width"])
    return torch.rand(shape, generator=generator) * scale


def _mask_video() -> torch.Tensor:
    """Repaint the right half of every frame but the first (255), keep the rest (0)."""
    mask = torch.zeros(1, 1, EASYANIMATE_SIZE["num_frames"], EASYANIMATE_SIZE["height"], EASYANIMATE_SIZE["width"])
    mask[:, :, 1:, :, EASYANIMATE_SIZE["width"] // 2:] = 255
    return mask


def easyanimate_components(seed: int) -> dict:
    import diffusers
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLTextConfig, Qwen2VLVisionConfig

    tokenizer = tiny._qwen2_tokenizer()
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    text_config = Qwen2VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    vision_config = Qwen2VLVisionConfig(depth=1, embed_dim=16, hidden_size=TEXT_WIDTH, num_heads=2, patch_size=4,
                                        spatial_merge_size=2, temporal_patch_size=2)
    with tiny._seeded(seed, 1):
        text_encoder = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
            text_config=text_config, vision_config=vision_config, image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>")))
    with tiny._seeded(seed, 3):
        vae = diffusers.AutoencoderKLMagvit(
            in_channels=3, out_channels=3,
            down_block_types=("SpatialDownBlock3D",) + ("SpatialTemporalDownBlock3D",) * 3,
            up_block_types=("SpatialUpBlock3D",) + ("SpatialTemporalUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
            spatial_group_norm=False)
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, vae=vae,
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


def consisid_components(seed: int) -> dict:
    return tiny.family_components("cogvideox", seed)


FAMILIES = {
    "easyanimate": TinyFamily(
        transformer_class="EasyAnimateTransformer3DModel",
        transformer=dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                         time_embed_dim=32, text_embed_dim=TEXT_WIDTH, num_layers=2, mmdit_layers=2, patch_size=2,
                         sample_width=6, sample_height=6),
        components=easyanimate_components,
        call=dict(PROMPT, guidance_scale=6.0, num_inference_steps=2, output_type="np", **EASYANIMATE_SIZE)),
    # 32 x 32 pixels are 4 x 4 latents, 2 x 2 patches: 4 tokens a frame; 9 frames 3 latent frames; the text is the
    # transformer's 16 tokens
    "consisid": TinyFamily(
        transformer_class="ConsisIDTransformer3DModel",
        transformer=dict(num_attention_heads=4, attention_head_dim=16, in_channels=8, out_channels=4,
                         time_embed_dim=32, text_embed_dim=TEXT_WIDTH, num_layers=2, patch_size=2, sample_width=4,
                         sample_height=4, sample_frames=9, temporal_compression_ratio=4, max_text_seq_length=16,
                         use_rotary_positional_embeddings=True, is_train_face=True, is_kps=False,
                         cross_attn_interval=1, cross_attn_dim_head=16, cross_attn_num_heads=2, LFE_id_dim=16,
                         LFE_vit_dim=32, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=2,
                         LFE_num_querie=4, LFE_output_dim=42, LFE_ff_mult=2, LFE_num_scale=2),
        components=consisid_components,
        call=dict(PROMPT, guidance_scale=6.0, num_inference_steps=2, height=32, width=32, num_frames=9,
                  max_sequence_length=16, use_dynamic_cfg=False, output_type="np", image=Picture(32, 32),
                  # the face features (normally from the face models of ConsisID's utilities): seeded
                  id_cond=torch.randn(1, 16, generator=torch.Generator().manual_seed(31)),
                  id_vit_hidden=[torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(32 + i))
                                 for i in range(2)])),
}

RECIPES = {
    "EasyAnimatePipeline": Recipe(family="easyanimate"),
    # the control video's latents and a reference image's (none: zeros) beside the noise: 4 + 4 + 4 channels
    "EasyAnimateControlPipeline": Recipe(extends="EasyAnimatePipeline", transformer=dict(in_channels=12),
                                         call=dict(control_video=_seeded_video(3, 41))),
    # the mask's latents and the masked video's latents beside the noise: 4 + 4 + 4 channels
    # (the mask through the VAE with the video: resizing it directly reads a config key the Magvit VAE lacks)
    "EasyAnimateInpaintPipeline": Recipe(extends="EasyAnimatePipeline",
                                         transformer=dict(in_channels=12, resize_inpaint_mask_directly=False),
                                         call=dict(video=_seeded_video(3, 42), mask_video=_mask_video(),
                                                   strength=1.0)),
    "ConsisIDPipeline": Recipe(family="consisid"),
}
