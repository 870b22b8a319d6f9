"""HunyuanVideo 1.5 pipelines: they guide through a guider component (ClassifierFreeGuidance: one transformer call
per branch, split by the cfg dimension), a Qwen2.5-VL text encoder and a ByT5 one; the image-to-video pipeline adds
a SigLIP vision encoder whose image tokens join the text context, and the image's latents beside the noise. The
components are testing.guiders' tiny HunyuanVideo 1.5 set (the guider's scale 4); the transformer has 4 heads (for
tp2 x ulysses2). The pipeline pads every prompt to 1000 Qwen tokens after its system part, as a real checkpoint."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily

IMAGE_WIDTH = 12


def components(seed: int) -> dict:
    from paradiff_testkit.guiders import build_guided_pipeline

    parts = dict(build_guided_pipeline("hunyuanvideo15", seed=seed).components)
    parts.pop("transformer")
    return parts


def image_encoder(seed: int, parts: dict, config: dict):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with tiny._seeded(seed, 7):
        return SiglipVisionModel(SiglipVisionConfig(
            hidden_size=IMAGE_WIDTH, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
            image_size=32, patch_size=8)).eval()


def feature_extractor(seed: int, parts: dict, config: dict):
    from transformers import SiglipImageProcessor

    return SiglipImageProcessor(size={"height": 32, "width": 32})


FAMILIES = {
    "hunyuanvideo15": TinyFamily(
        transformer_class="HunyuanVideo15Transformer3DModel",
        transformer=dict(in_channels=9, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=2,
                         num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                         text_embed_2_dim=32, image_embed_dim=IMAGE_WIDTH, rope_axes_dim=(2, 2, 4), target_size=16,
                         task_type="t2v"),
        components=components,
        # 5 frames of 16 x 16: 3 x 4 x 4 latents (the VAE: 4 in space, 2 in time), 48 tokens
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  height=16, width=16, num_frames=5, num_inference_steps=2, output_type="np")),
}

RECIPES = {
    "HunyuanVideo15Pipeline": Recipe(family="hunyuanvideo15"),
    "HunyuanVideo15ImageToVideoPipeline": Recipe(
        extends="HunyuanVideo15Pipeline", transformer=dict(task_type="i2v"),
        components=dict(image_encoder=image_encoder, feature_extractor=feature_extractor),
        drop=("height", "width"), call=dict(image=Picture(16, 16))),
}
