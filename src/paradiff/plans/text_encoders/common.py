"""The fragments most encoder plans share: a Llama-style decoder, and a CLIP-style encoder tower."""

from __future__ import annotations

from typing import Callable

from paradiff.tensor_parallel.plan import AttentionHeads, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, PackedColwise, Style


def decoder_text_model(
    config,
    model_class: str,
    paths: dict[str, tuple[str, str | None]],
    attention_attrs: dict[str, tuple[str, ...]] | None = None,
    fused_gate_up: bool = False,
    text_config=None,
    split_vocab: bool = True,
) -> TensorParallelPlan:
    """A Llama-style decoder (Llama, Mistral, Qwen 2 / 2.5 / 3 and their VL text parts, Gemma 1 / 2 / 3, SmolLM3,
    GLM, T5Gemma's encoder) used as a text encoder.

    `paths[model_class]` is (path of the decoder, path of the LM head or None) in that class. The token table and
    the LM head split the vocabulary (a tied pair holds one slice), attention splits by heads with grouped K/V heads
    replicated when tp exceeds their count, the SwiGLU MLP splits gate/up colwise and down rowwise (GLM packs gate
    and up in one `gate_up_proj`, split as two blocks: `fused_gate_up`). Everything else (norms, rotary tables,
    vision towers and projectors) stays whole on every rank. `attention_attrs` names the head counters the attention
    class keeps (keys: per_query_head, per_kv_head, groups). `text_config` is the decoder's config where it is
    neither the model's config nor its `text_config` (T5Gemma's `encoder`). `split_vocab=False` keeps the token
    table whole, for tables whose forward reads the token ids beyond the lookup.
    """
    text = text_config or getattr(config, "text_config", None) or config
    decoder, lm_head = paths[model_class]
    layers = f"{decoder}.layers" if decoder else "layers"
    kv_heads = text.num_key_value_heads or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    styles: dict[str, str | Style] = {
        f"{layers}.*.self_attn.q_proj": "colwise",
        f"{layers}.*.self_attn.k_proj": ColwiseHeads(head_dim),
        f"{layers}.*.self_attn.v_proj": ColwiseHeads(head_dim),
        f"{layers}.*.self_attn.o_proj": "rowwise",
        f"{layers}.*.mlp.down_proj": "rowwise",
    }
    if split_vocab:
        styles[f"{decoder}.embed_tokens" if decoder else "embed_tokens"] = "vocab"
    if fused_gate_up:
        styles[f"{layers}.*.mlp.gate_up_proj"] = PackedColwise((1, 1))  # chunk(2): gate, then up
    else:
        styles[f"{layers}.*.mlp.gate_proj"] = "colwise"
        styles[f"{layers}.*.mlp.up_proj"] = "colwise"
    if lm_head:
        styles[lm_head] = "vocab"
    attrs = attention_attrs or {"groups": ("num_key_value_groups",)}
    heads = AttentionHeads(text.num_attention_heads, kv_heads, **attrs)
    return TensorParallelPlan(styles=styles, attention={f"{layers}.*.self_attn": heads})


def decoder_paths(model_class: str, causal_lm_class: str | None = None) -> dict[str, tuple[str, str | None]]:
    """`decoder_text_model`'s paths for a decoder class and its causal LM (the decoder at `model`, the `lm_head`)."""
    paths: dict[str, tuple[str, str | None]] = {model_class: ("", None)}
    if causal_lm_class:
        paths[causal_lm_class] = ("model", "lm_head")
    return paths


def multimodal_paths(prefix: str) -> dict[str, tuple[str, str | None]]:
    """`decoder_text_model`'s paths for transformers' multimodal `<prefix>Model` (the decoder at `language_model`)
    and `<prefix>ForConditionalGeneration` (at `model.language_model`, with the `lm_head`)."""
    return {f"{prefix}Model": ("language_model", None),
            f"{prefix}ForConditionalGeneration": ("model.language_model", "lm_head")}


def decoder_plan(paths: dict[str, tuple[str, str | None]], **options) -> Callable[..., TensorParallelPlan]:
    """A family's `tensor_parallel_plan(config, model_class)`: `decoder_text_model` over `paths` with `options`."""

    def tensor_parallel_plan(config, model_class: str) -> TensorParallelPlan:
        return decoder_text_model(config, model_class, paths, **options)

    return tensor_parallel_plan


def clip_style_tower(root: str, tower_config) -> tuple[dict[str, str | Style], dict[str, AttentionHeads]]:
    """(styles, attention) of a CLIP / SigLIP transformer tower at `root` ("" or e.g. "vision_model."): q/k/v
    colwise and out_proj rowwise by heads (the attention class reshapes by head_dim and keeps `num_heads`), fc1
    colwise, fc2 rowwise. Embeddings, norms and pooling heads stay whole."""
    layers = f"{root}encoder.layers.*"
    styles: dict[str, str | Style] = {
        f"{layers}.self_attn.q_proj": "colwise",
        f"{layers}.self_attn.k_proj": "colwise",
        f"{layers}.self_attn.v_proj": "colwise",
        f"{layers}.self_attn.out_proj": "rowwise",
        f"{layers}.mlp.fc1": "colwise",
        f"{layers}.mlp.fc2": "rowwise",
    }
    heads = AttentionHeads(tower_config.num_attention_heads, per_query_head=("num_heads",))
    return styles, {f"{layers}.self_attn": heads}
