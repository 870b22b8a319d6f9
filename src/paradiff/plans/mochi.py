"""Mochi 1 (`MochiTransformer3DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform, text_mask

MODEL_CLASSES = ("MochiTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        "transformer_blocks.*.attn1.to_q": "colwise",
        "transformer_blocks.*.attn1.to_k": "colwise",
        "transformer_blocks.*.attn1.to_v": "colwise",
        "transformer_blocks.*.attn1.add_q_proj": "colwise",
        "transformer_blocks.*.attn1.add_k_proj": "colwise",
        "transformer_blocks.*.attn1.add_v_proj": "colwise",
        "transformer_blocks.*.attn1.to_out.0": "rowwise",
        **feed_forward("transformer_blocks.*.ff", gated=True),
        **split_input("transformer_blocks.*.norm1.linear", "time_embed.caption_proj", "norm_out.linear"),
        **mlp("time_embed.timestep_embedder"),
    }
    # the last block only reads the text (context_pre_only): no text output projection or feed-forward
    for block in range(config.num_layers - 1):
        styles.update({f"transformer_blocks.{block}.attn1.to_add_out": "rowwise",
                       f"transformer_blocks.{block}.norm1_context.linear": "rowwise_split_input",
                       **feed_forward(f"transformer_blocks.{block}.ff_context", gated=True)})
    styles[f"transformer_blocks.{config.num_layers - 1}.norm1_context.linear_1"] = "rowwise_split_input"
    # the rotary table holds one frequency set per head: each rank keeps its heads' rows
    return TensorParallelPlan(styles=styles, head_outputs={"rope": {0: 1, 1: 1}})


def context_parallel_plan(config) -> ContextParallelPlan:
    # Text and video attend jointly, so both are split; the processor keeps each sample's unmasked text tokens
    # (a prefix of every rank's chunk, as masks pad at the end), so the mask is split with the text. The text is
    # split at the first block: the caption pooling before it reads the whole prompt.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "transformer_blocks.*": {"encoder_attention_mask": Split(1)},
        },
        split_outputs={"rope": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1},
    )


# widths chosen so the SwiGLU hidden sizes (8/3 of the width) are whole and even
EXAMPLES = {
    "mochi-1": ("MochiTransformer3DModel", dict(
        patch_size=2, num_attention_heads=4, attention_head_dim=24, num_layers=2, pooled_projection_dim=48,
        in_channels=4, text_embed_dim=32, time_embed_dim=32, max_sequence_length=16)),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames", "height * patch_size", "width * patch_size")),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    timestep=Uniform(1000),
    encoder_attention_mask=text_mask(keep="text // 2"),  # the last prompt is shorter
    return_dict=False,
)


FAMILY = Family.of(__name__)
