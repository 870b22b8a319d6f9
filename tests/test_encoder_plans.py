"""Text-encoder plans resolved on meta-device models (no ranks): vocabulary splits cover every row once, K/V heads are
replicated within groups past their count, and degrees that split a head group are refused with the valid ones."""

from __future__ import annotations

import pytest
import torch
import transformers

from paradiff.errors import PlanError
from paradiff.plans import builtin_plan
from paradiff.tensor_parallel.plan import as_plan, resolve_plan
from paradiff.tensor_parallel.styles import Vocab


def _meta(model_cls, config):
    with torch.device("meta"):
        return model_cls(config)


def _qwen3(heads: int = 4, kv_heads: int = 2):
    config = transformers.Qwen3Config(vocab_size=1001, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
                                      tie_word_embeddings=True)
    return _meta(transformers.Qwen3ForCausalLM, config)


@pytest.mark.parametrize("rows,size", [(1001, 2), (1001, 4), (32128, 8), (5, 4)])
def test_vocab_split_covers_every_row_once(rows, size):
    pieces = [Vocab().shard_spec("weight", (rows, 16), rank, size, None, "embed").pieces[0] for rank in range(size)]
    assert [start for start, _ in pieces] == [sum(length for _, length in pieces[:r]) for r in range(size)]
    assert sum(length for _, length in pieces) == rows
    assert max(length for _, length in pieces) - min(length for _, length in pieces) <= 1


@pytest.mark.parametrize("size,kv_rows,groups", [(2, 8, 2), (4, 8, 1)])
def test_kv_heads_split_then_replicated(size, kv_rows, groups):
    model = _qwen3()
    for rank in range(size):
        resolved = resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), rank, size)
        k_spec = resolved.spec_for("model.layers.0.self_attn.k_proj.weight")
        (start, length), = k_spec.pieces
        assert length == kv_rows
        # rank r's query heads [r*4/size, (r+1)*4/size) all use K/V head (query head) // 2
        first_query_head = rank * 4 // size
        assert start == (first_query_head // 2) * 8
        assert resolved.local_head_counts["model.layers.0.self_attn"] == {"num_key_value_groups": groups}
        # the tied embedding and LM head take the same rows
        assert resolved.spec_for("lm_head.weight") == resolved.spec_for("model.embed_tokens.weight")


def test_degree_splitting_a_head_group_is_refused():
    model = _qwen3(heads=6, kv_heads=2)
    with pytest.raises(PlanError) as info:
        resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), 0, 3)
    message = str(info.value)
    assert "tp_degree=3 must divide its 2 key/value heads or be a multiple of them" in message
    assert "valid tp degrees: [1, 2, 6]" in message


def test_degree_not_dividing_query_heads_is_refused():
    model = _qwen3(heads=4, kv_heads=2)
    with pytest.raises(PlanError, match=r"tp_degree=8 must divide the attention head count num_attention_heads=4 of "
                                        r"Qwen3ForCausalLM; valid tp degrees: \[1, 2, 4\]"):
        resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), 0, 8)


def test_t5_relative_bias_splits_by_heads():
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False)
    model = _meta(transformers.T5EncoderModel, config)
    resolved = resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), 1, 2)
    spec = resolved.spec_for("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    assert spec.dim == 1 and spec.pieces == ((2, 2),)  # (buckets, heads): rank 1 holds heads 2 and 3
    assert resolved.local_head_counts["encoder.block.1.layer.0.SelfAttention"] == {"n_heads": 2, "inner_dim": 16}
