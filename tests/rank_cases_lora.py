"""Functions run on every rank of a pool by tests/test_lora.py (gloo, CPU): paradiff's LoRA against diffusers' own
LoRA on the unsplit model, step by step on one loaded model (so one pool run covers a whole mode)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.config import ParallelConfig, parse_mode
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.tensor_parallel.styles import ShardSpec
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual - expected).abs().max() / expected.abs().max())


def _lora_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)}


def _check_factor_slices(model, reference) -> int:
    """Each rank's LoRA factors equal the slices of the full factors its base weight's ShardSpec names."""
    plan = get_state(model).tp_plan
    full_layers = _lora_layers(reference)
    checked = 0
    for name, layer in _lora_layers(model).items():
        full = full_layers[name]
        planned = plan.linears.get(name) if plan is not None else None
        for adapter in layer.lora_A:
            a, b = full.lora_A[adapter].weight, full.lora_B[adapter].weight
            if planned is not None:
                pieces = planned.specs["weight"].pieces
                if planned.style.kind == "colwise":
                    b = slice_tensor(b, ShardSpec(dim=0, pieces=pieces))
                else:
                    a = slice_tensor(a, ShardSpec(dim=1, pieces=pieces))
                checked += 1
            assert torch.equal(layer.lora_A[adapter].weight, a), (name, adapter, "lora_A")
            assert torch.equal(layer.lora_B[adapter].weight, b), (name, adapter, "lora_B")
    return checked


def _shards(model) -> dict[str, torch.Tensor]:
    return {name: module.get_base_layer().weight.detach().clone() for name, module in _lora_layers(model).items()}


def lora_equivalence(family: str, folder: str, mode: str, loras: dict[str, str], weights: dict[str, float],
                     fuse_scale: float = 0.5, via: str = "file") -> dict:
    """Load `loras` (adapter name -> file) into a paradiff model in `mode` and into diffusers' single-process model,
    then compare outputs after: the first adapter; all mixed by `weights`; disable / enable; fuse (then the shards
    against the originals after unfuse); delete of the last adapter; unload. Returns every relative difference."""
    from safetensors.torch import load_file

    cls = model_class(family)
    reference = cls.from_pretrained(folder).eval()
    config = ParallelConfig.from_degrees(**parse_mode(mode))
    model = paradiff.from_pretrained(cls, folder, parallel_config=config)
    inputs = make_inputs(family, reference.config, batch=2, lengths=Lengths(height=4, width=4, text=6))
    diffs, names = {}, list(loras)

    def compare(step: str) -> None:
        diffs[step] = _rel(run_forward(model, inputs), run_forward(reference, inputs))

    compare("base")
    for name in names:
        source = loras[name] if via == "file" else load_file(loras[name])
        # use_safetensors: diffusers then reads the adapter metadata (lora_alpha != r) from the file
        reference.load_lora_adapter(loras[name], adapter_name=name, use_safetensors=True)
        model.load_lora_adapter(source, adapter_name=name, use_safetensors=True)
        if name == names[0]:
            compare(f"only {name}")
    report = model._paradiff_lora_load
    reference.set_adapters(names, [weights[n] for n in names])
    model.set_adapters(names, [weights[n] for n in names])
    compare("mixed")
    sliced = _check_factor_slices(model, reference)
    assert model.active_adapters() == reference.active_adapters()
    reference.disable_lora()
    model.disable_lora()
    compare("disabled")
    reference.enable_lora()
    model.enable_lora()
    compare("enabled")
    originals = _shards(model)
    reference.fuse_lora(lora_scale=fuse_scale)
    model.fuse_lora(lora_scale=fuse_scale)
    compare("fused")
    fused_changed = sum(not torch.equal(t, originals[n]) for n, t in _shards(model).items())
    reference.unfuse_lora()
    model.unfuse_lora()
    compare("unfused")
    unfused_exact = all(torch.equal(t, originals[n]) for n, t in _shards(model).items())
    reference.delete_adapters(names[-1])
    model.delete_adapters(names[-1])
    compare("deleted")
    reference.unload_lora()
    model.unload_lora()
    assert not _lora_layers(model)
    compare("unloaded")
    return {"rank": dist.get_rank(), "diffs": diffs, "sliced": sliced, "fused_changed": fused_changed,
            "layers": len(originals), "unfused_exact": unfused_exact, "bytes_read": report.bytes_read,
            "local_bytes": report.local_bytes, "tensors": report.tensors}

