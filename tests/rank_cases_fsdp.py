"""FSDP2 cases run on every rank by tests/test_fsdp.py (gloo, CPU)."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from diffusers import DiffusionPipeline
from torch.distributed.tensor import DTensor

import paradiff
from paradiff.config import ParallelConfig
from paradiff.errors import ParallelConfigError
from paradiff.fsdp.apply import held_weight_bytes
from paradiff.io.checkpoint import Checkpoint
from paradiff.plan_tools.memory import meta_model, per_rank_bytes
from paradiff.plans import plan_for
from paradiff.tensor_parallel.plan import as_plan, resolve_plan
from paradiff.runtime.state import get_state
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward
from paradiff_testkit.pipelines import default_call_kwargs


@contextlib.contextmanager
def _recorded_reads():
    """The (offset, length) of every tensor-data read the checkpoint reader makes (it reads with os.preadv only)."""
    ranges: list[tuple[int, int]] = []
    original = os.preadv

    def preadv(fd, buffers, offset, *args):
        count = original(fd, buffers, offset, *args)
        ranges.append((offset, count))
        return count

    os.preadv = preadv
    try:
        yield ranges
    finally:
        os.preadv = original


@contextlib.contextmanager
def _counted_gloo_all_gathers():
    """Counts the calls of c10d's all-gather into one tensor (what FSDP2 uses unless told otherwise): on CPU the
    FSDP units gather in place by point-to-point sends instead (fsdp/apply.py: _InPlaceGather)."""
    original, calls = dist.all_gather_single, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counted
    try:
        yield calls
    finally:
        dist.all_gather_single = original


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gather_buffer_bytes(model) -> int:
    """The bytes of the all-gather output buffers the in-place gather's pool holds (gathers in flight, buffers FSDP2
    keeps after a copy-out, idle ones): FSDP2's private param group holds the custom all-gather."""
    for module in model.modules():
        group = getattr(module, "_get_fsdp_state", None) and module._get_fsdp_state()._fsdp_param_group
        buffers = getattr(getattr(group, "_all_gather_comm", None), "buffers", None)
        if buffers is not None:
            return buffers.held_bytes
    return 0


def _gathered_peak(model) -> list[int]:
    """Hooks recording, as each block starts (its prefetch of the next block issued), the bytes of block weights held
    gathered (plain tensors: FSDP2 swaps a unit's DTensor parameters for the gathered ones while it is unsharded) and
    of the gather buffers held beside them, and of the weights outside the blocks but for the root's own (embeddings,
    modulation, final layers: units of their own, gathered only while they run)."""
    blocks = [model.get_submodule(name) for name in get_state(model).fsdp_blocks]
    inside = {id(module) for block in blocks for module in block.modules()} | {id(model)}
    outside = [module for module in model.modules() if id(module) not in inside]
    peak = [0, 0]
    # FSDP2's parameters, by slot: a LoRA loaded later adds whole (plain) factors to the blocks, not FSDP2's to gather
    sharded = [(module, leaf) for block in blocks for module in block.modules()
               for leaf, p in module._parameters.items() if isinstance(p, DTensor)]

    def record(*_):
        held = sum(_nbytes(module._parameters[leaf]) for module, leaf in sharded
                   if not isinstance(module._parameters[leaf], DTensor))
        peak[0] = max(peak[0], held + _gather_buffer_bytes(model))
        peak[1] = max(peak[1], sum(_nbytes(p) for module in outside for p in module._parameters.values()
                                   if p is not None and not isinstance(p, DTensor)))

    for block in blocks:
        block.register_forward_pre_hook(record)
    return peak


def _persistent_buffers(model) -> list[str]:
    parameters = {name for name, _ in model.named_parameters()}
    return [name for name in model.state_dict() if name not in parameters]


def fsdp_models(runs: list[dict]) -> list[dict]:
    """For each run {family, folder, mode, dtype}: the relative difference to the single-process forward, the block
    weights this rank holds and holds gathered at most, and the bytes its load read against its share."""
    torch.set_num_threads(1)
    from paradiff.plans import families

    families()  # imports every plan module now: the measured read below is then the load's own
    results = []
    for run in runs:
        family, folder, mode = run["family"], run["folder"], run["mode"]
        dtype = getattr(torch, run.get("dtype", "float32"))
        cls = model_class(family)
        reference = cls.from_pretrained(folder, torch_dtype=dtype).eval()
        dist.barrier()
        with _recorded_reads() as ranges:
            model = paradiff.from_pretrained(cls, folder, torch_dtype=dtype,
                                             parallel_config=ParallelConfig.from_mode(mode))
        read = sum(length for _offset, length in ranges)
        state = get_state(model)
        blocks = [model.get_submodule(name) for name in state.fsdp_blocks]
        full_blocks = [sum(_nbytes(p) for p in reference.get_submodule(name).parameters())
                       for name in state.fsdp_blocks]
        degree = ParallelConfig.from_mode(mode).fsdp_degree
        # a block's gather buffer: FSDP2 pads each weight's rows to a multiple of the degree
        gather_buffers = [sum(-(-p.shape[0] // degree) * degree * _nbytes(p) // max(1, p.shape[0])
                              for p in reference.get_submodule(name).parameters())
                          for name in state.fsdp_blocks]
        held_blocks = sum(_nbytes(p.to_local()) for block in blocks for p in block.parameters())
        peak = _gathered_peak(model)
        inputs = make_inputs(family, reference.config, batch=2, lengths=Lengths(height=3, width=4, text=6))
        inputs = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
        expected = run_forward(reference, inputs).float()
        with _counted_gloo_all_gathers() as gloo_gathers:
            actual = run_forward(model, inputs).float()
        again = run_forward(model, inputs).float()
        checkpoint = Checkpoint(folder)
        headers = sum(8 + int.from_bytes(open(path, "rb").read(8), "little")
                      for path in {info.file for info in checkpoint.tensors.values()})
        (file_dtype,) = {info.dtype for info in checkpoint.tensors.values()}
        checkpoint.close()
        itemsize = torch.empty((), dtype=file_dtype).element_size()
        parallel = ParallelConfig.from_mode(mode)
        tp_plan = None
        if parallel.tp_degree > 1:
            tp_plan = resolve_plan(meta_model(cls, reference.config), as_plan(plan_for(reference, None, "tensor")),
                                   get_state(model).mesh.coordinates.tp_rank, parallel.tp_degree)
        predicted = per_rank_bytes(meta_model(cls, reference.config), parallel, dtype, tp_plan=tp_plan)
        lora = _lora_on_fsdp(model, reference, inputs, run["lora"]) if run.get("lora") else None
        results.append({
            "lora": lora,
            "predicted_weights": predicted.weights, "held": held_weight_bytes(model),
            "model_group": 1 if state.mesh.model_group is None else dist.get_world_size(state.mesh.model_group),
            "run": run, "rank": dist.get_rank(), "blocks": len(blocks),
            "diff": float((actual - expected).abs().max() / expected.abs().max()),
            "repeat_diff": float((again - actual).abs().max()),
            "held_blocks": held_blocks, "full_blocks": sum(full_blocks), "largest_block": max(full_blocks),
            "largest_gather_buffer": max(gather_buffers),
            "gathered_peak": peak[0], "outside_gathered": peak[1], "gloo_gathers": gloo_gathers[0], "read": read, "headers": headers,
            # what this rank's rows and the persistent buffers take in the file
            "share": sum((p.to_local() if isinstance(p, DTensor) else p).numel() * itemsize
                         for p in model.parameters())
                     + sum(model.get_buffer(name).numel() * itemsize for name in _persistent_buffers(model)),
            "full": sum(p.numel() * itemsize for p in reference.parameters()),
        })
    return results


def _lora_on_fsdp(model, reference, inputs: dict, lora: str) -> dict:
    """A LoRA adapter on the FSDP model and on the single-process one (diffusers' own): the relative differences with
    it loaded, weighted, and unloaded; the whole factors each rank holds; and what fuse_lora and diffusers' group
    offloading (both refused on FSDP shards, by name, before anything changes) say."""
    from paradiff.errors import AdapterError, ParallelConfigError
    from paradiff_testkit.lora import lora_layers, relative_difference

    started = time.perf_counter()
    diffs, refused = {}, {}
    for target in (reference, model):
        target.load_lora_adapter(lora, adapter_name="style", use_safetensors=True)
    diffs["loaded"] = relative_difference(run_forward(model, inputs), run_forward(reference, inputs))
    for target in (reference, model):
        target.set_adapters(["style"], [0.6])
    diffs["weighted"] = relative_difference(run_forward(model, inputs), run_forward(reference, inputs))
    layers = lora_layers(model)
    whole = all(tuple(layer.lora_B["style"].weight.shape) == (layer.out_features, layer.lora_A["style"].weight.shape[0])
                and layer.out_features == reference.get_submodule(name).base_layer.out_features
                for name, layer in layers.items())
    for what, call, error in (("fuse", lambda: model.fuse_lora(lora_scale=0.5), AdapterError),
                              ("group offload", lambda: model.enable_group_offload("cpu"), ParallelConfigError)):
        try:
            call()
            refused[what] = None
        except error as exc:
            refused[what] = str(exc)
    diffs["after refusals"] = relative_difference(run_forward(model, inputs), run_forward(reference, inputs))
    for target in (reference, model):
        target.unload_lora()
    diffs["unloaded"] = relative_difference(run_forward(model, inputs), run_forward(reference, inputs))
    return {"diffs": diffs, "layers": len(layers), "whole": whole, "refused": refused,
            "seconds": time.perf_counter() - started}


def _offloaded(module) -> bool:
    """Whether FSDP2 keeps this sharded module's parameters offloaded to the CPU (its CPUOffloadPolicy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    group = fully_shard.state(module)._fsdp_param_group
    return group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)


def fsdp_pipeline(family: str, folder: str, mode: str, steps: int = 3, offload: bool = False,
                  lora: str | None = None) -> dict:
    """A whole pipeline with FSDP transformers: images equal the single-process ones, same seed; with `lora`, again
    after `load_lora_weights` of it on both pipelines (its difference `lora_diff`)."""
    from paradiff.config import parse_mode

    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    pipeline = paradiff.load_pipeline(folder, parallel_config=ParallelConfig.from_degrees(**parse_mode(mode),
                                                                                          fsdp_offload=offload))
    pipeline.set_progress_bar_config(disable=True)
    expected = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0)).frames)
    actual = np.asarray(pipeline(**kwargs, seed=0).frames)
    lora_diff, started = None, time.perf_counter()
    if lora is not None:
        for pipe in (reference, pipeline):
            pipe.load_lora_weights(lora, adapter_name="style")
        with_lora = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0)).frames)
        lora_diff = float(np.abs(np.asarray(pipeline(**kwargs, seed=0).frames) - with_lora).max())
        lora_diff = (lora_diff, float(np.abs(with_lora - expected).max()))  # (to diffusers', what the LoRA changed)
    try:  # diffusers' group offloading on FSDP shards: refused by name (fsdp/refusals.py: fsdp_refusal)
        pipeline.enable_group_offload("cpu", offload_type="block_level", num_blocks_per_group=1)
        group_offload = None
    except ParallelConfigError as exc:
        group_offload = str(exc)
    transformers = {name: module for name, module in pipeline.components.items()
                    if name.startswith("transformer") and module is not None}
    return {"rank": dist.get_rank(), "diff": float(np.abs(actual - expected).max()),
            "output_rank": pipeline.is_output_rank,
            "group_offload": group_offload,
            "lora_diff": lora_diff, "lora_seconds": time.perf_counter() - started,
            "offloaded": {name: all(_offloaded(module.get_submodule(block))
                                    for block in get_state(module).fsdp_blocks)
                          for name, module in transformers.items()},
            "fsdp_blocks": {name: len(get_state(module).fsdp_blocks) for name, module in transformers.items()},
            "held": {name: (held_weight_bytes(module), sum(_nbytes(p) for p in getattr(reference, name).parameters()))
                     for name, module in transformers.items()},
            "encoders": {name: (held_weight_bytes(module), sum(_nbytes(p) for p in getattr(reference, name).parameters()))
                         for name, module in pipeline.components.items()
                         if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)}}


def fsdp_quantized(runs: list[dict]) -> list[dict]:
    """For each run {family, folder (a float checkpoint) or file + config (GGUF), scheme, mode}: the relative
    difference of the FSDP model's forward to the single-process quantized model's (diffusers' own load: TorchAoConfig,
    or from_single_file of the GGUF file), the quantized bytes this rank holds against the whole model's, whether
    every quantized linear is held as plain rows (no weight dequantized), and the bytes read against the file's."""
    from rank_cases_gguf import gguf_config
    from rank_cases_quant import quant_config

    from paradiff.fsdp.packed import PackedLinear
    from paradiff.quant.apply import quantization_summary

    torch.set_num_threads(1)
    results = []
    for run in runs:
        family, mode, scheme = run["family"], run["mode"], run["scheme"]
        cls = model_class(family)
        if scheme == "gguf":
            source, kwargs = run["file"], dict(config=run["config"], quantization_config=gguf_config())
            reference = cls.from_single_file(source, **kwargs).eval()
        else:
            source, kwargs = run["folder"], dict(quantization_config=quant_config(scheme))
            reference = cls.from_pretrained(source, torch_dtype=torch.float32, **kwargs).eval()
        dist.barrier()
        with _recorded_reads() as ranges:
            model = paradiff.from_pretrained(cls, source, parallel_config=ParallelConfig.from_mode(mode), **kwargs)
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        quantized = {name: m for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear)
                     and (hasattr(m.weight, "qdata") or getattr(m.weight, "quant_type", None) is not None)}
        whole = sum(_nbytes(t) for m in quantized.values()
                    for t in ([m.weight.qdata, m.weight.scale] if hasattr(m.weight, "qdata") else [m.weight]))
        held = sum(_nbytes(getattr(m, part).to_local()) for m in packed for part in m.part_names)
        inputs = make_inputs(family, reference.config, batch=2, lengths=Lengths(height=3, width=4, text=6))
        expected = run_forward(reference, inputs).float()
        actual = run_forward(model, inputs).float()
        again = run_forward(model, inputs).float()
        results.append({
            "run": run, "rank": dist.get_rank(), "packed": len(packed), "quantized": len(quantized),
            "diff": float((actual - expected).abs().max() / expected.abs().max()),
            "repeat_diff": float((again - actual).abs().max()),
            "held": held, "whole": whole, "read": sum(length for _offset, length in ranges),
            "file": sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source)
                        if f.endswith(".safetensors")) if os.path.isdir(source) else os.path.getsize(source),
            "plain": all(type(getattr(m, part).to_local()) is torch.Tensor for m in packed for part in m.part_names),
            "summary": quantization_summary(model),
        })
    return results


def fsdp_families(runs: list[dict]) -> list[dict]:
    """For each run {family, example, modes} (the families' tiny examples, plan_tools/family_examples.py): per mode,
    the relative difference of the FSDP model (enable_parallelism of the example in memory) to its single-process
    forward, and the parameter bytes this rank holds against the whole model's."""
    from paradiff.plan_tools import family_examples as examples

    torch.set_num_threads(1)
    results = []
    for run in runs:
        family, example = run["family"], run["example"]
        reference = examples.build_example(family, example)
        inputs = examples.example_inputs(family, example, reference.config)
        expected, _flops = examples.forward_with_flops(reference, inputs)
        for mode in run["modes"]:
            model = paradiff.enable_parallelism(examples.build_example(family, example),
                                                ParallelConfig.from_mode(mode))
            actual, _flops = examples.forward_with_flops(model, inputs)
            results.append({"family": family, "mode": mode, "rank": dist.get_rank(),
                            "diff": examples.relative_difference(actual, expected),
                            "blocks": len(get_state(model).fsdp_blocks), "held": held_weight_bytes(model),
                            "whole": examples.parameter_bytes(reference)})
    return results
