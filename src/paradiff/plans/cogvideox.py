"""CogVideoX 1.0 / 1.5 (`CogVideoXTransformer3DModel`): how it splits under tensor and context parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, feed_forward, mlp, split_input
from paradiff.plans.family import Family

MODEL_CLASSES = ("CogVideoXTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # the QK LayerNorm is per head (head_dim wide): it stays whole on every rank
    styles = {
        **attention("transformer_blocks.*.attn1"),
        **feed_forward("transformer_blocks.*.ff"),
        **split_input("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm2.linear", "patch_embed.text_proj",
                      "norm_out.linear"),
        **mlp("time_embedding"),
    }
    if getattr(config, "ofs_embed_dim", None):  # ConsisID reuses this plan and has no ofs
        styles.update(mlp("ofs_embedding"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # Split after the patch embedding (it adds sin-cos positions for the full joint sequence). Text and video run
    # through the blocks' norms and feed-forward together and attend jointly, so both are split; the rotary table
    # (a (cos, sin) pair over the video tokens) follows the video tokens.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "": {"image_rotary_emb": Split(0)},
        },
        gather_outputs={"proj_out": 1},
    )


_BASE = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
             text_embed_dim=32, num_layers=2, patch_size=2, sample_width=10, sample_height=6, sample_frames=9)
EXAMPLES = {
    # CogVideoX-2b: sin-cos positions added to the joint sequence (the text must be max_text_seq_length long)
    "cogvideox1.0-2b": ("CogVideoXTransformer3DModel", {**_BASE, "max_text_seq_length": Grid().text}),
    # CogVideoX-5b: 3-D rotary table over the video tokens
    "cogvideox1.0-5b": ("CogVideoXTransformer3DModel", {**_BASE, "use_rotary_positional_embeddings": True}),
    # CogVideoX 1.5 I2V: temporal patches (a Linear patch embedding), rotary, and the ofs embedding
    "cogvideox1.5-i2v": ("CogVideoXTransformer3DModel", {
        **_BASE, "patch_size_t": 2, "use_rotary_positional_embeddings": True, "ofs_embed_dim": 32,
        "patch_bias": False}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    patch_size_t = getattr(config, "patch_size_t", None)  # 1.5 only (and not ConsisID)
    p, p_t = config.patch_size, patch_size_t or 1
    inputs = dict(
        hidden_states=torch.randn(batch, grid.frames * p_t, config.in_channels, grid.height * p, grid.width * p,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.text_embed_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        return_dict=False,
    )
    if config.use_rotary_positional_embeddings:
        slices = dict(grid_type="slice", max_size=(grid.height, grid.width)) if patch_size_t else {}
        inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(
            config.attention_head_dim, ((0, 0), (grid.height, grid.width)), (grid.height, grid.width), grid.frames,
            **slices)
    if getattr(config, "ofs_embed_dim", None):
        inputs["ofs"] = torch.rand(batch, generator=generator) * 2
    return inputs


FAMILY = Family.of(__name__)
