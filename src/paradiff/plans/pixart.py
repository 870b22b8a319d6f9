"""PixArt-alpha / PixArt-sigma (`PixArtTransformer2DModel`): how it splits under tensor and context parallelism."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import adaln_single, basic_transformer_block, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import image_inputs, text_mask

MODEL_CLASSES = ("PixArtTransformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **basic_transformer_block("transformer_blocks.*"),
        **adaln_single(),
    }
    if config.caption_channels is not None:
        styles.update(mlp("caption_projection"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": Split(1)}},
        gather_outputs={"proj_out": 1},
        # attn2 attends to the replicated caption: local, no communication
        local_attention=("transformer_blocks.*.attn2",),
    )


EXAMPLES = {
    "pixart-sigma": ("PixArtTransformer2DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=64, sample_size=16, patch_size=2, caption_channels=32, norm_num_groups=1)),
}


INPUTS = {**image_inputs("caption_channels"), "encoder_attention_mask": text_mask("long", keep="text // 2"),  # padded
          "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


FAMILY = Family.of(__name__)
