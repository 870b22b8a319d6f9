"""Per-GPU memory on paper (docs/fsdp.md): Wan 2.2 A14B at 1280x720 x 81 frames and FLUX.2-dev at 1024x1024, on 4
and 8 ranks, bf16 and int8 weights, with and without FSDP's CPU offload (`--fsdp-offload`: the shards in host
memory, the CPU column), from the models' published configs (written out below: nothing is downloaded), with the
code `paradiff generate --dry-run` runs (plan_tools/memory.py).

    python benchmarks/fsdp_paper.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from diffusers import Flux2Transformer2DModel, WanTransformer3DModel

from paradiff.config import ParallelConfig, parse_mode
from paradiff.plan_tools.memory import GIB, image_tokens_of, meta_model, per_rank_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, write_result  # noqa: E402

# Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json (transformer_2 is the same shape)
WAN22_A14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# black-forest-labs/FLUX.2-dev transformer/config.json
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), guidance_embeds=True)


def rows():
    wan = meta_model(WanTransformer3DModel, WAN22_A14B)
    flux = meta_model(Flux2Transformer2DModel, FLUX2_DEV)
    cases = [("Wan 2.2 A14B (x2 experts), 1280x720x81", wan, 2, image_tokens_of(wan.config, 720, 1280, 81), 512),
             ("FLUX.2-dev, 1024x1024", flux, 1, image_tokens_of(flux.config, 1024, 1024, None), 512)]
    for label, model, experts, tokens, text in cases:
        for ranks in (4, 8):
            for mode, offload in ((f"ulysses{ranks}", False), (f"fsdp{ranks}xulysses{ranks}", False),
                                  (f"fsdp{ranks}xulysses{ranks}", True)):
                for weights, per in (("bf16", None), ("int8", 1.0)):
                    degrees = parse_mode(mode)
                    parallel = ParallelConfig.from_degrees(ulysses=degrees["ulysses"], fsdp=degrees["fsdp"],
                                                           fsdp_offload=offload)
                    memory = per_rank_bytes(model, parallel, torch.bfloat16, image_tokens=tokens, text_tokens=text,
                                            weight_bytes_per_element=per)
                    held = experts * memory.weights
                    peak = held + memory.gathered + memory.activations
                    yield (label, ranks, mode + (" + offload" if offload else ""), weights, held / GIB,
                           experts * memory.host / GIB, memory.gathered / GIB, memory.activations / GIB, peak / GIB)


def main() -> None:
    print("| model | ranks | mesh | weights | held | CPU | gathered | activations | peak per GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    figures = []
    for label, ranks, mode, weights, held, host, gathered, activations, peak in rows():
        print(f"| {label} | {ranks} | {mode} | {weights} | {held:.1f} GiB | {host:.1f} GiB | {gathered:.1f} GiB | "
              f"{activations:.1f} GiB | **{peak:.1f} GiB** |")
        if mode.startswith("fsdp") and weights == "bf16" and "offload" not in mode:
            figures.append(figure(f"{label}: peak per GPU, {mode}, bf16", round(peak, 1), "GiB",
                                  note=f"held {held:.1f} GiB, gathered {gathered:.1f} GiB"))
        if "offload" in mode and label.startswith("Wan") and ranks == 4:  # the 24 GB card (22.35 GiB)
            figures.append(figure(f"{label}: peak per GPU, {mode}, {weights}", round(peak, 1), "GiB",
                                  goal="<= 22.3", note=f"{host:.1f} GiB of shards in CPU memory per rank, "
                                  f"gathered {gathered:.1f} GiB, activations {activations:.1f} GiB (estimate)"))
    write_result("fsdp_paper", "Per-GPU memory on paper with FSDP (and its CPU offload): Wan 2.2 A14B and FLUX.2-dev",
                 figures,
                 device="none (on paper, meta device)", timed=False)


if __name__ == "__main__":
    main()
