"""Sana-Video (`SanaVideoTransformer3DModel`): Sana's blocks over frames, with rotary linear attention and a temporal
convolution in the feed-forward."""

from paradiff.context_parallel.plan import ContextParallelPlan, GridSplit, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import sana
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Noise, Uniform

MODEL_CLASSES = ("SanaVideoTransformer3DModel",)

_FRAMES = GridSplit(1, ("frames", "height", "width"))


def tensor_parallel_plan(config) -> TensorParallelPlan:
    # the temporal convolution reads the full (all-reduced) width: each rank convolves its slice of the channels
    return TensorParallelPlan(styles={**sana.block_styles(config), **sana.embedder_styles(config),
                                      "transformer_blocks.*.ff.conv_temp": "rowwise_split_input"})


def context_parallel_plan(config) -> ContextParallelPlan:
    # Split by whole frames: the 3x3 convolution stays within a frame, the temporal one borrows a frame from each
    # neighbour. Per-token timesteps (image-to-video) and the rotary table follow the frames.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.*": {"hidden_states": _FRAMES, "timestep": _FRAMES, "rotary_emb": _FRAMES},
            "norm_out": {"temb": Split(1, like="hidden_states")},
        },
        gather_outputs={"proj_out": 1},
        halo_convs=("transformer_blocks.*.ff.conv_temp",),
        linear_attention=("transformer_blocks.*.attn1",),
        local_attention=("transformer_blocks.*.attn2",),
    )


_BASE = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
             num_cross_attention_heads=2, cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=32,
             sample_size=8, patch_size=(1, 2, 2), rope_max_seq_len=64)
EXAMPLES = {
    "sana-video-t2v": ("SanaVideoTransformer3DModel", _BASE),
    # image-to-video: per-token timesteps, the first frame's clean
    "sana-video-i2v": ("SanaVideoTransformer3DModel", _BASE),
}


# frames = the grid's width, so four CP ranks each get a frame (and height, width = the grid's height, frames)
_INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "width * patch_size[0]", "height * patch_size[1]",
                         "frames * patch_size[2]")),
    timestep=Uniform(1000),
    **sana.TEXT_INPUTS,
    return_dict=False,
)
INPUTS = ByExample({
    "sana-video-t2v": _INPUTS,
    # per-token timesteps: the first frame's clean
    "sana-video-i2v": {**_INPUTS, "timestep": Uniform(1000, ("batch", 1, 1, 1, 1), set=((":, :, 0", 0),),
                                                      expand=("batch", 1, "width", "height", "frames"))},
})


FAMILY = Family.of(__name__)
