"""The one load-and-attach sequence every entry point runs: prepare -> agree -> mesh -> read -> agree -> swap ->
attach (`from_pretrained`: one component; `load_pipeline`: every component it loads; `enable_parallelism`: a model
already in memory, so nothing is read).

The order is what the guarantees rest on: every argument, plan and checkpoint header is checked on every rank
before the ranks agree (through the store, not a collective), and only then is the mesh built and any weight read.
A failure on one rank, while preparing or while reading, is raised on every rank at the next agreement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from paradiff.distributed.agreement import agree
from paradiff.distributed.mesh import build_mesh
from paradiff.quant.apply import quantize_model
from paradiff.tensor_parallel.shard import swap_in_sharded_linears


@dataclass
class Component:
    """One model the sequence loads (or, with `checkpoint` None, one already in memory) and attaches."""

    model: nn.Module
    facts: dict[str, Any]  # what every rank must agree on before anything is read
    resolved: Any = None  # the TP plan resolved for this rank, or None: not split
    cp_resolved: Any = None  # the CP plan, or None
    checkpoint: Any = None  # io.checkpoint.Checkpoint, open; None: the weights are in memory already
    source: Any = None  # io weight source that reads `checkpoint` into `model`
    tp_dims: tuple[str, ...] = ("tp",)  # the mesh dimensions whose ranks hold its TP shards
    attach: bool = True  # record the parallel state, CP hooks and forward wrappers on it
    quantization: Any = None  # quant.schemes.QuantScheme: quantize the weights this rank holds, after the swap
    read_s: float = field(default=0.0, init=False)
    quantized: dict[str, int] = field(default_factory=dict, init=False)  # quant.apply.quantize_model's counts
    group: Any = field(default=None, init=False)  # the process group holding its TP shards (None: not split)

    def quantize(self) -> None:
        """Quantize the weights this rank read (its slices and the whole others). Every rank of `group` calls it
        after the ranks agreed that all read their weights: rowwise shards take one all-reduce of row extrema.
        Run after the load's read, and again after every staged re-read."""
        if self.quantization is not None:
            self.quantized = quantize_model(self.model, self.quantization, self.group)


@dataclass
class Prepared:
    components: dict[str, Component]  # name -> component; "" for a single model (facts then keep their own keys)
    parallel: Any  # the ParallelConfig, or None: single process
    device: torch.device
    facts: dict[str, Any] = field(default_factory=dict)  # agreed besides the components' own


def run_load_sequence(stage: str, prepare: Callable[[], Prepared], *, distributed: bool, read: str = "all",
                      progress: bool | None = None, eval_mode: bool = True) -> tuple[Prepared, Any]:
    """Run `prepare` (all local checks, no read), then the sequence; returns what was prepared and the mesh (None
    without a parallel config). `read`: "all", "buffers" (staged: parameters come at their stage) or "none"."""
    import time

    prepared, error = None, None
    try:
        prepared = prepare()
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc
    components = prepared.components if prepared is not None else {}
    try:
        if distributed:
            agree(stage, _facts(prepared) if error is None else None, error)
        elif error is not None:
            raise error
        mesh = build_mesh(prepared.parallel, prepared.device) if prepared.parallel is not None else None
        if read != "none":
            error = None
            try:
                for component in components.values():
                    if component.checkpoint is None:
                        continue
                    started = time.perf_counter()
                    if read == "all":
                        component.source.read(component.model, component.checkpoint, progress)
                    else:
                        component.source.read(component.model, component.checkpoint, parameters=False)
                    component.read_s = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - a read failure on one rank must stop every rank
                error = exc
            if distributed:
                agree(f"{stage} (reading weights)", {"loaded": True}, error)
            elif error is not None:
                raise error
    finally:
        for component in components.values():
            if component.checkpoint is not None:
                component.checkpoint.close()
    from paradiff.api.parallelize import attach

    for component in components.values():
        if component.resolved is not None:
            group = mesh.tp_group if component.tp_dims == ("tp",) else mesh.flat_group(component.tp_dims)
            component.group = group
            swap_in_sharded_linears(component.model, component.resolved, group, weights_are_local=read == "all")
        if read == "all":  # staged: quantized after each stage's read (api/pipeline_wiring.py)
            component.quantize()
        if eval_mode:
            component.model.eval()
        if mesh is not None and component.attach:
            attach(component.model, mesh, component.resolved, component.cp_resolved)
    return prepared, mesh


def _facts(prepared: Prepared) -> dict[str, Any]:
    facts = dict(prepared.facts)
    for name, component in prepared.components.items():
        facts.update(component.facts if name == "" else {f"{name}: {k}": v for k, v in component.facts.items()})
    return facts
