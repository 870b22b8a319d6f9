"""Context parallelism on CPU: paradiff's Ulysses / ring / unified attention next to diffusers' own CP, same run.

Model: a FLUX.2-architecture `Flux2Transformer2DModel` with random weights (see MODEL_CONFIG; 26.0 M parameters),
fp32, batch 1, one torch thread per rank, gloo on 127.0.0.1, every case in freshly spawned processes.

Shapes: a divisible sequence (64x64 image grid + 256 text = 4352 tokens) and a non-divisible one (63x65 grid + 255
text = 4350 tokens, odd on both streams; the 1008x1008-like case that diffusers' plain Ulysses refuses).

Per case: time per forward (one warm-up, then --repeats timed forwards in each of --rounds interleaved rounds; the
median over all of them; per forward the slowest rank counts), steps/s, peak anonymous RSS per rank (RssAnon sampled
from /proc/self/status every --sample-ms in a thread; reported as the rise over the value just before the forward and
as the absolute peak, max over ranks, repeats and rounds), and the max abs difference of the gathered output to the
single-process output of the same shape. The machine is shared: before each case the script waits for other
processes to go quiet, records the CPU-seconds they used during the timed forwards, reruns a disturbed case once and
leaves disturbed rounds out of the medians when a clean one exists.

Then one attention call alone (no model around it) per implementation: time, and peak RssAnon rise with glibc's
mmap threshold fixed at 128 KiB so that freed multi-MB buffers go back to the OS and the per-call peak is visible.

diffusers 0.42.1 refuses CPU; inside the diffusers worker processes only, `torch.accelerator.device_count` is
patched to return 1 (see `patch_diffusers_for_cpu`); one extra case also replaces diffusers' uneven output gather,
which gloo cannot do (`patch_diffusers_uneven_gather_for_gloo`). Cases that cannot run are reported with their error.

    .venv/bin/python benchmarks/bench_cp.py                 # full run (~8 min on 2 quiet cores)
    .venv/bin/python benchmarks/bench_cp.py --profile --rounds 1 --no-attention --shapes div \
        --cases "paradiff ulysses,paradiff ring,diffusers ulysses 2"     # where CP attention's time goes
    .venv/bin/python benchmarks/bench_cp.py --quick         # small config, for checking the script
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import system_busy_seconds, wait_for_quiet  # noqa: E402
from results import figure, write_result  # noqa: E402

from paradiff.distributed.spawn import RankFailed, RankTimeout, run_ranks  # noqa: E402
from paradiff.runtime.memory import PeakSampler, rss_anon_bytes  # noqa: E402


MB = 1e6

# FLUX.2 architecture, scaled down: 8 heads x 64 head dim (inner 512), 2 double-stream + 2 single-stream blocks.
MODEL_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=64,
    num_attention_heads=8,
    joint_attention_dim=512,
    timestep_guidance_channels=256,
    axes_dims_rope=(16, 16, 16, 16),
    guidance_embeds=True,
)
QUICK_CONFIG = dict(MODEL_CONFIG, num_layers=1, num_single_layers=1, attention_head_dim=32, joint_attention_dim=64,
                    axes_dims_rope=(8, 8, 8, 8), timestep_guidance_channels=64)

SHAPES = {  # name -> (grid height, grid width, text tokens)
    "div": (64, 64, 256),
    "nondiv": (63, 65, 255),
}
QUICK_SHAPES = {"div": (16, 16, 32), "nondiv": (15, 17, 31)}


@dataclass
class Case:
    name: str
    impl: str  # "single", "paradiff" or "diffusers"
    world: int
    ring: int = 1
    ulysses: int = 1
    ulysses_anything: bool = False
    diffusers_backend: str | None = None  # diffusers attention backend name; None keeps the default ("native")
    gloo_gather_patch: bool = False  # see patch_diffusers_uneven_gather_for_gloo
    shapes: tuple[str, ...] = ("div", "nondiv")
    expect_failure: bool = False  # a case recorded for its error (diffusers' ring on CPU)


CASES = [
    Case("single process", "single", 1),
    Case("paradiff ulysses 2", "paradiff", 2, ulysses=2),
    Case("paradiff ring 2", "paradiff", 2, ring=2),
    Case("paradiff unified 2x2", "paradiff", 4, ring=2, ulysses=2),
    Case("diffusers ulysses 2", "diffusers", 2, ulysses=2),
    Case("diffusers ulysses_anything 2", "diffusers", 2, ulysses=2, ulysses_anything=True, shapes=("nondiv",),
         expect_failure=True),
    Case("diffusers ulysses_anything 2 + gloo gather patch", "diffusers", 2, ulysses=2, ulysses_anything=True,
         gloo_gather_patch=True),
    Case("diffusers ring 2", "diffusers", 2, ring=2, shapes=("div",), expect_failure=True),
    Case("diffusers ring 2 (_native_flash)", "diffusers", 2, ring=2, diffusers_backend="_native_flash",
         shapes=("div",), expect_failure=True),
]

ATTENTION_CASES = [
    Case("paradiff ulysses 2", "paradiff", 2, ulysses=2),
    Case("paradiff ring 2", "paradiff", 2, ring=2),
    Case("diffusers ulysses 2", "diffusers", 2, ulysses=2),
]


# ----------------------------------------------------------------------------------------------------------------
# memory sampling


# ----------------------------------------------------------------------------------------------------------------
# the worker (one per rank)


def patch_diffusers_for_cpu() -> list[str]:
    """The only patch diffusers 0.42.1's context parallelism needs on CPU (applied in diffusers workers only).

    `ModelMixin._resolve_parallel_config` computes `rank % torch.accelerator.device_count()`, which is 0 without an
    accelerator (ZeroDivisionError). With 1 it builds device `cpu:0`; the mesh device type comes from
    `torch._C._get_accelerator()`, already "cpu" here, so the CP mesh is a gloo CPU mesh.
    """
    import torch

    applied = []
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
        applied.append("torch.accelerator.device_count -> 1")
    return applied


def patch_diffusers_uneven_gather_for_gloo() -> list[str]:
    """gloo's all_gather needs equal shapes; diffusers' `_all_gather_anything` (the output gather of ulysses_anything
    / ring_anything) passes unequal ones. Replaced, in the one case that asks for it, by pad-to-longest + all_gather +
    trim, which is what the uneven gather amounts to on NCCL too. The attention path itself is untouched.
    """
    import torch
    import torch.distributed as dist
    import diffusers.hooks.context_parallel as cp_hooks
    from diffusers.models._modeling_parallel import gather_size_by_comm

    def gather_padded(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
        dim = dim % tensor.dim()
        sizes = gather_size_by_comm(tensor.shape[dim], group)
        longest = max(sizes)
        if tensor.shape[dim] < longest:
            pad = list(tensor.shape)
            pad[dim] = longest - tensor.shape[dim]
            tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
        pieces = [torch.empty_like(tensor) for _ in sizes]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)], dim=dim)

    cp_hooks._all_gather_anything = gather_padded
    return ["diffusers.hooks.context_parallel._all_gather_anything -> pad + all_gather + trim (gloo needs equal shapes)"]


def build_model(config: dict):
    import torch
    from paradiff.testing.models import model_class

    torch.manual_seed(0)
    model = model_class("flux2")(**config)
    with torch.no_grad():  # perturb every parameter (as paradiff.testing.models.build_model does)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def build_inputs(model, shape: tuple[int, int, int]) -> dict:
    from paradiff.testing.models import Lengths, make_inputs

    height, width, text = shape
    inputs = make_inputs("flux2", model.config, batch=1, lengths=Lengths(height=height, width=width, text=text))
    # (batch, seq, 4) ids: diffusers' Flux2 CP plan only splits 3-D ids (expected_dims=3); the model takes both.
    inputs["img_ids"] = inputs["img_ids"].unsqueeze(0)
    inputs["txt_ids"] = inputs["txt_ids"].unsqueeze(0)
    return inputs


def short_error(exc: BaseException) -> str:
    """First line of the message, where it was raised and the innermost diffusers frame on the way."""
    frames = traceback.extract_tb(exc.__traceback__)
    places = []
    inner = [f for f in frames if "/diffusers/" in f.filename]
    for frame in ([inner[-1]] if inner and inner[-1] is not frames[-1] else []) + frames[-1:]:
        path = frame.filename.split("site-packages/")[-1]
        places.append(f"{path}:{frame.lineno} {frame.name}")
    message = str(exc).strip().split("\n")[0]
    message = message if len(message) <= 200 else message[:200] + " [...]"
    return f"{type(exc).__name__}: {message} (raised at {' <- '.join(reversed(places))})"


class Timers:
    """Wall time and calls of wrapped functions (the --profile breakdown). Nested buckets overlap by design."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attribute: str, bucket: str, key: Any = None) -> None:
        original = owner[key] if key is not None else getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[bucket] = self.seconds.get(bucket, 0.0) + time.perf_counter() - start
                self.calls[bucket] = self.calls.get(bucket, 0) + 1

        if key is not None:
            owner[key] = timed
        else:
            setattr(owner, attribute, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def install_paradiff_timers(timers: Timers) -> None:
    from paradiff.context_parallel import apply, attention, kernels, runtime

    timers.wrap(runtime.ContextParallelRuntime, "attention", "CP attention (all of it)")
    native = {"kernel": kernels.BACKENDS["native"].kernel}  # the backend's kernel timed, its checks kept
    timers.wrap(native, None, "  local kernel (flash-for-CPU, returns LSE)", key="kernel")
    kernels.BACKENDS["native"] = dataclasses.replace(kernels.BACKENDS["native"], kernel=native["kernel"])
    timers.wrap(attention, "all_gather_int", "  all_gather_int (lengths)")
    timers.wrap(attention, "ring_pass_start", "  ring: isend/irecv start")
    timers.wrap(attention, "ring_pass_wait", "  ring: wait for incoming block")
    timers.wrap(attention, "merge_lse", "  ring: LSE merge (fp32)")
    timers.wrap(attention, "_heads_to_sequence", "  ulysses: all-to-all q/k/v (incl. stack/copies)")
    timers.wrap(attention, "_sequence_to_heads", "  ulysses: all-to-all out (incl. copies)")
    timers.wrap(apply, "all_gather_uneven", "output gather (proj_out)")
    timers.wrap(runtime.AttentionInterceptor, "__torch_function__", "TorchFunctionMode dispatch (all torch calls "
                                                                    "inside attention modules, incl. their work)")


def install_diffusers_timers(timers: Timers) -> None:
    import torch
    from diffusers.models import attention_dispatch as dispatch

    timers.wrap(dispatch, "_templated_context_parallel_attention", "CP attention (all of it)")
    timers.wrap(torch.nn.functional, "scaled_dot_product_attention", "  local kernel (F.sdpa)")
    timers.wrap(dispatch, "_all_to_all_single", "  ulysses: all-to-all (equal splits)")
    timers.wrap(dispatch, "all_to_all_single_any_qkv_async", "  ulysses_anything: q/k/v all-to-all start")
    timers.wrap(dispatch, "all_to_all_single_any_o_async", "  ulysses_anything: out all-to-all start")


def mode_overhead_us() -> float:
    """Extra cost of one torch call made inside paradiff's AttentionInterceptor (a TorchFunctionMode), in us."""
    import torch
    from paradiff.context_parallel.runtime import AttentionInterceptor

    x = torch.ones(4)
    calls = 20000

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            torch.add(x, x)
        return time.perf_counter() - start

    plain = min(loop() for _ in range(3))
    with AttentionInterceptor(runtime=None, local=True):
        moded = min(loop() for _ in range(3))
    return (moded - plain) / calls * 1e6


def bench_worker(rank: int, world_size: int, case: Case, shape: tuple[int, int, int], config: dict, repeats: int,
                 sample_s: float, profile: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # diffusers' funcol.all_gather_tensor deprecation
    result: dict[str, Any] = {"rank": rank, "patches": []}
    model = build_model(config)
    inputs = build_inputs(model, shape)
    stats = None
    stage = "enable"
    try:
        if case.impl == "paradiff":
            import paradiff
            from paradiff.distributed.comm import CommStats
            from paradiff.runtime.state import get_state

            paradiff.enable_parallelism(
                model, paradiff.ContextParallelConfig(ring_degree=case.ring, ulysses_degree=case.ulysses)
            )
            stats = CommStats()
            get_state(model).context.stats = stats
        elif case.impl == "diffusers":
            result["patches"] = patch_diffusers_for_cpu()
            if case.gloo_gather_patch:
                result["patches"] += patch_diffusers_uneven_gather_for_gloo()
            if case.diffusers_backend is not None:
                model.set_attention_backend(case.diffusers_backend)
            model.enable_parallelism(config=diffusers.ContextParallelConfig(
                ring_degree=case.ring, ulysses_degree=case.ulysses, ulysses_anything=case.ulysses_anything
            ))
        timers = Timers() if profile else None
        if timers is not None:
            if case.impl == "paradiff":
                install_paradiff_timers(timers)
            else:
                install_diffusers_timers(timers)
        times, deltas, peaks = [], [], []
        loop_cpu = loop_busy = 0.0
        output = None
        for index in range(repeats + 1):
            stage = "warm-up forward" if index == 0 else "forward"
            gc.collect()
            if world_size > 1:
                dist.barrier()
            baseline = rss_anon_bytes()
            cpu_before, busy_before = time.process_time(), system_busy_seconds()
            with PeakSampler(interval_s=sample_s) as sampler, torch.no_grad():
                start = time.perf_counter()
                output = model(**inputs, return_dict=False)[0]
                elapsed = time.perf_counter() - start
            if world_size > 1:
                dist.barrier()  # every rank's window ends here, so the machine-wide busy time covers all of them
            if index > 0:
                loop_cpu += time.process_time() - cpu_before
                loop_busy += system_busy_seconds() - busy_before
            if index == 0:
                if timers is not None:
                    timers.reset()
                if stats is not None:
                    stats.calls.clear()
                    stats.bytes.clear()
                continue
            times.append(elapsed)
            deltas.append(sampler.peak["RssAnon"] - baseline)
            peaks.append(sampler.peak["RssAnon"])
        # numpy, not a tensor: torch shares tensors through fds that die with this process
        result.update(times=times, deltas=deltas, peaks=peaks, output=output.numpy() if rank == 0 else None,
                      cpu_s=loop_cpu, machine_busy_s=loop_busy)
        if timers is not None:
            result["profile"] = {name: (timers.seconds[name] / repeats * 1e3, timers.calls[name] / repeats)
                                 for name in timers.seconds}
            if case.impl == "paradiff":
                result["mode_overhead_us"] = mode_overhead_us()
        if stats is not None:
            result["comm"] = {name: (stats.calls[name] / repeats, stats.bytes[name] / repeats) for name in stats.calls}
    except Exception as exc:  # noqa: BLE001 - recorded; every rank raises the same error at the same point
        result["error"] = f"{stage}: {short_error(exc)}"
    return result


def attention_worker(rank: int, world_size: int, case: Case, shape: tuple[int, int, int], config: dict,
                     repeats: int, sample_s: float, profile: bool = False) -> dict:
    """One attention call at the benchmark's size, as the Flux2 processors issue it, without the rest of the model.

    q/k/v are this rank's (batch, local_seq, heads, head_dim) tensors; the call ends with the processor's
    `flatten(2, 3)` (free on diffusers' contiguous output, a copy on paradiff's head-major one).
    """
    import torch
    import torch.distributed as dist

    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    height, width, text = shape
    full = height * width + text
    local = full // world_size + (1 if rank < full % world_size else 0)
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    generator = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, local, heads, head_dim, generator=generator) for _ in range(3))
    model = build_model(dict(config, num_layers=1, num_single_layers=0))
    result: dict[str, Any] = {"rank": rank}
    if case.impl == "paradiff":
        import paradiff
        from paradiff.runtime.state import get_state

        paradiff.enable_parallelism(model, paradiff.ContextParallelConfig(ring_degree=case.ring,
                                                                          ulysses_degree=case.ulysses))
        runtime = get_state(model).context

        def call():  # diffusers' _native_attention hands SDPA (B, H, S, D) views and permutes the result back
            out = runtime.attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
            return out.permute(0, 2, 1, 3).flatten(2, 3)
    else:
        from diffusers.models.attention_dispatch import _native_attention

        patch_diffusers_for_cpu()
        model.enable_parallelism(config=diffusers.ContextParallelConfig(ring_degree=case.ring,
                                                                        ulysses_degree=case.ulysses))
        parallel_config = model.transformer_blocks[0].attn.processor._parallel_config

        def call():
            return _native_attention(q, k, v, _parallel_config=parallel_config).flatten(2, 3)

    times, deltas = [], []
    for index in range(repeats + 1):
        gc.collect()
        dist.barrier()
        baseline = rss_anon_bytes()
        with PeakSampler(interval_s=sample_s / 5) as sampler, torch.no_grad():
            start = time.perf_counter()
            out = call()
            elapsed = time.perf_counter() - start
        del out
        if index > 0:
            times.append(elapsed)
            deltas.append(sampler.peak["RssAnon"] - baseline)
    result.update(times=times, deltas=deltas)
    return result


def _rank_main(rank: int, world_size: int, kwargs: dict) -> dict:
    worker = attention_worker if kwargs.pop("attention_only", False) else bench_worker
    try:
        return worker(rank=rank, world_size=world_size, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported in this rank's row; its peers time out on their own
        return {"rank": rank, "error": f"worker: {short_error(exc)}", "traceback": traceback.format_exc()}


def run_case(case: Case, shape: tuple[int, int, int], config: dict, repeats: int, sample_s: float,
             timeout_s: float, profile: bool = False, attention_only: bool = False) -> list[dict]:
    kwargs = dict(case=case, shape=shape, config=config, repeats=repeats, sample_s=sample_s, profile=profile,
                  attention_only=attention_only)
    try:
        return run_ranks(_rank_main, case.world, kwargs=dict(kwargs=kwargs), timeout_s=timeout_s, grace_s=20.0,
                         gloo_timeout_s=180 if case.world > 1 else None)
    except (RankFailed, RankTimeout) as stopped:
        results = dict(stopped.results)
        error = next((r["error"] for r in results.values() if "error" in r), None)
        if isinstance(stopped, RankFailed):
            error = error or f"worker: {stopped.summary}"
        for rank in range(case.world):
            results.setdefault(rank, {"rank": rank, "error": error or f"timeout after {timeout_s:.0f}s"})
        return [results[rank] for rank in range(case.world)]


# ----------------------------------------------------------------------------------------------------------------
# reporting


@dataclass
class Row:
    case: Case
    shape_name: str
    shape: tuple[int, int, int]
    ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    delta_mb: float | None = None
    peak_mb: float | None = None
    diff: float | None = None
    error: str | None = None
    comm: dict | None = None
    patches: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    other_cpu_s: float | None = None  # CPU-seconds used by other processes during the timed forwards
    rounds_note: str = ""

    @property
    def tokens(self) -> int:
        height, width, text = self.shape
        return height * width + text


def summarise(case: Case, shape_name: str, shape, results: list[dict], reference, wall_s: float) -> Row:
    row = Row(case, shape_name, shape, wall_s=wall_s, patches=results[0].get("patches", []))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        row.error = errors[0]
        return row
    per_repeat = [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]
    row.times_ms = [t * 1e3 for t in per_repeat]
    row.ms = statistics.median(row.times_ms)
    row.delta_mb = max(max(r["deltas"]) for r in results) / MB
    row.peak_mb = max(max(r["peaks"]) for r in results) / MB
    row.comm = results[0].get("comm")
    # rank 0's machine-wide busy time over the timed forwards, minus what our ranks used over (about) the same window
    row.other_cpu_s = max(0.0, results[0]["machine_busy_s"] - sum(r["cpu_s"] for r in results))
    output = results[0]["output"]
    if reference is not None:
        row.diff = float(abs(output - reference).max())
    return row


def merge_rounds(rounds: list[Row], max_other: float) -> Row:
    """One row from a case's rounds: the median over every timed forward, the worst memory and difference.

    Rounds disturbed by other processes (> max_other CPU-s) are left out when at least one round is clean.
    """
    first = rounds[0]
    if first.error:
        return first
    clean = [row for row in rounds if row.other_cpu_s <= max_other]
    merged = Row(first.case, first.shape_name, first.shape, patches=first.patches, comm=first.comm)
    merged.rounds_note = f"{len(clean)}/{len(rounds)} rounds clean"
    rounds = clean or rounds
    merged.times_ms = [t for row in rounds for t in row.times_ms]
    merged.ms = statistics.median(merged.times_ms)
    merged.delta_mb = max(row.delta_mb for row in rounds)
    merged.peak_mb = max(row.peak_mb for row in rounds)
    diffs = [row.diff for row in rounds if row.diff is not None]
    merged.diff = max(diffs) if diffs else None
    merged.other_cpu_s = sum(row.other_cpu_s for row in rounds)
    merged.wall_s = sum(row.wall_s for row in rounds)
    return merged


def shape_label(shape) -> str:
    height, width, text = shape
    return f"{height}x{width} img + {text} txt = {height * width + text} tok"


def table(rows: list[Row]) -> str:
    header = ["CP backend", "Ranks", "Time / forward (ms)", "Steps / s", "Peak memory (MB): forward rise / absolute",
              "Shape", "Max abs diff vs single", "Other processes (CPU-s, rounds kept)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        if row.error:
            message = row.error.split(" (raised at")[0]
            message = message.split(". ")[0] if len(message) > 160 else message  # first sentence of long ones
            cells = [row.case.name, str(row.case.world), "fails", "-", "-", shape_label(row.shape),
                     "`" + message + "`", "-"]
        else:
            diff = "reference" if row.case.impl == "single" else f"{row.diff:.1e}"
            cells = [row.case.name, str(row.case.world), f"{row.ms:.0f}", f"{1e3 / row.ms:.3f}",
                     f"{row.delta_mb:.0f} / {row.peak_mb:.0f}", shape_label(row.shape), diff,
                     f"{row.other_cpu_s:.1f}" + (f" ({row.rounds_note})" if row.rounds_note else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kv_figures(config: dict, shape, ranks: int) -> dict:
    """Bytes of K+V per attention layer held on one rank beyond the processor's own local K/V (fp32, batch 1).

    diffusers' ring (`TemplatedRingAttention`, rotate_method="allgather") concatenates the local K and V into one
    buffer (1 local block, transient) and all-gathers it (N local blocks = the full K+V, held for the whole loop).
    paradiff's ring makes the current block contiguous (1 local block; the processor hands it strided views) and
    receives the next one (1 local block): at most 2 local blocks, whatever N.
    """
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    height, width, text = shape
    full = height * width + text
    local = -(-full // ranks)  # the longest local block (paradiff's ring pads every block to it)
    kv_local = 2 * 1 * heads * local * head_dim * 4
    kv_full = 2 * 1 * heads * full * head_dim * 4
    return dict(full_seq=full, local_seq=local, kv_local=kv_local, kv_full=kv_full,
                diffusers_held=kv_full, diffusers_peak=kv_full + kv_local, paradiff_peak=2 * kv_local)


def kv_lines(config: dict, shape) -> list[str]:
    lines = []
    for ranks in (2, 4, 8):
        kv = kv_figures(config, shape, ranks)
        lines.append(
            f"{ranks} ranks ({kv['full_seq']} tokens, local {kv['local_seq']}): diffusers' all-gather ring holds the "
            f"full K+V {kv['diffusers_held'] / MB:.2f} MB (peak {kv['diffusers_peak'] / MB:.2f} MB with its cat "
            f"buffer); paradiff's ring <= 2 local blocks = {kv['paradiff_peak'] / MB:.2f} MB; avoided "
            f"{(kv['diffusers_held'] - kv['paradiff_peak']) / MB:.2f} MB held, "
            f"{(kv['diffusers_peak'] - kv['paradiff_peak']) / MB:.2f} MB at peak")
    return lines


def machine_line() -> str:
    import torch
    import diffusers

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()}-core CPU ({cpu}), {mem:.0f} GiB RAM, torch {torch.__version__}, diffusers "
            f"{diffusers.__version__}, gloo on 127.0.0.1, python {platform.python_version()}")


def print_profile(results: list[dict], row: Row) -> None:
    for result in results:
        if "profile" not in result:
            continue
        forward = statistics.median(result["times"]) * 1e3
        print(f"      rank {result['rank']}: forward {forward:.0f} ms (this rank's own median)")
        for name, (ms, calls) in result["profile"].items():
            print(f"        {ms:8.1f} ms {calls:6.0f} calls  {name}")
        if "mode_overhead_us" in result:
            calls = sum(c for n, (_, c) in result["profile"].items() if n.startswith("TorchFunctionMode"))
            print(f"        TorchFunctionMode: {result['mode_overhead_us']:.2f} us extra per call x {calls:.0f} calls = "
                  f"{result['mode_overhead_us'] * calls / 1e3:.2f} ms per forward")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per case and round, after one warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all cases")
    parser.add_argument("--retries", type=int, default=1, help="reruns of a round disturbed by other processes")
    parser.add_argument("--max-other", type=float, default=1.0,
                        help="CPU-seconds other processes may use during a case's timed forwards before a rerun")
    parser.add_argument("--sample-ms", type=float, default=5.0, help="RssAnon sampling interval")
    parser.add_argument("--cases", default="", help="comma-separated substrings selecting cases (default: all)")
    parser.add_argument("--shapes", default="div,nondiv")
    parser.add_argument("--quick", action="store_true", help="tiny config and shapes (checks the script)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per case, seconds")
    parser.add_argument("--wait-quiet", type=float, default=60.0,
                        help="before each case, wait up to this many seconds for other processes to go quiet")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--no-attention", action="store_true", help="skip the single-attention-call section")
    parser.add_argument("--profile", action="store_true",
                        help="time CP attention's parts per forward (wrapped functions; adds a little overhead, so "
                             "its timings are not the table's)")
    args = parser.parse_args(argv)

    config = QUICK_CONFIG if args.quick else MODEL_CONFIG
    shapes = QUICK_SHAPES if args.quick else SHAPES
    wanted = [s for s in args.cases.split(",") if s]
    cases = [c for c in CASES if c.impl == "single" or not wanted or any(w in c.name for w in wanted)]
    started = time.monotonic()
    print(f"# {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} | {machine_line()}", flush=True)
    print(f"# model: Flux2Transformer2DModel {json.dumps(config)}", flush=True)
    # Every case runs `--rounds` times, the rounds interleaved (case A, B, C, ..., A, B, C, ...), so slow drifts of
    # this shared VM hit every case alike; a round in which other processes used > --max-other CPU-s is rerun.
    references: dict[str, Any] = {}
    measured: dict[tuple[str, str], list[Row]] = {}
    for round_index in range(args.rounds):
        for shape_name in args.shapes.split(","):
            shape = shapes[shape_name]
            for case in cases:
                if shape_name not in case.shapes or (round_index > 0 and case.expect_failure):
                    continue
                if (case.name, shape_name) in measured and measured[(case.name, shape_name)][0].error:
                    continue  # a case that failed keeps its one error
                for attempt in range(1 + args.retries):
                    load = wait_for_quiet(timeout_s=args.wait_quiet)
                    if load >= 0.3:
                        print(f"  (other processes use {load:.1f} cores; measuring anyway)", flush=True)
                    case_start = time.monotonic()
                    results = run_case(case, shape, config, args.repeats, args.sample_ms / 1e3, args.timeout,
                                       args.profile)
                    row = summarise(case, shape_name, shape, results, references.get(shape_name),
                                    time.monotonic() - case_start)
                    status = row.error or (
                        f"{row.ms:.0f} ms (repeats {', '.join(f'{t:.0f}' for t in row.times_ms)}), rise "
                        f"{row.delta_mb:.0f} MB, peak {row.peak_mb:.0f} MB, diff {row.diff}, other processes "
                        f"{row.other_cpu_s:.1f} CPU-s")
                    print(f"  [round {round_index + 1}, {row.wall_s:5.1f}s] {case.name:34s} {shape_label(shape)}: "
                          f"{status}", flush=True)
                    if args.profile and row.error is None:
                        print_profile(results, row)
                    if row.error or row.other_cpu_s <= args.max_other or attempt == args.retries:
                        break
                    print("    (rerun: other processes were busy during it)", flush=True)
                if case.impl == "single" and row.error is None and shape_name not in references:
                    references[shape_name] = results[0]["output"]
                measured.setdefault((case.name, shape_name), []).append(row)
    rows = [merge_rounds(measured[(case.name, shape_name)], args.max_other)
            for shape_name in args.shapes.split(",") for case in cases if (case.name, shape_name) in measured]

    attention_rows = []
    if not args.no_attention and "div" in shapes:
        print("# one attention call (all 8 heads, the full sequence split over 2 ranks), no model around it:")
        for case in ATTENTION_CASES:
            measured = {}
            # timing with the default allocator; memory with every allocation >= 128 KiB mmapped (glibc's dynamic
            # threshold otherwise keeps freed multi-MB blocks in the heap, hiding a call's peak from RssAnon)
            for label, env in (("time", {}), ("memory", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
                wait_for_quiet(timeout_s=args.wait_quiet)
                saved = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                try:
                    measured[label] = run_case(case, shapes["div"], config, 7, args.sample_ms / 1e3, args.timeout,
                                               attention_only=True)
                finally:
                    for key, value in saved.items():
                        if value is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = value
            errors = [r["error"] for rs in measured.values() for r in rs if "error" in r]
            if errors:
                print(f"  {case.name}: {errors[0]}")
                continue
            results = measured["time"]
            per_repeat = [max(r["times"][i] for r in results) * 1e3 for i in range(len(results[0]["times"]))]
            rise = max(max(r["deltas"]) for r in measured["memory"]) / MB
            attention_rows.append((case.name, statistics.median(per_repeat), min(per_repeat), rise))
            print(f"  {case.name:22s} {statistics.median(per_repeat):7.1f} ms median, {min(per_repeat):7.1f} ms min, "
                  f"peak rise {rise:5.1f} MB", flush=True)

    print()
    print(table(rows))
    print()
    if attention_rows:
        print("| One attention call, " + shape_label(shapes["div"]) + " | Time (ms), median of 7 | min | "
              "Peak memory rise (MB, allocations >= 128 KiB mmapped) |")
        print("|---|---|---|---|")
        for name, median, fastest, rise in attention_rows:
            print(f"| {name} | {median:.1f} | {fastest:.1f} | {rise:.1f} |")
        print()
    by = {(r.case.name, r.shape_name): r for r in rows}

    def ms(name, shape="div"):
        row = by.get((name, shape))
        return row.ms if row is not None and row.ms is not None else None

    print("Targets:")
    figures = []
    ours_u, theirs_u = ms("paradiff ulysses 2"), ms("diffusers ulysses 2")
    ours_r = ms("paradiff ring 2")
    if ours_u and theirs_u:
        print(f"  paradiff ulysses / diffusers ulysses = {ours_u / theirs_u:.3f} (target <= 1)")
        figures.append(figure("paradiff Ulysses / diffusers Ulysses (forward)", round(ours_u / theirs_u, 3), "x",
                              "<= 1.0", note=f"median over {args.rounds} round(s)"))
    if ours_u and ours_r:
        print(f"  paradiff ring / paradiff ulysses = {ours_r / ours_u:.3f} (target <= 1.15)")
        figures.append(figure("paradiff ring / paradiff Ulysses", round(ours_r / ours_u, 3), "x", "<= 1.15"))
    for name in ("single process", "paradiff ulysses 2", "paradiff ring 2", "paradiff unified 2x2",
                 "diffusers ulysses_anything 2 + gloo gather patch"):
        div, non = by.get((name, "div")), by.get((name, "nondiv"))
        if div and non and div.ms and non.ms:
            per_token = (non.ms / non.tokens) / (div.ms / div.tokens)
            print(f"  {name}: non-divisible / divisible = {non.ms / div.ms:.3f} in time, {per_token:.3f} per token "
                  "(target within 5%)")
            if name.startswith("paradiff"):
                figures.append(figure(f"{name}: non-divisible / divisible, per token", round(per_token, 3), "x",
                                      "<= 1.05"))
    if "div" in shapes:
        print("  K+V per attention layer and rank, beyond the processor's own local K/V (computed):")
        for line in kv_lines(config, shapes["div"]):
            print(f"    {line}")
    for row in rows:
        if row.comm:
            parts = ", ".join(f"{name} {calls:.0f} calls / {size / MB:.1f} MB" for name, (calls, size) in
                              sorted(row.comm.items()))
            print(f"  comm per forward, {row.case.name}, {row.shape_name}: {parts}")
    patches = sorted({p for row in rows for p in row.patches})
    print(f"  diffusers CPU patches applied in its workers: {patches or 'none'}")
    for row in rows:
        if row.error:
            print(f"  error, {row.case.name}, {shape_label(row.shape)}: {row.error}")
    print(f"# total {time.monotonic() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([dict(case=r.case.name, shape=r.shape, ms=r.ms, times_ms=r.times_ms, delta_mb=r.delta_mb,
                            peak_mb=r.peak_mb, diff=r.diff, error=r.error, comm=r.comm, other_cpu_s=r.other_cpu_s)
                       for r in rows], handle,
                      indent=1)
    if figures:
        write_result("bench_cp", "Context parallelism: FLUX.2-shaped transformer, paradiff vs diffusers", figures)
    failed = [r for r in rows if r.error and not r.case.expect_failure
              and not (r.case.name == "diffusers ulysses 2" and r.shape_name == "nondiv")]  # refuses odd lengths
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
