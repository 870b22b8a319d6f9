"""MiniMax Music 3 (`MiniMaxMusic3Transformer1DModel`): a 1-D audio DiT with the timestep prepended as a token."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.plans.common import attention, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform

MODEL_CLASSES = ("MiniMaxMusic3Transformer1DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn"),
        "transformer_blocks.*.ff_in": PackedColwise([1, 1]),  # [value, gate]
        "transformer_blocks.*.ff_out": "rowwise",
        **mlp("time_embed"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    # The model drops its first token (the timestep) after the blocks, so the sequence is gathered after the last
    # block, not at proj_out; the rotary table covers the same (timestep + audio) sequence.
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1)}},
        split_token_arguments={"transformer_blocks.*": ("rotary_emb",)},
        gather_outputs={f"transformer_blocks.{config.num_layers - 1}": 1},
    )


EXAMPLES = {"minimax-music-3": ("MiniMaxMusic3Transformer1DModel", dict(
    in_channels=8, condition_dim=16, num_layers=2, num_attention_heads=4, attention_head_dim=16, ff_inner_dim=96,
    rotary_dim=8, fourier_embedding_dim=16))}


INPUTS = dict(
    # height * width + 1 frames with the timestep token: 17, which 2 and 4 ranks do not divide
    hidden_states=Noise(("batch", "in_channels", "height * width + 1")),
    encoder_hidden_states=Noise(("batch", "height * width + 1", "condition_dim")),
    timestep=Uniform(),
    return_dict=False,
)


FAMILY = Family.of(__name__)
