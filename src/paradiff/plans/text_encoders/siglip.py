"""SigLIP encoders: the vision towers of SD3.5 (IP-Adapter), HunyuanVideo / 1.5 I2V and Framepack
(`SiglipVisionModel`), SD3 ControlNet inpainting (`SiglipModel`, both towers) and Z-Image Omni (`Siglip2VisionModel`).
The attention-pooling head's MLP splits like a layer's; its attention (a torch MultiheadAttention) stays whole."""

from paradiff.plans.family import Family
from paradiff.plans.text_encoders.common import clip_style_tower
from paradiff.tensor_parallel.plan import TensorParallelPlan

MODEL_CLASSES = ("SiglipVisionModel", "SiglipModel", "Siglip2VisionModel")


def _vision_tower(root: str, vision_config):
    styles, attention = clip_style_tower(root, vision_config)
    if getattr(vision_config, "vision_use_head", True):
        styles[f"{root}head.mlp.fc1"] = "colwise"
        styles[f"{root}head.mlp.fc2"] = "rowwise"
    return styles, attention


def tensor_parallel_plan(config, model_class: str) -> TensorParallelPlan:
    if model_class != "SiglipModel":
        styles, attention = _vision_tower("", config)
        return TensorParallelPlan(styles=styles, attention=attention)
    styles, attention = _vision_tower("vision_model.", config.vision_config)
    text_styles, text_attention = clip_style_tower("text_model.", config.text_config)
    styles.update(text_styles)
    styles["text_model.embeddings.token_embedding"] = "vocab"
    return TensorParallelPlan(styles=styles, attention=attention | text_attention)


FAMILY = Family.of(__name__)
