"""Wan 2.1 / 2.2 (`WanTransformer3DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Noise, Uniform

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


# a Wan-style video transformer's forward inputs (SkyReels-V2 declares its examples from them too)
VIDEO_INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames * patch_size[0]", "height * patch_size[1]",
                         "width * patch_size[2]")),
    encoder_hidden_states=Noise(("batch", "text", "text_dim")),
    timestep=Uniform(1000),
    return_dict=False,
)
INPUTS = ByExample({
    "wan2.1-t2v": VIDEO_INPUTS,
    # Wan 2.1 I2V's processor takes everything past the first 512 context tokens as the image context; those 512
    # replicated tokens would outweigh the split video tokens at this tiny size, so the video is 5x taller
    "wan2.1-i2v": dict(
        hidden_states=Noise(("batch", "in_channels", "frames * patch_size[0]", "5 * height * patch_size[1]",
                             "width * patch_size[2]")),
        encoder_hidden_states=Noise(("batch", 512, "text_dim")),
        timestep=Uniform(1000),
        encoder_hidden_states_image=Noise(("batch", 4, "image_dim")),
        return_dict=False,
    ),
    # per-token timesteps: the first frame's tokens are clean (t = 0)
    "wan2.2-ti2v": {**VIDEO_INPUTS, "timestep": Uniform(1000, ("batch", 1), expand=("batch", "frames * height * width"),
                                                   set=((":, :height * width", 0),))},
})


FAMILY = Family.of(__name__)
