"""GLM text encoders: CogView4's GLM-4-9B (`GlmModel`). A Llama-style decoder whose MLP packs gate and up in one
`gate_up_proj` (split as two blocks, so each rank keeps matching gate and up rows); partial rotary changes nothing
for the split."""

from paradiff.plans.text_encoders.common import decoder_paths, decoder_plan
from paradiff.plans.family import Family

PATHS = decoder_paths("GlmModel", "GlmForCausalLM")
MODEL_CLASSES = tuple(PATHS)

tensor_parallel_plan = decoder_plan(PATHS, fused_gate_up=True)


FAMILY = Family.of(__name__)
