"""Which quantization a diffusers config asks for, which linears it covers, and whether a plan's slices allow it.

Everything here runs before any weight is read: a config paradiff cannot honour exactly is refused by name, and so
is a blockwise format whose blocks a rank's slice would cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from paradiff.errors import BlockSplitError, ParallelConfigError

SCHEMES = ("int8", "fp8", "nf4")
SUPPORTED = (
    "TorchAoConfig(Int8WeightOnlyConfig()) (per-row int8 weight-only), TorchAoConfig(Float8WeightOnlyConfig()) "
    "(per-row float8 weight-only), BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')"
)
NF4_BLOCK = 64  # bitsandbytes' default blocksize on every device; diffusers passes no other


@dataclass(frozen=True)
class QuantScheme:
    """One weight quantization scheme as paradiff applies it, per linear weight, on each rank's slice."""

    name: str  # "int8", "fp8", "nf4" or "gguf" (pre-quantized GGUF weights, held as read)
    skip: tuple[str, ...] = ()  # the config's modules_to_not_convert / llm_int8_skip_modules (+ keep-in-fp32 modules)
    float8_dtype: torch.dtype | None = None  # fp8 only
    compute_dtype: torch.dtype | None = None  # nf4 only: the dtype bitsandbytes computes in (None: the input's)
    block: int | None = None  # nf4: elements per absmax block along the flattened weight
    config: Any = field(default=None, compare=False, hash=False)  # the user's config, for messages
    # gguf: parameter name -> ggml type id of every weight held packed (set at prepare, from the file)
    packed: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    # whether the config named its skip list itself (transformers adds its default skips only when it did not)
    skip_given: bool = False
    backend: str = ""  # "torchao" or "bitsandbytes" (each library's rule for which linears differs slightly)
    # set by `for_model`: whose rule chose the linears ("diffusers" or "transformers": the library that would load
    # the model) and the names of the linears it quantizes, chosen on the model as built, before any split
    rule: str = ""
    targets: frozenset[str] | None = field(default=None, compare=False, hash=False)
    # the weights come quantized from the checkpoint ("bitsandbytes 4-bit", "torchao": `quant/saved.py`) and are
    # read as stored, sliced; None: quantized on read from full-precision weights
    saved: str | None = None

    def describe(self) -> str:
        """What every rank must agree on."""
        extra = f", {self.float8_dtype}" if self.float8_dtype is not None else ""
        chosen = "" if self.targets is None else f", {self.rule} rule: {len(self.targets)} linears"
        origin = f", saved {self.saved}" if self.saved else ""
        return f"{self.name}{extra}, skip={list(self.skip)}, compute={self.compute_dtype}{chosen}{origin}"

    def for_model(self, model: nn.Module, transformers_model: bool = False) -> "QuantScheme":
        """The scheme for `model`: which of its linears are quantized, by the rule of the library that would load
        it (`transformers_model`: a transformers class, such as a text encoder; otherwise diffusers), as that
        library's quantizer decides."""
        if transformers_model:
            return self._transformers_rule(model)
        keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
        skip = _skip_list(list(self.skip), keep)
        # diffusers' rule: the weight of every nn.Linear, unless a skip key names the module (`key.` inside the
        # parameter's name, or the name itself)
        targets = frozenset(
            name for name, module in model.named_modules() if isinstance(module, nn.Linear)
            and not any(f"{key}." in f"{name}.weight" or key == f"{name}.weight" for key in skip))
        return replace(self, skip=skip, rule="diffusers", targets=targets)

    def _transformers_rule(self, model: nn.Module) -> "QuantScheme":
        """transformers' rule, with its own functions: the skips are the config's list (or, without one, its
        default: tied weights, the last parameter's module, the output embeddings such as `lm_head`) plus the
        model's keep-in-fp32 modules, matched as transformers matches them; torchao quantizes every nn.Linear's
        weight, bitsandbytes every module whose type is exactly nn.Linear."""
        from transformers.quantizers.base import HfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module

        keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
        skip = HfQuantizer.get_modules_to_not_convert(model, list(self.skip) if self.skip_given else None, keep)
        if self.backend == "bitsandbytes":
            targets = frozenset(name for name, module in model.named_modules()
                                if type(module) is nn.Linear and should_convert_module(name, skip))
        else:
            targets = frozenset(name for name, module in model.named_modules()
                                if isinstance(module, nn.Linear) and should_convert_module(f"{name}.weight", skip))
        return replace(self, skip=tuple(sorted(skip)), rule="transformers", targets=targets)

    def quantizes(self, module_name: str, module: nn.Module) -> bool:
        """Whether the linear `module_name` is one the rule chose (`for_model`); a split linear keeps its name."""
        if self.targets is None:
            raise RuntimeError("QuantScheme.quantizes needs the scheme for a model (QuantScheme.for_model)")
        return isinstance(module, nn.Linear) and module_name in self.targets


def scheme_from_config(config: Any) -> QuantScheme:
    """The scheme a quantization config asks for: diffusers' own config classes, or transformers' (what a
    PipelineQuantizationConfig resolves for a text encoder); anything paradiff does not slice exactly is refused,
    naming the config and what is supported. Needs no model (`for_model` chooses the linears)."""
    from diffusers import BitsAndBytesConfig, GGUFQuantizationConfig, TorchAoConfig

    torchao_configs, bnb_configs = [TorchAoConfig], [BitsAndBytesConfig]
    try:
        import transformers
    except ImportError:  # without transformers there are no text encoders to quantize either
        transformers = None
    if transformers is not None:
        torchao_configs.append(transformers.TorchAoConfig)
        bnb_configs.append(transformers.BitsAndBytesConfig)
    if isinstance(config, tuple(torchao_configs)):
        return _torchao_scheme(config)
    if isinstance(config, tuple(bnb_configs)):
        return _bnb_scheme(config)
    if isinstance(config, GGUFQuantizationConfig):
        raise ParallelConfigError(
            "quantization_config=GGUFQuantizationConfig(...) is not supported for a folder of safetensors weights: "
            "GGUF weights come pre-quantized in a single file; load that file, "
            "paradiff.from_pretrained(ModelClass, 'model.gguf', config=<diffusers model folder or Hub id>, "
            "quantization_config=GGUFQuantizationConfig(compute_dtype=...)), or in a pipeline "
            "paradiff.load_pipeline(folder, transformer_file='model.gguf', quantization_config="
            "PipelineQuantizationConfig(quant_mapping={'transformer': GGUFQuantizationConfig(compute_dtype=...)}))."
        )
    raise ParallelConfigError(
        f"quantization_config={type(config).__name__}(...) is not supported by paradiff loading; supported: "
        f"{SUPPORTED} (diffusers' or transformers' config classes); GGUF single files with GGUFQuantizationConfig. "
        "A folder saved quantized (bitsandbytes 4-bit, per-row torchao int8 / float8) loads without a "
        "quantization_config."
    )


def gguf_scheme(config: Any) -> QuantScheme:
    """The scheme of a GGUFQuantizationConfig: weights stay in the file's types and are dequantized at each
    forward to `compute_dtype`, as diffusers' GGUF linear does; `modules_to_not_convert` are dequantized at read."""
    from diffusers import GGUFQuantizationConfig

    if not isinstance(config, GGUFQuantizationConfig):
        given = "no quantization_config" if config is None else f"quantization_config={type(config).__name__}(...)"
        raise ParallelConfigError(
            f"a .gguf file holds pre-quantized weights, and {given} cannot load it; pass "
            "quantization_config=GGUFQuantizationConfig(compute_dtype=...) (diffusers' from_single_file needs it too)."
        )
    return QuantScheme("gguf", skip=_skip_list(config.modules_to_not_convert, []), compute_dtype=config.compute_dtype,
                       config=config)


def _skip_list(value: Any, keep: list[str]) -> tuple[str, ...]:
    listed = [] if value is None else [value] if isinstance(value, str) else list(value)
    return tuple(dict.fromkeys(key for key in [*listed, *keep] if key))


def _torchao_scheme(config: Any) -> QuantScheme:
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, PerRow

    quant_type = config.quant_type
    granularity = getattr(quant_type, "granularity", None)
    if isinstance(quant_type, (Int8WeightOnlyConfig, Float8WeightOnlyConfig)) and not isinstance(granularity, PerRow):
        raise ParallelConfigError(
            f"TorchAoConfig({type(quant_type).__name__}(granularity={granularity!r})): paradiff splits per-row "
            "(per-output-channel) scales only; use the default granularity=PerRow()."
        )
    if getattr(config, "include_input_output_embeddings", False):
        raise ParallelConfigError(
            "TorchAoConfig(include_input_output_embeddings=True) is not supported by paradiff loading (token tables "
            "split by vocabulary are not quantized on read yet); leave it False: the embeddings stay in the load "
            "dtype, the linears are quantized."
        )
    skip = _skip_list(config.modules_to_not_convert, [])
    given = config.modules_to_not_convert is not None
    if isinstance(quant_type, Int8WeightOnlyConfig):
        return QuantScheme("int8", skip=skip, config=config, skip_given=given, backend="torchao")
    if isinstance(quant_type, Float8WeightOnlyConfig):
        return QuantScheme("fp8", skip=skip, float8_dtype=quant_type.weight_dtype, config=config, skip_given=given,
                           backend="torchao")
    raise ParallelConfigError(
        f"TorchAoConfig({type(quant_type).__name__}(...)) is not supported by paradiff loading; supported: {SUPPORTED}. "
        "(torchao's dynamic-activation and int4 configs also need CUDA kernels.)"
    )


def _bnb_scheme(config: Any) -> QuantScheme:
    if not config.load_in_4bit:
        raise ParallelConfigError(
            "BitsAndBytesConfig(load_in_8bit=True) is not supported by paradiff loading (LLM.int8 outlier columns "
            f"are chosen over whole rows); supported: {SUPPORTED}."
        )
    if config.bnb_4bit_quant_type != "nf4":
        raise ParallelConfigError(
            f"BitsAndBytesConfig(bnb_4bit_quant_type={config.bnb_4bit_quant_type!r}) is not supported by paradiff "
            "loading; use bnb_4bit_quant_type='nf4'."
        )
    if config.bnb_4bit_use_double_quant:
        raise ParallelConfigError(
            "BitsAndBytesConfig(bnb_4bit_use_double_quant=True) is not supported by paradiff loading (the absmax "
            "of every 256 blocks is quantized again, across slices); leave bnb_4bit_use_double_quant=False."
        )
    storage = getattr(config, "bnb_4bit_quant_storage", "uint8")
    if str(storage).replace("torch.", "") != "uint8":
        raise ParallelConfigError(
            f"BitsAndBytesConfig(bnb_4bit_quant_storage={storage!r}) is not supported by paradiff loading; leave "
            "the default uint8."
        )
    compute = getattr(config, "bnb_4bit_compute_dtype", None)
    return QuantScheme("nf4", skip=_skip_list(config.llm_int8_skip_modules, []), compute_dtype=compute,
                       block=NF4_BLOCK, config=config, skip_given=config.llm_int8_skip_modules is not None,
                       backend="bitsandbytes")


def check_block_boundaries(scheme: QuantScheme, model: nn.Module, resolved: Any) -> None:
    """Refuse, by layer name, a blockwise scheme on a planned linear whose slice on this rank would cut a block.

    bitsandbytes blocks the row-major flattened weight, 64 elements at a time. A slice of rows keeps whole blocks when
    it starts and ends on a block boundary; a slice of columns needs every row to be whole blocks (in_features a
    multiple of 64) and its column ranges to start and end on a block boundary. Checked on the plan's own pieces, so
    uneven splits are covered as they are.
    """
    for name, (spec, rows, cols, cut) in block_cut_layers(scheme, model, resolved).items():
        what = "rows" if spec.dim == 0 else "columns"
        raise BlockSplitError(
            f"{name}: nf4 quantizes blocks of {scheme.block} elements of the flattened weight {(rows, cols)}, but "
            f"this rank's {what} {list(cut)} (start, length) would cut a block, so its shard could not equal the "
            f"slice of the single-device quantized weight. Choose a tp_degree whose slices of {name} are multiples "
            f"of {scheme.block} elements, or leave the layer unquantized (BitsAndBytesConfig(llm_int8_skip_modules="
            "[...]); paradiff generate: --quantize-skip)."
        )


def block_cut_layers(scheme: QuantScheme, model: nn.Module, resolved: Any) -> dict[str, tuple[Any, int, int, list]]:
    """The planned linears a blockwise `scheme` quantizes whose slice on this rank would cut a block: name -> (its
    slice spec, rows, columns, the cutting pieces), in the plan's order; empty for a scheme without blocks."""
    if scheme.block is None or resolved is None:
        return {}
    cuts = {}
    for name, linear in resolved.linears.items():
        if linear.embedding or linear.style.target != "linear" or "weight" not in linear.specs:
            continue
        module = model.get_submodule(name) if name else model
        spec = linear.specs["weight"]
        if spec is None or not scheme.quantizes(name, module):
            continue
        rows, cols = linear.full_shapes["weight"][:2]
        cut = block_cuts(spec, rows, cols, scheme.block)
        if cut:
            cuts[name] = (spec, rows, cols, cut)
    return cuts


def block_cuts(spec: Any, rows: int, cols: int, block: int) -> list[tuple[int, int]]:
    """The pieces (start, length) of a slice `spec` of a (rows, cols) weight that would cut one of its blocks of
    `block` elements of the row-major flattened weight."""
    if spec.dim == 0:
        return [(start, length) for start, length in spec.pieces
                if (start * cols) % block or ((start + length) * cols) % block and start + length != rows]
    return [(start, length) for start, length in spec.pieces if cols % block or start % block or length % block]


def model_config_for(scheme: str, compute_dtype: torch.dtype | None = None, skip: tuple[str, ...] = ()) -> Any:
    """The diffusers config a user would write for `scheme` ("int8", "fp8", "nf4"): what `--quantize` passes.
    `skip` (--quantize-skip): modules left unquantized (`llm_int8_skip_modules` / `modules_to_not_convert`)."""
    from diffusers import BitsAndBytesConfig, TorchAoConfig

    skipped = list(skip) if skip else None
    if scheme == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                                  llm_int8_skip_modules=skipped)
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme == "int8":
        return TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=skipped)
    if scheme == "fp8":
        return TorchAoConfig(Float8WeightOnlyConfig(), modules_to_not_convert=skipped)
    raise ParallelConfigError(f"unknown quantization scheme {scheme!r}; use one of {list(SCHEMES)}.")


def pipeline_quantization_config(scheme: str, compute_dtype: torch.dtype | None = None,
                                 components: tuple[str, ...] = ("transformer",), skip: tuple[str, ...] = ()) -> Any:
    """A PipelineQuantizationConfig quantizing `components` with `scheme` (the others stay as they are): diffusers'
    config for a diffusers model, transformers' for a text encoder (`text_encoder*`), as diffusers resolves them.
    `skip`: modules of the diffusers models (the transformers) left unquantized."""
    from diffusers import PipelineQuantizationConfig

    mapping = {name: text_encoder_config_for(scheme, compute_dtype) if name.startswith("text_encoder")
               else model_config_for(scheme, compute_dtype, skip) for name in components}
    return PipelineQuantizationConfig(quant_mapping=mapping)


def text_encoder_config_for(scheme: str, compute_dtype: torch.dtype | None = None) -> Any:
    """transformers' config for `scheme` ("int8", "fp8", "nf4"), which a text encoder's own loader takes."""
    import transformers

    if scheme == "nf4":
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=compute_dtype)
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme == "int8":
        return transformers.TorchAoConfig(Int8WeightOnlyConfig())
    if scheme == "fp8":
        return transformers.TorchAoConfig(Float8WeightOnlyConfig())
    raise ParallelConfigError(f"unknown quantization scheme {scheme!r}; use one of {list(SCHEMES)}.")
