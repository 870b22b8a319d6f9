"""SkyReels-V2 (`SkyReelsV2Transformer3DModel`): Wan's blocks, plus diffusion forcing (a timestep per frame, so a
modulation per token) and an optional fps embedding."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import wan
from paradiff.plans.common import Grid, feed_forward
from paradiff.plans.family import Family

MODEL_CLASSES = ("SkyReelsV2Transformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {**wan.block_styles("blocks.*", config), **wan.condition_styles("condition_embedder")}
    if config.inject_sample_info:
        styles.update(feed_forward("fps_projection"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "blocks.0": {"hidden_states": Split(1)},
            # diffusion forcing: the modulation is (batch, 6, tokens, dim), one row per token
            "blocks.*": {"temb": Split(2, ndim=4)},
        },
        split_outputs={"rope": {0: Split(1), 1: Split(1)}},
        # the final shift/scale are per token under diffusion forcing and computed in the model's forward from the
        # full sequence, so the sequence is whole again before them
        gather_outputs={"norm_out": 1},
        local_attention=("blocks.*.attn2",),
    )


_BASE = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
             text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
EXAMPLES = {
    "skyreels-v2-t2v": ("SkyReelsV2Transformer3DModel", {**_BASE, "inject_sample_info": True}),
    "skyreels-v2-df": ("SkyReelsV2Transformer3DModel", _BASE),
    "skyreels-v2-i2v": ("SkyReelsV2Transformer3DModel", {**_BASE, "image_dim": 24, "added_kv_proj_dim": 64}),
}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p_t, p_h, p_w = config.patch_size
    i2v = name == "skyreels-v2-i2v"
    if i2v:  # 512 replicated text tokens: enough video tokens that the split work dominates (see wan2.1-i2v)
        grid = Grid(grid.frames, grid.height * 5, grid.width, grid.text)
    inputs = dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.frames * p_t, grid.height * p_h, grid.width * p_w,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, 512 if i2v else grid.text, config.text_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        return_dict=False,
    )
    if i2v:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 4, config.image_dim, generator=generator)
    if name == "skyreels-v2-t2v":
        inputs["fps"] = [index % 2 for index in range(batch)]  # index into the two-entry fps embedding
    if name == "skyreels-v2-df":  # one noise level per latent frame; the first frame is clean
        timestep = torch.rand(batch, grid.frames, generator=generator) * 1000
        timestep[:, 0] = 0
        inputs.update(timestep=timestep, enable_diffusion_forcing=True)
    return inputs


FAMILY = Family.of(__name__)
