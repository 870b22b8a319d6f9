"""Functions run on every rank of a pool by tests/test_compile.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.config import mode_name
from paradiff_testkit.compile import RecordingBackend
from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward

SHAPE = Lengths(height=3, width=5, text=7)  # 15 image + 7 text tokens: divisible by neither 2 nor 4 ranks


def parallel_config(tp: int = 1, ring: int = 1, ulysses: int = 1) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig.from_degrees(tp=tp, ring=ring, ulysses=ulysses)


def compiled_vs_eager(cases: list[dict], backend: str = "aot_eager", batch: int = 2) -> dict:
    """For each case {family, tp, ring, ulysses}: the compiled model's output against its own eager output and
    against the single-process model (relative max difference), and what the compiled graphs contain."""
    from torch._dynamo.utils import counters

    results = {}
    # A case without parallel degrees is the same computation on every rank (no collective, same seeds): the first
    # rank alone runs it, after the parallel cases, so no other rank waits on it (one trace instead of one per rank).
    parallel = [case for case in cases if any(case.get(k, 1) > 1 for k in ("tp", "ring", "ulysses"))]
    single = [case for case in cases if case not in parallel]
    for case in parallel + (single if dist.get_rank() == 0 else []):
        family, degrees = case["family"], {k: case.get(k, 1) for k in ("tp", "ring", "ulysses")}
        label = f"{family}:{mode_name(degrees, order=tuple(degrees))}"
        torch._dynamo.reset()
        reference = build_model(family)
        model = build_model(family)
        if any(v > 1 for v in degrees.values()):
            paradiff.enable_parallelism(model, parallel_config(**degrees))
        inputs = make_inputs(family, reference.config, batch=batch, lengths=SHAPE)
        eager = run_forward(model, inputs)
        recorder = RecordingBackend(then=backend)
        breaks_before = sum(counters["graph_break"].values())
        compiled_model = paradiff.compile(model, backend=recorder)
        compiled = run_forward(compiled_model, inputs)
        again = run_forward(compiled_model, inputs)  # a second call reuses the graphs
        single = run_forward(reference, inputs)
        scale = float(single.abs().max())
        results[label] = {
            "vs_eager": float((compiled - eager).abs().max()) / scale,
            "vs_single": float((compiled - single).abs().max()) / scale,
            "repeat": float((again - compiled).abs().max()) / scale,
            "graphs": len(recorder.graphs),
            "graph_breaks": sum(counters["graph_break"].values()) - breaks_before,
            "cp_attention_ops": recorder.count("paradiff.cp_attention"),
            "all_reduce_ops": recorder.count("_c10d_functional.all_reduce"),
            "sdpa_ops": recorder.count("scaled_dot_product_attention"),
        }
        if case.get("cache"):
            results[label]["cache"] = _compiled_and_cached(family, compiled_model)
    return {"rank": dist.get_rank(), "results": results}


def _compiled_and_cached(family: str, compiled_model) -> dict:
    """A first-block-cached denoising loop on the compiled parallel model against the eager single-process one."""
    from diffusers import FirstBlockCacheConfig

    from rank_cases_cache import denoise, first_block_threshold

    config = FirstBlockCacheConfig(threshold=first_block_threshold(family, layers=1, single_layers=1))
    reference = build_model(family)
    reference_monitor = paradiff.enable_cache(reference, config)
    expected = denoise(reference, family)
    compiled_model.enable_cache(config)
    actual = denoise(compiled_model, family)
    return {
        "expected": [d.computed for d in reference_monitor.decisions],
        "actual": [d.computed for d in paradiff.cache_monitor(compiled_model).decisions],
        "diff": float((actual - expected).abs().max() / expected.abs().max()),
    }


def inductor_smoke() -> dict:
    """Inductor lowers both parallel ops to real code: a TP all-reduce (functional collective) and the CP attention
    custom op, in one small compiled function on 2 ranks, against the same function run eagerly."""
    from paradiff.distributed.comm import all_reduce_tp, group_name
    from paradiff.context_parallel.ops import cp_attention

    group = dist.new_group(list(range(dist.get_world_size())))
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(2, 4, 32, generator=generator)
    weight = torch.randn(32, 32, generator=torch.Generator().manual_seed(5))
    tokens = 3 + dist.get_rank()  # this rank's share of the sequence: uneven over the ranks

    def block(x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.linear(x, weight)
        summed = all_reduce_tp(partial, group)[:, :tokens]
        q = summed.reshape(x.shape[0], tokens, 4, 8).transpose(1, 2)
        if torch.compiler.is_compiling():
            out = cp_attention(q, q, q, None, 8 ** -0.5, "ulysses", "native", False, group_name(group), "",
                               group_name(group), None, None)
        else:
            from paradiff.context_parallel.runtime import attend

            out = attend(q, q, q, None, 8 ** -0.5, "ulysses", "native", False, group, None, group)
        return torch.nn.functional.gelu(out.transpose(1, 2).reshape(x.shape[0], tokens, -1)) + x[:, :tokens]

    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no pool of compile worker processes for one small graph
    with torch.no_grad():
        eager = block(x)
        recorder = RecordingBackend(then="inductor")
        compiled = torch.compile(block, backend=recorder, fullgraph=True)(x)
    return {"rank": dist.get_rank(), "diff": float((compiled - eager).abs().max() / eager.abs().max()),
            "all_reduce_ops": recorder.count("_c10d_functional.all_reduce"),
            "cp_attention_ops": recorder.count("paradiff.cp_attention")}
