"""Llama text encoders: HunyuanVideo's Llama-3-8B, HiDream's Llama-3.1-8B, and HunyuanVideo I2V's LLaVA (Llama
decoder split; its CLIP vision tower and projector stay whole)."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {
    "LlamaModel": ("", None),
    "LlamaForCausalLM": ("model", "lm_head"),
    "LlavaModel": ("language_model", None),
    "LlavaForConditionalGeneration": ("model.language_model", "lm_head"),
}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    return decoder_text_model(config, model_class, PATHS)


FAMILY = Family.of(__name__)
