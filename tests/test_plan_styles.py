"""Styles for per-head parameters and norms over grouped K heads: which slice each rank holds, and the errors a
wrong plan gets before anything is read (single process: resolution needs no torch.distributed)."""

from __future__ import annotations

import pytest

from paradiff import HeadNorm, PlanError, SplitParameter, TensorParallelPlan
from paradiff.plan_tools import family_examples as examples
from paradiff.tensor_parallel.plan import resolve_plan
from paradiff.tensor_parallel.styles import ShardSpec


@pytest.fixture(scope="module")
def lumina_next():
    return examples.build_example("lumina_next", "lumina-next")  # 4 query heads of 16, 2 K/V heads


def test_split_parameter_gives_each_rank_its_heads(lumina_next):
    plan = TensorParallelPlan(styles={"layers.*.gate": SplitParameter(0)})
    for rank in range(2):
        resolved = resolve_plan(lumina_next, plan, rank, 2)
        assert resolved.spec_for("layers.1.gate") == ShardSpec(dim=0, pieces=((2 * rank, 2),))
        assert resolved.spec_for("layers.1.attn1.to_q.weight") is None


def test_split_parameter_errors(lumina_next):
    with pytest.raises(PlanError, match=r"has no parameter 'gates'; its own parameters are \['gate'\]"):
        resolve_plan(lumina_next, TensorParallelPlan(styles={"layers.*.gates": SplitParameter(0)}), 0, 2)
    with pytest.raises(PlanError, match=r"a block of size 4 .* cannot give each of tp_degree=5 ranks a part"):
        SplitParameter(0).shard_spec("gate", (4,), 4, 5, None, "layers.0.gate")


def test_split_parameter_follows_an_uneven_head_split(lumina_next):
    """4 query heads over 2 K/V heads at tp3: ranks 0-1 share K/V head 0 and take one of its query heads each,
    rank 2 holds K/V head 1 with both of its; the gate's entries go with the query heads the rank holds."""
    plan = TensorParallelPlan(styles={"layers.*.gate": SplitParameter(0), "layers.*.attn1.to_q": "colwise"})
    for rank, (first, count) in enumerate([(0, 1), (1, 1), (2, 2)]):
        resolved = resolve_plan(lumina_next, plan, rank, 3)
        assert resolved.spec_for("layers.1.gate") == ShardSpec(dim=0, pieces=((first, count),))
        (start, rows), = resolved.spec_for("layers.1.attn1.to_q.weight").pieces
        assert (start, rows) == (first * rows // count, rows)


def test_head_norm_over_grouped_heads_follows_the_kv_heads(lumina_next):
    """tp=4, 2 K heads of 16: ranks 0-1 hold head 0, ranks 2-3 head 1 (as ColwiseHeads gives their K/V); tp=2 one
    head each."""
    plan = TensorParallelPlan(styles={"layers.*.attn1.norm_k": HeadNorm(head_dim=16)})
    held = [resolve_plan(lumina_next, plan, rank, 4).spec_for("layers.0.attn1.norm_k.weight").pieces
            for rank in range(4)]
    assert held == [((0, 16),), ((0, 16),), ((16, 16),), ((16, 16),)]
    assert resolve_plan(lumina_next, plan, 1, 2).spec_for("layers.0.attn1.norm_k.bias").pieces == ((16, 16),)


@pytest.fixture(scope="module")
def nucleus_moe():
    return examples.build_example("nucleusmoe", "nucleus-moe")  # block 1: 4 experts, 32 features each


def test_expert_banks_split_every_expert_like_a_dense_swiglu(nucleus_moe):
    """gate_up_proj (experts, in, [gate 32 | up 32]) keeps each half's slice; down_proj (experts, 32, out) the rows
    those features feed; both parameters of one module are planned, the bank's output all-reduced."""
    plan = examples.family_module("nucleusmoe").tensor_parallel_plan(nucleus_moe.config)
    for rank in range(2):
        resolved = resolve_plan(nucleus_moe, plan, rank, 2)
        bank = "transformer_blocks.1.img_mlp.experts"
        assert resolved.spec_for(f"{bank}.gate_up_proj") == ShardSpec(dim=2, pieces=((16 * rank, 16),
                                                                                       (32 + 16 * rank, 16)))
        assert resolved.spec_for(f"{bank}.down_proj") == ShardSpec(dim=1, pieces=((16 * rank, 16),))
        assert resolved.spec_for("transformer_blocks.1.img_mlp.gate.weight") is None  # the router stays whole
        assert resolved.reduce_outputs == [bank]
    # at tp3 each half splits 11 + 11 + 10 features
    pieces = [SplitParameter(2, blocks=(1, 1)).shard_spec("gate_up_proj", (4, 64, 64), rank, 3, None, "bank").pieces
              for rank in range(3)]
    assert pieces == [((0, 11), (32, 11)), ((11, 11), (43, 11)), ((22, 10), (54, 10))]
    with pytest.raises(PlanError, match=r"reduce_outputs entry 'transformer_blocks.\*.moe' names "
                                        r"'transformer_blocks.0.moe', which is not a submodule"):
        resolve_plan(nucleus_moe, TensorParallelPlan(styles={}, reduce_outputs=("transformer_blocks.*.moe",)), 0, 2)
