"""T5 and UMT5 encoders (FLUX.1 / SD3 / Chroma's T5-XXL, Wan's UMT5-XXL) as text encoders.

Attention splits by heads, and so does the relative position bias table (buckets x heads): T5 keeps it in the first
block only, UMT5 in every block. The gated (or plain) feed-forward splits wi colwise, wo rowwise.
"""

from paradiff.tensor_parallel.plan import AttentionHeads, TensorParallelPlan
from paradiff.plans.family import Family

MODEL_CLASSES = ("T5EncoderModel", "UMT5EncoderModel")


def tensor_parallel_plan(config, model_class: str) -> TensorParallelPlan:
    attention = "encoder.block.*.layer.0.SelfAttention"
    feed_forward = "encoder.block.*.layer.1.DenseReluDense"
    bias_blocks = "*" if model_class == "UMT5EncoderModel" else "0"
    styles = {
        "shared": "vocab",
        "encoder.embed_tokens": "vocab",
        f"{attention}.q": "colwise",
        f"{attention}.k": "colwise",
        f"{attention}.v": "colwise",
        f"{attention}.o": "rowwise",
        f"encoder.block.{bias_blocks}.layer.0.SelfAttention.relative_attention_bias": "colwise",
        f"{feed_forward}.wo": "rowwise",
    }
    for name in ("wi_0", "wi_1") if config.is_gated_act else ("wi",):
        styles[f"{feed_forward}.{name}"] = "colwise"
    heads = AttentionHeads(config.num_heads, per_query_head=("n_heads", "inner_dim"))
    return TensorParallelPlan(styles=styles, attention={attention: heads})


FAMILY = Family.of(__name__)
