"""SmolLM3 text encoders: Bria FIBO's SmolLM3-3B (a Llama-style decoder; some layers skip rotary embeddings, which
changes nothing for the split)."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {"SmolLM3Model": ("", None), "SmolLM3ForCausalLM": ("model", "lm_head")}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    return decoder_text_model(config, model_class, PATHS)


FAMILY = Family.of(__name__)
