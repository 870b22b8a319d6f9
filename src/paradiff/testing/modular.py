"""Tiny, random-weight, fully local Modular Diffusers pipelines, saved as modular pipeline folders
(modular_model_index.json and one subfolder per component, no model_index.json).

    folder = save_modular_pipeline("qwenimage", "/tmp/tiny-qwen-modular")
    pipe = ModularPipeline.from_pretrained(folder); pipe.load_components()
    images = pipe(**modular_call_kwargs("qwenimage"), generator=torch.Generator().manual_seed(0), output="images")

"flux2", "qwenimage" and "wan" are the tiny standard pipelines of `paradiff.testing.pipelines` run through their
modular classes (Flux2ModularPipeline, QwenImageModularPipeline, WanModularPipeline) and saved as modular folders.
"krea2-turbo" is a model diffusers ships only as a modular pipeline (Krea2TurboModularPipeline): built by its zoo
recipe (paradiff.testing.zoo.recipes.modular), as every family is when no standard folder is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from paradiff.testing.pipelines import default_call_kwargs, save_pipeline_folder

MODULAR_FAMILIES = ("flux2", "qwenimage", "wan", "krea2-turbo")
# the class each family's folder names, and what its call returns
MODULAR_CLASSES = {"flux2": "Flux2ModularPipeline", "qwenimage": "QwenImageModularPipeline",
                   "wan": "WanModularPipeline", "krea2-turbo": "Krea2TurboModularPipeline"}
OUTPUTS = {"flux2": "images", "qwenimage": "images", "wan": "videos", "krea2-turbo": "images"}
# The modular families that run guidance through a guider (the others are guidance-distilled).
GUIDED = ("qwenimage", "wan")


def save_modular_pipeline(family: str, folder: str | Path, seed: int = 0, standard: str | Path | None = None) -> Path:
    """Write the tiny modular pipeline of `family` as a modular pipeline folder (its zoo recipe,
    `MODULAR_CLASSES[family]`); does nothing if the folder holds a pipeline. `standard`: the family's tiny standard
    pipeline folder, when one is saved already (`paradiff.testing.pipelines.save_pipeline`), loaded through its
    modular class instead of saving the zoo's standard pipeline again."""
    from diffusers import ModularPipeline

    from paradiff.testing import zoo

    if family not in MODULAR_FAMILIES:
        raise ValueError(f"unknown modular family {family!r}; known: {MODULAR_FAMILIES}")
    if standard is None or zoo.recipe(MODULAR_CLASSES[family]).standard is None:
        return zoo.save(MODULAR_CLASSES[family], folder, seed)

    def load():
        pipe = ModularPipeline.from_pretrained(str(standard))
        pipe.load_components(dtype=torch.float32)
        return pipe

    return save_pipeline_folder(folder, load)


def modular_call_kwargs(family: str) -> dict[str, Any]:
    """Keyword arguments for a quick generation by the family's modular pipeline (pass a `generator` along)."""
    if family == "krea2-turbo":
        from paradiff.testing import zoo

        return zoo.call_kwargs(MODULAR_CLASSES[family])
    kwargs = dict(default_call_kwargs(family))
    if family in GUIDED:  # their guidance scale is the guider component's, not an argument of the call
        kwargs.pop("guidance_scale", None)
        kwargs.pop("true_cfg_scale", None)
    return kwargs


def skip_layer_guider(family: str):
    """A 3-branch guider: CFG plus skip-layer guidance (the second block skipped), from the second step on (diffusers'
    SkipLayerGuidance starts strictly after the start step)."""
    from diffusers.guiders import SkipLayerGuidance
    from diffusers.hooks import LayerSkipConfig

    # an explicit fqn: "auto" picks from a set, whose order differs between processes
    blocks = "blocks" if family == "wan" else "transformer_blocks"
    return SkipLayerGuidance(guidance_scale=4.0, skip_layer_guidance_scale=2.0, skip_layer_guidance_start=0.0,
                             skip_layer_guidance_stop=1.0, skip_layer_config=LayerSkipConfig(indices=[1], fqn=blocks))


def _first_block(transformer) -> torch.nn.Module:
    for name in ("transformer_blocks", "blocks"):
        if getattr(transformer, name, None) is not None:
            return getattr(transformer, name)[0]
    raise AttributeError(f"{type(transformer).__name__} has no transformer_blocks / blocks")


def _tokens_seen(transformer, into: list) -> None:
    _first_block(transformer).register_forward_pre_hook(
        lambda _m, args, kw: into.append(int(kw.get("hidden_states", args[0] if args else None).shape[1])),
        with_kwargs=True)


def modular_equivalence(family: str, folder: str, modes: dict[str, dict], guider: str | None = None,
                        steps: int = 2) -> dict:
    """diffusers' single-process modular call, then paradiff's load_pipeline of the same folder in each mode (a
    ParallelConfig.from_degrees dict, with `stages=True` for a staged load), same seed: the output, what each rank
    holds (transformer and text encoder), what its first block saw, whether the VAE was split."""
    import torch.distributed as dist
    from diffusers import ModularPipeline

    import paradiff
    from paradiff.distributed.comm import all_gather_object
    from paradiff.runtime.wrappers import wrappers
    from paradiff.testing.families import wrong_slices
    from paradiff.vae import get_vae_runtime

    torch.set_num_threads(1)
    kwargs = dict(modular_call_kwargs(family), num_inference_steps=steps)
    output = OUTPUTS[family]
    reference = ModularPipeline.from_pretrained(folder)
    reference.load_components(dtype=torch.float32)
    if guider == "skip_layer":
        reference.update_components(guider=skip_layer_guider(family))
    seen: list[int] = []
    _tokens_seen(reference.transformer, seen)
    expected = np.asarray(reference(**kwargs, generator=torch.Generator().manual_seed(0), output=output))
    whole = sum(p.numel() for p in reference.transformer.parameters())
    results = {}
    encoder_whole = sum(p.numel() for p in reference.text_encoder.parameters())
    for mode, degrees in modes.items():
        degrees = dict(degrees)
        stages = degrees.pop("stages", False)
        pipeline = paradiff.load_pipeline(folder, parallel_config=paradiff.ParallelConfig.from_degrees(**degrees),
                                          stages=stages)
        if guider == "skip_layer":
            pipeline.update_components(guider=skip_layer_guider(family))
        local: list[int] = []
        _tokens_seen(pipeline.transformer, local)
        held: dict = {}  # measured at each model's first forward, while its weights are there (staged or not)

        def measure(name: str, model, measurement) -> None:
            def hook(*_) -> None:  # a pre-hook returning something would replace the arguments
                if name not in held:
                    held[name] = measurement()

            model.register_forward_pre_hook(hook)

        transformer, encoder = pipeline.transformer, pipeline.text_encoder
        measure("wrong_slices", transformer, lambda: wrong_slices(transformer, reference.transformer))
        measure("param_share", transformer, lambda: sum(p.numel() for p in transformer.parameters()) / whole)
        measure("encoder_share", encoder, lambda: sum(p.numel() for p in encoder.parameters()) / encoder_whole)
        actual = np.asarray(pipeline(**kwargs, seed=0, output=output))
        branches = pipeline._paradiff_pipeline.cfgs
        results[mode] = {
            "type": type(pipeline).__name__,
            "max_abs_diff": float(np.abs(actual - expected).max()), "scale": float(np.abs(expected).max()),
            "wrong_slices": held["wrong_slices"], "param_share": held["param_share"],
            "tokens": local[0], "token_shares": all_gather_object(local[0]),
            "computed": branches[0].computed if branches else None,
            "branch_counts": branches[0].branch_counts if branches else None,
            "wrappers": wrappers(pipeline.transformer),
            "encoder_share": held["encoder_share"],
            "vae_split": get_vae_runtime(pipeline.vae) is not None,
            "stages": [row["stage"] for row in pipeline.stage_report() if row["entries"]],
        }
    return {"rank": dist.get_rank(), "tokens": seen[0], "shape": list(expected.shape), "modes": results}
