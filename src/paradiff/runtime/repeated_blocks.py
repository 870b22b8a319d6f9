"""A transformer's repeated blocks: the unit paradiff compiles, and the unit a step cache must wrap on a compiled
model."""

from __future__ import annotations

import re

from torch import nn

COMPILED_ATTR = "_paradiff_compiled"  # set on a block whose forward paradiff.compile replaced


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: classes named in diffusers' `_repeated_blocks`, else the items of top-level
    ModuleLists."""
    names = tuple(getattr(model, "_repeated_blocks", None) or ())
    if names:
        return [(name, module) for name, module in model.named_modules() if type(module).__name__ in names]
    found = []
    for list_name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            found.extend((f"{list_name}.{index}", block) for index, block in enumerate(child))
    return found


def layer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """A transformers model's repeated layers (a text encoder's): the modules of the classes its `_no_split_modules`
    names (the unit transformers itself never cuts), outermost only, in module order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in names and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def block_identifiers(model: nn.Module) -> list[str]:
    """Patterns matching exactly the model's repeated blocks, for a step cache's module selection, e.g.
    `TaylorSeerCacheConfig(cache_identifiers=paradiff.block_identifiers(model))`: the cache then predicts whole
    block outputs, the form that works on a compiled model (where each block runs as one graph) and on every family
    alike (diffusers' default TaylorSeer patterns name attention modules `...attn` and miss e.g. Wan's `attn1`)."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (no `_repeated_blocks`, no top-level "
                         "nn.ModuleList).")
    listed, single = set(), set()
    for name, _ in blocks:
        parent, _, last = name.rpartition(".")
        if parent and last.isdigit():
            listed.add(parent)  # an item of a ModuleList: one pattern covers the list
        else:
            single.add(name)
    return [rf"{re.escape(parent)}\.\d+" for parent in sorted(listed)] + [re.escape(name) for name in sorted(single)]

