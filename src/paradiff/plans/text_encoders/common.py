"""The Llama-style decoder fragment most text-encoder plans share."""

from __future__ import annotations

from paradiff.tensor_parallel.plan import AttentionHeads, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, Style


def decoder_text_model(
    config,
    model_class: str,
    paths: dict[str, tuple[str, str | None]],
    attention_attrs: dict[str, tuple[str, ...]] | None = None,
) -> TensorParallelPlan:
    """A Llama-style decoder (Llama, Mistral, Qwen 2.5 / 3, Gemma 2 / 3) used as a text encoder.

    `paths[model_class]` is (path of the decoder, path of the LM head or None) in that class. The token table and
    the LM head split the vocabulary (a tied pair holds one slice), attention splits by heads with grouped K/V heads
    replicated when tp exceeds their count, the SwiGLU MLP splits gate/up colwise and down rowwise. Everything else
    (norms, rotary tables, vision towers and projectors) stays whole on every rank. `attention_attrs` names the head
    counters the attention class keeps (keys: per_query_head, per_kv_head, groups).
    """
    text = getattr(config, "text_config", None) or config
    decoder, lm_head = paths[model_class]
    layers = f"{decoder}.layers" if decoder else "layers"
    kv_heads = text.num_key_value_heads or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    styles: dict[str, str | Style] = {
        f"{decoder}.embed_tokens" if decoder else "embed_tokens": "vocab",
        f"{layers}.*.self_attn.q_proj": "colwise",
        f"{layers}.*.self_attn.k_proj": ColwiseHeads(head_dim),
        f"{layers}.*.self_attn.v_proj": ColwiseHeads(head_dim),
        f"{layers}.*.self_attn.o_proj": "rowwise",
        f"{layers}.*.mlp.gate_proj": "colwise",
        f"{layers}.*.mlp.up_proj": "colwise",
        f"{layers}.*.mlp.down_proj": "rowwise",
    }
    if lm_head:
        styles[lm_head] = "vocab"
    attrs = attention_attrs or {"groups": ("num_key_value_groups",)}
    heads = AttentionHeads(text.num_attention_heads, kv_heads, **attrs)
    return TensorParallelPlan(styles=styles, attention={f"{layers}.*.self_attn": heads})
