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
    disabled_by_config: str | None = None
    # an argument that stops guidance after that fraction of the steps (Lumina 2's cfg_trunc_ratio, default 1): the
    # steps after it make one call, which the two-call pairing cannot follow, so CFG parallelism needs it at 1
    truncation_argument: str | None = None

    def __post_init__(self) -> None:
        if self.style not in (TWO_CALLS, BATCH):
            raise ValueError(f"CfgRule.style must be {TWO_CALLS!r} or {BATCH!r}, got {self.style!r}")
        if (self.style == BATCH) != bool(self.batched):
            raise ValueError("a 'batch' CfgRule names its batched arguments, a 'two_calls' one names none")

    def runs_cfg(self, call_kwargs: dict[str, Any], pipeline_config: Any = None) -> bool:
        if call_kwargs.get(self.scale_argument, self.default_scale) <= 1:
            return False
        if self.disabled_by_config and getattr(pipeline_config, self.disabled_by_config, False):
            return False
        if self.truncation_argument and call_kwargs.get(self.truncation_argument, 1.0) < 1:
            return False
        if not self.needs_negative_prompt:
            return True
        return call_kwargs.get("negative_prompt") is not None or call_kwargs.get("negative_prompt_embeds") is not None

    def how(self) -> str:
        """How to make a call guide, for error messages."""
        negative = " and a negative_prompt" if self.needs_negative_prompt else ""
        truncation = f", {self.truncation_argument} = 1" if self.truncation_argument else ""
        return f"{self.scale_argument} > 1{negative}{truncation}"


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
    "Flux2KleinPipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False,
                                  disabled_by_config="is_distilled"),
    "Flux2KleinInpaintPipeline": CfgRule("guidance_scale", 8.0, needs_negative_prompt=False,
                                         disabled_by_config="is_distilled"),
    "ChromaPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    "ChromaImg2ImgPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
    "AuraFlowPipeline": CfgRule("guidance_scale", 3.5, needs_negative_prompt=False, style=BATCH,
                                batched=_LATENTS_TEXT_TIME),
    "CogView3PlusPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False, style=BATCH,
                                    batched=_LATENTS_TEXT_TIME + ("original_size", "target_size", "crop_coords")),
    "CogVideoXPipeline": CfgRule("guidance_scale", 6.0, needs_negative_prompt=False, style=BATCH,
                                 batched=_LATENTS_TEXT_TIME),
    "HunyuanVideoPipeline": CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True),
    "Lumina2Pipeline": CfgRule("guidance_scale", 4.0, needs_negative_prompt=False,
                               truncation_argument="cfg_trunc_ratio"),
    **{name: CfgRule("guidance_scale", 7.0, needs_negative_prompt=False, style=BATCH, batched=_WITH_POOLED)
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
    "LTXPipeline": CfgRule("guidance_scale", 3.0, needs_negative_prompt=False, style=BATCH, batched=_WITH_TEXT_MASK),
}

# Pipelines that make one transformer call per step on the conditional batch only: guidance is distilled into the
# transformer (its `guidance` input), and the call takes no negative prompt.
NEVER_GUIDES: tuple[str, ...] = (
    "Flux2Pipeline", "FluxFillPipeline", "FluxControlPipeline", "FluxControlImg2ImgPipeline",
    "FluxControlInpaintPipeline", "FluxControlNetImg2ImgPipeline", "FluxControlNetInpaintPipeline",
    "SanaSprintPipeline", "SanaSprintImg2ImgPipeline", "Flux2KleinKVPipeline",
)


# Pipelines that guide, but in a way the cfg dimension cannot split, and why.
_PAG = ("runs perturbed-attention guidance: one transformer call on [uncond, cond, perturbed], whose attention "
        "processors in the perturbed layers take the three parts of the batch apart inside the transformer, so "
        "the whole batch must reach every call")
NOT_SPLITTABLE: dict[str, str] = {
    name: _PAG for name in ("StableDiffusion3PAGPipeline", "StableDiffusion3PAGImg2ImgPipeline", "SanaPAGPipeline",
                            "PixArtSigmaPAGPipeline", "HunyuanDiTPAGPipeline")
}


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


def cp_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` cannot run with context parallelism (ring / Ulysses), or None when it can."""
    reason = CP_REFUSALS.get(pipeline_name)
    return None if reason is None else f"{pipeline_name}: {reason}"


def cfg_refusal(pipeline_name: str) -> str | None:
    """Why `pipeline_name` cannot run with cfg_degree=2, or None when it can (it is in CFG_RULES)."""
    if pipeline_name in CFG_RULES:
        return None
    if pipeline_name in NOT_SPLITTABLE:
        return f"{pipeline_name} {NOT_SPLITTABLE[pipeline_name]}"
    if pipeline_name in NEVER_GUIDES:
        return (f"{pipeline_name} never runs classifier-free guidance (guidance-distilled: one transformer call per "
                "step, no negative prompt), so there is no second branch to split")
    return (f"{pipeline_name} is not classified for CFG parallelism yet ({len(CFG_RULES)} pipelines are: see the CFG "
            "table in docs/pipelines.md)")
