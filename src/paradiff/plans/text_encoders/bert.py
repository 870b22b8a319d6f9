"""BERT text encoders: HunyuanDiT's (and EasyAnimate v1's) Chinese BERT. Attention splits by heads (the attention
class reshapes by its head size and keeps `num_attention_heads` and `all_head_size`), the feed-forward's
intermediate dense colwise and output dense rowwise; position / token-type embeddings, norms and the pooler stay
whole."""

from paradiff.plans.family import Family
from paradiff.tensor_parallel.plan import AttentionHeads, TensorParallelPlan

MODEL_CLASSES = ("BertModel",)


def tensor_parallel_plan(config, model_class: str) -> TensorParallelPlan:
    layers = "encoder.layer.*"
    styles = {
        "embeddings.word_embeddings": "vocab",
        f"{layers}.attention.self.query": "colwise",
        f"{layers}.attention.self.key": "colwise",
        f"{layers}.attention.self.value": "colwise",
        f"{layers}.attention.output.dense": "rowwise",
        f"{layers}.intermediate.dense": "colwise",
        f"{layers}.output.dense": "rowwise",
    }
    heads = AttentionHeads(config.num_attention_heads, per_query_head=("num_attention_heads", "all_head_size"))
    return TensorParallelPlan(styles=styles, attention={f"{layers}.attention.self": heads})


FAMILY = Family.of(__name__)
