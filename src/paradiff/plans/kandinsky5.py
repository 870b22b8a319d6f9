"""Kandinsky 5 (`Kandinsky5Transformer3DModel`): a text encoder stack, then visual blocks with self-attention,
cross-attention to the encoded text and a feed-forward; returns a bare tensor with `return_dict=False`."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.plans.common import split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Arange, Noise, Uniform


def _attention(prefix: str) -> dict:
    return {f"{prefix}.to_query": "colwise", f"{prefix}.to_key": "colwise", f"{prefix}.to_value": "colwise",
            f"{prefix}.out_layer": "rowwise"}


MODEL_CLASSES = ("Kandinsky5Transformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **_attention("text_transformer_blocks.*.self_attention"),
        **_attention("visual_transformer_blocks.*.self_attention"),
        **_attention("visual_transformer_blocks.*.cross_attention"),
        "time_embeddings.in_layer": "colwise", "time_embeddings.out_layer": "rowwise",
        **split_input("text_embeddings.in_layer", "visual_transformer_blocks.*.visual_modulation.out_layer"),
        # per-block modulation: time_dim -> 6 or 9 x model_dim on the replicated time embedding
        "text_transformer_blocks.*.text_modulation.out_layer": "rowwise_split_input",
    }
    for stack in ("text_transformer_blocks", "visual_transformer_blocks"):
        styles.update({f"{stack}.*.feed_forward.in_layer": "colwise", f"{stack}.*.feed_forward.out_layer": "rowwise"})
    return TensorParallelPlan(styles=styles, head_attrs=DEFAULT_HEAD_ATTRS + ("num_heads",))


def context_parallel_plan(config) -> ContextParallelPlan:
    # The text and the (flattened) video are split at their stacks' first blocks with their rotary tables, and
    # gathered after their last: the visual blocks cross-attend to the whole text, the output layer unflattens the
    # whole video.
    return ContextParallelPlan(
        split_inputs={
            "text_transformer_blocks.0": {"x": Split(1)},
            "text_transformer_blocks.*": {"rope": Split(1)},
            "visual_transformer_blocks.0": {"visual_embed": Split(1)},
            "visual_transformer_blocks.*": {"rope": Split(1)},
        },
        gather_outputs={f"text_transformer_blocks.{config.num_text_blocks - 1}": 1,
                        f"visual_transformer_blocks.{config.num_visual_blocks - 1}": 1},
        local_attention=("visual_transformer_blocks.*.cross_attention",),
    )


EXAMPLES = {"kandinsky-5": ("Kandinsky5Transformer3DModel", dict(
    in_visual_dim=4, in_text_dim=24, in_text_dim2=16, time_dim=32, out_visual_dim=4, model_dim=64, ff_dim=96,
    num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6)))}


INPUTS = dict(
    hidden_states=Noise(("batch", "frames * patch_size[0]", "height * patch_size[1]", "width * patch_size[2]",
                         "in_visual_dim")),
    encoder_hidden_states=Noise(("batch", "text", "in_text_dim")),
    timestep=Uniform(1000),
    pooled_projections=Noise(("batch", "in_text_dim2")),
    visual_rope_pos=[Arange("frames"), Arange("height"), Arange("width")],
    text_rope_pos=Arange("text"),
    return_dict=False,
)


FAMILY = Family.of(__name__)
