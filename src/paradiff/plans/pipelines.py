"""Per-pipeline knowledge: how each diffusers pipeline runs classifier-free guidance, which is what cfg_degree=2
splits over the two halves of the mesh's cfg dimension.

Two styles (`CfgRule.style`):
- "two_calls": the pipeline calls the transformer twice per step (one branch each, in either order) and combines
  the predictions after the second call. Each cfg half computes one of the two calls.
- "batch": the pipeline calls the transformer once per step on the branches concatenated along the batch
  (`batch_order`, e.g. [uncond, cond]); the arguments in `batched` carry that batch. Each cfg half computes its
  half of the batch, and the outputs are gathered back into the whole batch.

A pipeline listed in NEVER_GUIDES cannot use cfg_degree=2 (one transformer call per step on the conditional batch,
guidance distilled into the transformer); one in neither table is not classified yet. Only pipelines whose
cfg2 output was checked against the single-process pipeline (tests/test_cfg.py, and every rule at cfg2 and
cfg2 x tp2 by tools/verify_pipelines.py: docs/pipeline-coverage.md) are listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TWO_CALLS, BATCH = "two_calls", "batch"

# The transformer arguments the batch-CFG pipelines concatenate over the branches, by what they pass.
_LATENTS_TEXT_TIME = ("hidden_states", "encoder_hidden_states", "timestep")
_WITH_TEXT_MASK = _LATENTS_TEXT_TIME + ("encoder_attention_mask",)
_WITH_POOLED = _LATENTS_TEXT_TIME + ("pooled_projections",)
_HUNYUANDIT = _LATENTS_TEXT_TIME + ("text_embedding_mask", "encoder_hidden_states_t5", "text_embedding_mask_t5",
                                    "image_meta_size", "style")


@dataclass(frozen=True)
class CfgRule:
    """A call runs CFG when `scale_argument` (diffusers' default `default_scale`) is above 1, where the pipeline
    needs one for CFG a negative prompt (or its embeddings) is given, and the pipeline's config flag
    `disabled_by_config` (a distilled checkpoint of a guiding class) is not set."""

    scale_argument: str
    default_scale: float
    needs_negative_prompt: bool
    style: str = TWO_CALLS
    batched: tuple[str, ...] = ()  # "batch": the transformer's arguments that hold the branches' batch
    batch_order: tuple[str, ...] = ("uncond", "cond")  # "batch": the branches in batch order
    # "batch": the batched arguments that are lists of one tensor per batch row (the first one the latents)
    sample_lists: tuple[str, ...] = ()
    # "batch": (argument, dimension) for the batched arguments whose batch is not their first dimension
    # "batch": batched arguments whose tensors hold the branches along another dim than 0 (argument, dim)
    batch_dims: tuple[tuple[str, int], ...] = ()
    disabled_by_config: str | None = None
    # an argument that stops guidance after that fraction of the steps (Lumina 2's cfg_trunc_ratio, default 1): the
    # steps after it make one call, which the two-call pairing cannot follow, so CFG parallelism needs it at 1
    truncation_argument: str | None = None
    branches: int = 2  # guidance branches per step: the cfg_degree that gives each cfg rank one
    # call arguments that make the pipeline guide in a way this style cannot split (argument -> why), refused
    refused_arguments: tuple[tuple[str, str], ...] = ()
    threshold: float = 1.0  # the scale above which the pipeline guides (Krea 2: above 0, its scale counts from 0)

    def __post_init__(self) -> None:
        if self.style not in (TWO_CALLS, BATCH):
            raise ValueError(f"CfgRule.style must be {TWO_CALLS!r} or {BATCH!r}, got {self.style!r}")
        if (self.style == BATCH) != bool(self.batched):
            raise ValueError("a 'batch' CfgRule names its batched arguments, a 'two_calls' one names none")
        if self.style == TWO_CALLS and self.branches != 2:
            raise ValueError("a 'two_calls' CfgRule pairs two calls per step: it has 2 branches")

    def runs_cfg(self, call_kwargs: dict[str, Any], pipeline_config: Any = None) -> bool:
        if call_kwargs.get(self.scale_argument, self.default_scale) <= self.threshold:
            return False
        if self.disabled_by_config and getattr(pipeline_config, self.disabled_by_config, False):
            return False
        if self.truncation_argument and call_kwargs.get(self.truncation_argument, 1.0) < 1:
            return False
        if not self.needs_negative_prompt:
            return True
        return call_kwargs.get("negative_prompt") is not None or call_kwargs.get("negative_prompt_embeds") is not None

    def refusal(self, call_kwargs: dict[str, Any]) -> str | None:
        """Why a call with these arguments cannot be split by this rule, or None."""
        for argument, why in self.refused_arguments:
            if call_kwargs.get(argument) is not None:
                return f"{argument}={call_kwargs[argument]!r}: {why}"
        return None

    def how(self) -> str:
        """How to make a call guide, for error messages."""
        negative = " and a negative_prompt" if self.needs_negative_prompt else ""
        truncation = f", {self.truncation_argument} = 1" if self.truncation_argument else ""
        return f"{self.scale_argument} > {self.threshold:g}{negative}{truncation}"


CFG_RULES: dict[str, CfgRule] = {
    "QwenImagePipeline": CfgRule("true_cfg_scale", 4.0, needs_negative_prompt=True),
    # Qwen-Image's variants: the same two calls (a ControlNet's residuals, computed once a step, go to both)
    **{name: CfgRule("true_cfg_scale", 4.0, needs_negative_prompt=True) for name in (
        "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline",
        "QwenImageEditInpaintPipeline", "QwenImageEditPlusPipeline", "QwenImageLayeredPipeline",
        "QwenImageControlNetPipeline", "QwenImageControlNetInpaintPipeline")},
    "FluxPipeline": CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True),
    # FLUX.1's true CFG: the conditional call, then the negative prompt's (a ControlNet's residuals, computed once
    # a step from the conditional inputs, go to both)
    **{name: CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True) for name in (
        "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxKontextPipeline", "FluxKontextInpaintPipeline",
        "FluxControlNetPipeline")},
    "WanPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    # Wan's conditioned pipelines and those built on its transformer: the conditional call, then the unconditional
    # one (the same image / video / VACE conditions in both)
    **{name: CfgRule("guidance_scale", 5.0, needs_negative_prompt=False) for name in (
        "WanImageToVideoPipeline", "WanVideoToVideoPipeline", "WanVACEPipeline", "LucyEditPipeline",
        "ChronoEditPipeline")},
    # Wan-Animate's unconditional call blanks the face frames (the pipeline computes both calls' inputs)
    "WanAnimatePipeline": CfgRule("guidance_scale", 1.0, needs_negative_prompt=False),
    # SkyReels-V2 and Helios (history latents, diffusion forcing: the same inputs in both calls but the text)
    **{name: CfgRule("guidance_scale", scale, needs_negative_prompt=False) for name, scale in (
        ("SkyReelsV2Pipeline", 6.0), ("SkyReelsV2ImageToVideoPipeline", 5.0),
        ("SkyReelsV2DiffusionForcingPipeline", 6.0), ("SkyReelsV2DiffusionForcingImageToVideoPipeline", 5.0),
        ("SkyReelsV2DiffusionForcingVideoToVideoPipeline", 6.0), ("HeliosPipeline", 5.0),
        ("HeliosPyramidPipeline", 5.0))},
    "Flux2KleinPipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False,
                                  disabled_by_config="is_distilled"),
    "Flux2KleinInpaintPipeline": CfgRule("guidance_scale", 8.0, needs_negative_prompt=False,
                                         disabled_by_config="is_distilled"),
    "ChromaPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    "ChromaImg2ImgPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    "ChromaInpaintPipeline": CfgRule("guidance_scale", 7.0, needs_negative_prompt=False),
    # PRX: [uncond, cond] in one call, the text mask batched with the text
    **{name: CfgRule("guidance_scale", 4.0, needs_negative_prompt=False, style=BATCH,
                     batched=_LATENTS_TEXT_TIME + ("attention_mask",))
       for name in ("PRXPipeline", "PRXPixelPipeline")},
    "AuraFlowPipeline": CfgRule("guidance_scale", 3.5, needs_negative_prompt=False, style=BATCH,
                                batched=_LATENTS_TEXT_TIME),
    "CogView3PlusPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                                    batched=_LATENTS_TEXT_TIME + ("original_size", "target_size", "crop_coords")),
    "CogVideoXPipeline": CfgRule("guidance_scale", 6.0, needs_negative_prompt=False, style=BATCH,
                                 batched=_LATENTS_TEXT_TIME),
    "HunyuanVideoPipeline": CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True),
    "Lumina2Pipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False,
                               truncation_argument="cfg_trunc_ratio"),
    **{name: CfgRule(
        "guidance_scale", 7.0, needs_negative_prompt=False, style=BATCH, batched=_WITH_POOLED,
        refused_arguments=(("skip_guidance_layers", "skip-layer guidance adds a third branch, a separate transformer "
                            "call on the conditional batch alone in some of the steps, which CFG parallelism does "
                            "not split yet"),))
       for name in ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")},
    # the ControlNet runs on the whole [uncond, cond] batch; its residuals reach the transformer batched
    **{name: CfgRule("guidance_scale", 7.0, needs_negative_prompt=False, style=BATCH,
                     batched=_WITH_POOLED + ("block_controlnet_hidden_states",))
       for name in ("StableDiffusion3ControlNetPipeline", "StableDiffusion3ControlNetInpaintingPipeline")},
    "SanaPipeline": CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, style=BATCH, batched=_WITH_TEXT_MASK),
    "SanaControlNetPipeline": CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, style=BATCH,
                                      batched=_WITH_TEXT_MASK + ("controlnet_block_samples",)),
    "PixArtAlphaPipeline": CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, style=BATCH,
                                   batched=_WITH_TEXT_MASK),
    "PixArtSigmaPipeline": CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, style=BATCH,
                                   batched=_WITH_TEXT_MASK),
    # AnyFlow: [uncond, cond] in one call, the two timesteps of every frame batched too
    "AnyFlowPipeline": CfgRule("guidance_scale", 1.0, needs_negative_prompt=False, style=BATCH,
                               batched=_LATENTS_TEXT_TIME + ("r_timestep",)),
    # AnyFlow FAR: the same, and each block's KV cache (2, batch, heads, tokens, head_dim), which the pipeline
    # allocates for both branches and a cache-encoding call per chunk fills, holds the branches along dim 1
    "AnyFlowFARPipeline": CfgRule("guidance_scale", 1.0, needs_negative_prompt=False, style=BATCH,
                                  batched=_LATENTS_TEXT_TIME + ("r_timestep", "kv_cache"),
                                  batch_dims=(("kv_cache", 1),)),
    "LTXPipeline": CfgRule("guidance_scale", 3.0, needs_negative_prompt=False, style=BATCH, batched=_WITH_TEXT_MASK),
    # Z-Image: one call on [cond..., uncond...] given as per-sample lists (latents, captions of their own lengths),
    # whenever guidance_scale > 0 (its scale counts from 0: pred = cond + scale * (cond - uncond));
    # cfg_truncation < 1 stops guiding after that fraction of the steps
    **{name: CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH, batched=("x", "t", "cap_feats"),
                     batch_order=("cond", "uncond"), sample_lists=("x", "cap_feats"),
                     truncation_argument="cfg_truncation", threshold=0.0)
       for name in ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")},
    # the ControlNet runs on the whole batch; its residuals (by layer index) reach the transformer batched
    **{name: CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                     batched=("x", "t", "cap_feats", "controlnet_block_samples"), batch_order=("cond", "uncond"),
                     sample_lists=("x", "cap_feats"), truncation_argument="cfg_truncation", threshold=0.0)
       for name in ("ZImageControlNetPipeline", "ZImageControlNetInpaintPipeline")},
    "LuminaPipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False, style=BATCH,
                              batched=_LATENTS_TEXT_TIME + ("encoder_mask",), batch_order=("cond", "uncond")),
    # Hunyuan-DiT: one call on [uncond, cond] with both prompts' embeddings and masks, the size and style
    # conditions; the ControlNet runs on the whole batch and its residuals reach the transformer batched
    "HunyuanDiTPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                                  batched=_HUNYUANDIT),
    "HunyuanDiTControlNetPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                                            batched=_HUNYUANDIT + ("controlnet_block_samples",)),
    # HiDream-I1: one call on [uncond, cond]; the Llama hidden states are stacked [layer, batch, token, width]
    "HiDreamImagePipeline": CfgRule(
        "guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
        batched=("hidden_states", "timesteps", "encoder_hidden_states_t5", "encoder_hidden_states_llama3",
                 "pooled_embeds"), batch_dims=(("encoder_hidden_states_llama3", 1),)),
    "OvisImagePipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    "CogView4Pipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    "CogView4ControlPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    # LTX I2V: the per-token timesteps (the clean first frame's at 0) carry the batch too; Condition: the rotary
    # coordinates as well
    "LTXImageToVideoPipeline": CfgRule("guidance_scale", 3.0, needs_negative_prompt=False, style=BATCH,
                                       batched=_WITH_TEXT_MASK),
    "LTXConditionPipeline": CfgRule("guidance_scale", 3.0, needs_negative_prompt=False, style=BATCH,
                                    batched=_WITH_TEXT_MASK + ("video_coords",)),
    # per temporal window, one call on [uncond, cond] (the window's rotary coordinates are one row, broadcast)
    "LTXI2VLongMultiPromptPipeline": CfgRule("guidance_scale", 1.0, needs_negative_prompt=False, style=BATCH,
                                             batched=_WITH_TEXT_MASK),
    # SkyReels V1 I2V: HunyuanVideo's true CFG (the prompt's call, then the negative prompt's)
    "HunyuanSkyreelsImageToVideoPipeline": CfgRule("true_cfg_scale", 6.0, needs_negative_prompt=True),
    "HunyuanVideoFramepackPipeline": CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True),
    "HunyuanVideoImageToVideoPipeline": CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True),
    # CogVideoX's variants: the image / control latents are concatenated to the batched noise latents
    **{name: CfgRule("guidance_scale", 6.0, needs_negative_prompt=False, style=BATCH, batched=_LATENTS_TEXT_TIME)
       for name in ("CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline", "CogVideoXFunControlPipeline")},
    "AllegroPipeline": CfgRule("guidance_scale", 7.5, needs_negative_prompt=False, style=BATCH,
                               batched=_WITH_TEXT_MASK),
    "LattePipeline": CfgRule("guidance_scale", 7.5, needs_negative_prompt=False, style=BATCH,
                             batched=_LATENTS_TEXT_TIME),
    "MochiPipeline": CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, style=BATCH, batched=_WITH_TEXT_MASK),
    # EasyAnimate: the inpaint latents (mask and masked video) are concatenated over the branches like the noise
    "EasyAnimatePipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                                   batched=_LATENTS_TEXT_TIME),
    "EasyAnimateInpaintPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                                          batched=_LATENTS_TEXT_TIME + ("inpaint_latents",)),
    # ConsisID: the face features stay one row, which the transformer broadcasts over the batch
    "ConsisIDPipeline": CfgRule("guidance_scale", 6.0, needs_negative_prompt=False, style=BATCH,
                                batched=_LATENTS_TEXT_TIME),
    # Stable Audio Open: [uncond, cond] with the duration conditioning batched (the timestep is one value)
    "StableAudioPipeline": CfgRule("guidance_scale", 7.0, needs_negative_prompt=False, style=BATCH,
                                   batched=("hidden_states", "encoder_hidden_states", "global_hidden_states")),
    # DiT: [cond, uncond] (the null class, 1000, second)
    "DiTPipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False, style=BATCH,
                           batched=("hidden_states", "timestep", "class_labels"), batch_order=("cond", "uncond")),
    "BriaPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                            batched=_LATENTS_TEXT_TIME),
    # Stable Audio 3 (the base checkpoint): [uncond, cond], the duration conditioning and the text mask batched
    "StableAudio3Pipeline": CfgRule("guidance_scale", 1.0, needs_negative_prompt=False, style=BATCH, batched=(
        "hidden_states", "timestep", "encoder_hidden_states", "global_hidden_states", "encoder_attention_mask")),
    # ACE-Step 1.5: [cond, uncond] (the condition encoder's null embedding), combined by APG. Steps outside the
    # cfg interval, and a cover task's extra call, make one call on the conditional batch alone
    "AceStepPipeline": CfgRule(
        "guidance_scale", 7.0, needs_negative_prompt=False, style=BATCH, batch_order=("cond", "uncond"),
        batched=("hidden_states", "timestep", "timestep_r", "encoder_hidden_states", "context_latents"),
        refused_arguments=tuple((name, "steps outside the cfg interval make one call on the conditional batch "
                                       "alone, which the batch split cannot share") for name in (
            "cfg_interval_start", "cfg_interval_end")) + (
            ("audio_cover_strength", "a cover task's blend makes a third call on the conditional batch alone"),)),
    # Qwen-Image 2.1: the prompt's call, then the negative prompt's
    "QwenImage21Pipeline": CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True),
    # NucleusMoE-Image: the prompt's call, then the negative prompt's (the empty prompt when none is given)
    "NucleusMoEImagePipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False),
    # LongCat-AudioDiT: the prompt's call, then the negative prompt's
    "LongCatAudioDiTPipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False),
    # LongCat-Image: the prompt's call, then the negative prompt's (the empty prompt when none is given)
    **{name: CfgRule("guidance_scale", 4.5, needs_negative_prompt=False) for name in (
        "LongCatImagePipeline", "LongCatImageEditPipeline")},
    # Bria FIBO: [uncond, cond] with the text-encoder layers and, when a prompt is padded, the joint key mask
    # (joint_attention_kwargs["attention_mask"]) batched
    **{name: CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                     batched=_LATENTS_TEXT_TIME + ("text_encoder_layers", "joint_attention_kwargs"))
       for name in ("BriaFiboPipeline", "BriaFiboEditPipeline")},
    # Bria FIBO 2: the prompt's call, then the negative prompt's (its default negative prompt when none is given)
    "BriaFibo2Pipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    # JoyImage Edit: the prompt's call, then the negative prompt's (both with the image)
    "JoyImageEditPipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False),
    # JoyImage Edit Plus: [uncond, cond] in one call, the per-row list of latent shapes batched too
    "JoyImageEditPlusPipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False, style=BATCH, batched=(
        "hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "shape_list"),
        sample_lists=("shape_list",)),
    # ERNIE-Image: [uncond, cond], the padded texts and their lengths batched
    "ErnieImagePipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False, style=BATCH,
                                  batched=("hidden_states", "timestep", "text_bth", "text_lens")),
    # Krea 2: the prompt's call, then the negative prompt's; it guides at any scale above 0
    "Krea2Pipeline": CfgRule("guidance_scale", 4.5, needs_negative_prompt=False, threshold=0.0),
    # Sana-Video: [uncond, cond] in one call; image-to-video's per-token timesteps are batched the same way
    **{name: CfgRule("guidance_scale", 6.0, needs_negative_prompt=False, style=BATCH, batched=_WITH_TEXT_MASK)
       for name in ("SanaVideoPipeline", "SanaImageToVideoPipeline")},
    # Kandinsky 5 and 6: the prompt's call, then the negative prompt's (a default one when none is given)
    **{name: CfgRule("guidance_scale", scale, needs_negative_prompt=False) for name, scale in (
        ("Kandinsky5T2VPipeline", 5.0), ("Kandinsky5I2VPipeline", 5.0), ("Kandinsky5T2IPipeline", 3.5),
        ("Kandinsky5I2IPipeline", 3.5), ("Kandinsky6TI2VAPipeline", 5.0))},
    # Cosmos 1.0: the prompt's call, then the negative prompt's (a default one when none is given); Video2World's
    # two calls differ in their condition masks and inputs as well
    **{name: CfgRule("guidance_scale", 7.0, needs_negative_prompt=False) for name in (
        "CosmosTextToWorldPipeline", "CosmosVideoToWorldPipeline")},
}

# Pipelines whose call takes a conditioning input under another keyword than diffusers' usual one (what `paradiff
# generate`'s --image / --video pass: image=, video=): {pipeline: {usual keyword: the pipeline's keyword}}
CALL_KEYWORDS: dict[str, dict[str, str]] = {
    "CogVideoXFunControlPipeline": {"video": "control_video"},
    "LTXI2VLongMultiPromptPipeline": {"image": "cond_image"},
}


def call_keyword(pipeline_name: str | None, keyword: str) -> str:
    """The keyword `pipeline_name`'s call takes the conditioning input usually passed as `keyword` under."""
    return CALL_KEYWORDS.get(pipeline_name or "", {}).get(keyword, keyword)


# Video pipelines whose VAE packs T frames into one latent frame (T: its config's `scale_factor_temporal`, or
# `temporal_compression_ratio`, or LTX's computed ratio) and whose call makes T*k + 1 frames: another num_frames is rounded (Wan, SkyReels-V2,
# ... warn in the log) or cut down (HunyuanVideo, LTX) without a word on the command line.
FRAMES_STEP_PIPELINES: tuple[str, ...] = (
    "WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline",
    "SkyReelsV2DiffusionForcingPipeline", "SkyReelsV2DiffusionForcingImageToVideoPipeline",
    "SkyReelsV2DiffusionForcingVideoToVideoPipeline", "ChronoEditPipeline", "LucyEditPipeline", "AnyFlowPipeline",
    "AnyFlowFARPipeline", "Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline", "Kandinsky6TI2VAPipeline",
    "HunyuanVideoPipeline", "LTXPipeline", "LTXImageToVideoPipeline",
)
_TEMPORAL_KEYS = ("scale_factor_temporal", "temporal_compression_ratio")


def frames_step(pipeline_name: str, vae_config: dict) -> int | None:
    """T when `pipeline_name` makes T*k + 1 frames with a VAE of config `vae_config`; None when it is not known to."""
    if pipeline_name not in FRAMES_STEP_PIPELINES:
        return None
    step = next((vae_config[key] for key in _TEMPORAL_KEYS if isinstance(vae_config.get(key), int)), None)
    if step is None and isinstance(vae_config.get("spatio_temporal_scaling"), list):
        # LTX's VAE computes its ratio when the config leaves it None: patch_size_t x 2 per time-downsampling block
        step = int(vae_config.get("patch_size_t") or 1) * 2 ** sum(map(bool, vae_config["spatio_temporal_scaling"]))
    return step if step is not None and step > 1 else None


# Pipelines that make one transformer call per step on the conditional batch only: guidance is distilled into the
# transformer (its `guidance` input), and the call takes no negative prompt.
NEVER_GUIDES: tuple[str, ...] = (
    "Flux2Pipeline", "FluxFillPipeline", "FluxControlPipeline", "FluxControlImg2ImgPipeline",
    "FluxControlInpaintPipeline", "FluxControlNetImg2ImgPipeline", "FluxControlNetInpaintPipeline",
    "SanaSprintPipeline", "SanaSprintImg2ImgPipeline", "Flux2KleinKVPipeline",
    # LTX-2's distilled-sigma pipelines: no negative branch, no guidance argument
    "LTX2DFRPipeline", "LTX2DFRTemporalRefinePipeline",
    # VisualCloze: FLUX.1-dev fine-tuned (embedded guidance), its in-context grid in one call a step
    "VisualClozeGenerationPipeline", "VisualClozePipeline",
    # Stable Audio 3's audio-to-audio and inpainting pipelines take no guidance scale (the distilled checkpoint)
    "StableAudio3AudioToAudioPipeline", "StableAudio3InpaintPipeline",
    # Kandinsky 6 SR: one call a step on a batch of tiles, no guidance argument
    "Kandinsky6SRPipeline",
)


# DiT pipelines of diffusers 0.42.1 that run more than two guidance branches in ways not split yet, with the reason
# (GUIDER_PIPELINES and modular pipelines run any number of branches through their guider: split up to that number).
_PAG = ("perturbed-attention guidance runs [uncond, cond, perturbed] as one batch that its attention processors cut "
        "in three inside every attention, so a cfg rank's share of the batch cannot go through them")
_LTX2 = ("it runs up to four branches per step: one call on [uncond, cond], then a spatio-temporal-guidance call and "
         "a modality-isolation call on the conditional batch alone")
_FIRST_PREDICTION_USED = ("it computes with the first call's prediction (preconditioning, or the conditioning frames' "
                          "velocity put in) before it makes the second call, so the second cfg rank has no prediction "
                          "to hand back for the first call: both branches would have to be computed on every rank")
CFG_NOT_SPLIT: dict[str, str] = {
    "Ideogram4Pipeline": ("it guides asymmetrically: the unconditional branch is a second transformer "
                          "(`unconditional_transformer`) on the image tokens alone, which the two-call pairing of one "
                          "transformer cannot follow"),
    **dict.fromkeys(("Cosmos2TextToImagePipeline", "Cosmos2VideoToWorldPipeline", "Cosmos2_5_PredictBasePipeline",
                     "Cosmos2_5_TransferPipeline"), _FIRST_PREDICTION_USED),
    "OmniGenPipeline": ("with input images it runs three branches (text, unconditional, image) as one call on a batch "
                        "of 3 whose input-image latents are a list indexed by batch row, which the batch split does "
                        "not follow yet"),
    **dict.fromkeys(("HunyuanDiTPAGPipeline", "StableDiffusion3PAGPipeline", "StableDiffusion3PAGImg2ImgPipeline",
                     "PixArtSigmaPAGPipeline", "SanaPAGPipeline"), _PAG),
    **dict.fromkeys(("LTX2Pipeline", "LTX2ConditionPipeline", "LTX2HDRPipeline", "LTX2InContextPipeline",
                     "LTX2ImageToVideoPipeline"), _LTX2),
}

# Standard pipelines that guide through a guider component (`self.guider`, diffusers' guiders: prepare_inputs -> one
# transformer call per branch -> guider(batches)), as modular pipelines do: CFG parallelism splits the guider's
# branches (runtime/cfg.py, "Guider style"), so any guider works, 3-branch ones (SkipLayerGuidance,
# PerturbedAttentionGuidance) at cfg_degree=3. HunyuanImage uses `ocr_guider` instead of `guider` for prompts with
# text to render; with neither it makes a disabled guider of its own (distilled checkpoints), which is refused.
GUIDER_PIPELINES: tuple[str, ...] = (
    "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline", "MotifVideoPipeline",
    "MotifVideoImage2VideoPipeline", "HunyuanImagePipeline", "HunyuanImageRefinerPipeline",
)

# Modular Diffusers pipelines guide through their guider component: each step the guider prepares one batch per
# branch, the denoise step calls the transformer once per batch and the guider combines the predictions. CFG
# parallelism follows that protocol for any modular pipeline (runtime/cfg.py, "Guider style"; cfg_degree up to the
# guider's branch count), so only the modular pipelines that guide some other way are listed, with the reason. One
# with no guider component never guides (guidance-distilled: FLUX.1, Krea 2 Turbo, FLUX.3 distilled, MiniMax-H3).
_TWO_GUIDERS = ("its denoise step runs the branches of two guiders at once (video and audio, cond / uncond / "
                "spatio-temporal / modality) and combines a different subset of them per modality")
MODULAR_CFG_REFUSALS: dict[str, str] = {
    "LTX2ModularPipeline": _TWO_GUIDERS,
    "LTX25ModularPipeline": _TWO_GUIDERS,
    "Cosmos3OmniModularPipeline": ("it guides without a guider component: its denoise step makes its own "
                                   "conditional and unconditional calls from guidance_scale"),
    "Ideogram4ModularPipeline": ("it guides without a guider component (asymmetric CFG: a second transformer, "
                                 "`unconditional_transformer`, makes the unconditional call)"),
}


def modular_cfg_refusal(pipeline_name: str, has_guider: bool) -> str | None:
    """Why the modular pipeline `pipeline_name` cannot run with cfg_degree > 1, or None when its guider's branches
    can be split (`has_guider`: its blocks expect a guider component)."""
    if pipeline_name in MODULAR_CFG_REFUSALS:
        return f"{pipeline_name} is not supported with CFG parallelism yet: {MODULAR_CFG_REFUSALS[pipeline_name]}"
    if not has_guider:
        return (f"{pipeline_name} never runs classifier-free guidance (its blocks have no guider component: "
                "guidance-distilled), so there is no second branch to split")
    return None


# Pipelines context parallelism cannot split, and why: their call puts attention processors of their own on the
# transformer, in place of the ones that split the attention over the ranks.
_PAG_SELF_ATTENTION = ("its perturbed-attention guidance replaces the self-attention of its perturbed layers during "
                       "the call with a processor that builds {what} from the tokens it holds, which under context "
                       "parallelism are one rank's share; load the folder as {base} (no PAG) to split the tokens")
CP_REFUSALS: dict[str, str] = {
    "StableDiffusion3PAGPipeline": _PAG_SELF_ATTENTION.format(what="a token-by-token mask",
                                                              base="StableDiffusion3Pipeline"),
    "StableDiffusion3PAGImg2ImgPipeline": _PAG_SELF_ATTENTION.format(what="a token-by-token mask",
                                                                     base="StableDiffusion3Img2ImgPipeline"),
    "SanaPAGPipeline": _PAG_SELF_ATTENTION.format(what="linear attention's sums over the keys", base="SanaPipeline"),
}


# Pipelines whose `__init__` takes a `transformer` but that are not diffusion-transformer generators of images, video
# or audio tokens that paradiff splits, with the reason (refused by load_pipeline in any parallel mode).
_AMUSED = ("aMUSEd is a masked-token (MaskGIT-style) generator: its UVit2DModel predicts VQ codebook indices with "
           "convolutional down / up blocks around a few transformer layers, and paradiff has no plan for UVit2DModel")
NOT_DIT_PIPELINES: dict[str, str] = {
    **dict.fromkeys(("AmusedPipeline", "AmusedImg2ImgPipeline", "AmusedInpaintPipeline"), _AMUSED),
    "VQDiffusionPipeline": ("VQ-Diffusion is a discrete diffusion over VQ codebook indices (a deprecated pipeline): "
                            "its Transformer2DModel takes vector-quantized classes and predicts log-probabilities "
                            "over the codebook, a path paradiff's Transformer2DModel plans were never checked on"),
    "RFD4ProteinaPipeline": ("RFD4-Proteina generates protein structures (residue frames and atom coordinates), "
                             "not image, video or audio tokens; paradiff has no plan for RFD4ProteinaTransformer"),
}


# Pipelines whose own single-process call fails in the installed diffusers (0.42.1) for every configuration: nothing
# to compare a split run with. The coverage table says so instead of FAIL.
FAILS_IN_DIFFUSERS: dict[str, str] = {
    "EasyAnimateControlPipeline": (
        "diffusers 0.42.1's call passes `text_encoder_index=0` to its own `encode_prompt`, which takes no such "
        "argument, on every call (whatever the components or arguments): even the single-process call raises "
        "TypeError"),
}


def not_dit_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` is no pipeline paradiff splits (not a DiT generator), or None."""
    reason = NOT_DIT_PIPELINES.get(pipeline_name)
    return None if reason is None else f"{pipeline_name} is not split by paradiff: {reason}"


def cp_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` cannot run with context parallelism (ring / Ulysses), or None when it can."""
    reason = CP_REFUSALS.get(pipeline_name)
    return None if reason is None else f"{pipeline_name}: {reason}"


def cfg_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` cannot run with cfg_degree > 1, or None when it can (it is in CFG_RULES or
    GUIDER_PIPELINES)."""
    if pipeline_name in CFG_RULES or pipeline_name in GUIDER_PIPELINES:
        return None
    if pipeline_name in CFG_NOT_SPLIT:
        return f"{pipeline_name} is not supported with CFG parallelism yet: {CFG_NOT_SPLIT[pipeline_name]}"
    if pipeline_name in NEVER_GUIDES:
        return (f"{pipeline_name} never runs classifier-free guidance (guidance-distilled: one transformer call per "
                "step, no negative prompt), so there is no second branch to split")
    return (f"{pipeline_name} is not classified for CFG parallelism yet ({len(CFG_RULES) + len(GUIDER_PIPELINES)} "
            "pipelines are: see the CFG table in docs/pipelines.md)")
