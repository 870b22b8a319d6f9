"""`parallelize_vae`: split a VAE's encoder and decoder by rows across ranks, in place, exactly.

Every check runs before the first collective: an unsupported class or module, a processor that bypasses SDPA, a
padding mode the halo cannot rebuild, a bad group or output rank.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from paradiff.distributed.comm import CommStats, all_gather_ints, all_gather_uneven, gather_uneven_to
from paradiff.errors import DistributedError, ParallelConfigError, UnsupportedModelError
from paradiff.runtime.patches import add_hook, set_attribute, wrap_forward
from paradiff.distributed.mesh import ParallelMesh, replica_group, require_distributed
from paradiff.vae.attention import KINDS, RowAttention
from paradiff.vae.conv import AgreedFramePieces, HaloConv, needs_halo
from paradiff.vae.layout import split_rows
from paradiff.vae.linear import SplitLinearAttention
from paradiff.vae.noise import FrameNoise
from paradiff.vae.norm import SplitGroupNorm
from paradiff.vae.plan import VaePlan
from paradiff.vae.runtime import RegionCall, VaeRuntime, get_vae_runtime, set_vae_runtime

# Modules that act on every row alike in every covered VAE (convolutions and group norms are replaced below).
_ROW_LOCAL = {"Conv2d", "Conv3d", "GroupNorm", "SiLU", "Mish", "GELU", "ReLU", "Dropout", "Identity",
              "Linear", "ModuleList", "Sequential"}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# convolution padding modes whose rows paradiff rebuilds at the image's edges (circular would need the far edge's)
_PAD_MODES = ("zeros", "replicate", "reflect")


def split_vae(vae: nn.Module, plan: VaePlan, mesh_or_group=None, *, output_rank: int | None = None,
              stats: CommStats | None = None) -> nn.Module:
    """Split `vae`'s decode and encode across the ranks of `mesh_or_group` as `plan` says, in place; returns `vae`.

    Afterwards `vae.decode(z)` / `vae.encode(x)`, called on every rank of the group with the same full input, return
    the full result on every rank, equal to a single-device call: each rank holds a band of rows, convolutions
    exchange the rows their windows need with the neighbouring ranks, group norms use statistics of the whole image
    and the mid-block attention runs over every rank's tokens. With `output_rank`, only that rank of the group gets
    the result; the others get a tensor with no rows (their memory is not spent on the gathered output).

    `mesh_or_group`: a process group, a paradiff ParallelMesh (each data-parallel replica splits its own VAE
    calls over its own ranks), a 1-D DeviceMesh, or None for every process. Inference only: outputs carry no
    autograd graph. Inputs too small to give every rank a band run whole on every rank, with the same result.
    `stats`: a `paradiff.distributed.comm.CommStats` counting the split VAE's collectives (tests, benchmarks).
    `paradiff.parallelize_vae` finds the plan of a covered VAE class and calls this.
    """
    require_distributed()
    if get_vae_runtime(vae) is not None:
        raise ParallelConfigError(f"This {type(vae).__name__} is already split across ranks by parallelize_vae.")
    regions = {name: getattr(vae, name) for name in plan.regions if isinstance(getattr(vae, name, None), nn.Module)}
    prepads = {}
    for name, region in regions.items():
        _check_region(vae, name, region, plan)
        prepads[name] = _prepads(name, region, plan)
    group = _resolve_group(mesh_or_group)
    size = dist.get_world_size(group)
    if output_rank is not None and not (isinstance(output_rank, int) and 0 <= output_rank < size):
        raise ParallelConfigError(f"output_rank must be None or a rank of the group, 0..{size - 1}; got {output_rank!r}.")
    runtime = VaeRuntime(group=group, output_rank=output_rank, stats=stats)
    for name, region in regions.items():
        _install(runtime, name, region, plan, prepads[name], unit=int(plan.regions[name](vae)))
    set_vae_runtime(vae, runtime)
    return vae


def _resolve_group(mesh_or_group) -> dist.ProcessGroup:
    if mesh_or_group is None:
        return dist.group.WORLD
    if isinstance(mesh_or_group, ParallelMesh):
        return replica_group(mesh_or_group)
    if isinstance(mesh_or_group, dist.ProcessGroup):
        return mesh_or_group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ParallelConfigError(
                f"parallelize_vae takes a 1-D DeviceMesh; this one has dimensions {mesh_or_group.mesh_dim_names}. "
                "Pass the paradiff ParallelMesh, or the process group to split over."
            )
        return mesh_or_group.get_group()
    raise ParallelConfigError(
        "parallelize_vae's mesh_or_group must be a torch.distributed ProcessGroup, a paradiff ParallelMesh, a 1-D "
        f"DeviceMesh or None; got {type(mesh_or_group).__name__}."
    )


def _check_region(vae: nn.Module, region_name: str, region: nn.Module, plan: VaePlan) -> None:
    known = _ROW_LOCAL | set(plan.row_local) | set(plan.prepadded) | set(plan.attention) | set(plan.frame_pieces)
    what = f"{type(vae).__name__}.{region_name}"
    for name, module in region.named_modules():
        cls = type(module).__name__
        path = f"{region_name}.{name}" if name else region_name
        if cls not in known:
            raise UnsupportedModelError(
                f"{what} contains {cls} ({path}), which paradiff has not checked for operations that mix rows, so "
                f"it cannot split this VAE exactly. Leave the VAE unsplit (it decodes whole on each rank)."
            )
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            unsupported_mode = module.padding_mode not in _PAD_MODES and needs_halo(module, (0, 0))
            if isinstance(module.padding, str) or unsupported_mode:
                raise UnsupportedModelError(
                    f"{path}: paradiff splits convolutions with integer padding in modes {_PAD_MODES}; this one has "
                    f"padding={module.padding!r}, padding_mode={module.padding_mode!r}."
                )
        processor = getattr(module, "processor", None)
        if processor is not None and type(processor).__name__ not in plan.processors:
            fix = (" Call vae.set_attn_processor(AttnProcessor2_0())." if "AttnProcessor2_0" in plan.processors
                   else "")
            raise UnsupportedModelError(
                f"{path} uses {type(processor).__name__}; paradiff has checked {list(plan.processors)} for "
                f"{type(vae).__name__} (its attention spread over ranks through scaled_dot_product_attention where "
                f"it attends across rows).{fix}"
            )
    for cls, kind in plan.attention.items():
        if kind not in KINDS:
            raise UnsupportedModelError(f"VAE plan attention kind {kind!r} for {cls}; valid kinds: {KINDS}.")


def _prepads(region_name: str, region: nn.Module, plan: VaePlan) -> dict[int, tuple[tuple[int, int], str]]:
    """Convolution id -> the (top, bottom) rows the model pads its input with just before the call, and their mode.
    Checked here, before anything is changed: pads paradiff cannot rebuild at the image's edges are refused."""
    prepadded: dict[int, tuple[tuple[int, int], str]] = {}
    for name, module in region.named_modules():
        spec = plan.prepadded.get(type(module).__name__)
        rows = spec.rows(module) if spec is not None else None
        if rows is not None and any(rows):
            conv = module.get_submodule(spec.conv) if spec.conv else module
            mode = spec.mode(module)
            before, before_mode = prepadded.get(id(conv), ((0, 0), mode))
            if mode not in ("constant", "replicate", "reflect") or (any(before) and before_mode != mode):
                raise UnsupportedModelError(
                    f"{region_name}.{name}: pads rows in mode {mode!r}"
                    + (f" over a pad in mode {before_mode!r}" if any(before) and before_mode != mode else "")
                    + "; paradiff rebuilds one pad of the modes constant, replicate or reflect at the image's edges.")
            prepadded[id(conv)] = ((before[0] + rows[0], before[1] + rows[1]), mode)
    for name, module in region.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Conv3d)) and module.padding_mode != "zeros" and id(module) in prepadded:
            raise UnsupportedModelError(
                f"{region_name}.{name}: the model pads its input and the convolution pads again in mode "
                f"{module.padding_mode!r}; paradiff rebuilds one pad at the image's edges.")
    return prepadded


def _install(runtime: VaeRuntime, region_name: str, region: nn.Module, plan: VaePlan,
             prepadded: dict[int, tuple[tuple[int, int], str]], unit: int) -> None:
    for name, module in region.named_modules():
        path = f"{region_name}.{name}" if name else region_name
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            rows, mode = prepadded.get(id(module), ((0, 0), "constant"))
            if needs_halo(module, rows):
                set_attribute(module, "_conv_forward", HaloConv(runtime, path, module, rows, mode), by="vae")
            pieces = plan.frame_pieces.get(type(module).__name__)
            if pieces is not None:
                wrap_forward(module, AgreedFramePieces(runtime, path, module, pieces.count, pieces.overlap), by="vae")
        elif isinstance(module, nn.GroupNorm):
            wrap_forward(module, SplitGroupNorm(runtime, module), by="vae")
        kind = _attention_kind(module, plan)
        if kind == "tokens":
            interceptor = RowAttention(runtime, kind, path)
            add_hook(module, interceptor.enter, by="vae", pre=True)
            add_hook(module, interceptor.leave, by="vae", always_call=True)
        elif kind == "causal_frames":
            # the block knows the frame count; its attention modules (none when the model was built without) attend,
            # or the block itself when it calls the attention (it has no attention modules with a processor)
            attentions = [(inner, attention) for inner, attention in module.named_modules()
                          if hasattr(attention, "processor")]
            for inner, attention in attentions or [("", module)]:
                interceptor = RowAttention(runtime, kind, f"{path}.{inner}" if inner else path,
                                           require_call=bool(attentions))
                add_hook(module, interceptor.frames_from, by="vae", pre=True)
                add_hook(attention, interceptor.enter, by="vae", pre=True)
                add_hook(attention, interceptor.leave, by="vae", always_call=True)
        elif kind == "linear":
            SplitLinearAttention(runtime, module).install()
        if type(module).__name__ in plan.frame_noise:
            noise = FrameNoise(runtime)
            add_hook(module, noise.enter, by="vae", pre=True)
            add_hook(module, noise.leave, by="vae", always_call=True)
    eval_only = [module for module in region.modules() if type(module).__name__ in plan.eval_only]
    wrap_forward(region, _SplitRegion(runtime, region_name, region.forward, unit, eval_only), by="vae")


def _attention_kind(module: nn.Module, plan: VaePlan) -> str | None:
    """A module's attention kind, declared for its class or for its processor's."""
    kind = plan.attention.get(type(module).__name__)
    processor = getattr(module, "processor", None)
    if kind is None and processor is not None:
        kind = plan.attention.get(type(processor).__name__)
    return kind


class _SplitRegion:
    """Stands in for a region's forward: keep this rank's rows of the input, run, gather the output rows."""

    def __init__(self, runtime: VaeRuntime, name: str, forward, unit: int, eval_only: list[nn.Module]) -> None:
        self.runtime = runtime
        self.name = name
        self.inner = forward
        self.unit = max(1, unit)
        self.eval_only = eval_only
        self.first_argument = next(iter(inspect.signature(forward).parameters))

    def __call__(self, *args, **kwargs):
        if args:
            sample, args = args[0], args[1:]
        else:
            sample = kwargs.pop(self.first_argument)
        return self._split(sample, *args, **kwargs)

    def _split(self, sample: torch.Tensor, *args, **kwargs):
        runtime = self.runtime
        training = [type(module).__name__ for module in self.eval_only if module.training]
        if training:  # every rank holds the same modules in the same mode, so every rank raises here alike
            raise ParallelConfigError(
                f"The split VAE {self.name} has {training[0]} in training mode (batch statistics over the whole "
                "image); paradiff splits it with its running statistics only. Call vae.eval()."
            )
        self._agree(sample)
        height = sample.shape[-2]
        if height < self.unit * runtime.size:
            return self.inner(sample, *args, **kwargs)  # too small for a band per rank: whole, on every rank
        start, stop = split_rows(height, runtime.size, self.unit)[runtime.rank]
        runtime.active = RegionCall(self.name, height)
        try:
            with torch.no_grad():
                local = self.inner(sample.narrow(-2, start, stop - start), *args, **kwargs)
        finally:
            runtime.active = None
        # a region may also return per-rank state of its own rows (a frame cache): passed back as this rank has it
        local, state = (local[0], local[1:]) if isinstance(local, tuple) else (local, None)
        runtime.last_split[self.name] = (stop - start, local.shape[-2])
        sizes = [row[0] for row in all_gather_ints([local.shape[-2]], runtime.group, local.device, runtime.stats,
                                                   "all_gather_heights")]
        if runtime.output_rank is None:
            full = all_gather_uneven(local, -2, sizes, runtime.group, runtime.stats, "gather_rows")
        else:
            full = gather_uneven_to(local, -2, sizes, runtime.output_rank, runtime.group, runtime.stats)
            full = local.narrow(-2, 0, 0) if full is None else full
        return full if state is None else (full, *state)

    def _agree(self, sample: torch.Tensor) -> None:
        """Every rank must call with the same shape (and dtype), or the bands would not fit together."""
        shape = list(sample.shape)[:6]
        code = _DTYPES.index(sample.dtype) if sample.dtype in _DTYPES else len(_DTYPES)
        mine = [sample.dim(), code, int(sample.requires_grad)] + shape + [0] * (6 - len(shape))
        every = all_gather_ints(mine, self.runtime.group, sample.device, self.runtime.stats, "agree_shape")
        if any(row != every[0] for row in every):
            described = ", ".join(
                f"rank {r}: shape {tuple(row[3:3 + min(row[0], 6)])}, "
                f"dtype {_DTYPES[row[1]] if row[1] < len(_DTYPES) else 'other'}, requires_grad {bool(row[2])}"
                for r, row in enumerate(every))
            raise DistributedError(
                f"The split VAE {self.name} needs the same full input on every rank of its group; got {described}."
            )
        # every rank agrees from here on, so every rank raises alike
        if sample.requires_grad:
            raise ParallelConfigError(
                f"The split VAE {self.name} is inference-only and its input requires grad; call it under "
                "torch.no_grad() or detach the input."
            )
        if code == len(_DTYPES) or sample.dim() not in (4, 5):
            raise ParallelConfigError(
                f"The split VAE {self.name} takes a 4-D image or 5-D video batch of dtype {_DTYPES}; got shape "
                f"{tuple(sample.shape)}, dtype {sample.dtype}."
            )
