"""Per-pipeline knowledge: one `PipelineSpec` per diffusers pipeline class (`PIPELINES`, by class name): how it
runs classifier-free guidance, which is what cfg_degree=2 splits over the two halves of the mesh's cfg dimension, the
conditioning inputs its call takes under other keywords, its frame count rule, and why a parallel mode refuses it.

Two styles (`CfgRule.style`):
- "two_calls": the pipeline calls the transformer twice per step (one branch each, in either order) and combines
  the predictions after the second call. Each cfg half computes one of the two calls.
- "batch": the pipeline calls the transformer once per step on the branches concatenated along the batch
  (`batch_order`, e.g. [uncond, cond]); the arguments in `batched` carry that batch. Each cfg half computes its
  half of the batch, and the outputs are gathered back into the whole batch.

A pipeline whose spec says `never_guides` cannot use cfg_degree=2 (one transformer call per step on the conditional
batch, guidance distilled into the transformer); one with no CFG rule, guider or refusal is not classified yet. Only
pipelines whose cfg2 output was checked against the single-process pipeline (tests/test_cfg.py, and every rule at
cfg2 and cfg2 x tp2 by tools/verify_pipelines.py: docs/pipeline-coverage.md) have a rule here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TWO_CALLS, BATCH = "two_calls", "batch"


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


@dataclass(frozen=True)
class PipelineSpec:
    """What paradiff knows about one diffusers pipeline class, besides its transformer's family plan. How it guides
    is one of: `cfg` (a rule CFG parallelism splits), `guider` (guidance through a guider component, as modular
    pipelines do: any guider's branches are split), `never_guides` (guidance-distilled: one transformer call per
    step, no negative prompt) and `cfg_not_split` (why its guidance cannot be split yet); none of them: not
    classified yet."""

    cfg: CfgRule | None = None
    guider: bool = False
    never_guides: bool = False
    cfg_not_split: str | None = None
    # a modular pipeline that guides without a guider component, or through two: why CFG parallelism refuses it
    modular_cfg_refusal: str | None = None
    # conditioning inputs its call takes under another keyword than diffusers' usual one (what `paradiff generate`'s
    # --image / --video pass: image=, video=): (usual keyword, the pipeline's keyword) pairs
    call_keywords: tuple[tuple[str, str], ...] = ()
    # a video pipeline whose VAE packs T frames into one latent frame (T: its config's `scale_factor_temporal`, or
    # `temporal_compression_ratio`, or LTX's computed ratio) and whose call makes T*k + 1 frames: another num_frames
    # is rounded (Wan, SkyReels-V2, ... warn in the log) or cut down (HunyuanVideo, LTX) without a word on the
    # command line
    frames_step: bool = False
    # why context parallelism cannot split it: its call puts attention processors of its own on the transformer, in
    # place of the ones that split the attention over the ranks
    cp_refusal: str | None = None
    # why it is no diffusion-transformer generator of images, video or audio tokens that paradiff splits, although
    # its `__init__` takes a `transformer` (refused by load_pipeline in any parallel mode)
    not_dit: str | None = None
    # why its own single-process call fails in the installed diffusers (0.42.1) for every configuration: nothing to
    # compare a split run with (the coverage table says so instead of FAIL)
    fails_in_diffusers: str | None = None

    def __post_init__(self) -> None:
        guidance = [self.cfg is not None, self.guider, self.never_guides, self.cfg_not_split is not None,
                    self.modular_cfg_refusal is not None]
        if sum(guidance) > 1:
            raise ValueError("a PipelineSpec says how the pipeline guides once: one of cfg, guider, never_guides, "
                             f"cfg_not_split, modular_cfg_refusal, got {self!r}")


def _each(names: str | tuple[str, ...], **facts: Any) -> dict[str, PipelineSpec]:
    """The same spec for each of `names`."""
    return dict.fromkeys((names,) if isinstance(names, str) else names, PipelineSpec(**facts))


def _table(*groups: dict[str, PipelineSpec]) -> dict[str, PipelineSpec]:
    table: dict[str, PipelineSpec] = {}
    for group in groups:
        for name, spec in group.items():
            if name in table:
                raise ValueError(f"{name} has two PipelineSpecs: one per pipeline class")
            table[name] = spec
    return table


# The transformer arguments the batch-CFG pipelines concatenate over the branches, by what they pass.
_LATENTS_TEXT_TIME = ("hidden_states", "encoder_hidden_states", "timestep")
_WITH_TEXT_MASK = _LATENTS_TEXT_TIME + ("encoder_attention_mask",)
_WITH_POOLED = _LATENTS_TEXT_TIME + ("pooled_projections",)
_HUNYUANDIT = _LATENTS_TEXT_TIME + ("text_embedding_mask", "encoder_hidden_states_t5", "text_embedding_mask_t5",
                                    "image_meta_size", "style")


def _two_calls(scale_argument: str, default_scale: float, **rule: Any) -> CfgRule:
    """The conditional call, then the unconditional (or negative prompt's) one; true CFG ("true_cfg_scale") needs a
    negative prompt."""
    return CfgRule(scale_argument, default_scale, needs_negative_prompt=scale_argument == "true_cfg_scale", **rule)


def _batch(default_scale: float, batched: tuple[str, ...], **rule: Any) -> CfgRule:
    """One call on the branches concatenated along the batch, guiding by `guidance_scale`."""
    return CfgRule("guidance_scale", default_scale, needs_negative_prompt=False, style=BATCH, batched=batched, **rule)


# Why some pipelines' guidance is not split yet (DiT pipelines of diffusers 0.42.1 that run more than two guidance
# branches in ways not split yet; guider pipelines and modular ones run any number of branches through their guider:
# split up to that number).
_PAG = ("perturbed-attention guidance runs [uncond, cond, perturbed] as one batch that its attention processors cut "
        "in three inside every attention, so a cfg rank's share of the batch cannot go through them")
_LTX2 = ("it runs up to four branches per step: one call on [uncond, cond], then a spatio-temporal-guidance call and "
         "a modality-isolation call on the conditional batch alone")
_FIRST_PREDICTION_USED = ("it computes with the first call's prediction (preconditioning, or the conditioning frames' "
                          "velocity put in) before it makes the second call, so the second cfg rank has no prediction "
                          "to hand back for the first call: both branches would have to be computed on every rank")
_TWO_GUIDERS = ("its denoise step runs the branches of two guiders at once (video and audio, cond / uncond / "
                "spatio-temporal / modality) and combines a different subset of them per modality")
_PAG_SELF_ATTENTION = ("its perturbed-attention guidance replaces the self-attention of its perturbed layers during "
                       "the call with a processor that builds {what} from the tokens it holds, which under context "
                       "parallelism are one rank's share; load the folder as {base} (no PAG) to split the tokens")
_AMUSED = ("aMUSEd is a masked-token (MaskGIT-style) generator: its UVit2DModel predicts VQ codebook indices with "
           "convolutional down / up blocks around a few transformer layers, and paradiff has no plan for UVit2DModel")

PIPELINES: dict[str, PipelineSpec] = _table(
    # Qwen-Image and its variants: the same two calls (a ControlNet's residuals, computed once a step, go to both)
    _each(("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline",
           "QwenImageEditInpaintPipeline", "QwenImageEditPlusPipeline", "QwenImageLayeredPipeline",
           "QwenImageControlNetPipeline", "QwenImageControlNetInpaintPipeline"), cfg=_two_calls("true_cfg_scale", 4.0)),
    # Qwen-Image 2.1: the prompt's call, then the negative prompt's
    _each("QwenImage21Pipeline", cfg=_two_calls("true_cfg_scale", 1.0)),
    # FLUX.1's true CFG: the conditional call, then the negative prompt's (a ControlNet's residuals, computed once
    # a step from the conditional inputs, go to both)
    _each(("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxKontextPipeline",
           "FluxKontextInpaintPipeline", "FluxControlNetPipeline"), cfg=_two_calls("true_cfg_scale", 1.0)),
    # FLUX.1's guidance-distilled variants, FLUX.2 and Klein KV: guidance embedded in the transformer
    _each(("Flux2Pipeline", "FluxFillPipeline", "FluxControlPipeline", "FluxControlImg2ImgPipeline",
           "FluxControlInpaintPipeline", "FluxControlNetImg2ImgPipeline", "FluxControlNetInpaintPipeline",
           "Flux2KleinKVPipeline"), never_guides=True),
    _each("Flux2KleinPipeline", cfg=_two_calls("guidance_scale", 4.0, disabled_by_config="is_distilled")),
    _each("Flux2KleinInpaintPipeline", cfg=_two_calls("guidance_scale", 8.0, disabled_by_config="is_distilled")),
    # VisualCloze: FLUX.1-dev fine-tuned (embedded guidance), its in-context grid in one call a step
    _each(("VisualClozeGenerationPipeline", "VisualClozePipeline"), never_guides=True),
    # Wan and the pipelines built on its transformer: the conditional call, then the unconditional one (the same
    # image / video / VACE conditions in both)
    _each(("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "LucyEditPipeline", "ChronoEditPipeline"),
          cfg=_two_calls("guidance_scale", 5.0), frames_step=True),
    _each("WanVideoToVideoPipeline", cfg=_two_calls("guidance_scale", 5.0)),
    # Wan-Animate's unconditional call blanks the face frames (the pipeline computes both calls' inputs)
    _each("WanAnimatePipeline", cfg=_two_calls("guidance_scale", 1.0)),
    # SkyReels-V2 and Helios (history latents, diffusion forcing: the same inputs in both calls but the text)
    _each(("SkyReelsV2Pipeline", "SkyReelsV2DiffusionForcingPipeline",
           "SkyReelsV2DiffusionForcingVideoToVideoPipeline"),
          cfg=_two_calls("guidance_scale", 6.0), frames_step=True),
    _each(("SkyReelsV2ImageToVideoPipeline", "SkyReelsV2DiffusionForcingImageToVideoPipeline"),
          cfg=_two_calls("guidance_scale", 5.0), frames_step=True),
    _each(("HeliosPipeline", "HeliosPyramidPipeline"), cfg=_two_calls("guidance_scale", 5.0)),
    _each("ChromaPipeline", cfg=_two_calls("guidance_scale", 5.0)),
    _each("ChromaImg2ImgPipeline", cfg=_two_calls("guidance_scale", 5.0)),
    _each("ChromaInpaintPipeline", cfg=_two_calls("guidance_scale", 7.0)),
    # PRX: [uncond, cond] in one call, the text mask batched with the text
    _each(("PRXPipeline", "PRXPixelPipeline"), cfg=_batch(4.0, _LATENTS_TEXT_TIME + ("attention_mask",))),
    _each("AuraFlowPipeline", cfg=_batch(3.5, _LATENTS_TEXT_TIME)),
    _each("CogView3PlusPipeline",
          cfg=_batch(5.0, _LATENTS_TEXT_TIME + ("original_size", "target_size", "crop_coords"))),
    _each(("CogView4Pipeline", "CogView4ControlPipeline"), cfg=_two_calls("guidance_scale", 5.0)),
    _each("CogVideoXPipeline", cfg=_batch(6.0, _LATENTS_TEXT_TIME)),
    # CogVideoX's variants: the image / control latents are concatenated to the batched noise latents
    _each(("CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline"), cfg=_batch(6.0, _LATENTS_TEXT_TIME)),
    _each("CogVideoXFunControlPipeline", cfg=_batch(6.0, _LATENTS_TEXT_TIME),
          call_keywords=(("video", "control_video"),)),
    _each("HunyuanVideoPipeline", cfg=_two_calls("true_cfg_scale", 1.0), frames_step=True),
    # SkyReels V1 I2V: HunyuanVideo's true CFG (the prompt's call, then the negative prompt's)
    _each("HunyuanSkyreelsImageToVideoPipeline", cfg=_two_calls("true_cfg_scale", 6.0)),
    _each(("HunyuanVideoFramepackPipeline", "HunyuanVideoImageToVideoPipeline"), cfg=_two_calls("true_cfg_scale", 1.0)),
    _each("Lumina2Pipeline", cfg=_two_calls("guidance_scale", 4.0, truncation_argument="cfg_trunc_ratio")),
    _each("LuminaPipeline", cfg=_batch(4.0, _LATENTS_TEXT_TIME + ("encoder_mask",), batch_order=("cond", "uncond"))),
    _each(("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
          cfg=_batch(7.0, _WITH_POOLED, refused_arguments=(("skip_guidance_layers", (
              "skip-layer guidance adds a third branch, a separate transformer call on the conditional batch alone in "
              "some of the steps, which CFG parallelism does not split yet")),))),
    # the ControlNet runs on the whole [uncond, cond] batch; its residuals reach the transformer batched
    _each(("StableDiffusion3ControlNetPipeline", "StableDiffusion3ControlNetInpaintingPipeline"),
          cfg=_batch(7.0, _WITH_POOLED + ("block_controlnet_hidden_states",))),
    _each("StableDiffusion3PAGPipeline", cfg_not_split=_PAG, cp_refusal=_PAG_SELF_ATTENTION.format(
        what="a token-by-token mask", base="StableDiffusion3Pipeline")),
    _each("StableDiffusion3PAGImg2ImgPipeline", cfg_not_split=_PAG, cp_refusal=_PAG_SELF_ATTENTION.format(
        what="a token-by-token mask", base="StableDiffusion3Img2ImgPipeline")),
    _each("SanaPipeline", cfg=_batch(4.5, _WITH_TEXT_MASK)),
    _each("SanaControlNetPipeline", cfg=_batch(4.5, _WITH_TEXT_MASK + ("controlnet_block_samples",))),
    _each("SanaPAGPipeline", cfg_not_split=_PAG, cp_refusal=_PAG_SELF_ATTENTION.format(
        what="linear attention's sums over the keys", base="SanaPipeline")),
    _each(("SanaSprintPipeline", "SanaSprintImg2ImgPipeline"), never_guides=True),
    # Sana-Video: [uncond, cond] in one call; image-to-video's per-token timesteps are batched the same way
    _each(("SanaVideoPipeline", "SanaImageToVideoPipeline"), cfg=_batch(6.0, _WITH_TEXT_MASK)),
    _each(("PixArtAlphaPipeline", "PixArtSigmaPipeline"), cfg=_batch(4.5, _WITH_TEXT_MASK)),
    _each("PixArtSigmaPAGPipeline", cfg_not_split=_PAG),
    # AnyFlow: [uncond, cond] in one call, the two timesteps of every frame batched too
    _each("AnyFlowPipeline", cfg=_batch(1.0, _LATENTS_TEXT_TIME + ("r_timestep",)), frames_step=True),
    # AnyFlow FAR: the same, and each block's KV cache (2, batch, heads, tokens, head_dim), which the pipeline
    # allocates for both branches and a cache-encoding call per chunk fills, holds the branches along dim 1
    _each("AnyFlowFARPipeline", cfg=_batch(1.0, _LATENTS_TEXT_TIME + ("r_timestep", "kv_cache"),
                                           batch_dims=(("kv_cache", 1),)), frames_step=True),
    # LTX; I2V: the per-token timesteps (the clean first frame's at 0) carry the batch too; Condition: the rotary
    # coordinates as well
    _each(("LTXPipeline", "LTXImageToVideoPipeline"), cfg=_batch(3.0, _WITH_TEXT_MASK), frames_step=True),
    _each("LTXConditionPipeline", cfg=_batch(3.0, _WITH_TEXT_MASK + ("video_coords",))),
    # per temporal window, one call on [uncond, cond] (the window's rotary coordinates are one row, broadcast)
    _each("LTXI2VLongMultiPromptPipeline", cfg=_batch(1.0, _WITH_TEXT_MASK), call_keywords=(("image", "cond_image"),)),
    _each(("LTX2Pipeline", "LTX2ConditionPipeline", "LTX2HDRPipeline", "LTX2InContextPipeline",
           "LTX2ImageToVideoPipeline"), cfg_not_split=_LTX2),
    # LTX-2's distilled-sigma pipelines: no negative branch, no guidance argument
    _each(("LTX2DFRPipeline", "LTX2DFRTemporalRefinePipeline"), never_guides=True),
    # Z-Image: one call on [cond..., uncond...] given as per-sample lists (latents, captions of their own lengths),
    # whenever guidance_scale > 0 (its scale counts from 0: pred = cond + scale * (cond - uncond));
    # cfg_truncation < 1 stops guiding after that fraction of the steps
    _each(("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline"), cfg=_batch(
        5.0, ("x", "t", "cap_feats"), batch_order=("cond", "uncond"), sample_lists=("x", "cap_feats"),
        truncation_argument="cfg_truncation", threshold=0.0)),
    # the ControlNet runs on the whole batch; its residuals (by layer index) reach the transformer batched
    _each(("ZImageControlNetPipeline", "ZImageControlNetInpaintPipeline"), cfg=_batch(
        5.0, ("x", "t", "cap_feats", "controlnet_block_samples"), batch_order=("cond", "uncond"),
        sample_lists=("x", "cap_feats"), truncation_argument="cfg_truncation", threshold=0.0)),
    # Hunyuan-DiT: one call on [uncond, cond] with both prompts' embeddings and masks, the size and style
    # conditions; the ControlNet runs on the whole batch and its residuals reach the transformer batched
    _each("HunyuanDiTPipeline", cfg=_batch(5.0, _HUNYUANDIT)),
    _each("HunyuanDiTControlNetPipeline", cfg=_batch(5.0, _HUNYUANDIT + ("controlnet_block_samples",))),
    _each("HunyuanDiTPAGPipeline", cfg_not_split=_PAG),
    # HiDream-I1: one call on [uncond, cond]; the Llama hidden states are stacked [layer, batch, token, width]
    _each("HiDreamImagePipeline", cfg=_batch(5.0, (
        "hidden_states", "timesteps", "encoder_hidden_states_t5", "encoder_hidden_states_llama3", "pooled_embeds"),
        batch_dims=(("encoder_hidden_states_llama3", 1),))),
    _each("OvisImagePipeline", cfg=_two_calls("guidance_scale", 5.0)),
    _each("AllegroPipeline", cfg=_batch(7.5, _WITH_TEXT_MASK)),
    _each("MochiPipeline", cfg=_batch(4.5, _WITH_TEXT_MASK)),
    _each("LattePipeline", cfg=_batch(7.5, _LATENTS_TEXT_TIME)),
    # EasyAnimate: the inpaint latents (mask and masked video) are concatenated over the branches like the noise
    _each("EasyAnimatePipeline", cfg=_batch(5.0, _LATENTS_TEXT_TIME)),
    _each("EasyAnimateInpaintPipeline", cfg=_batch(5.0, _LATENTS_TEXT_TIME + ("inpaint_latents",))),
    _each("EasyAnimateControlPipeline", fails_in_diffusers=(
        "diffusers 0.42.1's call passes `text_encoder_index=0` to its own `encode_prompt`, which takes no such "
        "argument, on every call (whatever the components or arguments): even the single-process call raises "
        "TypeError")),
    # ConsisID: the face features stay one row, which the transformer broadcasts over the batch
    _each("ConsisIDPipeline", cfg=_batch(6.0, _LATENTS_TEXT_TIME)),
    # Stable Audio Open: [uncond, cond] with the duration conditioning batched (the timestep is one value)
    _each("StableAudioPipeline", cfg=_batch(7.0, ("hidden_states", "encoder_hidden_states", "global_hidden_states"))),
    # Stable Audio 3 (the base checkpoint): [uncond, cond], the duration conditioning and the text mask batched
    _each("StableAudio3Pipeline", cfg=_batch(1.0, (
        "hidden_states", "timestep", "encoder_hidden_states", "global_hidden_states", "encoder_attention_mask"))),
    # its audio-to-audio and inpainting pipelines take no guidance scale (the distilled checkpoint)
    _each(("StableAudio3AudioToAudioPipeline", "StableAudio3InpaintPipeline"), never_guides=True),
    # DiT: [cond, uncond] (the null class, 1000, second)
    _each("DiTPipeline",
          cfg=_batch(4.0, ("hidden_states", "timestep", "class_labels"), batch_order=("cond", "uncond"))),
    _each("BriaPipeline", cfg=_batch(5.0, _LATENTS_TEXT_TIME)),
    # Bria FIBO: [uncond, cond] with the text-encoder layers and, when a prompt is padded, the joint key mask
    # (joint_attention_kwargs["attention_mask"]) batched
    _each(("BriaFiboPipeline", "BriaFiboEditPipeline"),
          cfg=_batch(5.0, _LATENTS_TEXT_TIME + ("text_encoder_layers", "joint_attention_kwargs"))),
    # Bria FIBO 2: the prompt's call, then the negative prompt's (its default negative prompt when none is given)
    _each("BriaFibo2Pipeline", cfg=_two_calls("guidance_scale", 5.0)),
    # ACE-Step 1.5: [cond, uncond] (the condition encoder's null embedding), combined by APG. Steps outside the
    # cfg interval, and a cover task's extra call, make one call on the conditional batch alone
    _each("AceStepPipeline", cfg=_batch(
        7.0, ("hidden_states", "timestep", "timestep_r", "encoder_hidden_states", "context_latents"),
        batch_order=("cond", "uncond"), refused_arguments=tuple(
            (name, "steps outside the cfg interval make one call on the conditional batch alone, which the batch "
                   "split cannot share") for name in ("cfg_interval_start", "cfg_interval_end")) + (
            ("audio_cover_strength", "a cover task's blend makes a third call on the conditional batch alone"),))),
    # NucleusMoE-Image: the prompt's call, then the negative prompt's (the empty prompt when none is given)
    _each("NucleusMoEImagePipeline", cfg=_two_calls("guidance_scale", 4.0)),
    # LongCat-AudioDiT: the prompt's call, then the negative prompt's
    _each("LongCatAudioDiTPipeline", cfg=_two_calls("guidance_scale", 4.0)),
    # LongCat-Image: the prompt's call, then the negative prompt's (the empty prompt when none is given)
    _each(("LongCatImagePipeline", "LongCatImageEditPipeline"), cfg=_two_calls("guidance_scale", 4.5)),
    # JoyImage Edit: the prompt's call, then the negative prompt's (both with the image)
    _each("JoyImageEditPipeline", cfg=_two_calls("guidance_scale", 4.0)),
    # JoyImage Edit Plus: [uncond, cond] in one call, the per-row list of latent shapes batched too
    _each("JoyImageEditPlusPipeline", cfg=_batch(4.0, (
        "hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "shape_list"),
        sample_lists=("shape_list",))),
    # ERNIE-Image: [uncond, cond], the padded texts and their lengths batched
    _each("ErnieImagePipeline", cfg=_batch(4.0, ("hidden_states", "timestep", "text_bth", "text_lens"))),
    # Krea 2: the prompt's call, then the negative prompt's; it guides at any scale above 0
    _each("Krea2Pipeline", cfg=_two_calls("guidance_scale", 4.5, threshold=0.0)),
    # Kandinsky 5 and 6: the prompt's call, then the negative prompt's (a default one when none is given)
    _each(("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline", "Kandinsky6TI2VAPipeline"),
          cfg=_two_calls("guidance_scale", 5.0), frames_step=True),
    _each(("Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline"), cfg=_two_calls("guidance_scale", 3.5)),
    # Kandinsky 6 SR: one call a step on a batch of tiles, no guidance argument
    _each("Kandinsky6SRPipeline", never_guides=True),
    # Cosmos 1.0: the prompt's call, then the negative prompt's (a default one when none is given); Video2World's
    # two calls differ in their condition masks and inputs as well
    _each(("CosmosTextToWorldPipeline", "CosmosVideoToWorldPipeline"), cfg=_two_calls("guidance_scale", 7.0)),
    _each(("Cosmos2TextToImagePipeline", "Cosmos2VideoToWorldPipeline", "Cosmos2_5_PredictBasePipeline",
           "Cosmos2_5_TransferPipeline"), cfg_not_split=_FIRST_PREDICTION_USED),
    _each("Ideogram4Pipeline", cfg_not_split=(
        "it guides asymmetrically: the unconditional branch is a second transformer (`unconditional_transformer`) "
        "on the image tokens alone, which the two-call pairing of one transformer cannot follow")),
    _each("OmniGenPipeline", cfg_not_split=(
        "with input images it runs three branches (text, unconditional, image) as one call on a batch of 3 whose "
        "input-image latents are a list indexed by batch row, which the batch split does not follow yet")),
    # Standard pipelines that guide through a guider component (`self.guider`, diffusers' guiders: prepare_inputs ->
    # one transformer call per branch -> guider(batches)), as modular pipelines do: CFG parallelism splits the
    # guider's branches (runtime/cfg.py, "Guider style"), so any guider works, 3-branch ones (SkipLayerGuidance,
    # PerturbedAttentionGuidance) at cfg_degree=3. HunyuanImage uses `ocr_guider` instead of `guider` for prompts
    # with text to render; with neither it makes a disabled guider of its own (distilled checkpoints), which is
    # refused.
    _each(("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline", "MotifVideoPipeline",
           "MotifVideoImage2VideoPipeline", "HunyuanImagePipeline", "HunyuanImageRefinerPipeline"), guider=True),
    # Modular Diffusers pipelines guide through their guider component: each step the guider prepares one batch per
    # branch, the denoise step calls the transformer once per batch and the guider combines the predictions. CFG
    # parallelism follows that protocol for any modular pipeline (runtime/cfg.py, "Guider style"; cfg_degree up to
    # the guider's branch count), so only the modular pipelines that guide some other way are listed, with the
    # reason. One with no guider component never guides (guidance-distilled: FLUX.1, Krea 2 Turbo, FLUX.3
    # distilled, MiniMax-H3).
    _each(("LTX2ModularPipeline", "LTX25ModularPipeline"), modular_cfg_refusal=_TWO_GUIDERS),
    _each("Cosmos3OmniModularPipeline", modular_cfg_refusal=(
        "it guides without a guider component: its denoise step makes its own conditional and unconditional calls "
        "from guidance_scale")),
    _each("Ideogram4ModularPipeline", modular_cfg_refusal=(
        "it guides without a guider component (asymmetric CFG: a second transformer, `unconditional_transformer`, "
        "makes the unconditional call)")),
    # not diffusion-transformer generators paradiff splits
    _each(("AmusedPipeline", "AmusedImg2ImgPipeline", "AmusedInpaintPipeline"), not_dit=_AMUSED),
    _each("VQDiffusionPipeline", not_dit=(
        "VQ-Diffusion is a discrete diffusion over VQ codebook indices (a deprecated pipeline): its "
        "Transformer2DModel takes vector-quantized classes and predicts log-probabilities over the codebook, a path "
        "paradiff's Transformer2DModel plans were never checked on")),
    _each("RFD4ProteinaPipeline", not_dit=(
        "RFD4-Proteina generates protein structures (residue frames and atom coordinates), not image, video or audio "
        "tokens; paradiff has no plan for RFD4ProteinaTransformer")),
)
_UNKNOWN = PipelineSpec()


def pipeline_spec(pipeline_name: str | None) -> PipelineSpec:
    """What paradiff knows about the pipeline class `pipeline_name`: its PipelineSpec, or an empty one."""
    return PIPELINES.get(pipeline_name or "", _UNKNOWN)


# The rules alone, by pipeline class: what CFG parallelism splits (runtime/cfg.py reads the rule of its pipeline).
CFG_RULES: dict[str, CfgRule] = {name: entry.cfg for name, entry in PIPELINES.items() if entry.cfg is not None}


def call_keyword(pipeline_name: str | None, keyword: str) -> str:
    """The keyword `pipeline_name`'s call takes the conditioning input usually passed as `keyword` under."""
    return dict(pipeline_spec(pipeline_name).call_keywords).get(keyword, keyword)


_TEMPORAL_KEYS = ("scale_factor_temporal", "temporal_compression_ratio")


def frames_step(pipeline_name: str, vae_config: dict) -> int | None:
    """T when `pipeline_name` makes T*k + 1 frames with a VAE of config `vae_config`; None when it is not known to."""
    if not pipeline_spec(pipeline_name).frames_step:
        return None
    step = next((vae_config[key] for key in _TEMPORAL_KEYS if isinstance(vae_config.get(key), int)), None)
    if step is None and isinstance(vae_config.get("spatio_temporal_scaling"), list):
        # LTX's VAE computes its ratio when the config leaves it None: patch_size_t x 2 per time-downsampling block
        step = int(vae_config.get("patch_size_t") or 1) * 2 ** sum(map(bool, vae_config["spatio_temporal_scaling"]))
    return step if step is not None and step > 1 else None


def modular_cfg_refusal(pipeline_name: str, has_guider: bool) -> str | None:
    """Why the modular pipeline `pipeline_name` cannot run with cfg_degree > 1, or None when its guider's branches
    can be split (`has_guider`: its blocks expect a guider component)."""
    reason = pipeline_spec(pipeline_name).modular_cfg_refusal
    if reason is not None:
        return f"{pipeline_name} is not supported with CFG parallelism yet: {reason}"
    if not has_guider:
        return (f"{pipeline_name} never runs classifier-free guidance (its blocks have no guider component: "
                "guidance-distilled), so there is no second branch to split")
    return None


def not_dit_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` is no pipeline paradiff splits (not a DiT generator), or None."""
    reason = pipeline_spec(pipeline_name).not_dit
    return None if reason is None else f"{pipeline_name} is not split by paradiff: {reason}"


def cp_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` cannot run with context parallelism (ring / Ulysses), or None when it can."""
    reason = pipeline_spec(pipeline_name).cp_refusal
    return None if reason is None else f"{pipeline_name}: {reason}"


def cfg_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` cannot run with cfg_degree > 1, or None when it can (it has a CFG rule or a guider)."""
    entry = pipeline_spec(pipeline_name)
    if entry.cfg is not None or entry.guider:
        return None
    if entry.cfg_not_split is not None:
        return f"{pipeline_name} is not supported with CFG parallelism yet: {entry.cfg_not_split}"
    if entry.never_guides:
        return (f"{pipeline_name} never runs classifier-free guidance (guidance-distilled: one transformer call per "
                "step, no negative prompt), so there is no second branch to split")
    splittable = sum(entry.cfg is not None or entry.guider for entry in PIPELINES.values())
    return (f"{pipeline_name} is not classified for CFG parallelism yet ({splittable} "
            "pipelines are: see the CFG table in docs/pipelines.md)")
