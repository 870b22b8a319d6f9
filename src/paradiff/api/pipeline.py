"""Whole diffusers pipelines on the paradiff mesh: parallel transformer, local components, same latents everywhere."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paradiff.distributed.agreement import agree, tensor_checksum
from paradiff.runtime.cfg import install_cfg_parallel
from paradiff.config import as_parallel_config
from paradiff.errors import CheckpointError, ParallelConfigError, PlanError, UnsupportedModelError
from paradiff.api.model import check_dtype
from paradiff.api.quantization import check_pipeline_quantization
from paradiff.io.folders import resolve_folder
from paradiff.distributed.mesh import default_device, rank_coordinates
from paradiff.plans.pipelines import CFG_RULES
from paradiff.runtime.stages import StagedComponent, StageRunner, stage_of
from paradiff.runtime.state import PipelineState, get_state
from paradiff.runtime.wrappers import install_wrapper

logger = logging.getLogger(__name__)

class ParallelPipelineMixin:
    """Mixed into the loaded pipeline's class: seeds every rank alike and checks CFG pairing."""

    _paradiff_pipeline: PipelineState

    def __call__(self, *args: Any, seed: int | None = None, **kwargs: Any):
        if kwargs.get("generator") is None:
            # every rank must draw identical initial latents; a CPU generator is identical on every device
            kwargs["generator"] = torch.Generator("cpu").manual_seed(0 if seed is None else seed)
        state = self._paradiff_pipeline
        splitters = state.cfgs
        if splitters:
            rule = CFG_RULES.get(state.base_name)
            if rule is None or not rule.runs_cfg(kwargs):
                raise ParallelConfigError(
                    f"cfg_degree=2 needs a call that runs classifier-free guidance; {state.base_name} "
                    "with these arguments does not (give a negative_prompt and true_cfg_scale > 1 for Qwen-Image / "
                    "FLUX.1, guidance_scale > 1 for Wan), or use cfg_degree=1."
                )
            for splitter in splitters:
                splitter.reset()
        state.check_latents = True
        with state.stages.call() if state.stages else contextlib.nullcontext():
            output = super().__call__(*args, **kwargs)
        for splitter in splitters:
            splitter.finish()
        return output

    def stage_report(self) -> list[dict]:
        """Per stage on this rank (text_encoders, transformer, vae), summed over the calls since the last
        `reset_stage_report()`: load_s, run_s, peak_bytes (CUDA max allocated, or peak RssAnon on CPU),
        parameter_bytes held (all components), entries (times the stage started)."""
        return self._paradiff_pipeline.stages.report()

    def reset_stage_report(self) -> None:
        self._paradiff_pipeline.stages.reset()

    @property
    def is_output_rank(self) -> bool:
        """True on the one rank of each data-parallel replica that should save its outputs."""
        state = get_state(self.transformer)
        if state is None:
            return not dist.is_initialized() or dist.get_rank() == 0
        mesh = state.mesh
        return all(mesh.local_rank(dim) == 0 for dim in ("cfg", "ring", "ulysses", "tp"))


def load_pipeline(
    path: str | os.PathLike,
    *,
    pipeline_cls: type | None = None,
    parallel_config: Any = None,
    torch_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    plan: Any = None,
    cp_plan: Any = None,
    stages: bool = False,
    shard_text_encoders: bool | None = None,
    text_encoder_plans: dict[str, Any] | None = None,
    parallel_vae: bool | None = None,
    **kwargs: Any,
):
    """A diffusers pipeline whose transformer is parallelised (shard-on-read for TP) and whose text encoders are
    split over the same mesh. `plan` / `cp_plan`: the transformer's plans (None: built-in; "auto": derived from its
    structure).

    Text encoders are split over the mesh's TP ranks (with no TP: over the context-parallel ranks, which encode the
    same prompts; with neither: kept whole), shard-on-read. `shard_text_encoders`: None (default) splits those with a
    plan and keeps an encoder class without one whole on each rank, with one warning; True requires every encoder to
    be split (an encoder without a plan is an error); False keeps them all whole. `text_encoder_plans`
    gives plans for encoder classes paradiff has none for ({"text_encoder": {...}}). With `stages=True` only the
    current stage's components hold weights during a call (text encoders, then the transformer, then the VAE;
    each read again, shard-on-read, when its stage starts); with `stages=False` (default) everything stays resident.
    Components paradiff does not split are placed on this rank's own device one by one (never `pipeline.to()`,
    which would move the transformer's shards); `device_map=` / `max_memory=` are passed through to diffusers for
    those components instead (not with `stages=True`, where paradiff places and frees every component itself).
    `parallel_vae`: split the VAE's decode and encode by rows across the ranks of each data-parallel replica
    (`paradiff.parallelize_vae`; same images). None (default): on when a replica has more than one rank and the VAE
    is covered, otherwise the VAE decodes whole on each rank; True: required (an uncovered VAE is an error); False:
    off.
    """
    from diffusers import DiffusionPipeline
    import diffusers

    dtype = check_dtype(torch_dtype)
    device = torch.device(device) if device is not None else default_device()
    _check_pipeline_options(stages, shard_text_encoders, text_encoder_plans, kwargs)
    parallel = None
    if parallel_config is not None:
        if not dist.is_initialized():
            from paradiff.distributed.mesh import require_distributed

            require_distributed()
        parallel = as_parallel_config(parallel_config, dist.get_world_size())
        if parallel.cfg_degree > 1 and pipeline_cls is not None and pipeline_cls.__name__ not in CFG_RULES:
            raise ParallelConfigError(
                f"cfg_degree=2 is supported for {sorted(CFG_RULES)}; {pipeline_cls.__name__} runs no true CFG."
            )
    folder = resolve_folder(path, pipeline=True)
    index = json.loads((folder / "model_index.json").read_text())
    if "transformer" not in index:
        raise CheckpointError(f"{folder}/model_index.json has no 'transformer' component.")
    pipeline_name = index.get("_class_name")
    if parallel is not None and parallel.cfg_degree > 1 and pipeline_cls is None and pipeline_name not in CFG_RULES:
        raise ParallelConfigError(
            f"cfg_degree=2 is supported for {sorted(CFG_RULES)}; {pipeline_name} runs no true CFG."
        )
    if parallel_vae:
        _check_parallel_vae(parallel, index, folder)
    own = _components_paradiff_loads(folder, index, parallel, stages, shard_text_encoders, text_encoder_plans or {})
    check_pipeline_quantization(kwargs.get("quantization_config"), {item.name: item.model_cls for item in own})
    loaded = _load_components(own, folder, parallel, dtype, device, stages, plan, cp_plan)
    target_cls = pipeline_cls or getattr(diffusers, str(pipeline_name), DiffusionPipeline)
    expected_modules, _ = DiffusionPipeline._get_signature_keys(target_cls)
    # Pipelines whose transformer is an optional argument (Wan) would load it again from disk, whole, and drop the
    # one passed in: load without it, then register the parallel one.
    given = {name: loaded[name].model if name in expected_modules else None for name in loaded}
    pipeline = target_cls.from_pretrained(folder, **given, dtype=dtype, **kwargs)
    for name, component in loaded.items():
        if getattr(pipeline, name, None) is not component.model:
            pipeline.register_modules(**{name: component.model})
        if getattr(pipeline, name) is not component.model:
            raise RuntimeError(f"{target_cls.__name__} replaced the paradiff-loaded {name} while loading.")
    if kwargs.get("device_map") is None:
        for name, component in pipeline.components.items():
            if isinstance(component, nn.Module) and name not in loaded:
                component.to(device)
    base = type(pipeline)
    pipeline.__class__ = type(f"Parallel{base.__name__}", (ParallelPipelineMixin, base), {})
    pipeline._paradiff_pipeline = PipelineState(base_name=base.__name__)
    if parallel is not None and parallel.cfg_degree > 1:
        pipeline._paradiff_pipeline.cfgs = tuple(
            install_cfg_parallel(model, get_state(model).mesh.group("cfg"))
            for model in (getattr(pipeline, name) for name in transformer_names(index))
        )
    if parallel is not None:
        _install_latent_check(pipeline)
        if parallel_vae is not False and parallel.world_size // parallel.data_degree > 1:
            _parallelize_vae(pipeline, required=bool(parallel_vae))
    pipeline._paradiff_pipeline.stages = _stage_runner(pipeline, loaded, device, stages)
    return pipeline


def _check_pipeline_options(stages: Any, shard_text_encoders: Any, text_encoder_plans: Any, kwargs: dict) -> None:
    if not isinstance(stages, bool):
        raise ParallelConfigError(f"stages must be True or False, got {stages!r}.")
    if shard_text_encoders is not None and not isinstance(shard_text_encoders, bool):
        raise ParallelConfigError(f"shard_text_encoders must be True, False or None, got {shard_text_encoders!r}.")
    if text_encoder_plans is not None and not (
        isinstance(text_encoder_plans, dict) and all(isinstance(k, str) for k in text_encoder_plans)
    ):
        raise ParallelConfigError(
            "text_encoder_plans must map component names to plans, e.g. {'text_encoder': {'layers.*.q': 'colwise'}}, "
            f"got {text_encoder_plans!r}."
        )
    if stages and (kwargs.get("device_map") is not None or kwargs.get("max_memory") is not None):
        raise ParallelConfigError(
            "stages=True places every component on this rank's device and frees it after its stage, which is what "
            f"device_map={kwargs.get('device_map')!r} / max_memory would otherwise arrange; pass one or the other "
            "(device_map and max_memory apply with stages=False, to the components paradiff does not split)."
        )


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
    kind: str  # "transformer", "text_encoder" (split) or "whole"
    plan: Any = None


@dataclass
class _Loaded:
    model: nn.Module
    source: Any  # loading.WeightSource
    load_s: float


def _components_paradiff_loads(folder, index, parallel, stages, shard_text_encoders, plans) -> list[_Own]:
    import importlib

    from paradiff.plans import family_of

    # Wan 2.2 A14B has a second transformer for the low-noise steps (`transformer_2`; null in model_index.json
    # for the single-transformer checkpoints): every transformer is split alike.
    own = [_Own(name, _component_class(index, name), "transformer") for name in transformer_names(index)]
    split_encoders = shard_text_encoders is not False and bool(text_encoder_dims(parallel))
    unknown = sorted(set(plans) - {n for n in index if n.startswith("text_encoder")})
    if unknown:
        raise ParallelConfigError(
            f"text_encoder_plans names {unknown}, which are not text encoders of this pipeline; its text encoders are "
            f"{sorted(n for n in index if n.startswith('text_encoder'))}."
        )
    for name, entry in sorted(index.items()):
        if name.startswith("transformer") or not _is_component(entry):
            continue
        model_cls = getattr(importlib.import_module(entry[0]), entry[1], None)
        if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            continue
        known = name in plans or family_of(model_cls) is not None
        if name.startswith("text_encoder") and split_encoders:
            if known or shard_text_encoders:  # True: split, or say why it cannot be
                own.append(_Own(name, model_cls, "text_encoder", plans.get(name)))
                continue
            # the class decides it, so every rank keeps it whole alike, before any read or collective
            logger.warning("%s (%s) has no built-in tensor-parallel plan: it stays whole on each rank (pass "
                           "text_encoder_plans={%r: ...} to split it)", name, model_cls.__name__, name)
        if stages or (name.startswith("text_encoder") and shard_text_encoders is not False and known):
            # paradiff reads the encoders it knows itself even when nothing splits them (single process, CFG- or
            # data-only meshes): into process memory, like every weight of a split run, never a mapped file
            own.append(_Own(name, model_cls, "whole"))
    return own


def transformer_names(index: dict) -> list[str]:
    """The pipeline's transformer components present in model_index.json: "transformer", then e.g. "transformer_2"."""
    return sorted(name for name, entry in index.items() if name.startswith("transformer") and _is_component(entry))


def _is_component(entry: Any) -> bool:
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(e, str) for e in entry)


def _component_class(index: dict, name: str) -> type:
    import importlib

    library, class_name = index[name]
    return getattr(importlib.import_module(library), class_name)


def _load_components(own: list[_Own], folder: Path, parallel, dtype, device, stages: bool, plan: Any = None,
                     cp_plan: Any = None) -> dict[str, _Loaded]:
    """Prepare every component (meta models, plans, checkpoint headers) on every rank, agree, build the mesh once,
    then read: everything now (all-resident), or only persistent buffers (staged; parameters come at their stage)."""
    from paradiff.api.load_sequence import Component, Prepared, run_load_sequence
    from paradiff.api.model import prepare_model

    encoder_dims = text_encoder_dims(parallel)
    transformers = {item.name for item in own if item.kind == "transformer"}

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
        return Prepared(components, parallel, device, facts)

    def _prepare_component(item: _Own, components: dict[str, Component]) -> None:
        tp_shard, context, item_plan, item_cp_plan, one = None, False, item.plan, None, None
        if item.kind == "transformer" and parallel is not None:
            if parallel.tp_degree > 1:
                tp_shard = _encoder_shard(parallel, ("tp",))
            context = parallel.context_parallel_config is not None
            item_plan, item_cp_plan = plan, cp_plan
        elif item.kind == "text_encoder":
            tp_shard = _encoder_shard(parallel, encoder_dims)
            builtin = item_plan is None
            item_plan = item_plan if item_plan is not None else _text_encoder_plan(item, folder)
            try:
                one = prepare_model(item.model_cls, folder / item.name, dtype=dtype, device=device,
                                    tp_shard=tp_shard, plan=item_plan)
            except PlanError as exc:
                if not builtin:  # the caller's own plan: their error to see
                    raise
                # The built-in plan cannot split this encoder that many ways (e.g. 2 heads over 4 ranks): the
                # config decides it, so every rank falls back alike, before any read or collective.
                logger.warning("%s (%s) is not split across the %d ranks (it stays whole on each rank): %s",
                               item.name, item.model_cls.__name__, tp_shard[1], exc)
                tp_shard, item_plan = None, None
        if one is None:
            one = prepare_model(item.model_cls, folder / item.name, dtype=dtype, device=device,
                                tp_shard=tp_shard, plan=item_plan, context=context, cp_plan=item_cp_plan)
        components[item.name] = Component(
            one.model, one.facts, one.resolved, one.cp_resolved, one.checkpoint, one.source,
            tp_dims=("tp",) if item.name in transformers else (encoder_dims or ("tp",)),
            attach=item.name in transformers or one.resolved is not None,
        )

    prepared, _mesh = run_load_sequence("paradiff.load_pipeline", prepare, distributed=parallel is not None,
                                        read="buffers" if stages else "all")
    return {name: _Loaded(c.model, c.source, c.read_s) for name, c in prepared.components.items()}


def _text_encoder_plan(item: _Own, folder: Path):
    from paradiff.errors import PlanError
    from paradiff.io.model_classes import load_config
    from paradiff.plans import builtin_plan, text_encoder_families

    try:
        return builtin_plan(item.model_cls, load_config(item.model_cls, folder / item.name), "tensor")
    except PlanError:
        known = sorted(name for family in text_encoder_families() for name in family.model_classes)
        raise PlanError(
            f"paradiff has no tensor-parallel plan for text encoder {item.name!r} ({item.model_cls.__name__}); it "
            f"has plans for {', '.join(known)}. Pass one with load_pipeline(..., text_encoder_plans="
            f"{{{item.name!r}: {{'<module glob>': 'colwise', ...}}}}) (see docs/tensor-parallel.md, 'Writing a plan'), or keep the "
            "text encoders whole on every rank with shard_text_encoders=False."
        ) from None


def _stage_runner(pipeline, loaded: dict[str, _Loaded], device: torch.device, staged: bool) -> StageRunner:
    from paradiff.api.model import free_parameters

    components = []
    for name, module in pipeline.components.items():
        stage = stage_of(name)
        if not isinstance(module, nn.Module) or stage is None:
            continue
        load = free = None
        if staged and name in loaded:
            load, free = _reader(module, loaded[name].source), (lambda m=module: free_parameters(m, device))
        components.append(StagedComponent(name, module, stage, load, free))
    modules = [m for m in pipeline.components.values() if isinstance(m, nn.Module)]
    state = get_state(pipeline.transformer)
    replica = None
    if state is not None:
        replica = state.mesh.replica_ranks()
    elif dist.is_initialized():
        replica = [dist.get_rank()]
    runner = StageRunner(components, modules, device, staged, replica)
    for component in components:
        if component.free is not None:
            component.free()
    if not staged:
        for name, item in loaded.items():
            if stage_of(name) is not None:
                runner.preload_time(stage_of(name), item.load_s)
    runner.install()
    return runner


def _reader(module: nn.Module, source) -> Callable[[], None]:
    def load() -> None:
        checkpoint = source.open()
        try:
            source.read(module, checkpoint, buffers=False)
        finally:
            checkpoint.close()

    return load


def _check_parallel_vae(parallel, index: dict, folder: Path) -> None:
    """parallel_vae=True: refuse, before any weight is read, what cannot split the VAE."""
    from paradiff.api.vae import supported_vaes

    if parallel is None or parallel.world_size // parallel.data_degree < 2:
        raise ParallelConfigError(
            "parallel_vae=True splits the VAE over the ranks of a replica; give a parallel_config whose replicas have "
            "more than one rank (tp, ring, ulysses or cfg > 1)."
        )
    vae_class = (index.get("vae") or [None, None])[1]
    if vae_class not in supported_vaes():
        raise UnsupportedModelError(
            f"parallel_vae=True, but {folder}'s VAE is {vae_class}; paradiff splits {supported_vaes()}. "
            "Use parallel_vae=None to decode it whole on each rank."
        )


def _parallelize_vae(pipeline, required: bool) -> None:
    from paradiff.api.vae import parallelize_vae

    vae = getattr(pipeline, "vae", None)
    if vae is None:
        return
    try:
        parallelize_vae(vae, get_state(pipeline.transformer).mesh)
    except UnsupportedModelError as exc:
        if required:
            raise
        # every rank holds the same VAE, so every rank falls back alike
        logger.warning("The VAE is not split across ranks (it decodes whole on each rank): %s", exc)


def _install_latent_check(pipeline) -> None:
    """At the first transformer call of each generation, before any collective of it, ranks compare a checksum of
    their initial latents: different seeds or inputs on one rank stop every rank with a clear error."""

    mesh = get_state(pipeline.transformer).mesh
    replica_ranks = mesh.replica_ranks()

    state = pipeline._paradiff_pipeline

    def check(args: tuple, kwargs: dict) -> None:
        if not state.check_latents:
            return
        state.check_latents = False
        latents = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_tensor(latents):
            agree("generation start", {"initial latents": tensor_checksum(latents)}, ranks=replica_ranks)

    install_wrapper(pipeline.transformer, "latent_check", check)


def data_coordinates(pipeline_or_model: Any = None) -> tuple[int, int]:
    """(index, size) of this rank along the data dimension (world rank/size when nothing is parallelised)."""
    model = getattr(pipeline_or_model, "transformer", pipeline_or_model)
    state = get_state(model) if model is not None else None
    if state is not None:
        return state.mesh.local_rank("data"), state.mesh.size("data")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def split_between_processes(items: Sequence[Any], pipeline_or_model: Any = None,
                            apply_padding: bool = False) -> Iterator[Sequence[Any]]:
    """Yield this data-parallel replica's contiguous share of `items` (same contract as accelerate's).

    Replicas get sizes differing by at most one; with `apply_padding` every share is padded with the last item to
    the longest share, so collective steps stay in lockstep.
    """
    index, size = data_coordinates(pipeline_or_model)
    base, extra = divmod(len(items), size)
    start = index * base + min(index, extra)
    share = items[start : start + base + (1 if index < extra else 0)]
    if apply_padding and len(items) and len(share) < base + (1 if extra else 0):
        share = list(share) + [items[-1]] * (base + (1 if extra else 0) - len(share))
    yield share
