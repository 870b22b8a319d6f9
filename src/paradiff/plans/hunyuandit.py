"""Hunyuan-DiT (`HunyuanDiT2DModel`) and its ControlNet (`HunyuanDiT2DControlNetModel`, a copy of the first half of the
blocks, each block's output projected by its own zero-initialised Linear): how they split under tensor and context
parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, feed_forward, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import ByExample, Call, Full, Noise, Tensor, Uniform, Value, text_mask

MODEL_CLASSES = ("HunyuanDiT2DModel", "HunyuanDiT2DControlNetModel")
CONTROLNET = "HunyuanDiT2DControlNetModel"


def tensor_parallel_plan(config, model_class: str = "HunyuanDiT2DModel") -> TensorParallelPlan:
    if model_class == CONTROLNET:
        return TensorParallelPlan(styles={
            **_shared_styles(),
            # per-block outputs and the condition's input projection, on replicated inputs
            "controlnet_blocks.*": "rowwise_split_input",
            "input_block": "rowwise_split_input",
        })
    skip_blocks = range(config.num_layers // 2 + 1, config.num_layers)  # the long-skip half
    return TensorParallelPlan(styles={
        **_shared_styles(),
        # [hidden, skip] -> dim on the replicated concatenation
        **{f"blocks.{i}.skip_linear": "rowwise_split_input" for i in skip_blocks},
        "norm_out.linear": "rowwise_split_input",
    })


def _shared_styles() -> dict:
    return {
        **attention("blocks.*.attn1"),
        **attention("blocks.*.attn2"),
        **feed_forward("blocks.*.ff"),
        "blocks.*.norm1.linear": "rowwise_split_input",
        **mlp("text_embedder"),
        **mlp("time_extra_emb.timestep_embedder"),
        **mlp("time_extra_emb.extra_embedder"),
    }


def context_parallel_plan(config, model_class: str = "HunyuanDiT2DModel") -> ContextParallelPlan:
    # The caller's rotary tables cover the whole image: split with the image tokens (attn2 rotates its queries too).
    # The ControlNet returns every block's projected output: each is gathered, and the transformer splits the
    # residuals it is given with the image tokens they add to.
    root = {"image_rotary_emb": Split(0)}
    if model_class != CONTROLNET:
        root["controlnet_block_samples"] = Split(1)
    return ContextParallelPlan(
        split_inputs={"blocks.0": {"hidden_states": Split(1)}, "": root},
        gather_outputs={"controlnet_blocks.*": 1} if model_class == CONTROLNET else {"proj_out": 1},
        local_attention=("blocks.*.attn2",),  # cross-attention to the replicated text
    )


EXAMPLES = {
    "hunyuandit": ("HunyuanDiT2DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=16, hidden_size=64,
        num_layers=4, cross_attention_dim=32, cross_attention_dim_t5=24, pooled_projection_dim=16, text_len=5,
        text_len_t5=7)),
    "hunyuandit-controlnet": ("HunyuanDiT2DControlNetModel", dict(
        conditioning_channels=4, num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2,
        sample_size=16, hidden_size=64, transformer_num_layers=6, cross_attention_dim=32, cross_attention_dim_t5=24,
        pooled_projection_dim=16, text_len=5, text_len_t5=7)),
}


_LATENTS = Noise(("batch", "in_channels", "height * patch_size", "width * patch_size"))
_INPUTS = dict(
    hidden_states=_LATENTS,
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", "text_len", "cross_attention_dim")),
    text_embedding_mask=text_mask("long", keep=3, length="text_len"),  # the last prompt is padded
    encoder_hidden_states_t5=Noise(("batch", "text_len_t5", "cross_attention_dim_t5")),
    text_embedding_mask_t5=text_mask("long", keep=4, length="text_len_t5"),
    image_meta_size=Tensor((32.0, 32.0, 32.0, 32.0, 0.0, 0.0), per_sample=True),
    style=Full(("batch",), 0, "long"),
    image_rotary_emb=Call("diffusers.models.embeddings:get_2d_rotary_pos_embed",
                          (Value("attention_head_dim"), Value("((0, 0), (height, width))"), Value("(height, width)")),
                          {"output_type": "pt"}),
    return_dict=False,
)
INPUTS = ByExample({
    "hunyuandit": _INPUTS,
    "hunyuandit-controlnet": {**_INPUTS, "controlnet_cond": _LATENTS},  # the condition image, patchified alike
})


FAMILY = Family.of(__name__)
