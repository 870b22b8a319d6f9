"""Llama text encoders: HunyuanVideo's Llama-3-8B, HiDream's Llama-3.1-8B, and HunyuanVideo I2V's LLaVA (Llama
decoder split; its CLIP vision tower and projector stay whole)."""

from paradiff.plans.text_encoders.common import decoder_paths, decoder_plan, multimodal_paths
from paradiff.plans.family import Family

PATHS = {**decoder_paths("LlamaModel", "LlamaForCausalLM"), **multimodal_paths("Llava")}
MODEL_CLASSES = tuple(PATHS)

tensor_parallel_plan = decoder_plan(PATHS)


FAMILY = Family.of(__name__)
