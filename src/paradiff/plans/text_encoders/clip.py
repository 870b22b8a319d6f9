"""CLIP text encoders (FLUX.1, SD3, HunyuanVideo): small, but split like the rest so every encoder shrinks."""

from paradiff.tensor_parallel.plan import AttentionHeads, TensorParallelPlan
from paradiff.plans.family import Family

# where the text transformer sits: CLIPTextModel is it, CLIPTextModelWithProjection wraps it
ROOTS = {"CLIPTextModel": "", "CLIPTextModelWithProjection": "text_model."}
MODEL_CLASSES = tuple(ROOTS)


def tensor_parallel_plan(config, model_class: str) -> TensorParallelPlan:
    root = ROOTS[model_class]
    layers = f"{root}encoder.layers.*"
    styles = {
        f"{root}embeddings.token_embedding": "vocab",
        f"{layers}.self_attn.q_proj": "colwise",
        f"{layers}.self_attn.k_proj": "colwise",
        f"{layers}.self_attn.v_proj": "colwise",
        f"{layers}.self_attn.out_proj": "rowwise",
        f"{layers}.mlp.fc1": "colwise",
        f"{layers}.mlp.fc2": "rowwise",
    }
    heads = AttentionHeads(config.num_attention_heads, per_query_head=("num_heads",))
    return TensorParallelPlan(styles=styles, attention={f"{layers}.self_attn": heads})


FAMILY = Family(name="clip", model_classes=MODEL_CLASSES, tensor_parallel_plan=tensor_parallel_plan)
