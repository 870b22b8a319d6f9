"""`paradiff plan --calibrate`: measure the devices at hand with short micro-benchmarks and make a hardware profile.

Measured, on every rank at once (so that ranks sharing a CPU's cores or a host's links measure what they will get):
- the GEMM rate per dtype (square products of --gemm-size), the attention rate (torch's SDPA, `heads` x tokens of
  head dim 64 or 128), the memory bandwidth (a large copy, bytes read + written), the elementwise bandwidth (a
  block's mix of norms, modulation, gated residual and activations, at activation-like sizes), the copy bandwidth
  of Ulysses' packing and concatenation around attention (`_layout_copies`) and the seconds per torch op (a toy-width block of 43 ops at 4 tokens, as diffusers writes its blocks);
  then that block at a model's width and token count, against what the rates above predict for it: the block
  factor every predicted forward is multiplied by (`_block_factor`);
- with world > 1, each collective the cost model uses, through `distributed/comm.py` (all-reduce as TP sums,
  all-to-all as Ulysses exchanges, all-gather as FSDP / CFG gathers, ring passes as p2p) at a small and a large
  size: the small one's time is the latency, the difference the bandwidth (wire bytes as `cost.Traffic` counts).
  Each size is timed over `LATENCY_BURST` calls and divided (one call's time moved 5x between runs on a quiet CPU
  machine). On CUDA the calls run back to back. On CPU each call follows a compute of about a millisecond or more
  (`GAP_GEMM`), as a forward's collectives follow its blocks' work, and the compute alone is taken off: gloo's
  threads sleep while the rank computes, and a collective that wakes them costs more than one of a burst, with
  a long tail (on a 2-core Intel Xeon VM, 2026-12-07: a 64 KiB all-reduce 0.35 ms back to back, 0.7-1.5 ms on
  average after 1-7 ms of compute, some calls 3-5 ms; inside a FLUX.2-shaped tp2 step the same, 1.2 ms on average);
- with world > 1, what FSDP2 adds to a forward per unit it gathers and per byte (`_fsdp_units`: a chain of linears
  sharded by paradiff's FSDP against the same chain whole): on a CPU, where nothing runs beside a rank's compute, it
  prices FSDP's gathers, their copies and FSDP2's hooks together (2026-12-07, Intel Xeon VM: about 1.2 ms a unit
  and 0.5 ms a MB; the all-gather link alone had priced FLUX.2- and Wan-shaped fsdp2 x ulysses2 steps 18-28% low).

On CPU the ranks are gloo processes spawned on 127.0.0.1 (`distributed/spawn.run_ranks`), one torch thread each; on
CUDA one NCCL rank per device. The rates are medians of a few repeats; a loaded machine gives a slow profile.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from functools import partial
from typing import Any

from paradiff.plan_tools.cost import Traffic
from paradiff.plan_tools.hardware import HardwareProfile, Link

OPS = ("all_reduce", "all_to_all", "all_gather", "p2p")


def _timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# The ops of `_probe_block`, counted by hand as `cost.OPS_PER_BLOCK` counts a block's: top-level torch calls.
PROBE_BLOCK_OPS = 43


def _probe_block(device: str, width: int = 64, heads: int = 2, tokens: int = 4, dtype=None):
    """An adaLN transformer block at toy width and 4 tokens, written as diffusers writes its blocks (module calls,
    chunked modulation, RMS-normed and rotated q / k, SDPA, a gated residual, a tanh-GELU MLP): its time is its ops'
    fixed costs (dispatch, Python, launches), not their arithmetic. Returns a closure running it once."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ProbeBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = width
            self.modulation = nn.Linear(d, 6 * d)
            self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
            self.qkv = nn.Linear(d, 3 * d)
            self.norm_q, self.norm_k = nn.RMSNorm(d // heads), nn.RMSNorm(d // heads)
            self.out = nn.Linear(d, d)
            self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
            self.up, self.act, self.down = nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)

        def forward(self, x, temb, cos, sin):  # ops per line, 43 in all
            shift1, scale1, gate1, shift2, scale2, gate2 = \
                self.modulation(F.silu(temb)).unsqueeze(1).chunk(6, dim=-1)  # 4
            h = self.norm1(x) * (1 + scale1) + shift1  # 4
            q, k, v = self.qkv(h).unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)  # 4
            q, k = self.norm_q(q), self.norm_k(k)  # 2
            q = q * cos + torch.cat((-q[..., 1::2], q[..., ::2]), dim=-1) * sin  # 7
            k = k * cos + torch.cat((-k[..., 1::2], k[..., ::2]), dim=-1) * sin  # 7
            attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)  # 3
            x = x + gate1 * self.out(attended)  # 3
            h = self.norm2(x) * (1 + scale2) + shift2  # 4
            return x + gate2 * self.down(self.act(self.up(h)))  # 5

    dtype = dtype or torch.float32
    block = ProbeBlock().to(device, dtype).eval()
    x, temb = (torch.randn(1, tokens, width, device=device, dtype=dtype),
               torch.randn(1, width, device=device, dtype=dtype))
    cos, sin = (torch.randn(tokens, width // heads, device=device, dtype=dtype) for _ in range(2))

    def run():
        with torch.no_grad():
            block(x, temb, cos, sin)
    return run


# The reference block `_block_factor` times: `_probe_block` at a small model's width, on CPU (heads x 64, tokens),
# and at FLUX.1's on CUDA
REFERENCE_BLOCK = {"cpu": (4, 512), "cuda": (24, 4096)}


def _block_factor(device: str, dtype, rates: dict[str, Any], repeats: int, sync) -> float:
    """A transformer block's time (`_probe_block` at `REFERENCE_BLOCK`'s size) over what the cost model predicts for
    it from this device's measured rates (`planner.compute_seconds`, the block counted as `cost.block_cost` counts a
    single-stream block: 12 d^2 weights per token, attention over its tokens, its elementwise passes and ops). On the
    2-core Intel Xeon, 2026-12-07: a FLUX.2-shaped forward's GEMMs ran at 134 GFLOP/s against 166 for the square
    probe, its attention 23% slower than the probe's."""
    import torch

    from paradiff.plan_tools.cost import BlockShape, block_cost
    from paradiff.plan_tools.hardware import HardwareProfile
    from paradiff.plan_tools.planner import compute_seconds

    heads, tokens = REFERENCE_BLOCK["cuda" if device.startswith("cuda") else "cpu"]
    width = heads * 64
    block = _probe_block(device, width=width, heads=heads, tokens=tokens, dtype=dtype)
    measured = _timed(block, max(repeats, 9), sync)
    name = str(dtype).removeprefix("torch.")
    shape = BlockShape("single", 1, heads, 64, 4 * width, ops=PROBE_BLOCK_OPS)
    profile = HardwareProfile(
        name="probe", source="", peak_flops={}, gemm_flops={name: rates["gemm"][name]},
        attention_flops={name: rates["attention"][name]}, memory_bytes=0.0,
        memory_bandwidth=rates["memory_bandwidth"], links={}, op_overhead_s=rates["op_overhead_s"],
        host_overlap=device.startswith("cuda"), elementwise_bandwidth=rates["elementwise_bandwidth"],
        copy_bandwidth=rates["copy_bandwidth"])
    predicted, _ = compute_seconds(block_cost(shape, tokens, 0, torch.tensor([], dtype=dtype).element_size()),
                                   profile, name)
    return measured / predicted


def _elementwise_mix(device: str, dtype, numel: int, width: int = 256):
    """The elementwise ops a block runs, on `numel` elements `width` wide: a layer norm (2 passes: read, write), a
    modulation x (1 + scale) + shift (4), a gated residual x + g y (5), a tanh GELU and a SiLU (2 each), 15 passes
    as `cost.ELEMENTWISE_PASSES` counts them. Returns (closure, bytes it moves by that count)."""
    import torch
    import torch.nn.functional as F

    rows = max(1, numel // width)
    x, y = (torch.randn(rows, width, device=device).to(dtype) for _ in range(2))
    scale, shift, gate = (torch.randn(width, device=device).to(dtype) for _ in range(3))

    def run():
        F.layer_norm(x, (width,))
        x * (1 + scale) + shift
        x + gate * y
        F.gelu(x, approximate="tanh")
        F.silu(x)
    return run, 15 * x.numel() * x.element_size()


def _layout_copies(device: str, dtype, tokens: int, heads: int = 4, head_dim: int = 64):
    """Ulysses' copies around one attention call at 2 ranks, as `context_parallel/attention.py` makes them: q, k and
    v (batch 1, `heads` x `tokens` x `head_dim`) packed by head halves into one flat buffer, the received halves
    concatenated along the sequence, then the output's halves packed and concatenated along the heads. Returns
    (closure, bytes it moves as `cost.ULYSSES_COPY_PASSES` counts them: 16 passes over one of q, k, v)."""
    import torch

    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device).to(dtype) for _ in range(3))
    half = heads // 2
    numel = q.numel()

    def run():
        pieces = [t.narrow(1, start, half) for start in (0, half) for t in (q, k, v)]
        flat = torch.empty(3 * numel, dtype=q.dtype, device=device)
        for piece, chunk in zip(pieces, flat.split([piece.numel() for piece in pieces])):
            chunk.view(piece.shape).copy_(piece)
        received = [part.view(3, 1, half, tokens, head_dim) for part in flat.split(3 * numel // 2)]
        qkv = torch.cat(received, dim=3)
        out = qkv[0]
        send = torch.empty(out.numel(), dtype=out.dtype, device=device)
        for part, chunk in zip(out.split(tokens, dim=2), send.split([out.numel() // 2] * 2)):
            chunk.view(part.shape).copy_(part)
        torch.cat([part.view(1, half, tokens, head_dim) for part in send.split(out.numel() // 2)], dim=1)
    return run, 16 * numel * q.element_size()


def measure_local(device: str, dtypes: tuple[str, ...], gemm_size: int, attention_tokens: int,
                  repeats: int, copy_numel: int | None = None, elementwise_numel: int | None = None
                  ) -> dict[str, Any]:
    """GEMM and attention FLOP/s per dtype, the copy bandwidth, the elementwise mix's bandwidth (in the first dtype,
    on `elementwise_numel` elements: the activations' size decides whether they stay in a CPU's caches) and the
    seconds per torch op (`_probe_block`: its 43 ops, many times over, divided) of this process's device; and the
    block factor (`_block_factor`, in the first dtype)."""
    import torch
    import torch.nn.functional as F

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    generator = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {"gemm": {}, "attention": {}}
    for name in dtypes:
        dtype = getattr(torch, name)
        a, b = (torch.randn(gemm_size, gemm_size, device=device, generator=generator).to(dtype) for _ in range(2))
        out["gemm"][name] = 2 * gemm_size ** 3 / _timed(lambda: a @ b, repeats, sync)
        heads, head_dim = 8, 64
        q, k, v = (torch.randn(1, heads, attention_tokens, head_dim, device=device, generator=generator).to(dtype)
                   for _ in range(3))
        out["attention"][name] = 4 * attention_tokens ** 2 * heads * head_dim / _timed(
            lambda: F.scaled_dot_product_attention(q, k, v), repeats, sync)
    source = torch.randn(copy_numel or (16 * 2 ** 20 if device == "cpu" else 256 * 2 ** 20), device=device,
                         generator=generator)
    target = torch.empty_like(source)
    out["memory_bandwidth"] = 2 * source.numel() * 4 / _timed(lambda: target.copy_(source), repeats, sync)
    mix, moved = _elementwise_mix(device, getattr(torch, dtypes[0]),
                                  elementwise_numel or (2 ** 18 if device == "cpu" else 2 ** 26))
    out["elementwise_bandwidth"] = moved / _timed(mix, repeats, sync)
    copies, copied = _layout_copies(device, getattr(torch, dtypes[0]), max(2, (elementwise_numel or (
        2 ** 18 if device == "cpu" else 2 ** 26)) // 256))
    out["copy_bandwidth"] = copied / _timed(copies, repeats, sync)
    block, calls = _probe_block(device), 20

    def blocks():
        for _ in range(calls):
            block()
    out["op_overhead_s"] = _timed(blocks, repeats, sync) / (calls * PROBE_BLOCK_OPS)
    out["block_factor"] = _block_factor(device, getattr(torch, dtypes[0]), out, repeats, sync)
    return out


def _collective(op: str, numel: int, group, device: str):
    """A closure issuing one `op` of `numel` float32 elements per rank, through paradiff's named collectives."""
    import torch
    import torch.distributed as dist

    from paradiff.distributed import comm

    world = dist.get_world_size(group)
    tensor = torch.ones(numel, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce_tp(tensor, group)
    if op == "all_to_all":
        piece = numel // world
        send = torch.ones(piece * world, device=device)
        return lambda: comm.all_to_all_uneven(send, [piece] * world, [(piece,)] * world, group)
    if op == "all_gather":
        piece = torch.ones(numel // world, device=device)
        return lambda: comm.all_gather_pieces(piece, group)
    return lambda: comm.ring_pass_wait(comm.ring_pass_start([tensor], group)[1])


LATENCY_BURST = 30
# the square GEMM each CPU collective follows (`_in_context`): a few milliseconds of one core's float32 (2 x 512^3
# FLOPs, 2-5 ms at 50-150 GFLOP/s), what a forward computes between its collectives at the sizes calibrated
GAP_GEMM = 512


def _in_context(issue, gap, calls: int, repeats: int, sync) -> float:
    """Seconds one collective costs when it follows a compute (`gap`, or None: back to back): `calls` rounds of the
    compute then the collective, less `calls` computes alone (timed alternately, medians of `repeats`), divided.
    The mean over the calls keeps what a forward pays: the slow wake-ups as well as the fast ones. Never less than
    the calls back to back take (where noise in the computes' time hides the difference: a loaded machine)."""
    def both():
        for _ in range(calls):
            if gap is not None:
                gap()
            issue()

    def computing():
        for _ in range(calls):
            gap()

    def back_to_back():
        for _ in range(calls):
            issue()
    floor = _timed(back_to_back, repeats, sync) / calls
    if gap is None:
        return floor
    with_gap, alone = [], []
    both()
    for _ in range(repeats):
        with_gap.append(_timed(both, 1, sync))
        alone.append(_timed(computing, 1, sync))
    return max(floor, (statistics.median(with_gap) - statistics.median(alone)) / calls)


def _wire(op: str, world: int, numel: int) -> float:
    return Traffic(op, world, 1, numel * 4).wire


FSDP_UNITS = 8  # the units of the FSDP probe's chain (`_fsdp_units`)


def _fsdp_units(device: str, widths: tuple[int, int], repeats: int, sync) -> dict[str, float]:
    """What FSDP2 adds to a forward per unit it gathers, through paradiff's own sharding (`fsdp/apply.shard_weights`:
    the in-place gather on CPU, the prefetch one unit ahead): a chain of `FSDP_UNITS` square linears (64 rows of
    input), sharded over every rank, timed against the same chain unsharded, at two widths. The extra time per unit
    at the narrow width, less its bytes' share, is `unit_s` (FSDP2's hooks and copies' setup, the gather's
    latency); the difference between the widths per gathered (whole) byte is `byte_s` (the transport, the copy in
    and the copy out). What a forward loses to FSDP where nothing runs beside its compute (a CPU core per rank)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from paradiff.distributed import comm
    from paradiff.fsdp.apply import shard_weights

    extra = {}
    for width in widths:
        plain = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(FSDP_UNITS)]).to(device).eval()
        sharded = copy.deepcopy(plain)
        mesh = DeviceMesh.from_group(dist.group.WORLD, torch.device(device).type,
                                     mesh_dim_names=(f"calibrate-fsdp-{width}",))
        shard_weights(sharded, [(str(i), unit) for i, unit in enumerate(sharded)], mesh, torch.device(device))
        x = torch.randn(64, width, device=device)
        models = {"plain": plain, "sharded": sharded}
        times = {name: [] for name in models}
        with torch.no_grad():
            for _ in range(max(3, repeats)):  # alternately, so a slow moment of the machine lands on both
                for name, model in models.items():
                    comm.barrier()
                    times[name].append(_timed(partial(model, x), 3, sync))
        extra[width] = max(0.0, statistics.median(times["sharded"]) - statistics.median(times["plain"])) / FSDP_UNITS
    narrow, wide = widths
    unit_bytes = {width: width * width * 4 for width in widths}
    byte_s = max(0.0, (extra[wide] - extra[narrow]) / (unit_bytes[wide] - unit_bytes[narrow]))
    return {"unit_s": max(0.0, extra[narrow] - byte_s * unit_bytes[narrow]), "byte_s": byte_s}


def calibrate_rank(rank: int, world_size: int, *, device: str, dtypes: tuple[str, ...], gemm_size: int,
                   attention_tokens: int, sizes: tuple[int, int], repeats: int, copy_numel: int | None = None,
                   elementwise_numel: int | None = None, burst: int = LATENCY_BURST,
                   gap_gemm: int = GAP_GEMM, fsdp_widths: tuple[int, int] | None = None) -> dict[str, Any]:
    """One rank's measurements (run by run_ranks: the process group exists when world_size > 1); `burst`: the
    collectives timed per repeat (`LATENCY_BURST`; fewer in tests); `gap_gemm`: the size of the square GEMM each
    follows on CPU (`GAP_GEMM`; smaller in tests); `fsdp_widths`: the FSDP probe's two unit widths (`_fsdp_units`;
    default 128 and 1024 on CPU, 1024 and 4096 on CUDA)."""
    import torch
    import torch.distributed as dist

    from paradiff.distributed import comm

    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device(device))
    if world_size > 1:
        comm.barrier()  # every rank computes at once, as the ranks of a mesh will
    result = measure_local(device, dtypes, gemm_size, attention_tokens, repeats, copy_numel, elementwise_numel)
    result["links"] = {}
    if world_size > 1:
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        group = dist.group.WORLD
        gap = None
        if device == "cpu":
            a = torch.randn(gap_gemm, gap_gemm)

            def gap():
                a @ a
        for op in OPS:
            small, large = sizes
            timed = {}
            for numel in (small, large):
                comm.barrier()
                timed[numel] = _in_context(_collective(op, numel, group, device), gap, burst, repeats, sync)
            latency = timed[small]
            extra = timed[large] - timed[small]
            steps = {"all_reduce": 2 * (world_size - 1), "all_gather": world_size - 1}.get(op, 1)
            # where noise hides the difference (a loaded machine), the whole large call's time: a lower bound
            bandwidth = ((_wire(op, world_size, large) - _wire(op, world_size, small)) / extra
                         if extra > 0.1 * timed[large] else _wire(op, world_size, large) / timed[large])
            result["links"][op] = {"latency_s": latency / steps, "bandwidth": bandwidth}
        comm.barrier()
        result["fsdp"] = _fsdp_units(device, fsdp_widths or ((1024, 4096) if device.startswith("cuda") else
                                                            (128, 1024)), repeats, sync)
    return result


def calibrate(world: int = 2, *, device: str | None = None, dtypes: tuple[str, ...] | None = None,
              gemm_size: int | None = None, attention_tokens: int | None = None,
              sizes: tuple[int, int] | None = None, repeats: int = 3, name: str | None = None) -> HardwareProfile:
    """Measure `world` ranks on this machine's devices; a profile whose links hold the measured world size."""
    import torch

    from paradiff.distributed.spawn import run_ranks

    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    device = "cuda" if cuda else "cpu"
    dtypes = dtypes or (("bfloat16", "float16", "float32") if cuda else ("float32", "bfloat16"))
    gemm_size = gemm_size or (8192 if cuda else 256)  # CPUs without bf16 units take seconds on larger bf16 GEMMs
    attention_tokens = attention_tokens or (8192 if cuda else 512)
    sizes = sizes or ((1024, 64 * 2 ** 20) if cuda else (256, 2 ** 20))
    kwargs = dict(device=device, dtypes=tuple(dtypes), gemm_size=gemm_size, attention_tokens=attention_tokens,
                  sizes=sizes, repeats=repeats)
    if world == 1:
        results = [calibrate_rank(0, 1, **kwargs)]
    else:
        results = run_ranks(calibrate_rank, world, kwargs=kwargs, gloo_timeout_s=120.0 if not cuda else None,
                            timeout_s=600.0)
    notes = (f"GEMM {gemm_size}^3, attention {attention_tokens} tokens x 8 heads x 64, collectives at {sizes[0]} "
             f"and {sizes[1]} float32 elements{'' if cuda else f', each after a {GAP_GEMM}^3 GEMM'}, median of "
             f"{repeats}; one torch thread per rank on CPU")
    return profile_from(results, world=world, device=device, dtypes=tuple(dtypes), notes=notes, name=name)


def profile_from(results: list[dict[str, Any]], *, world: int, device: str, dtypes: tuple[str, ...], notes: str,
                 name: str | None = None) -> HardwareProfile:
    """The profile of every rank's measurements: the slowest rank's rates, the worst latency and bandwidth."""
    import torch

    cuda = device == "cuda"
    slowest = {kind: {dtype: min(r[kind][dtype] for r in results) for dtype in dtypes}
               for kind in ("gemm", "attention")}
    links = {op: Link(max(r["links"][op]["latency_s"] for r in results),
                      min(r["links"][op]["bandwidth"] for r in results)) for op in results[0]["links"]}
    if cuda:
        label, memory = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
        concurrent = torch.cuda.device_count()
    else:
        label = platform.processor() or platform.machine()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        concurrent = len(os.sched_getaffinity(0))
    return HardwareProfile(
        name=name or f"calibrated-{device}", peak_flops=dict(slowest["gemm"]), gemm_flops=dict(slowest["gemm"]),
        source=f"calibrated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {label}, "
               f"{world} rank(s)",
        attention_flops=dict(slowest["attention"]), memory_bytes=float(memory),
        memory_bandwidth=min(r["memory_bandwidth"] for r in results),
        elementwise_bandwidth=min(r["elementwise_bandwidth"] for r in results),
        copy_bandwidth=min(r.get("copy_bandwidth", 0.0) for r in results),
        op_overhead_s=max(r["op_overhead_s"] for r in results), host_overlap=cuda,
        block_factor=statistics.median(r.get("block_factor", 1.0) for r in results),
        links=links or {op: Link(0.0, float("inf")) for op in OPS},
        link_by_world={str(world): links} if links else {}, concurrent_ranks=concurrent, notes=notes, overlap=cuda,
        fsdp_unit_s=max((r["fsdp"]["unit_s"] for r in results if "fsdp" in r), default=0.0),
        fsdp_byte_s=max((r["fsdp"]["byte_s"] for r in results if "fsdp" in r), default=0.0))
