"""Hunyuan-DiT (`HunyuanDiT2DModel`) and its ControlNet (`HunyuanDiT2DControlNetModel`, a copy of the first half of the
blocks, each block's output projected by its own zero-initialised Linear): how they split under tensor and context
parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("HunyuanDiT2DModel", "HunyuanDiT2DControlNetModel")
CONTROLNET = "HunyuanDiT2DControlNetModel"


def tensor_parallel_plan(config, model_class: str = "HunyuanDiT2DModel") -> TensorParallelPlan:
    if model_class == CONTROLNET:
        return TensorParallelPlan(styles={
            **_shared_styles(),
            # per-block outputs and the condition's input projection, on replicated inputs
            "controlnet_blocks.*": "rowwise_split_input",
            "input_block": "rowwise_split_input",
        })
    skip_blocks = range(config.num_layers // 2 + 1, config.num_layers)  # the long-skip half
    return TensorParallelPlan(styles={
        **_shared_styles(),
        # [hidden, skip] -> dim on the replicated concatenation
        **{f"blocks.{i}.skip_linear": "rowwise_split_input" for i in skip_blocks},
        "norm_out.linear": "rowwise_split_input",
    })


def _shared_styles() -> dict:
    return {
        **attention("blocks.*.attn1"),
        **attention("blocks.*.attn2"),
        **feed_forward("blocks.*.ff"),
        "blocks.*.norm1.linear": "rowwise_split_input",
        **mlp("text_embedder"),
        **mlp("time_extra_emb.timestep_embedder"),
        **mlp("time_extra_emb.extra_embedder"),
    }


def context_parallel_plan(config, model_class: str = "HunyuanDiT2DModel") -> ContextParallelPlan:
    # The caller's rotary tables cover the whole image: split with the image tokens (attn2 rotates its queries too).
    # The ControlNet returns every block's projected output: each is gathered, and the transformer splits the
    # residuals it is given with the image tokens they add to.
    root = {"image_rotary_emb": Split(0)}
    if model_class != CONTROLNET:
        root["controlnet_block_samples"] = Split(1)
    return ContextParallelPlan(
        split_inputs={"blocks.0": {"hidden_states": Split(1)}, "": root},
        gather_outputs={"controlnet_blocks.*": 1} if model_class == CONTROLNET else {"proj_out": 1},
        local_attention=("blocks.*.attn2",),  # cross-attention to the replicated text
    )


EXAMPLES = {
    "hunyuandit": ("HunyuanDiT2DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=16, hidden_size=64,
        num_layers=4, cross_attention_dim=32, cross_attention_dim_t5=24, pooled_projection_dim=16, text_len=5,
        text_len_t5=7)),
    "hunyuandit-controlnet": ("HunyuanDiT2DControlNetModel", dict(
        conditioning_channels=4, num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2,
        sample_size=16, hidden_size=64, transformer_num_layers=6, cross_attention_dim=32, cross_attention_dim_t5=24,
        pooled_projection_dim=16, text_len=5, text_len_t5=7)),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    p = config.patch_size
    clip_mask = torch.ones(batch, config.text_len, dtype=torch.long)
    t5_mask = torch.ones(batch, config.text_len_t5, dtype=torch.long)
    clip_mask[-1, 3:] = 0  # the last prompt is padded
    t5_mask[-1, 4:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.height * p, grid.width * p, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, config.text_len, config.cross_attention_dim, generator=generator),
        text_embedding_mask=clip_mask,
        encoder_hidden_states_t5=torch.randn(batch, config.text_len_t5, config.cross_attention_dim_t5,
                                             generator=generator),
        text_embedding_mask_t5=t5_mask,
        image_meta_size=torch.tensor([[32.0, 32.0, 32.0, 32.0, 0.0, 0.0]] * batch),
        style=torch.zeros(batch, dtype=torch.long),
        image_rotary_emb=get_2d_rotary_pos_embed(config.attention_head_dim, ((0, 0), (grid.height, grid.width)),
                                                 (grid.height, grid.width), output_type="pt"),
        return_dict=False,
    )
    if name == "hunyuandit-controlnet":  # the condition image, patchified like the latents
        inputs["controlnet_cond"] = torch.randn(batch, config.in_channels, grid.height * p, grid.width * p,
                                                generator=generator)
    return inputs


FAMILY = Family.of(__name__)
