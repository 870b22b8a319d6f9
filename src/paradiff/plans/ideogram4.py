"""Ideogram 4 (`Ideogram4Transformer2DModel`): a single-stream DiT over a packed [text, image] sequence where every
input is per token and a block-diagonal mask from `segment_ids` keeps packed samples apart."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Cat, Full, GridPositions, Noise, Uniform

MODEL_CLASSES = ("Ideogram4Transformer2DModel",)

_TEXT, _IMAGE, _PADDING = 3, 2, -1  # the model's per-token role indicators


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **attention("layers.*.attention"),
        # SwiGLU: w2(silu(w1(x)) * w3(x))
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        # per-block AdaLN modulation, adaln_dim -> 4 dim
        "layers.*.adaln_modulation": "rowwise_split_input",
        # the text features are wide (tens of thousands of channels) and arrive whole on every rank
        "llm_cond_proj": "rowwise_split_input",
        **mlp("t_embedding", "mlp_in", "mlp_out"),
    }
    return TensorParallelPlan(styles=styles, head_attrs=("num_heads",))


def context_parallel_plan(config) -> ContextParallelPlan:
    # Every per-token input is split at the model's input; `segment_ids` stays whole, so the model builds the full
    # query-dependent segment mask, which CP attention takes whole and reads its rows from.
    return ContextParallelPlan(
        split_inputs={"": {
            "hidden_states": Split(1),
            "encoder_hidden_states": Split(1),
            "position_ids": Split(1),
            "indicator": Split(1),
        }},
        gather_outputs={"final_layer": 1},
    )


EXAMPLES = {"ideogram4": ("Ideogram4Transformer2DModel", dict(
    in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4, intermediate_size=96, adaln_dim=32,
    llm_features_dim=48, mrope_section=(2, 2, 2)))}


_LENGTH = "text + height * width"
_TEXT_POSITIONS = GridPositions(("text",), points_first=True)  # the text's position on all three axes
INPUTS = dict(
    hidden_states=Noise(("batch", _LENGTH, "in_channels")),
    timestep=Uniform(),
    encoder_hidden_states=Noise(("batch", _LENGTH, "llm_features_dim")),
    # text at its index on all three axes, then the image at (65536, 65536 + row, 65536 + column)
    position_ids=Cat((Cat((_TEXT_POSITIONS,) * 3, dim=1),
                      GridPositions((1, "height", "width"), offset=(65536, 65536, 65536), points_first=True)),
                     per_sample=True),
    # the last sample's prompt is two tokens shorter: those positions are sequence padding in their own segment
    segment_ids=Full(("batch", _LENGTH), 0, "long", set=(("-1, text - 2:text", -1),)),
    indicator=Full(("batch", _LENGTH), _IMAGE, "long", set=((":, :text", _TEXT), ("-1, text - 2:text", _PADDING))),
    return_dict=False,
)


FAMILY = Family.of(__name__)
