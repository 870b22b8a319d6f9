"""The one load-and-attach sequence every entry point runs: prepare -> agree -> mesh -> [row extrema -> agree ->
all-reduce] -> read (quantizing each weight as it is read) -> agree -> swap (+ install the quantized weights) ->
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
from paradiff.api.attach import attach
from paradiff.api.parallelisms import REGISTRY, resolve_plans
from paradiff.distributed.parallelism import Registry
from paradiff.quant.apply import (ReadQuantizer, column_split_weights, quantize_model, reduce_row_extrema,
                                  row_extrema)


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
    quantization: Any = None  # quant.schemes.QuantScheme: quantize each weight this rank reads
    read_s: float = field(default=0.0, init=False)
    quantized: dict[str, int] = field(default_factory=dict, init=False)  # quant.apply's counts (quantized, bytes)
    group: Any = field(default=None, init=False)  # the process group holding its TP shards (None: not split)
    # FSDP (api/fsdp.py): the repeated blocks it shards one unit each (None: not sharded), then their names
    blocks: list[tuple[str, nn.Module]] | None = None
    prefetch_across_lists: bool = True  # False for a text encoder (fsdp/apply.py: shard_weights)
    fsdp_blocks: list[str] = field(default_factory=list, init=False)
    # every enabled parallelism's resolved plan, by name (None: resolved by the sequence, after `prepare`)
    plans: dict[str, Any] | None = None

    def quantize(self) -> None:
        """Quantize the weights this rank holds in the load dtype (its slices and the whole others): after every
        staged re-read (a resident load quantizes each weight as it reads it, `run_load_sequence`), and to wrap
        GGUF weights read packed. Every rank of `group` calls it after the ranks agreed that all read their
        weights: column slices take one all-reduce of row extrema."""
        if self.quantization is not None:
            self.quantized = quantize_model(self.model, self.quantization, self.group)


@dataclass
class Prepared:
    components: dict[str, Component]  # name -> component; "" for a single model (facts then keep their own keys)
    parallel: Any  # the ParallelConfig, or None: single process
    device: torch.device
    facts: dict[str, Any] = field(default_factory=dict)  # agreed besides the components' own
    registry: Registry = REGISTRY  # the parallelisms every phase walks (api/parallelisms.py)


def run_load_sequence(stage: str, prepare: Callable[[], Prepared], *, distributed: bool, read: str = "all",
                      progress: bool | None = None, eval_mode: bool = True) -> tuple[Prepared, Any]:
    """Run `prepare` (all local checks, no read), then the sequence; returns what was prepared and the mesh (None
    without a parallel config). `read`: "all", "buffers" (staged: parameters come at their stage) or "none"."""
    import time

    prepared, error = None, None
    try:
        prepared = prepare()
        _resolve_other_plans(prepared)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc  # (a plan that failed to resolve: the checkpoints opened are closed below)
    components = prepared.components if prepared is not None else {}
    quantizers: dict[str, ReadQuantizer] = {}
    try:
        if distributed:
            agree(stage, _facts(prepared) if error is None else None, error)
        elif error is not None:
            raise error
        mesh = None
        if prepared.parallel is not None:
            mesh = build_mesh(prepared.parallel, prepared.device, registry=prepared.registry)
            for component in components.values():  # the load-time phase, before the read (FSDP: on meta)
                component.group = _tp_group(component, mesh)
                for parallelism in prepared.registry.in_apply_order():
                    parallelism.before_read(component, mesh, prepared.device, read)
        if read != "none":
            if read == "all":
                quantizers = _row_extrema_pass(stage, components, mesh, distributed)
            error = None
            try:
                for name, component in components.items():
                    if component.checkpoint is None:
                        continue
                    started = time.perf_counter()
                    if name in quantizers:
                        component.source.read(component.model, component.checkpoint, progress,
                                              quantizer=quantizers[name])
                    elif read == "all":
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
    for name, component in components.items():
        component.group = _tp_group(component, mesh)
        if mesh is not None:  # the load-time phase, after the read (TP: the sharded linears, each holding its slice)
            for parallelism in prepared.registry.in_apply_order():
                parallelism.after_read(component, mesh, read)
        if name in quantizers:  # quantized as read: the held weights put in place
            component.quantized = quantizers[name].install(component.model)
        elif read == "all":  # GGUF weights wrapped as read; staged: quantized after each stage's read
            component.quantize()  # (api/pipeline_wiring.py)
        if eval_mode:
            component.model.eval()
        if mesh is not None and component.attach:
            attach(component.model, mesh, component.resolved, component.cp_resolved, component.fsdp_blocks,
                   registry=prepared.registry, plans=component.plans)
    return prepared, mesh


def _resolve_other_plans(prepared: Prepared) -> None:
    """The plans of every parallelism the loader did not resolve itself (`from_pretrained` and `load_pipeline`
    resolve TP, CP and FSDP against the checkpoint headers), for each component attach will put them on: while
    preparing, before the ranks agree."""
    if prepared.parallel is None:
        return
    for component in prepared.components.values():
        if component.attach and component.plans is None:
            component.plans = resolve_plans(component.model, prepared.parallel, registry=prepared.registry,
                                            known={"tp": component.resolved, "cp": component.cp_resolved,
                                                   "fsdp": component.blocks})


def _tp_group(component: Component, mesh: Any) -> Any:
    """The process group whose ranks hold the component's TP shards (None: not split)."""
    if component.resolved is None:
        return None
    return mesh.tp_group if component.tp_dims == ("tp",) else mesh.flat_group(component.tp_dims)


def _row_extrema_pass(stage: str, components: dict[str, Component], mesh: Any,
                      distributed: bool) -> dict[str, ReadQuantizer]:
    """A quantizer for every component read with a quantization scheme (GGUF weights are read packed: none).

    Per-row int8 / fp8 scales of a column-split weight need the whole row's extrema before its quantizing read, so
    each rank first reads its column slices once, in pieces (nothing kept), and the ranks agree that every rank
    read them before the one all-reduce of each component's TP group: a rank that failed to read is reported on
    every rank instead of leaving the others in the collective. Whether the pass runs follows from the agreed
    scheme and plan, so every rank runs the same agreement and collectives."""
    splits = {name: column_split_weights(component.model, component.resolved, component.quantization)
              for name, component in components.items()
              if component.checkpoint is not None and component.quantization is not None
              and component.quantization.name != "gguf"}
    local: dict[str, dict[str, torch.Tensor]] = {name: {} for name in splits}
    if any(splits.values()):
        error = None
        try:
            for name, split in splits.items():
                source, checkpoint = components[name].source, components[name].checkpoint
                local[name] = {param: row_extrema(source.read_in_rows(checkpoint, param)) for param in split}
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = exc
        if distributed:
            agree(f"{stage} (reading row extrema)", {"row extrema": True}, error)
        elif error is not None:
            raise error
    return {name: ReadQuantizer(components[name].quantization,
                                reduce_row_extrema(extrema, _tp_group(components[name], mesh)))
            for name, extrema in local.items()}


def _facts(prepared: Prepared) -> dict[str, Any]:
    facts = dict(prepared.facts)
    for name, component in prepared.components.items():
        facts.update(component.facts if name == "" else {f"{name}: {k}": v for k, v in component.facts.items()})
    return facts
