"""How one Linear is split over the TP group, as pure index arithmetic.

A style answers two questions: which slice of each parameter a rank holds (`shard_spec`), and how the module must run
on that slice (`kind`: "colwise" needs nothing, "rowwise" all-reduces its partial output). The loader reads exactly
the slices `shard_spec` names, so no rank ever materialises a full sharded weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from paradiff.errors import PlanError
from paradiff.tensor_parallel.heads import HeadSplit, uneven_piece, width_piece


@dataclass(frozen=True)
class ShardSpec:
    """The part of a full tensor a rank holds: `pieces` (start, length) along `dim`, concatenated in order."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    def local_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = sum(length for _, length in self.pieces)
        return tuple(shape)


BlockSizes = Sequence[int] | Callable[[Any], Sequence[int]] | None


@dataclass(frozen=True)
class Style:
    """Base: split along `dim` of the weight (0 = out_features, 1 = in_features)."""

    kind: ClassVar[str] = "colwise"
    # what the style splits: "linear" (an nn.Linear) or "norm" (an RMSNorm / LayerNorm over the split features)
    target: ClassVar[str] = "linear"

    def block_sizes_for(self, full_size: int, config: Any, where: str) -> list[int]:
        return [full_size]

    def weight_dim(self) -> int:
        return 0 if self.kind == "colwise" else 1

    def shard_spec(self, param: str, full_shape: Sequence[int], rank: int, size: int, config: Any, where: str,
                   heads: HeadSplit | None = None):
        """ShardSpec for `param` ("weight" or "bias"), or None when the rank keeps it whole. `heads`: the heads of
        the attention module the parameter belongs to, so head-structured widths split by whole heads."""
        if param == "bias" and self.kind != "colwise":
            return None  # rowwise bias is added once, after the all-reduce
        dim = self.weight_dim() if param == "weight" else 0
        return ShardSpec(dim=dim, pieces=_block_pieces(self.block_sizes_for(full_shape[dim], config, where), rank,
                                                        size, heads, f"{where}.{param}", dim, full_shape))


def _block_pieces(blocks: Sequence[int], rank: int, size: int, heads: HeadSplit | None, where: str, dim: int,
                  full_shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Each block of a (packed) width split on its own: by whole heads where it is head-structured, else by single
    features, floor/ceil."""
    pieces, offset = [], 0
    for block in blocks:
        start, length = width_piece(block, rank, size, heads)
        if length == 0:
            raise PlanError(
                f"{where}: a block of size {block} (dim {dim} of shape {tuple(full_shape)}) cannot give each of "
                f"tp_degree={size} ranks a part; choose a tp_degree of at most {block}."
            )
        pieces.append((offset + start, length))
        offset += block
    return tuple(pieces)


@dataclass(frozen=True)
class Colwise(Style):
    kind: ClassVar[str] = "colwise"


@dataclass(frozen=True)
class Rowwise(Style):
    kind: ClassVar[str] = "rowwise"


@dataclass(frozen=True)
class RowwiseSplitInput(Style):
    """Rowwise on a replicated input: each rank multiplies its slice of the input by its slice of the weight."""

    kind: ClassVar[str] = "rowwise_split_input"


@dataclass(frozen=True)
class _Packed(Style):
    """Several logical tensors packed along the split dim; each is split on its own.

    `blocks` are proportions (e.g. [1, 1] for SwiGLU gate/up) or a callable of the model config returning the
    absolute sizes, for packings whose proportions depend on the config (e.g. mlp_ratio).
    """

    blocks: BlockSizes = None

    def block_sizes_for(self, full_size: int, config: Any, where: str) -> list[int]:
        if self.blocks is None:
            raise PlanError(f"{where}: {type(self).__name__} needs blocks=[...] proportions or a callable of the config.")
        if callable(self.blocks):
            sizes = [int(s) for s in self.blocks(config)]
            if sum(sizes) != full_size:
                raise PlanError(
                    f"{where}: packed block sizes {sizes} sum to {sum(sizes)}, but the packed dim has size {full_size}."
                )
            return sizes
        proportions = [int(p) for p in self.blocks]
        if any(p <= 0 for p in proportions) or full_size % sum(proportions) != 0:
            raise PlanError(
                f"{where}: packed proportions {proportions} (sum {sum(proportions)}) must be positive and divide the "
                f"packed dim {full_size}."
            )
        unit = full_size // sum(proportions)
        return [p * unit for p in proportions]


@dataclass(frozen=True)
class PackedColwise(_Packed):
    kind: ClassVar[str] = "colwise"


@dataclass(frozen=True)
class PackedRowwise(_Packed):
    kind: ClassVar[str] = "rowwise"


@dataclass(frozen=True)
class HeadNorm(Style):
    """A norm (RMSNorm or LayerNorm) over all heads, applied to the output of a colwise projection.

    Wan's and LTX's QK-norm normalise the whole inner dimension, so a rank holding heads/tp heads sees only part of
    each token's features. The weight (and bias) are split with the heads; the per-token statistic is all-reduced
    over the TP group, which keeps the result exact for a few bytes per token. `blocks` as for packed styles, when
    the norm's features are packed like the projection's.
    """

    kind: ClassVar[str] = "norm_across_heads"
    target: ClassVar[str] = "norm"
    blocks: BlockSizes = None
    # grouped K heads (a norm after a ColwiseHeads projection): split like ColwiseHeads(head_dim), replicas included
    head_dim: int | Callable[[Any], int] | None = None

    def weight_dim(self) -> int:
        return 0

    def block_sizes_for(self, full_size: int, config: Any, where: str) -> list[int]:
        return [full_size] if self.blocks is None else _Packed(self.blocks).block_sizes_for(full_size, config, where)

    def shard_spec(self, param: str, full_shape: Sequence[int], rank: int, size: int, config: Any, where: str,
                   heads: HeadSplit | None = None):
        if self.head_dim is not None:
            return ColwiseHeads(self.head_dim).shard_spec("weight", full_shape, rank, size, config, where, heads)
        return Colwise.shard_spec(self, "weight", full_shape, rank, size, config, where, heads)


@dataclass(frozen=True)
class ColwiseHeads(Style):
    """Colwise by whole heads of `head_dim`, for grouped-query K/V projections with fewer heads than Q.

    The K/V heads follow their query heads (tensor_parallel/heads.py): split floor/ceil where there are at least as
    many as ranks, else every rank of a contiguous run holds the same K/V head, the one its query heads attend.
    `head_dim` is an int or a callable of the model config.
    """

    kind: ClassVar[str] = "colwise"
    head_dim: int | Callable[[Any], int] = 0

    def shard_spec(self, param: str, full_shape: Sequence[int], rank: int, size: int, config: Any, where: str,
                   heads: HeadSplit | None = None):
        head_dim = int(self.head_dim(config) if callable(self.head_dim) else self.head_dim)
        full = full_shape[0]
        if head_dim <= 0 or full % head_dim != 0:
            raise PlanError(f"{where}.{param}: ColwiseHeads(head_dim={head_dim}) must divide its {full} output features.")
        kv_heads = full // head_dim
        if heads is not None and heads.kv_heads == kv_heads:
            start, count = heads.kv[rank]
        elif kv_heads >= size:  # no attention module known: the K/V heads alone, split floor/ceil
            start, count = uneven_piece(kv_heads, rank, size)
        else:
            start, count = rank * kv_heads // size, 1
        return ShardSpec(dim=0, pieces=((start * head_dim, count * head_dim),))


@dataclass(frozen=True)
class SplitParameter(Style):
    """A bare parameter holding one value (or row) per head, e.g. Lumina-Next's per-head gate: split along `dim` by
    whole heads, each rank keeping the heads its colwise projections hold. The plan key names the
    parameter ('layers.*.gate'), not a module. Also a mixture-of-experts bank's 3-D weights (experts x in x out):
    the inner features split like a colwise / rowwise pair, each rank's output a partial sum
    (`TensorParallelPlan.reduce_outputs`)."""

    kind: ClassVar[str] = "parameter"
    target: ClassVar[str] = "parameter"
    dim: int = 0
    # several tensors packed along `dim` (e.g. an expert bank's fused gate and up projections, [1, 1]): each block
    # split on its own, as PackedColwise does
    blocks: BlockSizes = None

    def shard_spec(self, param: str, full_shape: Sequence[int], rank: int, size: int, config: Any, where: str,
                   heads: HeadSplit | None = None):
        full = full_shape[self.dim]
        sizes = [full] if self.blocks is None else _Packed(self.blocks).block_sizes_for(full, config, where)
        return ShardSpec(dim=self.dim, pieces=_block_pieces(sizes, rank, size, heads, where, self.dim, full_shape))


@dataclass(frozen=True)
class Vocab(Style):
    """Split the vocabulary: the rows of a token-embedding table (masked lookup, then one all-reduce), or the output
    rows of an LM head (then one all-gather), so a tied table and head hold the same slice.

    Vocabularies rarely divide evenly, so the split is uneven: the first `vocab % tp` ranks hold one row more.
    """

    kind: ClassVar[str] = "vocab"

    def shard_spec(self, param: str, full_shape: Sequence[int], rank: int, size: int, config: Any, where: str,
                   heads: HeadSplit | None = None):
        start, length = uneven_piece(full_shape[0], rank, size)
        if length == 0:
            raise PlanError(f"{where}.{param}: {full_shape[0]} vocabulary rows cannot be split over {size} ranks.")
        return ShardSpec(dim=0, pieces=((start, length),))


def PackedColwiseParallel(blocks: BlockSizes = None) -> PackedColwise:  # noqa: N802 - diffusers-compatible name
    return PackedColwise(blocks)


def PackedRowwiseParallel(blocks: BlockSizes = None) -> PackedRowwise:  # noqa: N802
    return PackedRowwise(blocks)


_NAMED = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "rowwise_split_input": RowwiseSplitInput(),
    "norm_across_heads": HeadNorm(),
    "vocab": Vocab(),
}


def resolve_style(value: str | Style, where: str) -> Style:
    if isinstance(value, Style):
        return value
    if isinstance(value, str) and value in _NAMED:
        return _NAMED[value]
    raise PlanError(
        f"Unknown tensor-parallel style {value!r} for {where!r}; valid styles: "
        f"{sorted(_NAMED)}, PackedColwise(blocks), PackedRowwise(blocks), HeadNorm(blocks, head_dim), "
        "ColwiseHeads(head_dim), SplitParameter(dim, blocks)."
    )
