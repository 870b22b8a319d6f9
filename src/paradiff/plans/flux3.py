"""FLUX.3 (`Flux3Transformer2DModel`): per-mode blocks (image, reference image, text) that attend within their own
mode, then joint single blocks over all tokens; modulation is per token."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.plans.common import attention, split_input
from paradiff.plans.family import Family
from paradiff.plans.flux import FLUX_INPUTS
from paradiff.plans.inputs import GridIds, Noise, Uniform, When

MODEL_CLASSES = ("Flux3Transformer2DModel",)

_STACKS = ("mode_blocks.*.*", "txt_mode_blocks.*", "single_transformer_blocks.*")
_MODES = ("image", "image_cond", "txt")


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {}
    for stack in _STACKS:
        styles.update(attention(f"{stack}.attn"))
        # SwiGLU: gate and value are equal halves of linear_in
        styles[f"{stack}.ff.linear_in"] = PackedColwise([1, 1])
        styles[f"{stack}.ff.linear_out"] = "rowwise"
    for mode in _MODES:
        # per-token modulation, dim -> 3 dim on a replicated input
        styles[f"early_stream_modulations.{mode}.linear"] = "rowwise_split_input"
        styles[f"single_stream_modulations.{mode}.linear"] = "rowwise_split_input"
    styles.update({
        **split_input("context_embedder", "norm_out.linear"),
        "timestep_embedder.linear_1": "colwise",
        "timestep_embedder.linear_2": "rowwise",
    })
    if config.flow_map:
        styles["target_timestep_embedder.linear_1"] = "colwise"
        styles["target_timestep_embedder.linear_2"] = "rowwise"
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # Every mode is split at the model's input with its position ids; nothing is masked, so each rank's joint
    # sequence [text, image, reference] being a different interleaving of the global one changes no attention.
    # The image tokens stay first in the local content sequence, so the model's own slice keeps only them.
    return ContextParallelPlan(
        split_inputs={
            "": {
                "hidden_states": Split(1),
                "encoder_hidden_states": Split(1),
                "image_cond_hidden_states": Split(1),
                "img_ids": Split(-2),
                "txt_ids": Split(-2),
                "image_cond_ids": Split(-2),
            }
        },
        gather_outputs={"proj_out": 1},
    )


_TINY = dict(in_channels=16, cond_in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=4, joint_attention_dim=32, timestep_channels=32, mlp_ratio=2.0,
             axes_dims_rope=(4, 4, 4, 4))
EXAMPLES = {
    "flux.3": ("Flux3Transformer2DModel", _TINY),
    "flux.3-flow-map": ("Flux3Transformer2DModel", {**_TINY, "flow_map": True}),
}


INPUTS = {
    **FLUX_INPUTS,
    # a reference image of a different size than the target: its own token count
    "image_cond_hidden_states": Noise(("batch", "height * (width + 2)", "cond_in_channels")),
    "image_cond_ids": GridIds("height", "width + 2", "len(axes_dims_rope)", fixed={0: 1}),
    "target_timestep": When("flow_map", Uniform()),
}


FAMILY = Family.of(__name__)
