"""Wan VACE (`WanVACETransformer3DModel`): Wan's blocks plus a stack of VACE blocks that turn the control video into
hints added after selected Wan blocks."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import wan
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Tensor, Uniform

MODEL_CLASSES = ("WanVACETransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **wan.block_styles("blocks.*", config),
        **wan.block_styles("vace_blocks.*", config),
        # dim -> dim projections of the control stream in and of the hint out, on replicated activations
        "vace_blocks.0.proj_in": "rowwise_split_input",
        "vace_blocks.*.proj_out": "rowwise_split_input",
        **wan.condition_styles("condition_embedder"),
    })


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            # every VACE block reads the model's (full) video tokens; the control tokens it passes on stay split
            "vace_blocks.*": {"hidden_states": Split(1)},
            "vace_blocks.0": {"control_hidden_states": Split(1)},
            "blocks.0": {"hidden_states": Split(1)},
        },
        split_outputs={"rope": {0: Split(1), 1: Split(1)}},
        gather_outputs={"proj_out": 1},
        local_attention=("blocks.*.attn2", "vace_blocks.*.attn2"),
    )


EXAMPLES = {
    "wan-vace": ("WanVACETransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, vace_layers=[0, 1],
        vace_in_channels=6)),
}


_VIDEO = ("frames * patch_size[0]", "height * patch_size[1]", "width * patch_size[2]")
INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", *_VIDEO)),
    encoder_hidden_states=Noise(("batch", "text", "text_dim")),
    timestep=Uniform(1000),
    control_hidden_states=Noise(("batch", "vace_in_channels", *_VIDEO)),
    control_hidden_states_scale=Tensor((1.0, 0.5)),
    return_dict=False,
)


FAMILY = Family.of(__name__)
