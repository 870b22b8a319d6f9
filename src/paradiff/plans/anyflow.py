"""AnyFlow (`AnyFlowTransformer3DModel`): Wan 2.1's backbone conditioned on two timesteps per frame, so the
modulation is per token; its rotary table is a dict of complex tables for queries and keys."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Ref, Uniform

MODEL_CLASSES = ("AnyFlowTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        # QK-norm over all heads, as in Wan
        **attention("blocks.*.attn1", norms_across_heads=("norm_q", "norm_k")),
        **attention("blocks.*.attn2", norms_across_heads=("norm_q", "norm_k")),
        **feed_forward("blocks.*.ffn"),
        **mlp("condition_embedder.time_embedder"),
        **mlp("condition_embedder.delta_embedder"),
        **mlp("condition_embedder.text_embedder"),
        "condition_embedder.time_proj": "rowwise_split_input",
    }
    if config.image_dim is not None:
        styles.update(feed_forward("condition_embedder.image_embedder.ff"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "blocks.0": {"hidden_states": Split(1)},
            # (batch, tokens, 6, dim) modulation and the (1, 1, tokens, dim / 2) rotary tables, one per token
            "blocks.*": {"temb": Split(1), "rotary_emb": Split(2)},
        },
        # the final shift/scale are per token and applied in the model's forward: the sequence is whole by then
        gather_outputs={"norm_out": 1},
        local_attention=("blocks.*.attn2",),
    )


EXAMPLES = {
    "anyflow": ("AnyFlowTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, image_dim=24,
        deltatime_type="t-r")),
}


INPUTS = dict(
    # AnyFlow takes (batch, frames, channels, height, width)
    hidden_states=Noise(("batch", "frames * patch_size[0]", "in_channels", "height * patch_size[1]",
                         "width * patch_size[2]")),
    timestep=Uniform(1000, ("batch", "frames")),
    r_timestep=Ref("timestep", Uniform(shape=("batch", "frames"))),
    encoder_hidden_states=Noise(("batch", "text", "text_dim")),
    encoder_hidden_states_image=Noise(("batch", 4, "image_dim")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
