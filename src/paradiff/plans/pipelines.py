"""Per-pipeline knowledge: which diffusers pipeline calls run classifier-free guidance (two transformer calls per step).

cfg_degree=2 splits those two calls over two ranks, so it is only valid for a pipeline listed here, called with
arguments that make it run true CFG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CfgRule:
    """A call runs CFG when `scale_argument` (diffusers' default `default_scale`) is above 1 and, where the pipeline
    needs one for CFG, a negative prompt (or its embeddings) is given."""

    scale_argument: str
    default_scale: float
    needs_negative_prompt: bool

    def runs_cfg(self, call_kwargs: dict[str, Any]) -> bool:
        if call_kwargs.get(self.scale_argument, self.default_scale) <= 1:
            return False
        if not self.needs_negative_prompt:
            return True
        return call_kwargs.get("negative_prompt") is not None or call_kwargs.get("negative_prompt_embeds") is not None


CFG_RULES: dict[str, CfgRule] = {
    "QwenImagePipeline": CfgRule("true_cfg_scale", 4.0, needs_negative_prompt=True),
    "FluxPipeline": CfgRule("true_cfg_scale", 1.0, needs_negative_prompt=True),
    "WanPipeline": CfgRule("guidance_scale", 5.0, needs_negative_prompt=False),
}
