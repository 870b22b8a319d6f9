"""LongCat-AudioDiT (`LongCatAudioDiTTransformer`): a 1-D audio DiT with self-attention over the latent frames
(QK-norm over all heads, a frame mask) and cross-attention to the text."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform, text_mask

MODEL_CLASSES = ("LongCatAudioDiTTransformer",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    norms = ("q_norm", "k_norm") if config.qk_norm else ()
    styles = {
        **attention("blocks.*.self_attn", norms_across_heads=norms),
        **attention("blocks.*.cross_attn", norms_across_heads=norms),
        "blocks.*.ffn.ff.0": "colwise",
        "blocks.*.ffn.ff.3": "rowwise",
        "time_embed.time_mlp.0": "colwise",
        "time_embed.time_mlp.2": "rowwise",
    }
    if config.adaln_type == "global":
        styles["adaln_global_mlp.mlp.1"] = "rowwise_split_input"
    else:
        styles["blocks.*.adaln_mlp.mlp.1"] = "rowwise_split_input"
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # The long skip adds the input embedding back after the blocks, so the frames are gathered after the last
    # block; the frame mask and the frames' rotary table are split with the frames, the text side stays whole.
    return ContextParallelPlan(
        split_inputs={"blocks.0": {"hidden_states": Split(1)}},
        split_token_arguments={"blocks.*": ("mask", "rope")},
        gather_outputs={f"blocks.{config.dit_depth - 1}": 1},
        local_attention=("blocks.*.cross_attn",),
    )


EXAMPLES = {"longcat-audio-dit": ("LongCatAudioDiTTransformer", dict(
    dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=24, latent_dim=8, ff_mult=2.0))}


INPUTS = dict(
    hidden_states=Noise(("batch", "height * width", "latent_dim")),
    encoder_hidden_states=Noise(("batch", "text", "dit_text_dim")),
    encoder_attention_mask=text_mask(),
    timestep=Uniform(),
    attention_mask=text_mask(keep="height * width - 3", length="height * width"),  # the last clip is shorter
    latent_cond=Noise(("batch", "height * width", "latent_dim")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
