"""Whole diffusers pipelines on the paradiff mesh: parallel transformer, local components, same latents everywhere."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paradiff.runtime.patches import swap_class
from paradiff.runtime.steps import StepHooks
from paradiff.config import as_parallel_config
from paradiff.errors import CheckpointError, ParallelConfigError
from paradiff.api.model import check_dtype
from paradiff.api.quantization import pipeline_quantization
from paradiff.io.folders import has_modular_index_only, read_pipeline_index, resolve_folder
from paradiff.distributed.mesh import REPLICA_DIMS, default_device
from paradiff.plans.pipelines import cfg_refusal, cp_refusal, modular_cfg_refusal, not_dit_refusal, pipeline_spec
from paradiff.api.pipeline_components import _components_paradiff_loads, _load_components, transformer_names
from paradiff.api.modular import (check_guided_call, fill_modular, guider_names, is_modular_class, modular_skeleton,
                                  pretrained_names)
from paradiff.api.parallelisms import REGISTRY, apply_to_pipelines
from paradiff.distributed.parallelism import Registry
from paradiff.api.pipeline_wiring import _check_parallel_vae, _install_latent_check, _parallelize_vae, _stage_runner
from paradiff.runtime.state import PipelineState, get_state

logger = logging.getLogger(__name__)


def _scheduler_of(pipeline) -> Any:
    """The pipeline's scheduler component (the one a call steps), or None."""
    return (getattr(pipeline, "components", None) or {}).get("scheduler")


class ParallelPipelineMixin:
    """Mixed into the loaded pipeline's class: seeds every rank alike and checks CFG pairing."""

    _paradiff_pipeline: PipelineState

    def __call__(self, *args: Any, seed: int | None = None, **kwargs: Any):
        state = self._paradiff_pipeline
        if kwargs.get("generator") is None and (not state.modular or "generator" in self._blocks.input_names):
            # every rank must draw identical initial latents; a CPU generator is identical on every device
            kwargs["generator"] = torch.Generator("cpu").manual_seed(0 if seed is None else seed)
        splitters = state.cfgs
        if splitters and state.guided:
            check_guided_call(self, splitters[0], state.base_name)
        elif splitters:
            rule = pipeline_spec(state.base_name).cfg
            refusal = rule.refusal(kwargs)
            if refusal is not None:
                raise ParallelConfigError(f"CFG parallelism on {state.base_name}: {refusal}; use cfg_degree=1.")
            if not rule.runs_cfg(kwargs, getattr(self, "config", None)):
                raise ParallelConfigError(
                    f"cfg_degree={get_state(self.transformer).mesh.size('cfg')} needs a call that runs "
                    f"classifier-free guidance; {state.base_name} with these arguments does not (give {rule.how()}), "
                    "or use cfg_degree=1."
                )
        for splitter in splitters:
            splitter.reset()
        state.check_latents = True
        with state.stages.call() if state.stages else contextlib.nullcontext():
            with state.steps.call(_scheduler_of(self)) if state.steps else contextlib.nullcontext():
                output = super().__call__(*args, **kwargs)
        for splitter in splitters:
            splitter.finish()
        return output

    def enable_group_offload(self, onload_device: Any, **kwargs: Any) -> None:
        """diffusers' group offloading, after paradiff split the components: each rank offloads its own shards,
        to its own folder under `offload_to_disk_path` (docs/quantization.md, 'Offloading on shards')."""
        from paradiff.runtime.offload import pipeline_group_offload

        pipeline_group_offload(self, onload_device, kwargs)

    def enable_model_cpu_offload(self, gpu_id: int | None = None, device: Any = None) -> None:
        """diffusers' model CPU offload with each rank's own device as the onload device."""
        from paradiff.runtime.offload import pipeline_model_cpu_offload

        pipeline_model_cpu_offload(self, super().enable_model_cpu_offload.__func__, gpu_id, device)

    # FLUX's load_lora_weights widens a transformer Linear (or zero-pads the adapter) whose shape differs from the
    # adapter's (Control LoRAs): on a tensor-parallel transformer every split Linear would look "too small".
    # paradiff checks the adapter against the full shapes itself (api/lora.py) and refuses a mismatch.
    @classmethod
    def _maybe_expand_transformer_param_shape_or_error_(cls, transformer, *args: Any, **kwargs: Any) -> bool:
        state = get_state(transformer)
        if state is not None and state.tp_plan is not None:
            return False
        return super()._maybe_expand_transformer_param_shape_or_error_(transformer, *args, **kwargs)

    @classmethod
    def _maybe_expand_lora_state_dict(cls, transformer, lora_state_dict: dict) -> dict:
        state = get_state(transformer)
        if state is not None and state.tp_plan is not None:
            return lora_state_dict
        return super()._maybe_expand_lora_state_dict(transformer, lora_state_dict)

    def stage_report(self) -> list[dict]:
        """Per stage on this rank (text_encoders, transformer, vae), summed over the calls since the last
        `reset_stage_report()`: load_s, run_s, peak_bytes (CUDA max allocated, or peak RssAnon on CPU),
        parameter_bytes held (all components), entries (times the stage started)."""
        return self._paradiff_pipeline.stages.report()

    def reset_stage_report(self) -> None:
        self._paradiff_pipeline.stages.reset()

    def quantization_report(self) -> dict[str, dict]:
        """Per component this rank ran (transformer, text encoders, VAE ...), as held while its stage ran in the
        last call: `scheme` (the quantization paradiff applied on read, or None), `quantized_linears`,
        `quantized_bytes` (data and scales) and `full_precision_bytes` (every other parameter)."""
        return self._paradiff_pipeline.stages.quantization()

    @property
    def is_output_rank(self) -> bool:
        """True on the one rank of each data-parallel replica that should save its outputs."""
        state = get_state(self.transformer)
        if state is None:
            return not dist.is_initialized() or dist.get_rank() == 0
        mesh = state.mesh
        return all(mesh.local_rank(dim) == 0 for dim in REPLICA_DIMS)  # fsdp ranks compute the same outputs too


class LoraPipelineMixin:
    """Mixed in (after ParallelPipelineMixin) into pipelines whose diffusers class has a LoRA loader."""

    # peft builds a text encoder's LoRA layers from its Linears' shapes, which are shards when paradiff split the
    # encoder: each rank hands diffusers its slices of the encoder's factors (api/lora.py)
    @classmethod
    def load_lora_into_text_encoder(cls, state_dict, network_alphas, text_encoder, prefix=None, *args: Any,
                                    **kwargs: Any):
        from paradiff.api.lora import adopt_layers, load_text_encoder_adapter

        original = super().load_lora_into_text_encoder
        state = get_state(text_encoder) if text_encoder is not None else None
        if state is None or state.tp_plan is None:
            # a whole encoder: diffusers' own load; its layers get paradiff's exact fuse / unfuse all the same
            result = original(state_dict, network_alphas, text_encoder, prefix, *args, **kwargs)
            if text_encoder is not None:
                adopt_layers(text_encoder)
            return result

        prefix = prefix or "text_encoder"
        return load_text_encoder_adapter(
            text_encoder, lambda local: original(local, network_alphas, text_encoder, prefix, *args, **kwargs),
            state_dict, network_alphas, prefix, kwargs)

    def load_lora_weights(self, *args: Any, **kwargs: Any):
        """diffusers' `load_lora_weights`; if any component's part fails (on any rank: the ranks agree on each
        part), the adapters the call added to the other components are deleted again, on every rank."""
        from paradiff.api.lora import delete_added_adapters, loaded_adapters

        before = loaded_adapters(self)
        try:
            return super().load_lora_weights(*args, **kwargs)
        except BaseException:
            if not kwargs.get("hotswap"):
                delete_added_adapters(self, before)
            raise

    def unload_lora_weights(self, *args: Any, **kwargs: Any):
        from paradiff.api.lora import return_hooks

        for component in self.components.values():
            if isinstance(component, nn.Module):
                return_hooks(component)
        return super().unload_lora_weights(*args, **kwargs)


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
    transformer_file: str | os.PathLike | dict[str, str | os.PathLike] | None = None,
    registry: Registry = REGISTRY,
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
    `transformer_file`: the transformer's weights from a GGUF file instead of the folder (a local `.gguf` path, or
    {component: path} for pipelines with several transformers, e.g. Wan 2.2's "transformer_2"), built from the
    folder's transformer config.json and read sliced like `paradiff.from_pretrained` of the file; pass
    `quantization_config=PipelineQuantizationConfig(quant_mapping={"transformer": GGUFQuantizationConfig(...)})`.
    `registry`: the parallelisms to apply, in its apply order, at every phase: while loading, on the pipeline, and
    per denoising step (`api/parallelisms.py: REGISTRY`, or a registry of one's own built with
    `REGISTRY.adding(...)`).
    """
    dtype = check_dtype(torch_dtype)
    device = torch.device(device) if device is not None else default_device()
    _check_pipeline_options(stages, shard_text_encoders, text_encoder_plans, kwargs)
    parallel = None
    if parallel_config is not None:
        if not dist.is_initialized():
            from paradiff.distributed.mesh import require_distributed

            require_distributed()
        parallel = as_parallel_config(parallel_config, dist.get_world_size())
    folder = resolve_folder(path, pipeline=True)
    modular = is_modular_class(pipeline_cls) or has_modular_index_only(folder)
    pipeline_index = read_pipeline_index(folder, modular)
    if "transformer" not in pipeline_index.components:
        index_file = "modular_model_index.json" if modular and not (folder / "model_index.json").is_file() \
            else "model_index.json"
        raise CheckpointError(f"{folder}/{index_file} has no 'transformer' component.")
    skeleton, names = None, None
    if modular:  # the blocks and component specs, no weight: which components the pipeline uses, its guiders
        skeleton, kwargs = modular_skeleton(pipeline_cls, folder, kwargs)
        names = pretrained_names(skeleton)
        base_name = type(skeleton).__name__
    else:
        base_name = pipeline_cls.__name__ if pipeline_cls is not None else str(pipeline_index.class_name)
    if parallel is not None and not_dit_refusal(base_name):
        raise ParallelConfigError(f"{not_dit_refusal(base_name)}.")
    guided = modular or pipeline_spec(base_name).guider  # guidance through a guider component
    if parallel is not None and parallel.cfg_degree > 1:
        _check_cfg_classified(base_name, parallel.cfg_degree,
                              modular=modular, has_guider=modular and bool(guider_names(skeleton)))
    if parallel is not None and parallel.ring_degree * parallel.ulysses_degree > 1 and cp_refusal(base_name):
        raise ParallelConfigError(f"context parallelism: {cp_refusal(base_name)}.")
    index = pipeline_index.entries()
    if parallel_vae:
        _check_parallel_vae(parallel, index, folder)
    single_files = _single_files(transformer_file, index)
    own = _components_paradiff_loads(pipeline_index, parallel, stages, shard_text_encoders, text_encoder_plans or {},
                                     names)
    schemes, diffusers_quantizes = pipeline_quantization(
        kwargs.get("quantization_config"), {item.name: (item.model_cls, item.kind) for item in own}, single_files)
    if not diffusers_quantizes:
        kwargs.pop("quantization_config", None)  # every component it names is paradiff's, quantized on read
    elif modular:
        raise ParallelConfigError(
            "quantization_config asks diffusers to quantize components of a Modular Diffusers pipeline, whose "
            "load_components takes no PipelineQuantizationConfig; list only the components paradiff loads "
            f"({', '.join(item.name for item in own)}) in components_to_quantize, or quantize the others yourself "
            "and pass them with pipe.update_components(...).")
    loaded = _load_components(own, parallel, dtype, device, stages, plan, cp_plan, schemes, single_files, registry)
    if modular:
        pipeline = skeleton
        fill_modular(pipeline, {name: item.model for name, item in loaded.items()}, dtype, kwargs)
    else:
        pipeline = _standard_pipeline(pipeline_cls, pipeline_index, folder, loaded, dtype, kwargs)
    if kwargs.get("device_map") is None:
        for name, component in pipeline.components.items():
            if isinstance(component, nn.Module) and name not in loaded:
                component.to(device)
    base = type(pipeline)
    swap_class(pipeline, parallel_pipeline_class(base), by="pipeline")
    pipeline._paradiff_pipeline = PipelineState(base_name=base.__name__, modular=modular, guided=guided)
    transformers = [getattr(pipeline, name) for name in transformer_names(index)
                    if isinstance(getattr(pipeline, name, None), nn.Module)]
    if parallel is not None:
        apply_to_pipelines(pipeline, transformers, get_state(transformers[0]).mesh, registry)  # CFG
        _install_step_hooks(pipeline, transformers)
        _install_latent_check(pipeline)
        if parallel_vae is not False and parallel.world_size // parallel.data_degree > 1:
            _parallelize_vae(pipeline, required=bool(parallel_vae))
    pipeline._paradiff_pipeline.stages = _stage_runner(pipeline, loaded, device, stages)
    return pipeline


def _install_step_hooks(pipeline, transformers: list[nn.Module]) -> None:
    """Each transformer's parallelisms with per-step hooks, run once per denoising step of every call
    (`runtime/steps.py`); none has any: nothing is put on."""
    hooks = tuple((parallelism, model) for model in transformers
                  for parallelism in get_state(model).parallelisms if parallelism.has_step_hooks)
    if hooks:
        pipeline._paradiff_pipeline.steps = StepHooks(hooks)
        pipeline._paradiff_pipeline.steps.install(transformers)


def _standard_pipeline(pipeline_cls: type | None, pipeline_index, folder, loaded: dict, dtype, kwargs: dict):
    """The diffusers pipeline of a model_index.json folder, built around the components paradiff loaded."""
    import diffusers
    from diffusers import DiffusionPipeline

    target_cls = pipeline_cls or getattr(diffusers, str(pipeline_index.class_name), DiffusionPipeline)
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
    return pipeline


def _single_files(transformer_file: Any, index: dict) -> dict[str, Path]:
    """load_pipeline's `transformer_file` as {transformer component: local .gguf path}, checked before any read."""
    from paradiff.api.single_file import is_gguf_path

    if transformer_file is None:
        return {}
    files = transformer_file if isinstance(transformer_file, dict) else {"transformer": transformer_file}
    names = transformer_names(index)
    out = {}
    for name, path in files.items():
        if name not in names:
            raise ParallelConfigError(
                f"transformer_file names {name!r}, which is not a transformer of this pipeline; its transformers are "
                f"{names}.")
        if not is_gguf_path(path):
            raise ParallelConfigError(
                f"transformer_file={str(path)!r} for {name!r}: paradiff reads a transformer from a GGUF file "
                "(*.gguf); a diffusers folder's own weights need no transformer_file.")
        if not Path(path).is_file():
            raise CheckpointError(
                f"transformer_file={str(path)!r} for {name!r} is not a local file; paradiff reads a GGUF file from "
                "disk (download it first, e.g. huggingface_hub.hf_hub_download(repo, filename)).")
        out[name] = Path(path)
    return out


def parallel_pipeline_class(base: type) -> type:
    """The class a loaded pipeline becomes: paradiff's mixins over diffusers' class; the LoRA one only where
    diffusers' class has a LoRA loader (the CLI tells the others apart by `load_lora_weights`)."""
    mixins = (ParallelPipelineMixin, LoraPipelineMixin) if hasattr(base, "load_lora_weights") else (ParallelPipelineMixin,)
    return type(f"Parallel{base.__name__}", (*mixins, base), {})


def _check_cfg_classified(pipeline_name: str, degree: int, modular: bool = False, has_guider: bool = False) -> None:
    refusal = modular_cfg_refusal(pipeline_name, has_guider) if modular else cfg_refusal(pipeline_name)
    if refusal is not None:
        raise ParallelConfigError(f"cfg_degree={degree}: {refusal}; use cfg_degree=1.")
    rule = pipeline_spec(pipeline_name).cfg
    if rule is not None and rule.branches != degree:
        branches = rule.branches
        raise ParallelConfigError(
            f"cfg_degree={degree}: {pipeline_name} runs {branches} guidance branches per step, one per cfg rank; use "
            f"cfg_degree={branches} (or cfg_degree=1).")


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
