"""Functions run on every rank of a pool by tests/test_lora.py (gloo, CPU): paradiff's LoRA against diffusers' own
LoRA on the unsplit model, step by step on one loaded model (so one pool run covers a whole mode)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.config import ParallelConfig, parse_mode
from paradiff_testkit.lora import check_factor_slices, lora_layers, pipeline_lora, relative_difference
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward


def _shards(model) -> dict[str, torch.Tensor]:
    return {name: module.get_base_layer().weight.detach().clone() for name, module in lora_layers(model).items()}


def lora_equivalence(family: str, folder: str, mode: str, loras: dict[str, str], weights: dict[str, float],
                     fuse_scale: float = 0.5, via: str = "file", swap: str | None = None,
                     references: dict | None = None) -> dict:
    """Load `loras` (adapter name -> file) into a paradiff model in `mode` and into diffusers' single-process model,
    then compare outputs after: the first adapter; all mixed by `weights`; `swap` hot-swapped into the first one's
    layers (when given); disable / enable; fuse (then the shards
    against the originals after unfuse); delete of the last adapter; unload. Returns every relative difference.
    `references`: what diffusers' model gave per step (outputs, active adapters, the full factors), kept by the
    first case of the same family, adapters and steps and replayed for the next ones (another mode, the same
    reference: diffusers' model is not loaded or run again)."""
    import copy

    from safetensors.torch import load_file

    cls = model_class(family)
    key = (family, folder, tuple(loras.items()), tuple(weights.items()), fuse_scale, via, swap)
    recorded = (references or {}).get(key)
    replay = recorded is not None
    if not replay:
        reference = cls.from_pretrained(folder).eval()
        recorded = {"outputs": {}, "inputs": make_inputs(family, reference.config, batch=2,
                                                         lengths=Lengths(height=4, width=4, text=6))}
    config = ParallelConfig.from_degrees(**parse_mode(mode))
    model = paradiff.from_pretrained(cls, folder, parallel_config=config)
    inputs = recorded["inputs"]
    diffs, names = {}, list(loras)

    def on_reference(action) -> None:  # diffusers' side of a step: skipped when its outputs are replayed
        if not replay:
            action(reference)

    def compare(step: str) -> None:
        if not replay:
            recorded["outputs"][step] = run_forward(reference, inputs)
        diffs[step] = relative_difference(run_forward(model, inputs), recorded["outputs"][step])

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
        on_reference(lambda ref: ref.load_lora_adapter(expected_source, adapter_name=name, **extra))
        model.load_lora_adapter(source, adapter_name=name, **extra)
        if name == names[0]:
            compare(f"only {name}")
    report = model._paradiff_lora_load
    on_reference(lambda ref: ref.set_adapters(names, [weights[n] for n in names]))
    model.set_adapters(names, [weights[n] for n in names])
    compare("mixed")
    if swap is not None:  # another adapter of the same shape into the first one's layers, in place
        on_reference(lambda ref: ref.load_lora_adapter(swap, adapter_name=names[0], hotswap=True,
                                                       use_safetensors=True))
        model.load_lora_adapter(swap, adapter_name=names[0], hotswap=True, use_safetensors=True)
        compare("hotswapped")
    if not replay:  # the full factors as they are now, and the adapters active
        recorded["factors"], recorded["active"] = copy.deepcopy(reference), reference.active_adapters()
    sliced = check_factor_slices(model, recorded["factors"])
    assert model.active_adapters() == recorded["active"]
    on_reference(lambda ref: ref.disable_lora())
    model.disable_lora()
    compare("disabled")
    on_reference(lambda ref: ref.enable_lora())
    model.enable_lora()
    compare("enabled")
    originals = _shards(model)
    on_reference(lambda ref: ref.fuse_lora(lora_scale=fuse_scale))
    model.fuse_lora(lora_scale=fuse_scale)
    compare("fused")
    fused_changed = sum(not torch.equal(t, originals[n]) for n, t in _shards(model).items())
    on_reference(lambda ref: ref.unfuse_lora())
    model.unfuse_lora()
    compare("unfused")
    unfused_exact = all(torch.equal(t, originals[n]) for n, t in _shards(model).items())
    on_reference(lambda ref: ref.delete_adapters(names[-1]))
    model.delete_adapters(names[-1])
    compare("deleted")
    on_reference(lambda ref: ref.unload_lora())
    model.unload_lora()
    assert not lora_layers(model)
    compare("unloaded")
    if references is not None:
        references[key] = recorded
    return {"rank": dist.get_rank(), "diffs": diffs, "sliced": sliced, "fused_changed": fused_changed,
            "layers": len(originals), "unfused_exact": unfused_exact, "bytes_read": report.bytes_read,
            "local_bytes": report.local_bytes, "tensors": report.tensors}



def lora_cases(cases: list[dict]) -> list[dict]:
    """Several `lora_equivalence` cases in one pool run (the pools are shared: fewer runs, a faster suite)."""
    torch.set_num_threads(1)
    references = {}  # diffusers' outputs per family and adapters, computed once for all the modes of the batch
    return [dict(lora_equivalence(**case, references=references), case=case) for case in cases]


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


def pipeline_lora_cases(cases: list[dict]) -> list[dict]:
    """Several `pipeline_lora` cases in one pool run (diffusers' pipeline run once per folder, adapters and prompt)."""
    torch.set_num_threads(1)
    references = {}
    return [dict(pipeline_lora(**case, references=references), case=case) for case in cases]


def wan22_two_transformers(folder: str, mode: str, high: str, low: str, steps: int = 2) -> dict:
    """Wan 2.2 A14B: one adapter into `transformer` (high-noise steps), another into `transformer_2` with
    `load_into_transformer_2=True`, as its distillation LoRAs come; videos against diffusers'."""
    import numpy as np
    from diffusers import DiffusionPipeline

    from paradiff_testkit.pipelines import default_call_kwargs

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
    from paradiff_testkit.compile import RecordingBackend

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

    diffs = {"first": relative_difference(run_forward(model, inputs), fresh(first))}
    graphs = {"first": len(recorder.graphs)}
    for label, path in swaps.items():
        model.load_lora_adapter(path, adapter_name="style", hotswap=True, use_safetensors=True)
        diffs[label] = relative_difference(run_forward(model, inputs), fresh(path))
        graphs[label] = len(recorder.graphs)
    shapes = sorted({tuple(layer.lora_A["style"].weight.shape[:1]) for layer in lora_layers(model).values()})
    torch._dynamo.reset()
    return {"rank": dist.get_rank(), "diffs": diffs, "graphs": graphs, "padded": shapes}
