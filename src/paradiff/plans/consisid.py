"""ConsisID (`ConsisIDTransformer3DModel`): CogVideoX blocks plus perceiver cross-attention to face features."""

from paradiff.context_parallel.plan import ContextParallelPlan
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import PackedColwise
from paradiff.plans import cogvideox
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Repeat

MODEL_CLASSES = ("ConsisIDTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = dict(cogvideox.tensor_parallel_plan(config).styles)
    if config.is_train_face:
        # hand-written attention (no processor): its `heads` shrinks with the split; K and V share one projection
        styles.update({"perceiver_cross_attention.*.to_q": "colwise",
                       "perceiver_cross_attention.*.to_kv": PackedColwise([1, 1]),
                       "perceiver_cross_attention.*.to_out": "rowwise"})
    return TensorParallelPlan(styles=styles, head_modules=("perceiver_cross_attention.*",) if config.is_train_face
                              else ())


def context_parallel_plan(config) -> ContextParallelPlan:
    # The perceiver cross-attention reads the local video tokens and the replicated face features: local as it is.
    # After the blocks the model cuts the text off by its full length, so the last block's text is gathered back.
    plan = cogvideox.context_parallel_plan(config)
    plan.gather_outputs[f"transformer_blocks.{config.num_layers - 1}"] = {1: 1}
    return plan


EXAMPLES = {
    "consisid": ("ConsisIDTransformer3DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
        text_embed_dim=32, num_layers=2, patch_size=2, sample_width=10, sample_height=6, sample_frames=9,
        use_rotary_positional_embeddings=True, is_train_face=True, cross_attn_interval=1, cross_attn_dim_head=16,
        cross_attn_num_heads=2, LFE_id_dim=16, LFE_vit_dim=32, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2,
        LFE_num_id_token=2, LFE_num_querie=4, LFE_output_dim=42, LFE_ff_mult=2, LFE_num_scale=2)),
}


INPUTS = {**cogvideox.INPUTS, "id_cond": Noise(("batch", "LFE_id_dim")),
          "id_vit_hidden": Repeat(Noise(("batch", 5, "LFE_vit_dim")), "LFE_num_scale")}


FAMILY = Family.of(__name__)
