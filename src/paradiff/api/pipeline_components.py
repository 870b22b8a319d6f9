"""Which components of a pipeline folder paradiff loads itself (its transformers, the text encoders it splits or
reads), how each is split, and loading them all through the one load sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from paradiff.distributed.mesh import rank_coordinates
from paradiff.errors import BlockSplitError, ParallelConfigError, PlanError
from paradiff.runtime.progress import is_main_rank

logger = logging.getLogger(__name__)


def text_encoder_dims(parallel) -> tuple[str, ...]:
    """The mesh dimensions text encoders are split over: the TP ranks; with no TP, the context-parallel ranks (every
    one of them encodes the same prompts); with neither, none. Always inside one data-parallel replica and one CFG
    branch, so a replica's prompt embeddings are computed, and stay, on its own ranks."""
    if parallel is None:
        return ()
    if parallel.tp_degree > 1:
        return ("tp",)
    if parallel.ring_degree * parallel.ulysses_degree > 1:
        return ("ring", "ulysses")
    return ()



def _encoder_shard(parallel, dims: tuple[str, ...]) -> tuple[int, int]:
    """(rank in the encoder group, its size), before the mesh exists; a multi-dimension group numbers its ranks
    row-major over its dimensions, as the mesh's flat groups do."""
    coordinates = rank_coordinates(parallel)
    return coordinates.index(*dims), coordinates.size(*dims)



@dataclass
class _Own:
    """A component paradiff loads itself: its class, and the TP plan when it is split."""

    name: str
    model_cls: type
    kind: str  # "transformer", "controlnet" (split like a transformer, built-in plans), "text_encoder" (split) or "whole"
    folder: Path  # where its config and weights are
    plan: Any = None



@dataclass
class _Loaded:
    model: nn.Module
    source: Any  # loading.WeightSource
    load_s: float
    component: Any = None  # its api.load_sequence.Component (quantization scheme, TP group)



def _components_paradiff_loads(pipeline_index, parallel, stages, shard_text_encoders, plans,
                               names: set[str] | None = None) -> list[_Own]:
    """`pipeline_index`: io.folders.PipelineIndex; `names`: the components the pipeline uses (None: all of the
    index; a modular pipeline run as one workflow uses fewer)."""
    from paradiff.plans import family_of

    index = {name: entry for name, entry in pipeline_index.entries().items() if names is None or name in names
             or not _is_component(entry)}

    def place(name: str) -> Path:
        return component_folder(pipeline_index, name)

    # Wan 2.2 A14B has a second transformer for the low-noise steps (`transformer_2`; null in model_index.json
    # for the single-transformer checkpoints): every transformer is split alike.
    own = [_Own(name, _component_class(index, name), "transformer", place(name)) for name in transformer_names(index)]
    split_encoders = shard_text_encoders is not False and bool(text_encoder_dims(parallel))
    unknown = sorted(set(plans) - {n for n in index if is_encoder(n)})
    if unknown:
        raise ParallelConfigError(
            f"text_encoder_plans names {unknown}, which are not text encoders (or image encoders) of this pipeline; "
            f"its encoders are {sorted(n for n in index if is_encoder(n))}."
        )
    for name, entry in sorted(index.items()):
        if name.startswith("transformer") or not _is_component(entry):
            continue
        model_cls = getattr(library_module(entry[0]), entry[1], None)
        if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            continue
        known = name in plans or family_of(model_cls) is not None
        if is_controlnet(name) and parallel is not None and family_of(model_cls) is not None:
            # its residuals are added to the transformer's tokens: split on the transformer's mesh, by its own plans
            own.append(_Own(name, model_cls, "controlnet", place(name)))
            continue
        if is_encoder(name) and split_encoders:
            if known or shard_text_encoders:  # True: split, or say why it cannot be
                own.append(_Own(name, model_cls, "text_encoder", place(name), plans.get(name)))
                continue
            # the class decides it, so every rank keeps it whole alike, before any read or collective; one
            # console line, from the first rank
            if is_main_rank():
                logger.warning("%s (%s) has no built-in tensor-parallel plan: it stays whole on each rank (pass "
                               "text_encoder_plans={%r: ...} to split it)", name, model_cls.__name__, name)
        if stages or (is_encoder(name) and shard_text_encoders is not False and known):
            # paradiff reads the encoders it knows itself even when nothing splits them (single process, CFG- or
            # data-only meshes): into process memory, like every weight of a split run, never a mapped file
            own.append(_Own(name, model_cls, "whole", place(name)))
    return own



# Components split over the encoder group like the text encoders: the text encoders, and the image encoders
# image-conditioned pipelines load (Wan 2.1 I2V's CLIP vision tower, SD3.5's / HunyuanVideo I2V's SigLIP); they run
# in the text-encoder stage.
ENCODER_PREFIXES = ("text_encoder", "image_encoder")


def is_controlnet(name: str) -> bool:
    """A ControlNet component (`controlnet` in FLUX.1, SD3, Qwen-Image, HunyuanDiT ... pipelines)."""
    return name.startswith("controlnet")


def is_encoder(name: str) -> bool:
    return name.startswith(ENCODER_PREFIXES)


def _encoder_kind(name: str) -> str:
    return "image encoder" if name.startswith("image_encoder") else "text encoder"



def component_folder(pipeline_index, name: str) -> Path:
    """The local folder of component `name` of a pipeline (io.folders.PipelineIndex): in the pipeline's folder, or,
    for a modular pipeline whose index points elsewhere, in another local folder or a Hub repository (fetched)."""
    from paradiff.io.folders import resolve_folder

    repository, subfolder = pipeline_index.location(name)
    return resolve_folder(repository, subfolder)


def transformer_names(index: dict) -> list[str]:
    """The pipeline's transformer components present in model_index.json: "transformer", then e.g. "transformer_2",
    then e.g. "unconditional_transformer" (Ideogram 4's unconditional branch)."""
    names = [name for name, entry in index.items() if _is_component(entry)
             and (name.startswith("transformer") or name.endswith("_transformer"))]
    return sorted(names, key=lambda name: (not name.startswith("transformer"), name))



def _is_component(entry: Any) -> bool:
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(e, str) for e in entry)



def _component_class(index: dict, name: str) -> type:
    library, class_name = index[name]
    return getattr(library_module(library), class_name)


def library_module(library: str):
    """The module a model_index.json entry names: a library ("diffusers", "transformers"), or a diffusers pipeline
    folder's own module ("stable_audio" for StableAudioProjectionModel), as diffusers itself resolves it."""
    import importlib

    try:
        return importlib.import_module(library)
    except ModuleNotFoundError:
        return importlib.import_module(f"diffusers.pipelines.{library}")



def _load_components(own: list[_Own], parallel, dtype, device, stages: bool, plan: Any = None,
                     cp_plan: Any = None, schemes: dict | None = None,
                     single_files: dict[str, Path] | None = None, registry: Any = None) -> dict[str, _Loaded]:
    """Prepare every component (meta models, plans, checkpoint headers) on every rank, agree, build the mesh once,
    then read: everything now (all-resident), or only persistent buffers (staged; parameters come at their stage).
    `schemes`: component name -> quant.schemes.QuantScheme, quantized on each rank's slice as it is read.
    `single_files`: transformer name -> the GGUF file its weights are read from (with its "gguf" scheme).
    `registry`: the parallelisms every phase of the sequence walks (None: paradiff's, `api/parallelisms.py`)."""
    schemes = schemes or {}
    single_files = single_files or {}
    from paradiff.api.load_sequence import Component, Prepared, run_load_sequence
    from paradiff.api.model import prepare_model
    from paradiff.api.parallelisms import REGISTRY

    encoder_dims = text_encoder_dims(parallel)
    transformers = {item.name for item in own if item.kind in ("transformer", "controlnet")}

    def prepare() -> Prepared:
        components: dict[str, Component] = {}
        try:
            for item in own:
                _prepare_component(item, components)
        except BaseException:
            for component in components.values():
                component.checkpoint.close()
            raise
        facts = {"parallel degrees": parallel.degrees(), "stages": stages} if parallel is not None else {}
        return Prepared(components, parallel, device, facts, registry=registry or REGISTRY)

    def _prepare_component(item: _Own, components: dict[str, Component]) -> None:
        tp_shard, context, item_plan, item_cp_plan, one = None, False, item.plan, None, None
        if item.kind in ("transformer", "controlnet") and parallel is not None:
            if parallel.tp_degree > 1:
                tp_shard = _encoder_shard(parallel, ("tp",))
            context = parallel.context_parallel_config is not None
            if item.kind == "transformer":  # the caller's plans are the transformer's; a ControlNet takes its own
                item_plan, item_cp_plan = plan, cp_plan
        elif item.kind == "text_encoder":
            tp_shard = _encoder_shard(parallel, encoder_dims)
            builtin = item_plan is None
            item_plan = item_plan if item_plan is not None else _text_encoder_plan(item)
            try:
                one = prepare_model(item.model_cls, item.folder, dtype=dtype, device=device,
                                    tp_shard=tp_shard, plan=item_plan, quantization=schemes.get(item.name))
            except PlanError as exc:
                # the caller's own plan: their error to see; a quantized slice that would cut a block: refused as
                # for the transformer (keeping the encoder whole instead would drop the split they asked for)
                if not builtin or isinstance(exc, BlockSplitError):
                    raise
                # The built-in plan cannot split this encoder that many ways (e.g. 2 heads over 4 ranks): the
                # config decides it, so every rank falls back alike, before any read or collective.
                logger.warning("%s (%s) is not split across the %d ranks (it stays whole on each rank): %s",
                               item.name, item.model_cls.__name__, tp_shard[1], exc)
                tp_shard, item_plan = None, None
        if one is None and item.name in single_files:
            from paradiff.api.single_file import prepare_gguf_model

            one = prepare_gguf_model(item.model_cls, single_files[item.name], config=str(item.folder),
                                     subfolder=None, hub_kwargs={}, dtype=dtype, device=device, tp_shard=tp_shard, plan=item_plan,
                                     context=context, cp_plan=item_cp_plan, scheme=schemes[item.name])
        if one is None:
            one = prepare_model(item.model_cls, item.folder, dtype=dtype, device=device,
                                tp_shard=tp_shard, plan=item_plan, context=context, cp_plan=item_cp_plan,
                                quantization=schemes.get(item.name))
        blocks = None
        if item.name in transformers and parallel is not None and parallel.fsdp_degree > 1:
            from paradiff.api.fsdp import check_fsdp

            try:
                blocks = check_fsdp(one.model, parallel, quantization=one.quantization,
                                    saved=bool(getattr(one.source, "saved", None)),
                                    single_file=item.name in single_files, stages=stages)
            except BaseException:
                one.checkpoint.close()
                raise
        elif (item.kind == "text_encoder" or (item.kind == "whole" and is_encoder(item.name))) \
                and parallel is not None and parallel.fsdp_degree > 1:
            from paradiff.api.fsdp import encoder_fsdp_blocks

            blocks = encoder_fsdp_blocks(item.name, one.model, parallel,
                                         encoder_dims if tp_shard and tp_shard[1] > 1 else (),
                                         quantized=one.quantization is not None or item.name in single_files)
        components[item.name] = Component(
            one.model, one.facts, one.resolved, one.cp_resolved, one.checkpoint, one.source,
            tp_dims=("tp",) if item.name in transformers else (encoder_dims or ("tp",)),
            attach=item.name in transformers or one.resolved is not None, quantization=one.quantization,
            blocks=blocks, prefetch_across_lists=item.name in transformers,
        )

    prepared, _mesh = run_load_sequence("paradiff.load_pipeline", prepare, distributed=parallel is not None,
                                        read="buffers" if stages else "all")
    return {name: _Loaded(c.model, c.source, c.read_s, c) for name, c in prepared.components.items()}



def _text_encoder_plan(item: _Own):
    from paradiff.errors import PlanError
    from paradiff.io.model_classes import load_config
    from paradiff.plans import builtin_plan, model_config, text_encoder_families

    try:
        config = model_config(item.model_cls, load_config(item.model_cls, item.folder))
        return builtin_plan(item.model_cls, config, "tensor")
    except PlanError:
        known = sorted(name for family in text_encoder_families() for name in family.model_classes)
        raise PlanError(
            f"paradiff has no tensor-parallel plan for {_encoder_kind(item.name)} {item.name!r} "
            f"({item.model_cls.__name__}); it "
            f"has plans for {', '.join(known)}. Pass one with load_pipeline(..., text_encoder_plans="
            f"{{{item.name!r}: {{'<module glob>': 'colwise', ...}}}}) (see docs/tensor-parallel.md, 'Writing a plan'), or keep the "
            "text encoders whole on every rank with shard_text_encoders=False."
        ) from None
