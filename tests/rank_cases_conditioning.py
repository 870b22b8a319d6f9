"""Conditioned pipeline calls (image-to-video, edit, inpaint) run on every rank by tests/test_conditioning.py."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

import diffusers
import paradiff
from paradiff.distributed.comm import all_gather_object
from paradiff_testkit.pipelines import CONTROLNET_FAMILIES, default_call_kwargs


def pipeline_class_name(family: str) -> str:
    return CONTROLNET_FAMILIES[family]

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


def conditioned_reference(case: str, folder: str) -> dict:
    """Diffusers' single-process call of the case (same seed as the ranks'): its output, its class, and the first
    block's input at every step. Made once in the test process and handed to conditioned_equivalence."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank computes
    try:
        reference = getattr(diffusers, CASES[case]["pipeline"]).from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        seen: list[torch.Tensor] = []  # the first block's input at every step
        _first_block(reference.transformer).register_forward_pre_hook(
            lambda _module, args, kw: seen.append(kw.get("hidden_states", args[0] if args else None).detach().clone()),
            with_kwargs=True)
        expected = _array(reference(**case_kwargs(case), generator=torch.Generator().manual_seed(0)))
    finally:
        torch.set_num_threads(threads)
    return {"expected": expected, "seen": seen, "type": type(reference).__name__}


def conditioned_equivalence(case: str, folder: str, modes: dict[str, dict], reference: dict) -> dict:
    """The conditioned call on the mesh, for each mode, against diffusers' single-process call (`reference`:
    conditioned_reference's); also the sequence length the transformer saw and the length of each rank's share."""
    torch.set_num_threads(1)
    spec = CASES[case]
    pipeline_cls = getattr(diffusers, spec["pipeline"])
    kwargs = case_kwargs(case)
    seen, expected = reference["seen"], reference["expected"]
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
    return {"rank": dist.get_rank(), "type": reference["type"], "tokens": sorted({t.shape[1] for t in seen}),
            "shape": list(expected.shape), "modes": results}


def _first_block(transformer) -> torch.nn.Module:
    for name in ("transformer_blocks", "blocks"):
        blocks = getattr(transformer, name, None)
        if blocks is not None:
            return blocks[0]
    raise AttributeError(f"{type(transformer).__name__} has no transformer_blocks / blocks")


# --- ControlNet: FluxControlNetPipeline, its ControlNet split like the transformer --------------------------------

# 44 x 36 pixels -> 22 x 18 latents -> 11 x 9 = 99 image tokens (FLUX.1's 2 x 2 packing, SD3's 2 x 2 patches): the
# ranks' shares are uneven (50 / 49)
CONTROLNET_CALL = dict(prompt="a small red fox running through the snow", max_sequence_length=32, height=44,
                       width=36, num_inference_steps=2, output_type="np", controlnet_conditioning_scale=0.8)
CONTROLNET_GUIDANCE = {
    "flux": dict(guidance_scale=3.5),  # guidance-distilled
    "sd3": dict(guidance_scale=5.0, negative_prompt="blurry, low quality"),  # batch CFG through both models
}
# where each family's transformer receives the tokens after its first residual was added
_AFTER_FIRST_RESIDUAL = {"flux": "single_transformer_blocks.0", "sd3": "transformer_blocks.1"}


# SD3's ControlNet pipeline takes multiples of 8 pixels: 40 x 56 through its tiny factor-4 VAE -> 10 x 14 latents
# -> 5 x 7 = 35 tokens (shares 18 / 17)
CONTROLNET_SIZES = {"flux": (44, 36), "sd3": (40, 56)}
CONTROLNET_TOKENS = {"flux": 99, "sd3": 35}


def controlnet_kwargs(family: str) -> dict:
    height, width = CONTROLNET_SIZES[family]
    return dict(CONTROLNET_CALL, **CONTROLNET_GUIDANCE[family], height=height, width=width,
                control_image=condition_image((height, width), seed=11))


def _recorder(module: torch.nn.Module, into: list, argument: str = "hidden_states") -> None:
    module.register_forward_pre_hook(
        lambda _module, args, kw: into.append(kw.get(argument, args[0] if args else None).detach().clone()),
        with_kwargs=True)


def controlnet_reference(family: str, folder: str) -> dict:
    """Diffusers' single-process ControlNet call (same seed as the ranks'), made once in the test process and handed
    to controlnet_equivalence: the images with and without the ControlNet's residuals, the residuals it returned at
    the first step, what the block after the first residual received at the first step, and its weights.
    (SD3's pipeline samples the control image's latents from the global generator: seeded alike before each call,
    here in a forked RNG state.)"""
    kwargs = controlnet_kwargs(family)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank computes
    try:
        reference = getattr(diffusers, pipeline_class_name(family)).from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        seen_residuals: list = []
        reference.controlnet.register_forward_hook(lambda _m, _a, out: seen_residuals.append(out))
        seen: list[torch.Tensor] = []
        _recorder(reference.transformer.get_submodule(_AFTER_FIRST_RESIDUAL[family]), seen)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            expected = _array(reference(**kwargs, generator=torch.Generator().manual_seed(0)))
            # the same call without the ControlNet's residuals: how much they change the image
            torch.manual_seed(0)
            unconditioned = _array(reference(**dict(kwargs, controlnet_conditioning_scale=0.0),
                                             generator=torch.Generator().manual_seed(0)))
    finally:
        torch.set_num_threads(threads)
    return {"expected": expected, "unconditioned": unconditioned, "residuals": seen_residuals[0], "seen": seen[0],
            "weights": {name: param.detach() for name, param in reference.controlnet.named_parameters()}}


def controlnet_equivalence(family: str, folder: str, modes: dict[str, dict], reference: dict) -> dict:
    """The family's ControlNet pipeline on the mesh, for each mode, against diffusers' single-process call (same
    seed; `reference`: controlnet_reference's): the images; the residuals the ControlNet returns at the first step
    (whole in every mode); what the block after the first residual receives at the first step (a block's output plus
    its residual) against this rank's slice of the single-process one; and at TP, each ControlNet weight against the
    slice its shard spec names. (SD3's pipeline samples the control image's latents from the global generator:
    seeded alike before each call.)"""
    from paradiff.context_parallel.attention import even_sizes
    from paradiff.tensor_parallel.layers import ShardedLinear

    torch.set_num_threads(1)
    kwargs = controlnet_kwargs(family)
    after_residual = _AFTER_FIRST_RESIDUAL[family]
    seen_residuals, seen = [reference["residuals"]], [reference["seen"]]
    expected, unconditioned = reference["expected"], reference["unconditioned"]
    full_weights = reference["weights"]
    full_bytes = sum(param.numel() * param.element_size() for param in full_weights.values())
    results = {}
    for mode, degrees in modes.items():
        degrees = dict(degrees)
        stages = degrees.pop("stages", False)
        pipeline = paradiff.load_pipeline(folder, parallel_config=_config(**degrees), stages=stages)
        pipeline.set_progress_bar_config(disable=True)
        residuals: list = []
        held_weights: dict = {}  # at the ControlNet's first call: staged, it holds its weights only in its stage

        def record(module, _args, out):
            residuals.append(out)
            if not held_weights:
                held_weights.update({name: param.detach().clone() for name, param in module.named_parameters()})

        pipeline.controlnet.register_forward_hook(record)
        local: list[torch.Tensor] = []
        _recorder(pipeline.transformer.get_submodule(after_residual), local)
        torch.manual_seed(0)
        actual = _array(pipeline(**kwargs, seed=0))
        share = local[0].shape[1]
        rank, ranks = _token_rank(pipeline.transformer)
        assert even_sizes(seen[0].shape[1], ranks)[rank] == share, (share, ranks)
        start = sum(even_sizes(seen[0].shape[1], ranks)[:rank])
        residual_diff = max(float((mine - theirs).abs().max()) for kind in range(len(seen_residuals[0]))
                            for mine, theirs in zip(residuals[0][kind], seen_residuals[0][kind]))
        sharded = {name: module for name, module in pipeline.controlnet.named_modules()
                   if isinstance(module, ShardedLinear)}
        shard_diff = 0.0
        for name, module in sharded.items():
            full = full_weights[f"{name}.weight"]
            spec = module.weight_spec
            expected_slice = torch.cat([full.narrow(spec.dim, s, n) for s, n in spec.pieces], dim=spec.dim)
            shard_diff = max(shard_diff, float((held_weights[f"{name}.weight"] - expected_slice).abs().max()))
        held = sum(param.numel() * param.element_size() for param in held_weights.values())
        results[mode] = {
            "max_abs_diff": float(np.abs(actual - expected).max()), "scale": float(np.abs(expected).max()),
            "residual_shapes": [list(t.shape) for kind in residuals[0] for t in kind],
            "residual_diff": residual_diff, "local_tokens": share,
            "share_diff": float((local[0] - seen[0][:, start:start + share]).abs().max()),
            "sharded_linears": sorted(sharded), "shard_diff": shard_diff, "held_fraction": held / full_bytes,
            "rows_split": sorted(name for name, module in sharded.items() if module.weight_spec.dim == 0)}
        del pipeline
    return {"rank": dist.get_rank(), "tokens": seen[0].shape[1],
            "residual_effect": float(np.abs(expected - unconditioned).max()),
            "residual_scale": max(float(t.abs().max()) for kind in seen_residuals[0] for t in kind),
            "full_residual_shapes": [list(t.shape) for kind in seen_residuals[0] for t in kind],
            "modes": results}


def _token_rank(transformer) -> tuple[int, int]:
    """This rank's index among the ranks splitting the tokens, and their count (one CP dimension in these modes)."""
    from paradiff.runtime.state import get_state

    mesh = get_state(transformer).mesh
    return mesh.local_rank("ring") * mesh.size("ulysses") + mesh.local_rank("ulysses"), mesh.size("ring") * mesh.size("ulysses")
