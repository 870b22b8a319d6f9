"""Kandinsky 5 pipelines: a Qwen2.5-VL text encoder behind a Qwen2-VL processor (the image-to-image call shows it
the image too) and a CLIP text model's pooled output, two transformer calls a step (the prompt, then the negative
prompt). Video: the HunyuanVideo VAE (factor 4 in space and time: 5 frames -> 2 latent frames; 32 x 48 pixels are
4 x 6 tokens of 1 x 2 x 2 patches a frame, 48 in all). Image: the pipelines snap every size to their list of
resolutions (1024 x 1024 the smallest) and assume a VAE factor of 8, so a four-level AutoencoderKL at 1024 x 1024:
64 x 64 tokens. Image-to-video and image-to-image condition the visual tokens on the image's latents and a mask
(`visual_cond`: 2 x 4 + 1 input channels); image-to-video renormalises its first four latent frames by the next
ones, so it takes 17 frames (5 latent frames, 120 tokens)."""

from paradiff.testing import pipelines as tiny
from paradiff.testing.zoo import Picture, Recipe, TinyFamily
from paradiff.testing.zoo.recipes.qwenimage import processor


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
    "Kandinsky5T2VPipeline": Recipe(family="kandinsky5_video"),
    "Kandinsky5I2VPipeline": Recipe(family="kandinsky5_video", transformer=dict(visual_cond=True),
                                    call=dict(image=Picture(32, 48), num_frames=17)),
    "Kandinsky5T2IPipeline": Recipe(family="kandinsky5_image"),
    "Kandinsky5I2IPipeline": Recipe(family="kandinsky5_image", transformer=dict(visual_cond=True),
                                    call=dict(image=Picture(64, 64))),
}
