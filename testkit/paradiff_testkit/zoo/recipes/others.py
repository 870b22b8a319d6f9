"""The other tiny families of paradiff_testkit.pipelines, as they are (their own sizes)."""

from paradiff_testkit.zoo import Recipe

RECIPES = {
    # 44 x 36 pixels, scale factor 2, 2 x 2 patches: 11 x 9 = 99 tokens, on a 16 x 16 grid of position embeddings
    "AuraFlowPipeline": Recipe(family="auraflow", transformer=dict(pos_embed_max_size=256),
                               call=dict(height=44, width=36)),
    "CogView3PlusPipeline": Recipe(family="cogview3plus"),
    # Lumina 2's VAE scale factor is 8 and its patches 2 x 2: 80 x 48 pixels are 5 x 3 = 15 tokens
    "Lumina2Pipeline": Recipe(family="lumina2", call=dict(height=80, width=48)),
    "WanPipeline": Recipe(family="wan"),
    "WanPipeline@wan2.2": Recipe(family="wan2.2"),
    "WanPipeline@wan2.2-a14b": Recipe(family="wan2.2-a14b", call=dict(num_inference_steps=3)),
    # true CFG against a negative prompt, on top of the embedded guidance
    "HunyuanVideoPipeline": Recipe(family="hunyuanvideo", call=dict(negative_prompt="blurry, low quality",
                                                                    true_cfg_scale=2.0)),
    "LTXPipeline": Recipe(family="ltx"),
    "CogVideoXPipeline": Recipe(family="cogvideox"),
}
