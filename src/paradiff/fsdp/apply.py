"""Fully sharded weights with PyTorch's own FSDP2: `fully_shard` on each repeated block, on each module outside the
blocks, and on the root.

Inference only: every rank holds 1/N of each block's weights (its rows, `shard.chunk_rows`), and a block's weights are
all-gathered just before its forward and freed after it (`reshard_after_forward=True`); each block starts the next
block's all-gather as it begins, without waiting for it (`_gather_next`), so the gather overlaps the current block's
compute. The modules outside the blocks (embeddings, modulation, the final norm and projection) are units of their
own (`shard.outside_units`), each gathered only while it runs: left to the root, they stayed gathered for the whole
forward. The root keeps only what no such unit can hold (tied weights, parameters of its own).

A model is sharded on the meta device, then its sharded parameters are made real but empty on the load device, and
the loader fills each rank's rows from the checkpoint (`io/weights.py: WeightSource.read`): no rank ever holds a whole
weight. Buffers (rotary tables computed at construction, persistent buffers read whole) are kept as they are.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

try:  # FSDP2's custom all-gather hook: torch's private module, absent before torch 2.8 (pyproject admits 2.6)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover - the lock pins a torch that has it
    AllGather = None

from paradiff.distributed.comm import all_gather_in_place
from paradiff.fsdp.shard import chunk_rows, outside_units
from paradiff.runtime.patches import add_hook


def shard_weights(model: nn.Module, blocks: list[tuple[str, nn.Module]], mesh: DeviceMesh,
                  device: torch.device, prefetch_across_lists: bool = True, offload: bool = False,
                  own_units: tuple[str, ...] = ()) -> list[str]:
    """`fully_shard` every block (in the order they run), then each module outside them, then the root over `mesh`,
    with forward prefetch of the next block; parameters on the meta device become this rank's empty rows on `device` (to be read). Returns the
    blocks' names. `prefetch_across_lists=False` (a text encoder): a block prefetches only the next one of its own list
    (a vision tower and the language layers are separate lists, and a text prompt runs only the latter).
    `offload`: the shards are kept in CPU memory (pinned when `device` is CUDA) and each unit's are copied to `device`
    for its all-gather (FSDP2's CPUOffloadPolicy); the prefetch makes that copy one block ahead too.
    `own_units`: names of submodules inside blocks that the model also calls outside their block's forward; each is
    sharded first, as a unit of its own (nested in its block's), so it is gathered wherever it runs. A name the model
    does not have is skipped (a family's classes or configurations differ in what they hold)."""
    model.requires_grad_(False)
    options = dict(mesh=mesh, reshard_after_forward=True)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    on_meta = any(p.is_meta for p in model.parameters())
    buffers = {(id(module), leaf): buffer for module in model.modules()
               for leaf, buffer in module._buffers.items() if buffer is not None}
    outside = outside_units(model, [block for _name, block in blocks])
    for name in own_units:
        part = _submodule_or_none(model, name)
        if part is not None and any(True for _ in part.parameters()):
            _shard_mixed_dtypes(part, options)
            fully_shard(part, **options)
    for _name, block in blocks:
        _shard_mixed_dtypes(block, options)
        fully_shard(block, **options)
    for part in outside:
        _shard_mixed_dtypes(part, options)
        fully_shard(part, **options)
    _shard_mixed_dtypes(model, options)
    fully_shard(model, **options)
    if device.type == "cpu" and AllGather is not None:  # without the hook: gloo's staged all_gather_into_tensor
        gather = _InPlaceGather(_GatherBuffers())  # one set of reused buffers for all the model's units
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(gather)
        add_hook(model, partial(_release_buffers, gather.buffers), by="fsdp", always_call=True)
    for (name, block), (next_name, following) in zip(blocks, blocks[1:]):
        if prefetch_across_lists or name.rpartition(".")[0] == next_name.rpartition(".")[0]:
            add_hook(block, partial(_gather_next, following), by="fsdp", pre=True)
    if prefetch_across_lists and blocks:  # the first block too, as the forward starts (see _gather_next)
        add_hook(model, partial(_gather_next, blocks[0][1]), by="fsdp", pre=True)
    if on_meta:
        # the sharded parameters only (in CPU memory when offloaded): buffers are put back as they were
        model.to_empty(device="cpu" if offload else device)
        for module in model.modules():
            for leaf in module._buffers:
                kept = buffers.get((id(module), leaf))
                if kept is not None:
                    module._buffers[leaf] = kept.to(device)
    return [name for name, _block in blocks]


class _InPlaceGather(AllGather or object):
    """FSDP2's all-gather on CPU (gloo): sent and received in place in FSDP2's own output buffer
    (`comm.all_gather_in_place`), not staged by gloo in a second whole buffer and copied back. In bench_fsdp.py the
    staging buffer was a block's worth of memory per gather in flight, and the copies part of the step. The output
    buffers come from `buffers`, reused from one gather to the next."""

    def __init__(self, buffers: "_GatherBuffers") -> None:
        self.buffers = buffers

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.buffers.take(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        return all_gather_in_place(output_tensor, input_tensor, group, async_op=async_op)


class _GatherBuffers:
    """FSDP2's all-gather output buffers (a unit's gathered weights, before its copy-out into the parameters), reused
    from one gather to the next within a forward instead of allocated for each, and let go after it
    (`_release_buffers`): a fresh block-sized buffer is new memory the kernel must fault in and zero page by page
    (with large allocations mapped and unmapped each time, as under MALLOC_MMAP_THRESHOLD_: every gather of every
    step; bench_fsdp.py).

    A buffer is free again once no tensor but the pool's storage uses it (FSDP2 drops its output after the copy-out),
    so reuse needs no hook into FSDP2's order. A gather takes the smallest free buffer that fits and the other free
    ones are let go (a gather that none fits gets a new one): in the blocks' steady state the next block's prefetch
    takes the buffer the current block's copy-out just left, so one buffer serves them all, and no idle buffer stays
    beside those in use (the gathers in flight, or a synchronous gather FSDP2 keeps until the next copy-out); `most`
    buffers at the most. Without torch's storage use count (a private function) every gather allocates, as FSDP2
    does."""

    most = 3  # the current unit, the prefetched next one, and one to spare (a unit gathered outside the order)

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []

    def take(self, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = math.prod(size) * dtype.itemsize
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None or device.type != "cpu":
            return torch.empty(*size, dtype=dtype, device=device)
        free = [storage for storage in self._storages if use_count(storage._cdata) == 1]
        fits = [storage for storage in free if storage.nbytes() >= nbytes]
        storage = min(fits, key=lambda s: s.nbytes()) if fits else None
        # the other free buffers are let go: an idle buffer would be a block's memory more than FSDP2 itself holds
        free_ids = {id(kept) for kept in free if kept is not storage}
        self._storages = [kept for kept in self._storages if id(kept) not in free_ids]
        if storage is None:
            if len(self._storages) >= self.most:  # buffers still held elsewhere: allocate as FSDP2 does
                return torch.empty(*size, dtype=dtype, device=device)
            storage = torch.UntypedStorage(nbytes, device=device)
            self._storages.append(storage)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(size))

    def release(self) -> None:
        """Let go of every buffer (one still in use lives on with its user, then is freed)."""
        self._storages.clear()

    @property
    def held_bytes(self) -> int:
        return sum(storage.nbytes() for storage in self._storages)


def _release_buffers(buffers: _GatherBuffers, _model: nn.Module, _args: tuple, _output) -> None:
    """After the model's forward: its gathers' buffers are freed, so nothing is held between steps beyond the shards
    (the buffers are reused within a forward, by all its blocks, and made again at the next one's first gathers)."""
    buffers.release()


def _submodule_or_none(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _gather_next(following: FSDPModule, _block: nn.Module, _args: tuple) -> None:
    """Start the next block's all-gather and return at once; FSDP2 waits for it in that block's pre-forward.

    Not FSDP2's own `set_modules_to_forward_prefetch`: that issues the prefetch with `async_op=False`, which over
    gloo (CPU) runs the whole all-gather before the current block computes (nothing overlapped: fsdp2 x ulysses2 took
    2.1x ulysses2's step in benchmarks/bench_fsdp.py), and a synchronous gather in forward keeps its gathered buffer
    until the next block's copy-out, one more block's worth of memory held. An `async_op=True` unshard is waited for
    in the next block's pre-forward and its buffer freed right after its copy-out. (Runs after FSDP2's own pre-forward
    hook, which fully_shard put first: the current block is gathered by then.)

    The first block is started the same way from the model's pre-forward, so it is gathered while the embedders and
    modulation run. Left to FSDP2's synchronous gather in its own pre-forward, its gathered buffer stayed until the
    second block's copy-out: while the first block ran a rank held it, that block's weights and the second block's
    gather in flight, three blocks' worth (FLUX.2-shaped at fsdp2 x ulysses2: 25.0 MB of peak rise against 19.1 with
    the first block prefetched, in step with the two blocks docs/fsdp.md and `plan` count)."""
    following.unshard(async_op=True)


def _shard_mixed_dtypes(module: nn.Module, options: dict) -> None:
    """FSDP2 gathers one unit's parameters as one buffer of one dtype: a unit whose parameters mix dtypes (float32
    norms kept in a bfloat16 model) gets each submodule of a minority dtype sharded as a unit of its own first."""
    dtypes = Counter(p.dtype for p in _unit_parameters(module))
    if len(dtypes) < 2:
        return
    main = dtypes.most_common(1)[0][0]
    for child in module.modules():
        if child is module or isinstance(child, FSDPModule):
            continue
        own = [p for p in child.parameters(recurse=False)]
        if own and any(p.dtype != main for p in own) and not any(isinstance(m, FSDPModule) for m in child.modules()):
            if len({p.dtype for p in child.parameters()}) == 1:
                fully_shard(child, **options)


def _unit_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a `fully_shard(module)` would own: those not in an already sharded submodule."""
    inside = {id(p) for child in module.modules() if child is not module and isinstance(child, FSDPModule)
              for p in child.parameters()}
    return [p for p in module.parameters() if id(p) not in inside]


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """(start, length) of the rows of an FSDP-sharded parameter this rank holds."""
    mesh = param.device_mesh
    return chunk_rows(param.shape[0], mesh.get_local_rank(), mesh.size())


def held_weight_bytes(model: nn.Module) -> int:
    """The bytes of weights this rank holds: its local rows of the sharded parameters, the whole of any other."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


@contextmanager
def whole_shapes(model: nn.Module) -> Iterator[None]:
    """While inside, every FSDP-sharded Linear weight reads as a plain tensor of the weight's whole shape (a zero-byte
    expanded view, never filled) and is put back after. For peft building LoRA layers on an FSDP model: peft takes a
    DTensor weight on a mesh not named "fsdp" for a TP shard and sizes the adapter to its local rows, but a Linear
    FSDP2 shards computes its whole output (its weight is gathered in the forward), so its adapter must be whole.
    The Linear's load_state_dict post-hooks (FSDP2's re-reading of its shard after a load) are set aside meanwhile:
    the adapter's load that follows fills the adapter's factors only, and must not take the placeholder for a shard."""
    swapped = []
    for module in model.modules():
        weight = module._parameters.get("weight") if isinstance(module, nn.Linear) else None
        if isinstance(weight, DTensor):
            placeholder = torch.zeros((), dtype=weight.dtype, device=weight.to_local().device).expand(weight.shape)
            hooks = dict(module._load_state_dict_post_hooks)
            module._load_state_dict_post_hooks.clear()
            module._parameters["weight"] = nn.Parameter(placeholder, requires_grad=False)
            swapped.append((module, weight, hooks))
    try:
        yield
    finally:
        for module, weight, hooks in swapped:
            module._parameters["weight"] = weight
            module._load_state_dict_post_hooks.update(hooks)
