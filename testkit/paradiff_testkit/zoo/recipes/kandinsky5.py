"""Kandinsky 5 pipelines: a Qwen2.5-VL text encoder behind a Qwen2-VL processor (the image-to-image call shows it
the image too) and a CLIP text model's pooled output, two transformer calls a step (the prompt, then the negative
prompt). Video: the HunyuanVideo VAE (factor 4 in space and time: 5 frames -> 2 latent frames; 32 x 48 pixels are
4 x 6 tokens of 1 x 2 x 2 patches a frame, 48 in all). Image: the pipelines snap every size to their list of
resolutions (1024 x 1024 the smallest) and assume a VAE factor of 8, so a four-level AutoencoderKL at 1024 x 1024:
64 x 64 tokens. Image-to-video and image-to-image condition the visual tokens on the image's latents and a mask
(`visual_cond`: 2 x 4 + 1 input channels); image-to-video renormalises its first four latent frames by the next
ones, so it takes 17 frames (5 latent frames, 120 tokens).

diffusers' Kandinsky 5 attention rounds the rotated queries and keys to bfloat16 (then back to float32): a
float32 difference of one ulp upstream (a split text encoder's sums in another order) flips a bfloat16 rounding
and comes out as 1e-5 to 1e-4 in the image, which says nothing about the split. The text-to-image, image-to-image
and text-to-video recipes compare with that step in float32 on both sides (`float32_rotary`: the same formula,
no rounding); image-to-video verifies with diffusers' own processor."""

import torch

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.qwenimage import processor


def _clip_text_model(seed: int, tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    with tiny._seeded(seed, 2):
        return CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, projection_dim=16,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))


def _text_parts(seed: int) -> dict:
    qwen = tiny.family_components("qwenimage", seed)
    tokenizer_2 = tiny._clip_tokenizer()
    parts = dict(text_encoder=qwen["text_encoder"], tokenizer=qwen["tokenizer"], tokenizer_2=tokenizer_2,
                 text_encoder_2=_clip_text_model(seed, tokenizer_2))
    parts["tokenizer"] = processor(seed, parts, {})
    return parts


def video_components(seed: int) -> dict:
    import diffusers

    vae = tiny.family_components("hunyuanvideo", seed)["vae"]
    return dict(_text_parts(seed), vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


def image_components(seed: int) -> dict:
    import diffusers

    vae = tiny._small_vae(seed, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                          block_out_channels=(8, 8, 8, 8), scaling_factor=0.3611, shift_factor=0.1159)
    return dict(_text_parts(seed), vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


class Float32RotaryProcessor:
    """Kandinsky 5 attention with its rotary step kept in float32: projections, per-head RMS norms in float32, the
    rotation of each (even, odd) feature pair by the 2 x 2 matrices of `rotary_emb`, SDPA over the heads, the
    output projection. diffusers' processor computes the same, rounding the rotated queries and keys to bfloat16."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        if sparse_params is not None:
            raise NotImplementedError("Float32RotaryProcessor serves dense attention only (attention_type='regular')")
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        heads = attn.num_heads
        query = attn.to_query(hidden_states).unflatten(-1, (heads, -1))
        key = attn.to_key(source).unflatten(-1, (heads, -1))
        value = attn.to_value(source).unflatten(-1, (heads, -1))
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        if rotary_emb is not None:
            query, key = _rotate(query, rotary_emb), _rotate(key, rotary_emb)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(-3, -2), key.transpose(-3, -2), value.transpose(-3, -2))
        return attn.out_layer(out.transpose(-3, -2).flatten(-2, -1))


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2)).unsqueeze(-2)  # (..., dim / 2, 1, 2)
    return (rope * pairs).sum(-1).flatten(-2).type_as(x)


def float32_rotary(pipe) -> None:
    """Every Kandinsky 5 attention module of the pipeline's transformer on Float32RotaryProcessor."""
    for module in pipe.transformer.modules():
        if type(module).__name__ == "Kandinsky5Attention":
            module.processor = Float32RotaryProcessor()


_TRANSFORMER = dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=16, time_dim=16,
                    patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2,
                    axes_dims=(4, 6, 6), visual_cond=False, attention_type="regular")
_CALL = dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
             guidance_scale=4.0, num_inference_steps=2, max_sequence_length=16, output_type="np")

FAMILIES = {
    "kandinsky5_video": TinyFamily(transformer_class="Kandinsky5Transformer3DModel", transformer=_TRANSFORMER,
                                   components=video_components,
                                   call=dict(_CALL, height=32, width=48, num_frames=5)),
    "kandinsky5_image": TinyFamily(transformer_class="Kandinsky5Transformer3DModel", transformer=_TRANSFORMER,
                                   components=image_components, call=dict(_CALL, height=1024, width=1024)),
}

RECIPES = {
    "Kandinsky5T2VPipeline": Recipe(family="kandinsky5_video", numerics=float32_rotary),
    "Kandinsky5I2VPipeline": Recipe(family="kandinsky5_video", transformer=dict(visual_cond=True),
                                    call=dict(image=Picture(32, 48), num_frames=17)),
    "Kandinsky5T2IPipeline": Recipe(family="kandinsky5_image", numerics=float32_rotary),
    "Kandinsky5I2IPipeline": Recipe(family="kandinsky5_image", transformer=dict(visual_cond=True),
                                    numerics=float32_rotary,
                                    # the tiny tokenizer spells the long system text in many tokens: a text
                                    # length that keeps the user turn, where the image's 16 tokens are
                                    call=dict(image=Picture(64, 64), max_sequence_length=1024)),
}
