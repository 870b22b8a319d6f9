"""Functions run on every rank of a pool by tests/test_lora_slots.py (gloo, CPU): a mixed batch (each sample its own
adapter, or none) in one call on adapter slots, against diffusers' single-process model with only that sample's
adapter loaded."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.api.lora_slots import (enable_adapter_slots, load_slot_adapter, set_sample_adapters,
                                     unload_slot_adapter)
from paradiff.config import ParallelConfig, parse_mode
from paradiff_testkit.lora import relative_difference
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward


def _adapter_source(path: str, kohya: bool) -> dict:
    """load_slot_adapter / load_lora_adapter arguments for a file: a kohya file converted by diffusers' FLUX loader
    (as load_lora_weights does), a diffusers file with its metadata."""
    if not kohya:
        return {"source": path, "use_safetensors": True}
    from diffusers import FluxPipeline

    converted, alphas = FluxPipeline.lora_state_dict(path, return_alphas=True)
    return {"source": converted, "network_alphas": alphas}


def _load_reference(reference, name: str, spec: dict) -> None:
    source = _adapter_source(spec["path"], spec.get("kohya", False))
    reference.load_lora_adapter(source.pop("source"), adapter_name=name, **source)


def _loads(cls, folder: str, mode: str, scheme: str | None, gguf_config: str | None):
    """The model under test (paradiff's load in `mode`; diffusers' own model for "single") and a function loading
    the single-process reference, for a base quantized by `scheme` (None; "int8" / "fp8": torchao through diffusers'
    TorchAoConfig; "nf4": bitsandbytes, whose diffusers load refuses a machine without a GPU, so the reference is
    paradiff's single-process load, bitsandbytes' own 4-bit weights (test_quantization shows it equals
    quantize_4bit); "gguf": `folder` a GGUF file, `gguf_config` its config folder, the reference diffusers'
    `from_single_file`)."""
    if scheme == "gguf":
        from rank_cases_gguf import gguf_config as quantization

        model = paradiff.from_pretrained(cls, folder, config=gguf_config, quantization_config=quantization(),
                                         parallel_config=ParallelConfig.from_degrees(**parse_mode(mode)), device="cpu")
        return model, lambda: cls.from_single_file(folder, config=gguf_config, quantization_config=quantization())
    quant = {}
    if scheme is not None:
        from rank_cases_quant import quant_config

        quant = {"quantization_config": quant_config(scheme)}
    if mode == "single":  # the slots on a plain diffusers model
        model = cls.from_pretrained(folder, torch_dtype=torch.float32, **quant).eval()
    else:
        config = ParallelConfig.from_degrees(**parse_mode(mode))
        model = paradiff.from_pretrained(cls, folder, parallel_config=config, **quant)
    if scheme == "nf4":
        return model, lambda: paradiff.from_pretrained(cls, folder, device="cpu", **quant)
    return model, lambda: cls.from_pretrained(folder, torch_dtype=torch.float32, **quant)


def mixed_batch(family: str, folder: str, mode: str, loras: dict[str, dict], samples: list[str | None],
                scheme: str | None = None, compiled: bool = False, max_lora_rank: int = 16,
                gguf_config: str | None = None) -> dict:
    """One call on a batch whose samples run `samples` (adapter names, None for the base); each sample against
    diffusers' model (quantized alike for `scheme`: `_loads`) with only that adapter loaded. Compiled: then every
    sample's adapter switched to another slot's (and one unloaded), counting the graphs Dynamo compiled."""
    torch.set_num_threads(1)
    cls = model_class(family)
    model, load_reference = _loads(cls, folder, mode, scheme, gguf_config)
    enable_adapter_slots(model, max_loras=len(loras), max_lora_rank=max_lora_rank)
    for name, spec in loras.items():
        source = _adapter_source(spec["path"], spec.get("kohya", False))
        load_slot_adapter(model, name, source.pop("source"), **source)
    inputs = make_inputs(family, model.config, batch=len(samples), lengths=Lengths(height=4, width=4, text=6))
    recorder = None
    if compiled:
        from paradiff_testkit.compile import RecordingBackend

        torch._dynamo.reset()
        recorder = RecordingBackend()
        paradiff.compile(model, backend=recorder)
    set_sample_adapters(model, samples)
    actual = run_forward(model, inputs)

    reference = load_reference().eval()
    computed = {}  # adapter name -> the reference's output with only it loaded (the same for every order)

    def expected(order: list[str | None]) -> dict[str, torch.Tensor]:
        for name in dict.fromkeys(order):
            if name in computed:
                continue
            if name is not None:
                _load_reference(reference, name, loras[name])
            computed[name] = run_forward(reference, inputs)
            if name is not None:
                reference.delete_adapters(name)
        return {name: computed[name] for name in dict.fromkeys(order)}

    references = expected(samples)
    diffs = {f"{row} {name}": relative_difference(actual[row], references[name][row])
             for row, name in enumerate(samples)}
    result = {"rank": dist.get_rank() if dist.is_initialized() else 0, "diffs": diffs,
              "adapted": {name: relative_difference(references[name], references[None]) for name in references
                          if name is not None and None in references},
              "quantized": sum(_quantized(module) for module in model.modules())}
    if compiled:
        graphs_before = len(recorder.graphs)
        switched = samples[1:] + samples[:1]  # every sample another adapter
        set_sample_adapters(model, switched)
        actual = run_forward(model, inputs)
        references = expected(switched)
        result["switched"] = {f"{row} {name}": relative_difference(actual[row], references[name][row])
                              for row, name in enumerate(switched)}
        dropped = next(name for name in switched if name is not None)
        unload_slot_adapter(model, dropped)
        emptied = [None if name == dropped else name for name in switched]
        set_sample_adapters(model, emptied)
        actual = run_forward(model, inputs)
        result["unloaded"] = {f"{row} {name}": relative_difference(actual[row], references[name][row])
                              for row, name in enumerate(emptied) if name in references}
        result["graphs"] = {"first": graphs_before, "after switch and unload": len(recorder.graphs)}
        torch._dynamo.reset()
    return result


def _quantized(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and (hasattr(weight, "qdata") or getattr(weight, "quant_state", None) is not None
                                   or getattr(weight, "quant_type", None) is not None)


def mixed_batch_cases(cases: list[dict]) -> list[dict]:
    """Several `mixed_batch` (or, with "pipeline": True, `mixed_batch_pipeline`) cases in one pool run."""
    return [dict(mixed_batch_pipeline(**{k: v for k, v in case.items() if k != "pipeline"}) if case.get("pipeline")
                 else mixed_batch(**case), case=case) for case in cases]


def mixed_batch_pipeline(family: str, folder: str, mode: str, loras: dict[str, str], samples: list[str | None],
                         steps: int = 2) -> dict:
    """A pipeline call on one prompt per sample, each sample with its adapter (None: the base), against diffusers'
    single-process pipeline with only that adapter in its transformer: the denoised latents, sample by sample."""
    from diffusers import DiffusionPipeline

    from paradiff_testkit.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps, output_type="latent")
    kwargs["prompt"] = [f"{kwargs['prompt']} {index}" for index in range(len(samples))]
    reference = DiffusionPipeline.from_pretrained(folder)
    pipeline = paradiff.load_pipeline(folder, parallel_config=ParallelConfig.from_degrees(**parse_mode(mode)))
    for pipe in (reference, pipeline):
        pipe.set_progress_bar_config(disable=True)
    enable_adapter_slots(pipeline.transformer, max_loras=len(loras), max_lora_rank=8)
    for name, path in loras.items():
        load_slot_adapter(pipeline.transformer, name, path, use_safetensors=True)
    set_sample_adapters(pipeline.transformer, samples)

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(index) for index in range(len(samples))]

    actual = torch.as_tensor(pipeline(**kwargs, generator=generators()).images)
    diffs = {}
    for name in dict.fromkeys(samples):
        if name is not None:
            reference.transformer.load_lora_adapter(loras[name], adapter_name=name, use_safetensors=True)
        expected = torch.as_tensor(reference(**kwargs, generator=generators()).images)
        if name is not None:
            reference.transformer.delete_adapters(name)
        diffs.update({f"{row} {name}": relative_difference(actual[row], expected[row])
                      for row, sample in enumerate(samples) if sample == name})
    return {"rank": dist.get_rank(), "diffs": diffs}


def slot_checksums_disagree(path: str) -> dict:
    """Every rank loads the same file into a slot, but rank 1 under another checksum (as if its copy differed): every
    rank refuses before any writes a slot."""
    from paradiff.testing.models import build_model

    model = build_model("flux")
    bank = enable_adapter_slots(model, max_loras=1, max_lora_rank=4)
    try:
        load_slot_adapter(model, "style", path, identity=f"sha256 {dist.get_rank() == 1:d}", use_safetensors=True)
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    result = {"error": error, "loaded": sorted(bank.adapters),
              "written": any(layer.lora_a.any() or layer.lora_b.any() for layer in bank.layers.values())}
    # the server's cache, rank 1's copy of the file changed since rank 0 named it: every rank refuses, none hangs
    import hashlib
    import shutil
    from pathlib import Path

    from paradiff.api.lora_slots import disable_adapter_slots
    from paradiff.serve.adapters import AdapterCache

    disable_adapter_slots(model)
    cache = AdapterCache(model, max_loras=1, max_rank=4)
    copy = Path(path).with_name(f"rank{dist.get_rank()}.safetensors")
    shutil.copy(path, copy)
    if dist.get_rank() == 1:
        copy.write_bytes(copy.read_bytes() + b" ")
    try:
        cache.prepare([{"name": "style", "path": str(copy), "sha256": hashlib.sha256(Path(path).read_bytes())
                        .hexdigest()}], None, ranks=[0, 1])
        result["cache error"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["cache error"] = f"{type(exc).__name__}: {getattr(exc, 'status', '')} {exc}"
    result["cache loads"] = cache.loads
    return result
