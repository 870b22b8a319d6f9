"""What loads a pipeline for `paradiff generate` and `paradiff serve`: one typed `LoadSpec`, checked when it is built
(each bad value named, with what would be valid, before any weight is read), and `load`, which loads it on this
rank's mesh. The command line builds it from its flags in one place (`cli/worker.py: load_spec_of`); the server
takes it as it is, with no parser."""

from __future__ import annotations

import dataclasses
import difflib
import time
from pathlib import Path
from typing import Any

import torch

from paradiff.config import ParallelConfig
from paradiff.errors import AdapterError, LoadSpecError

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_SCHEMES = ("int8", "fp8", "nf4")
CACHE_USAGE = "use fbc:THRESHOLD (a number > 0, e.g. fbc:0.08) or taylorseer:INTERVAL[:WARMUP] (integers >= 1)"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """One LoRA adapter of the transformer: a file, folder or Hub id, at `scale`, loaded as `adapter_name`."""

    path: str
    scale: float = 1.0
    adapter_name: str = "lora0"

    def as_dict(self) -> dict:
        return {"adapter_name": self.adapter_name, "path": self.path, "scale": self.scale}


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """Everything a rank reads to load a pipeline on its mesh.

    `model`: a pipeline folder or a Hub id. `pipeline`: a diffusers pipeline class to run on it instead of its own.
    `parallel`: the mesh's degrees (`data_degree` replicas of the mesh). `plan` / `cp_plan`: None (built-in), "auto"
    or a plan file. `quantize`: a scheme applied on read to the transformers (and with `quantize_text_encoders` to
    the text encoders), `quantize_skip` modules left out; `gguf`: {transformer component: GGUF file}. `loras`: the
    adapters, mixed at their scales; with `adapter_slots` each in a slot of its own (a different adapter per sample).
    `cache`: a step-cache spec (`fbc:0.08`, `taylorseer:3:2`)."""

    model: str
    dtype: str = "float32"
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    pipeline: str | None = None
    plan: str | None = None
    cp_plan: str | None = None
    parallel_vae: bool = True
    stages: bool = False
    shard_text_encoders: bool = True
    quantize: str | None = None
    quantize_skip: tuple[str, ...] = ()
    quantize_text_encoders: bool = False
    gguf: tuple[tuple[str, str], ...] = ()
    loras: tuple[LoraSpec, ...] = ()
    lora_weight_name: str | None = None
    adapter_slots: bool = False
    compile: bool = False
    compile_backend: str | None = None
    cache: str | None = None
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, Path):
            object.__setattr__(self, "model", str(self.model))
        for name in ("quantize_skip", "gguf", "loras"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.model, str) or not self.model:
            raise LoadSpecError("model", self.model, "expected a pipeline folder or a Hub id")
        if self.dtype not in DTYPES:
            raise LoadSpecError("dtype", self.dtype, f"expected one of {', '.join(DTYPES)}")
        if not isinstance(self.parallel, ParallelConfig):
            raise LoadSpecError("parallel", self.parallel, "expected a paradiff.ParallelConfig")
        if self.pipeline is not None:
            pipeline_class(self.pipeline)
        for field in ("plan", "cp_plan"):
            value = getattr(self, field)
            if value not in (None, "auto") and not Path(value).is_file():
                raise LoadSpecError(field, value, "expected 'auto' or a plan file (FILE.py); no such file")
        self._check_quantization()
        names = [lora.adapter_name for lora in self.loras]
        if len(set(names)) != len(names):
            raise LoadSpecError("loras", names, "each adapter needs a name of its own")
        if self.lora_weight_name is not None and not self.loras:
            raise LoadSpecError("lora_weight_name", self.lora_weight_name,
                                "it picks a file of a LoRA folder or repo: give loras too")
        if self.adapter_slots and not self.loras:
            raise LoadSpecError("adapter_slots", True, "slots hold adapters: give loras too")
        if self.compile_backend is not None and not self.compile:
            raise LoadSpecError("compile_backend", self.compile_backend, "nothing is compiled: set compile too")
        if self.cache is not None:
            cache_config(self.cache)
        if self.attention_backend is not None:
            self._check_attention_backend()
        if self.parallel.fsdp_degree > 1:
            from paradiff.fsdp.refusals import fsdp_refusal

            refusal = fsdp_refusal(self.parallel.fsdp_degree, self.parallel.tp_degree,
                                   self.quantize or ("gguf" if self.gguf else None), stages=self.stages)
            if refusal is not None:
                raise LoadSpecError("parallel", f"fsdp_degree={self.parallel.fsdp_degree}", refusal)

    def _check_attention_backend(self) -> None:
        """A backend this machine runs and, with ring, one returning the log-sum-exp (each rank checks its device
        and dtype in `load`, before it reads a weight)."""
        from paradiff.attention.backends import check_choice
        from paradiff.errors import ParallelConfigError

        try:
            check_choice(self.attention_backend, self.parallel.ring_degree)
        except ParallelConfigError as exc:
            raise LoadSpecError("attention_backend", self.attention_backend, str(exc)) from None

    def _check_quantization(self) -> None:
        if self.quantize is not None and self.quantize not in QUANTIZE_SCHEMES:
            raise LoadSpecError("quantize", self.quantize, f"expected one of {', '.join(QUANTIZE_SCHEMES)}")
        if self.quantize is None:
            for field, value in (("quantize_skip", self.quantize_skip),
                                 ("quantize_text_encoders", self.quantize_text_encoders)):
                if value:
                    raise LoadSpecError(field, value, "it applies to quantization: give quantize too")
        seen = set()
        for component, path in self.gguf:
            if not component.startswith("transformer") or component in seen:
                raise LoadSpecError("gguf", f"{component}={path}",
                                    "expected one file per transformer component (transformer, transformer_2 ...)")
            if not str(path).lower().endswith(".gguf"):
                raise LoadSpecError("gguf", f"{component}={path}", "expected a .gguf file")
            seen.add(component)
        if self.gguf and self.quantize is not None:
            raise LoadSpecError("quantize", self.quantize,
                                "a GGUF file's weights are already quantized (in the file's own types); drop one")

    def one_replica(self) -> LoadSpec:
        """This spec for one replica of the mesh (what each data-parallel replica loads)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, data_degree=1))

    def pipeline_class_name(self) -> str | None:
        """The class that runs: `pipeline`, else the folder's index's; None when unknown (a Hub id not yet
        fetched)."""
        if self.pipeline is not None:
            return self.pipeline
        from paradiff.io.folders import INDEX_FILES, read_pipeline_index

        if not any((Path(self.model) / name).is_file() for name in INDEX_FILES):
            return None
        return str(read_pipeline_index(self.model).class_name)


def pipeline_class(name: str) -> type:
    """The diffusers pipeline class called `name` (a DiffusionPipeline or a ModularPipeline), or a LoadSpecError
    listing the closest names."""
    import diffusers
    from diffusers import DiffusionPipeline, ModularPipeline

    candidate = getattr(diffusers, name, None)
    if isinstance(candidate, type) and issubclass(candidate, (DiffusionPipeline, ModularPipeline)):
        return candidate
    known = [entry for entry in dir(diffusers)
             if entry.endswith("Pipeline") and entry not in ("DiffusionPipeline", "ModularPipeline")]
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(close)}" if close else ""
    raise LoadSpecError("pipeline", name, f"diffusers {diffusers.__version__} has no pipeline class of that name{hint}")


def cache_config(spec: str, model: Any = None) -> Any:
    """The diffusers cache config of a step-cache SPEC, or a LoadSpecError saying what a valid one looks like.

    TaylorSeer predicts whole block outputs of `model` (its repeated blocks; diffusers' default patterns pick
    attention modules inside the blocks, which a compiled block cannot hold and which miss some families' names)."""
    kind, _, rest = spec.partition(":")
    values = rest.split(":") if rest else []
    try:
        if kind == "fbc" and len(values) == 1 and float(values[0]) > 0:
            from diffusers import FirstBlockCacheConfig

            return FirstBlockCacheConfig(threshold=float(values[0]))
        if kind == "taylorseer" and 1 <= len(values) <= 2 and all(int(v) >= 1 for v in values):
            from diffusers import TaylorSeerCacheConfig

            interval = int(values[0])
            warmup = int(values[1]) if len(values) == 2 else 3
            identifiers = None
            if model is not None:
                from paradiff.runtime.repeated_blocks import block_identifiers

                identifiers = block_identifiers(model)
            return TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=warmup,
                                         taylor_factors_dtype=torch.float32, cache_identifiers=identifiers)
    except ValueError:
        pass
    raise LoadSpecError("cache", spec, CACHE_USAGE)


@dataclasses.dataclass
class Loaded:
    pipeline: Any
    loras: list[dict]
    transformers: dict[str, torch.nn.Module]  # the transformer(s): Wan 2.2 A14B has `transformer_2` too
    monitors: dict[str, Any]  # with a cache: each transformer's cache monitor
    load_s: float
    spec: LoadSpec | None = None  # what was loaded


def load(spec: LoadSpec, device: torch.device) -> Loaded:
    """The pipeline of `spec` on this rank's mesh (the default process group): loaded (quantized, split), its
    adapters loaded and mixed, its transformers compiled and cached."""
    import paradiff

    dtype = getattr(torch, spec.dtype)
    if spec.attention_backend is not None:  # this rank's device and dtype, before any weight is read
        from paradiff.attention.backends import check_supported

        check_supported(spec.attention_backend, device=device, dtype=dtype, needs_lse=spec.parallel.ring_degree > 1)
    start = time.perf_counter()
    extra = {} if not spec.quantize else {"quantization_config": quantization_config(spec)}
    files = dict(spec.gguf)
    if files:  # the transformers' weights from GGUF files, held packed, computing in `dtype`
        from diffusers import GGUFQuantizationConfig, PipelineQuantizationConfig

        extra = {"transformer_file": files, "quantization_config": PipelineQuantizationConfig(
            quant_mapping={name: GGUFQuantizationConfig(compute_dtype=dtype) for name in files})}
    pipeline = paradiff.load_pipeline(spec.model, pipeline_cls=pipeline_class(spec.pipeline) if spec.pipeline else None,
                                      parallel_config=spec.parallel, torch_dtype=dtype, device=device,
                                      **extra, plan=plan_argument(spec.plan, "tensor"),
                                      cp_plan=plan_argument(spec.cp_plan, "context"),
                                      parallel_vae=None if spec.parallel_vae else False,
                                      stages=spec.stages, shard_text_encoders=None if spec.shard_text_encoders else False)
    loras = [lora.as_dict() for lora in spec.loras]
    if spec.adapter_slots:
        load_slot_adapters(pipeline, loras)  # an adapter column: each prompt its own adapter, in mixed batches
    else:
        load_adapters(pipeline, loras, spec.lora_weight_name)
    load_s = time.perf_counter() - start
    transformers = {name: module for name, module in pipeline.components.items()
                    if name.startswith("transformer") and isinstance(module, torch.nn.Module)}
    if spec.attention_backend is not None:
        for module in transformers.values():
            paradiff.set_attention_backend(module, spec.attention_backend)
    if spec.compile:
        for module in transformers.values():
            paradiff.compile(module, backend=spec.compile_backend or "inductor")
    monitors = ({name: paradiff.enable_cache(module, cache_config(spec.cache, module))
                 for name, module in transformers.items()} if spec.cache else {})
    return Loaded(pipeline, loras, transformers, monitors, load_s, spec)


def plan_argument(value: str | None, kind: str) -> Any:
    """A plan field: None (built-in), "auto", or a plan file, loaded."""
    if value in (None, "auto"):
        return value
    from paradiff.plan_tools.check_plan import load_plan_file

    return load_plan_file(value, kind)


def quantization_config(spec: LoadSpec) -> Any:
    """The spec's quantization as diffusers' PipelineQuantizationConfig: what the ranks load with, and what
    --compare's single-process reference loads with."""
    from paradiff.quant.schemes import pipeline_quantization_config

    return pipeline_quantization_config(spec.quantize, getattr(torch, spec.dtype), quantized_components(spec),
                                        spec.quantize_skip)


def quantized_components(spec: LoadSpec) -> tuple[str, ...]:
    """Every transformer of the pipeline (Wan 2.2 A14B has two); with `quantize_text_encoders`, its text encoders
    too."""
    import json

    from paradiff.io.folders import resolve_folder

    index = json.loads((resolve_folder(spec.model, pipeline=True) / "model_index.json").read_text())
    prefixes = ("transformer", "text_encoder") if spec.quantize_text_encoders else ("transformer",)
    return tuple(sorted(name for name, entry in index.items()
                        if name.startswith(prefixes) and isinstance(entry, list) and None not in entry))


def load_adapters(pipeline: Any, loras: list[dict], weight_name: str | None) -> None:
    """Each adapter by diffusers' load_lora_weights (paradiff's on a split transformer), mixed by scale."""
    if not loras:
        return
    if not hasattr(pipeline, "load_lora_weights"):
        raise AdapterError(f"--lora: {type(pipeline).__name__} has no LoRA loader in diffusers (no load_lora_weights);"
                           " adapters work on pipelines whose class has one (FLUX, Qwen-Image, Wan, SD3 ...).")
    for lora in loras:
        pipeline.load_lora_weights(lora["path"], adapter_name=lora["adapter_name"], weight_name=weight_name)
    pipeline.set_adapters([lora["adapter_name"] for lora in loras], [lora["scale"] for lora in loras])


def load_slot_adapters(pipeline: Any, loras: list[dict]) -> None:
    """Each adapter in its own slot of the transformer (api/lora_slots.py), at its scale; the slots as wide as the
    widest adapter."""
    from paradiff.api.lora_slots import enable_adapter_slots, load_slot_adapter, slot_adapter_source, source_max_rank

    sources = [slot_adapter_source(pipeline, lora["path"]) for lora in loras]
    enable_adapter_slots(pipeline.transformer, max_loras=len(loras),
                         max_lora_rank=max(source_max_rank(source) for source, _ in sources))
    for lora, (source, extra) in zip(loras, sources):
        load_slot_adapter(pipeline.transformer, lora["adapter_name"], source, scale=lora["scale"], **extra)
