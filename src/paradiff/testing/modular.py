"""Tiny, random-weight, fully local Modular Diffusers pipelines, saved as modular pipeline folders
(modular_model_index.json and one subfolder per component, no model_index.json).

    folder = save_modular_pipeline("qwenimage", "/tmp/tiny-qwen-modular")
    pipe = ModularPipeline.from_pretrained(folder); pipe.load_components()
    images = pipe(**modular_call_kwargs("qwenimage"), generator=torch.Generator().manual_seed(0), output="images")

"flux2", "qwenimage" and "wan" are the tiny standard pipelines of `paradiff.testing.pipelines` run through their
modular classes (Flux2ModularPipeline, QwenImageModularPipeline, WanModularPipeline) and saved as modular folders.
"krea2-turbo" is a model diffusers ships only as a modular pipeline (Krea2TurboModularPipeline): its components are
built here at the sizes of diffusers' own Krea 2 tests, with a Qwen3-VL text encoder deep enough for the layers the
modular text step stacks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paradiff.testing.pipelines import _qwen2_tokenizer, _seeded, default_call_kwargs, save_pipeline

MODULAR_FAMILIES = ("flux2", "qwenimage", "wan", "krea2-turbo")
# the class each family's folder names, and what its call returns
MODULAR_CLASSES = {"flux2": "Flux2ModularPipeline", "qwenimage": "QwenImageModularPipeline",
                   "wan": "WanModularPipeline", "krea2-turbo": "Krea2TurboModularPipeline"}
OUTPUTS = {"flux2": "images", "qwenimage": "images", "wan": "videos", "krea2-turbo": "images"}
# The modular families that run guidance through a guider (the others are guidance-distilled).
GUIDED = ("qwenimage", "wan")


def save_modular_pipeline(family: str, folder: str | Path, seed: int = 0, standard: str | Path | None = None) -> Path:
    """Write the tiny modular pipeline of `family` as a modular pipeline folder; does nothing if
    `folder/modular_model_index.json` exists. `standard`: the family's tiny standard pipeline folder, when one is
    saved already (`paradiff.testing.pipelines.save_pipeline`; else it is made here)."""
    from diffusers import ModularPipeline

    folder = Path(folder)
    if (folder / "modular_model_index.json").is_file():
        return folder
    if family not in MODULAR_FAMILIES:
        raise ValueError(f"unknown modular family {family!r}; known: {MODULAR_FAMILIES}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place (several processes may save the same folder at once).
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    os.chmod(staging, 0o755)
    try:
        if family == "krea2-turbo":
            pipe = _krea2_turbo(seed)
        else:
            standard = standard or save_pipeline(family, staging / "standard", seed=seed)
            pipe = ModularPipeline.from_pretrained(str(standard))
            pipe.load_components(dtype=torch.float32)
        target = staging / "modular"
        pipe.save_pretrained(str(target), overwrite_modular_index=True)
        _point_index_at(target, folder)
        try:
            os.rename(target, folder)
        except OSError:
            if not (folder / "modular_model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def modular_call_kwargs(family: str) -> dict[str, Any]:
    """Keyword arguments for a quick generation by the family's modular pipeline (pass a `generator` along)."""
    if family == "krea2-turbo":
        return dict(prompt="a small red fox running through the snow", height=32, width=32, num_inference_steps=2,
                    max_sequence_length=16, output_type="np")
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


def _point_index_at(saved: Path, final: Path) -> None:
    """The saved index names the folder it was written to; make it name the folder it is renamed to."""
    index = saved / "modular_model_index.json"
    entries = json.loads(index.read_text())
    for entry in entries.values():
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict):
            if entry[2].get("pretrained_model_name_or_path") == str(saved):
                entry[2]["pretrained_model_name_or_path"] = str(final)
    index.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")


def _krea2_turbo(seed: int):
    import diffusers
    from diffusers.modular_pipelines import Krea2TurboModularPipeline
    from diffusers.modular_pipelines.krea2.encoders import KREA2_TEXT_ENCODER_SELECT_LAYERS
    from transformers import Qwen3VLConfig, Qwen3VLModel

    tokenizer = _qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    text_layers = max(KREA2_TEXT_ENCODER_SELECT_LAYERS)  # hidden_states[0] is the embedding output
    with _seeded(seed, 1):
        text_encoder = Qwen3VLModel(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16,
                             num_hidden_layers=text_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             max_position_embeddings=1024,
                             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                              "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16,
                               patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        )).eval()
    with _seeded(seed, 0):
        transformer = diffusers.Krea2Transformer2DModel(
            in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16,
            num_text_layers=len(KREA2_TEXT_ENCODER_SELECT_LAYERS), text_num_attention_heads=2,
            text_num_key_value_heads=1, text_intermediate_size=16, num_layerwise_text_blocks=1,
            num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2), rope_theta=1000.0,
        ).eval()
        with torch.no_grad():  # diffusers zero-initialises some projections: perturb everything
            for param in transformer.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    with _seeded(seed, 3):
        # one spatial downsampling: 32 x 32 pixels are 16 x 16 latents, 64 tokens of 2 x 2 patches
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
            latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.1, 0.9, 1.3, 1.0],
        ).eval()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400)
    pipe = Krea2TurboModularPipeline()  # its default blocks: Krea2TurboAutoBlocks
    pipe.update_components(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                           scheduler=scheduler)
    return pipe
