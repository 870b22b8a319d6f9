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
