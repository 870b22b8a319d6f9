"""Run on every rank by tests/test_encoder_classes.py: each encoder class loaded alone through paradiff at a TP
degree, against transformers' single-process model of the same checkpoint (gloo, CPU, float32)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paradiff
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.layers import ShardedLinear
from paradiff.tensor_parallel.shard import slice_tensor
from paradiff_testkit.encoders import encoder_class, encoder_inputs, encoder_outputs


def _relative(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    assert len(actual) == len(expected) and actual, (len(actual), len(expected))
    worst = 0.0
    for a, e in zip(actual, expected):
        assert a.shape == e.shape, (a.shape, e.shape)
        worst = max(worst, float((a.double() - e.double()).abs().max()) / max(float(e.double().abs().max()), 1e-30))
    return worst


def _held_slices(model, full: dict[str, torch.Tensor]) -> dict:
    """Every tensor this rank holds equals its slice of the full one (`full`: the single-process model's
    state_dict), the slice named by the resolved plan."""
    resolved = get_state(model).tp_plan
    local = model.state_dict()
    assert set(full) == set(local), sorted(set(full) ^ set(local))
    split = []
    for name, tensor in local.items():
        spec = resolved.spec_for(name)
        expected = slice_tensor(full[name], spec)
        assert tensor.shape == expected.shape, (name, tuple(tensor.shape), tuple(expected.shape))
        assert torch.equal(tensor, expected), name
        if spec is not None:
            split.append(name)
    assert any(isinstance(m, ShardedLinear) for m in model.modules())
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    return {"split_tensors": len(split), "share": nbytes(local.values()) / nbytes(full.values())}


def reference(name: str, folder: str) -> dict:
    """transformers' single-process model of one class: its state_dict and its outputs on `encoder_inputs`. Made
    once in the test process (tests/test_encoder_classes.py) for every rank of every TP degree, which each loaded
    and ran it themselves before."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = encoder_class(name).from_pretrained(folder).eval()
        return {"state": model.state_dict(), "outputs": encoder_outputs(model, encoder_inputs(name, model.config))}
    finally:
        torch.set_num_threads(threads)


def encoder_classes_match(folders: dict[str, str], references: dict[str, dict], tp: int) -> dict:
    """For each class: outputs (every hidden state, pooled / projected outputs, logits) relative to the single
    process (`references`: `reference` of each class), what this rank holds, and its share of the parameter bytes."""
    torch.set_num_threads(1)
    results = {}
    for name, folder in folders.items():
        cls = encoder_class(name)
        model = paradiff.from_pretrained(cls, folder, parallel_config=paradiff.TensorParallelConfig(tp))
        inputs = encoder_inputs(name, model.config)
        results[name] = {
            "diff": _relative(encoder_outputs(model, inputs), references[name]["outputs"]),
            **_held_slices(model, references[name]["state"]),
        }
    return {"rank": dist.get_rank(), "classes": results}


def image_encoder_in_pipeline(folder: str, modes: dict[str, dict]) -> dict:
    """A Wan I2V pipeline folder: `encode_image` (two images) through load_pipeline per mode, against diffusers'
    single-process pipeline, the image encoder's held slices and its share."""
    from diffusers import DiffusionPipeline

    from paradiff_testkit.encoders import sample_images

    torch.set_num_threads(1)
    reference = DiffusionPipeline.from_pretrained(folder)
    images = sample_images()
    with torch.no_grad():
        expected = reference.encode_image(images, device=torch.device("cpu"))
    results = {}
    for mode, degrees in modes.items():
        pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees))
        with torch.no_grad():
            actual = pipeline.encode_image(images, device=torch.device("cpu"))
        results[mode] = {"diff": _relative([actual], [expected]),
                         **_held_slices(pipeline.image_encoder, reference.image_encoder.state_dict())}
    return {"rank": dist.get_rank(), "modes": results}


def cogview4_pipeline_matches(folder: str, prompts: list[str], modes: dict[str, dict]) -> dict:
    """CogView4 (GLM text encoder) through load_pipeline per mode: prompt embeddings and images against diffusers'
    single-process pipeline, and the share of the text encoder this rank holds."""
    import numpy as np
    from diffusers import DiffusionPipeline

    from paradiff_testkit.encoders import COGVIEW4_CALL

    torch.set_num_threads(1)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected_embeds = reference.encode_prompt(prompts, do_classifier_free_guidance=False)[0]
    expected = np.asarray(reference(prompt=prompts, generator=torch.Generator().manual_seed(0), **COGVIEW4_CALL).images)
    whole = sum(p.numel() for p in reference.text_encoder.parameters())
    results = {}
    for mode, degrees in modes.items():
        pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees))
        pipeline.set_progress_bar_config(disable=True)
        with torch.no_grad():
            embeds = pipeline.encode_prompt(prompts, do_classifier_free_guidance=False)[0]
        images = np.asarray(pipeline(prompt=prompts, seed=0, **COGVIEW4_CALL).images)
        results[mode] = {
            "embeds": _relative([embeds], [expected_embeds]),
            "image": float(np.abs(images - expected).max()),
            "encoder_share": sum(p.numel() for p in pipeline.text_encoder.parameters()) / whole,
        }
    return {"rank": dist.get_rank(), "modes": results}
