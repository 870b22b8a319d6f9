"""FLUX.2 (`Flux2Transformer2DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise, PackedRowwise
from paradiff.plans.common import joint_attention, split_input
from paradiff.plans.family import Family
from paradiff.plans.flux import FLUX_INPUTS
from paradiff.plans.inputs import Full

MODEL_CLASSES = ("Flux2Transformer2DModel",)


def _widths(config) -> tuple[int, int]:
    inner = config.num_attention_heads * config.attention_head_dim
    return inner, int(inner * config.mlp_ratio)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **joint_attention("transformer_blocks.*.attn"),
        # SwiGLU: gate and up are equal halves of linear_in
        "transformer_blocks.*.ff.linear_in": PackedColwise([1, 1]),
        "transformer_blocks.*.ff.linear_out": "rowwise",
        "transformer_blocks.*.ff_context.linear_in": PackedColwise([1, 1]),
        "transformer_blocks.*.ff_context.linear_out": "rowwise",
        # single-stream: one fused [Q, K, V, gate, up] projection in, [attention, MLP] out
        "single_transformer_blocks.*.attn.to_qkv_mlp_proj": PackedColwise(
            lambda c: [_widths(c)[0]] * 3 + [_widths(c)[1]] * 2
        ),
        "single_transformer_blocks.*.attn.to_out": PackedRowwise(lambda c: list(_widths(c))),
        # shared AdaLN modulation (dim -> 6 dim / 3 dim) and the large text projection: replicated inputs
        "double_stream_modulation_img.linear": "rowwise_split_input",
        **split_input("double_stream_modulation_txt.linear", "single_stream_modulation.linear", "context_embedder",
                      "norm_out.linear"),
        "time_guidance_embed.timestep_embedder.linear_1": "colwise",
        "time_guidance_embed.timestep_embedder.linear_2": "rowwise",
    }
    if config.guidance_embeds:
        styles["time_guidance_embed.guidance_embedder.linear_1"] = "colwise"
        styles["time_guidance_embed.guidance_embedder.linear_2"] = "rowwise"
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "": {
                "hidden_states": Split(1),
                "encoder_hidden_states": Split(1),
                "img_ids": Split(-2),
                "txt_ids": Split(-2),
            }
        },
        gather_outputs={"proj_out": 1},
        # FLUX.2 [klein] KV: the reference image's tokens lead the sequence at the first step, attend to themselves
        # only and leave their keys and values in a cache the later steps attend to; split across the ranks, neither
        # the block structure nor the cache holds
        unsupported_inputs={"": {"kv_cache_mode": (
            "the reference tokens' K/V cache (Flux2KleinKVPipeline with an image) needs the whole sequence on each "
            "rank; run it without context parallelism, or without reference images")}},
    )


EXAMPLES = {"flux.2-dev": ("Flux2Transformer2DModel", dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=32, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True))}


INPUTS = {**FLUX_INPUTS, "guidance": Full(("batch",), 3.5)}


FAMILY = Family.of(__name__)
