"""Run on every rank by tests/test_text_encoders.py: split text encoders and staged pipelines against diffusers'
single-process pipeline of the same folder (gloo, CPU, float32)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from diffusers import DiffusionPipeline

import paradiff
from paradiff.runtime.memory import parameter_bytes
from paradiff_testkit.pipelines import default_call_kwargs, encode_prompt_kwargs

# different lengths, so the shorter prompt is padded and the encoders' masks matter
PROMPTS = ["a cat", "a lighthouse on a rocky coast during a storm, dramatic lighting"]


def _config(tp: int = 1, ulysses: int = 1, dp: int = 1, fsdp: int = 1) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig.from_degrees(tp=tp, ulysses=ulysses, data=dp, fsdp=fsdp)


def _pixels(output) -> np.ndarray:
    return np.asarray(output.frames if hasattr(output, "frames") else output.images)


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _relative(actual, expected) -> float:
    actual, expected = _tensors(actual), _tensors(expected)
    assert len(actual) == len(expected) and actual, (len(actual), len(expected))
    worst = max(float((a.double() - e.double()).abs().max()) for a, e in zip(actual, expected))
    return worst / max(float(e.double().abs().max()) for e in expected)


def _encoders(pipeline) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in pipeline.components.items()
            if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)}


def reference(family: str, folder: str, steps: int = 2) -> dict:
    """diffusers' single-process results for one family: computed once, in the test process, for every case."""
    pipeline = DiffusionPipeline.from_pretrained(folder)
    pipeline.set_progress_bar_config(disable=True)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps)
    with torch.no_grad():
        embeds = _tensors(pipeline.encode_prompt(**encode_prompt_kwargs(family, PROMPTS)))
    image = _pixels(pipeline(**kwargs, generator=torch.Generator().manual_seed(0)))
    full = {name: parameter_bytes([module]) for name, module in _encoders(pipeline).items()}
    return {"kwargs": kwargs, "embeds": embeds, "image": image, "encoder_bytes": full}


def pipelines_match(folders: dict[str, str], references: dict[str, dict], degrees: dict,
                    stage_modes: dict[str, list[bool]]) -> dict:
    """For each family: encode_prompt (batch 2, padded) and a generation, with and without stages, against the
    single-process pipeline; the share of each encoder's parameter bytes this rank holds."""
    torch.set_num_threads(1)
    results = {}
    for family, folder in folders.items():
        expected = references[family]
        for stages in stage_modes[family]:
            pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees), stages=stages)
            pipeline.set_progress_bar_config(disable=True)
            with torch.no_grad():
                embeds = pipeline.encode_prompt(**encode_prompt_kwargs(family, PROMPTS))
            shares = {name: parameter_bytes([module]) / expected["encoder_bytes"][name]
                      for name, module in _encoders(pipeline).items()}
            image = _pixels(pipeline(**expected["kwargs"], seed=0))
            results[f"{family}/stages={stages}"] = {
                "embeds": _relative(embeds, expected["embeds"]),
                "image": float(np.abs(image - expected["image"]).max()),
                "encoder_shares": shares,
                # after a staged call only the VAE holds weights
                "held_after_call": {name: parameter_bytes([module]) for name, module in pipeline.components.items()
                                    if isinstance(module, torch.nn.Module)},
                "stages": [s["stage"] for s in pipeline.stage_report()],
            }
            del pipeline
    return results


def encoders_beyond_kv_heads(folders: dict[str, str], references: dict[str, dict], tp: int) -> dict:
    """encode_prompt at a TP degree above the encoders' K/V head count (K/V heads replicated within groups)."""
    torch.set_num_threads(1)
    results = {}
    for family, folder in folders.items():
        pipeline = paradiff.load_pipeline(folder, parallel_config=_config(tp=tp))
        with torch.no_grad():
            actual = pipeline.encode_prompt(**encode_prompt_kwargs(family, PROMPTS))
        attention = next(m for n, m in pipeline.text_encoder.named_modules() if n.endswith("layers.0.self_attn"))
        results[family] = {
            "embeds": _relative(actual, references[family]["embeds"]),
            "kv_rows": attention.k_proj.weight.shape[0],
            "head_dim": attention.head_dim,
            "groups": attention.num_key_value_groups,
        }
    return results


def data_parallel_staged(family: str, folder: str, prompts: list[str]) -> dict:
    """dp2 x tp2 with stages: each replica encodes, denoises and decodes its own share of the prompts."""
    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=2)
    kwargs.pop("prompt")
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(tp=2, dp=2), stages=True)
    pipeline.set_progress_bar_config(disable=True)
    made = {}
    with paradiff.split_between_processes(list(enumerate(prompts)), pipeline) as share:
        images = _pixels(pipeline(prompt=[p for _, p in share], seed=0,
                                  generator=[torch.Generator().manual_seed(100 + i) for i, _ in share], **kwargs))
        made = {index: image for (index, _), image in zip(share, images)}
    return {"rank": dist.get_rank(), "made": made}


def data_parallel_expected(family: str, folder: str, prompts: list[str]) -> dict:
    """diffusers' single-process image of each prompt with `data_parallel_staged`'s seeds: made once, in the test
    process beside the ranks (each rank loaded the reference and drew its own prompts before)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kwargs = dict(default_call_kwargs(family), num_inference_steps=2)
        kwargs.pop("prompt")
        reference = DiffusionPipeline.from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        return {index: _pixels(reference(prompt=prompt, generator=torch.Generator().manual_seed(100 + index),
                                         **kwargs))[0] for index, prompt in enumerate(prompts)}
    finally:
        torch.set_num_threads(threads)


def unplanned_encoder(folder: str, scratch: str) -> dict:
    """A pipeline whose text encoder class has no plan: by default it stays whole on each rank with one warning;
    with shard_text_encoders=True every rank refuses with the same clear error before any weight is read;
    shard_text_encoders=False or text_encoder_plans= then load it."""
    torch.set_num_threads(1)
    target = Path(scratch)
    if dist.get_rank() == 0 and not target.exists():
        unplanned_encoder_folder(folder, scratch)
    dist.barrier()
    out = {"rank": dist.get_rank()}
    warnings = _WarningsNaming("MT5EncoderModel")
    logging.getLogger("paradiff").addHandler(warnings)
    try:
        default = paradiff.load_pipeline(str(target), parallel_config=_config(tp=2))
        default_cp = paradiff.load_pipeline(str(target), parallel_config=_config(ulysses=2))  # CP-only: same rule
    finally:
        logging.getLogger("paradiff").removeHandler(warnings)
    out["default_warnings"] = warnings.count
    try:
        paradiff.load_pipeline(str(target), parallel_config=_config(tp=2), shard_text_encoders=True)
        out["error"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    whole = paradiff.load_pipeline(str(target), parallel_config=_config(tp=2), shard_text_encoders=False)
    out["whole_share"] = parameter_bytes([whole.text_encoder])
    from paradiff.plans.text_encoders import t5

    plan = t5.tensor_parallel_plan(whole.text_encoder.config, model_class="T5EncoderModel")  # MT5: T5 layout
    given = paradiff.load_pipeline(str(target), parallel_config=_config(tp=2), text_encoder_plans={"text_encoder": plan})
    out["given_share"] = parameter_bytes([given.text_encoder]) / out["whole_share"]
    out["default_share"] = parameter_bytes([default.text_encoder]) / out["whole_share"]
    with torch.no_grad():
        kwargs = encode_prompt_kwargs("wan", PROMPTS)
        out["given_vs_whole"] = _relative(given.encode_prompt(**kwargs), whole.encode_prompt(**kwargs))
        out["default_vs_whole"] = _relative(default.encode_prompt(**kwargs), whole.encode_prompt(**kwargs))
        out["default_cp_vs_whole"] = _relative(default_cp.encode_prompt(**kwargs), whole.encode_prompt(**kwargs))
    out["default_cp_share"] = parameter_bytes([default_cp.text_encoder]) / out["whole_share"]
    # compared with diffusers' single-process pipeline on the same folder in the test process (`reference`)
    kwargs = dict(default_call_kwargs("wan"), num_inference_steps=2)
    for name, pipeline in (("default", default), ("default_cp", default_cp)):
        pipeline.set_progress_bar_config(disable=True)
        out[f"{name}_image"] = _pixels(pipeline(**kwargs, seed=0))
    return out


def unplanned_encoder_folder(folder: str, scratch: str) -> str:
    """The tiny Wan pipeline copied to `scratch` with its UMT5 text encoder named MT5EncoderModel: same weights, a
    class paradiff has no plan for."""
    target = Path(scratch)
    shutil.copytree(folder, target)
    index = json.loads((target / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "MT5EncoderModel"]  # same weights as UMT5, no paradiff plan
    (target / "model_index.json").write_text(json.dumps(index))
    config = json.loads((target / "text_encoder" / "config.json").read_text())
    config.update(architectures=["MT5EncoderModel"], model_type="mt5")
    (target / "text_encoder" / "config.json").write_text(json.dumps(config))
    return str(target)


class _WarningsNaming(logging.Handler):
    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text, self.count = text, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += self.text in record.getMessage()


def device_map_for_whole_components(family: str, folder: str) -> dict:
    """device_map / max_memory reach diffusers for the components paradiff does not split."""
    torch.set_num_threads(1)
    pipeline = paradiff.load_pipeline(folder, parallel_config=_config(tp=2), shard_text_encoders=False,
                                      device_map="cpu", max_memory={"cpu": "8GB"})
    pipeline.set_progress_bar_config(disable=True)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=2)
    image = _pixels(pipeline(**kwargs, seed=0))
    # compared with diffusers' single-process pipeline in the test process (`device_map_expected`)
    return {"device_map": getattr(pipeline, "hf_device_map", None), "image": image,
            "encoder_bytes": parameter_bytes([pipeline.text_encoder])}


def device_map_expected(family: str, folder: str) -> dict:
    """diffusers' single-process image and text-encoder bytes for `device_map_for_whole_components`, made once in
    the test process beside the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = DiffusionPipeline.from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        kwargs = dict(default_call_kwargs(family), num_inference_steps=2)
        return {"image": _pixels(reference(**kwargs, generator=torch.Generator().manual_seed(0))),
                "encoder_bytes": parameter_bytes([reference.text_encoder])}
    finally:
        torch.set_num_threads(threads)


def staged_matches_unstaged_in_dtypes(family: str, folder: str, degrees: dict, dtypes: list[str]) -> dict:
    """In each half-precision dtype: the pipeline staged against the same pipeline unstaged (same dtype, same mesh),
    and the dtype every component reports after the load, and after a staged call freed all but the VAE."""
    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=1, output_type="pt")
    parallel = _config(**degrees) if degrees else None
    results = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        images, reported = {}, {}
        for stages in (False, True):
            pipeline = paradiff.load_pipeline(folder, parallel_config=parallel, torch_dtype=dtype, stages=stages)
            pipeline.set_progress_bar_config(disable=True)
            modules = {n: m for n, m in pipeline.components.items() if isinstance(m, torch.nn.Module)}
            reported[f"stages={stages} loaded"] = {n: str(m.dtype) for n, m in modules.items()}
            output = pipeline(**kwargs, seed=0)
            images[stages] = torch.stack(list(output.images)).double() if "images" in output else output.frames.double()
            reported[f"stages={stages} called"] = {n: str(m.dtype) for n, m in modules.items()}
            del pipeline
        results[name] = {"diff": float((images[True] - images[False]).abs().max()), "dtypes": reported}
    return results
