"""The cost model's arithmetic (counted by hand for one small FLUX.1 block), `paradiff plan`'s feasibility rules and
its command, and calibration's collectives on two gloo ranks."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from paradiff.plan_tools import cost
from paradiff.plan_tools.cost import BlockShape, CostModelError, Mesh, Traffic, block_cost, model_shape
from paradiff.plan_tools.hardware import BUILT_IN, HardwareProfile, load_profile
from paradiff.plan_tools.hardware import Link as cost_link
from paradiff.plan_tools.planner import meshes, plan

# One FLUX.1 double-stream block: 2 heads x head dim 4 (d = 8), FFN 4 d = 32; 16 latent and 4 text tokens.
D, FFN, LATENT, TEXT = 8, 32, 16, 4
FLUX_BLOCK = BlockShape("joint", 1, heads=2, head_dim=4, ffn_dim=FFN, modulation=2 * 6 * D * D)
# Per stream: q, k, v, o (4 x 8x8 = 256 weights) and the FFN (8x32 + 32x8 = 512): 768.
STREAM_WEIGHTS = 4 * 8 * 8 + 8 * 32 + 32 * 8


def test_one_flux_block_flops_bytes_and_weights_counted_by_hand():
    one = block_cost(FLUX_BLOCK, LATENT, TEXT, dtype_bytes=2)
    assert STREAM_WEIGHTS == 768
    assert one.linear_flops == 2 * LATENT * 768 + 2 * TEXT * 768 == 30720
    assert one.attention_flops == 4 * (LATENT + TEXT) ** 2 * D == 12800  # QK^T and AV over 20 tokens
    # weights read once (2 x 768 x 2 bytes) + per token and stream: q k v in/out 8 + 24, o 8 + 8, FFN 8 + 32 and
    # 32 + 8 (128 elements) + attention's q, k, v, o (4 x 8) per token, at 2 bytes
    assert one.bytes == 2 * 768 * 2 + (20 * 128 + 4 * 20 * 8) * 2 == 9472
    assert FLUX_BLOCK.params == 2 * 768 + 768
    assert one.traffic == []
    # elementwise, per token: 22 d-wide passes on the whole stream, 44 on q / k / attention's layout, 2 ffn-wide
    # (GELU); tp2 halves the last two only
    assert one.elementwise_bytes == 20 * (22 * 8 + 44 * 8 + 2 * 32) * 2
    tp = block_cost(FLUX_BLOCK, LATENT, TEXT, 2, Mesh(tp=2))
    assert tp.elementwise_bytes == 20 * (22 * 8 + (44 * 8 + 64) / 2) * 2


def test_the_hand_count_is_diffusers_flux_block():
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    from torch.utils.flop_counter import FlopCounterMode

    block = FluxTransformerBlock(dim=D, num_attention_heads=2, attention_head_dim=4)
    linears = {name: module.weight.numel() for name, module in block.named_modules()
               if isinstance(module, torch.nn.Linear)}
    modulation = linears.pop("norm1.linear") + linears.pop("norm1_context.linear")
    assert (sum(linears.values()), modulation) == (2 * STREAM_WEIGHTS, FLUX_BLOCK.modulation)
    generator = torch.Generator().manual_seed(0)
    with FlopCounterMode(display=False) as counter:
        block(hidden_states=torch.randn(1, LATENT, D, generator=generator),
              encoder_hidden_states=torch.randn(1, TEXT, D, generator=generator),
              temb=torch.randn(1, D, generator=generator))
    # the modulation linears act once on the time embedding: 2 x 768 FLOPs, not per token
    assert counter.get_total_flops() == block_cost(FLUX_BLOCK, LATENT, TEXT).linear_flops + 2 * modulation


def test_one_flux_block_communication_per_mode_counted_by_hand():
    b = 2
    tp = block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(tp=2))
    # attention output and FFN output summed per stream: 2 x 16 x 8 x 2 bytes and 2 x 4 x 8 x 2 bytes; the two
    # modulation linears (norm1, norm1_context: 6 x 8 wide, split on their input) one vector each, 48 x 2 bytes
    assert tp.traffic == [Traffic("all_reduce", 2, 2, 256), Traffic("all_reduce", 2, 2, 64),
                          Traffic("all_reduce", 2, 2, 96)]
    assert tp.wire_bytes() == 2 * 256 + 2 * 64 + 2 * 96  # ring all-reduce on 2 ranks: 2 (g-1)/g = 1 x the tensor
    assert tp.linear_flops == 30720 / 2 and tp.attention_flops == 12800 / 2
    ulysses = block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(ulysses=2))
    # the two ranks' sequence lengths agreed (one int64 each, gathered), then q, k and v of this rank's 10 tokens x 8
    # features in one all-to-all (packed), the output in another, each half sent away
    lengths = Traffic("all_gather", 2, 1, 2 * 8)
    assert ulysses.traffic == [lengths, Traffic("all_to_all", 2, 1, 3 * 10 * 8 * 2),
                               Traffic("all_to_all", 2, 1, 10 * 8 * 2)]
    assert ulysses.wire_bytes() == 8 + 4 * 80
    ring = block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(ring=2))
    # k and v packed in one message, passed once, right after the lengths' agreement
    assert ring.traffic == [lengths, Traffic("p2p", 2, 1, 2 * 10 * 8 * 2, overlapped=True)]
    unified = block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(ring=2, ulysses=2))
    # 5 tokens x 8 features all-to-all'd; then k, v of 10 tokens x 4 features passed once
    assert unified.traffic == [Traffic("all_gather", 4, 1, 4 * 8), Traffic("all_to_all", 2, 1, 3 * 5 * 8 * 2),
                               Traffic("all_to_all", 2, 1, 5 * 8 * 2), Traffic("p2p", 2, 1, 2 * 10 * 4 * 2, True)]
    for mesh in (Mesh(cfg=2), Mesh(data=2)):
        assert block_cost(FLUX_BLOCK, LATENT, TEXT, b, mesh).traffic == []


def test_what_sequence_parallelism_pays_beside_its_traffic_counted_by_hand():
    from dataclasses import replace

    from paradiff.plan_tools.planner import predict

    b = 2
    # One FLUX block on 2 ranks: each holds 10 of the 20 tokens, so one of its q, k, v or output is 10 x 8 elements.
    # Ulysses packs q, k, v (read and written: 6 passes), concatenates what it receives (6), packs and concatenates
    # the output (2 + 2): 16 passes of 80 elements at 2 bytes
    assert block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(ulysses=2)).copy_bytes == 16 * 80 * 2 == 2560
    # ring stacks k and v (4 passes at 2 bytes) and merges the second block's output into its float32 accumulator
    # (2 + 3 passes at 4 bytes)
    assert block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(ring=2)).copy_bytes == 4 * 80 * 2 + 5 * 80 * 4 == 2240
    # tp2 beside ulysses2 halves the width: 10 tokens x 4 features; nothing without sequence ranks
    assert block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(ulysses=2, tp=2)).copy_bytes == 16 * 40 * 2
    for mesh in (Mesh(), Mesh(tp=2), Mesh(cfg=2)):
        assert block_cost(FLUX_BLOCK, LATENT, TEXT, b, mesh).copy_bytes == 0
    # timed at the profile's copy bandwidth (else the elementwise one), on the device's side of the forward
    profile = replace(BUILT_IN["h100-sxm"], op_overhead_s=0.0, copy_bandwidth=1e6)
    flux = model_shape(_tiny_flux_config(), text_tokens=TEXT)
    with_copies = predict(flux, LATENT, Mesh(ulysses=2), profile)
    without = predict(flux, LATENT, Mesh(ulysses=2), replace(profile, copy_bandwidth=float("inf")))
    assert with_copies.compute_s - without.compute_s == pytest.approx(with_copies.forward.copy_bytes / 1e6)
    # A Wan block's cross attention attends the rank's 8 queries to the whole text: every sequence rank projects all
    # 4 text tokens to cross keys and values (2 x 8 x 8 weights), and the routed backend adds its ops to the call
    wan = model_shape({"_class_name": "WanTransformer3DModel", "num_layers": 1, "num_attention_heads": 2,
                       "attention_head_dim": 4, "in_channels": 16, "out_channels": 16, "text_dim": 8,
                       "ffn_dim": FFN}, text_tokens=TEXT).blocks[0]
    latent_weights = 6 * D * D + 2 * D * FFN
    single, ulysses = block_cost(wan, LATENT, TEXT, b), block_cost(wan, LATENT, TEXT, b, Mesh(ulysses=2))
    assert single.linear_flops == 2 * LATENT * latent_weights + 2 * TEXT * 2 * D * D
    assert ulysses.linear_flops == 2 * (LATENT // 2) * latent_weights + 2 * TEXT * 2 * D * D
    assert ulysses.ops == wan.ops + cost.ULYSSES_OPS + cost.LOCAL_ATTENTION_OPS
    assert block_cost(FLUX_BLOCK, LATENT, TEXT, b, Mesh(ulysses=2)).ops == FLUX_BLOCK.ops + cost.ULYSSES_OPS
    # after the blocks, the ranks agree on their lengths and gather the final projection's output: 8 of the 16
    # latent tokens x 16 channels, 2 x 2 patched, on each rank
    whole = model_shape({"_class_name": "WanTransformer3DModel", "num_layers": 1, "num_attention_heads": 2,
                         "attention_head_dim": 4, "in_channels": 16, "out_channels": 16, "text_dim": 8,
                         "ffn_dim": FFN}, text_tokens=TEXT)
    assert cost.forward_cost(whole, LATENT, b, Mesh(ring=2)).traffic[-2:] == [
        Traffic("all_gather", 2, 1, 2 * 8), Traffic("all_gather", 2, 1, 8 * 16 * 4 * 2)]


@pytest.mark.parametrize("family", ["flux", "flux2", "qwenimage", "wan"])
def test_tp_all_reduces_counted_are_those_a_tp2_forward_makes(pools, family):
    """Every all-reduce of a tp2 forward, its bytes, as the cost model counts them: the blocks' outputs, QK norms
    and modulation linears, and the plans' rowwise layers outside the blocks (`ModelShape.tp_reduces`)."""
    import rank_cases_cost as cases
    from paradiff.testing.models import model_class, tiny_config

    made = pools.get(2).run(cases.tp_all_reduce_bytes, family=family)
    assert made[0] and made[0] == made[1]
    config = dict(tiny_config(family), _class_name=model_class(family).__name__)
    counted = cost.forward_cost(model_shape(config, text_tokens=5), 4 * 6, 4, Mesh(tp=2)).traffic
    assert sorted(made[0]) == sorted(int(item.size) for item in counted for _ in range(item.calls)
                                     if item.op == "all_reduce")


def test_qk_norms_over_all_heads_counted_by_hand():
    # A Wan block: self attention, cross attention to the text, FFN (d = 8, FFN 32). Its QK norms span all heads,
    # so under tp each sums a float32 per token over the ranks: self q and k and cross q on the 16 latent tokens,
    # cross k on the 4 text tokens
    wan = model_shape({"_class_name": "WanTransformer3DModel", "num_layers": 1, "num_attention_heads": 2,
                       "attention_head_dim": 4, "in_channels": 16, "out_channels": 16, "text_dim": 8,
                       "ffn_dim": FFN}, text_tokens=TEXT)
    block = wan.blocks[0]
    assert block.norm_reduces == (3, 1)
    tp = block_cost(block, LATENT, TEXT, 2, Mesh(tp=2))
    # the 3 rowwise outputs (self, cross, FFN: 16 tokens x 8 x 2 bytes), then the 4 statistics
    assert tp.traffic == [Traffic("all_reduce", 2, 3, 16 * 8 * 2), Traffic("all_reduce", 2, 3, 16 * 4),
                          Traffic("all_reduce", 2, 1, 4 * 4)]
    assert tp.ops == block.ops + 3 + 4  # one op per all-reduce call
    # with ulysses 2 beside it, the latent statistics are of this rank's 8 tokens; the text is whole on every rank
    assert block_cost(block, LATENT, TEXT, 2, Mesh(tp=2, ulysses=2)).traffic[1:3] == [
        Traffic("all_reduce", 2, 3, 8 * 4), Traffic("all_reduce", 2, 1, 4 * 4)]
    # FLUX's per-head norms need none (its 3 all-reduces: the two streams' outputs and the modulation linears)
    assert FLUX_BLOCK.norm_reduces == (0, 0) and len(block_cost(FLUX_BLOCK, LATENT, TEXT, 2, Mesh(tp=2)).traffic) == 3


def _top_level_ops(run) -> int:
    """The aten calls `run` makes that no other aten call makes (what `cost.OPS_PER_BLOCK` counts)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    calls = [event for event in prof.events() if event.name.startswith("aten::")]
    return sum(1 for event in calls if not (event.cpu_parent and event.cpu_parent.name.startswith("aten::")))


def test_ops_per_block_counted_by_hand_are_diffusers_eager_calls():
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from paradiff.plan_tools.calibrate import PROBE_BLOCK_OPS, _probe_block

    # FLUX.1's double block, per its forward: 14 linears (2 modulations, q k v o and the FFN's two per stream),
    # 4 layer norms, 4 RMS norms (q, k per stream), 1 SDPA, 2 GELU, 2 SiLU, 26 multiplies and adds (modulation,
    # gates, residuals, RoPE), RoPE's 2 negations and 2 stacks, 3 concatenations, 11 dtype casts, 40 view-like
    # calls (20 unsqueeze, 6 unflatten, 4 permute, 3 flatten, 2 reshape, 2 unbind, 2 chunk, 1 split) and 3 dropouts
    joint = 14 + 4 + 4 + 1 + 2 + 2 + 26 + 2 + 2 + 3 + 11 + 40 + 3
    shape = model_shape(_tiny_flux_config(), text_tokens=TEXT)
    assert (joint, shape.blocks[0].ops, shape.blocks[1].ops, shape.other_ops) == (114, 114, 68, 108)
    assert cost.forward_cost(shape, LATENT).ops == 114 + 68 + 108
    # every rank issues all of them; tp adds its all-reduce calls (4 and 2 for the modulation in a double block, 1
    # and 1 in a single one) and the embedders' (17 ops), Ulysses 65 per self attention and 32 to split and gather
    # the sequence
    assert cost.forward_cost(shape, LATENT, mesh=Mesh(tp=2, ulysses=2)).ops == \
        (114 + 4 + 2 + 65) + (68 + 1 + 1 + 65) + (108 + 17 + 32)
    assert cost.forward_cost(shape, LATENT, mesh=Mesh(ring=4)).ops == (114 + 3 * 44) + (68 + 3 * 44) + (108 + 32)
    generator = torch.Generator().manual_seed(0)
    x, text, temb = (torch.randn(*size, generator=generator) for size in ((1, LATENT, D), (1, TEXT, D), (1, D)))
    rope = (torch.randn(LATENT + TEXT, 4, generator=generator), torch.randn(LATENT + TEXT, 4, generator=generator))
    double = FluxTransformerBlock(dim=D, num_attention_heads=2, attention_head_dim=4).eval()
    single = FluxSingleTransformerBlock(dim=D, num_attention_heads=2, attention_head_dim=4).eval()
    assert _top_level_ops(lambda: double(hidden_states=x, encoder_hidden_states=text, temb=temb,
                                         image_rotary_emb=rope)) == 114
    assert _top_level_ops(lambda: single(hidden_states=x, encoder_hidden_states=text, temb=temb,
                                         image_rotary_emb=rope)) == 68
    wan = WanTransformerBlock(dim=D, ffn_dim=FFN, num_heads=2, cross_attn_norm=True,
                              qk_norm="rms_norm_across_heads").eval()
    wan_temb, wan_rope = torch.randn(1, 6, D), (torch.randn(1, LATENT, 1, 4), torch.randn(1, LATENT, 1, 4))
    assert _top_level_ops(lambda: wan(x, text, wan_temb, wan_rope)) == cost.OPS_PER_BLOCK["Wan"][0] == 106
    assert _top_level_ops(_probe_block("cpu")) == PROBE_BLOCK_OPS  # calibration's per-op probe, as counted


def test_op_overhead_adds_on_a_cpu_and_hides_behind_a_busy_gpu():
    from dataclasses import replace

    from paradiff.plan_tools.planner import predict

    shape = model_shape(_tiny_flux_config(), text_tokens=TEXT)
    ops = 114 + 68 + 108
    gpu = replace(BUILT_IN["h100-sxm"], op_overhead_s=1e-6)
    none = predict(shape, LATENT, Mesh(), replace(gpu, op_overhead_s=0.0))
    device = none.compute_s
    cpu_like = predict(shape, LATENT, Mesh(), replace(gpu, host_overlap=False))
    assert cpu_like.compute_s == pytest.approx(device + ops * 1e-6)  # the host is the device: they add
    issued_ahead = predict(shape, LATENT, Mesh(), gpu)
    assert issued_ahead.compute_s == pytest.approx(max(device, ops * 1e-6))  # the longer of the two
    # elementwise bytes at the elementwise bandwidth where the profile has one, else at the memory bandwidth
    faster = predict(shape, LATENT, Mesh(), replace(gpu, op_overhead_s=0.0,
                                                     elementwise_bandwidth=2 * gpu.memory_bandwidth))
    elementwise_s = none.forward.elementwise_bytes / gpu.memory_bandwidth
    assert faster.compute_s == pytest.approx(device - elementwise_s / 2)
    assert BUILT_IN["h100-sxm"].op_overhead_s == 5e-6 and BUILT_IN["h100-sxm"].host_overlap
    # the block factor (a calibrated reference block over its prediction) scales the compute, not the collectives;
    # built-in profiles have none
    calibrated_cpu = replace(gpu, host_overlap=False)
    slower = predict(shape, LATENT, Mesh(tp=2), replace(calibrated_cpu, block_factor=1.25))
    plain = predict(shape, LATENT, Mesh(tp=2), calibrated_cpu)
    assert slower.compute_s == pytest.approx(1.25 * plain.compute_s) and slower.comm_s == plain.comm_s > 0
    assert all(profile.block_factor == 1.0 for profile in BUILT_IN.values())


def _tiny_flux_config(**changes) -> dict:
    return dict({"_class_name": "FluxTransformer2DModel", "num_layers": 1, "num_single_layers": 1,
                 "num_attention_heads": 2, "attention_head_dim": 4, "in_channels": 16, "joint_attention_dim": 8},
                **changes)


def test_forward_memory_and_fsdp_of_a_small_flux():
    shape = model_shape(_tiny_flux_config(), text_tokens=TEXT)
    latent = shape.latent_tokens(64, 64)  # 64 / (8 x 2) = 4 per side
    assert latent == 16
    whole = cost.forward_cost(shape, latent, 2)
    single_block = BlockShape("single", 1, 2, 4, FFN, modulation=3 * D * D)
    assert whole.linear_flops == 30720 + 2 * 20 * (3 * 64 + 8 * 32 + 40 * 8)
    fsdp = cost.forward_cost(shape, latent, 2, Mesh(fsdp=2, data=2))
    single, sharded = cost.memory(shape, latent, 2), cost.memory(shape, latent, 2, Mesh(tp=2))
    # FSDP gathers every unit once a forward: the two blocks and FLUX.1's five modules outside them, the whole model
    (gathers,) = fsdp.traffic
    assert (gathers.op, gathers.group, gathers.calls, gathers.overlapped, gathers.fsdp) == ("all_gather", 2, 7, True,
                                                                                          True)
    assert gathers.calls * gathers.size == pytest.approx(single.weights)
    linear = 2 * STREAM_WEIGHTS + (3 * 64 + 8 * 32 + 40 * 8)
    # tp2 halves what the FLUX.1 plan splits: the block linears, their modulation linears (2 x 6 x 64 + 3 x 64) and
    # the text / time embedders (8 x 8 context; no guidance embedder: (256 + 768) x 8 and 2 x 64 in the time and
    # pooled-text MLPs; 2 x 64 in the output norm); the patch embedding and the final projection (2 x 16 x 8) stay
    # whole on every rank
    split = linear + (2 * 6 * 64 + 3 * 64) + (8 * 8 + 1024 * 8 + 2 * 64 + 2 * 64)
    assert single.weights == (split + 2 * 16 * 8) * 2 and single.weights - sharded.weights == split * 2 / 2
    gathered = cost.memory(shape, latent, 2, Mesh(data=2, fsdp=2))
    assert gathered.weights == single.weights / 2 and gathered.gathered == 2 * FLUX_BLOCK.params * 2


@pytest.mark.parametrize("name", ["flux.1-dev", "flux.2-dev", "qwen-image", "wan2.1-t2v-14b", "hunyuan-video",
                                  "ltx-video"])
def test_fsdp_units_counted_are_those_fsdp_shards(name):
    """`ModelShape.fsdp_units` against the units `fsdp/apply.shard_weights` makes of diffusers' class (on meta): the
    modules outside the blocks, the root where it holds weights, and the blocks the shape counts as other weights."""
    import diffusers

    from paradiff.fsdp.shard import outside_units
    from paradiff.plans.reference_configs import REFERENCE_CONFIGS
    from paradiff.runtime.repeated_blocks import repeated_blocks

    config = REFERENCE_CONFIGS[name][1]
    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    blocks = [block for _name, block in repeated_blocks(model)]
    units = outside_units(model, blocks)
    owned = {id(p) for module in blocks + units for p in module.parameters()}
    root = any(id(p) not in owned for p in model.parameters())
    shape = model_shape(config)
    assert shape.fsdp_units + sum(block.count for block in shape.blocks) == len(blocks) + len(units) + root


@pytest.mark.parametrize("name, billions", [("flux.1-dev", 11.90), ("flux.2-dev", 32.22), ("qwen-image", 20.43),
                                            ("wan2.1-t2v-14b", 14.29), ("hunyuan-video", 12.82),
                                            ("ltx-video", 1.92)])
def test_parameter_counts_of_the_published_configs(name, billions):
    from paradiff.plans.reference_configs import REFERENCE_CONFIGS

    # the counts diffusers' classes give for these configs (built on the meta device once, 2026-12-06)
    assert model_shape(REFERENCE_CONFIGS[name][1]).params / 1e9 == pytest.approx(billions, rel=0.01)


def test_sizes_the_model_cannot_take_are_refused_with_the_valid_values():
    shape = model_shape(_tiny_flux_config())
    with pytest.raises(CostModelError, match=r"height 100 is not a multiple of 16.*try 96"):
        shape.latent_tokens(100, 64)
    with pytest.raises(CostModelError, match="image model"):
        shape.latent_tokens(64, 64, frames=5)
    with pytest.raises(CostModelError, match=r"no cost model for transformer class 'Foo'; known: Flux"):
        model_shape({"_class_name": "Foo", "num_attention_heads": 1, "attention_head_dim": 1})
    from paradiff.plans.reference_configs import REFERENCE_CONFIGS

    with pytest.raises(CostModelError, match=r"frames 80: .* 1 \+ a multiple of 4 frames, e.g. 77"):
        model_shape(REFERENCE_CONFIGS["wan2.1-t2v-14b"][1]).latent_tokens(480, 832, 80)
    with pytest.raises(CostModelError, match="bad part 'tq2'"):
        Mesh.parse("tq2")
    assert Mesh.parse("cfg2xring2+fsdp2") == Mesh(ring=2, cfg=2, fsdp=2)
    with pytest.raises(CostModelError, match="unknown profile 'h900'.*h100-sxm"):
        load_profile("h900")


def test_every_mesh_of_a_world_is_enumerated_once():
    found = meshes(4)
    assert len(found) == len(set(found))
    assert all(mesh.world == 4 for mesh in found)
    # as --fsdp makes them: over the ulysses x ring ranks (adding none), or on ranks of its own without them
    assert {Mesh(tp=2, ulysses=2), Mesh(ring=4, fsdp=4), Mesh(cfg=2, fsdp=2), Mesh(tp=2, fsdp=2)} <= set(found)
    assert Mesh(ulysses=4, fsdp=2) not in found and Mesh(ring=2, cfg=2, fsdp=4) not in found


def test_plan_feasibility_heads_cfg_and_memory(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_tiny_flux_config(num_attention_heads=3)))
    cpu = BUILT_IN["h100-sxm"]
    result = plan(str(config), height=64, width=64, steps=2, world=2, profile=cpu)
    by_mesh = {p.mesh.name: p for p in result.predictions}
    # 3 heads over 2 ranks: run as generate runs them (2 and 1), costed by the busier rank: 4/3 of an even share
    assert by_mesh["tp2"].feasible and by_mesh["ulysses2"].feasible
    assert by_mesh["tp2"].imbalance == by_mesh["ulysses2"].imbalance == pytest.approx(4 / 3)
    assert by_mesh["ring2"].imbalance == 1.0
    at_four = {p.mesh.name: p for p in plan(str(config), height=64, width=64, steps=2, world=4,
                                             profile=cpu).predictions}
    assert at_four["tp4"].problems == ["tp4 is more ranks than the 3 heads (each TP rank holds a whole head)"]
    assert at_four["ulysses4"].feasible and at_four["ulysses4"].imbalance == pytest.approx(4 / 3)
    assert "cfg needs a pipeline that guides" in by_mesh["cfg2"].problems[0]  # a bare config: no pipeline
    assert by_mesh["ring2"].feasible and by_mesh["data2"].feasible
    assert result.recommended is not None and result.recommended.feasible
    assert result.recommended.latency_s == min(p.latency_s for p in result.predictions if p.feasible)
    starved = plan(str(config), height=64, width=64, steps=2, world=2, profile=cpu, device_memory_gb=1e-9)
    assert starved.recommended is None and "needs" in starved.reason
    # Wan guides by default: cfg2 is feasible there and halves the forwards of a step
    wan = plan("wan2.1-t2v-14b", height=480, width=832, frames=81, steps=50, world=2, profile=cpu)
    by_mesh = {p.mesh.name: p for p in wan.predictions}
    assert wan.branches == 2 and by_mesh["cfg2"].feasible
    assert by_mesh["cfg2"].step_s < 0.55 * plan("wan2.1-t2v-14b", height=480, width=832, frames=81, steps=50,
                                                world=1, profile=cpu).predictions[0].step_s
    flux = plan("flux.1-dev", height=1024, width=1024, steps=50, world=2, profile=cpu, guidance_scale=1.0)
    assert not {p.mesh.name: p for p in flux.predictions}["cfg2"].feasible


def test_feasibility_rules_fsdp_over_the_sequence_ranks_and_tokens_to_split():
    from paradiff.plan_tools.planner import problems

    shape = model_shape(_tiny_flux_config(), text_tokens=TEXT)
    fits = cost.Memory(1.0, 0.0, 1.0)
    assert problems(shape, 16, Mesh(ring=2, fsdp=2), 1, fits, 1e9) == []
    assert problems(shape, 16, Mesh(ring=2, ulysses=2, fsdp=2), 1, fits, 1e9) == [
        "fsdp2 with ulysses x ring = 4: fsdp shards over the same ranks and must equal it"]
    assert problems(shape, 1, Mesh(ring=2), 1, fits, 1e9) == ["1 tokens cannot be split over 2 sequence ranks"]
    assert problems(shape, 16, Mesh(cfg=3), 2, fits, 1e9) == [
        "cfg3: the pipeline makes 2 calls per step; cfg must be 2"]
    assert problems(shape, 16, Mesh(), 1, cost.Memory(2e9, 0.0, 1e9), 2.5e9) == [
        "needs 3.0 GB per rank, the device has 2.5 GB"]


def test_passes_issued_ahead_hide_behind_compute_only_where_the_profile_overlaps():
    from dataclasses import replace

    from paradiff.plan_tools.planner import predict
    from paradiff.plans.reference_configs import REFERENCE_CONFIGS

    shape = model_shape(REFERENCE_CONFIGS["wan2.1-t2v-14b"][1])
    latent = shape.latent_tokens(480, 832, 81)
    gpu = BUILT_IN["h100-sxm"]
    cpu_like = replace(gpu, overlap=False)  # as calibrated on CPU: gloo's threads share each rank's core
    for mesh in (Mesh(ring=2), Mesh(data=2, fsdp=2)):
        hidden, exposed = predict(shape, latent, mesh, gpu), predict(shape, latent, mesh, cpu_like)
        every = sum(gpu.comm_seconds(item) for item in exposed.forward.traffic)
        assert exposed.comm_s == pytest.approx(every) and hidden.comm_s < 0.05 * every
        assert exposed.compute_s == hidden.compute_s
    # a CPU profile that calibrated FSDP prices its gathers per unit and byte instead of on the all-gather link; a
    # device that overlaps keeps the link, hidden behind the compute
    measured = replace(cpu_like, fsdp_unit_s=1e-3, fsdp_byte_s=1e-9)
    mesh = Mesh(data=2, fsdp=2)
    (gathers,) = [item for item in predict(shape, latent, mesh, measured).forward.traffic if item.fsdp]
    assert predict(shape, latent, mesh, measured).comm_s == pytest.approx(
        gathers.calls * 1e-3 + gathers.calls * gathers.size * 1e-9)
    assert predict(shape, latent, mesh, replace(measured, overlap=True)).comm_s == predict(shape, latent, mesh,
                                                                                           gpu).comm_s


def test_profiles_round_trip_through_json(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(BUILT_IN["rtx4090"].to_json())
    assert load_profile(str(path)) == BUILT_IN["rtx4090"]
    # a calibration saved before the per-collective wait term was dropped (it had `sync_s`) still loads
    older = json.loads(BUILT_IN["rtx4090"].to_json()) | {"sync_s": 0.002}
    path.write_text(json.dumps(older))
    assert load_profile(str(path)) == BUILT_IN["rtx4090"]
    assert all("public specs" in profile.source for profile in BUILT_IN.values())
    path.write_text("{}")
    with pytest.raises(CostModelError, match="not a paradiff hardware profile"):
        load_profile(str(path))


def test_plan_command_prints_the_meshes_and_the_recommendation(capsys):
    from paradiff.cli import main

    assert main(["plan", "wan2.1-i2v-14b", "--height", "480", "--width", "832", "--frames", "81", "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "Wan, 16.4 B parameters, 32760 latent + 512 text tokens, 2 transformer call(s) per step" in out
    assert "recommended: " in out and "from public specs" in out
    assert main(["plan", "flux.1-dev", "--world", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"] in {mesh["mesh"] for mesh in data["meshes"] if mesh["feasible"]}
    assert all(mesh["step_flops"] == mesh["forward_flops"] for mesh in data["meshes"])  # FLUX.1-dev: no CFG
    assert main(["plan", "no-such-model"]) == 2
    assert "is not a reference name (flux.1-dev" in capsys.readouterr().err + capsys.readouterr().out


def test_calibration_measures_every_collective_through_comm(pools):
    import rank_cases_cost as cases
    from paradiff.plan_tools.calibrate import profile_from

    results = pools.get(2).run(cases.calibrate_tiny)
    for result in results:
        assert set(result["links"]) == {"all_reduce", "all_to_all", "all_gather", "p2p"}
        assert all(link["latency_s"] > 0 and math.isfinite(link["bandwidth"]) and link["bandwidth"] > 0
                   for link in result["links"].values())
        assert result["gemm"]["float32"] > 0 and result["attention"]["float32"] > 0
        assert result["elementwise_bandwidth"] > 0 and result["op_overhead_s"] > 0
        # the reference block's time over its prediction (far from 1 here: the tiny probes' rates are no block's)
        assert result["block_factor"] > 0 and math.isfinite(result["block_factor"])
        # FSDP's cost per unit and per byte, from paradiff's FSDP over both ranks against the same chain whole
        assert result["fsdp"]["unit_s"] >= 0 and result["fsdp"]["byte_s"] >= 0
        assert result["fsdp"]["unit_s"] + result["fsdp"]["byte_s"] * 256 ** 2 * 4 > 0
    profile = profile_from(results, world=2, device="cpu", dtypes=("float32",), notes="tiny")
    assert profile.fsdp_unit_s == max(r["fsdp"]["unit_s"] for r in results)
    assert profile.block_factor == statistics.median(r["block_factor"] for r in results)
    assert profile.link("all_reduce", 2).bandwidth == min(r["links"]["all_reduce"]["bandwidth"] for r in results)
    assert profile.op_overhead_s == max(r["op_overhead_s"] for r in results) and not profile.host_overlap
    assert HardwareProfile.from_dict(json.loads(profile.to_json())) == profile


def test_parallel_auto_writes_the_recommended_degrees_into_the_workers_argv(capsys):
    from paradiff.cli.args import CliError, build_parser
    from paradiff.cli.embedded import embedded_default
    from paradiff.cli.plan import resolve_auto_parallel
    from paradiff.plan_tools.hardware import load_profile

    argv = ["generate", "--parallel", "auto", "--world", "2", "--steps", "3", "--profile=rtx4090"]
    args = build_parser().parse_args(argv)
    out = resolve_auto_parallel(args, argv)
    expected = plan(str(embedded_default()), height=64, width=64, steps=3, world=2, profile=load_profile("rtx4090"))
    mesh = next(p.mesh for p in expected.predictions if p.feasible)
    assert out == ["generate", "--steps", "3", "--tp", str(mesh.tp), "--ulysses", str(mesh.ulysses), "--ring",
                   str(mesh.ring), "--cfg", str(mesh.cfg), "--dp", str(mesh.data), "--fsdp", str(mesh.fsdp)]
    assert (args.tp, args.ulysses, args.ring, args.cfg, args.dp, args.fsdp) == (
        mesh.tp, mesh.ulysses, mesh.ring, mesh.cfg, mesh.data, mesh.fsdp)
    # what --fsdp refuses (api/fsdp.py: nf4, --stages, a quantized base with --tp) is never picked; int8 / fp8 / GGUF
    # bases take fsdp without tp
    by_flags = {}
    for extra in (["--quantize", "nf4"], ["--stages"], ["--quantize", "int8"], ["--quantize", "fp8"]):
        chosen = build_parser().parse_args(argv + extra)
        assert "--fsdp" in resolve_auto_parallel(chosen, argv)
        by_flags[extra[-1]] = (chosen.fsdp, chosen.tp)
    assert by_flags["nf4"][0] == 1 and by_flags["--stages"][0] == 1, by_flags
    assert all(fsdp == 1 or tp == 1 for fsdp, tp in by_flags.values()), by_flags
    assert by_flags["int8"] == next((p.mesh.fsdp, p.mesh.tp) for p in expected.predictions
                                    if p.feasible and (p.mesh.fsdp == 1 or p.mesh.tp == 1)), by_flags
    assert f"--parallel auto on 2 ranks (rtx4090): {mesh.name}" in capsys.readouterr().err
    with pytest.raises(CliError, match=r"picks the degrees itself: drop --tp 2"):
        resolve_auto_parallel(build_parser().parse_args(["generate", "--parallel", "auto", "--tp", "2"]), [])
    with pytest.raises(CliError, match=r"needs the number of ranks: add --world N"):
        resolve_auto_parallel(build_parser().parse_args(["generate", "--parallel", "auto"]), [])


class LiveTensorPeak:
    """The peak bytes of the tensors a forward allocates and still references, op by op (what a CUDA allocator's
    peak would count, without its caching): every op's outputs are counted once per storage until the last tensor
    on that storage is gone. Storages in `held` (the weights, the inputs) are not counted."""

    def __init__(self, held: set[int]):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._count(out)
                return out

        self.mode, self.held = Mode(), held
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _count(self, out) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten

        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.held or not storage.nbytes():
                continue
            if key not in self.refs:
                self.refs[key], self.sizes[key] = 0, storage.nbytes()
                self.live += storage.nbytes()
            self.refs[key] += 1
            weakref.finalize(tensor, self._release, key)
        self.peak = max(self.peak, self.live)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


HEADS, HEAD_DIM = 2, 32
ACTIVATION_CASES = {  # d = 64; FLUX.1 (joint FFN / single attention), FLUX.2 (fused single block), Wan (cross)
    "flux": ("FluxTransformer2DModel", dict(
        num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
        joint_attention_dim=64, pooled_projection_dim=16, guidance_embeds=True, in_channels=16,
        axes_dims_rope=(8, 12, 12))),
    "flux2": ("Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=64, timestep_guidance_channels=32, axes_dims_rope=(8,) * 4,
        guidance_embeds=True)),
    "wan": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=32, ffn_dim=192, num_layers=1, rope_max_seq_len=64)),
}


@pytest.mark.parametrize("family", sorted(ACTIVATION_CASES))
def test_activation_peak_and_weights_are_diffusers_forward(family):
    """The predicted activation peak is the peak of the tensors diffusers' forward holds (within 10%; at the
    benchmark's sizes within 5%: benchmarks/bench_cost_model.py), and the weights its parameters."""
    from paradiff.testing.models import Lengths, make_inputs, model_class

    class_name, config = ACTIVATION_CASES[family]
    torch.manual_seed(0)
    model = model_class(family)(**config).eval()
    inputs = make_inputs(family, model.config, lengths=Lengths(height=16, width=16, text=32))
    held = {tensor.untyped_storage().data_ptr() for tensor in
            [*model.parameters(), *model.buffers(), *(v for v in inputs.values() if isinstance(v, torch.Tensor))]}
    live = LiveTensorPeak(held)
    with torch.no_grad(), live.mode:
        model(**inputs, return_dict=False)
    predicted = cost.memory(model_shape(dict(config, _class_name=class_name), text_tokens=32), 256, 4)
    assert predicted.activations == pytest.approx(live.peak, rel=0.1)
    assert predicted.weights == pytest.approx(sum(p.numel() * 4 for p in model.parameters()), rel=0.025)
