"""Qwen text encoders: Qwen-Image / HunyuanImage / Kandinsky 5 / LongCat / Cosmos 2.5's Qwen2.5-VL, EasyAnimate's
Qwen2-VL, Qwen-Image 2.1 / Bria FIBO 2 / JoyImage / NucleusMoE / Krea 2 / Ideogram 4 / PRX-pixel's Qwen3-VL (text
part split; the vision towers stay whole), and FLUX.2 Klein / Z-Image / Ovis / ACE-Step's Qwen3."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {
    "Qwen2VLTextModel": ("", None),
    "Qwen2VLModel": ("language_model", None),
    "Qwen2VLForConditionalGeneration": ("model.language_model", "lm_head"),
    "Qwen2_5_VLTextModel": ("", None),
    "Qwen2_5_VLModel": ("language_model", None),
    "Qwen2_5_VLForConditionalGeneration": ("model.language_model", "lm_head"),
    "Qwen3Model": ("", None),
    "Qwen3ForCausalLM": ("model", "lm_head"),
    "Qwen3VLTextModel": ("", None),
    "Qwen3VLModel": ("language_model", None),
    "Qwen3VLForConditionalGeneration": ("model.language_model", "lm_head"),
}
MODEL_CLASSES = tuple(PATHS)

# Qwen2-VL's and Qwen2.5-VL's attention keep their own head counters; Qwen3 / Qwen3-VL's reshape by head_dim like
# Llama.
_QWEN2_VL_ATTRS = {
    "per_query_head": ("num_heads",),
    "per_kv_head": ("num_key_value_heads",),
    "groups": ("num_key_value_groups",),
}


def tensor_parallel_plan(config, model_class: str):
    attrs = _QWEN2_VL_ATTRS if model_class.startswith(("Qwen2VL", "Qwen2_5_VL")) else None
    return decoder_text_model(config, model_class, PATHS, attrs)


FAMILY = Family.of(__name__)
