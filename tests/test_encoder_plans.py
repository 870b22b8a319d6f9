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


@pytest.mark.parametrize("heads,kv_heads,size,query,kv", [
    # 2 K/V heads over 3 ranks: ranks 0-1 share K/V head 0 and split its 3 query heads 2 + 1, rank 2 has head 1
    (6, 2, 3, [(0, 2), (2, 1), (3, 3)], [(0, 1), (0, 1), (1, 1)]),
    # 3 K/V heads over 2 ranks: whole groups, 2 + 1 K/V heads with their query heads
    (6, 3, 2, [(0, 4), (4, 2)], [(0, 2), (2, 1)]),
    # one K/V head: every rank holds it, the 5 query heads split 2 + 2 + 1
    (5, 1, 3, [(0, 2), (2, 2), (4, 1)], [(0, 1), (0, 1), (0, 1)]),
])
def test_uneven_grouped_heads_keep_each_query_head_with_its_kv_head(heads, kv_heads, size, query, kv):
    model = _qwen3(heads=heads, kv_heads=kv_heads)
    for rank in range(size):
        resolved = resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), rank, size)
        (q_start, q_rows), = resolved.spec_for("model.layers.0.self_attn.q_proj.weight").pieces
        (k_start, k_rows), = resolved.spec_for("model.layers.0.self_attn.k_proj.weight").pieces
        assert (q_start // 8, q_rows // 8) == query[rank] and (k_start // 8, k_rows // 8) == kv[rank]
        assert resolved.spec_for("model.layers.0.self_attn.o_proj.weight").pieces == ((q_start, q_rows),)
        group = heads // kv_heads
        # every query head the rank holds attends a K/V head the rank holds
        assert all(kv[rank][0] <= head // group < kv[rank][0] + kv[rank][1]
                   for head in range(query[rank][0], query[rank][0] + query[rank][1]))
        assert resolved.local_head_counts["model.layers.0.self_attn"] == {
            "num_key_value_groups": query[rank][1] // kv[rank][1]}


def test_degree_larger_than_the_query_heads_is_refused():
    model = _qwen3(heads=4, kv_heads=2)
    with pytest.raises(PlanError, match=r"tp_degree=8 is larger than the attention head count num_attention_heads=4 "
                                        r"of Qwen3ForCausalLM: tensor parallelism splits whole heads.*valid tp "
                                        r"degrees: 1 to 4"):
        resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), 0, 8)


def test_t5_relative_bias_splits_by_heads():
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False)
    model = _meta(transformers.T5EncoderModel, config)
    resolved = resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), 1, 2)
    spec = resolved.spec_for("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    assert spec.dim == 1 and spec.pieces == ((2, 2),)  # (buckets, heads): rank 1 holds heads 2 and 3
    assert resolved.local_head_counts["encoder.block.1.layer.0.SelfAttention"] == {"n_heads": 2, "inner_dim": 16}
    # 4 heads at tp3: 2 + 1 + 1 whole heads, the relative-position table's columns with them
    for rank, (first, count) in enumerate([(0, 2), (2, 1), (3, 1)]):
        resolved = resolve_plan(model, as_plan(builtin_plan(model, model.config, "tensor")), rank, 3)
        spec = resolved.spec_for("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        assert spec.pieces == ((first, count),)
        assert resolved.spec_for("encoder.block.0.layer.0.SelfAttention.q.weight").pieces == ((first * 8, count * 8),)
        assert resolved.local_head_counts["encoder.block.1.layer.0.SelfAttention"] == {"n_heads": count,
                                                                                        "inner_dim": count * 8}
