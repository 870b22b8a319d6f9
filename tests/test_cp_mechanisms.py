"""Context-parallel plan mechanisms that video families need, checked in one process against the arithmetic they
promise (the families' multi-process equivalence tests exercise them end to end)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rank_cases_cp_mechanisms as cases
from paradiff.context_parallel.apply import _local_count, _split
from paradiff.context_parallel.plan import Count, Split


def rank_of(rank: int, size: int):
    return SimpleNamespace(cp_rank=rank, cp_size=size)


def test_split_reaches_every_tensor_inside_tuples_lists_and_dicts():
    table = torch.arange(2 * 7 * 3).view(2, 7, 3)
    value = {"query": table, "key": (table, [table, "not a tensor"])}
    for rank, rows in ((0, slice(0, 4)), (1, slice(4, 7))):
        out = _split(value, Split(1), rank_of(rank, 2), "rotary_emb")
        assert torch.equal(out["query"], table[:, rows])
        assert isinstance(out["key"], tuple) and torch.equal(out["key"][0], table[:, rows])
        assert isinstance(out["key"][1], list) and torch.equal(out["key"][1][0], table[:, rows])
        assert out["key"][1][1] == "not a tensor"


def test_split_with_ndim_leaves_other_ranks_whole_inside_containers():
    per_sample, per_token = torch.ones(2, 5), torch.ones(2, 6, 5, 4)
    out = _split((per_sample, per_token), Split(2, ndim=4), rank_of(1, 2), "temb")
    assert out[0] is per_sample and out[1].shape == (2, 6, 2, 4)
    # several ranks: LTX's timestep, per sample (batch,), per token (batch, tokens) or (batch, tokens, 1)
    timesteps = torch.ones(2), torch.arange(14.0).view(2, 7), torch.arange(14.0).view(2, 7, 1)
    out = _split(timesteps, Split(1, ndim=(2, 3)), rank_of(1, 2), "timestep")
    assert out[0] is timesteps[0]
    assert torch.equal(out[1], timesteps[1][:, 4:]) and torch.equal(out[2], timesteps[2][:, 4:])


def test_split_names_items_of_a_tuple_argument():
    # Allegro's rotary argument: ((tables looked up by position), (t, h, w positions of every token))
    tables, positions = (torch.ones(3, 8), torch.ones(4, 8)), (torch.arange(7)[None], torch.arange(7)[None] * 2)
    out = _split((tables, positions), {1: Split(-1)}, rank_of(1, 2), "image_rotary_emb")
    assert out[0] is tables
    assert torch.equal(out[1][0], torch.arange(4, 7)[None]) and torch.equal(out[1][1], torch.arange(4, 7)[None] * 2)


def test_local_attention_applies_any_mask_that_broadcasts_over_the_queries():
    from torch.nn import functional as F

    from paradiff.context_parallel.runtime import ContextParallelRuntime

    runtime = ContextParallelRuntime(mode="ring", cp_group=None, ring_group=None, ulysses_group=None)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=generator) for n in (5, 7, 7))
    mask = torch.zeros(2, 4, 1, 7)
    mask[1, :, :, 4:] = -10000.0  # diffusers' additive text mask, repeated per head
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(runtime.attention(q, k, v, attn_mask=mask, local=True), expected, atol=1e-6)


def test_split_within_cuts_each_sample_s_rows_alike():
    # Latte's temporal timesteps: (batch x 5 locations) rows; rank 1 of 2 keeps locations 3, 4 of every sample
    runtime = SimpleNamespace(cp_rank=1, cp_size=2, full_tokens={"hidden_states": 5})
    rows = torch.arange(2 * 5)[:, None].float()
    out = _split(rows, Split(0, within="hidden_states"), runtime, "timestep")
    assert out.flatten().tolist() == [3, 4, 8, 9]


def test_split_within_names_the_stream_it_needs():
    runtime = SimpleNamespace(cp_rank=0, cp_size=2, full_tokens={})
    try:
        _split(torch.ones(10, 3), Split(0, within="hidden_states"), runtime, "timestep")
    except ValueError as exc:
        assert "hidden_states" in str(exc) and "timestep" in str(exc)
    else:
        raise AssertionError("an unknown stream length must be refused")


@pytest.mark.parametrize("tail,expected", [(False, [4, 0, 0]), (True, [0, 1, 3])])
def test_counts_become_the_share_of_the_counted_tokens_each_rank_holds(tail, expected):
    # 10 tokens over 3 ranks: [0, 4), [4, 7), [7, 10); count the first or the last 4
    shares = [_local_count(Count("hidden_states", tail=tail), 4,
                           SimpleNamespace(cp_rank=rank, cp_size=3, full_tokens={"hidden_states": 10}), "n")
              for rank in range(3)]
    assert shares == expected


def test_a_count_larger_than_its_stream_is_refused():
    runtime = SimpleNamespace(cp_rank=0, cp_size=2, full_tokens={"hidden_states": 10})
    with pytest.raises(ValueError, match="an int from 0 to 10"):
        _local_count(Count(), 11, runtime, "num_tokens")


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_padding_masks_of_queries_and_keys_match_single_process(pools, mode):
    assert max(pools.get(2).run(cases.padding_mask_attention, mode=mode)) < 1e-6


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_other_square_masks_are_refused_on_every_rank(pools, mode):
    for message in pools.get(2).run(cases.causal_mask_is_refused, mode=mode):
        assert "only when they mask padding" in message and "mask is another kind" in message


def test_local_attention_takes_a_mask_per_head_and_query(pools):
    assert max(pools.get(2).run(cases.local_attention_with_any_mask, mode="ulysses")) < 1e-6


def test_grid_layout_splits_whole_rows_and_refuses_fewer_rows_than_ranks():
    from paradiff.context_parallel.grid import grid_layout, split_grid
    from paradiff.context_parallel.plan import GridSplit

    full, chunks, local = grid_layout([5, 3], rank_of(1, 2), "hidden_states")
    assert (full, chunks, local) == (15, [9, 6], 2)
    tokens = torch.arange(15)[None]
    assert split_grid(tokens, GridSplit(1), (full, chunks), 1).tolist() == [list(range(9, 15))]
    per_sample = torch.ones(2, 1, 8)
    assert split_grid(per_sample, GridSplit(1), (full, chunks), 1) is per_sample  # not per token: whole
    try:
        grid_layout([3, 5], rank_of(0, 4), "hidden_states")
    except ValueError as exc:
        assert "3 slices" in str(exc) and "4 context-parallel ranks" in str(exc)
    else:
        raise AssertionError("fewer rows than ranks must be refused")


def test_halo_convolutions_must_keep_the_split_axis_size():
    import pytest
    from torch import nn

    from paradiff.context_parallel.grid import check_halo_conv
    from paradiff.errors import PlanError

    assert check_halo_conv(nn.Conv2d(4, 4, (3, 1), padding=(1, 0)), "conv_temp") == 1
    with pytest.raises(PlanError, match="stride 1"):
        check_halo_conv(nn.Conv2d(4, 4, 3, stride=2, padding=1), "down")
    with pytest.raises(PlanError, match="not a convolution|Linear"):
        check_halo_conv(nn.Linear(4, 4), "proj")


def test_linear_attention_sums_over_the_ranks(pools):
    import rank_cases_grid as cases

    for rotary in (False, True):
        for result in pools.get(2).run(cases.linear_attention, rotary=rotary):
            assert result["diff"] <= 1e-5, (rotary, result)
            assert result["calls"] == {"all_reduce_cp_sums": 1}, result


def test_halo_convolution_borrows_only_the_neighbours_edge_rows(pools):
    import rank_cases_grid as cases

    for kernel, rows in (((3, 3), 5), ((3, 1), 3), ((5, 1), 7)):
        results = pools.get(2).run(cases.halo_convolution, kernel=kernel, rows=rows)
        assert [r["rows"] for r in results] == [(rows + 1) // 2, rows // 2]
        for result in results:
            assert result["diff"] <= 1e-6, (kernel, rows, result)
            assert result["calls"] == {"halo_exchange": 1}, result


@pytest.mark.parametrize("world,mode", [(2, "ring"), (2, "ulysses"), (4, "ulysses")])
def test_cross_attention_between_two_split_sequences(pools, world, mode):
    assert max(pools.get(world).run(cases.cross_attention_between_split_sequences, mode=mode)) < 1e-6


class _PerFrameAdapter(torch.nn.Module):
    """Each token gets its own frame's row of `encoder_hidden_states` (WanAnimate's face adapter pattern)."""

    def forward(self, hidden_states, encoder_hidden_states):
        frames = encoder_hidden_states.shape[1]
        grouped = hidden_states.unflatten(1, (frames, -1))
        return (grouped * encoder_hidden_states.mean(2, keepdim=True)).flatten(1, 2)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_token_groups_pad_each_chunk_to_whole_groups_and_keep_its_own_tokens(size):
    from paradiff.context_parallel.attention import local_chunk
    from paradiff.context_parallel.groups import token_group_hooks
    from paradiff.context_parallel.plan import TokenGroups

    generator = torch.Generator().manual_seed(0)
    video, faces = torch.randn(2, 3 * 5, 4, generator=generator), torch.randn(2, 3, 2, 4, generator=generator)
    expected = _PerFrameAdapter()(video, faces)
    for rank in range(size):
        module = _PerFrameAdapter()
        runtime = SimpleNamespace(cp_rank=rank, cp_size=size, full_tokens={"hidden_states": 15})
        widen, trim = token_group_hooks(module, TokenGroups(), runtime, "face_adapter.0")
        module.register_forward_pre_hook(widen, with_kwargs=True)
        module.register_forward_hook(trim)
        assert torch.equal(module(local_chunk(video, 1, rank, size), faces), local_chunk(expected, 1, rank, size))


def test_token_groups_that_do_not_divide_the_stream_are_refused():
    from paradiff.context_parallel.groups import token_group_hooks
    from paradiff.context_parallel.plan import TokenGroups

    module = _PerFrameAdapter()
    runtime = SimpleNamespace(cp_rank=0, cp_size=2, full_tokens={"hidden_states": 16})
    widen, _ = token_group_hooks(module, TokenGroups(), runtime, "face_adapter.0")
    with pytest.raises(ValueError, match="its 3 groups .* must divide the 16 tokens"):
        widen(module, (torch.ones(2, 8, 4), torch.ones(2, 3, 2, 4)), {})


def test_gathered_cross_attention_sees_every_rank_s_keys(pools):
    import rank_cases_grid as cases

    for text in (5, 1):  # with one key, rank 1 holds none
        results = pools.get(2).run(cases.gathered_cross_attention, text=text)
        assert [r["keys"] for r in results] == [(text + 1) // 2, text // 2]
        assert all(r["diff"] <= 1e-6 for r in results), (text, results)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_replicated_key_prefix_is_attended_once(pools, mode):
    import rank_cases_grid as cases

    for result in pools.get(2).run(cases.prefix_attention, mode=mode):
        assert result["diff"] <= 1e-6 and result["causal"] <= 1e-6, result


def test_rewrite_inputs_replace_positional_and_keyword_arguments_and_refuse_unknown_names():
    from torch import nn

    from paradiff.context_parallel.apply import _input_rewriter
    from paradiff.errors import PlanError

    class Block(nn.Module):
        def forward(self, hidden_states, segments=None, attention_mask=None):
            return hidden_states, segments, attention_mask

    block = Block()
    seen = []
    handle = block.register_forward_pre_hook(_input_rewriter(block, lambda given: seen.append(dict(given)) or {
        "segments": None, "attention_mask": given["hidden_states"] > 0}, "block"), with_kwargs=True)
    x = torch.tensor([-1.0, 2.0])
    _, segments, mask = block(x, [(0, 1, True)])
    assert segments is None and torch.equal(mask, torch.tensor([False, True]))
    assert seen[0]["segments"] == [(0, 1, True)] and seen[0]["hidden_states"] is x
    handle.remove()
    block.register_forward_pre_hook(_input_rewriter(block, lambda given: {"mask": None}, "block"), with_kwargs=True)
    with pytest.raises(PlanError, match=r"returned argument 'mask'; its forward takes \['hidden_states', 'segments'"):
        block(x)


def test_rewrite_inputs_must_be_functions():
    from paradiff import ContextParallelPlan
    from paradiff.plan_tools import family_examples as examples
    from paradiff.context_parallel.apply import resolve_cp_plan
    from paradiff.errors import PlanError

    model = examples.build_example("qwenimage21", "qwen-image-2.1")
    with pytest.raises(PlanError, match="rewrite_inputs for transformer_blocks.0 must be a function .* got dict"):
        resolve_cp_plan(model, ContextParallelPlan(rewrite_inputs={"transformer_blocks.*": {}}))


def test_qwen_image_21_block_causal_mask_equals_its_per_segment_attention():
    # one process: the whole-sequence mask the CP plan substitutes gives the processor's per-segment result
    from paradiff.plan_tools import family_examples as examples
    from paradiff.plans.qwenimage21 import block_causal_mask

    model = examples.build_example("qwenimage21", "qwen-image-2.1")
    inputs = examples.example_inputs("qwenimage21", "qwen-image-2.1", model.config)
    expected = model(**inputs)[0]
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda _m, args, kwargs: (args, {**kwargs, **block_causal_mask(kwargs)}),
                                        with_kwargs=True)
    actual = model(**inputs)[0]
    assert (actual - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_nabla_block_choice_is_diffusers_and_attends_only_the_chosen_blocks():
    # one process. Eager flex attention on CPU ignores a BlockMask's full blocks (it attends every key), so diffusers'
    # processor cannot be the reference here; its block choice is compared instead, and the attention against flex
    # attention told the same blocks by a mask function, which eager flex does apply.
    from diffusers.models.transformers.transformer_kandinsky6_sr import nabla_block_mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from paradiff.context_parallel.nabla import BLOCK, block_mask, block_means

    generator = torch.Generator().manual_seed(0)
    q, v = (torch.randn(2, 3 * BLOCK, 4, 16, generator=generator) for _ in range(2))
    k = torch.randn(2, 3 * BLOCK, 4, 16, generator=generator) + 0.5 * q
    prior = torch.eye(3, dtype=torch.bool)
    theirs = nabla_block_mask(q.transpose(1, 2), k.transpose(1, 2), prior, thr=0.5).to_dense().bool()
    ours = block_mask(block_means(q, 0, 3, None), block_means(k, 0, 3, None), prior, 0.5)
    assert torch.equal(ours, theirs) and not ours.all()
    tokens = ours.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    chosen = create_block_mask(lambda b, h, i, j: tokens[b, h, i, j], 2, 4, 3 * BLOCK, 3 * BLOCK, device="cpu",
                               BLOCK_SIZE=BLOCK)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with torch.no_grad():
        expected = flex_attention(q, k, v, block_mask=chosen)
    actual = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tokens)
    assert (actual - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (torch.nn.functional.scaled_dot_product_attention(q, k, v) - expected).abs().max() > 1e-2


def test_processors_must_name_attention_modules():
    from paradiff import ContextParallelPlan
    from paradiff.plan_tools import family_examples as examples
    from paradiff.context_parallel.apply import resolve_cp_plan
    from paradiff.context_parallel.nabla import NablaAttentionProcessor
    from paradiff.errors import PlanError

    model = examples.build_example("kandinsky6_sr", "kandinsky6-sr")
    with pytest.raises(PlanError, match="processors entry 'time_embeddings' must name an attention module"):
        resolve_cp_plan(model, ContextParallelPlan(processors={"time_embeddings": NablaAttentionProcessor}))


def test_expert_choice_names_a_layer_with_the_attributes_it_reads():
    from paradiff import ContextParallelPlan
    from paradiff.plan_tools import family_examples as examples
    from paradiff.context_parallel.apply import resolve_cp_plan
    from paradiff.context_parallel.experts import ExpertChoice
    from paradiff.errors import PlanError

    model = examples.build_example("nucleusmoe", "nucleus-moe")  # block 0 is dense, block 1 a mixture of experts
    resolve_cp_plan(model, ContextParallelPlan(expert_choice={"transformer_blocks.1.img_mlp": ExpertChoice()}))
    with pytest.raises(PlanError, match=r"'transformer_blocks.0.img_mlp' \(FeedForward\) as an expert-choice layer, "
                                        r"but it has no \['gate', 'experts', 'shared_expert'"):
        resolve_cp_plan(model, ContextParallelPlan(expert_choice={"transformer_blocks.0.img_mlp": ExpertChoice()}))


def test_a_nan_output_is_never_within_tolerance():
    from paradiff.plan_tools.family_examples import relative_difference

    expected = torch.ones(3)
    assert relative_difference([torch.tensor([1.0, float("nan"), 1.0])], [expected]) == float("inf")
    assert relative_difference([expected + 1e-7], [expected]) < 1e-6


def test_mask_function_processor_equals_diffusers_flex_attention():
    # one process: AnyFlow FAR's chunk-causal BlockMask as a dense mask on SDPA gives diffusers' flex result (eager
    # flex attention applies the mask function), and the mask does exclude keys
    from diffusers.models.transformers.transformer_anyflow_far import AnyFlowCausalAttnProcessor

    from paradiff.plan_tools import family_examples as examples
    from paradiff.context_parallel.flex import dense_mask

    model = examples.build_example("anyflow_far", "anyflow-far")
    inputs = examples.example_inputs("anyflow_far", "anyflow-far", model.config)
    ours = examples.forward(model, inputs)[0]
    for block in model.blocks:
        block.attn1.set_processor(AnyFlowCausalAttnProcessor())
    theirs = examples.forward(model, inputs)[0]
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max()
    mask = dense_mask(model.build_attention_mask(chunk_partition=[1, 1, 1], height=12, width=20), 135, "cpu")
    assert mask[0, 0, 0, :15].all() and not mask[0, 0, 0, 15:].any()  # the context frame sees only itself


def test_expert_choice_routed_per_chunk_would_differ_from_the_whole_sequence():
    # why the ranks must route together: each expert's top-capacity tokens of a chunk are not those of the sequence
    from paradiff.plan_tools import family_examples as examples

    layer = examples.build_example("nucleusmoe", "nucleus-moe").transformer_blocks[1].img_mlp
    generator = torch.Generator().manual_seed(0)
    hidden, unmodulated = (torch.randn(2, 15, 64, generator=generator) for _ in range(2))
    timestep = torch.randn(2, 64, generator=generator)
    with torch.no_grad():
        whole = layer(hidden, unmodulated, timestep)
        chunked = torch.cat([layer(hidden[:, part], unmodulated[:, part], timestep)
                             for part in (slice(0, 8), slice(8, 15))], dim=1)
    assert (chunked - whole).abs().max() > 1e-2 * whole.abs().max()


def test_qwen_image_21_flex_block_mask_is_refused_and_decode_masks_pass_unchanged():
    from paradiff.plans.qwenimage21 import block_causal_mask

    class BlockMask:  # stands for flex attention's BlockMask: not a tensor the CP attention can take
        pass

    with pytest.raises(ValueError, match="got a BlockMask .* Use model.set_attn_processor\\(QwenImage21AttnProcessor"):
        block_causal_mask({"segments": None, "attention_mask": BlockMask()})
    assert block_causal_mask({"segments": None, "attention_mask": torch.ones(2, 1, 1, 5, dtype=torch.bool)}) == {}


def test_gathered_returns_every_rank_s_uneven_piece_and_this_rank_s_start(pools):
    for result in pools.get(2).run(cases.gathered_pieces_and_model_outputs):
        assert result["equal"] and result["start"] == result["expected_start"], result
        assert result["model_output"] == "Transformer2DModelOutput" and result["sample_equal"], result


def test_forwards_replace_a_module_s_forward_and_must_be_functions():
    from paradiff import ContextParallelPlan
    from paradiff.plan_tools import family_examples as examples
    from paradiff.context_parallel.apply import resolve_cp_plan
    from paradiff.errors import PlanError

    model = examples.build_example("sana_wm", "sana-wm")
    resolved = resolve_cp_plan(model, ContextParallelPlan(forwards={"blocks.*.attn": lambda module, runtime: None}))
    assert sorted(resolved.forwards) == ["blocks.0.attn", "blocks.1.attn"]
    with pytest.raises(PlanError, match="forwards entry 'blocks.0.attn' must be a function of"):
        resolve_cp_plan(model, ContextParallelPlan(forwards={"blocks.*.attn": "not callable"}))


@pytest.mark.parametrize("world,steps", [(2, 5), (4, 6)])
def test_a_linear_recurrence_split_over_the_ranks_receives_the_single_process_state(pools, world, steps):
    results = pools.get(world).run(cases.split_linear_recurrence, steps=steps)
    assert sum(r["steps"] for r in results) == steps
    for result in results:
        assert result["diff"] <= 1e-12, result


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_ranks_called_with_inputs_of_different_shapes_all_raise(pools, mode):
    messages = pools.get(2).run(cases.ranks_given_different_lengths, mode=mode)
    assert all("called with inputs of different shapes" in message and "rank 1: " in message
               for message in messages), messages
