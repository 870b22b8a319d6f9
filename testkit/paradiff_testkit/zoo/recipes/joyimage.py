"""JoyImage edit pipelines: a Qwen3-VL encoder reads the prompt with the reference image(s) (TinyQwen3VLProcessor,
zoo/recipes/qwen3vl.py); the Wan VAE (z 16) encodes them; the transformer takes 1 x 2 x 2 patches; CFG as two
calls (the prompt's, then the negative prompt's, both with the images). The pipelines resize every image to a
1024-pixel bucket (1088 x 896 for these): a VAE of five spatial levels (factor 32) makes one token a 64 x 64 tile,
17 x 14 = 238 tokens an image."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.qwen3vl import TEXT_WIDTH, qwen3vl_encoder, qwen3vl_processor

SIZE = dict(height=320, width=192)


def components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen2_tokenizer()
    with tiny._seeded(seed, 3):
        # five spatial levels (factor 32): the pipelines resize every image to a 1024-pixel bucket
        vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[False, True, True, False, False],
                                         scale_factor_spatial=32, scale_factor_temporal=4)
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                text_encoder=qwen3vl_encoder(seed, tokenizer), tokenizer=tokenizer,
                processor=qwen3vl_processor(tokenizer), text_token_max_length=64)


TRANSFORMER = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=64, num_attention_heads=4, text_dim=TEXT_WIDTH,
                   num_layers=2, rope_dim_list=[4, 6, 6])
CALL = dict(prompt="make the fox red", negative_prompt="blurry, low quality", guidance_scale=4.0,
            num_inference_steps=2, max_sequence_length=32, output_type="np", **SIZE)

FAMILIES = {
    "joyimage_edit": TinyFamily(transformer_class="JoyImageEditTransformer3DModel", transformer=TRANSFORMER,
                                components=components, call=dict(CALL, image=Picture(**SIZE))),
    "joyimage_edit_plus": TinyFamily(transformer_class="JoyImageEditPlusTransformer3DModel", transformer=TRANSFORMER,
                                     components=components,
                                     call=dict(CALL, images=[Picture(**SIZE), Picture(128, 192, seed=9)])),
}

RECIPES = {
    "JoyImageEditPipeline": Recipe(family="joyimage_edit"),
    "JoyImageEditPlusPipeline": Recipe(family="joyimage_edit_plus"),
}
