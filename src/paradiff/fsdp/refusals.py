"""What FSDP2 cannot hold, stated once: a mechanism's rules, read by `api/fsdp.py: check_fsdp`, `--parallel auto`
and diffusers' group offload on a split model (`runtime/offload.py`)."""

from __future__ import annotations


def fsdp_refusal(degree: int, tp_degree: int, scheme: str | None = None, *, saved: bool = False,
                 single_file: bool = False, stages: bool = False, group_offload: bool = False) -> str | None:
    """Why FSDP2 cannot hold this combination (quantization `scheme`, a pre-quantized checkpoint, a GGUF file, TP,
    stages, diffusers' group offloading), naming what to change; None when it can. The one statement of these rules:
    `check_fsdp` raises it, `--parallel auto` skips the meshes it refuses, `enable_group_offload` on an FSDP model
    raises it (runtime/offload.py) before any hook is placed."""
    what = f"fsdp_degree={degree}"
    if group_offload:
        return (f"enable_group_offload on a model loaded with {what}: diffusers' group offloading moves each "
                "parameter's data between devices, while FSDP2 gathers every block from shard buffers of its own "
                "that the offload would not move, so the two would not agree on where a weight is. FSDP2 offloads "
                "its shards itself: load with fsdp_offload=True (--fsdp-offload), or use group offload with "
                "fsdp_degree=1.")
    if saved:
        return (f"{what} with a pre-quantized checkpoint: paradiff's FSDP quantizes each rank's rows as it reads them "
                "from a float checkpoint (int8 / fp8) or reads a GGUF file's packed rows; a checkpoint saved quantized "
                "is not read in rows yet. Load the unquantized folder with quantization_config (int8 / fp8), or use "
                "tp / ulysses / ring and fsdp_degree=1.")
    if scheme == "nf4":
        return (f"{what} with nf4 quantization: bitsandbytes' Params4bit holds its weight flattened into packed bytes "
                "whose rows are not the weight's rows, with its scales in a QuantState object beside the tensor, so "
                "FSDP2 can neither cut it by rows nor gather the scales with it (docs/fsdp.md). Use int8 / fp8 or a "
                "GGUF file with FSDP, or nf4 with tp / ulysses / ring and fsdp_degree=1.")
    if (scheme is not None or single_file) and tp_degree > 1:
        kind = "GGUF weights" if single_file or scheme == "gguf" else f"{scheme} quantization"
        return (f"{what} with tp_degree={tp_degree} and {kind}: quantized FSDP shards whole rows of each "
                "weight, not rows of a TP slice. Drop tp (fsdp with ulysses / ring / cfg composes), or fsdp.")
    if stages:
        return (f"{what} with staged execution (stages=True / --stages): a staged load frees and re-reads whole "
                "components, FSDP keeps each rank's rows resident. Use one of the two.")
    return None
