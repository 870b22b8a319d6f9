"""Sana-Video pipelines: Sana's Gemma 2 text encoder and batch CFG (one transformer call on [uncond, cond], the text
masks batched along) over a Wan VAE (spatial factor 4, temporal 2). 32 x 32 pixels and 5 frames are 3 latent frames
of 4 x 4 tokens (1 x 2 x 2 patches): 48 tokens, in whole frames 3, which 2 and 4 ranks do not divide. Image-to-video
gives the first latent frame a clean (zero) timestep, per token."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily


def components(seed: int) -> dict:
    parts = tiny.family_components("sana", seed)
    parts["vae"] = tiny.family_components("wan", seed)["vae"]
    return parts


FAMILIES = {
    "sana_video": TinyFamily(
        transformer_class="SanaVideoTransformer3DModel",
        transformer=dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
                         num_cross_attention_heads=2, cross_attention_head_dim=32, cross_attention_dim=64,
                         caption_channels=32, sample_size=8, patch_size=(1, 2, 2), rope_max_seq_len=64,
                         qk_norm="rms_norm_across_heads"),
        components=components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  guidance_scale=4.5, num_inference_steps=2, height=32, width=32, frames=5, max_sequence_length=32,
                  complex_human_instruction=None, use_resolution_binning=False, output_type="np")),
}

RECIPES = {
    "SanaVideoPipeline": Recipe(family="sana_video"),
    "SanaImageToVideoPipeline": Recipe(extends="SanaVideoPipeline", call=dict(image=Picture(32, 32))),
}
