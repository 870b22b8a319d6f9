"""Modular Diffusers pipelines checked on the mesh beyond the zoo's modes: the tiny modular pipelines are the zoo's
(`paradiff_testkit.zoo`, `ModularRecipe` keys such as "QwenImageModularPipeline"; tools/verify_pipelines.py verifies
them in the coverage table's modes); `modular_equivalence` runs one in extra modes (a staged load, data parallel x
TP, a 3-branch SkipLayerGuidance guider) against diffusers' single-process modular call and reports what each rank
held and computed (tools/verify_modular.py, tests/test_modular.py).

    folder = zoo.save("QwenImageModularPipeline", "/tmp/tiny-qwen-modular")
    pipe = ModularPipeline.from_pretrained(folder); pipe.load_components()
    images = pipe(**zoo.call_kwargs("QwenImageModularPipeline"), generator=torch.Generator().manual_seed(0),
                  output="images")
"""

from __future__ import annotations

import numpy as np
import torch

from paradiff_testkit import zoo

# the modular keys verify_modular.py runs its extra modes on: two from standard recipes that guide through a guider
# (Qwen-Image, Wan), one guidance-distilled (FLUX.2), one modular-only (Krea 2 Turbo)
MODULAR_KEYS = ("Flux2ModularPipeline", "QwenImageModularPipeline", "WanModularPipeline", "Krea2TurboModularPipeline")


def guided(key: str) -> bool:
    """Whether the modular pipeline of `key` guides through a guider component."""
    return bool(zoo.modular_guiders(zoo.pipeline_name(key)))


def skip_layer_guider(key: str):
    """A 3-branch guider: CFG plus skip-layer guidance (the second block skipped), from the second step on (diffusers'
    SkipLayerGuidance starts strictly after the start step)."""
    from diffusers.guiders import SkipLayerGuidance
    from diffusers.hooks import LayerSkipConfig

    # an explicit fqn: "auto" picks from a set, whose order differs between processes
    blocks = "blocks" if zoo.pipeline_name(key).startswith("Wan") else "transformer_blocks"
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


def modular_equivalence(key: str, folder: str, modes: dict[str, dict], guider: str | None = None,
                        steps: int = 2) -> dict:
    """diffusers' single-process modular call, then paradiff's load_pipeline of the same folder in each mode (a
    ParallelConfig.from_degrees dict, with `stages=True` for a staged load), same seed: the output, what each rank
    holds (transformer and text encoder), what its first block saw, whether the VAE was split."""
    import torch.distributed as dist
    from diffusers import ModularPipeline

    import paradiff
    from paradiff.distributed.comm import all_gather_object
    from paradiff.runtime.wrappers import wrappers
    from paradiff_testkit.families import wrong_slices
    from paradiff.vae import get_vae_runtime

    torch.set_num_threads(1)
    kwargs = dict(zoo.call_kwargs(key), num_inference_steps=steps)
    output = zoo.recipe(key).output
    reference = ModularPipeline.from_pretrained(folder)
    reference.load_components(dtype=torch.float32)
    zoo.configure(reference, key)
    if guider == "skip_layer":
        reference.update_components(guider=skip_layer_guider(key))
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
        zoo.configure(pipeline, key)
        if guider == "skip_layer":
            pipeline.update_components(guider=skip_layer_guider(key))
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
