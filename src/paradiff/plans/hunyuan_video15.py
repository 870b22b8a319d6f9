"""HunyuanVideo 1.5 (`HunyuanVideo15Transformer3DModel`): dual-stream blocks over [video tokens, context tokens],
where the context joins image, ByT5 and MLLM tokens with their padding masks; the processor builds a
(valid query & valid key) mask from the context mask."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, feed_forward, joint_attention, mlp, split_input
from paradiff.plans.hunyuan_video import REFINER_ATTENTION, refiner_styles, text_mask
from paradiff.plans.family import Family

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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    byt5_tokens, image_tokens = 5, 4
    i2v = name == "hunyuan-video-1.5-i2v"
    image_embeds = torch.randn(batch, image_tokens, config.image_embed_dim, generator=generator)
    byt5_mask = torch.ones(batch, byt5_tokens, dtype=torch.int64)
    byt5_mask[0, -2:] = 0  # padding in the first sample's ByT5 tokens, the MLLM text pads the last sample
    inputs = dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.frames, grid.height, grid.width,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_embed_dim, generator=generator),
        encoder_attention_mask=text_mask(batch, grid.text),
        encoder_hidden_states_2=torch.randn(batch, byt5_tokens, config.text_embed_2_dim, generator=generator),
        encoder_attention_mask_2=byt5_mask,
        # text-to-video passes all-zero image embeddings, which the model masks out
        image_embeds=image_embeds if i2v else torch.zeros_like(image_embeds),
        return_dict=False,
    )
    if i2v:
        inputs["timestep_r"] = inputs["timestep"] * 0.5
    return inputs


FAMILY = Family.of(__name__)
