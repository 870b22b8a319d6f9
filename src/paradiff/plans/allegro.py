"""Allegro (`AllegroTransformer3DModel`): PixArt-style blocks over video tokens."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import adaln_single, basic_transformer_block, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Call, Noise, Uniform, Value, text_mask

MODEL_CLASSES = ("AllegroTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **basic_transformer_block("transformer_blocks.*"),
        **adaln_single(),
        **mlp("caption_projection"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # The rotary argument is ((per-axis tables), (t, h, w positions of every token, each (1, tokens))): the tables
    # are looked up by position and stay whole; the positions follow the video tokens.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "": {"image_rotary_emb": {1: Split(-1)}},
        },
        gather_outputs={"proj_out": 1},
        # attn2 attends to the replicated text
        local_attention=("transformer_blocks.*.attn2",),
    )


EXAMPLES = {
    # head_dim 24: the rotary splits each head in three (t, h, w) parts of even size
    "allegro": ("AllegroTransformer3DModel", dict(
        patch_size=2, patch_size_t=1, num_attention_heads=4, attention_head_dim=24, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=96, sample_height=6, sample_width=10, sample_frames=3, caption_channels=32)),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames", "height * patch_size", "width * patch_size")),
    encoder_hidden_states=Noise(("batch", "text", "caption_channels")),
    timestep=Uniform(1000),
    encoder_attention_mask=text_mask("float32", keep="text // 2"),  # the last prompt is shorter
    image_rotary_emb=Call("paradiff.models.allegro:rotary_embedding", (
        Value("attention_head_dim"), Value("frames"), Value("height"), Value("width"),
        Value("(interpolation_scale_t, interpolation_scale_h, interpolation_scale_w)"))),
    return_dict=False,
)


FAMILY = Family.of(__name__)
