"""Wan 2.1 / 2.2 (`WanTransformer3DModel`): how it splits under tensor and context parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("WanTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={**block_styles("blocks.*", config), **condition_styles("condition_embedder")})


def block_styles(prefix: str, config) -> dict:
    """A Wan block (self-attention, cross-attention, FFN); Wan-derived families share it."""
    # Wan's QK-norm is an RMSNorm over all heads: split with them, its statistic all-reduced
    styles = {
        **attention(f"{prefix}.attn1", norms_across_heads=("norm_q", "norm_k")),
        **attention(f"{prefix}.attn2", norms_across_heads=("norm_q", "norm_k")),
        **feed_forward(f"{prefix}.ffn"),
    }
    if config.added_kv_proj_dim is not None:  # Wan 2.1 I2V: image tokens get their own K/V
        styles.update({f"{prefix}.attn2.add_k_proj": "colwise", f"{prefix}.attn2.add_v_proj": "colwise",
                       f"{prefix}.attn2.norm_added_k": "norm_across_heads"})
    return styles


def condition_styles(prefix: str) -> dict:
    """Wan's time/text embedder: both MLPs split, the 6-way modulation projection rowwise on its replicated input."""
    return {**mlp(f"{prefix}.time_embedder"), **mlp(f"{prefix}.text_embedder"),
            f"{prefix}.time_proj": "rowwise_split_input"}


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "blocks.0": {"hidden_states": Split(1)},
            "": {"timestep": Split(1, ndim=2)},  # Wan 2.2 per-token timesteps
        },
        split_outputs={"rope": {0: Split(1), 1: Split(1)}},
        gather_outputs={"proj_out": 1},
        # attn2 attends to the replicated text (and image) context: local, no communication
        local_attention=("blocks.*.attn2",),
    )


_BASE = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
             text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
EXAMPLES = {
    "wan2.1-t2v": ("WanTransformer3DModel", _BASE),
    "wan2.1-i2v": ("WanTransformer3DModel", {**_BASE, "image_dim": 24, "added_kv_proj_dim": 64}),
    "wan2.2-ti2v": ("WanTransformer3DModel", _BASE),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p_t, p_h, p_w = config.patch_size
    if name == "wan2.1-i2v":
        # its 512 replicated context tokens would otherwise outweigh the split video tokens at this tiny size
        grid = Grid(grid.frames, grid.height * 5, grid.width, grid.text)
    tokens = grid.frames * grid.height * grid.width
    inputs = dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.frames * p_t, grid.height * p_h, grid.width * p_w,
                                  generator=generator),
        # Wan 2.1 I2V's processor takes everything past the first 512 context tokens as the image context
        encoder_hidden_states=torch.randn(batch, 512 if name == "wan2.1-i2v" else grid.text, config.text_dim,
                                          generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        return_dict=False,
    )
    if name == "wan2.1-i2v":
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 4, config.image_dim, generator=generator)
    if name == "wan2.2-ti2v":  # per-token timesteps: the first frame's tokens are clean (t = 0)
        timestep = inputs["timestep"][:, None].repeat(1, tokens)
        timestep[:, : grid.height * grid.width] = 0
        inputs["timestep"] = timestep
    return inputs


FAMILY = Family.of(__name__)
