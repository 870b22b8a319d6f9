"""HunyuanVideo 1.5 (`HunyuanVideo15Transformer3DModel`): dual-stream blocks over [video tokens, context tokens],
where the context joins image, ByT5 and MLLM tokens with their padding masks; the processor builds a
(valid query & valid key) mask from the context mask."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import feed_forward, joint_attention, mlp, split_input
from paradiff.plans.hunyuan_video import REFINER_ATTENTION, TEXT_MASK, refiner_styles
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Full, Noise, Ref, Uniform

MODEL_CLASSES = ("HunyuanVideo15Transformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **joint_attention("transformer_blocks.*.attn"),
        **feed_forward("transformer_blocks.*.ff"),
        **feed_forward("transformer_blocks.*.ff_context"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
                      "norm_out.linear"),
        **refiner_styles("context_embedder"),
        **mlp("context_embedder_2"),  # ByT5 projection: its first two layers (its third stays whole)
        **mlp("image_embedder"),
        **mlp("time_embed.timestep_embedder"),
        **(mlp("time_embed.timestep_embedder_r") if config.use_meanflow else {}),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            # the context mask travels with the context tokens; the processor pads it for the local video tokens
            "transformer_blocks.*": {"attention_mask": Split(1)},
        },
        split_outputs={"rope": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1},
        local_attention=(REFINER_ATTENTION,),
    )


_BASE = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
             num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=32,
             text_embed_2_dim=24, image_embed_dim=16, rope_axes_dim=(4, 6, 6))
EXAMPLES = {
    "hunyuan-video-1.5-t2v": ("HunyuanVideo15Transformer3DModel", {**_BASE, "task_type": "t2v"}),
    # image-conditioned, with MeanFlow's second (target) timestep
    "hunyuan-video-1.5-i2v": ("HunyuanVideo15Transformer3DModel", {**_BASE, "use_meanflow": True}),
}


_INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames", "height", "width")),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text", "text_embed_dim")),
    encoder_attention_mask=TEXT_MASK,
    encoder_hidden_states_2=Noise(("batch", 5, "text_embed_2_dim")),
    # padding in the first sample's ByT5 tokens, the MLLM text pads the last sample
    encoder_attention_mask_2=Full(("batch", 5), 1, "int64", set=(("0, -2:", 0),)),
    return_dict=False,
)
INPUTS = ByExample({
    # text-to-video passes all-zero image embeddings, which the model masks out
    "hunyuan-video-1.5-t2v": {**_INPUTS, "image_embeds": Full(("batch", 4, "image_embed_dim"), 0.0)},
    "hunyuan-video-1.5-i2v": {**_INPUTS, "image_embeds": Noise(("batch", 4, "image_embed_dim")),
                              "timestep_r": Ref("timestep", 0.5)},
})


FAMILY = Family.of(__name__)
