"""Qwen-Image (`QwenImageTransformer2DModel`) and its ControlNet (`QwenImageControlNetModel`: the same blocks, each
block's image tokens projected by its own Linear into a residual the transformer adds after its blocks of that
depth): how they split under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import joint_attention, split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Noise, PerSample, Uniform, Value, text_mask

MODEL_CLASSES = ("QwenImageTransformer2DModel", "QwenImageControlNetModel")
CONTROLNET = "QwenImageControlNetModel"


def tensor_parallel_plan(config, model_class: str = "QwenImageTransformer2DModel") -> TensorParallelPlan:
    styles = {
        **joint_attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.img_mlp.net.0.proj": "colwise",
        "transformer_blocks.*.img_mlp.net.2": "rowwise",
        "transformer_blocks.*.txt_mlp.net.0.proj": "colwise",
        "transformer_blocks.*.txt_mlp.net.2": "rowwise",
        # per-block AdaLN modulation, dim -> 6 dim: the largest replicated weights of the model
        "transformer_blocks.*.img_mod.1": "rowwise_split_input",
        **split_input("transformer_blocks.*.txt_mod.1", "txt_in"),
        "time_text_embed.timestep_embedder.linear_1": "colwise",
        "time_text_embed.timestep_embedder.linear_2": "rowwise",
    }
    if model_class == CONTROLNET:
        # each residual projection reads its block's replicated output: the residuals come out whole on every rank,
        # as the transformer's replicated tokens they are added to (the condition's embedder stays whole)
        styles["controlnet_blocks.*"] = "rowwise_split_input"
    else:
        styles["norm_out.linear"] = "rowwise_split_input"
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config, model_class: str = "QwenImageTransformer2DModel") -> ContextParallelPlan:
    # The rotary tables are computed from the full text length, so the text is split at the first block, not at the
    # model's input; the text mask and the per-token modulation index travel with every block.
    split_inputs = {
        "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
        "transformer_blocks.*": {"encoder_hidden_states_mask": Split(1), "modulate_index": Split(1)},
    }
    if model_class == CONTROLNET:
        # the condition was added to the image tokens before the first block, where they are split; every residual
        # is gathered whole: a transformer on any mesh (or none) takes them as a plain model does
        return ContextParallelPlan(split_inputs=split_inputs, split_outputs={"pos_embed": {0: Split(0), 1: Split(0)}},
                                   gather_outputs={"controlnet_blocks.*": 1})
    # the ControlNet's residuals (whole, one per image token) are added to the image tokens after the blocks: each
    # rank adds its own tokens' slice, split like the image tokens at the first block
    split_inputs[""] = {"controlnet_block_samples": Split(1)}
    return ContextParallelPlan(split_inputs=split_inputs, split_outputs={"pos_embed": {0: Split(0), 1: Split(0)}},
                               gather_outputs={"proj_out": 1})


_TINY = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
             joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
EXAMPLES = {"qwen-image": ("QwenImageTransformer2DModel", _TINY),
            "qwen-image-controlnet": (CONTROLNET, {k: v for k, v in _TINY.items() if k != "out_channels"})}


_INPUTS = dict(
    hidden_states=Noise(("batch", "height * width", "in_channels")),
    encoder_hidden_states=Noise(("batch", "text", "joint_attention_dim")),
    encoder_hidden_states_mask=text_mask("long"),  # the last prompt is padded: exercises the text mask
    timestep=Uniform(),
    img_shapes=PerSample(Value("[(1, height, width)]")),
    return_dict=False,
)
INPUTS = ByExample({
    "qwen-image": _INPUTS,
    # the control image's packed latents, one per image token
    "qwen-image-controlnet": {**_INPUTS, "controlnet_cond": Noise(("batch", "height * width", "in_channels"))},
})


FAMILY = Family.of(__name__)
