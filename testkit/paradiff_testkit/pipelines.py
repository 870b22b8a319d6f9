"""Tiny, random-weight, fully local diffusers pipelines, saved as real pipeline folders.

Every component is made here: the transformer, the VAE, the text encoder(s), the scheduler and the tokenizer(s).
The tokenizers learn their vocabulary on the spot from a small built-in corpus, cut by the same normalizer and
pre-tokenizer as the transformers class the pipeline expects, so that they save and load back as that class.
Nothing is downloaded.

    pipe = build_pipeline("flux")                       # in memory
    folder = save_pipeline("wan", "/tmp/tiny-wan")      # model_index.json + one subfolder per component
    pipe = DiffusionPipeline.from_pretrained(folder)
    out = pipe(**default_call_kwargs("wan"), generator=torch.Generator().manual_seed(0))

Sizes are chosen so that one 2-step generation at 32x32 takes well under a second on a CPU, in float32, while the
transformer still has 4 heads (divisible by 2 and 4) and enough image tokens (48 to 64) to split across ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

PIPELINE_FAMILIES = ("flux", "flux2", "qwenimage", "wan", "wan2.2", "wan2.2-a14b", "hunyuanvideo", "ltx",
                     "flux2_klein", "lumina2", "sd3", "pixart_sigma", "sana", "auraflow",
                     "chroma", "cogview3plus", "cogvideox")
# modular: Modular Diffusers pipelines (modular_model_index.json) are zoo keys (paradiff_testkit.zoo's ModularRecipe:
# a standard recipe's tiny pipeline loaded through its modular class, or a modular-only builder), verified by
# tools/verify_pipelines.py; paradiff_testkit.modular's `modular_equivalence` checks one in the extra modes of
# tools/verify_modular.py. The standard pipelines that guide through a guider component: paradiff_testkit.guiders
# (HunyuanVideo 1.5).
# The families whose pipelines return videos (`.frames`) and take `num_frames`.
VIDEO_FAMILIES = ("wan", "wan2.2", "wan2.2-a14b", "hunyuanvideo", "ltx", "cogvideox")

# What each family's pipeline and transformer classes are called in diffusers.
PIPELINE_CLASSES = {
    "flux": "FluxPipeline",
    "flux2": "Flux2Pipeline",
    "qwenimage": "QwenImagePipeline",
    "wan": "WanPipeline",
    "wan2.2": "WanPipeline",
    "wan2.2-a14b": "WanPipeline",
    "hunyuanvideo": "HunyuanVideoPipeline",
    "ltx": "LTXPipeline",
    "flux2_klein": "Flux2KleinPipeline",
    "lumina2": "Lumina2Pipeline",
    "sd3": "StableDiffusion3Pipeline",
    "pixart_sigma": "PixArtSigmaPipeline",
    "sana": "SanaPipeline",
    "auraflow": "AuraFlowPipeline",
    "chroma": "ChromaPipeline",
    "cogview3plus": "CogView3PlusPipeline",
    "cogvideox": "CogVideoXPipeline",
}
TRANSFORMER_CLASSES = {
    "flux": "FluxTransformer2DModel",
    "flux2": "Flux2Transformer2DModel",
    "qwenimage": "QwenImageTransformer2DModel",
    "wan": "WanTransformer3DModel",
    "wan2.2": "WanTransformer3DModel",
    "wan2.2-a14b": "WanTransformer3DModel",
    "hunyuanvideo": "HunyuanVideoTransformer3DModel",
    "ltx": "LTXVideoTransformer3DModel",
    "flux2_klein": "Flux2Transformer2DModel",
    "lumina2": "Lumina2Transformer2DModel",
    "sd3": "SD3Transformer2DModel",
    "pixart_sigma": "PixArtTransformer2DModel",
    "sana": "SanaTransformer2DModel",
    "auraflow": "AuraFlowTransformer2DModel",
    "chroma": "ChromaTransformer2DModel",
    "cogview3plus": "CogView3PlusTransformer2DModel",
    "cogvideox": "CogVideoXTransformer3DModel",
}

# Transformer config keys that other components depend on (latent channels, text width, packing):
# changing them through `transformer_overrides` would give a pipeline that cannot run, so it is refused.
_COUPLED_KEYS = {
    "flux": ("in_channels", "out_channels", "joint_attention_dim", "pooled_projection_dim", "patch_size"),
    "flux2": ("in_channels", "out_channels", "joint_attention_dim", "patch_size"),
    "qwenimage": ("in_channels", "out_channels", "joint_attention_dim", "patch_size"),
    "wan": ("in_channels", "out_channels", "text_dim", "image_dim", "added_kv_proj_dim"),
    "wan2.2": ("in_channels", "out_channels", "text_dim", "image_dim", "added_kv_proj_dim", "patch_size"),
    "wan2.2-a14b": ("in_channels", "out_channels", "text_dim", "image_dim", "added_kv_proj_dim"),
    "hunyuanvideo": ("in_channels", "out_channels", "text_embed_dim", "pooled_projection_dim", "patch_size",
                     "patch_size_t"),
    "ltx": ("in_channels", "out_channels", "caption_channels", "patch_size", "patch_size_t"),
    "flux2_klein": ("in_channels", "out_channels", "joint_attention_dim", "patch_size"),
    "lumina2": ("in_channels", "out_channels", "cap_feat_dim", "patch_size"),
    "sd3": ("in_channels", "out_channels", "joint_attention_dim", "pooled_projection_dim"),
    "pixart_sigma": ("in_channels", "out_channels", "caption_channels", "sample_size"),
    "sana": ("in_channels", "out_channels", "caption_channels"),
    "auraflow": ("in_channels", "out_channels", "joint_attention_dim"),
    "chroma": ("in_channels", "out_channels", "joint_attention_dim", "patch_size"),
    "cogview3plus": ("in_channels", "out_channels", "text_embed_dim"),
    "cogvideox": ("in_channels", "out_channels", "text_embed_dim", "max_text_seq_length",
                  "temporal_compression_ratio"),
}

# Text width of every text encoder; the transformers' text projections are sized from these.
_TEXT_WIDTH = 32
_LATENT_CHANNELS = 4

# The Qwen-Image pipeline formats each prompt into this template and drops the first 34 tokens of the text
# encoder's output (the system part). The tiny tokenizer is trained so that this prefix is exactly 34 tokens.
_QWEN_SYSTEM_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
_QWEN_DROP_TOKENS = 34

# A Mistral-style chat template for the FLUX.2 tokenizer. The pipeline passes messages whose content is a list of
# {"type": "text", "text": ...} parts (and sometimes images, which a text-only tokenizer skips).
_MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Lumina 2 prefixes every prompt with this system prompt (and "<Prompt Start> "); the Gemma tokenizer learns it.
_LUMINA2_SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text alignment "
    "based on textual prompts or user prompts. <Prompt Start>"
)

# Written for these tiny tokenizers: short scene descriptions of the kind a text-to-image prompt holds.
_CORPUS = (
    "a photo of a cat sitting on a wooden table",
    "a small red fox running through the snow at dawn",
    "an astronaut riding a horse on the surface of the moon",
    "a bowl of fresh fruit with apples, oranges and grapes",
    "a lighthouse on a rocky coast during a storm, dramatic lighting",
    "a watercolor painting of a quiet village by the river",
    "a close-up portrait of an old man with a grey beard",
    "a futuristic city at night with neon signs and flying cars",
    "a cup of coffee next to an open book, soft morning light",
    "two dogs playing with a ball in a green park",
    "a mountain lake reflecting pine trees and blue sky",
    "a robot painting a picture in a sunny studio",
    "a plate of pasta with tomato sauce and basil leaves",
    "a sailing boat on calm water at sunset, golden hour",
    "a child flying a kite on a windy beach",
    "a snowy forest with a small cabin and smoke from the chimney",
    "a vintage car parked in front of a brick building",
    "a hand-drawn map of an island with a treasure chest",
    "a colorful hot air balloon above a field of flowers",
    "an owl perched on a branch under the full moon",
    "a glass of water on a marble counter, studio photo, 4k",
    "a street market full of people, vegetables and bright umbrellas",
    "a dragon made of paper flying over a mountain",
    "a sign that says hello world in large letters",
    "a tiny house made of candy in a magical garden",
    "the quick brown fox jumps over the lazy dog",
    "blurry, low quality, distorted, watermark, ugly, bad anatomy",
    "A cat, a dog and a bird. Red, green, blue! Is it 1, 2 or 3?",
    "Describe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:",
    "system user assistant",
)


def transformer_class(family: str) -> type:
    """The diffusers transformer class of a family."""
    import diffusers

    _check_family(family)
    return getattr(diffusers, TRANSFORMER_CLASSES[family])


def pipeline_class(family: str) -> type:
    """The diffusers pipeline class of a family."""
    import diffusers

    _check_family(family)
    return getattr(diffusers, PIPELINE_CLASSES[family])


def transformer_config(family: str, overrides: dict | None = None) -> dict:
    """The tiny transformer config of a family, with `overrides` applied (coupled keys refused)."""
    _check_family(family)
    overrides = dict(overrides or {})
    coupled = sorted(set(overrides) & set(_COUPLED_KEYS[family]))
    if coupled:
        raise ValueError(
            f"transformer_overrides for {family!r} cannot change {coupled}: the VAE, the text encoder or the "
            "pipeline's latent packing depend on them"
        )
    heads = overrides.get("num_attention_heads", 4)
    head_dim = overrides.get("attention_head_dim", 16)
    if family == "flux":
        config = dict(
            patch_size=1, in_channels=4 * _LATENT_CHANNELS, out_channels=None, num_layers=1, num_single_layers=1,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=_TEXT_WIDTH,
            pooled_projection_dim=_TEXT_WIDTH, guidance_embeds=True, axes_dims_rope=_rope_axes(head_dim, 3),
        )
    elif family == "flux2":
        config = dict(
            patch_size=1, in_channels=4 * _LATENT_CHANNELS, out_channels=None, num_layers=1, num_single_layers=1,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=3 * _TEXT_WIDTH,
            timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=_rope_axes(head_dim, 4), rope_theta=2000,
            guidance_embeds=True,
        )
    elif family == "flux2_klein":
        # FLUX.2 [klein]: the FLUX.2 transformer without guidance distillation, conditioned on three Qwen3 layers
        config = dict(
            patch_size=1, in_channels=4 * _LATENT_CHANNELS, out_channels=None, num_layers=1, num_single_layers=1,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=3 * _TEXT_WIDTH,
            timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=_rope_axes(head_dim, 4), rope_theta=2000,
            guidance_embeds=False,
        )
    elif family == "lumina2":
        # grouped-query attention (2 K/V heads for 4 query heads); one refiner block of each kind
        config = dict(
            sample_size=8, patch_size=2, in_channels=_LATENT_CHANNELS, hidden_size=heads * head_dim, num_layers=2,
            num_refiner_layers=1, num_attention_heads=heads, num_kv_heads=max(heads // 2, 1), multiple_of=16,
            cap_feat_dim=_TEXT_WIDTH, axes_dim_rope=_rope_axes(head_dim, 3), axes_lens=(300, 64, 64),
        )
    elif family == "sd3":
        # the two CLIP encoders' hidden states (32 + 32) are cut to the T5 width (32); their pooled outputs concatenate
        config = dict(
            sample_size=16, patch_size=2, in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, num_layers=2,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=_TEXT_WIDTH,
            caption_projection_dim=heads * head_dim, pooled_projection_dim=2 * _TEXT_WIDTH, pos_embed_max_size=32,
        )
    elif family == "pixart_sigma":
        # learnt sigma (twice the latent channels out); sample_size 16 = 32 pixels through the VAE's factor 2, which
        # also turns off the 1024-pixel checkpoints' resolution conditioning
        config = dict(
            sample_size=16, num_layers=2, patch_size=2, attention_head_dim=head_dim, num_attention_heads=heads,
            caption_channels=_TEXT_WIDTH, in_channels=_LATENT_CHANNELS, cross_attention_dim=heads * head_dim,
            out_channels=2 * _LATENT_CHANNELS, attention_bias=True, activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        )
    elif family == "sana":
        config = dict(
            patch_size=2, in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, num_layers=2,
            num_attention_heads=heads, attention_head_dim=head_dim, num_cross_attention_heads=heads,
            cross_attention_head_dim=head_dim, cross_attention_dim=heads * head_dim, caption_channels=_TEXT_WIDTH,
            sample_size=16,
        )
    elif family == "auraflow":
        config = dict(
            sample_size=16, patch_size=2, in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS,
            num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=head_dim, num_attention_heads=heads,
            joint_attention_dim=_TEXT_WIDTH, caption_projection_dim=heads * head_dim, pos_embed_max_size=64,
        )
    elif family == "chroma":
        # FLUX.1 packing (2 x 2 latents per token); the modulation approximator replaces FLUX's per-block MLPs
        config = dict(
            patch_size=1, in_channels=4 * _LATENT_CHANNELS, out_channels=None, num_layers=1, num_single_layers=1,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=_TEXT_WIDTH,
            axes_dims_rope=_rope_axes(head_dim, 3), approximator_num_channels=16, approximator_hidden_dim=32,
            approximator_layers=1,
        )
    elif family == "cogview3plus":
        config = dict(
            patch_size=2, in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, num_layers=2,
            attention_head_dim=head_dim, num_attention_heads=heads, text_embed_dim=_TEXT_WIDTH, time_embed_dim=16,
            condition_dim=4, pos_embed_max_size=16, sample_size=16,
        )
    elif family == "cogvideox":
        # the text length is fixed by the config (the pipeline's max_sequence_length must equal it); 9 frames are 3
        # latent frames through the VAE's temporal factor 4, 32 pixels 4 latents (factor 8), 2 x 2 patches
        config = dict(
            num_attention_heads=heads, attention_head_dim=head_dim, in_channels=_LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS, time_embed_dim=8, text_embed_dim=_TEXT_WIDTH, num_layers=2,
            sample_width=4, sample_height=4, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
            max_text_seq_length=16,
        )
    elif family == "qwenimage":
        config = dict(
            patch_size=2, in_channels=4 * _LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, num_layers=2,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=_TEXT_WIDTH,
            guidance_embeds=False, axes_dims_rope=_rope_axes(head_dim, 3),
        )
    elif family in ("wan", "wan2.2", "wan2.2-a14b"):
        config = dict(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
            in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, text_dim=_TEXT_WIDTH, freq_dim=32,
            ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        )
    elif family == "hunyuanvideo":
        config = dict(
            in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, num_attention_heads=heads,
            attention_head_dim=head_dim, num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
            patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=_TEXT_WIDTH,
            pooled_projection_dim=_TEXT_WIDTH, rope_axes_dim=_rope_axes(head_dim, 3),
        )
    else:
        config = dict(
            in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, patch_size=1, patch_size_t=1,
            num_attention_heads=heads, attention_head_dim=head_dim, cross_attention_dim=heads * head_dim,
            num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=_TEXT_WIDTH,
        )
    config.update(overrides)
    return config


def build_pipeline(family: str, seed: int = 0, transformer_overrides: dict | None = None):
    """A tiny pipeline of `family` with random weights, the same for the same seed and overrides.

    Each component draws its weights from its own seed (derived from `seed`), so overriding the transformer's
    config leaves the text encoders and the VAE unchanged. The caller's global RNG state is left untouched.
    """
    components = family_components(family, seed)
    components.update(family_transformers(family, seed, transformer_config(family, transformer_overrides)))
    return finish_pipeline(pipeline_class(family)(**components))


def family_components(family: str, seed: int = 0) -> dict[str, Any]:
    """Every component of the family's tiny pipeline but its transformer(s): scheduler, VAE, text encoders,
    tokenizers (and the pipeline's config arguments, e.g. Wan 2.2's `expand_timesteps`)."""
    _check_family(family)
    builders = {"flux": _build_flux, "flux2": _build_flux2, "qwenimage": _build_qwenimage, "wan": _build_wan,
                "wan2.2": _build_wan22, "wan2.2-a14b": _build_wan22_a14b, "hunyuanvideo": _build_hunyuanvideo,
                "ltx": _build_ltx,
                "flux2_klein": _build_flux2_klein, "lumina2": _build_lumina2, "sd3": _build_sd3,
                "pixart_sigma": _build_pixart_sigma, "sana": _build_sana, "auraflow": _build_auraflow,
                "chroma": _build_chroma, "cogview3plus": _build_cogview3plus, "cogvideox": _build_cogvideox}
    return builders[family](seed)


def family_transformers(family: str, seed: int, config: dict) -> dict[str, Any]:
    """The family's transformer(s) of this config, random weights (Wan 2.2 A14B: `transformer` and `transformer_2`,
    the low-noise expert with the same config and its own weights)."""
    transformers = {"transformer": random_model(transformer_class(family), config, seed, 0)}
    if family == "wan2.2-a14b":
        transformers["transformer_2"] = random_model(transformer_class(family), config, seed, 4)
    return transformers


def random_model(cls: type, config: dict, seed: int, component: int, std: float = 0.05,
                 std_of: Any = None) -> torch.nn.Module:
    """`cls(**config)` drawn from its own seed (`seed`, `component`), every parameter perturbed by `std` (diffusers
    zero-initialises some projections: no weight stays trivially zero); `std_of(name)` may give a parameter its
    own scale. The caller's global RNG state is left untouched."""
    with _seeded(seed, component):
        model = cls(**config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                scale = std_of(name) if std_of is not None else None
                param.add_(torch.randn_like(param) * (std if scale is None else scale))
    return model


def finish_pipeline(pipe):
    """No progress bars, every module in eval mode."""
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


def save_pipeline(family: str, folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny pipeline of `family` as a pipeline folder; does nothing if `folder/model_index.json` exists."""
    return save_pipeline_folder(folder, lambda: build_pipeline(family, seed=seed))


def save_pipeline_folder(folder: str | Path, build: Callable[[], Any]) -> Path:
    """Write the pipeline `build()` makes as a pipeline folder (a Modular Diffusers pipeline as a modular folder:
    modular_model_index.json naming this folder); does nothing if the folder holds either index already.

    Written beside the target and renamed into place, so that processes saving the same folder at once (one per
    rank, say) never see a half-written pipeline: the first rename wins, the others find it there."""
    folder = Path(folder)
    if _holds_pipeline(folder):
        return folder
    pipe = build()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    os.chmod(staging, 0o755)

    def write(into: Path) -> None:
        if _is_modular(pipe):
            pipe.save_pretrained(str(into), overwrite_modular_index=True)
            _point_index_at(into, folder)
        else:
            pipe.save_pretrained(into, safe_serialization=True)

    try:
        write(staging)
        try:
            os.rename(staging, folder)  # also replaces an empty folder
        except OSError:
            if not _holds_pipeline(folder):  # a non-empty folder without a pipeline in it
                write(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _holds_pipeline(folder: Path) -> bool:
    return (folder / "model_index.json").is_file() or (folder / "modular_model_index.json").is_file()


def _is_modular(pipe) -> bool:
    from diffusers import ModularPipeline

    return isinstance(pipe, ModularPipeline)


def _point_index_at(saved: Path, final: Path) -> None:
    """A modular index names the folder it was written to as its components' source; make it name `final`."""
    index = saved / "modular_model_index.json"
    entries = json.loads(index.read_text())
    for entry in entries.values():
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict):
            if entry[2].get("pretrained_model_name_or_path") == str(saved):
                entry[2]["pretrained_model_name_or_path"] = str(final)
    index.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")


def default_call_kwargs(family: str) -> dict[str, Any]:
    """Keyword arguments for a valid, quick generation (pass a `generator` along for reproducibility)."""
    _check_family(family)
    common = dict(height=32, width=32, num_inference_steps=2, output_type="np")
    if family == "flux":
        # FLUX.1-dev style: guidance distilled into the transformer, no negative prompt, so no true CFG.
        return dict(prompt="a small red fox running through the snow", guidance_scale=3.5,
                    max_sequence_length=32, **common)
    if family == "flux2":
        # The system message and the prompt fit in 64 tokens.
        return dict(prompt="a small red fox running through the snow", guidance_scale=4.0,
                    max_sequence_length=64, **common)
    if family == "qwenimage":
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    true_cfg_scale=4.0, max_sequence_length=64, **common)
    if family in ("wan", "wan2.2", "wan2.2-a14b"):
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    guidance_scale=5.0, num_frames=5, max_sequence_length=32, **common)
    if family == "hunyuanvideo":
        # guidance distilled into the transformer (guidance_embeds), no negative prompt
        return dict(prompt="a small red fox running through the snow", guidance_scale=6.0, num_frames=5,
                    max_sequence_length=32, **common)
    if family == "flux2_klein":
        # CFG against the empty prompt; the tiny Qwen3 has 4 layers, so the pipeline stacks layers 1, 2 and 3
        return dict(prompt="a small red fox running through the snow", guidance_scale=4.0,
                    max_sequence_length=32, text_encoder_out_layers=(1, 2, 3), **common)
    if family == "lumina2":
        # Lumina 2's VAE scale factor is fixed at 8: 64 x 64 pixels are 8 x 8 latents, 16 patches
        return dict(prompt="a small red fox running through the snow", guidance_scale=4.0,
                    max_sequence_length=64, **dict(common, height=64, width=64))
    if family == "sd3":  # batch CFG: [uncond, cond] in one transformer call
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    guidance_scale=5.0, max_sequence_length=32, **common)
    if family == "cogview3plus":  # batch CFG, with the size conditions batched too
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    guidance_scale=5.0, max_sequence_length=32, **common)
    if family == "cogvideox":  # batch CFG; the text length is the transformer's max_text_seq_length
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    guidance_scale=6.0, num_frames=9, max_sequence_length=16, use_dynamic_cfg=False, **common)
    if family == "auraflow":  # batch CFG
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    guidance_scale=3.5, max_sequence_length=32, **common)
    if family == "chroma":  # two calls: the prompt, then the negative prompt
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    guidance_scale=5.0, max_sequence_length=32, **common)
    if family in ("pixart_sigma", "sana"):  # batch CFG; no resolution binning at 32 x 32
        extra = dict(complex_human_instruction=None) if family == "sana" else {}
        extra["clean_caption"] = False  # needs bs4 and ftfy; the corpus has nothing to clean
        return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                    guidance_scale=4.5, max_sequence_length=32, use_resolution_binning=False, **extra, **common)
    return dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                guidance_scale=3.0, num_frames=5, max_sequence_length=32, **common)


def encode_prompt_kwargs(family: str, prompts: list[str]) -> dict[str, Any]:
    """Arguments for the family pipeline's own `encode_prompt` on `prompts` (a batch; prompts of different lengths
    leave padding in the shorter ones), with the sequence length and layers its default call uses."""
    _check_family(family)
    call = default_call_kwargs(family)
    kwargs: dict[str, Any] = dict(prompt=prompts, max_sequence_length=call["max_sequence_length"])
    if family in ("flux", "hunyuanvideo"):
        kwargs["prompt_2"] = None
    if family == "wan":
        kwargs.update(negative_prompt=[call["negative_prompt"]] * len(prompts), do_classifier_free_guidance=True)
    if family == "flux2_klein":
        kwargs["text_encoder_out_layers"] = call["text_encoder_out_layers"]
    if family == "lumina2":
        kwargs.update(do_classifier_free_guidance=True, negative_prompt=["blurry, low quality"] * len(prompts))
    return kwargs


def save_medium_lumina2(folder: str | Path, width: int = 1024, text_layers: int = 5, layers: int = 2,
                        seed: int = 0) -> Path:
    """A Lumina 2 pipeline whose Gemma 2 text encoder and transformer weigh a few hundred MB each (float32) at the
    default width: large next to a Python process with torch imported, so memory tests see the weights. Weights are
    drawn uniformly (fast at this size); the VAE and tokenizer are the tiny ones."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return folder
    import diffusers
    from transformers import Gemma2Config, Gemma2Model

    tiny = build_pipeline("lumina2", seed=seed)
    tokenizer = tiny.tokenizer
    heads, head_dim = width // 128, 128
    # built on the meta device and filled once: default initialisation would cost more than the whole test (the
    # models are only saved; their non-persistent tables are rebuilt when the folder is loaded)
    with torch.device("meta"):
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=width * 11 // 4,
            num_hidden_layers=text_layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
            head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64, max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ))
        transformer = diffusers.Lumina2Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=_LATENT_CHANNELS, hidden_size=width, num_layers=layers,
            num_refiner_layers=1, num_attention_heads=heads, num_kv_heads=heads // 2, multiple_of=256,
            cap_feat_dim=width, axes_dim_rope=(32, 48, 48), axes_lens=(300, 64, 64),
        )
    generator = torch.Generator().manual_seed(seed)
    for module in (text_encoder, transformer):
        module.to_empty(device="cpu")
        with torch.no_grad():
            for param in module.parameters():
                param.uniform_(-0.02, 0.02, generator=generator) if param.dim() > 1 else param.uniform_(
                    0.9, 1.1, generator=generator)
    pipe = pipeline_class("lumina2")(transformer=transformer, scheduler=tiny.scheduler, vae=tiny.vae,
                                     text_encoder=text_encoder, tokenizer=tokenizer)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        pipe.save_pretrained(staging, safe_serialization=True)
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# --- families ---------------------------------------------------------------------------------------------------


def _build_flux(seed: int) -> dict:
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _clip_tokenizer()
    tokenizer_2 = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, projection_dim=_TEXT_WIDTH,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))
    with _seeded(seed, 2):
        text_encoder_2 = T5EncoderModel(_t5_config(T5Config, tokenizer_2, feed_forward_proj="gated-gelu"))
    with _seeded(seed, 3):
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
            latent_channels=_LATENT_CHANNELS, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


def _build_flux2(seed: int) -> dict:
    import diffusers
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    tokenizer = _mistral_tokenizer()
    # The pipeline stacks the hidden states of layers 10, 20 and 30 by default, so the tiny text model keeps 30
    # (very narrow) layers: the pipeline then runs with its default `text_encoder_out_layers`.
    text_config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=30,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    vision_config = PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
        patch_size=4, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    with _seeded(seed, 1):
        text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=text_config, vision_config=vision_config,
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
            multimodal_projector_bias=False, tie_word_embeddings=False,
        ))
    with _seeded(seed, 3):
        vae = diffusers.AutoencoderKLFlux2(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
            latent_channels=_LATENT_CHANNELS, norm_num_groups=4, sample_size=32, patch_size=(2, 2),
        )
        # Non-trivial latent statistics, so the pipeline's (de)normalisation is exercised.
        channels = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_(torch.randn(channels) * 0.1)
        vae.bn.running_var.copy_(1.0 + torch.rand(channels) * 0.5)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _build_qwenimage(seed: int) -> dict:
    import diffusers
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLVisionConfig,
    )

    tokenizer = _qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    text_config = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    )
    vision_config = Qwen2_5_VLVisionConfig(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, window_size=16, out_hidden_size=_TEXT_WIDTH, fullatt_block_indexes=[0],
    )
    with _seeded(seed, 1):
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text_config, vision_config=vision_config, image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        ))
    with _seeded(seed, 3):
        # One spatial downsampling: a VAE scale factor of 2 (the pipeline reads it off `temperal_downsample`).
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=8, z_dim=_LATENT_CHANNELS, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False], latents_mean=_latent_stats(seed, 0.0), latents_std=_latent_stats(seed, 1.0),
        )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _build_wan(seed: int) -> dict:
    import diffusers
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = UMT5EncoderModel(_t5_config(UMT5Config, tokenizer, feed_forward_proj="gated-gelu"))
    with _seeded(seed, 3):
        # Two spatial downsamplings (factor 4), one of them also temporal (factor 2): 5 frames -> 3 latent frames.
        vae = diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=_LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False, True], latents_mean=_latent_stats(seed, 0.0),
            latents_std=_latent_stats(seed, 1.0), scale_factor_temporal=2, scale_factor_spatial=4,
        )
    scheduler = diffusers.UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
        solver_order=2, predict_x0=True, solver_type="bh2", lower_order_final=True,
    )
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler)


def _build_wan22(seed: int) -> dict:
    """Wan 2.2 TI2V-5B style: one transformer fed per-token timesteps (`expand_timesteps`) and the residual VAE
    that patchifies its input (patch size 2) before downsampling."""
    import diffusers

    components = _build_wan(seed)
    with _seeded(seed, 3):
        # patch 2 x two spatial downsamplings = 8; one temporal downsampling: 5 frames -> 3 latent frames
        components["vae"] = diffusers.AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=_LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
            attn_scales=[], temperal_downsample=[False, True], is_residual=True, patch_size=2,
            in_channels=3 * 2 * 2, out_channels=3 * 2 * 2,  # RGB, patchified 2x2
            latents_mean=_latent_stats(seed, 0.0), latents_std=_latent_stats(seed, 1.0), scale_factor_temporal=2,
            scale_factor_spatial=8,
        )
    components["expand_timesteps"] = True
    return components


def _build_wan22_a14b(seed: int) -> dict:
    """Wan 2.2 A14B style: two transformers, the first for the high-noise steps (timestep >= boundary_ratio x 1000)
    and `transformer_2` for the rest. With 3 steps the boundary at 0.9 gives each of them at least one step."""
    components = _build_wan(seed)
    components["boundary_ratio"] = 0.9
    return components


def _build_hunyuanvideo(seed: int) -> dict:
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    tokenizer = _llama3_tokenizer()
    tokenizer_2 = _clip_tokenizer()
    with _seeded(seed, 1):
        # The pipeline takes the hidden states three layers from the top: three layers keep one real one in play.
        text_encoder = LlamaModel(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        ))
    with _seeded(seed, 2):
        text_encoder_2 = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer_2), hidden_size=_TEXT_WIDTH, intermediate_size=64, projection_dim=_TEXT_WIDTH,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
            bos_token_id=tokenizer_2.bos_token_id, eos_token_id=tokenizer_2.eos_token_id,
            pad_token_id=tokenizer_2.pad_token_id,
        ))
    with _seeded(seed, 3):
        # The VAE knows temporal factors 4 and 8 only, and the last block never downsamples: three blocks give 4
        # in space and in time (5 frames -> 2 latent frames).
        vae = diffusers.AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=_LATENT_CHANNELS,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3, up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            block_out_channels=(8, 16, 16), layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=4,
            temporal_compression_ratio=4, mid_block_add_attention=False,
        )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0)
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, vae=vae, scheduler=scheduler,
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


def _build_ltx(seed: int) -> dict:
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = T5EncoderModel(_t5_config(T5Config, tokenizer, feed_forward_proj="gated-gelu"))
    with _seeded(seed, 3):
        # patch 2 x one spatio-temporal downsampling: 4 in space, 2 in time (5 frames -> 3 latent frames)
        vae = diffusers.AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=_LATENT_CHANNELS, block_out_channels=(8, 16),
            down_block_types=("LTXVideoDownBlock3D",) * 2, decoder_block_out_channels=(8, 16),
            layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, False),
            decoder_spatio_temporal_scaling=(True, False), decoder_inject_noise=(False, False, False),
            downsample_type=("conv", "conv"), upsample_residual=(False, False), upsample_factor=(1, 1),
            patch_size=2, patch_size_t=1, timestep_conditioning=False,
        )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
        base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1, time_shift_type="exponential",
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _build_flux2_klein(seed: int) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen3_chat_tokenizer()
    with _seeded(seed, 1):
        # tied input and output embeddings, as in the Qwen3 models FLUX.2 [klein] uses
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ))
    components = _build_flux2(seed)
    components.update(text_encoder=text_encoder, tokenizer=tokenizer)
    return components


def _build_lumina2(seed: int) -> dict:
    import diffusers
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = _gemma_tokenizer()
    with _seeded(seed, 1):
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            query_pre_attn_scalar=8, sliding_window=16, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        ))
    with _seeded(seed, 3):
        # the pipeline assumes a VAE scale factor of 8: three downsamplings
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
            latent_channels=_LATENT_CHANNELS, norm_num_groups=4, sample_size=64, scaling_factor=0.3611,
            shift_factor=0.1159,
        )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _small_vae(seed: int, **overrides: Any):
    """A two-level AutoencoderKL: VAE scale factor 2."""
    import diffusers

    config = dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=_LATENT_CHANNELS, norm_num_groups=4, sample_size=32,
    )
    config.update(overrides)
    with _seeded(seed, 3):
        return diffusers.AutoencoderKL(**config)


def _clip_with_projection(tokenizer, seed: int, component: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    with _seeded(seed, component):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, projection_dim=_TEXT_WIDTH,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))


def _build_sd3(seed: int) -> dict:
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
    text_encoder = _clip_with_projection(tokenizer, seed, 1)
    text_encoder_2 = _clip_with_projection(tokenizer_2, seed, 2)
    with _seeded(seed, 5):
        text_encoder_3 = T5EncoderModel(_t5_config(T5Config, tokenizer_3, feed_forward_proj="gated-gelu"))
    vae = _small_vae(seed, scaling_factor=1.5305, shift_factor=0.0609)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3,
                tokenizer_3=tokenizer_3, image_encoder=None, feature_extractor=None)


def _build_cogview3plus(seed: int) -> dict:
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = T5EncoderModel(_t5_config(T5Config, tokenizer, feed_forward_proj="gated-gelu"))
    vae = _small_vae(seed, scaling_factor=0.18215)
    scheduler = diffusers.CogVideoXDDIMScheduler(num_train_timesteps=1000, timestep_spacing="trailing",
                                                 rescale_betas_zero_snr=True, snr_shift_scale=1.0,
                                                 prediction_type="v_prediction")
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _build_cogvideox(seed: int) -> dict:
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = T5EncoderModel(_t5_config(T5Config, tokenizer, feed_forward_proj="gated-gelu"))
    with _seeded(seed, 3):
        vae = diffusers.AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
            latent_channels=_LATENT_CHANNELS, layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
        )
    scheduler = diffusers.CogVideoXDDIMScheduler(num_train_timesteps=1000, timestep_spacing="trailing",
                                                 rescale_betas_zero_snr=True, snr_shift_scale=1.0,
                                                 prediction_type="v_prediction")
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _build_auraflow(seed: int) -> dict:
    import diffusers
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = UMT5EncoderModel(_t5_config(UMT5Config, tokenizer, feed_forward_proj="gated-gelu"))
    vae = _small_vae(seed, scaling_factor=0.13025)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.73)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _build_chroma(seed: int) -> dict:
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = T5EncoderModel(_t5_config(T5Config, tokenizer, feed_forward_proj="gated-gelu"))
    vae = _small_vae(seed, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                     use_post_quant_conv=False)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, image_encoder=None,
                feature_extractor=None)


def _build_pixart_sigma(seed: int) -> dict:
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = T5EncoderModel(_t5_config(T5Config, tokenizer, feed_forward_proj="gated-gelu"))
    vae = _small_vae(seed, scaling_factor=0.13025)
    scheduler = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _build_sana(seed: int) -> dict:
    import diffusers
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = _gemma_tokenizer()
    with _seeded(seed, 1):
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            query_pre_attn_scalar=8, sliding_window=16, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        ))
    with _seeded(seed, 3):
        # two stages: VAE scale factor 2
        vae = diffusers.AutoencoderDC(
            in_channels=3, latent_channels=_LATENT_CHANNELS, attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"), decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
            encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)), encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1), downsample_block_type="conv", upsample_block_type="interpolate",
            decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
        )
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def _t5_config(config_cls: type, tokenizer, feed_forward_proj: str):
    return config_cls(
        vocab_size=len(tokenizer), d_model=_TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
        feed_forward_proj=feed_forward_proj, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False, use_cache=False,
    )


def _latent_stats(seed: int, centre: float) -> list[float]:
    generator = torch.Generator().manual_seed(seed + 17 + int(centre))
    values = centre + (torch.rand(_LATENT_CHANNELS, generator=generator) - 0.5) * 0.2
    return [round(float(v), 4) for v in values]


# --- tokenizers -------------------------------------------------------------------------------------------------
#
# Each tokenizer is built in two steps: an empty instance of the transformers class gives its normalizer and
# pre-tokenizer; a vocabulary learnt here over the corpus, split by them, is then handed to the class, which is
# also how the class rebuilds itself from a saved folder. The learning is written out below rather than left to
# the `tokenizers` trainers, whose tie-breaking (and so the ids) can change from one process to the next: the same
# seed must give the same pipeline folder everywhere.


def _words(backend, corpus) -> dict[str, int]:
    """How often each pre-token (as the backend's normalizer and pre-tokenizer cut it) occurs in the corpus."""
    counts: dict[str, int] = {}
    for text in corpus:
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(text):
            counts[word] = counts.get(word, 0) + 1
    return counts


# Learnt vocabularies, by what they were learnt from: a pipeline folder built again in the same process (the suite's
# fixtures build many families, several on one tokenizer) reuses them. With PARADIFF_TESTKIT_CACHE naming a folder
# (tests/conftest.py: one per test session, inherited by rank processes and forked commands) they are also kept there
# as JSON, so a vocabulary is learnt once per session rather than once per process: 0.2-5 s of CPU each.
_LEARNT: dict[str, tuple[dict[str, int], list[tuple[str, str]]]] = {}
CACHE_ENV = "PARADIFF_TESTKIT_CACHE"


def _learn_bpe(
    backend, specials: list[str], corpus, alphabet: list[str], end_of_word_suffix: str = ""
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """_learn_bpe_now's result, from this process's memory or the session's cache folder when learnt before."""
    import hashlib

    key = hashlib.sha256(json.dumps([backend.to_str(), list(specials), list(corpus), list(alphabet),
                                     end_of_word_suffix]).encode()).hexdigest()
    if key not in _LEARNT:
        folder = os.environ.get(CACHE_ENV)
        path = Path(folder) / f"bpe-{key}.json" if folder else None
        if path is not None and path.exists():
            stored = json.loads(path.read_text())
            _LEARNT[key] = stored["vocab"], [tuple(pair) for pair in stored["merges"]]
        else:
            _LEARNT[key] = _learn_bpe_now(backend, specials, corpus, alphabet, end_of_word_suffix)
            if path is not None:  # written whole, then renamed: a reader never sees half a file
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                partial.write_text(json.dumps({"vocab": _LEARNT[key][0], "merges": _LEARNT[key][1]}))
                os.replace(partial, path)
    vocab, merges = _LEARNT[key]
    return dict(vocab), list(merges)


def _learn_bpe_now(
    backend, specials: list[str], corpus, alphabet: list[str], end_of_word_suffix: str = ""
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-pair merges until every corpus word is one token; the most frequent pair first, ties by pair order."""
    words: dict[tuple[str, ...], int] = {}
    for word, count in sorted(_words(backend, corpus).items()):
        symbols = list(word)
        symbols[-1] += end_of_word_suffix
        words[tuple(symbols)] = words.get(tuple(symbols), 0) + count
    merges: list[tuple[str, str]] = []
    while True:
        pairs: dict[tuple[str, str], int] = {}
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for symbols, count in words.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        words = merged
    vocab: dict[str, int] = {}
    for token in [*specials, *alphabet, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def _learn_unigram(backend, specials: list[str], corpus) -> list[tuple[str, float]]:
    """Unigram pieces: every corpus word (scored by its log frequency), then single characters, scored low, so a
    known word is one piece and anything else falls back to characters."""
    import math

    words = _words(backend, corpus)
    total = sum(words.values())
    pieces = [(token, 0.0) for token in specials]
    seen = set(specials)
    for word, count in sorted(words.items(), key=lambda item: (-item[1], item[0])):
        if len(word) > 1 and word not in seen:
            pieces.append((word, math.log(count / total)))
            seen.add(word)
    characters = sorted({c for word in words for c in word} | {chr(c) for c in range(33, 127)} | {"\u2581"})
    for char in characters:
        if char not in seen:
            pieces.append((char, math.log(1 / total) - 10.0))
            seen.add(char)
    return pieces


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    # Every byte may start or end a word: both forms are in the vocabulary, so no text maps to the unknown token.
    alphabet = _byte_alphabet() + [c + "</w>" for c in _byte_alphabet()]
    vocab, merges = _learn_bpe(CLIPTokenizer().backend_tokenizer, specials, _CORPUS, alphabet, "</w>")
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def _t5_tokenizer():
    from transformers import T5Tokenizer

    # T5's layout: <pad>=0, </s>=1, <unk>=2, then the pieces.
    pieces = _learn_unigram(T5Tokenizer(extra_ids=0).backend_tokenizer, ["<pad>", "</s>", "<unk>"], _CORPUS)
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def _qwen2_tokenizer():
    from transformers import Qwen2Tokenizer

    extras = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    corpus = list(_CORPUS) + [_QWEN_SYSTEM_PREFIX.replace("<|im_start|>", "").replace("<|im_end|>", "")]
    vocab, merges = _learn_bpe(Qwen2Tokenizer().backend_tokenizer, ["<|endoftext|>"] + extras, corpus, _byte_alphabet())
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=extras, model_max_length=32768)
    prefix = len(tokenizer(_QWEN_SYSTEM_PREFIX).input_ids)
    if prefix != _QWEN_DROP_TOKENS:  # the pipeline would drop part of the prompt, or keep part of the system text
        raise RuntimeError(f"tiny Qwen2 tokenizer gives {prefix} system tokens, the pipeline drops {_QWEN_DROP_TOKENS}")
    return tokenizer


def _qwen3_chat_tokenizer():
    """Qwen2-style BPE with Qwen3's chat layout (the FLUX.2 [klein] pipeline formats every prompt as a user turn,
    thinking disabled)."""
    from transformers import Qwen2Tokenizer

    extras = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab, merges = _learn_bpe(Qwen2Tokenizer().backend_tokenizer, ["<|endoftext|>"] + extras,
                               list(_CORPUS) + ["user assistant"], _byte_alphabet())
    return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=extras, model_max_length=32768,
                          chat_template=_QWEN3_CHAT_TEMPLATE)


def _gemma_tokenizer():
    """Gemma's layout: <pad>=0, <eos>=1, <bos>=2, <unk>=3, <mask>=4, then the learnt pieces; byte fallback covers
    any character the corpus lacks."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    alphabet = sorted({c for text in _CORPUS + (_LUMINA2_SYSTEM_PROMPT,) for c in text.replace(" ", "\u2581")}
                      | {chr(c) for c in range(33, 127)} | {"\u2581"})
    alphabet += [f"<0x{byte:02X}>" for byte in range(256)]
    vocab, merges = _learn_bpe(GemmaTokenizer().backend_tokenizer, specials,
                               list(_CORPUS) + [_LUMINA2_SYSTEM_PROMPT], alphabet)
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=1024)


def _mistral_tokenizer():
    """A byte-level BPE tokenizer with Mistral's special tokens and a chat template.

    FLUX.2 ships a PixtralProcessor (tokenizer + image processor), which transformers only builds with torchvision.
    For text-to-image the pipeline only calls `apply_chat_template` on it, which a plain tokenizer provides too.
    """
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    template = Tokenizer(models.BPE())
    template.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab, merges = _learn_bpe(template, specials, list(_CORPUS) + [SYSTEM_MESSAGE], _byte_alphabet())
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens=specials[4:], chat_template=_MISTRAL_CHAT_TEMPLATE, model_max_length=1024,
    )


def _llama3_tokenizer():
    """A byte-level BPE tokenizer with Llama 3's special tokens, BOS in front, runs of newlines kept whole and digits
    apart from the space before them (as Llama 3's does), so that HunyuanVideo's prompt template is cut where the
    pipeline cuts it."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|finetune_right_pad_id|>"]
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\r\n]+"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[0-9]{1,3}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    template = Tokenizer(models.BPE())
    template.pre_tokenizer = pre_tokenizer
    system = DEFAULT_PROMPT_TEMPLATE["template"]
    for special in specials:
        system = system.replace(special, "")
    vocab, merges = _learn_bpe(template, specials, list(_CORPUS) + [system], _byte_alphabet())
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>", extra_special_tokens=specials[2:5], model_max_length=1024,
    )
    prefix = len(tokenizer(system_prefix := DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]).input_ids)
    if prefix != DEFAULT_PROMPT_TEMPLATE["crop_start"]:  # the pipeline would keep system text, or drop the prompt's
        raise RuntimeError(f"tiny Llama tokenizer gives {prefix} tokens for {system_prefix!r}, the pipeline crops "
                           f"{DEFAULT_PROMPT_TEMPLATE['crop_start']}")
    return tokenizer


# --- helpers ----------------------------------------------------------------------------------------------------


def _rope_axes(head_dim: int, axes: int) -> tuple[int, ...]:
    """Split a head dimension into `axes` even rotary sizes, the last ones taking the remainder: (4, 6, 6)."""
    if head_dim % 2:
        raise ValueError(f"attention_head_dim must be even for rotary embeddings, got {head_dim}")
    pairs = head_dim // 2
    sizes = [pairs // axes] * axes
    for i in range(pairs % axes):
        sizes[-1 - i] += 1
    return tuple(2 * s for s in sizes)


@contextmanager
def _seeded(seed: int, component: int) -> Iterator[None]:
    """Seed the global RNG for one component's initialisation, restoring the caller's state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 101 + component)
        yield


def _check_family(family: str) -> None:
    if family not in PIPELINE_FAMILIES:
        raise ValueError(f"unknown pipeline family {family!r}; known: {PIPELINE_FAMILIES}")


# --- ControlNet pipelines ---------------------------------------------------------------------------------------

# The ControlNet's residual projections and condition embedder come zero-initialised from diffusers (a fresh
# ControlNet changes nothing); the tiny one draws them at this scale, so its residuals are as large as the tokens they
# are added to and a residual added to the wrong tokens changes the image far beyond any tolerance.
CONTROLNET_RESIDUAL_STD = 0.2


CONTROLNET_FAMILIES = {"flux": "FluxControlNetPipeline", "sd3": "StableDiffusion3ControlNetPipeline"}


def build_controlnet_pipeline(family: str = "flux", seed: int = 0):
    """A tiny ControlNet pipeline of `family` (CONTROLNET_FAMILIES): the family's components and transformer, and a
    ControlNet of the transformer's configuration (FLUX.1: FluxControlNetModel, guidance embedded; SD3:
    SD3ControlNetModel) with random weights."""
    import diffusers

    components = {"flux": _build_flux, "sd3": _build_sd3}[family](seed)
    if family == "sd3":
        # SD3's ControlNet pipeline takes sizes in multiples of 8 pixels only: with a three-level VAE (factor 4) and
        # 2 x 2 patches, 40 x 56 pixels are 5 x 7 = 35 tokens, a count two ranks do not divide
        levels = 3
        components["vae"] = _small_vae(seed, scaling_factor=1.5305, shift_factor=0.0609,
                                       down_block_types=("DownEncoderBlock2D",) * levels,
                                       up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=(8, 16, 16))
    with _seeded(seed, 0):
        components["transformer"] = transformer_class(family)(**transformer_config(family))
        with torch.no_grad():
            for param in components["transformer"].parameters():
                param.add_(torch.randn_like(param) * 0.05)
    config = transformer_config(family)
    if family == "flux":
        config.pop("out_channels")
    with _seeded(seed, 6):
        controlnet = {"flux": diffusers.FluxControlNetModel, "sd3": diffusers.SD3ControlNetModel}[family](**config)
        with torch.no_grad():
            for name, param in controlnet.named_parameters():
                residual = name.startswith(("controlnet_", "pos_embed_input"))
                param.add_(torch.randn_like(param) * (CONTROLNET_RESIDUAL_STD if residual else 0.05))
    pipe = getattr(diffusers, CONTROLNET_FAMILIES[family])(**components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


def save_controlnet_pipeline(folder: str | Path, family: str = "flux", seed: int = 0) -> Path:
    """Write `build_controlnet_pipeline(family, seed)` as a pipeline folder; does nothing if it is there already."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build_controlnet_pipeline(family, seed).save_pretrained(staging, safe_serialization=True)
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# --- single-process references ----------------------------------------------------------------------------------


class References:
    """What diffusers' own pipeline (no paradiff) makes from a tiny pipeline folder, made once per call in the test
    process and handed to the rank cases that compare against it: every rank of every case used to load and run the
    same reference itself (4 ranks x 12 composed modes for a handful of distinct calls). One torch thread, as a rank
    computes. A session fixture holds one (tests/conftest.py: `references`)."""

    def __init__(self) -> None:
        self._pipelines: dict[tuple, Any] = {}
        self._outputs: dict[str, Any] = {}

    def pipeline(self, folder: str | Path, pipeline_class: str | None = None):
        key = (str(folder), pipeline_class)
        if key not in self._pipelines:
            import diffusers

            cls = getattr(diffusers, pipeline_class) if pipeline_class else diffusers.DiffusionPipeline
            pipeline = cls.from_pretrained(str(folder))
            pipeline.set_progress_bar_config(disable=True)
            self._pipelines[key] = pipeline
        return self._pipelines[key]

    def pixels(self, folder: str | Path, seed: int, pipeline_class: str | None = None, **call: Any):
        """Images (or video frames) as one numpy array: `pipeline(**call, generator=manual_seed(seed))`."""
        return self.run(folder, seed, pipeline_class, **call)["pixels"]

    def run(self, folder: str | Path, seed: int, pipeline_class: str | None = None, **call: Any) -> dict:
        """`pixels` (as above) and `block_inputs`: the hidden states the transformer's first block was called
        with, one tensor per call (the block list is `transformer_blocks`, `joint_transformer_blocks` or `layers`;
        none recorded for a transformer without one of those)."""
        import numpy as np

        key = json.dumps([str(folder), seed, pipeline_class, call], sort_keys=True, default=repr)
        if key not in self._outputs:
            pipeline = self.pipeline(folder, pipeline_class)
            blocks = next((getattr(pipeline.transformer, name) for name in (
                "transformer_blocks", "joint_transformer_blocks", "layers") if hasattr(pipeline.transformer, name)),
                None)
            seen: list[torch.Tensor] = []
            hook = None if blocks is None else blocks[0].register_forward_pre_hook(
                lambda _module, args, kw: seen.append((args[0] if args else kw["hidden_states"]).detach().clone()),
                with_kwargs=True)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                output = pipeline(**call, generator=torch.Generator().manual_seed(seed))
            finally:
                torch.set_num_threads(threads)
                if hook is not None:
                    hook.remove()
            self._outputs[key] = {"pixels": np.asarray(output.frames if hasattr(output, "frames") else output.images),
                                  "block_inputs": seen}
        return self._outputs[key]

    def parameters(self, folder: str | Path, prefix: str = "transformer") -> dict[str, int]:
        """Parameter count of each whole component whose name starts with `prefix`."""
        pipeline = self.pipeline(folder)
        return {name: sum(p.numel() for p in module.parameters()) for name, module in pipeline.components.items()
                if name.startswith(prefix) and module is not None}
