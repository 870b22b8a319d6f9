"""Mistral text encoders: FLUX.2's Mistral-Small-3.1 (`Mistral3ForConditionalGeneration`, whose Pixtral vision tower
and projector stay whole: text-to-image never runs them)."""

from paradiff.plans.text_encoders.common import decoder_paths, decoder_plan, multimodal_paths
from paradiff.plans.family import Family

PATHS = {**decoder_paths("MistralModel", "MistralForCausalLM"), **multimodal_paths("Mistral3")}
MODEL_CLASSES = tuple(PATHS)

tensor_parallel_plan = decoder_plan(PATHS)


FAMILY = Family.of(__name__)
