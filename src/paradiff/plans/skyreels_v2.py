"""SkyReels-V2 (`SkyReelsV2Transformer3DModel`): Wan's blocks, plus diffusion forcing (a timestep per frame, so a
modulation per token) and an optional fps embedding."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import wan
from paradiff.plans.common import feed_forward
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Noise, PerSample, Uniform, Value

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


_INPUTS = wan.VIDEO_INPUTS  # the same forward inputs as Wan's
INPUTS = ByExample({
    "skyreels-v2-t2v": {**_INPUTS, "fps": PerSample(Value("index % 2"))},  # index into the two-entry fps embedding
    # one noise level per latent frame; the first frame is clean
    "skyreels-v2-df": {**_INPUTS, "timestep": Uniform(1000, ("batch", "frames"), set=((":, 0", 0),)),
                       "enable_diffusion_forcing": True},
    # 512 replicated text tokens: enough video tokens (5x the grid's height) that the split work dominates (see
    # wan2.1-i2v)
    "skyreels-v2-i2v": dict(
        hidden_states=Noise(("batch", "in_channels", "frames * patch_size[0]", "5 * height * patch_size[1]",
                             "width * patch_size[2]")),
        encoder_hidden_states=Noise(("batch", 512, "text_dim")),
        timestep=Uniform(1000),
        encoder_hidden_states_image=Noise(("batch", 4, "image_dim")),
        return_dict=False,
    ),
})


FAMILY = Family.of(__name__)
