"""GLM text encoders: CogView4's GLM-4-9B (`GlmModel`). A Llama-style decoder whose MLP packs gate and up in one
`gate_up_proj` (split as two blocks, so each rank keeps matching gate and up rows); partial rotary changes nothing
for the split."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {"GlmModel": ("", None), "GlmForCausalLM": ("model", "lm_head")}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    return decoder_text_model(config, model_class, PATHS, fused_gate_up=True)


FAMILY = Family.of(__name__)
