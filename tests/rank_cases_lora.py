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
                     fuse_scale: float = 0.5, via: str = "file", swap: str | None = None) -> dict:
    """Load `loras` (adapter name -> file) into a paradiff model in `mode` and into diffusers' single-process model,
    then compare outputs after: the first adapter; all mixed by `weights`; `swap` hot-swapped into the first one's
    layers (when given); disable / enable; fuse (then the shards
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
        # use_safetensors: diffusers then reads the adapter metadata (lora_alpha != r) from the file
        extra, expected_source, source = {"use_safetensors": True}, loras[name], loras[name]
        if name == "kohya":  # converted by diffusers' own FLUX loader, as load_lora_weights does
            from diffusers import FluxPipeline

            converted, alphas = FluxPipeline.lora_state_dict(loras[name], return_alphas=True)
            expected_source, source, extra = converted, dict(converted), {"network_alphas": alphas}
        elif via == "dict":  # a dict carries no adapter metadata: both sides then take lora_alpha = r
            expected_source, source = load_file(loras[name]), load_file(loras[name])
        reference.load_lora_adapter(expected_source, adapter_name=name, **extra)
        model.load_lora_adapter(source, adapter_name=name, **extra)
        if name == names[0]:
            compare(f"only {name}")
    report = model._paradiff_lora_load
    reference.set_adapters(names, [weights[n] for n in names])
    model.set_adapters(names, [weights[n] for n in names])
    compare("mixed")
    if swap is not None:  # another adapter of the same shape into the first one's layers, in place
        for target in (reference, model):
            target.load_lora_adapter(swap, adapter_name=names[0], hotswap=True, use_safetensors=True)
        compare("hotswapped")
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



def lora_cases(cases: list[dict]) -> list[dict]:
    """Several `lora_equivalence` cases in one pool run (the pools are shared: fewer runs, a faster suite)."""
    torch.set_num_threads(1)
    return [dict(lora_equivalence(**case), case=case) for case in cases]


def lora_errors(family: str, folder: str, good: str, truncated: str, seed_files: list[str]) -> dict:
    """Bad adapters on a tp2 model that already holds one: each is one typed error on every rank, raised before the
    adapter layers are built, and the model still generates what it did before."""
    from safetensors.torch import load_file

    cls = model_class(family)
    model = paradiff.from_pretrained(cls, folder, parallel_config=paradiff.TensorParallelConfig(tp_degree=2))
    inputs = make_inputs(family, model.config, batch=1, lengths=Lengths(height=4, width=4, text=6))
    model.load_lora_adapter(good, adapter_name="style", use_safetensors=True)
    before = run_forward(model, inputs)
    full = load_file(good)
    rank = dist.get_rank()
    first = next(k for k in full if k.endswith("lora_A.weight"))
    wrong_shape = dict(full, **{first: torch.zeros(full[first].shape[0], full[first].shape[1] + 8)})
    unknown = dict(full)
    unknown["transformer.transformer_blocks.0.attn.to_nowhere.lora_A.weight"] = full[first]
    unknown["transformer.transformer_blocks.0.attn.to_nowhere.lora_B.weight"] = torch.zeros(8, full[first].shape[0])
    attempts = {
        "wrong shape": wrong_shape,
        "unknown target": unknown,
        "truncated": truncated,
        "different files": seed_files[rank],
        "only rank 1 wrong": wrong_shape if rank == 1 else full,
        "name in use": full,
    }
    errors = {}
    for what, source in attempts.items():
        name = "style" if what == "name in use" else "extra"
        try:
            model.load_lora_adapter(source, adapter_name=name)
            errors[what] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects type and message
            errors[what] = (type(exc).__name__, str(exc))
    after = run_forward(model, inputs)
    return {"rank": rank, "errors": errors, "same_output": torch.equal(before, after),
            "adapters": sorted(model.peft_config), "first_key": first.removeprefix("transformer.")}


def pipeline_lora(family: str, folder: str, mode: str, loras: dict[str, str], steps: int = 2) -> dict:
    """`pipe.load_lora_weights` on a paradiff pipeline (diffusers' format conversion included) against the
    single-process diffusers pipeline: images with the adapters, fused, unfused, unloaded."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from paradiff.testing.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps)
    reference = DiffusionPipeline.from_pretrained(folder)
    pipeline = paradiff.load_pipeline(folder, parallel_config=ParallelConfig.from_degrees(**parse_mode(mode)))
    for pipe in (reference, pipeline):
        pipe.set_progress_bar_config(disable=True)

    def images(pipe):
        call = dict(kwargs, generator=torch.Generator().manual_seed(0)) if pipe is reference else dict(kwargs, seed=0)
        return np.asarray(pipe(**call).images)

    diffs = {}

    def compare(step: str) -> None:
        expected = images(reference)
        diffs[step] = float(np.abs(images(pipeline) - expected).max() / max(np.abs(expected).max(), 1e-12))

    base = images(pipeline)
    for name, path in loras.items():
        for pipe in (reference, pipeline):
            pipe.load_lora_weights(path, adapter_name=name)
    compare("loaded")
    changed = float(np.abs(images(pipeline) - base).max())
    active = (pipeline.get_active_adapters(), reference.get_active_adapters())
    for pipe in (reference, pipeline):
        pipe.fuse_lora(lora_scale=0.8)
    compare("fused")
    for pipe in (reference, pipeline):
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    compare("unloaded")
    back_to_base = bool(np.array_equal(images(pipeline), base))
    # an adapter with text-encoder weights: refused on a split encoder, with the transformer's part taken out again
    from paradiff.errors import AdapterError
    from paradiff.tensor_parallel.layers import ShardedLinear

    q_proj = next(name for name, _ in reference.text_encoder.named_modules() if name.endswith("q_proj"))
    width = reference.text_encoder.get_submodule(q_proj).in_features
    with_encoder = {f"text_encoder.{q_proj}.lora_A.weight": torch.ones(4, width),
                    f"text_encoder.{q_proj}.lora_B.weight": torch.ones(width, 4)}
    with_encoder.update({k: v for k, v in load_file(next(iter(loras.values()))).items()})
    encoder_split = any(isinstance(m, ShardedLinear) for m in pipeline.text_encoder.modules())
    try:
        pipeline.load_lora_weights(with_encoder, adapter_name="with_encoder")
        encoder_error = None
    except AdapterError as exc:
        encoder_error = str(exc)
    return {"rank": dist.get_rank(), "diffs": diffs, "changed": changed, "active": active,
            "back_to_base": back_to_base, "encoder_split": encoder_split, "encoder_error": encoder_error,
            "adapters_after": sorted(getattr(pipeline.transformer, "peft_config", None) or {}),
            "still_base": bool(np.array_equal(images(pipeline), base)) if encoder_error else None}


def wan22_two_transformers(folder: str, mode: str, high: str, low: str, steps: int = 2) -> dict:
    """Wan 2.2 A14B: one adapter into `transformer` (high-noise steps), another into `transformer_2` with
    `load_into_transformer_2=True`, as its distillation LoRAs come; videos against diffusers'."""
    import numpy as np
    from diffusers import DiffusionPipeline

    from paradiff.testing.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs("wan2.2-a14b"), num_inference_steps=steps)
    reference = DiffusionPipeline.from_pretrained(folder)
    pipeline = paradiff.load_pipeline(folder, parallel_config=ParallelConfig.from_degrees(**parse_mode(mode)))
    for pipe in (reference, pipeline):
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(high, adapter_name="high")
        pipe.load_lora_weights(low, adapter_name="low", load_into_transformer_2=True)
    expected = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0)).frames)
    actual = np.asarray(pipeline(**kwargs, seed=0).frames)
    layers = {name: type(module).__name__ for name in ("transformer", "transformer_2")
              for module in getattr(pipeline, name).modules() if hasattr(module, "lora_A")}
    return {"rank": dist.get_rank(), "diff": float(np.abs(actual - expected).max() / np.abs(expected).max()),
            "adapters": {name: sorted(getattr(pipeline, name).peft_config) for name in ("transformer", "transformer_2")},
            "split_layers": sum(type(m).__name__ == "ShardedLoraLinear" and type(m.get_base_layer()).__name__ != "Linear"
                                for name in ("transformer", "transformer_2") for m in getattr(pipeline, name).modules()),
            "layer_classes": sorted(set(layers.values()))}


def compiled_hotswap(family: str, folder: str, mode: str, first: str, swaps: dict[str, str], target_rank: int) -> dict:
    """`enable_lora_hotswap(target_rank)` before the first load, then `paradiff.compile`, then each of `swaps`
    (label -> file) hot-swapped into the first adapter's layers: how many graphs Dynamo compiled before and after
    every swap, and the compiled output against diffusers' unsplit model with the swapped adapter freshly loaded."""
    from paradiff.testing.compile import RecordingBackend

    torch.set_num_threads(1)
    torch._dynamo.reset()
    cls = model_class(family)
    model = paradiff.from_pretrained(cls, folder, parallel_config=ParallelConfig.from_degrees(**parse_mode(mode)))
    inputs = make_inputs(family, model.config, batch=1, lengths=Lengths(height=4, width=4, text=6))
    model.enable_lora_hotswap(target_rank=target_rank)
    model.load_lora_adapter(first, adapter_name="style", use_safetensors=True)
    recorder = RecordingBackend()
    paradiff.compile(model, backend=recorder)

    def fresh(path: str) -> torch.Tensor:
        reference = cls.from_pretrained(folder).eval()
        reference.load_lora_adapter(path, adapter_name="style", use_safetensors=True)
        return run_forward(reference, inputs)

    diffs = {"first": _rel(run_forward(model, inputs), fresh(first))}
    graphs = {"first": len(recorder.graphs)}
    for label, path in swaps.items():
        model.load_lora_adapter(path, adapter_name="style", hotswap=True, use_safetensors=True)
        diffs[label] = _rel(run_forward(model, inputs), fresh(path))
        graphs[label] = len(recorder.graphs)
    shapes = sorted({tuple(layer.lora_A["style"].weight.shape[:1]) for layer in _lora_layers(model).values()})
    torch._dynamo.reset()
    return {"rank": dist.get_rank(), "diffs": diffs, "graphs": graphs, "padded": shapes}
