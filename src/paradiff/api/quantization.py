"""A pipeline's quantization request, held against the components paradiff reads itself.

diffusers applies a `PipelineQuantizationConfig` while it loads each component; the components paradiff loads
(the transformers, ControlNets, the text encoders it splits or reads, every component under `stages=True`) never
pass through that path. paradiff quantizes each of them on read (`paradiff.quant`), with the config diffusers would
have resolved for it (diffusers' config class for a diffusers model, transformers' for a text encoder) and that
library's rule for which linears; a request it cannot honour exactly (a scheme it cannot slice) is refused by name,
before any weight is read.
"""

from __future__ import annotations

from typing import Any, Iterable

from paradiff.errors import ParallelConfigError
from paradiff.quant.schemes import QuantScheme, gguf_scheme, scheme_from_config


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


def pipeline_quantization(config: Any, paradiff_loads: dict[str, tuple[type, str]],
                          single_files: Iterable[str] = ()) -> tuple[dict[str, QuantScheme], bool]:
    """What a pipeline's quantization request asks of the components paradiff loads itself.

    `paradiff_loads`: component name -> (class, kind: "transformer", "controlnet", "text_encoder" or "whole").
    `single_files`: the transformers read from a GGUF file (`load_pipeline(transformer_file=...)`), which need a
    GGUFQuantizationConfig. Returns the scheme of each component paradiff quantizes on read (or holds as the GGUF
    file stores it), and whether diffusers must still see the config (it names a component diffusers loads). A
    component asked for with a scheme paradiff cannot slice is refused by name, before any read."""
    single_files = sorted(single_files)
    if config is None:
        if single_files:
            raise ParallelConfigError(_gguf_needs_config(single_files, "no quantization_config"))
        return {}, False
    from diffusers import GGUFQuantizationConfig, PipelineQuantizationConfig

    from paradiff.io.model_classes import is_transformers_class

    if not isinstance(config, PipelineQuantizationConfig):
        raise ParallelConfigError(
            f"load_pipeline(quantization_config={type(config).__name__}(...)): a pipeline takes a "
            "diffusers.PipelineQuantizationConfig (quant_backend=..., quant_kwargs=..., components_to_quantize=[...]); "
            "a model-level config such as this one goes to paradiff.from_pretrained or diffusers' own loaders."
        )
    schemes = {}
    for name in single_files:
        model_config = (config._resolve_quant_config(is_diffusers=True, module_name=name)
                        if name in requested_components(config, [name]) else None)
        if not isinstance(model_config, GGUFQuantizationConfig):
            given = "no quantization for it" if model_config is None else f"{type(model_config).__name__}(...)"
            raise ParallelConfigError(_gguf_needs_config([name], f"quantization_config gives {given}"))
        schemes[name] = gguf_scheme(model_config)
    for name in requested_components(config, sorted(paradiff_loads)):
        if name in schemes:
            continue
        model_cls = paradiff_loads[name][0]
        # the config class diffusers would hand to the component's own loader: transformers' for a text encoder
        model_config = config._resolve_quant_config(is_diffusers=not is_transformers_class(model_cls),
                                                    module_name=name)
        try:
            schemes[name] = scheme_from_config(model_config)
        except ParallelConfigError as exc:
            raise ParallelConfigError(f"quantization_config for {name!r} ({model_cls.__name__}): {exc}") from None
    others = [name for name in _all_components(config) if name not in paradiff_loads]
    return schemes, bool(others) or (not config.quant_mapping and not config.components_to_quantize)


def _gguf_needs_config(names: list[str], given: str) -> str:
    files = ", ".join(repr(name) for name in names)
    mapping = ", ".join(f"{name!r}: GGUFQuantizationConfig(compute_dtype=...)" for name in names)
    return (f"transformer_file gives {files} as a GGUF file, whose weights are pre-quantized, and {given}; pass "
            f"quantization_config=PipelineQuantizationConfig(quant_mapping={{{mapping}}}) (diffusers' "
            "from_single_file needs GGUFQuantizationConfig too).")


def _all_components(config: Any) -> list[str]:
    mapping = getattr(config, "quant_mapping", None)
    if mapping:
        return list(mapping)
    listed = getattr(config, "components_to_quantize", None)
    return [listed] if isinstance(listed, str) else list(listed or [])
