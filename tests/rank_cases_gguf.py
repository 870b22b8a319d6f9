"""Functions run on every rank of a pool by tests/test_gguf.py (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import paradiff
from paradiff.io.gguf import GGUFFile
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff.tensor_parallel.styles import ShardSpec
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward


def gguf_config():
    from diffusers import GGUFQuantizationConfig

    return GGUFQuantizationConfig(compute_dtype=torch.float32)


def parallel_config(mode: str):
    if mode == "tp2":
        return paradiff.TensorParallelConfig(tp_degree=2)
    if mode == "ulysses2":
        return paradiff.ContextParallelConfig(ulysses_degree=2)
    if mode == "tp2xulysses2":
        return paradiff.ParallelConfig.from_degrees(tp=2, ulysses=2)
    raise ValueError(mode)


def _rchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _packed_slice(full, spec: ShardSpec | None) -> torch.Tensor:
    """The slice of a single-device GGUFParameter's bytes: rows as they are; columns as the bytes of whole
    blocks (start / block x type_size)."""
    import gguf

    data = full.as_tensor()
    if spec is None or spec.dim == 0:
        return slice_tensor(data, spec)
    block, type_size = gguf.GGML_QUANT_SIZES[full.quant_type]
    return slice_tensor(data, ShardSpec(spec.dim, tuple((s // block * type_size, n // block * type_size)
                                                        for s, n in spec.pieces)))


def gguf_equivalence(cases: list[dict]) -> list[dict]:
    """For each case (file, config, mode, plain_itemsize): every tensor this rank holds equals the slice of what
    diffusers' single-process `from_single_file` GGUF model holds (packed bytes for quantized weights), the
    bytes read from the file (measured by the kernel) stay within the rank's share, and the output matches."""
    results = []
    cls = model_class("flux2")
    for case in cases[:1]:  # first loads import modules (their reads count too); measure warm loads
        paradiff.from_pretrained(cls, case["file"], config=case["config"], quantization_config=gguf_config(),
                                 parallel_config=parallel_config(case["mode"]), device="cpu")
    for case in cases:
        reference = cls.from_single_file(case["file"], config=case["config"], quantization_config=gguf_config())
        dist.barrier()
        before = _rchar()
        model = paradiff.from_pretrained(cls, case["file"], config=case["config"], quantization_config=gguf_config(),
                                         parallel_config=parallel_config(case["mode"]), device="cpu")
        read = _rchar() - before
        plan = get_state(model).tp_plan
        expected_params = dict(reference.named_parameters())
        share, packed_bytes, splits = 0, 0, {}
        for name, held in model.named_parameters():
            full = expected_params[name]
            spec = plan.spec_for(name) if plan is not None else None
            quant_type = getattr(full, "quant_type", None)
            assert getattr(held, "quant_type", None) == quant_type, (name, type(held))
            if quant_type is not None:
                expected = _packed_slice(full, spec)
                nbytes = held.numel()
                packed_bytes += nbytes
                kind = quant_type.name
            else:
                expected = slice_tensor(full.detach(), spec)
                nbytes = held.numel() * case["plain_itemsize"].get(name, 4)
                kind = "F16" if case["plain_itemsize"].get(name) == 2 else "F32"
            assert held.dtype == expected.dtype and held.shape == expected.shape, (name, held.shape, expected.shape)
            assert torch.equal(held.as_tensor() if quant_type is not None else held.detach(), expected), name
            share += nbytes
            if held.dim() == 2:
                splits.setdefault(kind, set()).add("whole" if spec is None else ("rows", "columns")[spec.dim])
        whole_linears = [name for name, module in model.named_modules()
                         if type(module) is nn.Linear and hasattr(getattr(reference.get_submodule(name), "weight"),
                                                                   "quant_type")]
        assert not whole_linears, whole_linears  # every packed whole linear is diffusers' GGUFLinear, as in diffusers
        diffs = []
        for batch in (1, 2):
            inputs = make_inputs("flux2", reference.config, batch=batch, lengths=Lengths(height=4, width=4, text=6))
            expected_out = run_forward(reference, inputs)
            actual = run_forward(model, inputs)
            assert actual.shape == expected_out.shape
            diffs.append(float((actual - expected_out).abs().max() / expected_out.abs().max()))
        with GGUFFile(case["file"]) as gguf_file:
            header, total = gguf_file.header_bytes, sum(info.nbytes for info in gguf_file.tensors.values())
        results.append({"mode": case["mode"], "rank": dist.get_rank(), "relative_diff": max(diffs), "read": read,
                        "share": share, "packed_bytes": packed_bytes, "header": header, "total": total,
                        "splits": {kind: sorted(where) for kind, where in splits.items()}})
    return results


def refused_before_read(file: str, config: str) -> str:
    """The error a rank raises for a GGUF load paradiff cannot slice; no tensor may be read first."""
    original = GGUFFile.read

    def refuse(*_args, **_kwargs):
        raise AssertionError("a tensor was read before the plan's slices were checked")

    GGUFFile.read = refuse
    try:
        paradiff.from_pretrained(model_class("flux2"), file, config=config, quantization_config=gguf_config(),
                                 parallel_config=parallel_config("tp2"), device="cpu")
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return f"{type(exc).__name__}: {exc}"
    finally:
        GGUFFile.read = original
    return "no error"


def pipeline_gguf(folder: str, file: str) -> dict:
    """load_pipeline(tp2, transformer_file=the GGUF file) holds the transformer shards `from_pretrained` of the file
    gives at tp2, and its images equal those of diffusers' pipeline with the same file's single-device
    `from_single_file` transformer; then the same staged (`stages=True`: the slices read again at the transformer's
    stage). Returns the largest pixel differences and how many packed weights it holds."""
    import numpy as np
    from diffusers import DiffusionPipeline, PipelineQuantizationConfig

    from paradiff_testkit.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    config = PipelineQuantizationConfig(quant_mapping={"transformer": gguf_config()})
    pipe = paradiff.load_pipeline(folder, parallel_config=parallel_config("tp2"), transformer_file=file,
                                  quantization_config=config, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    cls = type(pipe.transformer)
    alone = paradiff.from_pretrained(cls, file, config=folder, subfolder="transformer",
                                     quantization_config=gguf_config(), parallel_config=parallel_config("tp2"),
                                     device="cpu")
    held = dict(pipe.transformer.named_parameters())
    expected = dict(alone.named_parameters())
    assert held.keys() == expected.keys()
    packed = 0
    for name, param in expected.items():
        assert type(held[name]) is type(param) and torch.equal(held[name].data, param.data), name
        packed += getattr(param, "quant_type", None) is not None
    transformer = cls.from_single_file(file, config=folder, subfolder="transformer", quantization_config=gguf_config(),
                                       torch_dtype=torch.float32)
    reference = DiffusionPipeline.from_pretrained(folder, transformer=transformer)
    reference.set_progress_bar_config(disable=True)
    kwargs = dict(default_call_kwargs("flux2"), num_inference_steps=1)  # the shards act alike in every step
    actual = np.asarray(pipe(**kwargs, seed=0).images)
    wanted = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0)).images)
    del pipe
    # staged: the file's slices read again at the transformer's stage and wrapped in place
    staged = paradiff.load_pipeline(folder, parallel_config=parallel_config("tp2"), transformer_file=file,
                                    quantization_config=config, device="cpu", stages=True)
    staged.set_progress_bar_config(disable=True)
    staged_image = np.asarray(staged(**kwargs, seed=0).images)
    return {"diff": float(np.abs(actual - wanted).max()), "packed": packed, "spread": float(wanted.std()),
            "staged_diff": float(np.abs(staged_image - wanted).max()),
            "staged_packed": staged.quantization_report()["transformer"]["quantized_linears"]}
