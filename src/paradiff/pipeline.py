"""Whole diffusers pipelines on the paradiff mesh: parallel transformer, local components, same latents everywhere."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .agreement import agree, tensor_checksum
from .cfg import CfgSplitter, install_cfg_parallel
from .config import as_parallel_config
from .errors import CheckpointError, ParallelConfigError, UnsupportedModelError
from .loading import check_dtype, from_pretrained
from .mesh import default_device
from .state import get_state

logger = logging.getLogger(__name__)

# Whether a pipeline call runs classifier-free guidance (two transformer calls per step), by pipeline class.
CFG_RULES = {
    "QwenImagePipeline": lambda kw: kw.get("true_cfg_scale", 4.0) > 1
    and (kw.get("negative_prompt") is not None or kw.get("negative_prompt_embeds") is not None),
    "FluxPipeline": lambda kw: kw.get("true_cfg_scale", 1.0) > 1
    and (kw.get("negative_prompt") is not None or kw.get("negative_prompt_embeds") is not None),
    "WanPipeline": lambda kw: kw.get("guidance_scale", 5.0) > 1,
}


def resolve_pipeline_folder(path: str | os.PathLike, hub_kwargs: dict | None = None) -> Path:
    local = Path(path)
    if local.is_dir():
        if not (local / "model_index.json").is_file():
            raise CheckpointError(f"{local} has no model_index.json: not a diffusers pipeline folder.")
        return local
    if local.exists() or str(path).count("/") != 1:
        raise CheckpointError(f"{str(path)!r} is neither a pipeline folder nor a Hub id of the form 'owner/name'.")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path), **(hub_kwargs or {})))


class ParallelPipelineMixin:
    """Mixed into the loaded pipeline's class: seeds every rank alike and checks CFG pairing."""

    _paradiff_cfg: CfgSplitter | None = None
    _paradiff_base: str = ""
    _paradiff_check_latents: bool = False

    def __call__(self, *args: Any, seed: int | None = None, **kwargs: Any):
        if kwargs.get("generator") is None:
            # every rank must draw identical initial latents; a CPU generator is identical on every device
            kwargs["generator"] = torch.Generator("cpu").manual_seed(0 if seed is None else seed)
        splitter = self._paradiff_cfg
        if splitter is not None:
            rule = CFG_RULES.get(self._paradiff_base)
            if rule is None or not rule(kwargs):
                raise ParallelConfigError(
                    f"cfg_degree=2 needs a call that runs classifier-free guidance; {self._paradiff_base} "
                    "with these arguments does not (give a negative_prompt and true_cfg_scale > 1 for Qwen-Image / "
                    "FLUX.1, guidance_scale > 1 for Wan), or use cfg_degree=1."
                )
            splitter.reset()
        self._paradiff_check_latents = True
        output = super().__call__(*args, **kwargs)
        if splitter is not None:
            splitter.finish()
        return output

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
    parallel_vae: bool | None = None,
    **kwargs: Any,
):
    """A diffusers pipeline whose transformer is parallelised (shard-on-read for TP). `plan` / `cp_plan`: the
    transformer's plans (None: built-in; "auto": derived from its structure).

    `parallel_vae`: split the VAE's decode and encode by rows across the ranks of each data-parallel replica
    (`paradiff.parallelize_vae`; same images). None (default): on when a replica has more than one rank and the VAE
    is covered, otherwise the VAE decodes whole on each rank; True: required (an uncovered VAE is an error); False:
    off.

    The other components are placed on this rank's own device one by one (never `pipeline.to()`, which would move
    the transformer's shards); `device_map=` is passed through to diffusers for users who want component placement.
    """
    from diffusers import DiffusionPipeline
    import diffusers

    dtype = check_dtype(torch_dtype)
    device = torch.device(device) if device is not None else default_device()
    parallel = None
    if parallel_config is not None:
        if not dist.is_initialized():
            from .mesh import require_distributed

            require_distributed()
        parallel = as_parallel_config(parallel_config, dist.get_world_size())
        if parallel.cfg_degree > 1 and pipeline_cls is not None and pipeline_cls.__name__ not in CFG_RULES:
            raise ParallelConfigError(
                f"cfg_degree=2 is supported for {sorted(CFG_RULES)}; {pipeline_cls.__name__} runs no true CFG."
            )
    folder = resolve_pipeline_folder(path)
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
    transformer_cls = getattr(diffusers, index["transformer"][1])
    transformer = from_pretrained(transformer_cls, folder, subfolder="transformer", torch_dtype=dtype,
                                  parallel_config=parallel, device=device, plan=plan, cp_plan=cp_plan)
    target_cls = pipeline_cls or getattr(diffusers, str(pipeline_name), DiffusionPipeline)
    expected_modules, _ = DiffusionPipeline._get_signature_keys(target_cls)
    if "transformer" in expected_modules:
        pipeline = target_cls.from_pretrained(folder, transformer=transformer, dtype=dtype, **kwargs)
    else:
        # Pipelines whose transformer is an optional argument (Wan) would load it again from disk, whole, and drop
        # the one passed in: load without it, then register the parallel one.
        pipeline = target_cls.from_pretrained(folder, transformer=None, dtype=dtype, **kwargs)
        pipeline.register_modules(transformer=transformer)
    if pipeline.transformer is not transformer:
        raise RuntimeError(f"{target_cls.__name__} replaced the parallel transformer while loading.")
    if kwargs.get("device_map") is None:
        for name, component in pipeline.components.items():
            if isinstance(component, nn.Module) and name != "transformer":
                component.to(device)
    base = type(pipeline)
    pipeline.__class__ = type(f"Parallel{base.__name__}", (ParallelPipelineMixin, base), {"_paradiff_base": base.__name__})
    if parallel is not None and parallel.cfg_degree > 1:
        pipeline._paradiff_cfg = install_cfg_parallel(transformer, get_state(transformer).mesh.group("cfg"))
    if parallel is not None:
        _install_latent_check(pipeline)
        if parallel_vae is not False and parallel.world_size // parallel.data_degree > 1:
            _parallelize_vae(pipeline, required=bool(parallel_vae))
    return pipeline


def _check_parallel_vae(parallel, index: dict, folder: Path) -> None:
    """parallel_vae=True: refuse, before any weight is read, what cannot split the VAE."""
    from .vae import supported_vaes

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
    from .vae import parallelize_vae

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
    replica_ranks = mesh.device_mesh.mesh[mesh.local_rank("data")].flatten().tolist()  # same data index: same inputs

    def check(_module, args, kwargs):
        if not pipeline._paradiff_check_latents:
            return None
        pipeline._paradiff_check_latents = False
        latents = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_tensor(latents):
            agree("generation start", {"initial latents": tensor_checksum(latents)}, ranks=replica_ranks)
        return None

    pipeline.transformer.register_forward_pre_hook(check, with_kwargs=True, prepend=True)


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
