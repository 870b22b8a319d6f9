"""Z-Image pipelines: a Qwen3 text encoder (the hidden states one layer from the top, padding dropped per prompt),
batch CFG over per-sample lists (one transformer call on [cond..., uncond...]). The transformer pads every image and
caption to a multiple of 32 tokens itself, so its token counts always divide 2 and 4 ranks. The tiny VAE has a
scale factor of 2 and the transformer 2 x 2 patches: 40 x 56 pixels are 10 x 14 = 140 image tokens (160 padded)."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Mask, Picture, Recipe, TinyFamily

TEXT_WIDTH = 32
SIZE = dict(height=40, width=56)
IMAGE, MASK = Picture(**SIZE), Mask(**SIZE)
PARTIAL = dict(strength=0.6, num_inference_steps=4)


def qwen3_text_encoder(seed: int, tokenizer):
    from transformers import Qwen3Config, Qwen3Model

    with tiny._seeded(seed, 1):
        return Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None))


def components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen3_chat_tokenizer()
    vae = tiny._small_vae(seed, scaling_factor=0.3611, shift_factor=0.1159)
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), vae=vae,
                text_encoder=qwen3_text_encoder(seed, tokenizer), tokenizer=tokenizer)


FAMILIES = {
    "z_image": TinyFamily(
        transformer_class="ZImageTransformer2DModel",
        transformer=dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=2,
                         n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=TEXT_WIDTH, axes_dims=[4, 6, 6],
                         axes_lens=[256, 64, 64]),
        components=components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  guidance_scale=3.0, num_inference_steps=2, max_sequence_length=32, output_type="np", **SIZE)),
}

RECIPES = {
    "ZImagePipeline": Recipe(family="z_image"),
    "ZImageImg2ImgPipeline": Recipe(extends="ZImagePipeline", call=dict(image=IMAGE, **PARTIAL)),
    "ZImageInpaintPipeline": Recipe(extends="ZImageImg2ImgPipeline", call=dict(mask_image=MASK)),
    # a ZImageControlNetModel sharing the transformer's embedders; residuals into both of its layers
    "ZImageControlNetPipeline": Recipe(
        extends="ZImagePipeline", controlnet=dict(control_layers_places=[0, 1], control_refiner_layers_places=[0],
                                                  control_in_dim=4),
        call=dict(control_image=Picture(**SIZE, seed=11), controlnet_conditioning_scale=0.8)),
    # the 2.0 ControlNet: the control latents, the mask and the masked image's latents (4 + 1 + 4 channels)
    "ZImageControlNetInpaintPipeline": Recipe(
        extends="ZImageControlNetPipeline", controlnet=dict(control_in_dim=9),
        call=dict(image=IMAGE, mask_image=MASK)),
}
