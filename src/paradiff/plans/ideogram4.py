"""Ideogram 4 (`Ideogram4Transformer2DModel`): a single-stream DiT over a packed [text, image] sequence where every
input is per token and a block-diagonal mask from `segment_ids` keeps packed samples apart."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, attention, mlp
from paradiff.plans.family import Family

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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    h, w, t = grid.height, grid.width, grid.text
    length = t + h * w
    indicator = torch.full((batch, length), _IMAGE, dtype=torch.long)
    indicator[:, :t] = _TEXT
    segment_ids = torch.zeros(batch, length, dtype=torch.long)
    # the last sample's prompt is two tokens shorter: those positions are sequence padding in their own segment
    indicator[-1, t - 2:t] = _PADDING
    segment_ids[-1, t - 2:t] = -1
    position_ids = torch.zeros(batch, length, 3, dtype=torch.long)
    position_ids[:, :t] = torch.arange(t)[:, None]
    position_ids[:, t:, 0] = 65536
    position_ids[:, t:, 1] = 65536 + torch.arange(h).repeat_interleave(w)
    position_ids[:, t:, 2] = 65536 + torch.arange(w).repeat(h)
    return dict(
        hidden_states=torch.randn(batch, length, config.in_channels, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, length, config.llm_features_dim, generator=generator),
        position_ids=position_ids,
        segment_ids=segment_ids,
        indicator=indicator,
        return_dict=False,
    )


FAMILY = Family.of(__name__)
