"""Functions run on every rank of a pool by tests/test_quantization.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import paradiff
from paradiff.io.checkpoint import Checkpoint
from paradiff.quant.apply import float32_4bit_products
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward
from rank_cases_encoder_classes import _relative as _relative_outputs  # per output, relative to its largest

NF4_BLOCK = 64


def quant_config(scheme: str):
    """The diffusers config a user passes for `scheme`."""
    from diffusers import BitsAndBytesConfig, TorchAoConfig

    if scheme == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return TorchAoConfig(Int8WeightOnlyConfig() if scheme == "int8" else Float8WeightOnlyConfig())


def parallel_config(mode: str):
    return paradiff.ParallelConfig.from_mode(mode)


def single_device_reference(cls, folder: str, scheme: str) -> dict[str, dict[str, torch.Tensor]]:
    """linear name -> the quantized tensors the single-device model holds. int8 / fp8: diffusers' own quantized load
    (TorchAoConfig). nf4: diffusers refuses bitsandbytes without a GPU, so the full fp32 weights quantized one by one
    with bitsandbytes' own quantize_4bit, with the arguments diffusers' Linear4bit passes (blocksize 64, no double
    quantization)."""
    if scheme != "nf4":
        model = cls.from_pretrained(folder, quantization_config=quant_config(scheme), torch_dtype=torch.float32)
        return {name: _torchao_parts(module.weight) for name, module in model.named_modules()
                if isinstance(module, nn.Linear) and hasattr(module.weight, "qdata")}
    import bitsandbytes.functional as bnb_functional

    model = cls.from_pretrained(folder)
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(f"{key}." in f"{name}.weight" for key in keep):
            continue
        packed, state = bnb_functional.quantize_4bit(module.weight.detach().contiguous(), blocksize=NF4_BLOCK,
                                                     quant_type="nf4", compress_statistics=False)
        out[name] = {"packed": packed.reshape(-1), "absmax": state.absmax, "shape": tuple(module.weight.shape)}
    return out


def _torchao_parts(weight) -> dict[str, torch.Tensor]:
    parts = {"qdata": weight.qdata, "scale": weight.scale}
    if getattr(weight, "zero_point", None) is not None:
        parts["zero_point"] = weight.zero_point
    return parts


def _held(module: nn.Module) -> dict[str, torch.Tensor] | None:
    weight = module.weight
    if hasattr(weight, "qdata"):
        return _torchao_parts(weight)
    if getattr(weight, "quant_state", None) is not None:
        return {"packed": weight.data.reshape(-1), "absmax": weight.quant_state.absmax}
    return None


def _nf4_expected(full: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """The slice of a single-device nf4 weight: blocks are row-major over the flattened weight, two values a byte."""
    if spec is None:
        return {"packed": full["packed"], "absmax": full["absmax"]}
    rows, cols = full["shape"]
    if spec.dim == 0:
        packed = [full["packed"][start * cols // 2:(start + length) * cols // 2] for start, length in spec.pieces]
        absmax = [full["absmax"][start * cols // NF4_BLOCK:-(-(start + length) * cols // NF4_BLOCK)]
                  for start, length in spec.pieces]
        return {"packed": torch.cat(packed), "absmax": torch.cat(absmax)}
    packed = full["packed"].view(rows, cols // 2)
    absmax = full["absmax"].view(rows, cols // NF4_BLOCK)
    return {
        "packed": torch.cat([packed[:, s // 2:(s + n) // 2] for s, n in spec.pieces], dim=1).reshape(-1),
        "absmax": torch.cat([absmax[:, s // NF4_BLOCK:(s + n) // NF4_BLOCK] for s, n in spec.pieces], dim=1).reshape(-1),
    }


def _torchao_expected(full: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """The slice of a single-device per-row tensor: a slice of rows slices the scales; a slice of columns keeps the
    whole row's scales."""
    if spec is None:
        return full
    out = {"qdata": slice_tensor(full["qdata"], spec)}
    for name in ("scale", "zero_point"):
        if name in full:
            out[name] = slice_tensor(full[name], spec) if spec.dim == 0 else full[name]
    return out


def quantized_equivalence(cases: list[dict]) -> list[dict]:
    """For each case (family, folder, scheme, mode): every quantized shard equals the slice of the single-device
    quantized tensor (data and scales), and the output matches the quantized single-process one."""
    results = []
    singles = {}  # (family, folder, scheme) -> the single-device tensors and outputs, shared by its modes
    for case in cases:
        family, folder, scheme, mode = case["family"], case["folder"], case["scheme"], case["mode"]
        cls = model_class(family)
        key = (family, folder, scheme)
        if key not in singles:
            singles[key] = _single_quantized(cls, family, folder, scheme)
        reference, single_outputs = singles[key]
        model = paradiff.from_pretrained(cls, folder, quantization_config=quant_config(scheme),
                                         parallel_config=parallel_config(mode), device="cpu")
        plan = get_state(model).tp_plan
        checked, column_split, local_bytes = 0, 0, 0
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            held = _held(module)
            assert (held is not None) == (name in reference), (name, type(module.weight))
            if held is None:
                continue
            spec = plan.spec_for(f"{name}.weight") if plan is not None else None
            column_split += spec is not None and spec.dim == 1
            expected = (_nf4_expected if scheme == "nf4" else _torchao_expected)(reference[name], spec)
            for part, tensor in expected.items():
                assert held[part].shape == tensor.shape, (name, part, held[part].shape, tensor.shape)
                assert torch.equal(held[part], tensor), (name, part)
            local_bytes += sum(t.numel() * t.element_size() for t in held.values())
            checked += 1
        diffs = []
        for inputs, expected in single_outputs:
            actual = run_forward(model, inputs)
            assert actual.shape == expected.shape
            diffs.append(float((actual - expected).abs().max() / expected.abs().max()))
        results.append({**{k: case[k] for k in ("family", "scheme", "mode")}, "rank": dist.get_rank(),
                        "quantized": checked, "column_split": column_split, "relative_diff": max(diffs),
                        "local_quantized_bytes": local_bytes, "counted": get_state(model) is not None})
    return results


def _single_quantized(cls, family: str, folder: str, scheme: str):
    """The single-device quantized tensors (single_device_reference), paradiff's single-process quantized model,
    checked to hold exactly those, and its outputs on batches of 1 and 2: (reference, [(inputs, output)])."""
    reference = single_device_reference(cls, folder, scheme)
    single = paradiff.from_pretrained(cls, folder, quantization_config=quant_config(scheme), device="cpu")
    single_held = {name: _held(m) for name, m in single.named_modules() if isinstance(m, nn.Linear)}
    for name, full in reference.items():
        expected = (_nf4_expected if scheme == "nf4" else _torchao_expected)(full, None)
        assert all(torch.equal(single_held[name][part], t) for part, t in expected.items()), name
    outputs = []
    for batch in (1, 2):
        inputs = make_inputs(family, single.config, batch=batch, lengths=Lengths(height=4, width=4, text=6))
        outputs.append((inputs, run_forward(single, inputs)))
    return reference, outputs


def refused_before_read(family: str, folder: str, scheme: str | None, mode: str) -> str:
    """The error a rank raises for a quantized load paradiff cannot do exactly; no weight may be read first.
    `scheme` None: the folder is pre-quantized."""
    original = Checkpoint.read

    def refuse(*_args, **_kwargs):
        raise AssertionError("a weight was read before the quantization request was checked")

    def refuse_weights(self, name, *args, **kwargs):  # a pre-quantized file's quant-state records may be read
        if ".quant_state.bitsandbytes__" in name:
            return original(self, name, *args, **kwargs)
        return refuse()

    Checkpoint.read = refuse_weights
    try:
        paradiff.from_pretrained(model_class(family), folder, parallel_config=parallel_config(mode), device="cpu",
                                 quantization_config=None if scheme is None else quant_config(scheme))
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return f"{type(exc).__name__}: {exc}"
    finally:
        Checkpoint.read = original
    return "no error"


def transformers_quant_config(scheme: str):
    """transformers' config for `scheme`: what a PipelineQuantizationConfig resolves for a text encoder."""
    import transformers

    if scheme == "nf4":
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return transformers.TorchAoConfig(Int8WeightOnlyConfig() if scheme == "int8" else Float8WeightOnlyConfig())


def loaded_as_on_avx512_bf16(load):
    """`load()` run as on an AVX512-BF16 CPU, whatever this machine is: bitsandbytes' capability probe, which each
    Linear4bit asks when it is built, answers yes."""
    import bitsandbytes as bnb
    from unittest import mock

    with mock.patch.object(bnb.nn.modules, "has_avx512bf16", return_value=True):
        return load()


def bf16_kernel_linears(model: nn.Module) -> list[str]:
    """The Linear4bit of `model` that take bitsandbytes' bf16 CPU kernel where the CPU has one."""
    import bitsandbytes as bnb

    return [name for name, module in model.named_modules()
            if isinstance(module, bnb.nn.Linear4bit) and module.support_avx512bf16_for_cpu]


def float32_precision() -> dict[str, str]:
    """torch's settings that let a float32 product run in reduced precision (oneDNN's bf16 / AMX kernels on an
    Intel CPU, TF32 on CUDA): every exactness test in this suite assumes full float32 ("highest" / "ieee" / "none")."""
    mkldnn = torch.backends.mkldnn
    return {"matmul_precision": torch.get_float32_matmul_precision(), "backends": torch.backends.fp32_precision,
            "mkldnn.matmul": mkldnn.matmul.fp32_precision, "mkldnn.conv": mkldnn.conv.fp32_precision}


FULL_FLOAT32 = {"highest", "ieee", "none"}


def _reference_parts(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The quantized tensors a single-device quantized linear holds (copies: a CPU forward may repack them)."""
    weight = module.weight
    if hasattr(weight, "qdata"):
        return {k: v.clone() for k, v in _torchao_parts(weight).items()}
    if getattr(weight, "quant_state", None) is not None:
        return {"packed": weight.data.reshape(-1).clone(), "absmax": weight.quant_state.absmax.clone(),
                "shape": tuple(weight.quant_state.shape)}
    return None




def text_encoders_quantized(folders: dict[str, str], schemes: dict[str, list[str]], tp: int) -> list[dict]:
    """Each text encoder class x scheme, loaded alone through paradiff at tp with transformers' config: every
    quantized shard equals the slice of what transformers' own single-device quantized load holds (data and scales),
    the linears transformers keeps in full precision (the LM head, T5's `wo`) are kept here too, and every output
    (all hidden states, logits) matches transformers' quantized model."""
    from paradiff_testkit.encoders import encoder_class, encoder_inputs, encoder_outputs

    torch.set_num_threads(1)
    results = []
    for name, folder in folders.items():
        cls = encoder_class(name)
        for scheme in schemes[name]:
            # computed as paradiff computes NF4 (float32 products; quant.apply.float32_4bit_products says why)
            reference = float32_4bit_products(cls.from_pretrained(
                folder, quantization_config=transformers_quant_config(scheme), dtype=torch.float32).eval())
            expected_parts = {n: _reference_parts(m) for n, m in reference.named_modules() if isinstance(m, nn.Linear)}
            model = loaded_as_on_avx512_bf16(lambda: paradiff.from_pretrained(
                cls, folder, quantization_config=transformers_quant_config(scheme),
                parallel_config=paradiff.TensorParallelConfig(tp), device="cpu"))
            plan = get_state(model).tp_plan
            held_names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
            assert held_names == set(expected_parts), sorted(held_names ^ set(expected_parts))
            checked, column_split, kept = 0, 0, []
            for module_name in sorted(held_names):
                held, full = _held(model.get_submodule(module_name)), expected_parts[module_name]
                assert (held is None) == (full is None), (name, scheme, module_name)
                if full is None:
                    kept.append(module_name)
                    continue
                spec = plan.spec_for(f"{module_name}.weight")
                column_split += spec is not None and spec.dim == 1
                expected = (_nf4_expected if scheme == "nf4" else _torchao_expected)(full, spec)
                for part, tensor in expected.items():
                    assert held[part].shape == tensor.shape, (name, module_name, part, held[part].shape, tensor.shape)
                    assert torch.equal(held[part], tensor), (name, scheme, module_name, part)
                checked += 1
            inputs = encoder_inputs(name, reference.config)
            results.append({"encoder": name, "scheme": scheme, "rank": dist.get_rank(), "quantized": checked,
                            "column_split": column_split, "kept": kept, "bf16_linears": bf16_kernel_linears(model),
                            "float32_precision": float32_precision(),
                            "diff": _relative_outputs(encoder_outputs(model, inputs),
                                                      encoder_outputs(reference, inputs))})
    return results


def pipeline_request(schemes: dict[str, str]):
    """A PipelineQuantizationConfig mapping each component to `scheme`: diffusers' config for the transformer,
    transformers' for a text encoder (what diffusers resolves for each)."""
    from diffusers import PipelineQuantizationConfig

    config = object.__new__(PipelineQuantizationConfig)  # a mixed mapping, built without diffusers' backend check
    config.quant_backend, config.components_to_quantize, config.config_mapping = None, None, {}
    config.quant_mapping = {name: transformers_quant_config(scheme) if name.startswith("text_encoder")
                            else quant_config(scheme) for name, scheme in schemes.items()}
    config.is_granular = True
    return config


def _snapshot_at_first_call(module: nn.Module, into: dict) -> None:
    """Keep, at the module's first forward (after a staged read and its quantization), the quantized tensors each
    linear holds: a staged pipeline frees them again after its stage."""
    def record(_module, _args, _kwargs):
        if not into:
            into.update({name: _held(m) for name, m in module.named_modules() if isinstance(m, nn.Linear)})

    module.register_forward_pre_hook(record, with_kwargs=True)


def pipeline_reference_key(family: str, schemes: dict[str, str]) -> str:
    return f"{family}:" + ",".join(f"{name}={scheme}" for name, scheme in sorted(schemes.items()))


def quantized_pipeline_reference(family: str, folder: str, schemes: dict[str, str]) -> dict:
    """The single-process paradiff pipeline with the same request (computed once, in the test process): its image
    and every quantized tensor it holds (each equal to diffusers' / transformers' own quantized load: tests above)."""
    from paradiff_testkit.pipelines import default_call_kwargs

    # one step: the shards are checked at the first call, and the image depends on them in every step alike
    # (Qwen-Image two: its one-step pipeline LoRA comparisons came out NaN, tests/test_lora.py)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=2 if family == "qwenimage" else 1)
    pipeline = paradiff.load_pipeline(folder, quantization_config=pipeline_request(schemes))
    pipeline.set_progress_bar_config(disable=True)
    parts = {name: {n: _reference_parts(m) for n, m in getattr(pipeline, name).named_modules()
                    if isinstance(m, nn.Linear)} for name in schemes}
    image = _pipeline_pixels(pipeline(**kwargs, seed=0))
    return {"kwargs": kwargs, "image": image, "parts": parts}


def _pipeline_pixels(output):
    import numpy as np

    return np.asarray(output.frames if hasattr(output, "frames") else output.images)


def pipeline_modes(folders: dict[str, str], runs: list[dict], references: dict[str, dict]) -> list[dict]:
    """Each run (family, mode, stages, schemes: component -> int8 / fp8 / nf4): load_pipeline on the mesh with that
    request; every quantized shard of the transformer and the text encoders (captured at their first call, so also
    under stages) equals the slice of the single-process quantized tensor, and the image equals the single-process
    quantized pipeline's (the VAE split beside them where the replica has more than one rank)."""
    import numpy as np

    from paradiff.vae import get_vae_runtime

    torch.set_num_threads(1)
    results = []
    for run in runs:
        family, schemes = run["family"], run["schemes"]
        reference = references[pipeline_reference_key(family, schemes)]
        kwargs = reference["kwargs"]
        pipeline = paradiff.load_pipeline(folders[family], parallel_config=paradiff.ParallelConfig.from_mode(run["mode"]),
                                          quantization_config=pipeline_request(schemes), stages=run["stages"])
        pipeline.set_progress_bar_config(disable=True)
        held = {name: {} for name in schemes}
        for name in schemes:
            _snapshot_at_first_call(getattr(pipeline, name), held[name])
        image = _pipeline_pixels(pipeline(**kwargs, seed=0))
        checked, split = {}, {}
        for name, scheme in schemes.items():
            state = get_state(getattr(pipeline, name))
            plan = state.tp_plan if state is not None else None
            assert held[name] and held[name].keys() == reference["parts"][name].keys(), (family, name)
            checked[name] = split[name] = 0
            for module_name, full in reference["parts"][name].items():
                parts = held[name][module_name]
                assert (parts is None) == (full is None), (family, run["mode"], name, module_name)
                if full is None:
                    continue
                spec = plan.spec_for(f"{module_name}.weight") if plan is not None else None
                split[name] += spec is not None
                expected = (_nf4_expected if scheme == "nf4" else _torchao_expected)(full, spec)
                for part, tensor in expected.items():
                    assert torch.equal(parts[part], tensor), (family, run["mode"], name, module_name, part)
                checked[name] += 1
        report = pipeline.quantization_report()
        held_bytes = {name: sum(t.numel() * t.element_size() for parts in held[name].values() if parts is not None
                                for t in parts.values()) for name in schemes}
        results.append({**run, "rank": dist.get_rank(), "checked": checked, "split": split,
                        "reported": {name: report[name] for name in schemes}, "held_bytes": held_bytes,
                        "image": float(np.abs(image - reference["image"]).max()),
                        "split_vae": get_vae_runtime(pipeline.vae) is not None,
                        "stage_names": [s["stage"] for s in pipeline.stage_report()]})
        del pipeline
    return results


def quantized_lora(folder: str, lora: str, schemes: list[str], modes: list[str]) -> list[dict]:
    """A LoRA adapter unfused on a quantized base (QLoRA style), per scheme and mode: the output equals the
    single-process quantized model with the same adapter (diffusers' and peft's own load), with the adapter
    active, disabled and re-enabled; fusing is refused on every rank before any layer merges (outputs unchanged)."""
    from paradiff.errors import AdapterError
    from paradiff.tensor_parallel.layers import ColwiseLinear, RowwiseLinear

    torch.set_num_threads(1)
    cls = model_class("flux2")
    results = []
    for scheme in schemes:
        reference = paradiff.from_pretrained(cls, folder, quantization_config=quant_config(scheme), device="cpu")
        inputs = make_inputs("flux2", reference.config, batch=2, lengths=Lengths(height=4, width=4, text=6))
        plain = run_forward(reference, inputs)
        reference.load_lora_adapter(lora, adapter_name="a", use_safetensors=True)
        adapted = run_forward(reference, inputs)
        for mode in modes:
            model = paradiff.from_pretrained(cls, folder, quantization_config=quant_config(scheme), device="cpu",
                                             parallel_config=paradiff.ParallelConfig.from_mode(mode))
            model.load_lora_adapter(lora, adapter_name="a", use_safetensors=True)
            diffs = {"adapted": _relative_outputs([run_forward(model, inputs)], [adapted])}
            model.disable_lora()
            diffs["disabled"] = _relative_outputs([run_forward(model, inputs)], [plain])
            model.enable_lora()
            try:
                model.fuse_lora()
                refusal = "no error"
            except AdapterError as exc:
                refusal = str(exc)
            diffs["after refused fuse"] = _relative_outputs([run_forward(model, inputs)], [adapted])
            bases = [m.base_layer for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
            results.append({"scheme": scheme, "mode": mode, "rank": dist.get_rank(), "diffs": diffs,
                            "refusal": refusal, "changed": float((adapted - plain).abs().max() / plain.abs().max()),
                            "quantized_bases": sum(_held(base) is not None for base in bases),
                            "colwise": sum(isinstance(b, ColwiseLinear) and _held(b) is not None for b in bases),
                            "rowwise": sum(isinstance(b, RowwiseLinear) and _held(b) is not None for b in bases)})
    return results


def compiled_quantized(folder: str, schemes: list[str], mode: str) -> list[dict]:
    """Per scheme: the quantized parallel model eager, then compiled by paradiff.compile (aot_eager: Dynamo and
    AOTAutograd, without inductor's C++ build), on the same inputs."""
    import torch._dynamo

    from paradiff.runtime.repeated_blocks import COMPILED_ATTR, repeated_blocks

    torch.set_num_threads(1)
    cls = model_class("flux2")
    results = []
    for scheme in schemes:
        torch._dynamo.reset()
        model = paradiff.from_pretrained(cls, folder, quantization_config=quant_config(scheme), device="cpu",
                                         parallel_config=paradiff.ParallelConfig.from_mode(mode))
        inputs = make_inputs("flux2", model.config, batch=2, lengths=Lengths(height=4, width=4, text=6))
        eager = run_forward(model, inputs)
        paradiff.compile(model, backend="aot_eager")
        compiled = run_forward(model, inputs)
        results.append({"scheme": scheme, "rank": dist.get_rank(), "diff": _relative_outputs([compiled], [eager]),
                        "compiled_blocks": len({type(block) for _, block in repeated_blocks(model)
                                                if getattr(block, COMPILED_ATTR, False)})})
    return results


def pipeline_requests_refused(folder: str, mode: str) -> list[str]:
    """load_pipeline on the mesh with requests paradiff cannot honour: the error each rank raises, with no weight
    read first (a mapping mixing a supported scheme with an unsupported one; NF4 on a text encoder whose split would
    cut a block)."""
    import transformers

    original = Checkpoint.read

    def refuse(*_args, **_kwargs):
        raise AssertionError("a weight was read before the quantization request was checked")

    requests = [pipeline_request({"transformer": "int8"}), pipeline_request({"text_encoder": "nf4"})]
    requests[0].quant_mapping["text_encoder"] = transformers.BitsAndBytesConfig(load_in_8bit=True)
    errors = []
    Checkpoint.read = refuse
    try:
        for request in requests:
            try:
                paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_mode(mode),
                                       quantization_config=request)
                errors.append("no error")
            except Exception as exc:  # noqa: BLE001 - the error is what the test checks
                errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        Checkpoint.read = original
    return errors


def load_memory(family: str, folder: str, schemes: list[str]) -> list[dict]:
    """For each scheme, a tp2 quantized load on fresh memory: the peak growth of this rank's anonymous resident memory
    during `from_pretrained`, the bytes it holds after (quantized weights and scales, other parameters), the bytes it
    read from the checkpoint and the largest slice it reads of one weight (in the load dtype)."""
    import ctypes
    import gc

    from paradiff.quant.apply import quantization_summary
    from paradiff.runtime.memory import PeakMemory, release_freed_memory, rss_anon_bytes

    # a fixed mmap threshold: every weight-sized block comes from mmap and goes back to the system when freed, so
    # the peak counts what is held, not glibc's growing heap (its threshold otherwise rises after each large free)
    ctypes.CDLL(None).mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    cpu = torch.device("cpu")
    # the first load in a process also pays for diffusers' and the backends' lazy imports (80 MB here): not measured
    paradiff.from_pretrained(model_class(family), folder, quantization_config=quant_config(schemes[0]),
                             parallel_config=parallel_config("tp2"), device="cpu", progress=False)
    results = []
    original = Checkpoint.read
    for scheme in schemes:
        counted = {"bytes": 0, "largest": 0}

        def counting_read(self, *args, **kwargs):
            tensor = original(self, *args, **kwargs)
            counted["bytes"] += tensor.numel() * tensor.element_size()
            counted["largest"] = max(counted["largest"], tensor.numel() * tensor.element_size())
            return tensor

        gc.collect()
        release_freed_memory(cpu)
        memory = PeakMemory(cpu)
        Checkpoint.read = counting_read
        try:
            with memory.active():
                memory.reset()
                baseline = rss_anon_bytes()
                model = paradiff.from_pretrained(model_class(family), folder, quantization_config=quant_config(scheme),
                                                 parallel_config=parallel_config("tp2"), device="cpu", progress=False)
                peak = memory.peak()
        finally:
            Checkpoint.read = original
        held = quantization_summary(model)
        results.append({"scheme": scheme, "growth": peak - baseline, "quantized_bytes": held["quantized_bytes"],
                        "full_precision_bytes": held["full_precision_bytes"], "quantized_linears": held["quantized_linears"],
                        "read_bytes": counted["bytes"], "largest_read": counted["largest"]})
        del model
    return results


def load_memory_fresh(rank: int, world_size: int, family: str, folder: str, schemes: list[str]) -> list[dict]:
    """`load_memory` in a freshly spawned rank (paradiff.distributed.spawn.run_ranks): what earlier cases left in a
    pool process (its allocator's state, gloo groups, compiled code) would count in the growth."""
    return load_memory(family, folder, schemes)


def _saved_reference(cls, folder: str, kind: str) -> nn.Module:
    """The single-device model diffusers builds from a pre-quantized folder: its own torchao load; for
    bitsandbytes 4-bit (diffusers needs a GPU for it) the same steps on CPU (paradiff_testkit.quant)."""
    if kind.startswith("bnb"):
        from paradiff_testkit.quant import reference_bnb_4bit

        return reference_bnb_4bit(cls, folder)
    model = cls.from_pretrained(folder, torch_dtype=torch.float32).eval()
    # fresh storage for its plain tensors (diffusers may keep views of the file's buffer, 8-byte aligned: a GEMM over
    # an unaligned weight may round differently, which is no property of the weights)
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is not None and type(param) is nn.Parameter and type(param.data) is torch.Tensor:
                module._parameters[leaf] = nn.Parameter(param.data.clone(), requires_grad=False)
    return model


def _bnb_held(weight, dequantize: bool) -> dict[str, torch.Tensor]:
    """A bitsandbytes 4-bit weight's packed codes and absmax (float32: the double-quantized absmax dequantized as
    bitsandbytes does before each product; else as held, with the nested absmax)."""
    import bitsandbytes.functional as bnb_functional

    state = weight.quant_state
    parts = {"packed": weight.data.reshape(-1)}
    if state.nested and dequantize:
        parts["absmax"] = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    else:
        parts["absmax"] = state.absmax
        if state.nested:
            parts["nested_absmax"] = state.state2.absmax
    return parts


def saved_equivalence(cases: list[dict]) -> list[dict]:
    """For each pre-quantized checkpoint (family, folder, kind, mode): every shard is the slice of what the
    single-device model diffusers builds holds (bnb: packed codes and absmax; torchao: data and scales), paradiff's
    single process holds exactly that model's tensors, and the outputs match it. Returns the bytes this rank read."""
    results = []
    original = Checkpoint.read
    loaded = {}  # (family, folder, kind) -> diffusers' model, paradiff's single process: shared by its modes
    for case in cases:
        family, folder, kind, mode = case["family"], case["folder"], case["kind"], case["mode"]
        cls = model_class(family)
        if (family, folder, kind) not in loaded:
            loaded[family, folder, kind] = (_saved_reference(cls, folder, kind),
                                            paradiff.from_pretrained(cls, folder, device="cpu", progress=False))
        reference, single = loaded[family, folder, kind]
        counted = {"bytes": 0}

        def counting_read(self, *args, **kwargs):
            tensor = original(self, *args, **kwargs)
            counted["bytes"] += tensor.numel() * tensor.element_size()
            return tensor

        Checkpoint.read = counting_read
        try:
            model = paradiff.from_pretrained(cls, folder, parallel_config=parallel_config(mode), device="cpu",
                                             progress=False)
        finally:
            Checkpoint.read = original
        plan = get_state(model).tp_plan
        checked, split = 0, 0
        for name, module in reference.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, nn.Linear) or not (hasattr(weight, "qdata") or hasattr(weight, "quant_state")):
                continue
            spec = plan.spec_for(f"{name}.weight") if plan is not None else None
            alone = single.get_submodule(name).weight
            held = model.get_submodule(name).weight
            if kind.startswith("bnb"):
                whole = _bnb_held(weight, dequantize=False)
                assert all(torch.equal(t, _bnb_held(alone, False)[k]) for k, t in whole.items()), name
                assert alone.quant_state.nested == weight.quant_state.nested, name
                full = {**_bnb_held(weight, dequantize=True), "shape": tuple(weight.quant_state.shape)}
                expected = _nf4_expected(full, spec)
                actual = _bnb_held(held, dequantize=True)
                assert tuple(held.quant_state.shape) == tuple(full["shape"] if spec is None
                                                              else spec.local_shape(full["shape"])), name
            else:
                whole = _torchao_parts(weight)
                assert all(torch.equal(t, _torchao_parts(alone)[k]) for k, t in whole.items()), name
                expected = _torchao_expected(whole, spec)
                actual = _torchao_parts(held)
            for part, tensor in expected.items():
                assert actual[part].shape == tensor.shape and torch.equal(actual[part], tensor), (name, part)
            checked += 1
            split += spec is not None
        diffs, single_diffs = [], []
        for batch in (1, 2):
            inputs = make_inputs(family, reference.config, batch=batch, lengths=Lengths(height=4, width=4, text=6))
            expected = run_forward(reference, inputs)
            scale = expected.abs().max()
            diffs.append(float((run_forward(model, inputs) - expected).abs().max() / scale))
            single_diffs.append(float((run_forward(single, inputs) - expected).abs().max() / scale))
        results.append({**{k: case[k] for k in ("family", "kind", "mode")}, "checked": checked, "split": split,
                        "relative_diff": max(diffs), "single_diff": max(single_diffs), "read_bytes": counted["bytes"]})
    return results


def saved_pipeline_image(folder: str, mode: str | None = None, stages: bool = False) -> dict:
    """A pipeline whose transformer folder was saved quantized, loaded by paradiff (on the mesh with `mode`, or one
    process), one seeded image and what the transformer held at its stage."""
    import numpy as np

    from paradiff_testkit.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    parallel = None if mode is None else paradiff.ParallelConfig.from_mode(mode)
    pipe = paradiff.load_pipeline(folder, parallel_config=parallel, stages=stages, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    image = np.asarray(pipe(**dict(default_call_kwargs("flux2"), num_inference_steps=1), seed=0).images)
    state = get_state(pipe.transformer)
    split = 0 if state is None or state.tp_plan is None else sum(
        state.tp_plan.spec_for(f"{name}.weight") is not None for name, m in pipe.transformer.named_modules()
        if isinstance(m, nn.Linear))
    return {"image": image, "transformer": pipe.quantization_report()["transformer"], "split": split}


def saved_pipelines_staged(runs: list[dict], references: dict[str, object]) -> list[dict]:
    """Each run (kind, folder, mode): the staged pipeline on the mesh (the transformer's stored parts read again at
    its stage, held as read) against the single-process resident pipeline of the same folder."""
    import numpy as np

    results = []
    for run in runs:
        got = saved_pipeline_image(run["folder"], run["mode"], stages=True)
        results.append({**{k: v for k, v in run.items() if k != "folder"}, "rank": dist.get_rank(),
                        "image": float(np.abs(got["image"] - references[run["kind"]]).max()),
                        "transformer": got["transformer"], "split": got["split"]})
    return results
