"""Kandinsky 6 TI2VA without its audio branch (no audio VAE, `sample_audio=False`): Kandinsky 5's text encoders
(Qwen2.5-VL behind a Qwen2-VL processor, CLIP's pooled output), the HunyuanVideo VAE (factor 4 in space and time:
5 frames -> 2 latent frames of 4 x 6 tokens at 32 x 48 pixels), two transformer calls a step."""

from paradiff.testing.zoo import Recipe, TinyFamily
from paradiff.testing.zoo.recipes.kandinsky5 import video_components

FAMILIES = {
    "kandinsky6": TinyFamily(
        transformer_class="Kandinsky6Transformer3DModel",
        transformer=dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=16, time_dim=32,
                         patch_size=(1, 2, 2), model_dim=64, ff_dim=128, num_text_blocks=1, num_visual_blocks=2,
                         axes_dims=(4, 6, 6), in_audio_dim=6, out_audio_dim=6, model_dim_a=32, time_dim_a=24,
                         ff_dim_a=64, ca_rope=True, cross_gates=True, fix_modulation=True, text_token_padding=True,
                         visual_token_type_num_embeddings=2),
        components=video_components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  guidance_scale=4.0, num_inference_steps=2, max_sequence_length=16, height=32, width=48,
                  num_frames=5, sample_audio=False, output_type="np")),
}

RECIPES = {"Kandinsky6TI2VAPipeline": Recipe(family="kandinsky6")}
