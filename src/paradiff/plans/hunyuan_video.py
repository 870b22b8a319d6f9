"""HunyuanVideo (`HunyuanVideoTransformer3DModel`): dual-stream then single-stream blocks over [video tokens, text
tokens] with a text-padding mask, a token refiner on the text, and (I2V) token-replace blocks that modulate the
first frame's tokens with the clean timestep."""

from paradiff.context_parallel.plan import ContextParallelPlan, Count, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedRowwise
from paradiff.plans.common import attention, feed_forward, joint_attention, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full, Noise, Uniform, When, text_mask

MODEL_CLASSES = ("HunyuanVideoTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **block_styles(),
        **refiner_styles("context_embedder"),
        **mlp("time_text_embed.timestep_embedder"),
        **mlp("time_text_embed.text_embedder"),
        **(mlp("time_text_embed.guidance_embedder") if config.guidance_embeds else {}),
        "norm_out.linear": "rowwise_split_input",
    })


def block_styles() -> dict:
    """Dual- and single-stream blocks (QK-norms are per head, so they need no split)."""
    return {
        **joint_attention("transformer_blocks.*.attn"),
        **feed_forward("transformer_blocks.*.ff"),
        **feed_forward("transformer_blocks.*.ff_context"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
                      "single_transformer_blocks.*.norm.linear"),
        "single_transformer_blocks.*.attn.to_q": "colwise",
        "single_transformer_blocks.*.attn.to_k": "colwise",
        "single_transformer_blocks.*.attn.to_v": "colwise",
        "single_transformer_blocks.*.proj_mlp": "colwise",
        # proj_out reads [attention output, MLP activation]
        "single_transformer_blocks.*.proj_out": PackedRowwise(_single_out_blocks),
    }


def _single_out_blocks(config) -> list[int]:
    inner = config.num_attention_heads * config.attention_head_dim
    return [inner, int(inner * config.mlp_ratio)]


def refiner_styles(prefix: str) -> dict:
    """The token refiner: a small self-attention transformer over the text, its own time/text embedder."""
    blocks = f"{prefix}.token_refiner.refiner_blocks.*"
    return {
        f"{prefix}.proj_in": "rowwise_split_input",
        **mlp(f"{prefix}.time_text_embed.timestep_embedder"),
        **mlp(f"{prefix}.time_text_embed.text_embedder"),
        **attention(f"{blocks}.attn"),
        **feed_forward(f"{blocks}.ff"),
        f"{blocks}.norm_out.linear": "rowwise_split_input",
    }


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs=block_splits(config, token_replace=config.image_condition_type == "token_replace"),
        split_outputs={"rope": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1},
        local_attention=(REFINER_ATTENTION,),
    )


# the refiner attends within the replicated text only
REFINER_ATTENTION = "context_embedder.token_refiner.refiner_blocks.*.attn"


def block_splits(config, token_replace: bool = False) -> dict:
    """Both streams split at the first block; the [video, text] key mask every block takes is split stream by
    stream, as the processor concatenates the streams' local tokens."""
    first = "transformer_blocks.0" if config.num_layers else "single_transformer_blocks.0"
    per_block = {"attention_mask": Split(3, parts=("hidden_states", "encoder_hidden_states"))}
    if token_replace:  # the first frame's tokens: how many of them this rank holds
        per_block["num_tokens"] = Count("hidden_states")
    return {
        first: {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
        "transformer_blocks.*": per_block,
        "single_transformer_blocks.*": per_block,
    }


_BASE = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
             text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))
EXAMPLES = {
    "hunyuan-video-t2v": ("HunyuanVideoTransformer3DModel", {**_BASE, "guidance_embeds": True}),
    "hunyuan-video-i2v": ("HunyuanVideoTransformer3DModel", {
        **_BASE, "in_channels": 9, "guidance_embeds": False, "image_condition_type": "token_replace"}),
}


# all text valid except the last sample's final three tokens (padding)
TEXT_MASK = text_mask("int64", keep="text - 3")
INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames * patch_size_t", "height * patch_size", "width * patch_size")),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    encoder_attention_mask=TEXT_MASK,
    pooled_projections=Noise(("batch", "pooled_projection_dim")),
    guidance=When("guidance_embeds", Full(("batch",), 6000.0)),
    return_dict=False,
)


FAMILY = Family.of(__name__)
