"""Gemma text encoders: Lumina-Next's Gemma, Lumina 2 / Sana's Gemma 2 and LTX-2 / SANA-WM's Gemma 3 (text part
split; Gemma 3's SigLIP vision tower stays whole). Gemma's scaled token embedding keeps its scaling under the
vocabulary split."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {
    "GemmaModel": ("", None),
    "GemmaForCausalLM": ("model", "lm_head"),
    "Gemma2Model": ("", None),
    "Gemma2ForCausalLM": ("model", "lm_head"),
    "Gemma3TextModel": ("", None),
    "Gemma3ForCausalLM": ("model", "lm_head"),
    "Gemma3Model": ("language_model", None),
    "Gemma3ForConditionalGeneration": ("model.language_model", "lm_head"),
}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    return decoder_text_model(config, model_class, PATHS)


FAMILY = Family.of(__name__)
