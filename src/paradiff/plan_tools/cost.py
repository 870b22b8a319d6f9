"""A cost model of a diffusion transformer step on a mesh: FLOPs, bytes, communication and per-rank memory.

Pure arithmetic from the model's config (a diffusers config dict) and the token count; no torch, no weights. Times
come from a hardware profile (`plan_tools/hardware.py`), the mesh choice from `plan_tools/planner.py`.

How each quantity is counted (b = bytes per element of the compute dtype, d = heads x head_dim, S = tokens that
attend together, N = latent (image / video) tokens, T = text tokens):
- a linear of `p` weights applied to `n` tokens: 2·n·p FLOPs (one multiply and one add per weight per token);
- attention over S queries and S keys: QK^T and AV, 2·S·S·d FLOPs each, 4·S²·d in all (cross: 4·N·T·d);
- adaLN modulation linears act on one vector per sample, not per token: counted in parameters, not in FLOPs;
- bytes per block: every weight read once, and each linear's input and output and attention's q, k, v, o moved
  once; the elementwise ops (norms, modulation, gates, RoPE, activations) counted apart (`ELEMENTWISE_PASSES`),
  timed at the profile's elementwise bandwidth;
- torch ops per forward, each a fixed cost whatever its size (dispatch, Python, a launch): counted per block and
  outside the blocks from diffusers' eager forward, plus what the parallel wrappers add (`OPS_PER_BLOCK`).

Block kinds, by family (the keys read from the config are in `model_shape`):
- "joint": two streams (latent, text) with their own weights, attention over both (FLUX.1 / FLUX.2 double blocks,
  Qwen-Image, HunyuanVideo double blocks);
- "single": one stream over the concatenated tokens, the MLP fused beside attention (FLUX.1 / FLUX.2 / HunyuanVideo
  single blocks);
- "cross": self attention over the latent tokens, then cross attention to the text (Wan 2.x, LTX).

Communication per forward, per rank (sizes in bytes; `wire` is what a ring algorithm puts on each rank's link):
- tp (degree t): the rowwise outputs are summed: joint blocks 2 all-reduces per stream, single blocks 1 (the fused
  output projection), cross blocks 3 (self, cross, FFN); all-reduce wire 2(t-1)/t · size. A QK norm over all heads
  (Wan's, LTX's: `norm_across_heads` in their plans) sums its per-token statistic over the tp ranks: one more
  all-reduce of a float32 per token per such norm (`BlockShape.norm_reduces`). A block's own modulation linears
  (FLUX.1's, Qwen-Image's, HunyuanVideo's: split on their replicated input) sum one vector per sample each (a joint
  block 2, a single block 1), and so do the plans' rowwise layers outside the blocks (embedders, shared modulation,
  the final norm's linear; the text projection sums per text token): `ModelShape.tp_reduces`, counted from the
  plans. Small, so their latency is what they cost;
- ulysses (u): q, k and v packed in one all-to-all, the output in another, per self attention; wire (u-1)/u · local
  size. Cross attention needs none: each rank keeps every text key and its own queries;
- ring (r): keys and values, packed in one message, passed r-1 times around the ring per self attention, overlapped
  with the attention on the block just received where the device can (`context_parallel.attention.overlaps_compute`:
  not on CPU);
- ulysses and ring: before each self attention the ranks all-gather their sequence lengths (a few bytes: latency);
  after the blocks, the final projection's output is all-gathered, its lengths agreed first (two calls a forward);
- cfg: the branch predictions exchanged once per step (the output latent), no per-block traffic;
- data: nothing;
- fsdp (f; paradiff's `--fsdp`, docs/fsdp.md: with ulysses / ring, the weights sharded over the same f = ulysses x
  ring ranks, adding none; without them, f ranks of their own, each computing the same forward): every unit's
  weights (each block, each module outside the blocks: `ModelShape.fsdp_units`) all-gathered once per forward, one
  unit ahead of use (overlapped with compute where the device can); wire (f-1)/f · weights. Where nothing overlaps
  (a CPU core per rank) a calibrated profile prices each unit and byte as `calibrate._fsdp_units` measured FSDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
MESH_DIMENSIONS = ("tp", "ulysses", "ring", "cfg", "data", "fsdp")


class CostModelError(ValueError):
    """A config or size the cost model cannot describe; the message names the bad value and what would be valid."""


@dataclass(frozen=True)
class BlockShape:
    """`count` blocks of one kind (module docstring); `modulation` parameters act once per sample."""

    kind: str
    count: int
    heads: int
    head_dim: int
    ffn_dim: int
    gated: bool = False  # SwiGLU: the FFN's input projection is 2 x ffn_dim wide
    modulation: int = 0
    context_dim: int = 0  # "cross": the width of the text the keys and values are projected from
    # The activations live at the block's peak, per token it runs on: (whole, split, ffn) = `whole` tensors d wide
    # that every tp rank holds in full (the residual stream, normed inputs, gathered outputs), `split` d wide and
    # `ffn` ffn_dim wide that tp divides (projections, q / k after RoPE, the FFN's hidden). Counted from the live
    # tensors of diffusers' forward per family (`model_shape`), see `activation_bytes`.
    peak: tuple[float, float, float] = (4.0, 0.0, 2.0)
    # the same widths at the attention call: the stream and its normed input whole; q, k, v, the normed and rotated
    # q and k split. The sequence ranks add their exchange buffers there (`SEQUENCE_BUFFERS`)
    attention_peak: tuple[float, float, float] = (2.0, 7.0, 0.0)
    modulation_split: bool = True  # the plans split modulation linears by tp (a table, as Wan's, stays whole)
    # torch ops one eager forward of the block issues (its top-level aten calls: linears, norms, views, RoPE, SDPA),
    # whatever the token count; each costs the profile's op_overhead_s (`OPS_PER_BLOCK`)
    ops: int = 0
    # QK norms over all heads (split by tp, their statistic all-reduced), as (on latent tokens, on text tokens)
    norm_reduces: tuple[int, int] = (0, 0)

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    def linear_params(self) -> dict[str, int]:
        """Token-wise linear weights by the tokens they act on: "latent", "text" or "all" (a single stream)."""
        d, f, g = self.dim, self.ffn_dim, 2 if self.gated else 1
        ffn = d * f * g + f * d
        if self.kind == "joint":
            return {"latent": 4 * d * d + ffn, "text": 4 * d * d + ffn}
        if self.kind == "single":  # q, k, v and the MLP input side by side; one output over [attention, MLP]
            return {"all": 3 * d * d + d * f * g + (d + f) * d}
        if self.kind == "cross":  # self q k v o, cross q o, FFN on the latent; cross k v on the text
            return {"latent": 4 * d * d + 2 * d * d + ffn, "text": 2 * self.context_dim * d}
        raise CostModelError(f"block kind {self.kind!r}: valid kinds are 'joint', 'single', 'cross'.")

    @property
    def params(self) -> int:
        return sum(self.linear_params().values()) + self.modulation


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a transformer; built from a diffusers config by `model_shape`."""

    family: str
    blocks: tuple[BlockShape, ...]
    other_params: int  # embedders, final layer, shared modulation: replicated on every rank
    in_channels: int  # latent channels per token (after patching)
    patch: tuple[int, int, int]  # (frames, height, width) latent patch
    compression: tuple[int, int]  # the VAE's (temporal, spatial) compression
    text_tokens: int
    video: bool
    replicated_params: int = 0  # of other_params, those tp leaves whole (the patch embedding, the final projection)
    # elements per token of the position tables (RoPE cos / sin and the pieces they are built from) held through
    # a forward; the sequence ranks divide them
    rope_width: int = 0
    other_ops: int = 0  # torch ops of a forward outside the blocks (embedders, RoPE tables, the final layer)
    # the all-reduces tp adds outside the blocks, one per rowwise layer of the family's plan (`plans/<family>.py`):
    # (what it acts on: "sample" (one vector) or "text" (per text token), its output width in elements)
    tp_reduces: tuple[tuple[str, int], ...] = ()
    # the FSDP units a forward gathers besides the blocks (`fsdp/shard.outside_units`, the root where it holds
    # weights of its own, HunyuanVideo's token refiner blocks); tests/test_cost_model.py counts them on the classes
    fsdp_units: int = 0

    @property
    def heads(self) -> int:
        return self.blocks[0].heads

    @property
    def block_params(self) -> int:
        return sum(block.params * block.count for block in self.blocks)

    @property
    def params(self) -> int:
        return self.block_params + self.other_params

    def latent_tokens(self, height: int, width: int, frames: int | None = None) -> int:
        temporal, spatial = self.compression
        pt, ph, pw = self.patch
        for name, value in (("height", height), ("width", width)):
            if value % (spatial * ph):
                unit = spatial * ph
                raise CostModelError(f"{name} {value} is not a multiple of {unit} (the VAE's {spatial}x times the "
                                     f"{ph}x patch of {self.family}); try {value // unit * unit or unit}.")
        latent_frames = 1
        if self.video:
            frames = frames or 1
            if (frames - 1) % temporal:
                raise CostModelError(f"frames {frames}: {self.family} takes 1 + a multiple of {temporal} frames, "
                                     f"e.g. {(frames - 1) // temporal * temporal + 1}.")
            latent_frames = (frames - 1) // temporal + 1
        elif frames not in (None, 1):
            raise CostModelError(f"frames {frames}: {self.family} is an image model; leave --frames out.")
        return math.ceil(latent_frames / pt) * (height // (spatial * ph)) * (width // (spatial * pw))


# Top-level torch ops (aten calls not made inside another) one eager forward issues, per block and outside the blocks,
# counted with torch.profiler on diffusers' classes (the difference a block more makes; torch 2.13, diffusers of
# 2026-12; `tests/test_cost_model.py` checks FLUX.1's and Wan's blocks). HunyuanVideo's and LTX's blocks were not
# traced: they take FLUX.1's and Wan's counts, the closest blocks.
OPS_PER_BLOCK = {  # family -> (first block kind, second block kind, outside the blocks)
    "FLUX.1": (114, 68, 108), "FLUX.2": (104, 63, 188), "Qwen-Image": (145, 0, 53), "Wan": (106, 0, 73),
    "HunyuanVideo": (114, 68, 108), "LTX": (106, 0, 73),
}


# The ops the parallel wrappers add, traced the same way on the FLUX.2 benchmark shape with 2 ranks: Ulysses 65 per
# self attention (the layout changes around its exchanges, the length agreement), ring 44 per pass (the block's
# packing, send / receive and the in-place LSE merge; measured at ring 2 on 2026-12-06 23:00 UTC: a forward 730 ops
# against single's 522; 52 before the pass became one message), each collective call of tp 1; outside the blocks
# the sequence split and gather 32, tp's embedder all-reduces 17.
ULYSSES_OPS, RING_OPS_PER_PASS, SEQUENCE_OPS_OUTSIDE, TP_OPS_OUTSIDE = 65, 44, 32, 17
# A cross attention under Ulysses or ring goes through the same routed backend, which attends the rank's queries to
# the whole text locally: its checks and the kernel call with LSE add 11 ops to diffusers' one SDPA call (traced on
# the Wan benchmark shape, 2 ranks, 2026-12-07: a forward 834 ops under ulysses2 and 750 under ring2 against 789 and
# 705 counted without them, 45 more in both, 4 cross attentions)
LOCAL_ATTENTION_OPS = 11

# Copies the sequence ranks add around each self attention, in passes (a read or a write of one element) over this
# rank's share of q, k, v or the output (its tokens x d / tp elements; after Ulysses' exchange the same count, as
# tokens x ring x d / (tp u)), counted from context_parallel/attention.py: Ulysses packs q, k and v into one send
# buffer (read and written: 6) and concatenates what it receives into one (6), then packs the output (2) and
# concatenates what comes back (2): 16. Ring stacks k and v into the block that travels (4), and merges each further
# block's output into its float32 accumulator in place by log-sum-exp (out x keep_old: 2; + block_out x keep_new: 3):
# 5 a pass, at 4 bytes an element whatever the dtype. Timed at the profile's copy bandwidth (calibrated on the same
# packing and concatenation, `calibrate._layout_copies`).
ULYSSES_COPY_PASSES, RING_BLOCK_PASSES, RING_MERGE_PASSES = 16, 4, 5


def _with_ops(shape: "ModelShape") -> "ModelShape":
    first, second, other = OPS_PER_BLOCK[shape.family]
    blocks = tuple(replace(block, ops=(first, second)[i]) for i, block in enumerate(shape.blocks))
    return replace(shape, blocks=blocks, other_ops=other)


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise CostModelError(f"the config has none of {list(keys)}; it does not look like the class it names.")
    return default


def _patch(value: Any, temporal: int = 1) -> tuple[int, int, int]:
    if isinstance(value, (list, tuple)):
        return (int(value[0]), int(value[1]), int(value[2])) if len(value) == 3 else (temporal, value[0], value[1])
    return (temporal, int(value), int(value))


def model_shape(config: dict[str, Any], text_tokens: int | None = None) -> ModelShape:
    """The shape of a transformer from its diffusers config, with its ops counted (`OPS_PER_BLOCK`)."""
    return _with_ops(_model_shape(config, text_tokens))


def _model_shape(config: dict[str, Any], text_tokens: int | None = None) -> ModelShape:
    """The shape of a transformer from its diffusers config (`_class_name` names the family).

    Families: FluxTransformer2DModel (FLUX.1), Flux2Transformer2DModel, QwenImageTransformer2DModel,
    WanTransformer3DModel (Wan 2.x), HunyuanVideoTransformer3DModel, LTXVideoTransformer3DModel. `text_tokens`:
    the prompt length the pipeline pads to (default: each family's pipeline default).
    """
    cls = config.get("_class_name")
    heads = _get(config, "num_attention_heads")
    head_dim = _get(config, "attention_head_dim")
    d = heads * head_dim
    in_channels = _get(config, "in_channels", default=16)
    if cls == "FluxTransformer2DModel":
        # peaks: the double block's at the FFN (stream in, gated attention, new stream, normed; hidden and GELU),
        # the single block's in attention (both streams and their concatenation, normed; q k v, normed and rotated
        # q k, the MLP's activation)
        joint = BlockShape("joint", _get(config, "num_layers"), heads, head_dim, 4 * d, modulation=2 * 6 * d * d,
                           peak=(4, 0, 2))
        single = BlockShape("single", _get(config, "num_single_layers"), heads, head_dim, 4 * d, modulation=3 * d * d,
                            peak=(3, 7, 1))
        replicated = 2 * in_channels * d
        guidance = 1 if config.get("guidance_embeds") else 0  # time, pooled text and guidance MLPs
        other = replicated + _get(config, "joint_attention_dim") * d \
            + (256 + _get(config, "pooled_projection_dim", default=768) + guidance * 256) * d \
            + (2 + guidance) * d * d + 2 * d * d
        # plans/flux.py: the text projection, the time / pooled-text (/ guidance) MLPs' outputs, the final modulation
        reduces = (("text", d), ("sample", d), ("sample", d)) + (("sample", d),) * guidance + (("sample", 2 * d),)
        return ModelShape("FLUX.1", (joint, single), other, in_channels, (1, 2, 2), (1, 8),
                          text_tokens or 512, video=False, replicated_params=replicated, rope_width=2 * head_dim,
                          tp_reduces=reduces, fsdp_units=5)
    if cls == "Flux2Transformer2DModel":
        ffn = int(d * float(config.get("mlp_ratio", 3.0)))
        # peaks: the double block's at the SwiGLU (stream in, gated attention, new stream, normed; gate-and-up,
        # SiLU, product), the single block's at its output projection (stream, normed, output; the fused
        # q k v gate up projection, rotated q k, [attention, MLP] and the SwiGLU product)
        joint = BlockShape("joint", _get(config, "num_layers"), heads, head_dim, ffn, gated=True, peak=(4, 0, 4))
        single = BlockShape("single", _get(config, "num_single_layers"), heads, head_dim, ffn, gated=True,
                            peak=(3, 6, 4), attention_peak=(2, 8, 2))  # + the fused projection's gate and up
        shared_modulation = (6 + 6 + 3) * d * d  # FLUX.2 modulates every block from three shared linears
        embedders = 2 if config.get("guidance_embeds", True) else 1
        replicated = 2 * in_channels * d
        other = replicated + _get(config, "joint_attention_dim") * d \
            + embedders * (_get(config, "timestep_guidance_channels", default=256) * d + d * d) \
            + shared_modulation + 2 * d * d
        # plans/flux2.py: the three shared modulations, the text projection, the final modulation, the time (and
        # guidance) MLPs' outputs
        reduces = (("sample", 6 * d), ("sample", 6 * d), ("sample", 3 * d), ("text", d), ("sample", 2 * d)) \
            + (("sample", d),) * embedders
        return ModelShape("FLUX.2", (joint, single), other, in_channels, (1, 2, 2), (1, 8),
                          text_tokens or 512, video=False, replicated_params=replicated, rope_width=4 * head_dim,
                          tp_reduces=reduces, fsdp_units=8)
    if cls == "QwenImageTransformer2DModel":
        # peak at the FFN; Qwen-Image keeps more d-wide tensors of the stream alive than FLUX.1 (the modulated
        # inputs and gates of both halves)
        joint = BlockShape("joint", _get(config, "num_layers"), heads, head_dim, 4 * d, modulation=2 * 6 * d * d,
                           peak=(7, 0, 2))
        replicated = in_channels * d + d * _get(config, "out_channels", default=in_channels // 4) * 4
        other = replicated + _get(config, "joint_attention_dim") * d + 256 * d + d * d + 2 * d * d
        # plans/qwenimage.py: the text projection, the time MLP's output, the final modulation
        return ModelShape("Qwen-Image", (joint,), other, in_channels, (1, 2, 2), (1, 8),
                          text_tokens or 512, video=False, replicated_params=replicated, rope_width=head_dim,
                          tp_reduces=(("text", d), ("sample", d), ("sample", 2 * d)), fsdp_units=6)
    if cls == "WanTransformer3DModel":
        # peak at the FFN: the stream's float copy, the cross-attention output, the new stream and its normed input;
        # the FFN's hidden and its GELU
        # its QK norms span all heads: self q, k and cross q on the latent, cross k on the text
        cross = BlockShape("cross", _get(config, "num_layers"), heads, head_dim, _get(config, "ffn_dim"),
                           modulation=6 * d, context_dim=d, peak=(4, 0, 2), modulation_split=False,
                           norm_reduces=(3, 1))
        patch = _patch(_get(config, "patch_size", default=(1, 2, 2)))
        text_dim = _get(config, "text_dim", default=4096)
        volume = patch[0] * patch[1] * patch[2]
        replicated = in_channels * d * volume + d * _get(config, "out_channels", default=16) * volume
        other = replicated + text_dim * d + d * d + _get(config, "freq_dim", default=256) * d + d * d + 6 * d * d
        if config.get("image_dim"):  # I2V: image tokens get their own cross keys and values (counted as text)
            cross = replace(cross, modulation=cross.modulation + 2 * d * d, norm_reduces=(3, 2))
        spatial = 16 if in_channels == 48 else 8  # Wan 2.2 TI2V-5B's VAE compresses 16x
        # plans/wan.py: the time MLP's and text MLP's outputs, the 6-way modulation projection
        return ModelShape("Wan", (cross,), other, in_channels, patch, (4, spatial), text_tokens or 512, video=True,
                          replicated_params=replicated, rope_width=2 * head_dim,
                          tp_reduces=(("sample", d), ("text", d), ("sample", 6 * d)), fsdp_units=4)
    if cls == "HunyuanVideoTransformer3DModel":
        ratio = float(config.get("mlp_ratio", 4.0))
        joint = BlockShape("joint", _get(config, "num_layers"), heads, head_dim, int(d * ratio),
                           modulation=2 * 6 * d * d)
        single = BlockShape("single", _get(config, "num_single_layers"), heads, head_dim, int(d * ratio),
                            modulation=3 * d * d, peak=(3, 7, 1))  # FLUX.1's single block, as written there
        p = _get(config, "patch_size", default=2)
        patch = (_get(config, "patch_size_t", default=1), p, p)
        refiner = _get(config, "num_refiner_layers", default=2) * 14 * d * d  # the text token refiner's blocks
        replicated = 2 * in_channels * d * p * p
        other = replicated + _get(config, "text_embed_dim", default=4096) * d + 2 * 256 * d + 3 * d * d + refiner
        # plans/hunyuan_video.py: the token refiner's input projection, its time / text MLPs, each refiner block's
        # attention output, FFN output and modulation; the time / text (/ guidance) MLPs, the final modulation
        guidance = 1 if config.get("guidance_embeds", True) else 0
        refiners = _get(config, "num_refiner_layers", default=2)
        reduces = (("text", d), ("sample", d), ("sample", d)) + (("text", d), ("text", d), ("sample", 2 * d)) \
            * refiners + (("sample", d),) * (2 + guidance) + (("sample", 2 * d),)
        return ModelShape("HunyuanVideo", (joint, single), other, in_channels, patch, (4, 8),
                          text_tokens or 256, video=True, replicated_params=replicated, rope_width=2 * head_dim,
                          tp_reduces=reduces, fsdp_units=3 + refiners)
    if cls == "LTXVideoTransformer3DModel":
        cross = BlockShape("cross", _get(config, "num_layers"), heads, head_dim, 4 * d, modulation=6 * d,
                           context_dim=_get(config, "cross_attention_dim", default=d), peak=(4, 0, 2),
                           modulation_split=False, norm_reduces=(3, 1))
        p = _get(config, "patch_size", default=1)
        patch = (_get(config, "patch_size_t", default=1), p, p)
        replicated = 2 * in_channels * d
        other = replicated + _get(config, "caption_channels", default=4096) * d + 256 * d + 6 * d * d
        # plans/ltx.py: the time MLP's output, the 6-way modulation, the caption projection's output
        return ModelShape("LTX", (cross,), other, in_channels, patch, (8, 32), text_tokens or 128, video=True,
                          replicated_params=replicated, rope_width=2 * head_dim,
                          tp_reduces=(("sample", d), ("sample", 6 * d), ("text", d)), fsdp_units=5)
    known = ("FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel",
             "WanTransformer3DModel", "HunyuanVideoTransformer3DModel", "LTXVideoTransformer3DModel")
    raise CostModelError(f"no cost model for transformer class {cls!r}; known: {', '.join(known)}.")


@dataclass(frozen=True)
class Mesh:
    """The degrees of a mesh: tp x ulysses x ring x cfg x data ranks, and fsdp sharding the weights as `--fsdp` does:
    over the sequence ranks (fsdp = ulysses x ring, adding no rank), or over fsdp ranks of its own without them."""

    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    data: int = 1
    fsdp: int = 1

    @property
    def world(self) -> int:
        own = self.fsdp if self.sequence == 1 else 1  # without ulysses / ring, fsdp's ranks are its own
        return self.tp * self.ulysses * self.ring * self.cfg * self.data * own

    @property
    def sequence(self) -> int:
        return self.ulysses * self.ring

    @property
    def name(self) -> str:
        parts = [f"{dim}{getattr(self, dim)}" for dim in ("data", "cfg", "ring", "ulysses", "tp")
                 if getattr(self, dim) > 1]
        fsdp = f"fsdp{self.fsdp}" if self.fsdp > 1 else ""
        return "+".join(filter(None, ["x".join(parts), fsdp])) or "single"

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """A mesh spelled like the CLI's modes ("tp2xulysses2", "dp2", "single"), "+fsdpN" for FSDP over them."""
        degrees: dict[str, int] = {}
        base, _, fsdp = text.partition("+")
        for part in ([] if base.strip() in ("", "single") else base.split("x")) + ([fsdp] if fsdp else []):
            name = part.strip().rstrip("0123456789")
            number = part.strip()[len(name):]
            name = {"dp": "data"}.get(name, name)
            if name not in MESH_DIMENSIONS or not number or int(number) < 1 or name in degrees:
                raise CostModelError(f"mesh {text!r}: bad part {part!r}; write parts like 'tp2' joined by 'x' from "
                                     f"{', '.join(MESH_DIMENSIONS)} (dp for data), or 'single'.")
            degrees[name] = int(number)
        return cls(**degrees)


@dataclass
class Traffic:
    """One kind of collective in a forward: `calls` of it, each moving `size` bytes per rank, on a group of `group`."""

    op: str  # "all_reduce", "all_to_all", "all_gather", "p2p"
    group: int
    calls: int
    size: float
    overlapped: bool = False  # hidden behind compute where the compute is longer (ring passes, FSDP prefetch)
    fsdp: bool = False  # FSDP's gathers: `calls` units, `size` the average unit's gathered bytes

    @property
    def wire(self) -> float:
        """Bytes each rank sends per call, by the ring algorithms' counts."""
        g = self.group
        return {"all_reduce": 2 * (g - 1) / g, "all_gather": (g - 1) / g, "all_to_all": (g - 1) / g,
                "p2p": 1.0}[self.op] * self.size


@dataclass
class ForwardCost:
    """One transformer forward on one rank of a mesh."""

    linear_flops: float
    attention_flops: float
    bytes: float
    traffic: list[Traffic] = field(default_factory=list)
    elementwise_bytes: float = 0.0  # what the norms, modulation, gates, RoPE and activations read and write
    ops: int = 0  # torch ops issued (each costs the profile's op_overhead_s, whatever its size)
    copy_bytes: float = 0.0  # the sequence ranks' packing, concatenation and LSE merges around attention

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    def wire_bytes(self) -> float:
        return sum(item.wire * item.calls for item in self.traffic)


# Elementwise passes per token of a block (each op's reads and writes of a tensor, in d-wide units): on the whole
# stream (tp leaves it whole) a joint block's two norms (2 passes each), two modulations (x (1 + scale) + shift, 4
# each) and two gated residuals (5 each); split by tp, q and k's RMS norms (10 each), RoPE (8 each) and the
# copies into and out of attention's head layout (8). A single block has one of each whole-stream op, a cross block
# a third norm, residual and attention's q norm and copies. The FFN's activation adds 2 ffn-wide passes (GELU) or 5
# (SiLU x up), a single block's [attention, MLP] concatenation 2. Not fused by torch eagerly, they took 22% (FLUX.2)
# and 27% (Wan) of a one-thread CPU forward (torch.profiler, benchmarks/bench_cost_model.py's shapes).
ELEMENTWISE_PASSES = {"joint": (22, 44), "single": (11, 46), "cross": (29, 58)}


def block_cost(block: BlockShape, latent: int, text: int, dtype_bytes: int = 2, mesh: Mesh = Mesh()) -> ForwardCost:
    """One block's cost on one rank: `latent` and `text` are the whole sequence's token counts (the mesh splits them).

    Counted for the whole sequence, then divided: TP splits every token-wise linear and the heads, the sequence
    ranks split the tokens; attention FLOPs divide by both.
    """
    t, seq = mesh.tp, mesh.sequence
    d, b = block.dim, dtype_bytes
    params = block.linear_params()
    tokens = {"latent": latent, "text": text, "all": latent + text}
    # a cross block's text (its cross keys and values) is not split by the sequence ranks: every rank projects all
    # of it (counted here as seq times the text, so that the division by the sequence ranks below leaves it whole)
    text_share = seq if block.kind == "cross" else 1
    linear = sum(2 * tokens[kind] * p * (text_share if kind == "text" else 1) for kind, p in params.items())
    weights = sum(params.values())
    moved = 0.0
    d_ffn = block.ffn_dim * (2 if block.gated else 1)
    for kind, n in (("latent", latent), ("text", text), ("all", latent + text)):
        if kind not in params:
            continue
        if block.kind == "joint" or block.kind == "single":  # qkv, o, ffn in, ffn out: inputs and outputs
            moved += n * ((d + 3 * d) + (d + d) + (d + d_ffn) + (block.ffn_dim + d))
        elif kind == "latent":
            moved += n * ((d + 3 * d) + (d + d) + (d + d) + (d + d) + (d + d_ffn) + (block.ffn_dim + d))
        else:
            moved += n * (block.context_dim + 2 * d) * text_share
    if block.kind == "cross":
        attn = 4 * latent * latent * d + 4 * latent * text * d
        moved += 4 * latent * d + 2 * text * d
    else:
        attn = 4 * (latent + text) ** 2 * d
        moved += 4 * (latent + text) * d
    cost = ForwardCost(linear / (t * seq), attn / (t * seq), (weights * b) / t + moved * b / (t * seq))
    whole, split = ELEMENTWISE_PASSES[block.kind]
    ffn_passes = (5 if block.gated else 2) + (2 if block.kind == "single" else 0)
    stream_tokens = latent if block.kind == "cross" else latent + text
    cost.elementwise_bytes = stream_tokens / seq * (whole * d + (split * d + ffn_passes * block.ffn_dim) / t) * b
    # every rank issues all of the block's ops, on its share of the work
    cost.ops = block.ops + (ULYSSES_OPS if mesh.ulysses > 1 else 0) + RING_OPS_PER_PASS * (mesh.ring - 1)
    if seq > 1 and block.kind == "cross":
        cost.ops += LOCAL_ATTENTION_OPS
    # communication; sizes are this rank's tensors
    self_tokens = latent + text if block.kind != "cross" else latent
    local = self_tokens / seq
    if t > 1:
        latent_norms, text_norms = block.norm_reduces
        # the modulation linears split on their replicated input: a joint block's two (6 d each), a single's one
        modulation_linears = (2 if block.kind == "joint" else 1) if block.modulation and block.modulation_split else 0
        cost.ops += {"joint": 4, "single": 1, "cross": 3}[block.kind] + latent_norms + text_norms \
            + modulation_linears  # all-reduce calls
        if block.kind == "joint":
            cost.traffic += [Traffic("all_reduce", t, 2, latent / seq * d * b),
                             Traffic("all_reduce", t, 2, text / seq * d * b)]
        else:
            calls = 1 if block.kind == "single" else 3
            cost.traffic.append(Traffic("all_reduce", t, calls, local * d * b))
        # a norm's statistic: one float32 per token (the text, which a cross block's keys come from, is whole)
        if latent_norms:
            cost.traffic.append(Traffic("all_reduce", t, latent_norms, latent / seq * 4))
        if text_norms:
            cost.traffic.append(Traffic("all_reduce", t, text_norms, text * 4))
        if modulation_linears:
            cost.traffic.append(Traffic("all_reduce", t, modulation_linears,
                                        block.modulation / modulation_linears / d * b))
    heads_width = d / t
    share = local * heads_width  # elements of one of this rank's q, k, v or output
    if mesh.ulysses > 1:
        cost.copy_bytes += ULYSSES_COPY_PASSES * share * b
    if mesh.ring > 1:
        cost.copy_bytes += RING_BLOCK_PASSES * share * b + RING_MERGE_PASSES * (mesh.ring - 1) * share * 4
    if seq > 1:  # both attentions first agree on the ranks' sequence lengths: one small all-gather per call
        cost.traffic.append(Traffic("all_gather", seq, 1, 8 * seq))
    if mesh.ulysses > 1:
        piece = local * heads_width * b  # one of q, k, v or the output: this rank's tokens, its tp share of heads
        cost.traffic += [Traffic("all_to_all", mesh.ulysses, 1, 3 * piece),
                         Traffic("all_to_all", mesh.ulysses, 1, piece)]
    if mesh.ring > 1:  # after Ulysses' exchange a rank holds self_tokens / ring tokens of d / (t u) features
        kv = 2 * (self_tokens / mesh.ring) * (heads_width / mesh.ulysses) * b
        cost.traffic.append(Traffic("p2p", mesh.ring, mesh.ring - 1, kv, overlapped=True))
    return cost


def forward_cost(shape: ModelShape, latent: int, dtype_bytes: int = 2, mesh: Mesh = Mesh()) -> ForwardCost:
    """One transformer forward (all blocks) on one rank of `mesh`; FSDP's all-gathers and CFG's exchange included."""
    total = ForwardCost(0.0, 0.0, 0.0, ops=shape.other_ops + (SEQUENCE_OPS_OUTSIDE if mesh.sequence > 1 else 0)
                        + (TP_OPS_OUTSIDE if mesh.tp > 1 else 0))
    for block in shape.blocks:
        one = block_cost(block, latent, shape.text_tokens, dtype_bytes, mesh)
        total.linear_flops += one.linear_flops * block.count
        total.attention_flops += one.attention_flops * block.count
        total.bytes += one.bytes * block.count
        total.elementwise_bytes += one.elementwise_bytes * block.count
        total.copy_bytes += one.copy_bytes * block.count
        total.ops += one.ops * block.count
        total.traffic += [replace(item, calls=item.calls * block.count) for item in one.traffic]
    if mesh.tp > 1:  # the rowwise layers outside the blocks; a cross family keeps its text whole on every rank
        text = shape.text_tokens / (mesh.sequence if shape.blocks[0].kind != "cross" else 1)
        total.traffic += [Traffic("all_reduce", mesh.tp, 1, (text if acts == "text" else 1) * width * dtype_bytes)
                          for acts, width in shape.tp_reduces]
    if mesh.sequence > 1:  # the output gathered at the final projection, after agreeing on the ranks' lengths
        volume = math.prod(shape.patch) if shape.video else 1  # a video model's projection unpatches per token
        total.traffic += [Traffic("all_gather", mesh.sequence, 1, 8 * mesh.sequence),
                          Traffic("all_gather", mesh.sequence, 1,
                                  latent / mesh.sequence * shape.in_channels * volume * dtype_bytes)]
    if mesh.fsdp > 1:  # every unit gathered once: the blocks, then what FSDP shards outside them
        units = sum(block.count for block in shape.blocks) + shape.fsdp_units
        total.traffic.append(Traffic("all_gather", mesh.fsdp, units, tp_rank_params(shape, mesh.tp) * dtype_bytes
                                     / units, overlapped=True, fsdp=True))
    if mesh.cfg > 1:  # the other branch's prediction, once per step
        total.traffic.append(Traffic("all_gather", mesh.cfg, 1, latent * shape.in_channels * dtype_bytes * mesh.cfg
                                     / mesh.sequence))
    return total


@dataclass
class Memory:
    """Per-rank bytes: the weights this rank holds, FSDP's gathered blocks, and the peak activations of a forward."""

    weights: float
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gathered + self.activations


# d-wide buffers (split by tp) that sequence parallelism adds at the attention call, per token of the rank: Ulysses
# q, k, v sent and received (the permuted copies and the all-to-all's outputs); ring the keys and values in hand
# and the pair arriving, and the float output accumulator of the LSE merge.
SEQUENCE_BUFFERS = {"ulysses": 6.0, "ring": 5.0}


def activation_bytes(block: BlockShape, tokens: float, dtype_bytes: int, tp: int, mesh: Mesh = Mesh()) -> float:
    """The activations live at `block`'s peak on one rank running `tokens` tokens: its `peak` widths, the split ones
    divided by tp. The widths were counted from the tensors alive at the block's peak in diffusers' forward
    (one tensor-allocating op at a time, fp32 on CPU; `tests/test_cost_model.py` checks them on tiny models): the
    peak is where the FFN's hidden (or a fused projection) meets the d-wide tensors the block still references."""
    def width(whole: float, split: float, ffn: float) -> float:
        return whole * block.dim + (split * block.dim + ffn * block.ffn_dim) / tp

    whole, split, ffn = block.attention_peak
    split += sum(SEQUENCE_BUFFERS[dim] for dim in SEQUENCE_BUFFERS if getattr(mesh, dim) > 1)
    return tokens * max(width(*block.peak), width(whole, split, ffn)) * dtype_bytes


def tp_rank_params(shape: ModelShape, tp: int) -> float:
    """The parameters one tp rank holds (before FSDP shards them): block linears, modulation linears and the text /
    time embedders split by tp as the plans split them; the patch embedding, the final projection and modulation
    tables whole."""
    linear = sum(sum(block.linear_params().values()) * block.count for block in shape.blocks)
    split_modulation = sum(block.modulation * block.count for block in shape.blocks if block.modulation_split)
    whole_modulation = sum(block.modulation * block.count for block in shape.blocks if not block.modulation_split)
    split = linear + split_modulation + shape.other_params - shape.replicated_params
    return split / tp + whole_modulation + shape.replicated_params


def memory(shape: ModelShape, latent: int, dtype_bytes: int = 2, mesh: Mesh = Mesh()) -> Memory:
    """Per-rank memory of the transformer on `mesh`. Weights: block linears, modulation linears and the text / time
    embedders split by tp as the plans split them; the patch embedding, the final projection and modulation tables
    whole; all of it sharded by fsdp, which holds two gathered blocks at a time (the one running and the one
    prefetched). Activations: the largest block peak on this rank's tokens, plus what the whole forward holds
    beside it: the position tables of this rank's tokens and, with cross attention, the projected text."""
    t = mesh.tp
    weights = tp_rank_params(shape, t) / mesh.fsdp * dtype_bytes
    largest = max(block.params for block in shape.blocks)
    gathered = 2 * largest / t * dtype_bytes if mesh.fsdp > 1 else 0.0
    cross = all(block.kind == "cross" for block in shape.blocks)
    tokens = (latent if cross else latent + shape.text_tokens) / mesh.sequence
    peak = max(activation_bytes(block, tokens, dtype_bytes, t, mesh) for block in shape.blocks)
    held = tokens * shape.rope_width * dtype_bytes
    if cross:
        held += shape.text_tokens * shape.blocks[0].dim * dtype_bytes
    return Memory(weights, gathered, peak + held)
