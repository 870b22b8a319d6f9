"""OmniGen (`OmniGenTransformer2DModel`): how it splits under tensor and context parallelism.

One sequence of [prompt tokens (with input-image tokens in place), time token, output-image tokens] under a mask
that is causal over the prompt and bidirectional over each image: a query-dependent mask, which reaches the
attention whole; ring attention takes its local rows and each travelling block's columns, Ulysses all of it.
"""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, PackedColwise
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Call, Integers, Noise, Uniform, Value

MODEL_CLASSES = ("OmniGenTransformer2DModel",)


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        "layers.*.self_attn.to_q": "colwise",
        "layers.*.self_attn.to_k": ColwiseHeads(_head_dim),  # grouped K/V heads when num_key_value_heads < heads
        "layers.*.self_attn.to_v": ColwiseHeads(_head_dim),
        "layers.*.self_attn.to_out.0": "rowwise",
        "layers.*.mlp.gate_up_proj": PackedColwise([1, 1]),  # gate and up halves
        "layers.*.mlp.down_proj": "rowwise",
        **mlp("time_token"),
        **mlp("t_embedder"),
        "norm_out.linear": "rowwise_split_input",
    }, head_attrs=DEFAULT_HEAD_ATTRS + ("out_dim",))  # the processor reshapes its output to attn.out_dim


def context_parallel_plan(config) -> ContextParallelPlan:
    # the model keeps the output-image tokens from the end of the whole sequence, so it is gathered after `norm`
    return ContextParallelPlan(
        split_inputs={"layers.0": {"hidden_states": Split(1)}, "layers.*": {"image_rotary_emb": Split(0)}},
        gather_outputs={"norm": 1},
    )


EXAMPLES = {
    "omnigen": ("OmniGenTransformer2DModel", dict(
        in_channels=4, patch_size=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, num_layers=2, pad_token_id=0, vocab_size=64, pos_embed_max_size=16, time_step_dim=32,
        rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8})),
}


# 7 prompt + 1 time + 15 image tokens; the last prompt is left-padded by 2 (pad tokens), sample 0's prompt holds a
# 2 x 2-patch input image at tokens 1..4 (models/omnigen.py lays out the masks and positions)
_LAYOUT = (Value("batch"), Value("text"), Value("height * width"), 2)
INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "height * patch_size", "width * patch_size")),
    timestep=Uniform(),
    input_ids=Integers("vocab_size", ("batch", "text"), low=1, set=(("-1, :2", "pad_token_id"),)),
    input_img_latents=[Noise((1, "in_channels", "2 * patch_size", "2 * patch_size"))],
    input_image_sizes={0: [(1, 5)]},
    attention_mask=Call("paradiff.models.omnigen:prompt_masks", (*_LAYOUT, (1, 5))),
    position_ids=Call("paradiff.models.omnigen:prompt_positions", _LAYOUT),
    return_dict=False,
)


FAMILY = Family.of(__name__)
