"""Bria FIBO: FLUX.1's blocks where each block takes half its text features from one SmolLM3 layer; the prompt's
last two layers concatenated are the text (64 wide); batch CFG on [uncond, cond] with the layers and the text's key
mask batched. The pipeline fixes the VAE's factor at 16: a Wan 2.2-style VAE on 2 x 2 patchified pixels with three
spatial levels (z 16), unpatched latents: 176 x 144 pixels are 11 x 9 = 99 tokens."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily


def components(seed: int) -> dict:
    import diffusers
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    tokenizer = tiny._t5_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = SmolLM3ForCausalLM(SmolLM3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id))
    with tiny._seeded(seed, 3):
        vae = diffusers.AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2],
                                         num_res_blocks=1, temperal_downsample=[False, True, True], is_residual=True,
                                         in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                                         scale_factor_temporal=4, latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                text_encoder=text_encoder, tokenizer=tokenizer)


FAMILIES = {
    "bria_fibo": TinyFamily(
        transformer_class="BriaFiboTransformer2DModel",
        transformer=dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                         num_attention_heads=4, joint_attention_dim=64, text_encoder_dim=32,
                         pooled_projection_dim=None, axes_dims_rope=[4, 6, 6]),
        components=components,
        call=dict(prompt="{'text': 'a small red fox running through the snow'}", negative_prompt="blurry",
                  guidance_scale=5.0, num_inference_steps=2, max_sequence_length=64, output_type="np",
                  height=176, width=144)),
}

RECIPES = {
    "BriaFiboPipeline": Recipe(family="bria_fibo"),
    # the reference image's 99 tokens follow the 99 noise tokens (its own RoPE time plane), the mask left out
    "BriaFiboEditPipeline": Recipe(extends="BriaFiboPipeline", call=dict(
        prompt='{"text": "a small red fox", "edit_instruction": "make the fox red"}', image=Picture(176, 144))),
}
