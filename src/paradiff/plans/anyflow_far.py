"""AnyFlow FAR (`AnyFlowFARTransformer3DModel`): AnyFlow's blocks over a chunk-causal sequence of FAR-compressed
context frames then full-resolution frames, with a flex-attention BlockMask. The cache-free forward is covered; its
KV-cache paths (prefill, autoregressive steps) index the cache by whole-sequence token counts and are refused under
context parallelism; under tensor parallelism each rank uses its heads' block of the cache."""

from paradiff.context_parallel.flex import MaskModAttentionProcessor
from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import anyflow
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Ref, Uniform, Value
from paradiff.models.anyflow_far import prepare_example

MODEL_CLASSES = ("AnyFlowFARTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    plan = anyflow.tensor_parallel_plan(config)
    # the pipeline allocates each block's KV cache, (2, batch, heads, tokens, head_dim), for every head: a rank
    # writes and reads its own heads' block of it
    plan.head_inputs = {"blocks.*": {"kv_cache": {"full_cache": 2, "compressed_cache": 2}}}
    return plan


def context_parallel_plan(config) -> ContextParallelPlan:
    why = ("the KV cache is written and read by whole-sequence token counts; context parallelism supports the "
           "cache-free forward")
    return ContextParallelPlan(
        # (batch, tokens, 6, dim) per-token modulation; the rotary tables and the BlockMask reach the blocks whole
        split_inputs={"blocks.0": {"hidden_states": Split(1)}, "blocks.*": {"temb": Split(1)}},
        gather_outputs={"norm_out": 1},
        local_attention=("blocks.*.attn2",),
        processors={"blocks.*.attn1": MaskModAttentionProcessor},
        unsupported_inputs={"": {"kv_cache": why}},
    )


EXAMPLES = {
    # three one-frame chunks, two kept at full resolution: one compressed context frame, then two full frames
    "anyflow-far": ("AnyFlowFARTransformer3DModel", dict(
        patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=2, num_attention_heads=4,
        attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        rope_max_seq_len=64, image_dim=24, deltatime_type="t-r", chunk_partition=(1, 1, 1))),
}


# 12 x 20 latents: 60 tokens per full frame, 15 per compressed one; 15 + 2 * 60 = 135 tokens
INPUTS = dict(
    hidden_states=Noise(("batch", "sum(chunk_partition)", "in_channels", 12, 20)),
    timestep=Uniform(1000, ("batch", "sum(chunk_partition)")),
    r_timestep=Ref("timestep", Uniform(shape=("batch", "sum(chunk_partition)"))),
    encoder_hidden_states=Noise(("batch", "text", "text_dim")),
    encoder_hidden_states_image=Noise(("batch", 4, "image_dim")),
    chunk_partition=Value("list(chunk_partition)"),
    return_dict=False,
)


FAMILY = Family.of(__name__)
