"""What a loaded pipeline is wired with on the mesh: the stage runner, the split VAE and the check of the initial
latents."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from paradiff.api.pipeline_components import _Loaded
from paradiff.distributed.agreement import agree, tensor_checksum
from paradiff.errors import ParallelConfigError, UnsupportedModelError
from paradiff.runtime.stages import StagedComponent, StageRunner, stage_of
from paradiff.runtime.state import get_state
from paradiff.runtime.wrappers import install_wrapper

logger = logging.getLogger(__name__)


def _stage_runner(pipeline, loaded: dict[str, _Loaded], device: torch.device, staged: bool) -> StageRunner:
    from paradiff.io.weights import free_parameters

    components = []
    for name, module in pipeline.components.items():
        stage = stage_of(name)
        if not isinstance(module, nn.Module) or stage is None:
            continue
        load = free = settle = None
        component = loaded[name].component if name in loaded else None
        scheme = component.quantization if component is not None else None
        if staged and name in loaded:
            # a checkpoint saved quantized is read as stored, each weight held as read (as at a resident load); the
            # others are quantized again once the replica agreed the read (rowwise shards then take a collective)
            saved = scheme if scheme is not None and scheme.saved else None
            load, free = _reader(module, loaded[name].source, saved), (lambda m=module: free_parameters(m, device))
            if scheme is not None and saved is None:
                settle = component.quantize
        components.append(StagedComponent(name, module, stage, load, free, settle,
                                          scheme=None if scheme is None else scheme.name))
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



def _reader(module: nn.Module, source, saved=None) -> Callable[[], None]:
    """The stage's read of `module`; `saved`: the scheme of a checkpoint saved quantized, whose weights are held as
    read and put in place after it (quant.apply.ReadQuantizer)."""
    def load() -> None:
        from paradiff.tensor_parallel.lora import weights_read
        from paradiff.quant.apply import ReadQuantizer

        quantizer = ReadQuantizer(saved) if saved is not None else None
        checkpoint = source.open()
        try:
            source.read(module, checkpoint, buffers=False, **({} if quantizer is None else {"quantizer": quantizer}))
        finally:
            checkpoint.close()
        if quantizer is not None:
            quantizer.install(module)
        weights_read(module)  # adapters fused before the stage freed the weights are fused again

    return load



def _check_parallel_vae(parallel, index: dict, folder: Path) -> None:
    """parallel_vae=True: refuse, before any weight is read, what cannot split the VAE."""
    from paradiff.api.vae import supported_vaes
    from paradiff.plans.vae import vae_refusal

    if parallel is None or parallel.world_size // parallel.data_degree < 2:
        raise ParallelConfigError(
            "parallel_vae=True splits the VAE over the ranks of a replica; give a parallel_config whose replicas have "
            "more than one rank (tp, ring, ulysses or cfg > 1)."
        )
    vae_class = (index.get("vae") or [None, None])[1]
    if vae_class not in supported_vaes():
        raise UnsupportedModelError(
            f"parallel_vae=True, but {folder}'s VAE is {vae_class}, which paradiff cannot split: "
            f"{vae_refusal(str(vae_class))}; paradiff splits {supported_vaes()}. "
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

    # a ControlNet runs before the transformer at each step, and its collectives too: whichever is called first checks
    for name, module in pipeline.components.items():
        if (name == "transformer" or name.startswith("controlnet")) and get_state(module) is not None:
            install_wrapper(module, "latent_check", check)
