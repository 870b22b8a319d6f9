"""Stable Audio Open (`StableAudioDiTModel`): a 1-D audio DiT with one global token prepended to the audio,
self-attention with partial rotary embeddings, and cross-attention to the text with grouped K/V heads."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads
from paradiff.plans.common import attention, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Call, Noise, Uniform, Value, text_mask

MODEL_CLASSES = ("StableAudioDiTModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    head_dim = config.attention_head_dim
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn1"),
        # the processor reads the K/V head count from the projection's width: it follows ColwiseHeads' slice
        "transformer_blocks.*.attn2.to_q": "colwise",
        "transformer_blocks.*.attn2.to_k": ColwiseHeads(head_dim),
        "transformer_blocks.*.attn2.to_v": ColwiseHeads(head_dim),
        "transformer_blocks.*.attn2.to_out.0": "rowwise",
        **feed_forward("transformer_blocks.*.ff", gated=True),
        **mlp("timestep_proj", "0", "2"),
        **mlp("global_proj", "0", "2"),
        **mlp("cross_attention_proj", "0", "2"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # [global token, audio] is assembled inside the model: split at the first block with its key mask and rotary
    # table (both cover the joint sequence), gathered at the output projection, before the global token is dropped.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "transformer_blocks.*": {"attention_mask": Split(1), "rotary_embedding": Split(0)},
        },
        gather_outputs={"proj_out": 1},
        local_attention=("transformer_blocks.*.attn2",),
    )


EXAMPLES = {"stable-audio-open": ("StableAudioDiTModel", dict(
    in_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=4, num_key_value_attention_heads=2,
    out_channels=8, cross_attention_dim=32, time_proj_dim=32, global_states_input_dim=24,
    cross_attention_input_dim=24))}
EXTRA_MODES = {"stable-audio-open": ("tp4",)}  # 2 K/V heads over 4 ranks: replicated in pairs


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "2 * height * width")),  # + the global token: 31
    timestep=Uniform(),
    encoder_hidden_states=Noise(("batch", "text", "cross_attention_input_dim")),
    global_hidden_states=Noise(("batch", 1, "global_states_input_dim")),
    # the pipeline's table: rotary on the first half of each head's features
    rotary_embedding=Call("diffusers.models.embeddings:get_1d_rotary_pos_embed",
                          (Value("attention_head_dim // 2"), Value("2 * height * width + 1")),
                          {"use_real": True, "repeat_interleave_real": False}),
    # the last clip is padded: exercises the self-attention key mask
    attention_mask=text_mask(keep="2 * height * width - 3", length="2 * height * width"),
    encoder_attention_mask=text_mask(),
    return_dict=False,
)


FAMILY = Family.of(__name__)
