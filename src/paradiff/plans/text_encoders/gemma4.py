"""Gemma 4 text encoders: LTX-2's `Gemma4UnifiedForConditionalGeneration` (text part split; vision and audio towers
stay whole), and the plain Gemma 4 classes.

Gemma 4's layers are not alike, so the plan names each layer: global (full-attention) layers have their own head
size and K/V head count (`per_layer_config`), global layers with `attention_k_eq_v` have no V projection (V is K),
and the last `num_kv_shared_layers` layers have no K/V projections at all, reusing the K/V of the last earlier
layer of their type: under TP the stored K/V are the producer's local heads, which are the heads the consumer's
local query heads use, since both layers split their heads the same way. The per-layer token table (vocabulary x
layers * per-layer width; plain Gemma 4 only) splits by vocabulary like the main one; mixture-of-experts blocks
stay whole.
"""

from paradiff.plans.family import Family
from paradiff.tensor_parallel.plan import AttentionHeads, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, Style

_PATHS = {"TextModel": ("", None), "ForCausalLM": ("model", "lm_head"), "Model": ("language_model", None),
          "ForConditionalGeneration": ("model.language_model", "lm_head")}
PATHS = {f"{family}{suffix}": path for family in ("Gemma4", "Gemma4Unified") for suffix, path in _PATHS.items()}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str) -> TensorParallelPlan:
    text = getattr(config, "text_config", None) or config
    decoder, lm_head = PATHS[model_class]
    prefix = f"{decoder}." if decoder else ""
    styles: dict[str, str | Style] = {f"{prefix}embed_tokens": "vocab"}
    if getattr(text, "hidden_size_per_layer_input", None) and not model_class.startswith("Gemma4Unified"):
        styles[f"{prefix}embed_tokens_per_layer"] = "vocab"
    if lm_head:
        styles[lm_head] = "vocab"
    attention = {}
    for index in range(text.num_hidden_layers):
        layer = f"{prefix}layers.{index}"
        layer_config = text.per_layer_config[index]
        styles[f"{layer}.self_attn.q_proj"] = "colwise"
        styles[f"{layer}.self_attn.o_proj"] = "rowwise"
        if text.kv_sharing_modes[index] != "reuse":
            styles[f"{layer}.self_attn.k_proj"] = ColwiseHeads(layer_config.head_dim)
            if not (text.attention_k_eq_v and text.layer_types[index] != "sliding_attention"):
                styles[f"{layer}.self_attn.v_proj"] = ColwiseHeads(layer_config.head_dim)
        for name, style in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise")):
            styles[f"{layer}.mlp.{name}"] = style
        attention[f"{layer}.self_attn"] = AttentionHeads(
            text.num_attention_heads, layer_config.num_key_value_heads, groups=("num_key_value_groups",))
    return TensorParallelPlan(styles=styles, attention=attention)


FAMILY = Family.of(__name__)
