"""Functions run on every rank of a pool by tests/test_describe.py (gloo, CPU)."""

from __future__ import annotations

import paradiff
from paradiff.testing.models import model_class


def describe_a_split_model(family: str, folder: str, mode: str) -> dict:
    """Load `family` in `mode` and return what `paradiff.describe` finds: its counts by kind and its lines."""
    parallel = paradiff.ParallelConfig.from_mode(mode)
    model = paradiff.from_pretrained(model_class(family), folder, parallel_config=parallel)
    description = paradiff.describe(model)
    return {"counts": description.counts(), "lines": [str(change) for change in description.changes],
            "text": str(description)}


def patches_removed_give_the_plain_model_back(family: str, mode: str) -> dict:
    """A model split in `mode` with a LoRA adapter and a step cache on: its recorded patches, then the model after
    `remove_patches` (diffusers' own changes, the cache's hooks and peft's adapter layers, taken off first with
    diffusers' calls), against its output and its modules before paradiff touched it."""
    import torch
    from diffusers import FirstBlockCacheConfig

    from paradiff_testkit.lora import TARGETS, random_lora
    from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward

    model = build_model(family, layers=2, single_layers=2).eval()
    inputs = make_inputs(family, model.config, batch=2, lengths=Lengths(height=4, width=4, text=6))
    plain = run_forward(model, inputs)
    modules = {name: (module, type(module)) for name, module in model.named_modules()}
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    adapter = random_lora(model, TARGETS[family], 4, seed=1)
    paradiff.enable_parallelism(model, paradiff.ParallelConfig.from_mode(mode))
    model.load_lora_adapter(adapter, adapter_name="style")
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    adapted = run_forward(model, inputs)
    listed = [f"{where}: {patch}" for where, patch in paradiff.patches(model)]
    kinds = sorted({patch.kind for _, patch in paradiff.patches(model)})
    mechanisms = sorted({patch.by for _, patch in paradiff.patches(model)})
    model.disable_cache()  # diffusers' own: its cache hooks, peft's adapter layers
    model.unload_lora()  # its layers go, and with them the patches on them
    remaining = len(paradiff.patches(model))
    removed = paradiff.remove_patches(model)
    # the split gave the full weights up (a rank never keeps the whole model): the layers come back as meta tensors,
    # loaded again as a user would from the checkpoint
    released = sorted(name for name, tensor in model.state_dict().items() if tensor.is_meta)
    model.load_state_dict(weights, assign=True)
    after = run_forward(model, inputs)
    changed = [name for name, module in model.named_modules()
               if name not in modules or modules[name][0] is not module or modules[name][1] is not type(module)]
    return {"listed": listed, "kinds": kinds, "mechanisms": mechanisms, "removed": removed, "remaining": remaining,
            "left": len(paradiff.patches(model)), "adapted_differs": not torch.equal(adapted, plain),
            "bitwise": torch.equal(after, plain), "changed": changed[:8], "released": len(released),
            "released_blocks": sum(".attn.to_q." in name for name in released),
            "missing": sorted(set(modules) - {name for name, _ in model.named_modules()})[:8]}


def pipeline_patches_removed_give_the_plain_pipeline_back(family: str, folder: str, lora: str, mode: str,
                                                          scheme: str, steps: int) -> dict:
    """A pipeline loaded in `mode` (tp, ulysses and cfg: the model, its text encoder, VAE, pipeline and guider all
    patched) with its transformer quantized (`scheme`, applied while reading), a LoRA adapter and a step cache on:
    its recorded patches, then the pipeline after `remove_patches` (diffusers' own changes, the cache's hooks and
    peft's adapter layers, taken off first with diffusers' calls) and every component's weights loaded again, against
    diffusers' own pipeline of the same folder: same classes, same latents bit for bit."""
    import torch
    from diffusers import DiffusionPipeline, FirstBlockCacheConfig
    from torch import nn

    from paradiff.runtime.wrappers import wrappers
    from paradiff_testkit.pipelines import default_call_kwargs
    from rank_cases_quant import pipeline_request

    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps, output_type="latent")

    def latents(pipe, **seed) -> torch.Tensor:
        return torch.as_tensor(pipe(**kwargs, **seed).images)

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    plain = latents(reference, generator=torch.Generator().manual_seed(0))
    classes = {name: type(component) for name, component in reference.components.items()}
    pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_mode(mode),
                                      quantization_config=pipeline_request({"transformer": scheme}))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(lora, adapter_name="style")
    pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    adapted = latents(pipeline, seed=0)
    # quantized while read: the held weights are torchao's tensors, not a patch; the CFG exchange is a wrapper
    quantized = _quantized_tensors(pipeline.transformer)
    wrapped = {name: wrappers(component) for name, component in pipeline.components.items()
               if isinstance(component, nn.Module) and wrappers(component)}
    listed = [f"{where}: {patch}" for where, patch in paradiff.patches(pipeline)]
    placed = [f"{where}: {patch.kind} {patch.target} (by {patch.by})" for where, patch in paradiff.patches(pipeline)]
    kinds = sorted({patch.kind for _, patch in paradiff.patches(pipeline)})
    mechanisms = sorted({patch.by for _, patch in paradiff.patches(pipeline)})
    patched = sorted({where.split(".")[0] for where, _ in paradiff.patches(pipeline)})
    pipeline.transformer.disable_cache()  # diffusers' own: its cache hooks, peft's adapter layers
    pipeline.unload_lora_weights()
    remaining = len(paradiff.patches(pipeline))
    removed = paradiff.remove_patches(pipeline)
    # the split and the quantization gave the full weights up: every component's are loaded again from the checkpoint
    # (the reference read the same files)
    released = 0
    for name, component in pipeline.components.items():
        if isinstance(component, nn.Module):
            released += sum(tensor.is_meta for tensor in component.state_dict().values())
            component.load_state_dict(reference.components[name].state_dict(), assign=True)
    after = latents(pipeline, generator=torch.Generator().manual_seed(0))
    return {"listed": listed, "placed": placed, "kinds": kinds, "mechanisms": mechanisms, "patched": patched,
            "removed": removed, "remaining": remaining, "left": len(paradiff.patches(pipeline)), "released": released,
            "quantized": quantized, "quantized_after": _quantized_tensors(pipeline.transformer), "wrapped": wrapped,
            "wrapped_after": [name for name, component in pipeline.components.items()
                              if isinstance(component, nn.Module) and wrappers(component)],
            "adapted_differs": not torch.equal(adapted, plain), "bitwise": torch.equal(after, plain),
            "classes": sorted(name for name, component in pipeline.components.items()
                              if type(component) is not classes.get(name))}


def _quantized_tensors(model) -> int:
    """How many of `model`'s tensors are a quantization library's tensor subclass (torchao's), not a plain tensor."""
    import torch

    return sum(type(tensor) not in (torch.Tensor, torch.nn.Parameter) for tensor in model.state_dict().values())
