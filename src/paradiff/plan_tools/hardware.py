"""Hardware profiles for the cost model: built-in ones from public specs, and calibrated ones measured here.

A profile gives, per device: the GEMM and attention rates per dtype (FLOP/s), the memory, and per collective a
latency and a bandwidth (`time = latency + wire bytes / bandwidth`, wire bytes as `cost.Traffic.wire` counts them).
The built-in rates are the vendors' dense (no sparsity) datasheet peaks times an achievable fraction (`efficiency`,
written next to each); elementwise ops at the HBM bandwidth; each torch op a 5 us host overhead (a CUDA kernel launch
is about 2-5 us, NVIDIA's figures; PyTorch's eager dispatch adds a few more), issued ahead of the device; the links
are the datasheet's per-direction NVLink / PCIe bandwidth times 0.8 and a typical NCCL small-message latency. They are leads, marked "from public specs"; `paradiff plan --calibrate` measures the
devices at hand instead (`plan_tools/calibrate.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paradiff.plan_tools.cost import CostModelError, Traffic

TERA, GIGA = 1e12, 1e9
GPU_OP_OVERHEAD_S = 5e-6  # per eager torch op: a kernel launch (2-5 us) and PyTorch's dispatch, issued ahead
PUBLIC = "from public specs (vendor datasheet peaks x the efficiency given; not measured)"


@dataclass
class Link:
    latency_s: float
    bandwidth: float  # bytes per second of wire traffic per rank


@dataclass
class HardwareProfile:
    name: str
    source: str
    peak_flops: dict[str, float]  # dtype -> dense peak FLOP/s (MFU's denominator)
    gemm_flops: dict[str, float]  # dtype -> the GEMM rate the model predicts with
    attention_flops: dict[str, float]  # dtype -> attention FLOP/s
    memory_bytes: float
    memory_bandwidth: float
    links: dict[str, Link]  # "all_reduce", "all_to_all", "all_gather", "p2p"
    # how many ranks run at full rate at once (CPU: cores / threads per rank); more ranks share the rate
    concurrent_ranks: int = 1 << 20
    notes: str = ""
    link_by_world: dict[str, dict[str, Link]] = field(default_factory=dict)  # calibrated: "2" -> op -> Link
    # whether a collective issued ahead (ring passes, FSDP prefetch) runs beside the compute; not on a CPU whose
    # ranks have one core each: gloo's transport threads then take turns with the rank's compute on that core
    overlap: bool = True
    # seconds each torch op costs whatever its size (eager dispatch, Python, a kernel launch), and whether the host
    # issues ops ahead of the device (CUDA: a step takes the longer of the device's work and the host's issuing)
    # or is the device (CPU: they add up)
    op_overhead_s: float = 0.0
    host_overlap: bool = True
    # bytes per second of the elementwise mix (norms, modulation, gates, activations) as `cost.ELEMENTWISE_PASSES`
    # counts its bytes; 0: the memory bandwidth
    elementwise_bandwidth: float = 0.0
    # bytes per second of the sequence ranks' packing and concatenation around attention (`cost.ForwardCost.
    # copy_bytes`; calibrated: `calibrate._layout_copies`); 0: the elementwise bandwidth
    copy_bandwidth: float = 0.0
    # a transformer block's measured time over what the rates above predict for it (`calibrate._block_factor`): what
    # isolated micro-benchmarks miss between a block's ops (operands' layouts and caches, clocks); 1: not measured
    block_factor: float = 1.0
    # what FSDP adds to a forward for each unit it gathers and each byte gathered (`calibrate._fsdp_units`); used
    # where nothing overlaps the compute (`overlap` false); 0: not measured, FSDP's gathers priced on the all-gather
    # link
    fsdp_unit_s: float = 0.0
    fsdp_byte_s: float = 0.0

    def link(self, op: str, group: int) -> Link:
        measured = self.link_by_world.get(str(group), {}).get(op)
        if measured is not None:
            return measured
        if self.link_by_world:  # the nearest measured world size
            nearest = min(self.link_by_world, key=lambda world: abs(int(world) - group))
            if op in self.link_by_world[nearest]:
                return self.link_by_world[nearest][op]
        return self.links[op]

    def comm_seconds(self, item: Traffic) -> float:
        link = self.link(item.op, item.group)
        steps = {"all_reduce": 2 * (item.group - 1), "all_gather": item.group - 1, "all_to_all": 1, "p2p": 1}[item.op]
        return item.calls * (link.latency_s * steps + item.wire / link.bandwidth)

    def rate(self, table: dict[str, float], dtype: str) -> float:
        if dtype not in table:
            raise CostModelError(f"profile {self.name!r} has no {dtype} rate; it has {', '.join(sorted(table))}.")
        return table[dtype]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict) -> "HardwareProfile":
        data = dict(data)
        # a wait per collective after compute that calibrations of 2026-12 measured; no longer a term (docs/plan.md)
        data.pop("sync_s", None)
        data["links"] = {op: Link(**link) for op, link in data["links"].items()}
        data["link_by_world"] = {world: {op: Link(**link) for op, link in ops.items()}
                                 for world, ops in data.get("link_by_world", {}).items()}
        return cls(**data)


def _gpu(name: str, bf16_tflops: float, fp8_tflops: float | None, memory_gb: float, hbm_tbs: float,
         link_gbs: float, link_latency_us: float, link_name: str, gemm_efficiency: float = 0.75,
         attention_efficiency: float = 0.55) -> HardwareProfile:
    peak = {"bfloat16": bf16_tflops * TERA, "float16": bf16_tflops * TERA, "float32": bf16_tflops / 2 * TERA}
    if fp8_tflops:
        peak["float8"] = fp8_tflops * TERA
    link = Link(link_latency_us * 1e-6, link_gbs * 0.8 * GIGA)
    return HardwareProfile(
        name=name, source=PUBLIC, peak_flops=peak,
        gemm_flops={dtype: rate * gemm_efficiency for dtype, rate in peak.items()},
        attention_flops={dtype: rate * attention_efficiency for dtype, rate in peak.items()},
        memory_bytes=memory_gb * GIGA, memory_bandwidth=hbm_tbs * TERA,
        links={op: link for op in ("all_reduce", "all_to_all", "all_gather", "p2p")},
        op_overhead_s=GPU_OP_OVERHEAD_S, host_overlap=True,
        notes=f"{link_name} {link_gbs:g} GB/s per direction x 0.8, {link_latency_us:g} us per step; GEMM at "
              f"{gemm_efficiency:.0%} and attention at {attention_efficiency:.0%} of the dense peak; float32 means "
              "TF32 (half the bf16 rate); 5 us per torch op, hidden while the device is busier")


BUILT_IN: dict[str, HardwareProfile] = {profile.name: profile for profile in (
    _gpu("h100-sxm", 989, 1979, 80, 3.35, 450, 8, "NVLink 4"),
    _gpu("h100-pcie", 756, 1513, 80, 2.0, 64, 25, "PCIe 5 x16"),
    _gpu("h200", 989, 1979, 141, 4.8, 450, 8, "NVLink 4"),
    _gpu("b200", 2250, 4500, 180, 8.0, 900, 8, "NVLink 5"),
    _gpu("a100-80gb", 312, None, 80, 2.04, 300, 10, "NVLink 3"),
    _gpu("l40s", 362, 733, 48, 0.864, 32, 25, "PCIe 4 x16"),
    _gpu("rtx4090", 165, 330, 24, 1.008, 32, 30, "PCIe 4 x16 (no NVLink, no P2P: through host memory)"),
)}


def load_profile(name_or_file: str) -> HardwareProfile:
    """A built-in profile by name, or a calibrated profile's JSON file."""
    if name_or_file in BUILT_IN:
        return BUILT_IN[name_or_file]
    path = Path(name_or_file)
    if path.is_file():
        try:
            return HardwareProfile.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError) as exc:
            raise CostModelError(f"profile file {path} is not a paradiff hardware profile ({exc}); write one with "
                                 "`paradiff plan --calibrate --save FILE`.") from None
    raise CostModelError(f"unknown profile {name_or_file!r}: built-in profiles are {', '.join(BUILT_IN)}, or give "
                         "the JSON file `paradiff plan --calibrate --save FILE` wrote.")
