"""Context parallelism: every mode, even and uneven lengths, masks, odd head counts, against single-process runs."""

from __future__ import annotations

import pytest
import torch

import paradiff
import rank_cases_cp as cases
from paradiff.config import mode_world_size, parse_mode

ATOL = 1e-5
# (height, width, text): an even split at 2 and 4 ranks, and one that divides neither (15 image, 7 text tokens)
EVEN, UNEVEN = (4, 4, 8), (3, 5, 7)
MODES = {name: (mode_world_size(mode), parse_mode(mode)["ring"], parse_mode(mode)["ulysses"])  # id: (world, ring, ulysses)
         for name, mode in {"ring2": "ring2", "ring4": "ring4", "ulysses2": "ulysses2", "ulysses4": "ulysses4",
                            "unified2x2": "ring2xulysses2"}.items()}
EXPECTED_COMM = {"ring2": "ring_pass", "ring4": "ring_pass", "ulysses2": "all_to_all_ulysses",
                 "ulysses4": "all_to_all_ulysses", "unified2x2": "ring_pass"}


@pytest.mark.parametrize("family", ["flux", "flux2", "qwenimage", "wan"])
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_single_process(pools, family, mode):
    world, ring, ulysses = MODES[mode]
    results = pools.get(world).run(cases.cp_equivalence, family=family, ring=ring, ulysses=ulysses,
                                   shapes=[EVEN, UNEVEN])
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result
        assert result["calls"].get(EXPECTED_COMM[mode], 0) > 0, result  # the CP path really ran
        assert result["calls"].get("all_gather_seq", 0) > 0, result


@pytest.mark.parametrize("mode", ["ulysses2", "ulysses4", "unified2x2", "ring2"])
def test_head_count_not_divisible_by_ulysses(pools, mode):
    world, ring, ulysses = MODES[mode]
    results = pools.get(world).run(cases.cp_equivalence, family="flux2", ring=ring, ulysses=ulysses, heads=3,
                                   shapes=[UNEVEN])
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result


@pytest.mark.parametrize("family", ["qwenimage", "flux"])
def test_batch_of_two_with_mask(pools, family):
    results = pools.get(4).run(cases.cp_equivalence, family=family, ring=2, ulysses=2, batch=2, shapes=[UNEVEN, (3, 3, 5)])
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_other_backends(pools, backend):
    results = pools.get(2).run(cases.cp_equivalence, family="qwenimage", ring=1, ulysses=2, backend=backend,
                               shapes=[UNEVEN])
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result


def test_every_backend_here_matches_with_and_without_context_parallelism(pools):
    """One backend interface with or without CP: each backend this machine runs gives the single-process output
    routed on a plain model and at ulysses2 and ring2 (ring: those with an LSE), is one recorded patch either way,
    one that cannot run is refused by name before any collective, and one chosen before CP is carried over."""
    for result in pools.get(2).run(cases.cp_every_backend, family="flux2"):
        assert {"native", "math", "sdpa", "sdpa-flash", "flex"} <= set(result["without_cp"]), result
        assert max(result["without_cp"].values()) < ATOL, result
        # without CP: one patch routing the two attention modules' SDPA calls, removed to give the model back
        assert result["plain_listed"] == ["route_attention F.scaled_dot_product_attention: attention backend 'flex' "
                                          "in 2 attention modules (by attention)"], result
        assert set(result["calls_routed"].values()) == {2}, result  # each backend ran both attentions
        assert result["removed"] == 1 and result["unrouted"], result
        for mode in ("ulysses", "ring"):
            cp = result[mode]
            assert set(cp["diffs"]) == set(result["without_cp"]) - ({"sdpa"} if mode == "ring" else set()), result
            assert max(cp["diffs"].values()) < ATOL, result
            assert cp["listed"] == [f"set_attribute backend: attention backend 'flex' (in CP's {mode} attention) "
                                    "(by attention)"], result
            # not on this machine, or (with CUDA) not on the model's CPU: the same message as without CP
            assert "Attention backend 'sdpa-cudnn' " in cp["refused"] and "cuda" in cp["refused"].lower(), result
            assert "not available here" in cp["refused"] or "cannot run here" in cp["refused"], result
            assert "'native'" in cp["refused"] and cp["collectives_during_refusal"] == 0, result
        assert result["carried"]["backend"] == "math" and result["carried"]["diff"] < ATOL, result
        assert result["carried"]["listed"] == ["set_attribute backend: attention backend 'math' (in CP's ring "
                                               "attention) (by attention)"], result


def test_math_backend_in_ring(pools):
    results = pools.get(2).run(cases.cp_equivalence, family="flux", ring=2, ulysses=1, backend="math", shapes=[UNEVEN])
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result


def test_fewer_tokens_than_ranks_is_a_clear_error_on_every_rank(pools):
    messages = pools.get(4).run(cases.cp_too_short)
    for message in messages:
        assert "has 1 tokens" in message and "fewer than the 4 context-parallel ranks" in message, message


def test_errors_on_live_world(pools):
    messages = pools.get(4).run(cases.cp_errors)[0]
    assert "ring_degree=8" in messages["too_many_ranks"] and "world size is 4" in messages["too_many_ranks"]
    assert "ParallelConfigError" in messages["not_dividing"] and "divide the world size 4" in messages["not_dividing"]
    assert "'sdpa' returns no log-sum-exp" in messages["backend_without_lse"]
    assert "'native'" in messages["backend_without_lse"] and "'math'" in messages["backend_without_lse"]
    assert "Unknown attention backend 'cudnn-magic'" in messages["unknown_backend"]
    # without CP the same backends and checks apply (the model is not refused for lacking CP)
    assert "Attention backend 'sdpa-efficient' " in messages["not_cp"] and "cuda" in messages["not_cp"].lower()


def test_process_group_not_initialised():
    from paradiff.testing.models import build_model

    assert not torch.distributed.is_initialized()
    with pytest.raises(paradiff.DistributedError, match="init_process_group"):
        paradiff.enable_parallelism(build_model("flux2"), paradiff.ContextParallelConfig(ulysses_degree=2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "ring_degree > 1 or ulysses_degree > 1"),
        ({"ring_degree": 0}, "ring_degree must be >= 1, got 0"),
        ({"ulysses_degree": -2}, "ulysses_degree must be >= 1, got -2"),
        ({"ring_degree": 2.0}, "ring_degree must be an int"),
    ],
)
def test_bad_degrees(kwargs, match):
    with pytest.raises(paradiff.ParallelConfigError, match=match):
        paradiff.ContextParallelConfig(**kwargs)


def test_anything_flags_are_accepted_and_inert():
    config = paradiff.ContextParallelConfig(ring_degree=2, ulysses_degree=2, ulysses_anything=True, ring_anything=True)
    assert config.mode == "unified" and config.degree == 4


@pytest.mark.parametrize("family", ["flux", "flux2", "qwenimage"])
@pytest.mark.parametrize("ring,ulysses", [(2, 1), (1, 2)], ids=["tp2xring2", "tp2xulysses2"])
def test_tensor_and_context_parallel_combined(pools, family, ring, ulysses):
    """diffusers refuses TP together with CP; here both split the same model on 4 ranks."""
    results = pools.get(4).run(cases.cp_equivalence, family=family, ring=ring, ulysses=ulysses, tp=2, shapes=[UNEVEN])
    for result in results:
        assert max(result["diffs"].values()) < ATOL, result


@pytest.mark.parametrize("world,ring,ulysses,tp", [(2, 2, 1, 1), (4, 1, 2, 2)], ids=["ring2", "tp2xulysses2"])
def test_from_pretrained_with_context_parallel_config(pools, checkpoints, world, ring, ulysses, tp):
    results = pools.get(world).run(cases.cp_from_pretrained, family="qwenimage",
                                   folder=str(checkpoints[("qwenimage", "sharded")]), ring=ring, ulysses=ulysses, tp=tp)
    for result in results:
        assert result["diff"] < ATOL, result


@pytest.mark.parametrize("mode", ["ring2", "ulysses2", "unified2x2", "ring4"])
def test_query_dependent_and_per_head_masks(pools, mode):
    """Masks that are not key-padding masks (OmniGen's causal text + bidirectional image, per-head biases) are exact
    in every CP mode; a query-dependent mask must reach the attention whole."""
    world, ring, ulysses = MODES[mode]
    for result in pools.get(world).run(cases.cp_general_masks, ring=ring, ulysses=ulysses):
        assert max(result["diffs"].values()) < ATOL, result
        assert result["calls"].get(EXPECTED_COMM[mode], 0) > 0, result
        assert "must cover the whole sequence of 11 tokens" in result["split_mask_error"], result


def test_plan_refuses_an_argument_the_split_cannot_honour(pools):
    for message in pools.get(2).run(cases.cp_refused_argument):
        assert "'cross_attention_kwargs.base_sequence_length' is not supported under context parallelism" in message
        assert "proportional_attn=False" in message and message.endswith("collectives: 0"), message


def test_split_by_parts_splits_each_stream_on_its_own():
    """A key mask over [image (15), text (7)] is split as joint attention holds its keys: this rank's image chunk,
    then its text chunk."""
    from types import SimpleNamespace

    from paradiff.context_parallel.apply import _split

    mask = torch.arange(22).view(1, 1, 1, 22)
    split = paradiff.Split(-1, parts=("hidden_states", "encoder_hidden_states"))
    runtime = SimpleNamespace(cp_rank=1, cp_size=2, full_tokens={"hidden_states": 15, "encoder_hidden_states": 7})
    assert _split(mask, split, runtime, "mask").flatten().tolist() == [8, 9, 10, 11, 12, 13, 14, 19, 20, 21]
    runtime = SimpleNamespace(cp_rank=0, cp_size=4, full_tokens={"hidden_states": 15, "encoder_hidden_states": 7})
    assert _split(mask, split, runtime, "mask").flatten().tolist() == [0, 1, 2, 3, 15, 16]
    with pytest.raises(ValueError, match=r"has 21 entries along dim 3, but its parts .* have \[15, 7\] tokens"):
        _split(mask[..., :21], split, runtime, "mask")
    with pytest.raises(paradiff.PlanError, match=r"splits no \['encoder_hidden_states'\] before it"):
        _split(mask, split, SimpleNamespace(cp_rank=0, cp_size=2, full_tokens={"hidden_states": 15}), "mask")


@pytest.mark.parametrize("mode,heads", [("ulysses2", 4), ("ulysses4", 3), ("unified2x2", 4), ("ring2", 4)])
def test_queries_and_keys_of_different_lengths(pools, mode, heads):
    """Image queries over [text, image] keys, both split: Ulysses exchanges queries and keys by their own lengths."""
    world, ring, ulysses = MODES[mode]
    for result in pools.get(world).run(cases.cp_queries_and_keys_of_different_lengths, ring=ring, ulysses=ulysses,
                                       heads=heads):
        assert result["diff"] < ATOL, result
        assert result["calls"].get(EXPECTED_COMM[mode], 0) > 0, result


@pytest.mark.parametrize("masked", [False, True])
def test_a_ring_pass_is_one_message_into_the_buffer_the_last_pass_sent(monkeypatch, masked):
    """Ring attention's loop in one process: a stand-in ring of 3 ranks whose neighbours hold this rank's block.
    Each pass sends one tensor (keys, values and the key mask packed), received into the other of two buffers, and
    on CPU is waited on before the attention (gloo's threads get the core); the merged result is attention over the
    keys three times over, which (softmax over copies) is attention over them once."""
    from paradiff.context_parallel import attention
    from paradiff.context_parallel.kernels import BACKENDS, math_attention

    events, buffers = [], []

    def ring_pass_start(tensors, group, stats=None, into=None):
        assert len(tensors) == 1 and into is not None and len(into) == 1
        buffers.append((tensors[0].data_ptr(), into[0].data_ptr()))
        into[0].copy_(tensors[0])
        events.append("pass")
        return into, ["work"]

    monkeypatch.setattr(attention.dist, "get_world_size", lambda group: 3)
    monkeypatch.setattr(attention.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(attention, "all_gather_int", lambda value, group, device: [value] * 3)
    monkeypatch.setattr(attention, "ring_pass_start", ring_pass_start)
    monkeypatch.setattr(attention, "ring_pass_wait", lambda works: events.append("wait"))
    kernel = BACKENDS["native"]
    monkeypatch.setattr(attention, "merge_lse", lambda *args, merge=attention.merge_lse: events.append("attend")
                        or merge(*args))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=generator).transpose(1, 2).contiguous().transpose(1, 2)
               for _ in range(3))
    mask = torch.tensor([True, True, False, True, True, True]).view(1, 1, 1, 6) if masked else None
    out = attention.ring_attention(q, k, v, mask, 0.35, kernel, group=None)
    expected, _ = math_attention(q, k, v, mask, 0.35)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert events == ["pass", "wait", "attend"] * 2 + ["attend"]
    (sent, received), (sent_next, received_next) = buffers
    assert (sent_next, received_next) == (received, sent)  # the buffer just sent receives the next block
    assert attention.overlaps_compute(torch.device("cuda", 0)) and not attention.overlaps_compute(q.device)
