"""Gemma text encoders: Lumina-Next's Gemma, Lumina 2 / Sana's Gemma 2 and LTX-2 / SANA-WM's Gemma 3 (text part
split; Gemma 3's SigLIP vision tower stays whole). Gemma's scaled token embedding keeps its scaling under the
vocabulary split."""

from paradiff.plans.text_encoders.common import decoder_paths, decoder_plan, multimodal_paths
from paradiff.plans.family import Family

PATHS = {**decoder_paths("GemmaModel", "GemmaForCausalLM"), **decoder_paths("Gemma2Model", "Gemma2ForCausalLM"),
         **decoder_paths("Gemma3TextModel", "Gemma3ForCausalLM"), **multimodal_paths("Gemma3")}
MODEL_CLASSES = tuple(PATHS)

tensor_parallel_plan = decoder_plan(PATHS)


FAMILY = Family.of(__name__)
