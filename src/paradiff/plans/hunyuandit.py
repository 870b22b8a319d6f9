"""Hunyuan-DiT (`HunyuanDiT2DModel`): how it splits under tensor and context parallelism."""

import torch

from ..context_parallel.plan import ContextParallelPlan, Split
from ..tensor_parallel.plan import TensorParallelPlan
from .common import Grid, attention, feed_forward, mlp

MODEL_CLASSES = ("HunyuanDiT2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    skip_blocks = range(config.num_layers // 2 + 1, config.num_layers)  # the long-skip half
    return TensorParallelPlan(styles={
        **attention("blocks.*.attn1"),
        **attention("blocks.*.attn2"),
        **feed_forward("blocks.*.ff"),
        "blocks.*.norm1.linear": "rowwise_split_input",
        # [hidden, skip] -> dim on the replicated concatenation
        **{f"blocks.{i}.skip_linear": "rowwise_split_input" for i in skip_blocks},
        **mlp("text_embedder"),
        **mlp("time_extra_emb.timestep_embedder"),
        **mlp("time_extra_emb.extra_embedder"),
        "norm_out.linear": "rowwise_split_input",
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # The caller's rotary tables cover the whole image: split with the image tokens (attn2 rotates its queries too).
    return ContextParallelPlan(
        split_inputs={"blocks.0": {"hidden_states": Split(1)}, "": {"image_rotary_emb": Split(0)}},
        gather_outputs={"proj_out": 1},
        local_attention=("blocks.*.attn2",),  # cross-attention to the replicated text
    )


EXAMPLES = {
    "hunyuandit": ("HunyuanDiT2DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=16, hidden_size=64,
        num_layers=4, cross_attention_dim=32, cross_attention_dim_t5=24, pooled_projection_dim=16, text_len=5,
        text_len_t5=7)),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    p = config.patch_size
    clip_mask = torch.ones(batch, config.text_len, dtype=torch.long)
    t5_mask = torch.ones(batch, config.text_len_t5, dtype=torch.long)
    clip_mask[-1, 3:] = 0  # the last prompt is padded
    t5_mask[-1, 4:] = 0
    return dict(
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
