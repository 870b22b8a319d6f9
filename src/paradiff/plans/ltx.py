"""LTX-Video (`LTXVideoTransformer3DModel`): self-attention with QK-norm over all heads and a rotary table over the
whole inner dimension (applied before the heads are split), cross-attention to the masked text; per-token
timesteps for conditioning frames (0.9.5+)."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, GridPositions, Noise, Uniform, Value, text_mask

MODEL_CLASSES = ("LTXVideoTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(
        styles={
            **attention("transformer_blocks.*.attn1", norms_across_heads=("norm_q", "norm_k")),
            **attention("transformer_blocks.*.attn2", norms_across_heads=("norm_q", "norm_k")),
            **feed_forward("transformer_blocks.*.ff"),
            **mlp("time_embed.emb.timestep_embedder"),
            "time_embed.linear": "rowwise_split_input",
            **mlp("caption_projection"),
        },
        # (cos, sin) span the inner dimension, so each rank keeps its heads' channels
        head_outputs={"rope": {0: -1, 1: -1}},
    )


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        # tokens come patchified; per-token timesteps come as (batch, tokens), or (batch, tokens, 1) from the long
        # multi-prompt pipeline
        split_inputs={"": {"hidden_states": Split(1), "timestep": Split(1, ndim=(2, 3))}},
        split_outputs={"rope": {0: Split(1), 1: Split(1)}},
        gather_outputs={"proj_out": 1},
        local_attention=("transformer_blocks.*.attn2",),
    )


_CONFIG = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=12, cross_attention_dim=48,
               num_layers=2, caption_channels=32)
EXAMPLES = {
    "ltx-video": ("LTXVideoTransformer3DModel", _CONFIG),
    # 0.9.5+: per-token timesteps (clean conditioning frame) and explicit rotary coordinates
    "ltx-video-0.9.5": ("LTXVideoTransformer3DModel", _CONFIG),
}


_INPUTS = dict(
    hidden_states=Noise(("batch", "frames * height * width", "in_channels")),
    encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
    timestep=Uniform(1000),
    encoder_attention_mask=text_mask("int64", keep="text - 3"),
    num_frames=Value("frames"), height=Value("height"), width=Value("width"),
    rope_interpolation_scale=(0.32, 32, 32),
    return_dict=False,
)
INPUTS = ByExample({
    "ltx-video": _INPUTS,
    "ltx-video-0.9.5": {
        **_INPUTS,
        # per-token timesteps: the first frame conditions, fully denoised
        "timestep": Uniform(1000, ("batch", 1), expand=("batch", "frames * height * width"),
                            set=((":, :height * width", 0),)),
        "rope_interpolation_scale": None,
        # (batch, 3, tokens) in pixel units
        "video_coords": GridPositions(("frames", "height", "width"), scale=(8 * 0.04, 32.0, 32.0), per_sample=True),
    },
})


FAMILY = Family.of(__name__)
