"""A pipeline's quantization request, held against the components paradiff reads itself.

diffusers applies a `PipelineQuantizationConfig` while it loads each component; the components paradiff loads
(the transformer, the text encoders it splits or reads, every component under `stages=True`) never pass through
that path, so a request naming them would be dropped and the weights would stay in full precision. Until paradiff
quantizes on read, such a request is refused by name, before any weight is read.
"""

from __future__ import annotations

from typing import Any, Iterable

from paradiff.errors import ParallelConfigError


def requested_components(config: Any, names: Iterable[str]) -> list[str]:
    """The names among `names` that `config` asks to quantize, by diffusers' own rule: a granular `quant_mapping`
    names its components; otherwise `components_to_quantize`, and when that is empty, every component."""
    mapping = getattr(config, "quant_mapping", None)
    if mapping:
        return [name for name in names if name in mapping]
    listed = getattr(config, "components_to_quantize", None)
    if isinstance(listed, str):
        listed = [listed]
    return [name for name in names if not listed or name in listed]


def check_pipeline_quantization(config: Any, paradiff_loads: dict[str, type]) -> None:
    """Refuse a quantization request that would be silently ignored. `paradiff_loads`: component name -> class of
    every component paradiff reads itself."""
    if config is None:
        return
    from diffusers import PipelineQuantizationConfig

    if not isinstance(config, PipelineQuantizationConfig):
        raise ParallelConfigError(
            f"load_pipeline(quantization_config={type(config).__name__}(...)): a pipeline takes a "
            "diffusers.PipelineQuantizationConfig (quant_backend=..., quant_kwargs=..., components_to_quantize=[...]); "
            "a model-level config such as this one goes to paradiff.from_pretrained or diffusers' own loaders."
        )
    asked = requested_components(config, sorted(paradiff_loads))
    if asked:
        scheme = config.quant_backend or ", ".join(
            f"{name}: {type(config.quant_mapping[name]).__name__}" for name in asked
        )
        loaded = ", ".join(f"{name!r} ({paradiff_loads[name].__name__})" for name in asked)
        raise ParallelConfigError(
            f"quantization_config asks to quantize {loaded} ({scheme}), but paradiff loads "
            f"{'this component' if len(asked) == 1 else 'these components'} itself from unquantized float weights, "
            "so the request would be ignored and the weights kept in full precision. Leave "
            f"{'it' if len(asked) == 1 else 'them'} out of components_to_quantize / quant_mapping (the components "
            "diffusers loads are quantized as asked), or load the pipeline with plain diffusers."
        )
