"""Functions run on every rank of a pool by tests/test_quantization.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import paradiff
from paradiff.io.checkpoint import Checkpoint
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward

NF4_BLOCK = 64


def quant_config(scheme: str):
    """The diffusers config a user passes for `scheme`."""
    from diffusers import BitsAndBytesConfig, TorchAoConfig

    if scheme == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return TorchAoConfig(Int8WeightOnlyConfig() if scheme == "int8" else Float8WeightOnlyConfig())


def parallel_config(mode: str):
    if mode == "tp2":
        return paradiff.TensorParallelConfig(tp_degree=2)
    if mode == "ulysses2":
        return paradiff.ContextParallelConfig(ulysses_degree=2)
    raise ValueError(mode)


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
    for case in cases:
        family, folder, scheme, mode = case["family"], case["folder"], case["scheme"], case["mode"]
        cls = model_class(family)
        reference = single_device_reference(cls, folder, scheme)
        single = paradiff.from_pretrained(cls, folder, quantization_config=quant_config(scheme), device="cpu")
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
        single_held = {name: _held(m) for name, m in single.named_modules() if isinstance(m, nn.Linear)}
        for name, full in reference.items():
            expected = (_nf4_expected if scheme == "nf4" else _torchao_expected)(full, None)
            assert all(torch.equal(single_held[name][part], t) for part, t in expected.items()), name
        diffs = []
        for batch in (1, 2):
            inputs = make_inputs(family, single.config, batch=batch, lengths=Lengths(height=4, width=4, text=6))
            expected = run_forward(single, inputs)
            actual = run_forward(model, inputs)
            assert actual.shape == expected.shape
            diffs.append(float((actual - expected).abs().max() / expected.abs().max()))
        results.append({**{k: case[k] for k in ("family", "scheme", "mode")}, "rank": dist.get_rank(),
                        "quantized": checked, "column_split": column_split, "relative_diff": max(diffs),
                        "local_quantized_bytes": local_bytes, "counted": get_state(model) is not None})
    return results


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


def pipeline_quantized(folder: str) -> int:
    """load_pipeline(tp2, a PipelineQuantizationConfig for the transformer): its shards are those of the model-level
    quantized tp2 load. Returns how many quantized linears were compared."""
    from diffusers import PipelineQuantizationConfig

    config = PipelineQuantizationConfig(quant_mapping={"transformer": quant_config("int8")})
    pipe = paradiff.load_pipeline(folder, parallel_config=parallel_config("tp2"), quantization_config=config,
                                  device="cpu")
    alone = paradiff.from_pretrained(type(pipe.transformer), f"{folder}/transformer", device="cpu",
                                     parallel_config=parallel_config("tp2"), quantization_config=quant_config("int8"))
    compared = 0
    for name, module in pipe.transformer.named_modules():
        if isinstance(module, nn.Linear):
            held, expected = _held(module), _held(alone.get_submodule(name))
            assert held is not None and held.keys() == expected.keys(), name
            assert all(torch.equal(held[k], expected[k]) for k in held), name
            compared += 1
    return compared


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
                        "other_bytes": held["other_bytes"], "quantized_linears": held["quantized_linears"],
                        "read_bytes": counted["bytes"], "largest_read": counted["largest"]})
        del model
    return results


def _saved_reference(cls, folder: str, kind: str) -> nn.Module:
    """The single-device model diffusers builds from a pre-quantized folder: its own torchao load; for
    bitsandbytes 4-bit (diffusers needs a GPU for it) the same steps on CPU (paradiff.testing.quant)."""
    if kind.startswith("bnb"):
        from paradiff.testing.quant import reference_bnb_4bit

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
    for case in cases:
        family, folder, kind, mode = case["family"], case["folder"], case["kind"], case["mode"]
        cls = model_class(family)
        reference = _saved_reference(cls, folder, kind)
        single = paradiff.from_pretrained(cls, folder, device="cpu", progress=False)
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
