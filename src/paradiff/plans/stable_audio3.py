"""Stable Audio 3 (`StableAudio3DiTModel`): a 1-D audio DiT with learned memory tokens prepended, differential
attention (two query/key pairs, one value) and cross-attention to the text context."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform, text_mask

MODEL_CLASSES = ("StableAudio3DiTModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    differential = config.use_differential_attention
    return TensorParallelPlan(styles={
        # fused [q1 | q2 | k1 | k2 | v] (or [q | k | v]): each part split by heads
        "transformer_blocks.*.self_attn.to_qkv": PackedColwise([1] * (5 if differential else 3)),
        "transformer_blocks.*.self_attn.to_out": "rowwise",
        "transformer_blocks.*.cross_attn.to_q": PackedColwise([1] * (2 if differential else 1)),
        "transformer_blocks.*.cross_attn.to_kv": PackedColwise([1] * (3 if differential else 2)),
        "transformer_blocks.*.cross_attn.to_out": "rowwise",
        "transformer_blocks.*.ff.proj_in": PackedColwise([1, 1]),  # [value, gate]
        "transformer_blocks.*.ff.proj_out": "rowwise",
        "transformer_blocks.*.to_local_embed.0": "colwise",
        "transformer_blocks.*.to_local_embed.2": "rowwise",
        "global_cond_embedder.0": "colwise",
        "global_cond_embedder.2": "rowwise",
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # The memory tokens are prepended to the audio and dropped after the blocks: the sequence is split at the first
    # block and gathered after the last, with the rotary table split alike.
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1)}},
        split_token_arguments={"transformer_blocks.*": ("rope",)},
        gather_outputs={f"transformer_blocks.{config.depth - 1}": 1},
        local_attention=("transformer_blocks.*.cross_attn",),
        unsupported_inputs={"": {"local_add_cond": "the blocks add it to the audio positions past the memory "
                                                    "tokens of the whole sequence; run inpainting with tensor "
                                                    "parallelism only"}},
    )


EXAMPLES = {"stable-audio-3": ("StableAudio3DiTModel", dict(
    io_channels=8, embed_dim=64, depth=2, num_heads=4, cond_token_dim=24, global_cond_dim=16, local_add_cond_dim=5,
    timestep_features_dim=16, ff_mult=2.0, num_memory_tokens=2, use_differential_attention=True))}


INPUTS = dict(
    hidden_states=Noise(("batch", "io_channels", "height * width")),  # + 2 memory tokens: 17
    timestep=Uniform(),
    encoder_hidden_states=Noise(("batch", "text", "cond_token_dim")),
    global_hidden_states=Noise(("batch", "global_cond_dim")),
    encoder_attention_mask=text_mask(),
    return_dict=False,
)


FAMILY = Family.of(__name__)
