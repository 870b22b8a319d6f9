"""Lumina-Next (`LuminaNextDiT2DModel`): how it splits under tensor and context parallelism.

Each block mixes its self- and cross-attention per head (a learned gate per head) before one shared output
projection (attn2.to_out.0), so the gate is split with the heads. Q/K norms normalise all heads at once; K/V have
fewer heads than Q (grouped-query attention), and beyond their count each rank pair shares one K/V head.
"""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, HeadNorm, SplitParameter
from paradiff.plans.common import split_input
from paradiff.plans.family import Family
from paradiff.plans.inputs import Call, Value, image_inputs, text_mask

MODEL_CLASSES = ("LuminaNextDiT2DModel",)


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        "layers.*.gate": SplitParameter(0),
        "layers.*.attn2.to_out.0": "rowwise",  # attn1 has no output projection of its own
        "layers.*.feed_forward.linear_1": "colwise",
        "layers.*.feed_forward.linear_3": "colwise",
        "layers.*.feed_forward.linear_2": "rowwise",
        **split_input("layers.*.norm1.linear", "time_caption_embed.caption_embedder.1", "norm_out.linear_1"),
        "time_caption_embed.timestep_embedder.linear_1": "colwise",
        "time_caption_embed.timestep_embedder.linear_2": "rowwise",
    }
    for attn in ("attn1", "attn2"):
        styles.update({
            f"layers.*.{attn}.to_q": "colwise",
            f"layers.*.{attn}.to_k": ColwiseHeads(_head_dim),
            f"layers.*.{attn}.to_v": ColwiseHeads(_head_dim),
        })
        if config.qk_norm:
            styles[f"layers.*.{attn}.norm_q"] = "norm_across_heads"
            styles[f"layers.*.{attn}.norm_k"] = HeadNorm(head_dim=_head_dim)
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={
            "layers.0": {"hidden_states": Split(1)},
            # the patch embedder's all-ones token mask and the rotary table cropped to the image
            "layers.*": {"attention_mask": Split(1), "image_rotary_emb": Split(1)},
        },
        gather_outputs={"norm_out": 1},
        local_attention=("layers.*.attn2",),  # cross-attention to the replicated caption
        unsupported_inputs={"": {"cross_attention_kwargs.base_sequence_length": (
            "proportional attention scales each attention by the sequence length its processor sees, which is the "
            "rank's part; call the pipeline with proportional_attn=False, or use tensor parallelism")}},
    )


EXAMPLES = {
    # 4 query heads, 2 K/V heads: tp2 splits both, tp4 replicates each K/V head (and its norm) on two ranks
    "lumina-next": ("LuminaNextDiT2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_kv_heads=2, multiple_of=16, cross_attention_dim=32)),
}
EXTRA_MODES = {"lumina-next": ("tp4",)}


INPUTS = {
    **image_inputs("cross_attention_dim", flow=True),
    "encoder_mask": text_mask("long", keep="text - 3"),  # the last caption is padded
    "image_rotary_emb": Call("diffusers.models.embeddings:get_2d_rotary_pos_embed_lumina",
                             (Value("hidden_size // num_attention_heads"), 16, 16)),
    "cross_attention_kwargs": {},
}


FAMILY = Family.of(__name__)
