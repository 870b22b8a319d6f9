"""FLUX.1 (`FluxTransformer2DModel`): how it splits under tensor and context parallelism."""

from ..context_parallel.plan import ContextParallelPlan, Split
from ..tensor_parallel.plan import TensorParallelPlan
from ..tensor_parallel.styles import PackedRowwise
from .common import joint_attention

MODEL_CLASSES = ("FluxTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        # double-stream blocks: Q/K/V and FFN-in colwise, their projections back rowwise
        **joint_attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
        "transformer_blocks.*.ff_context.net.0.proj": "colwise",
        "transformer_blocks.*.ff_context.net.2": "rowwise",
        # AdaLN modulation (dim -> 6 dim) reads the replicated timestep embedding
        "transformer_blocks.*.norm1.linear": "rowwise_split_input",
        "transformer_blocks.*.norm1_context.linear": "rowwise_split_input",
        # single-stream blocks: proj_out consumes [attention (dim), MLP (4 dim)] concatenated
        "single_transformer_blocks.*.attn.to_q": "colwise",
        "single_transformer_blocks.*.attn.to_k": "colwise",
        "single_transformer_blocks.*.attn.to_v": "colwise",
        "single_transformer_blocks.*.proj_mlp": "colwise",
        "single_transformer_blocks.*.proj_out": PackedRowwise(_single_out_blocks),
        "single_transformer_blocks.*.norm.linear": "rowwise_split_input",
        # embeddings and the final modulation
        "context_embedder": "rowwise_split_input",
        "time_text_embed.timestep_embedder.linear_1": "colwise",
        "time_text_embed.timestep_embedder.linear_2": "rowwise",
        "time_text_embed.text_embedder.linear_1": "colwise",
        "time_text_embed.text_embedder.linear_2": "rowwise",
        "norm_out.linear": "rowwise_split_input",
    }
    if config.guidance_embeds:
        styles["time_text_embed.guidance_embedder.linear_1"] = "colwise"
        styles["time_text_embed.guidance_embedder.linear_2"] = "rowwise"
    return TensorParallelPlan(styles=styles)


def _single_out_blocks(config) -> list[int]:
    inner = config.num_attention_heads * config.attention_head_dim
    return [inner, 4 * inner]  # FluxSingleTransformerBlock uses mlp_ratio 4


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
    )
