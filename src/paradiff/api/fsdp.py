"""What a load with `fsdp_degree > 1` checks before anything is read, and the sharding step of the load sequence
(`api/load_sequence.py`): mechanism in `fsdp/`, docs/fsdp.md."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paradiff.errors import ParallelConfigError, UnsupportedModelError
from paradiff.api.building import target_dtype
from paradiff.fsdp.apply import shard_weights
from paradiff.fsdp.packed import PackedLinear
from paradiff.fsdp.refusals import fsdp_refusal
from paradiff.plans import family_of
from paradiff.runtime.patches import replace_module, share_hooks
from paradiff.runtime.repeated_blocks import layer_blocks, repeated_blocks
from paradiff.tensor_parallel.shard import swap_in_sharded_linears




def check_fsdp(model: nn.Module, parallel: Any, *, quantization: Any = None, saved: bool = False,
               single_file: bool = False, stages: bool = False) -> list[tuple[str, nn.Module]]:
    """The blocks FSDP shards one at a time; refuses, naming what to change, whatever FSDP2 cannot hold here. Runs
    while preparing: before any weight is read or any collective issued."""
    what = f"fsdp_degree={parallel.fsdp_degree}"
    refusal = fsdp_refusal(parallel.fsdp_degree, parallel.tp_degree, getattr(quantization, "name", None),
                           saved=saved, single_file=single_file, stages=stages)
    if refusal is not None:
        raise ParallelConfigError(refusal)
    blocks = repeated_blocks(model)
    if not blocks:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no repeated blocks (no `_repeated_blocks`, no top-level nn.ModuleList), so "
            f"FSDP has no unit to gather one at a time; use fsdp_degree=1 ({what} was asked).")
    return blocks


def encoder_fsdp_blocks(name: str, model: nn.Module, parallel: Any, split_dims: tuple[str, ...],
                        quantized: bool) -> list[tuple[str, nn.Module]] | None:
    """The layers FSDP shards in a text encoder (None: it stays as TP left it, and why is logged once). An encoder
    split by TP over the FSDP ranks themselves (CP without TP: `fsdp` = ring x ulysses) already holds 1/N there; a
    quantized one holds packed or subclassed weights that FSDP2 cannot cut (see `check_fsdp`)."""
    import logging

    from paradiff.runtime.progress import is_main_rank

    why = None
    if set(split_dims) & set(parallel.fsdp_dims):
        why = f"it is split by TP over the same ranks ({' x '.join(split_dims)})"
    elif quantized:
        why = "it is quantized (FSDP shards quantized transformers only: docs/fsdp.md)"
    elif _records_outputs_by_class(model):
        why = (f"transformers looks up which outputs {type(model).__name__} records (its hidden states) by the "
               "model's class at every call, and FSDP2 gives the model it shards a class of its own")
    blocks = layer_blocks(model) if why is None else []
    if why is None and not blocks:
        why = f"{type(model).__name__} names no repeated layers (`_no_split_modules`)"
    if why is not None:
        if is_main_rank():
            logging.getLogger(__name__).info("%s is not FSDP-sharded: %s", name, why)
        return None
    return blocks


def _records_outputs_by_class(model: nn.Module) -> bool:
    """Whether the model's own forward is wrapped by transformers' output capturing (`capture_outputs`, transformers
    5), which finds the model's recorder list by `str(model.__class__)`: a model used bare as an encoder (Gemma2Model,
    LlamaModel). A model that holds such a model inside (Qwen3ForCausalLM) is not: FSDP2 changes only the classes of
    the model and its blocks."""
    function = type(model).forward
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None and code.co_filename.endswith("output_capturing.py"):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def shard_component(component: Any, mesh: Any, group: Any, weights_on_meta: bool, device: torch.device) -> None:
    """TP first (a planned Linear becomes its sharded form holding this rank's slice: empty on meta, or sliced
    from the weights in memory), then FSDP2 over the FSDP group, each block a unit (`fsdp/apply.py`)."""
    model, resolved = component.model, component.resolved
    if weights_on_meta:
        _load_dtypes_on_meta(model, component.source)
    if resolved is not None:
        if weights_on_meta:
            _tp_shapes_on_meta(model, resolved)
        swap_in_sharded_linears(model, resolved, group, weights_are_local=weights_on_meta)
    if component.quantization is not None and weights_on_meta:
        _packed_linears_on_meta(model, component.quantization)
    family = family_of(model)
    component.fsdp_blocks = shard_weights(model, component.blocks, mesh.fsdp_mesh(), device,
                                          prefetch_across_lists=component.prefetch_across_lists,
                                          offload=mesh.config.fsdp_offload,
                                          own_units=family.fsdp_own_units if family is not None else ())


def _packed_linears_on_meta(model: nn.Module, scheme: Any) -> None:
    """Each linear the scheme quantizes becomes a PackedLinear (`fsdp/packed.py`) holding its quantized weight's
    inner tensors as plain parameters, on the meta device: FSDP then shards them by rows, and the read fills each
    rank's rows (int8 / fp8: quantized from the float rows read; GGUF: the packed rows of the file)."""
    from paradiff.quant.apply import packed_layout

    if scheme.name == "gguf":
        targets = {name.rpartition(".")[0]: type_id for name, type_id in scheme.packed.items()}
    else:
        targets = {name: None for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and scheme.quantizes(name, module)}
    for name, type_id in targets.items():
        module = model.get_submodule(name)
        parts, build, product = packed_layout(scheme, module.in_features, module.out_features, module.weight.dtype,
                                              type_id)
        packed = PackedLinear(module.in_features, module.out_features, parts, build, product,
                              bias=None if module.bias is None else module.bias.detach())
        share_hooks(module, packed, by="fsdp")  # a hook placed before (none on a model just built) stays with it
        parent_name, _, leaf = name.rpartition(".")
        replace_module(model.get_submodule(parent_name) if parent_name else model, leaf, packed, by="fsdp",
                       release=True)


def _tp_shapes_on_meta(model: nn.Module, resolved: Any) -> None:
    """Planned parameters take their TP slice's shape on the meta device, so FSDP shards the slice."""
    for name, linear in resolved.linears.items():
        module = model.get_submodule(name) if name else model
        for leaf, spec in linear.specs.items():
            param = module._parameters.get(leaf)
            if param is not None and spec is not None:
                shape = spec.local_shape(param.shape)
                module._parameters[leaf] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"),
                                                        requires_grad=False)


def _load_dtypes_on_meta(model: nn.Module, source: Any) -> None:
    """Parameters take the dtype the read gives them (the load dtype, float32 for the modules kept so) before FSDP
    makes them real: its shards are filled in place."""
    for name, param in list(model.named_parameters()):
        if param.is_meta and param.dtype.is_floating_point:
            dtype = target_dtype(name, source.dtype, source.keep_fp32)
            if dtype != param.dtype:
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                module._parameters[leaf] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"),
                                                        requires_grad=False)
