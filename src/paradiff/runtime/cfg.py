"""CFG parallelism: the conditional and unconditional branches of one denoising step run at the same time on the
two halves of the mesh's cfg dimension, and the predictions are exchanged. Which way a pipeline runs its branches
is per-pipeline knowledge (plans/pipelines.py `CfgRule.style`); this module holds the two mechanisms.

Batch style (BatchCfgSplitter): the pipeline makes one call on the branches concatenated along the batch. Each cfg
rank takes its half of every batched argument (the rule names them), computes it, and the halves of the output are
all-gathered back into the whole batch. Nothing has to be known in advance.

Two-call style (CfgSplitter): pipelines call the transformer twice per step (first the conditional branch, then the unconditional one), and use
the first prediction only after the second call returns. So cfg rank 0 computes the first call while cfg rank 1
returns a placeholder and computes the second call; at the end of the second call the two predictions are exchanged
and the placeholder is filled in place.

Cfg rank 1 must hand out the placeholder before it has computed anything, so it needs the output's structure (type,
shape, dtype) in advance. It learns it from a meta-device run: the model's class, built from its config on the meta
device with the real parameters' dtypes, run on meta copies of the call's arguments. That costs no arithmetic and no
communication, and is remembered per argument signature. A model whose forward cannot run on meta tensors falls
back to computing that first call for real on cfg rank 1 (once per signature).

Guider style (GuidedBranches): Modular Diffusers pipelines run guidance through a guider component. Each step the
guider turns the step's inputs into one batch per branch (`prepare_inputs`: 2 for ClassifierFreeGuidance, 3 for
SkipLayerGuidance or PerturbedAttentionGuidance ...), the denoise step calls the transformer once per batch, and the
guider combines the batches' predictions (`guider(batches)` -> `forward(pred_cond=..., pred_uncond=..., ...)`).
Branch i is computed by cfg rank i % cfg_degree; on the other ranks the call returns zeros of the output's structure
(the meta-device run above), and when the guider combines the predictions each branch's is broadcast from the rank
that computed it. What is exchanged is what the denoise step stored for each branch, after its own handling of the
transformer's output (slicing, sign), so nothing is assumed about views, and any number of branches works.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from paradiff.distributed.comm import all_gather_any_shape, all_gather_cfg_batch, broadcast_cfg_branch
from paradiff.errors import ParallelConfigError
from paradiff.runtime.patches import set_attribute
from paradiff.runtime.wrappers import install_wrapper, registry_of


def _sample_of(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output.sample


def _with_sample(template: Any, sample: torch.Tensor) -> Any:
    if torch.is_tensor(template):
        return sample
    if isinstance(template, tuple):
        return (sample,) + tuple(template[1:])
    return type(template)(sample=sample)


def signature(args: tuple, kwargs: dict) -> str:
    """What the output's structure can depend on: tensors by shape and dtype, everything else by value."""
    described = pytree.tree_map_only(torch.Tensor, lambda t: ("tensor", tuple(t.shape), str(t.dtype)), (args, kwargs))
    return repr(described)


class MetaStructure:
    """The output structure of `model` for given arguments, from a run of its architecture on the meta device."""

    KEEP = 16  # signatures remembered; a pipeline uses one per resolution and prompt length

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.meta_model: nn.Module | None = None
        self.known: dict[str, Any] = {}

    def _build(self) -> nn.Module:
        model = self.model
        with torch.device("meta"):
            meta = type(model).from_config(model.config)

        def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
            return {**dict(module.named_parameters()), **dict(module.named_buffers())}

        dtypes = {name: tensor.dtype for name, tensor in tensors(model).items()}
        for name, tensor in tensors(meta).items():
            if name in dtypes and tensor.dtype != dtypes[name]:
                tensor.data = tensor.data.to(dtypes[name])  # mixed dtypes (fp32-kept modules) as in the real model
        return meta.eval()

    def __call__(self, args: tuple, kwargs: dict) -> Any | None:
        """A template output (meta tensors) or None when the forward cannot run on the meta device."""
        key = signature(args, kwargs)
        if key not in self.known:
            try:
                if self.meta_model is None:
                    self.meta_model = self._build()
                meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
                with torch.no_grad():
                    self.known[key] = self.meta_model(*meta_args, **meta_kwargs)
            except Exception:  # noqa: BLE001 - deterministic for given shapes: every rank of the group falls back
                self.known[key] = None
            self._forget_oldest()
        return self.known.get(key)

    def remember(self, args: tuple, kwargs: dict, output: Any) -> None:
        self.known[signature(args, kwargs)] = output
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        while len(self.known) > self.KEEP:
            self.known.pop(next(iter(self.known)))


@dataclass
class CfgSplitter:
    group: dist.ProcessGroup
    cfg_rank: int
    structure: Callable[[tuple, dict], Any] | None = None  # MetaStructure (cfg rank 1)
    calls: int = 0
    computed: int = 0  # forwards this rank really ran (for tests and reports)
    placeholder: torch.Tensor | None = None  # cfg rank 1: the first prediction, filled at the exchange
    first_output: torch.Tensor | None = None  # cfg rank 0: its first prediction, kept until the exchange
    template: Any = field(default=None, repr=False)

    def reset(self) -> None:
        self.calls = 0
        self.placeholder = None

    def finish(self) -> None:
        if self.calls % 2:
            raise ParallelConfigError(
                "cfg_degree=2 needs the pipeline to call the transformer twice per step (conditional and "
                f"unconditional), but it made {self.calls} calls. Enable classifier-free guidance (e.g. a negative "
                "prompt with true_cfg_scale > 1, or guidance_scale > 1) or use cfg_degree=1."
            )

    def step_done(self, step: int) -> None:
        """The end of a denoising step (`runtime/steps.py`): its calls made whole pairs, and the next step's first
        call is a first branch again. A step of one call would otherwise pair its branch with the next step's."""
        if self.calls % 2:
            raise ParallelConfigError(
                "cfg_degree=2 needs the pipeline to call the transformer twice per step (conditional and "
                f"unconditional), but at denoising step {step} it made {self.calls} call(s). Enable classifier-free "
                "guidance at every step (e.g. a negative prompt with true_cfg_scale > 1, or guidance_scale > 1) or "
                "use cfg_degree=1."
            )
        self.calls = 0

    def _forward(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.computed += 1
        return forward(*args, **kwargs)

    def __call__(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        slot = self.calls % 2
        self.calls += 1
        if slot == 0:
            if self.cfg_rank == 0:
                output = self._forward(forward, args, kwargs)
                self.first_output, self.template = _sample_of(output), output
                return output
            template = self.structure(args, kwargs) if self.structure is not None else None
            if template is None:  # no meta run possible: learn the structure by computing this call once
                template = self._forward(forward, args, kwargs)
                if self.structure is not None:
                    self.structure.remember(args, kwargs, template)
            sample = _sample_of(template)
            self.placeholder = torch.empty(sample.shape, dtype=sample.dtype, device=_device_of(args, kwargs))
            return _with_sample(template, self.placeholder)
        # second call of the pair: cfg rank 1 computes it; then both predictions are exchanged
        if self.cfg_rank == 1:
            output = self._forward(forward, args, kwargs)
            mine, template = _sample_of(output), output
        else:
            mine, template, self.first_output = self.first_output, self.template, None
        # the two predictions may differ in shape where the output carries the prompt's tokens (Qwen-Image 2.1)
        first, second = all_gather_any_shape(mine, self.group)
        if self.placeholder is not None:
            placeholder, self.placeholder = self.placeholder, None
            if placeholder.shape != first.shape or placeholder.dtype != first.dtype:
                raise RuntimeError(
                    f"CFG parallelism: the meta-device run predicted a {tuple(placeholder.shape)} {placeholder.dtype} "
                    f"output but the transformer returned {tuple(first.shape)} {first.dtype}."
                )
            placeholder.copy_(first)
        return _with_sample(template, second)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(leaf)]
    return tensors[0].device if tensors else torch.device("cpu")


@dataclass
class BatchCfgSplitter:
    """One call per step on the branches' batch: this cfg rank computes its share of the batch of every argument
    named in `batched` (keyword names; positional arguments are matched to the forward's parameter names)."""

    group: dist.ProcessGroup
    cfg_rank: int
    cfg_degree: int
    batched: tuple[str, ...]
    parameter_names: tuple[str, ...]  # the forward's positional parameters, in order
    sample_lists: tuple[str, ...] = ()  # batched arguments that are lists of one tensor per batch row (Z-Image)
    batch_dims: dict[str, int] = field(default_factory=dict)  # batched arguments whose batch is not dimension 0
    calls: int = 0
    computed: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # the batch this rank computed, per call (for reports)

    def reset(self) -> None:
        self.calls = 0

    def finish(self) -> None:
        """Nothing to pair: every call exchanged its own output."""

    def _share(self, name: str, value: Any, whole: int) -> Any:
        if name in self.sample_lists:  # one item per batch row
            if len(value) != whole:
                raise ParallelConfigError(
                    f"CFG parallelism (batch style): the transformer argument {name!r} holds {len(value)} samples "
                    f"but the batch has {whole}; the pipeline's CfgRule in plans/pipelines.py names it a sample list.")
            share = whole // self.cfg_degree
            return type(value)(value[self.cfg_rank * share:(self.cfg_rank + 1) * share])
        # a ControlNet's residuals by block index, attention-processor keyword arguments (a batched key mask), a KV
        # cache's tensors per block (views: the model's writes reach them)
        if isinstance(value, dict):
            return {key: self._share(name, item, whole) for key, item in value.items()}
        if isinstance(value, (list, tuple)):  # a ControlNet's residuals: one batched tensor per block
            return type(value)(self._share(name, item, whole) for item in value)
        if not torch.is_tensor(value) or value.ndim == 0:
            return value
        dim = self.batch_dims.get(name, 0)
        if value.shape[dim] != whole:
            raise ParallelConfigError(
                f"CFG parallelism (batch style): the transformer argument {name!r} has batch {value.shape[dim]} "
                f"(dim {dim}) but the latents have {whole}; the pipeline's CfgRule in plans/pipelines.py "
                "names it as batched."
            )
        share = whole // self.cfg_degree
        return value.narrow(dim, self.cfg_rank * share, share)

    def __call__(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        named = dict(zip(self.parameter_names, args))
        named.update(kwargs)
        # the latents, whose batch every other batched argument follows: hidden_states, or the rule's first
        first = "hidden_states" if torch.is_tensor(named.get("hidden_states")) else self.batched[0]
        latents = named.get(first)
        if first in self.sample_lists and isinstance(latents, (list, tuple)):
            whole = len(latents)
        elif torch.is_tensor(latents):
            whole = latents.shape[0]
        else:
            raise ParallelConfigError(f"CFG parallelism (batch style) needs the transformer's {first} argument "
                                      f"(its latents); the call passed {sorted(named)}.")
        if whole % self.cfg_degree:
            raise ParallelConfigError(
                f"CFG parallelism (batch style): the transformer was called on a batch of {whole}, which the "
                f"{self.cfg_degree} cfg ranks cannot share; the call does not run CFG (use cfg_degree=1).")
        whole_of: dict[int, Any] = {}  # id(this rank's share) -> the argument it was cut from

        def share(name: str, value: Any) -> Any:
            if name not in self.batched:
                return value
            mine = self._share(name, value, whole)
            whole_of[id(mine)] = value
            return mine

        args = tuple(share(name, value) for name, value in zip(self.parameter_names, args))
        kwargs = {name: share(name, value) for name, value in kwargs.items()}
        self.computed += 1
        self.batch_sizes.append(whole // self.cfg_degree)
        output = forward(*args, **kwargs)
        if type(output) is tuple:  # a batched argument handed back (AnyFlow FAR's KV cache): the caller's own
            output = tuple(whole_of.get(id(item), item) for item in output)
        sample = _sample_of(output)
        if sample is None:  # a call that only fills a cache (AnyFlow FAR's cache-encoding call): nothing to gather
            return output
        if isinstance(sample, (list, tuple)):  # one prediction per batch row (the rows of a call share a shape)
            return _with_sample(output, list(all_gather_cfg_batch(torch.stack(list(sample)), self.group).unbind(0)))
        return _with_sample(output, all_gather_cfg_batch(sample, self.group))


@dataclass
class GuidedBranches:
    """CFG parallelism over a guider's branches (module docstring, "Guider style"), shared by every transformer and
    guider of one pipeline (Wan 2.2 has two of each)."""

    group: dist.ProcessGroup
    cfg_rank: int
    cfg_degree: int
    identifiers: list[str] | None = None  # the current step's branches, in the guider's order; None between steps
    calls: int = 0  # transformer calls in the current step
    computed: int = 0  # forwards this rank really ran (for tests and reports)
    branch_counts: list[int] = field(default_factory=list)  # branches per step, for reports

    def reset(self) -> None:
        self.identifiers, self.calls = None, 0
        self.branch_counts = []

    def finish(self) -> None:
        if self.identifiers is not None and self.calls:
            identifiers, self.identifiers = self.identifiers, None
            raise ParallelConfigError(
                f"CFG parallelism: the transformer ran the guidance branches {identifiers} of a step, but the guider "
                "never combined their predictions through its forward, so each cfg rank kept only its own; this "
                "pipeline's denoise step does not use its guider the way CFG parallelism follows (use cfg_degree=1).")

    def owner(self, index: int) -> int:
        return index % self.cfg_degree

    def begin(self, batches: list[Any], identifier_key: str) -> None:
        """The guider prepared this step's batches, one per branch, in the order the transformer will run them."""
        if self.identifiers is not None and self.calls:
            raise ParallelConfigError(
                f"CFG parallelism: the guider prepared new branches before it combined the {self.calls} predictions "
                f"of the branches {self.identifiers}; use cfg_degree=1 for this pipeline.")
        self.identifiers = [getattr(batch, identifier_key, None) for batch in batches]
        self.calls = 0
        self.branch_counts.append(len(batches))

    def transformer_call(self, structure: MetaStructure, forward: Callable[..., Any], args: tuple, kwargs: dict
                         ) -> Any:
        if self.identifiers is None:  # not a guided call (e.g. a step without guider): every rank computes it
            return forward(*args, **kwargs)
        index = self.calls
        self.calls += 1
        if index >= len(self.identifiers):
            raise ParallelConfigError(
                f"CFG parallelism: the guider prepared {len(self.identifiers)} branches ({self.identifiers}) but the "
                f"transformer was called {index + 1} times in this step; use cfg_degree=1 for this pipeline.")
        if self.owner(index) == self.cfg_rank:
            self.computed += 1
            return forward(*args, **kwargs)
        template = structure(args, kwargs)
        if template is None:  # no meta run possible: compute it (the exchange then brings the owner's same values)
            self.computed += 1
            output = forward(*args, **kwargs)
            structure.remember(args, kwargs, output)
            return output
        device = _device_of(args, kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device),
                                    template)

    def combine(self, predictions: dict[str, Any]) -> dict[str, Any]:
        """The guider's forward arguments (branch identifier -> prediction), each the one its owner computed."""
        if self.identifiers is None:
            return predictions
        identifiers, calls = self.identifiers, self.calls
        self.identifiers, self.calls = None, 0
        if calls != len(identifiers) or sorted(predictions, key=str) != sorted(identifiers, key=str):
            raise ParallelConfigError(
                f"CFG parallelism: the guider prepared the branches {identifiers} and the transformer ran {calls} of "
                f"them, but the guider combines {sorted(predictions)}; use cfg_degree=1 for this pipeline.")
        combined = dict(predictions)
        for index, identifier in enumerate(identifiers):
            owner = self.owner(index)
            combined[identifier] = pytree.tree_map_only(
                torch.Tensor, lambda t, owner=owner: broadcast_cfg_branch(t, owner, self.group), predictions[identifier])
        return combined


@dataclass
class GuidedTransformer:
    """The "cfg_exchange" wrapper of one transformer of a guided (modular) pipeline."""

    branches: GuidedBranches
    structure: MetaStructure

    def __call__(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return self.branches.transformer_call(self.structure, forward, args, kwargs)


_GUIDER_METHODS = ("prepare_inputs", "prepare_inputs_from_block_state", "forward")


def install_guided_branches(model: nn.Module, branches: GuidedBranches) -> GuidedTransformer:
    """Run `model`'s calls inside a guider's steps as branches of `branches` (its "cfg_exchange" wrapper)."""
    wrapper = GuidedTransformer(branches, MetaStructure(model))
    install_wrapper(model, "cfg_exchange", wrapper)
    return wrapper


def attach_guider(guider: Any, branches: GuidedBranches) -> None:
    """Make `guider` (a diffusers BaseGuidance) announce each step's branches to `branches` and combine the
    predictions `branches` exchanged. On the instance: another guider put in the pipeline later is attached at its
    first call, and a copy made by `guider.new()` is a plain guider."""
    if guider.__dict__.get("_paradiff_branches") is branches:
        return
    plain = guider.__dict__.get("_paradiff_plain") or {name: getattr(guider, name) for name in _GUIDER_METHODS}
    key = guider._identifier_key

    def prepare_inputs(*args: Any, **kwargs: Any) -> list[Any]:
        batches = plain["prepare_inputs"](*args, **kwargs)
        branches.begin(batches, key)
        return batches

    def prepare_inputs_from_block_state(*args: Any, **kwargs: Any) -> list[Any]:
        batches = plain["prepare_inputs_from_block_state"](*args, **kwargs)
        branches.begin(batches, key)
        return batches

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            raise ParallelConfigError(f"CFG parallelism: {type(guider).__name__}.forward was called with positional "
                                      "predictions; it combines branches by name (pred_cond=..., ...).")
        return plain["forward"](**branches.combine(kwargs))

    for name, method in (("prepare_inputs", prepare_inputs),
                         ("prepare_inputs_from_block_state", prepare_inputs_from_block_state), ("forward", forward)):
        set_attribute(guider, name, method, by="cfg")
    set_attribute(guider, "_paradiff_plain", plain, by="cfg")
    set_attribute(guider, "_paradiff_branches", branches, by="cfg")


def is_guider_component(name: str) -> bool:
    """Whether a pipeline component of this name is a guider: "guider" (Wan 2.2 also "guider_2", LTX-2 "audio_guider",
    HunyuanImage "ocr_guider")."""
    return name.startswith("guider") or name.endswith("_guider")


def guider_branch_count(guider: Any) -> int | None:
    """How many branches `guider` runs per step at most with its settings (a copy with no step set: ranges such as
    start / stop count as on); None when its `num_conditions` cannot be read without a step."""
    import copy

    probe = copy.copy(guider)
    probe._step = probe._num_inference_steps = probe._timestep = None
    try:
        return int(probe.num_conditions)
    except Exception:  # noqa: BLE001 - a guider whose count needs a step: known only while it runs
        return None


def install_cfg_parallel(model: nn.Module, group: dist.ProcessGroup, rule: Any = None
                         ) -> CfgSplitter | BatchCfgSplitter:
    """Put the splitter of `rule`'s style (a plans.pipelines.CfgRule; None: two calls) on `group` into `model`'s
    forward, as its "cfg_exchange" wrapper."""
    cfg_degree = dist.get_world_size(group)
    cfg_rank = dist.get_rank(group)
    if rule is not None and rule.style == "batch":
        parameters = list(inspect.signature(type(model).forward).parameters)[1:]  # without self
        splitter: CfgSplitter | BatchCfgSplitter = BatchCfgSplitter(
            group=group, cfg_rank=cfg_rank, cfg_degree=cfg_degree, batched=rule.batched,
            parameter_names=tuple(parameters), sample_lists=rule.sample_lists, batch_dims=dict(rule.batch_dims))
    else:
        if cfg_degree != 2:
            raise ParallelConfigError(f"the cfg group must have 2 ranks, it has {cfg_degree}.")
        splitter = CfgSplitter(group=group, cfg_rank=cfg_rank,
                               structure=MetaStructure(model) if cfg_rank == 1 else None)
    install_wrapper(model, "cfg_exchange", splitter)
    return splitter


def cfg_step_done(model: nn.Module, step: int) -> None:
    """The end of denoising step `step` for `model`'s CFG exchange (its "cfg_exchange" wrapper; the batch and guider
    styles close nothing per step)."""
    exchange = registry_of(model).installed.get("cfg_exchange")
    if isinstance(exchange, CfgSplitter):
        exchange.step_done(step)
