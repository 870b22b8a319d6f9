"""Qwen-Image (`QwenImageTransformer2DModel`): how it splits under tensor and context parallelism."""

from ..context_parallel.plan import ContextParallelPlan, Split
from ..tensor_parallel.plan import TensorParallelPlan
from .common import joint_attention

MODEL_CLASSES = ("QwenImageTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **joint_attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.img_mlp.net.0.proj": "colwise",
        "transformer_blocks.*.img_mlp.net.2": "rowwise",
        "transformer_blocks.*.txt_mlp.net.0.proj": "colwise",
        "transformer_blocks.*.txt_mlp.net.2": "rowwise",
        # per-block AdaLN modulation, dim -> 6 dim: the largest replicated weights of the model
        "transformer_blocks.*.img_mod.1": "rowwise_split_input",
        "transformer_blocks.*.txt_mod.1": "rowwise_split_input",
        "txt_in": "rowwise_split_input",
        "time_text_embed.timestep_embedder.linear_1": "colwise",
        "time_text_embed.timestep_embedder.linear_2": "rowwise",
        "norm_out.linear": "rowwise_split_input",
    }
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # The rotary tables are computed from the full text length, so the text is split at the first block, not at the
    # model's input; the text mask and the per-token modulation index travel with every block.
    return ContextParallelPlan(
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1), "encoder_hidden_states": Split(1)},
            "transformer_blocks.*": {"encoder_hidden_states_mask": Split(1), "modulate_index": Split(1)},
        },
        split_outputs={"pos_embed": {0: Split(0), 1: Split(0)}},
        gather_outputs={"proj_out": 1},
    )
