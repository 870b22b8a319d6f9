"""Which rows of a weight an FSDP rank holds, and how to read only those from the checkpoint.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards every parameter along its first dimension the way `torch.chunk`
does: chunks of ceil(rows / size) rows, the last ones shorter or empty. A parameter already split by tensor
parallelism is FSDP-sharded within its TP slice, so the rows to read compose the two.
"""

from __future__ import annotations

from torch import nn

from paradiff.tensor_parallel.styles import ShardSpec


def chunk_rows(rows: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of the rows `rank` of `size` holds of a dimension of `rows`, as FSDP2 chunks it."""
    step = -(-rows // size) if rows else 0
    start = min(rows, rank * step)
    return start, max(0, min(step, rows - start))


def read_plan(tp_spec: ShardSpec | None, start: int, length: int) -> tuple[ShardSpec | None, tuple[int, int] | None]:
    """The (spec, rows) arguments of `Checkpoint.read` that read rows [start, start + length) of the tensor this
    rank's TP spec gives (the whole tensor when `tp_spec` is None): the rows of a spec along dim 0 become the part of
    its pieces they cover; a spec along another dimension keeps its columns and reads those rows of the file."""
    if tp_spec is None or tp_spec.dim != 0:
        return tp_spec, (start, length)
    pieces, position = [], 0
    for piece_start, piece_length in tp_spec.pieces:
        low, high = max(start, position), min(start + length, position + piece_length)
        if low < high:
            pieces.append((piece_start + low - position, high - low))
        position += piece_length
    return ShardSpec(dim=0, pieces=tuple(pieces)), None


def outside_units(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules outside `blocks` that become FSDP units of their own (embeddings, modulation, final norm and
    projection), so that each is gathered only while it runs rather than for the whole forward, as the root's own
    parameters are: each child of the model, or of a module holding blocks or of a container (ModuleList /
    ModuleDict), that holds parameters and no block.
    Left to the root: a module sharing a parameter with a module outside it (tied embeddings: FSDP2 needs a shared
    parameter in one unit) and parameters registered on a module that holds blocks."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(id(module))
    block_ids = {id(block) for block in blocks}
    units: list[nn.Module] = []
    seen: set[int] = set()

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if id(child) in seen or id(child) in block_ids:
                continue
            seen.add(id(child))
            inside = list(child.modules())
            if any(id(module) in block_ids for module in inside) or type(child).forward is nn.Module.forward:
                # a module holding blocks, or a container without a forward of its own (ModuleList / ModuleDict:
                # FSDP2 gathers a unit in its forward's pre-hook, which a container never runs): look inside
                visit(child)
                continue
            mine = {id(module) for module in inside}
            params = [p for module in inside for p in module._parameters.values() if p is not None]
            if params and all(owners[id(p)] <= mine for p in params):
                units.append(child)

    visit(model)
    return units
