"""EasyAnimate (`EasyAnimateTransformer3DModel`): joint text-video attention, MMDiT blocks then shared-weight ones."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform, When

MODEL_CLASSES = ("EasyAnimateTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # QK-norms are per head: whole on every rank
    styles = {
        **attention("transformer_blocks.*.attn1"),
        **feed_forward("transformer_blocks.*.ff"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm2.linear", "norm_out.linear"),
        **mlp("time_embedding"),
    }
    for block in range(min(config.mmdit_layers, config.num_layers)):  # text's own projections and feed-forward
        prefix = f"transformer_blocks.{block}"
        styles.update({f"{prefix}.attn1.add_{x}_proj": "colwise" for x in "qkv"})
        styles.update({f"{prefix}.attn1.to_add_out": "rowwise", **feed_forward(f"{prefix}.txt_ff")})
    linear = ".1" if config.add_norm_text_encoder else ""  # behind an RMSNorm there
    styles[f"text_proj{linear}"] = "rowwise_split_input"
    if config.text_embed_dim_t5 is not None:
        styles[f"text_proj_t5{linear}"] = "rowwise_split_input"
    # the shared-weight blocks add the text's attention output to the text unprojected: it is gathered over heads
    shared = {f"transformer_blocks.{block}.attn1": {1: -1} for block in range(config.mmdit_layers, config.num_layers)}
    return TensorParallelPlan(styles=styles, gather_heads=shared)


def context_parallel_plan(config) -> ContextParallelPlan:
    # text and video attend jointly and both run through the blocks: both split; the rotary table covers the video
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)}},
        split_outputs={"rope_embedding": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1},
    )


_BASE = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, patch_size=2,
             num_layers=2, mmdit_layers=2, time_embed_dim=32, text_embed_dim=32)
EXAMPLES = {
    "easyanimate-v5.1": ("EasyAnimateTransformer3DModel", _BASE),
    # one MMDiT block then a shared-weight block, inpainting latents, a second (T5) text stream, normed text input
    "easyanimate-mixed-inpaint": ("EasyAnimateTransformer3DModel", {
        **_BASE, "in_channels": 9, "mmdit_layers": 1, "after_norm": True, "add_norm_text_encoder": True,
        "text_embed_dim_t5": 32}),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "out_channels", "frames", "height * patch_size", "width * patch_size")),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    # masked video latents and the mask itself
    inpaint_latents=When("in_channels > out_channels", Noise(("batch", "in_channels - out_channels", "frames",
                                                              "height * patch_size", "width * patch_size"))),
    encoder_hidden_states_t5=When("text_embed_dim_t5 is not None", Noise(("batch", 5, "text_embed_dim_t5"))),
    return_dict=False,
)


FAMILY = Family.of(__name__)
