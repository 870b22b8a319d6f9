"""Mistral text encoders: FLUX.2's Mistral-Small-3.1 (`Mistral3ForConditionalGeneration`, whose Pixtral vision tower
and projector stay whole: text-to-image never runs them)."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {
    "MistralModel": ("", None),
    "MistralForCausalLM": ("model", "lm_head"),
    "Mistral3Model": ("language_model", None),
    "Mistral3ForConditionalGeneration": ("model.language_model", "lm_head"),
}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    return decoder_text_model(config, model_class, PATHS)


FAMILY = Family.of(__name__)
