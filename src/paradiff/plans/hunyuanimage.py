"""HunyuanImage 2.1 (`HunyuanImageTransformer2DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedRowwise
from paradiff.plans.common import attention, feed_forward, joint_attention, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full, Noise, Uniform, text_mask

MODEL_CLASSES = ("HunyuanImageTransformer2DModel",)
REFINER = "context_embedder.token_refiner.refiner_blocks"


def _single_out_blocks(config) -> list[int]:
    inner = config.num_attention_heads * config.attention_head_dim
    return [inner, int(inner * config.mlp_ratio)]  # proj_out reads [attention, MLP]


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **joint_attention("transformer_blocks.*.attn"),
        **feed_forward("transformer_blocks.*.ff"),
        **feed_forward("transformer_blocks.*.ff_context"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
                      "single_transformer_blocks.*.norm.linear", "context_embedder.proj_in", "norm_out.linear"),
        # single-stream blocks: attention without an output projection; proj_out reads [attention, MLP]
        "single_transformer_blocks.*.attn.to_q": "colwise",
        "single_transformer_blocks.*.attn.to_k": "colwise",
        "single_transformer_blocks.*.attn.to_v": "colwise",
        "single_transformer_blocks.*.proj_mlp": "colwise",
        "single_transformer_blocks.*.proj_out": PackedRowwise(_single_out_blocks),
        # the text token refiner
        **attention(f"{REFINER}.*.attn"),
        **feed_forward(f"{REFINER}.*.ff"),
        f"{REFINER}.*.norm_out.linear": "rowwise_split_input",
        **mlp("context_embedder.time_text_embed.timestep_embedder"),
        **mlp("context_embedder.time_text_embed.text_embedder"),
        **mlp("time_guidance_embed.timestep_embedder"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # Image and (refined) text are split at the first block; the attention holds [image, text], so the key mask over
    # [image, text] is split part by part, and the rotary tables (image only) with the image.
    per_block = {"attention_mask": Split(-1, parts=("hidden_states", "encoder_hidden_states")),
                 "image_rotary_emb": Split(0)}
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "transformer_blocks.*": per_block,
            "single_transformer_blocks.*": per_block,
        },
        gather_outputs={"proj_out": 1},
        # the token refiner runs on the whole text on every rank before the split
        local_attention=(f"{REFINER}.*.attn",),
    )


EXAMPLES = {
    "hunyuanimage-2.1": ("HunyuanImageTransformer2DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=32, text_embed_2_dim=24,
        rope_axes_dim=(8, 8))),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "height", "width")),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    encoder_attention_mask=text_mask("long", keep="text - 3"),  # the last prompt is padded
    encoder_hidden_states_2=Noise(("batch", 4, "text_embed_2_dim")),
    encoder_attention_mask_2=Full(("batch", 4), 1, "long", set=(("0, 2:", 0),)),
    return_dict=False,
)


FAMILY = Family.of(__name__)
