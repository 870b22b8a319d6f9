"""Tensor-parallel plan mechanisms that video families need, checked in one process (the families' multi-process
equivalence tests exercise them end to end)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paradiff.errors import PlanError
from paradiff.tensor_parallel.plan import TensorParallelPlan, localise_heads, resolve_plan
from paradiff.tensor_parallel.shard import _local_heads_of_outputs


class HandWrittenAttention(nn.Module):
    """Attention without a diffusers processor, reshaping by its own `heads` (like ConsisID's perceiver)."""

    def __init__(self, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(16, heads * head_dim)
        self.to_out = nn.Linear(heads * head_dim, 16)


class Model(nn.Module):
    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([HandWrittenAttention(heads) for _ in range(2)])
        self.rope = nn.Identity()


def test_head_modules_shrink_the_head_count_of_attention_without_a_processor():
    model = Model()
    plan = TensorParallelPlan(styles={"blocks.*.to_q": "colwise", "blocks.*.to_out": "rowwise"},
                              head_modules=("blocks.*",))
    resolved = resolve_plan(model, plan, rank=1, size=2)
    assert resolved.attention_modules == ["blocks.0", "blocks.1"]
    localise_heads(model, resolved)
    assert [block.heads for block in model.blocks] == [2, 2]


@pytest.mark.parametrize("rank,heads,rows", [(0, 2, (0, 16)), (1, 1, (16, 8))])
def test_head_modules_split_a_head_count_the_degree_does_not_divide_into_whole_heads(rank, heads, rows):
    """3 heads of 8 at tp2: rank 0 holds heads 0-1, rank 1 head 2; the projections follow the heads."""
    model = Model(heads=3)
    plan = TensorParallelPlan(styles={"blocks.*.to_q": "colwise", "blocks.*.to_out": "rowwise"},
                              head_modules=("blocks.*",))
    resolved = resolve_plan(model, plan, rank=rank, size=2)
    assert resolved.spec_for("blocks.0.to_q.weight").pieces == (rows,)
    assert resolved.spec_for("blocks.1.to_out.weight").pieces == (rows,)
    localise_heads(model, resolved)
    assert [block.heads for block in model.blocks] == [heads, heads]


def test_head_modules_refuse_more_ranks_than_heads():
    plan = TensorParallelPlan(styles={"blocks.*.to_q": "colwise"}, head_modules=("blocks.*",))
    with pytest.raises(PlanError, match=r"blocks.0: tp_degree=4 is larger than the 3 attention heads"):
        resolve_plan(Model(heads=3), plan, rank=0, size=4)


def test_head_outputs_keep_the_rank_s_contiguous_block_of_heads():
    plan = TensorParallelPlan(styles={"blocks.*.to_q": "colwise"}, head_outputs={"rope": {0: 1, 1: 1}})
    resolved = resolve_plan(Model(), plan, rank=1, size=2)
    assert resolved.head_outputs == {"rope": {0: 1, 1: 1}}
    cos, sin = torch.arange(5 * 4 * 3).view(5, 4, 3), torch.arange(5 * 4 * 3).view(5, 4, 3) + 1
    hook = _local_heads_of_outputs(resolved.head_outputs["rope"], rank=1, size=2, heads=None, name="rope")
    local = hook(None, (), (cos, sin))
    assert isinstance(local, tuple) and torch.equal(local[0], cos[:, 2:]) and torch.equal(local[1], sin[:, 2:])


@pytest.mark.parametrize("rank,kept", [(0, slice(0, 2)), (1, slice(2, 3))])
def test_head_outputs_follow_an_uneven_head_split(rank, kept):
    """A per-head table (5 positions x 3 heads x 4) at tp2: the rank's heads, as its attention holds them."""
    from paradiff.tensor_parallel.heads import HeadSplit

    heads = HeadSplit.of(3, 3, 2)
    hook = _local_heads_of_outputs({0: 1}, rank=rank, size=2, heads=heads, name="rope")
    table = torch.arange(5 * 3 * 4).view(5, 3, 4)
    assert torch.equal(hook(None, (), table), table[:, kept])


def test_head_outputs_name_a_missing_module():
    plan = TensorParallelPlan(styles={}, head_outputs={"rotary": {0: 1}})
    with pytest.raises(PlanError, match="'rotary'.*children"):
        resolve_plan(Model(), plan, rank=0, size=2)


def test_gather_heads_are_resolved_per_module():
    plan = TensorParallelPlan(styles={"blocks.*.to_q": "colwise"}, gather_heads={"blocks.*": {1: -1}})
    resolved = resolve_plan(Model(), plan, rank=0, size=2)
    assert resolved.gather_heads == {"blocks.0": {1: -1}, "blocks.1": {1: -1}}


class ConvFeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({
            "inverted": nn.Conv2d(8, 32, 1), "depth": nn.Conv2d(32, 32, 3, padding=1, groups=32),
            "grouped": nn.Conv2d(32, 32, 3, padding=1, groups=4), "point": nn.Conv2d(16, 8, 1)})])


def test_convolutions_split_over_channels_and_depthwise_ones_keep_a_group_per_channel():
    model = ConvFeedForward()
    plan = TensorParallelPlan(styles={"blocks.*.inverted": "colwise", "blocks.*.depth": "colwise",
                                      "blocks.*.point": "rowwise"})
    resolved = resolve_plan(model, plan, rank=1, size=2)
    assert resolved.linears["blocks.0.depth"].specs["weight"].pieces == ((16, 16),)
    assert resolved.linears["blocks.0.point"].specs["weight"].dim == 1


def test_grouped_convolutions_that_are_not_depthwise_are_refused():
    for style in ("colwise", "rowwise"):
        with pytest.raises(PlanError, match="groups=4"):
            resolve_plan(ConvFeedForward(), TensorParallelPlan(styles={"blocks.*.grouped": style}), rank=0, size=2)


class TakesTables(nn.Module):
    def forward(self, hidden_states, tables=None, scale=None):
        return hidden_states, tables, scale


def test_head_inputs_keep_the_rank_s_block_of_heads_of_positional_and_keyword_arguments():
    from paradiff.tensor_parallel.shard import _local_heads_of_inputs

    plan = TensorParallelPlan(styles={}, head_inputs={"": {"tables": {0: -1, 1: -1}, "scale": {0: 1}}})
    resolved = resolve_plan(TakesTables(), plan, rank=1, size=2)
    module = TakesTables()
    module.register_forward_pre_hook(_local_heads_of_inputs(module, resolved.head_inputs[""], 1, 2,
                                                            resolved.head_splits[""], ""), with_kwargs=True)
    cos, sin, scale = torch.arange(24.0).view(2, 3, 4), -torch.arange(24.0).view(2, 3, 4), torch.ones(2, 4)
    _, tables, local_scale = module(torch.zeros(1), (cos, sin), scale=scale)
    assert torch.equal(tables[0], cos[..., 2:]) and torch.equal(tables[1], sin[..., 2:])
    assert local_scale.shape == (2, 2)
    # a dict's items by key (AnyFlow FAR's KV cache): views of the rank's heads, so writes reach the caller's tensor
    plan = TensorParallelPlan(styles={}, head_inputs={"": {"tables": {"full": 1}}})
    resolved = resolve_plan(TakesTables(), plan, rank=1, size=2)
    module = TakesTables()
    module.register_forward_pre_hook(_local_heads_of_inputs(module, resolved.head_inputs[""], 1, 2,
                                                            resolved.head_splits[""], ""), with_kwargs=True)
    cache = {"full": torch.zeros(2, 4, 3), "steps": 5}
    _, local, _ = module(torch.zeros(1), tables=cache)
    local["full"].fill_(1.0)
    assert local["steps"] == 5 and local["full"].shape == (2, 2, 3)
    assert cache["full"][:, 2:].eq(1).all() and cache["full"][:, :2].eq(0).all()
    with pytest.raises(PlanError, match=r"names arguments \['rope'\] of TakesTables, whose forward takes"):
        resolve_plan(TakesTables(), TensorParallelPlan(styles={}, head_inputs={"": {"rope": {0: 1}}}), rank=0, size=2)


def test_forwards_are_resolved_per_module_and_must_be_functions():
    def factory(module, runtime):
        return lambda x: module.to_out(module.to_q(x))

    plan = TensorParallelPlan(styles={"blocks.*.to_q": "colwise"}, head_modules=("blocks.*",),
                              forwards={"blocks.*": factory})
    assert resolve_plan(Model(), plan, rank=0, size=2).forwards == {"blocks.0": factory, "blocks.1": factory}
    with pytest.raises(PlanError, match="forwards entry 'blocks.\\*' must be a function"):
        resolve_plan(Model(), TensorParallelPlan(styles={}, forwards={"blocks.*": 3}), rank=0, size=2)
    with pytest.raises(PlanError, match="forwards entry 'missing' names 'missing'"):
        resolve_plan(Model(), TensorParallelPlan(styles={}, forwards={"missing": factory}), rank=0, size=2)


def test_sharded_convolutions_report_the_output_channels_they_compute():
    from paradiff.tensor_parallel.layers import ShardedConv
    from paradiff.tensor_parallel.styles import resolve_style

    source = nn.Conv2d(8, 6, kernel_size=(3, 1), padding=(1, 0))
    for style, local in (("colwise", source.weight[:3]), ("rowwise", source.weight[:, :4])):
        spec = resolve_style(style, "conv").shard_spec("weight", tuple(source.weight.shape), 0, 2, None, "conv")
        conv = ShardedConv(source, local.detach(), None, resolve_style(style, "conv"), spec, tuple(source.weight.shape),
                           None)
        assert (conv.out_channels, conv.kernel_size) == (local.shape[0], (3, 1))
