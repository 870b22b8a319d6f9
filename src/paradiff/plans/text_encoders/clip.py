"""CLIP encoders: the text towers of FLUX.1, SD3, HunyuanVideo and HiDream, and the vision towers Wan 2.1 I2V,
ChronoEdit, FLUX.1 / Chroma / Bria / SkyReels-V2 (IP-Adapter image encoders) load. Small, but split like the rest so
every encoder shrinks."""

from paradiff.plans.family import Family
from paradiff.plans.text_encoders.common import clip_style_tower
from paradiff.tensor_parallel.plan import TensorParallelPlan

# where the transformer tower sits: the bare models are it, the WithProjection ones wrap it
ROOTS = {
    "CLIPTextModel": "",
    "CLIPTextModelWithProjection": "text_model.",
    "CLIPVisionModel": "",
    "CLIPVisionModelWithProjection": "vision_model.",
}
MODEL_CLASSES = tuple(ROOTS)


def tensor_parallel_plan(config, model_class: str) -> TensorParallelPlan:
    root = ROOTS[model_class]
    styles, attention = clip_style_tower(root, config)
    if model_class.startswith("CLIPText"):
        styles[f"{root}embeddings.token_embedding"] = "vocab"
    return TensorParallelPlan(styles=styles, attention=attention)


FAMILY = Family.of(__name__)
