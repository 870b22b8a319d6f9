"""`paradiff plan`'s engine: every mesh of a world size, its predicted memory and times, feasibility, a recommendation.

Times come from the cost model (`cost.py`) and a hardware profile (`hardware.py`):
- a rank's forward = its GEMM FLOPs / the GEMM rate + its attention FLOPs / the attention rate + its elementwise
  bytes / the elementwise bandwidth + the sequence ranks' copies / the copy bandwidth (the device's time), and its
  torch ops x the per-op overhead (the host's time): added where the host is the device (CPU), the longer of the two where the host issues ahead (CUDA);
  times the profile's block factor (a calibrated transformer block's time over this sum, `calibrate._block_factor`);
  times world / concurrent_ranks where more ranks than that share the devices (a CPU's cores), plus the
  collectives it waits on; ring passes hide behind the attention on the block just received, FSDP's all-gathers
  behind the forward (prefetch), each only up to that compute, and only where the profile overlaps (not on CPU
  ranks; there a calibrated profile prices FSDP's units and bytes as its FSDP probe measured them);
- a step = the forwards one rank runs per step (2 with CFG on one rank, 1 with cfg2) x the forward;
- latency = steps x step (the text encoders and the VAE are left out).

Feasibility: heads split evenly over tp x ulysses (the plans keep head splits even); cfg only where the pipeline
guides (its CFG rule, `plans/pipelines.py`, at the given scale) and only at its branch count; fsdp equals ulysses x
ring where they are on (`--fsdp` shards over the same ranks); the per-rank memory fits the device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paradiff.plan_tools.cost import (DTYPE_BYTES, CostModelError, ForwardCost, Memory, Mesh, ModelShape, forward_cost,
                                      memory, model_shape)
from paradiff.plan_tools.hardware import HardwareProfile


@dataclass
class Prediction:
    mesh: Mesh
    memory: Memory
    forward: ForwardCost
    forwards: float = 1.0  # transformer forwards per step on one rank
    compute_s: float = 0.0  # one forward's compute on one rank
    comm_s: float = 0.0  # one forward's exposed communication
    step_s: float = 0.0
    latency_s: float = 0.0
    images_per_s: float = 0.0
    imbalance: float = 1.0  # the busiest rank's heads over an even share, where tp x ulysses does not divide them
    problems: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.problems


@dataclass
class ModelSource:
    name: str
    config: dict[str, Any]
    pipeline_class: str | None


def read_model(model: str) -> ModelSource:
    """A reference name (`plans/reference_configs.py`), a pipeline folder (model_index.json + transformer/), a
    transformer folder, or a config.json file. Reads configs only, never weights."""
    from paradiff.plans.reference_configs import REFERENCE_CONFIGS

    if model.lower() in REFERENCE_CONFIGS:
        pipeline, config = REFERENCE_CONFIGS[model.lower()]
        return ModelSource(model.lower(), config, pipeline)
    path = Path(model)
    pipeline = None
    if path.is_dir() and (path / "model_index.json").is_file():
        from paradiff.errors import CheckpointError
        from paradiff.io.folders import read_pipeline_index

        try:
            pipeline = read_pipeline_index(path, modular=False).class_name
        except CheckpointError as exc:
            raise CostModelError(str(exc)) from None
        path = path / "transformer"
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CostModelError(f"model {model!r} is not a reference name ({', '.join(REFERENCE_CONFIGS)}), a pipeline "
                             "or transformer folder, nor a config.json file (the Hub is not read: download the "
                             "folder's configs first).")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise CostModelError(f"{path} is not JSON ({exc}).") from None
    return ModelSource(model, config, pipeline)


def guidance_branches(pipeline_class: str | None, scale: float | None = None, negative_prompt: bool = False) -> int:
    """How many transformer calls per step the pipeline makes at this guidance scale (1 or its CFG branches)."""
    from paradiff.plans.pipelines import pipeline_spec

    rule = pipeline_spec(pipeline_class).cfg
    if rule is None:
        return 1
    if (rule.default_scale if scale is None else scale) <= rule.threshold:
        return 1
    if rule.needs_negative_prompt and not negative_prompt:
        return 1
    return rule.branches


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(world: int) -> list[Mesh]:
    """Every tp x ulysses x ring x cfg x data x fsdp mesh of `world` ranks that `--fsdp` can make: fsdp 1, or equal to
    ulysses x ring (over the same ranks), or, without them, a factor of its own."""
    found = []
    for tp in _divisors(world):
        for ulysses in _divisors(world // tp):
            for ring in _divisors(world // tp // ulysses):
                for cfg in _divisors(world // tp // ulysses // ring):
                    rest = world // tp // ulysses // ring // cfg
                    if ulysses * ring > 1:
                        found += [Mesh(tp, ulysses, ring, cfg, rest), Mesh(tp, ulysses, ring, cfg, rest, ulysses * ring)]
                        continue
                    found += [Mesh(tp, 1, 1, cfg, rest // fsdp, fsdp) for fsdp in _divisors(rest)]
    return found


def compute_seconds(cost: ForwardCost, profile: HardwareProfile, dtype: str, share: float = 1.0
                    ) -> tuple[float, float]:
    """(a forward's compute on one rank, of which its attention) from the profile's rates: the device's terms and
    the host's ops added (CPU) or the longer of the two (CUDA), times the profile's block factor; `share`: how many
    ranks share a device's rate."""
    linear_s = cost.linear_flops / profile.rate(profile.gemm_flops, dtype) * share
    attention_s = cost.attention_flops / profile.rate(profile.attention_flops, dtype) * share
    elementwise_s = cost.elementwise_bytes / (profile.elementwise_bandwidth or profile.memory_bandwidth) * share
    copy_s = cost.copy_bytes / (profile.copy_bandwidth or profile.elementwise_bandwidth
                                or profile.memory_bandwidth) * share
    device_s = linear_s + attention_s + elementwise_s + copy_s
    host_s = cost.ops * profile.op_overhead_s * share
    compute = max(device_s, host_s) if profile.host_overlap else device_s + host_s
    return compute * profile.block_factor, attention_s * profile.block_factor


def predict(shape: ModelShape, latent: int, mesh: Mesh, profile: HardwareProfile, *, steps: int = 1,
            dtype: str = "bfloat16", branches: int = 1, device_memory: float | None = None) -> Prediction:
    b = DTYPE_BYTES[dtype]
    cost = forward_cost(shape, latent, b, mesh)
    prediction = Prediction(mesh, memory(shape, latent, b, mesh), cost)
    share = max(1.0, mesh.world / profile.concurrent_ranks)
    compute, attention_s = compute_seconds(cost, profile, dtype, share)
    split = mesh.tp * mesh.ulysses
    if shape.heads % split:  # split unevenly (the runtime takes any head count): the busiest rank sets the pace,
        # on its whole forward under TP (a little over: the parts TP leaves whole), on its attention under Ulysses
        prediction.imbalance = -(-shape.heads // split) * split / shape.heads
        extra = (prediction.imbalance - 1) * (compute if mesh.tp > 1 else attention_s)
        compute, attention_s = compute + extra, attention_s * prediction.imbalance
    exposed = 0.0
    for item in cost.traffic:
        seconds = profile.comm_seconds(item)
        if item.fsdp and profile.fsdp_unit_s and not profile.overlap:  # FSDP as calibration measured it, exposed
            exposed += item.calls * (profile.fsdp_unit_s + item.size * profile.fsdp_byte_s)
        elif item.overlapped and not profile.overlap:  # nothing runs beside the compute (a CPU core per rank)
            exposed += seconds
        elif item.op == "p2p":  # each pass hides behind the attention on the block in hand
            exposed += max(0.0, seconds - attention_s * (mesh.ring - 1) / mesh.ring)
        elif item.overlapped:
            exposed += max(0.0, seconds - compute)
        else:
            exposed += seconds
    prediction.compute_s, prediction.comm_s = compute, exposed
    prediction.forwards = forwards = branches / mesh.cfg if mesh.cfg <= branches else 1
    prediction.step_s = forwards * (compute + exposed)
    prediction.latency_s = steps * prediction.step_s
    prediction.images_per_s = mesh.data / prediction.latency_s if prediction.latency_s else 0.0
    prediction.problems = problems(shape, latent, mesh, branches, prediction.memory,
                                   device_memory if device_memory is not None else profile.memory_bytes)
    return prediction


def problems(shape: ModelShape, latent: int, mesh: Mesh, branches: int, used: Memory, device_memory: float
             ) -> list[str]:
    found = []
    if mesh.tp > shape.heads:
        found.append(f"tp{mesh.tp} is more ranks than the {shape.heads} heads (each TP rank holds a whole head)")
    if mesh.cfg > 1 and branches == 1:
        found.append("cfg needs a pipeline that guides (a CFG pipeline with guidance > 1): this run makes one "
                     "transformer call per step")
    elif mesh.cfg > 1 and mesh.cfg != branches:
        found.append(f"cfg{mesh.cfg}: the pipeline makes {branches} calls per step; cfg must be {branches}")
    if mesh.fsdp > 1 and mesh.sequence > 1 and mesh.fsdp != mesh.sequence:
        found.append(f"fsdp{mesh.fsdp} with ulysses x ring = {mesh.sequence}: fsdp shards over the same ranks and "
                     f"must equal it")
    if latent < mesh.sequence:
        found.append(f"{latent} tokens cannot be split over {mesh.sequence} sequence ranks")
    if used.total > device_memory:
        found.append(f"needs {used.total / 1e9:.1f} GB per rank, the device has {device_memory / 1e9:.1f} GB")
    return found


@dataclass
class Plan:
    source: ModelSource
    shape: ModelShape
    latent: int
    steps: int
    branches: int
    profile: HardwareProfile
    predictions: list[Prediction]
    recommended: Prediction | None
    reason: str


def plan(model: str, *, height: int, width: int, frames: int | None = None, steps: int = 50, world: int = 1,
         profile: HardwareProfile, dtype: str = "bfloat16", device_memory_gb: float | None = None,
         guidance_scale: float | None = None, negative_prompt: bool = False) -> Plan:
    if dtype not in DTYPE_BYTES:
        raise CostModelError(f"dtype {dtype!r}: valid are {', '.join(DTYPE_BYTES)}.")
    if world < 1:
        raise CostModelError(f"world {world}: give the number of ranks, 1 or more.")
    source = read_model(model)
    shape = model_shape(source.config)
    latent = shape.latent_tokens(height, width, frames)
    branches = guidance_branches(source.pipeline_class, guidance_scale, negative_prompt)
    device_memory = device_memory_gb * 1e9 if device_memory_gb is not None else None
    predictions = sorted((predict(shape, latent, mesh, profile, steps=steps, dtype=dtype, branches=branches,
                                  device_memory=device_memory) for mesh in meshes(world)),
                         key=lambda p: (not p.feasible, p.latency_s, -p.images_per_s, p.memory.total))
    feasible = [p for p in predictions if p.feasible]
    if feasible:  # within 1% of the fastest, the simplest: FSDP's overlap is modelled perfect, so fewer gathers
        near = [p for p in feasible if p.latency_s <= feasible[0].latency_s * 1.01]
        simplest = min(near, key=lambda p: (p.mesh.fsdp, p.mesh.cfg == 1, -p.images_per_s, p.memory.total))
        feasible.remove(simplest)
        feasible.insert(0, simplest)
    recommended, reason = (feasible[0], _reason(feasible, predictions)) if feasible else \
        (None, "no mesh fits: " + "; ".join(sorted({problem for p in predictions for problem in p.problems})[:4]))
    return Plan(source, shape, latent, steps, branches, profile, predictions, recommended, reason)


def _reason(feasible: list[Prediction], every: list[Prediction]) -> str:
    best = feasible[0]
    parts = [f"lowest predicted latency ({best.latency_s:.2f} s)"]
    runner = next((p for p in feasible[1:] if p.mesh.fsdp == 1 or best.mesh.fsdp > 1), None)
    if runner is not None:
        parts.append(f"next {runner.mesh.name} at {runner.latency_s:.2f} s "
                     f"(+{max(0.0, runner.latency_s / best.latency_s - 1) * 100:.0f}%)")
    compute_share = best.compute_s / (best.compute_s + best.comm_s) if best.compute_s + best.comm_s else 1.0
    parts.append(f"{compute_share:.0%} of its forward is compute")
    excluded = len(every) - len(feasible)
    if excluded:
        parts.append(f"{excluded} meshes excluded (see their notes)")
    return "; ".join(parts)
