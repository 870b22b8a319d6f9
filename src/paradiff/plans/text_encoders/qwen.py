"""Qwen text encoders: Qwen-Image's Qwen2.5-VL (text part split; the vision tower stays whole) and FLUX.2 Klein /
Z-Image's Qwen3."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {
    "Qwen2_5_VLTextModel": ("", None),
    "Qwen2_5_VLModel": ("language_model", None),
    "Qwen2_5_VLForConditionalGeneration": ("model.language_model", "lm_head"),
    "Qwen3Model": ("", None),
    "Qwen3ForCausalLM": ("model", "lm_head"),
}
MODEL_CLASSES = tuple(PATHS)

# Qwen2.5-VL's attention keeps its own head counters; Qwen3's reshapes by head_dim like Llama.
_QWEN2_5_VL_ATTRS = {
    "per_query_head": ("num_heads",),
    "per_kv_head": ("num_key_value_heads",),
    "groups": ("num_key_value_groups",),
}


def tensor_parallel_plan(config, model_class: str):
    attrs = _QWEN2_5_VL_ATTRS if model_class.startswith("Qwen2_5_VL") else None
    return decoder_text_model(config, model_class, PATHS, attrs)


FAMILY = Family(name="qwen", model_classes=MODEL_CLASSES, tensor_parallel_plan=tensor_parallel_plan)
