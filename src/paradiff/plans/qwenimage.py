"""Qwen-Image (`QwenImageTransformer2DModel`): how it splits under tensor and context parallelism."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import Grid, joint_attention
from paradiff.plans.family import Family

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


EXAMPLES = {"qwen-image": ("QwenImageTransformer2DModel", dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))}


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    mask = torch.ones(batch, grid.text, dtype=torch.long)
    mask[-1, -2:] = 0  # the last prompt is padded: exercises the text mask
    return dict(
        hidden_states=torch.randn(batch, grid.height * grid.width, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, grid.text, config.joint_attention_dim, generator=generator),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=generator),
        img_shapes=[[(1, grid.height, grid.width)]] * batch,
        return_dict=False,
    )


FAMILY = Family(
    name="qwenimage",
    model_classes=MODEL_CLASSES,
    tensor_parallel_plan=tensor_parallel_plan,
    context_parallel_plan=context_parallel_plan,
    examples=EXAMPLES,
    example_inputs=example_inputs,
)
