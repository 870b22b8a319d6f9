"""Conditioned pipeline calls (image-to-video, edit, inpaint) run on every rank by tests/test_conditioning.py."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

import diffusers
import paradiff
from paradiff.distributed.comm import all_gather_object
from paradiff.testing.pipelines import default_call_kwargs

# What each case runs: the family's tiny folder loaded as another pipeline class, and the call's extra inputs.
# The condition images have sizes whose token counts the two ranks do not divide (see the test module).
CASES = {
    # FLUX.1 Kontext: the reference image's 9 x 7 = 63 packed tokens follow the 8 x 8 noise tokens: 127 in all
    "kontext": dict(family="flux", pipeline="FluxKontextPipeline", images=[(36, 28)],
                    call=dict(_auto_resize=False, max_area=32 * 32, guidance_scale=2.5)),
    # FLUX.1 inpainting: image, mask and strength on the text-to-image checkpoint; 44 x 36 -> 11 x 9 = 99 tokens
    "inpaint": dict(family="flux", pipeline="FluxInpaintPipeline", images=[(44, 36)], mask=True,
                    call=dict(height=44, width=36, strength=0.8, num_inference_steps=4)),
    # Wan 2.2 TI2V as image-to-video: the first latent frame is the image's (per-token timesteps 0 there);
    # 3 latent frames x 3 x 3 tokens = 27
    "ti2v": dict(family="wan2.2", pipeline="WanImageToVideoPipeline", images=[(48, 48)],
                 call=dict(height=48, width=48)),
}


def condition_image(size: tuple[int, int], seed: int) -> Image.Image:
    """A seeded RGB picture, `size` = (height, width)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def condition_mask(size: tuple[int, int]) -> Image.Image:
    """White (repaint) on the right half, black (keep) elsewhere."""
    mask = np.zeros(size, dtype=np.uint8)
    mask[:, size[1] // 2:] = 255
    return Image.fromarray(mask)


def case_kwargs(case: str) -> dict:
    spec = CASES[case]
    kwargs = dict(default_call_kwargs(spec["family"]), **spec["call"])
    kwargs.pop("negative_prompt", None) if spec["family"] == "flux" else None
    images = [condition_image(size, seed=7 + number) for number, size in enumerate(spec["images"])]
    kwargs["image"] = images[0] if len(images) == 1 else images
    if spec.get("mask"):
        kwargs["mask_image"] = condition_mask(spec["images"][0])
    return kwargs


def _array(output) -> np.ndarray:
    return np.asarray(output.frames if hasattr(output, "frames") else output.images)


def _config(ring: int = 1, ulysses: int = 1, tp: int = 1) -> paradiff.ParallelConfig:
    return paradiff.ParallelConfig(
        tensor_parallel_config=paradiff.TensorParallelConfig(tp) if tp > 1 else None,
        context_parallel_config=(paradiff.ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
                                 if ring * ulysses > 1 else None))


def conditioned_equivalence(case: str, folder: str, modes: dict[str, dict]) -> dict:
    """The conditioned call on the mesh, for each mode, against diffusers' single-process call (same seed); also
    the sequence length the transformer saw and the length of each rank's share."""
    torch.set_num_threads(1)
    spec = CASES[case]
    pipeline_cls = getattr(diffusers, spec["pipeline"])
    kwargs = case_kwargs(case)
    reference = pipeline_cls.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    seen: list[torch.Tensor] = []  # the first block's input at every step
    _first_block(reference.transformer).register_forward_pre_hook(
        lambda _module, args, kw: seen.append(kw.get("hidden_states", args[0] if args else None).detach().clone()),
        with_kwargs=True)
    expected = _array(reference(**kwargs, generator=torch.Generator().manual_seed(0)))
    results = {}
    for mode, degrees in modes.items():
        pipeline = paradiff.load_pipeline(folder, pipeline_cls=pipeline_cls, parallel_config=_config(**degrees))
        pipeline.set_progress_bar_config(disable=True)
        local: list[torch.Tensor] = []
        block = _first_block(pipeline.transformer)
        block.register_forward_pre_hook(
            lambda _module, args, kw: local.append(kw.get("hidden_states", args[0] if args else None).detach().clone()),
            with_kwargs=True)
        actual = _array(pipeline(**kwargs, seed=0))
        scale = float(np.abs(expected).max())
        # what this rank's first block got at the first step: its own run of the full sequence's tokens
        share = local[0].shape[1]
        offsets = all_gather_object(share)
        start = sum(offsets[: dist.get_rank()])
        held = float((local[0] - seen[0][:, start:start + share]).abs().max())
        results[mode] = {"max_abs_diff": float(np.abs(actual - expected).max()), "scale": scale,
                         "local_tokens": sorted({tensor.shape[1] for tensor in local}), "share_diff": held}
        del pipeline
    return {"rank": dist.get_rank(), "type": type(reference).__name__, "tokens": sorted({t.shape[1] for t in seen}),
            "shape": list(expected.shape), "modes": results}


def _first_block(transformer) -> torch.nn.Module:
    for name in ("transformer_blocks", "blocks"):
        blocks = getattr(transformer, name, None)
        if blocks is not None:
            return blocks[0]
    raise AttributeError(f"{type(transformer).__name__} has no transformer_blocks / blocks")
