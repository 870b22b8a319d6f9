"""ERNIE-Image (`ErnieImageTransformer2DModel`): how it splits under tensor and context parallelism.

One sequence, sequence-first ([image, text] x batch x dim): the blocks take it with its rotary table, its key mask
and the shared AdaLN modulation already expanded to every token, all split along the tokens alike.
"""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full, Noise, Uniform

MODEL_CLASSES = ("ErnieImageTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        "layers.*.self_attention.to_q": "colwise",
        "layers.*.self_attention.to_k": "colwise",
        "layers.*.self_attention.to_v": "colwise",
        "layers.*.self_attention.to_out.0": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.linear_fc2": "rowwise",
        # one AdaLN modulation (dim -> 6 dim) shared by every block
        "adaLN_modulation.1": "rowwise_split_input",
        **mlp("time_embedding"),
        "final_norm.linear": "rowwise_split_input",
    }
    if config.text_in_dim != config.hidden_size:
        styles["text_proj"] = "rowwise_split_input"
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "layers.0": {"x": Split(0)},
            "layers.*": {"rotary_pos_emb": Split(1), "temb": Split(0), "attention_mask": Split(-1)},
        },
        gather_outputs={"final_linear": 0},
    )


EXAMPLES = {
    "ernie-image": ("ErnieImageTransformer2DModel", dict(
        hidden_size=64, num_attention_heads=4, num_layers=2, ffn_hidden_size=128, in_channels=4, out_channels=4,
        patch_size=1, text_in_dim=32, rope_axes_dim=(4, 6, 6))),
}


INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "height", "width")),
    timestep=Uniform(1000),
    # 15 image + 8 text tokens: a sequence neither 2 nor 4 ranks divide
    text_bth=Noise(("batch", "text + 1", "text_in_dim")),
    text_lens=Full(("batch",), "text + 1", set=(("-1", "text + 1 - 3"),)),  # the last prompt is shorter
    return_dict=False,
)


FAMILY = Family.of(__name__)
