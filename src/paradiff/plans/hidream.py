"""HiDream-I1 (`HiDreamImageTransformer2DModel`): how it splits under tensor and context parallelism.

Mixture-of-experts feed-forwards: every expert (and the shared one) is split like a dense SwiGLU feed-forward and
the router stays whole, so every TP rank routes each token alike and calls the same experts in the same order.
"""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform

MODEL_CLASSES = ("HiDreamImageTransformer2DModel",)
STACKS = ("double_stream_blocks", "single_stream_blocks")


def _swiglu(prefix: str) -> dict[str, str]:
    return {f"{prefix}.w1": "colwise", f"{prefix}.w3": "colwise", f"{prefix}.w2": "rowwise"}


def _attention(prefix: str, suffix: str = "") -> dict[str, str]:
    # Q/K RMS norms run over all heads at once
    return {f"{prefix}.to_q{suffix}": "colwise", f"{prefix}.to_k{suffix}": "colwise", f"{prefix}.to_v{suffix}": "colwise",
            f"{prefix}.to_out{suffix}": "rowwise", f"{prefix}.q_rms_norm{suffix}": "norm_across_heads",
            f"{prefix}.k_rms_norm{suffix}": "norm_across_heads"}


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **_attention("double_stream_blocks.*.block.attn1", "_t"),  # the text stream's own projections
        **_swiglu("double_stream_blocks.*.block.ff_t"),
        **mlp("t_embedder.timestep_embedder"),
        **mlp("p_embedder.pooled_embedder"),
        # one text projection per block (and one for T5), on the replicated text
        "caption_projection.*.linear": "rowwise_split_input",
        "final_layer.adaLN_modulation.1": "rowwise_split_input",
    }
    for stack in STACKS:
        styles.update(_attention(f"{stack}.*.block.attn1"))
        styles[f"{stack}.*.block.adaLN_modulation.1"] = "rowwise_split_input"
        if config.num_routed_experts > 0:
            styles.update(_swiglu(f"{stack}.*.block.ff_i.shared_experts"))
            styles.update(_swiglu(f"{stack}.*.block.ff_i.experts.*"))
        else:
            styles.update(_swiglu(f"{stack}.*.block.ff_i"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # The model rebuilds the text between blocks (each block appends its own Llama layer and cuts it off again by the
    # full length), so text leaves every block whole: double blocks split their fresh text and gather it back, the
    # last gathers the image too; single blocks split their whole [image, text] sequence and gather it back.
    # Rotary tables cover [image, text]: in double blocks the attention holds [image chunk, text chunk].
    split_inputs, gather_outputs = {}, {}
    if config.num_layers:
        split_inputs["double_stream_blocks.0"] = {"hidden_states": Split(1)}
        split_inputs["double_stream_blocks.*"] = {
            "encoder_hidden_states": Split(1), "hidden_states_masks": Split(1),
            "image_rotary_emb": Split(1, parts=("hidden_states", "encoder_hidden_states"))}
        gather_outputs["double_stream_blocks.*"] = {1: 1}
        gather_outputs[f"double_stream_blocks.{config.num_layers - 1}"] = {0: 1, 1: 1}
    if config.num_single_layers:
        split_inputs["single_stream_blocks.*"] = {
            "hidden_states": Split(1), "hidden_states_masks": Split(1), "image_rotary_emb": Split(1)}
        gather_outputs["single_stream_blocks.*"] = 1
    return ContextParallelPlan(split_inputs=split_inputs, gather_outputs=gather_outputs)


EXAMPLES = {
    # a non-square image: the model pads it to max_resolution's token count (21) and masks the padding's keys
    "hidream-i1": ("HiDreamImageTransformer2DModel", dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, caption_channels=[32, 24], text_emb_dim=16, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(6, 14), llama_layers=[0, 1, 2])),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "height * patch_size", "width * patch_size")),
    timesteps=Uniform(1000),
    # single blocks see image (21) + T5 (6) + 2 x Llama (7) tokens: 41
    encoder_hidden_states_t5=Noise(("batch", "text - 1", "caption_channels[0]")),
    encoder_hidden_states_llama3=Noise(("len(llama_layers)", "batch", "text", "caption_channels[1]")),
    pooled_embeds=Noise(("batch", "text_emb_dim")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
