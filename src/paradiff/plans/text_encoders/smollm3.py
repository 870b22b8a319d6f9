"""SmolLM3 text encoders: Bria FIBO's SmolLM3-3B (a Llama-style decoder; some layers skip rotary embeddings, which
changes nothing for the split)."""

from paradiff.plans.text_encoders.common import decoder_paths, decoder_plan
from paradiff.plans.family import Family

PATHS = decoder_paths("SmolLM3Model", "SmolLM3ForCausalLM")
MODEL_CLASSES = tuple(PATHS)

tensor_parallel_plan = decoder_plan(PATHS)


FAMILY = Family.of(__name__)
