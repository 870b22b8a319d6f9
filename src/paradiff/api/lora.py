"""diffusers' LoRA API on a paradiff model: `load_lora_adapter` reads each rank's slice of every factor, checks the
adapter against the full model, makes the ranks agree, then lets diffusers and peft build the adapter layers from
the local shapes; `unload_lora` gives the module hooks back to the base layers.

Why around diffusers' own `load_lora_adapter` rather than beside it: the pipelines' `load_lora_weights` (with
diffusers' conversions of kohya, BFL, XLabs... formats in `lora_state_dict`) ends in it, and everything after a load
(`set_adapters`, `disable_lora`, `delete_adapters`, `fuse_lora`, `unload_lora`) is peft's work on the layers, which
`tensor_parallel/lora.py` adapts to shards. Installed on the instance by `attach`, so a plain diffusers model of the
same class is untouched.

Order, as for a model load: prepare (headers or tensors, conversion to peft's keys, every check, nothing sliced) ->
agree (adapter name, tensor names and full shapes, a checksum of the content) -> read each rank's slices -> build
the layers -> agree again; a rank that failed there has its new adapter deleted on every rank, so the model and its
other adapters stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from paradiff.runtime.patches import has_hooks, module_patches, move_hooks, remove_patch, set_attribute
from paradiff.distributed.agreement import agree, fingerprint
from paradiff.errors import AdapterError
from paradiff.io.adapters import FETCH_KWARGS, AdapterSource, open_adapter, text_encoder_adapter
from paradiff.fsdp.apply import is_sharded, whole_shapes
from paradiff.runtime.state import get_state
from paradiff.tensor_parallel.layers import ShardedLinear
from paradiff.tensor_parallel.lora import FACTORS, adopt, factor_specs, lora_layers
from paradiff.tensor_parallel.styles import ShardSpec


def install_lora_support(model: nn.Module) -> None:
    """Shadow diffusers' `load_lora_adapter` and `unload_lora` on this instance (a no-op for a class without them)."""
    cls = type(model)
    if not (hasattr(cls, "load_lora_adapter") and hasattr(cls, "unload_lora")):
        return
    original_load, original_unload = cls.load_lora_adapter, cls.unload_lora

    def load_lora_adapter(pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap=False, **kwargs):
        return load_adapter(model, original_load, pretrained_model_name_or_path_or_dict, prefix, hotswap, kwargs)

    def unload_lora():
        return_hooks(model)
        return original_unload(model)

    load_lora_adapter.__doc__ = original_load.__doc__
    set_attribute(model, "load_lora_adapter", load_lora_adapter, by="lora")
    set_attribute(model, "unload_lora", unload_lora, by="lora")
    if hasattr(cls, "fuse_lora"):
        original_fuse = cls.fuse_lora

        def fuse_lora(*args: Any, **kwargs: Any):
            check_fusable(model)
            return original_fuse(model, *args, **kwargs)

        fuse_lora.__doc__ = original_fuse.__doc__
        set_attribute(model, "fuse_lora", fuse_lora, by="lora")


def check_fusable(model: nn.Module) -> None:
    """Refuse, before any layer is merged, to fuse adapters into quantized weights: the sum would have to be
    quantized again (with new scales, different from a single device's if done per slice), and the exact unfuse
    keeps the original shards only for plain weights. Unfused, the adapters run on the quantized shards as they are.
    Nor into FSDP shards: each rank holds only its rows of them between forwards."""
    from paradiff.quant.apply import is_quantized_weight

    refusals = (
        (is_sharded, lambda weight: "hold FSDP-sharded weights", "each rank holds only its rows of them between "
         "forwards, and paradiff does not fuse adapters into FSDP shards. Keep the adapters unfused (they run exactly "
         "on the sharded model), or load without fsdp to fuse."),
        (is_quantized_weight, lambda weight: f"hold quantized weights ({type(weight).__name__})", "paradiff does not "
         "fuse adapters into quantized shards (they would be re-quantized, not fused exactly). Keep the adapters "
         "unfused (they run on the quantized base as loaded), or load the model without quantization_config to fuse."),
    )
    for held, what, reason in refusals:
        names = [name for name, module in model.named_modules() if name.endswith(".base_layer")
                 and held(getattr(module, "weight", None))]
        if names:
            layer = names[0].removesuffix(".base_layer")
            raise AdapterError(f"fuse_lora: {len(names)} adapted layer(s) {what(model.get_submodule(names[0]).weight)} "
                               f"(e.g. {layer!r}): {reason}")


def adopt_layers(model: nn.Module) -> None:
    """Every peft LoRA Linear of the model becomes paradiff's (split forward, exact fuse / unfuse)."""
    for module in lora_layers(model):
        adopt(module)


def return_hooks(model: nn.Module) -> None:
    """Give the hooks paradiff moved onto LoRA layers back to their base layers (before peft removes the layers)."""
    for module in lora_layers(model):
        for patch in [patch for patch in module_patches(module) if patch.kind == "moved_hooks"]:
            remove_patch(module, patch)


def loaded_adapters(pipeline) -> dict[str, set[str]]:
    """Component name -> the adapters loaded into it."""
    return {name: set(getattr(component, "peft_config", None) or {}) for name, component in pipeline.components.items()
            if isinstance(component, nn.Module)}


def delete_added_adapters(pipeline, before: dict[str, set[str]]) -> None:
    """Delete from every component the adapters loaded since `before` (a failed `load_lora_weights`)."""
    for name, adapters in loaded_adapters(pipeline).items():
        added = sorted(adapters - before.get(name, set()))
        if not added:
            continue
        delete_adapters(pipeline.components[name], added)


def delete_adapters(component: nn.Module, names: list[str]) -> None:
    """diffusers' way for its models (`delete_adapters`), and for transformers' text encoders."""
    from diffusers.utils.peft_utils import delete_adapter_layers

    if hasattr(component, "delete_adapters"):
        component.delete_adapters(names)
        return
    for name in names:
        delete_adapter_layers(component, name)


@dataclass
class LoadReport:
    """What the last `load_lora_adapter` did on this rank (kept on the model as `_paradiff_lora_load`)."""

    adapter_name: str | None
    tensors: int
    sliced: int
    bytes_read: int  # from the file (0 for tensors given in memory)
    local_bytes: int  # of the factors this rank keeps


def load_adapter(model: nn.Module, original: Callable, source: Any, prefix: str | None, hotswap: bool,
                 kwargs: dict[str, Any]) -> None:
    """diffusers' `load_lora_adapter` on a paradiff model (a transformer or a ControlNet)."""
    adapter_name = kwargs.get("adapter_name")
    adapter, specs, error = None, {}, None
    try:
        adapter = open_adapter(source, prefix, kwargs)
        specs = check_adapter(model, _resolved(model), adapter, adapter_name, hotswap)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc

    def build(local: dict[str, torch.Tensor]) -> None:
        call_kwargs = {k: v for k, v in kwargs.items() if k not in FETCH_KWARGS}
        if adapter.metadata is not None and call_kwargs.get("metadata") is None:
            call_kwargs["metadata"] = adapter.metadata
        named = {(f"{prefix}.{name}" if prefix else name): tensor for name, tensor in local.items()}
        with whole_shapes(model):  # FSDP-sharded Linears compute whole outputs: their adapters are whole
            original(model, named, prefix=prefix, hotswap=hotswap, **call_kwargs)

    try:
        facts = None if adapter is None else _facts(adapter, adapter_name, prefix, hotswap,
                                                    kwargs.get("network_alphas"), kwargs.get("metadata", adapter.metadata))
        _load_slices(model, "paradiff.load_lora_adapter", adapter, specs, facts, error, build,
                     delete=None if hotswap else model.delete_adapters)
    finally:
        if adapter is not None:
            adapter.close()


def load_text_encoder_adapter(text_encoder: nn.Module, original: Callable, state_dict: dict[str, torch.Tensor],
                              network_alphas: Any, prefix: str, kwargs: dict[str, Any]) -> None:
    """A pipeline's `load_lora_into_text_encoder` on a text encoder paradiff split: the encoder's part of the
    adapter (diffusers' prefix and key conversions, as its own loader applies them) checked against the full
    encoder, agreed, sliced by the encoder's plan, then handed to diffusers' loader, which builds peft's layers from
    the shard shapes. `original(local_state_dict)` is that loader with the call's other arguments."""
    adapter_name, hotswap = kwargs.get("adapter_name"), bool(kwargs.get("hotswap"))
    adapter, specs, error = None, {}, None
    try:
        adapter = text_encoder_adapter(state_dict, prefix, text_encoder)
        specs = check_adapter(text_encoder, _resolved(text_encoder), adapter, adapter_name, hotswap)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc

    def build(local: dict[str, torch.Tensor]) -> None:
        # peft keys already: diffusers' conversions leave them as they are
        with whole_shapes(text_encoder):
            original({f"{prefix}.{name}": tensor for name, tensor in local.items()})

    facts = None if adapter is None else _facts(adapter, adapter_name, prefix, hotswap, network_alphas,
                                                kwargs.get("metadata"))
    _load_slices(text_encoder, f"paradiff.load_lora_into_text_encoder ({prefix})", adapter, specs, facts, error,
                 build, delete=None if hotswap else (lambda names: delete_adapters(text_encoder, names)))


def _resolved(model: nn.Module):
    state = get_state(model)
    return state.tp_plan if state is not None else None


def _facts(adapter: "AdapterSource", adapter_name: str | None, prefix: str | None, hotswap: bool,
           network_alphas: Any, metadata: Any) -> dict[str, Any]:
    return {
        "adapter name": adapter_name, "prefix": prefix, "hotswap": hotswap,
        "adapter tensors": fingerprint(sorted((n, list(s), adapter.dtypes[n]) for n, s in adapter.shapes.items())),
        "adapter content": adapter.identity,
        "network alphas": fingerprint(network_alphas),
        "adapter metadata": fingerprint(metadata),
    }


def _load_slices(model: nn.Module, stage: str, adapter: "AdapterSource | None", specs: dict[str, ShardSpec | None],
                 facts: dict[str, Any] | None, error: BaseException | None,
                 build: Callable[[dict[str, torch.Tensor]], None], delete: Callable[[list[str]], None] | None) -> None:
    """The part every adapter load shares: agree on what is loaded (or on a rank's error), read this rank's slice of
    every factor, let diffusers / peft build the layers (`build`), make them paradiff's, then agree again; if a rank
    failed there, every rank deletes the adapters the call added (`delete`; None for a hot-swap, which adds none)."""
    agree(stage, facts, error)
    before = set(getattr(model, "peft_config", None) or {})
    error = None
    try:
        local = {name: adapter.read(name, spec) for name, spec in specs.items()}
        build(local)
        for module in lora_layers(model):
            adopt(module)
            _move_hooks(module.base_layer, module)
        object.__setattr__(model, "_paradiff_lora_load", LoadReport(
            facts["adapter name"], len(local), sum(spec is not None for spec in specs.values()),
            adapter.bytes_read, sum(t.numel() * t.element_size() for t in local.values())))
    except Exception as exc:  # noqa: BLE001
        error = exc
    try:
        agree(f"{stage} (building the adapter layers)", {"loaded": True}, error)
    except Exception:
        # this rank or another failed: every rank goes back to the adapters it had
        added = sorted(set(getattr(model, "peft_config", None) or {}) - before)
        if added and delete is not None:
            delete(added)
        raise


def check_adapter(model: nn.Module, resolved: Any, adapter: AdapterSource, adapter_name: str | None,
                  hotswap: bool) -> dict[str, ShardSpec | None]:
    """Every tensor against the full model (not the shards); returns each tensor's slice for this rank."""
    loaded = getattr(model, "peft_config", None) or {}
    if adapter_name is not None and adapter_name in loaded and not hotswap:
        raise AdapterError(f"An adapter named {adapter_name!r} is already loaded (loaded: {sorted(loaded)}); choose "
                           "another adapter_name, delete_adapters it first, or pass hotswap=True to replace it.")
    targets: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in adapter.shapes.items():
        module_name, factor = _split_name(name)
        targets.setdefault(module_name, {})[factor] = shape
    specs: dict[str, ShardSpec | None] = {}
    for module_name, factors in targets.items():
        module = _target(model, module_name, next(iter(factors)))
        base = getattr(module, "base_layer", module)
        planned = resolved.linears.get(module_name) if resolved is not None else None
        local = factor_specs(module_name, planned) if planned is not None else {}
        for factor, shape in factors.items():
            if planned is not None and factor not in FACTORS:
                raise AdapterError(
                    f"LoRA tensor {module_name}.{factor} (shape {list(shape)}) is not a plain LoRA factor, on "
                    f"{module_name!r}, which tensor parallelism splits; only {list(FACTORS)} split exactly (DoRA and "
                    "other peft variants are refused on split layers). Load without tensor parallelism.")
            specs[f"{module_name}.{factor}"] = local.get(factor)
        if isinstance(base, nn.Linear):
            _check_linear_shapes(module_name, base, factors)
    return specs


def _check_linear_shapes(module_name: str, base: nn.Linear, factors: dict[str, tuple[int, ...]]) -> None:
    if isinstance(base, ShardedLinear):
        out_features, in_features = base.full_out_features, base.full_in_features
    else:
        out_features, in_features = base.out_features, base.in_features
    rank = factors.get("lora_A.weight", (None,))[0]
    expected = {"lora_A.weight": (rank, in_features), "lora_B.weight": (out_features, rank),
                "lora_B.bias": (out_features,)}
    for factor, shape in factors.items():
        if factor in expected and tuple(shape) != expected[factor]:
            raise AdapterError(
                f"LoRA tensor {module_name}.{factor} has shape {list(shape)}, but {module_name!r} is a Linear "
                f"{in_features} -> {out_features}, which needs {list(expected[factor])}; the adapter was made for "
                "another model (or another configuration of it).")
    if "lora_A.weight" in factors and "lora_B.weight" not in factors or "lora_B.weight" in factors and \
            "lora_A.weight" not in factors:
        raise AdapterError(f"LoRA for {module_name!r} has {sorted(factors)} but needs both lora_A.weight and "
                           "lora_B.weight; the adapter file is incomplete.")


def _split_name(name: str) -> tuple[str, str]:
    """('blocks.0.attn.to_q', 'lora_A.weight') from a peft tensor name: the module is what precedes 'lora_*'."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.startswith("lora_") and index:
            return ".".join(parts[:index]), ".".join(parts[index:])
    raise AdapterError(f"Adapter tensor {name!r} is not a LoRA tensor (no 'lora_A' / 'lora_B' part in its name); "
                       "paradiff loads LoRA adapters in the formats diffusers' load_lora_weights accepts.")


def _target(model: nn.Module, module_name: str, factor: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        pass
    parts = module_name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        try:
            parent = model.get_submodule(".".join(parts[:cut]))
        except AttributeError:
            continue
        where = repr(".".join(parts[:cut])) if cut else type(model).__name__
        children = [child for child, _ in parent.named_children()]
        raise AdapterError(
            f"LoRA tensor {module_name}.{factor} targets {module_name!r}, which {type(model).__name__} does not have "
            f"({where} has children {children[:16]}); the adapter was made for another model.")
    raise AdapterError(f"LoRA tensor {module_name}.{factor} targets {module_name!r}, which does not exist.")


def _move_hooks(source: nn.Module, target: nn.Module) -> None:
    """The module hooks paradiff places (CP token split / gather, TP head slicing) travel from a base layer to the
    LoRA layer wrapping it, and back on unload (`return_hooks`): a patch moving the dicts whole, so every
    RemovableHandle still finds its hook."""
    if not has_hooks(source):
        return
    if has_hooks(target):
        raise AdapterError(f"{type(target).__name__} has hooks of its own; paradiff cannot move its hooks onto it.")
    move_hooks(source, target, by="lora")


