"""`make demo`, second part: the shipped demo transformer loaded with tp=2 on 2 local CPU processes.

Each rank reads only its slices of the checkpoint (shard-on-read); the script prints per-rank load time, the bytes
of parameters each rank holds and the max difference of one forward to the single-process forward.
"""

from __future__ import annotations

import argparse
import time

import torch

from paradiff.distributed.spawn import run_ranks
from paradiff.demo import CALL_KWARGS, pipeline_path


def _inputs(config) -> dict:
    """One denoising step's inputs at the demo's size (64x64 pixels, 20 text tokens), seeded."""
    import json

    from diffusers import Flux2Pipeline

    generator = torch.Generator().manual_seed(0)
    vae = json.loads((pipeline_path() / "vae" / "config.json").read_text())
    # the VAE downsamples by 2 per block after the first, the pipeline packs 2x2 latent patches into one token
    grid = CALL_KWARGS["height"] // (2 ** (len(vae["block_out_channels"]) - 1) * 2)
    text = CALL_KWARGS["max_sequence_length"]
    return dict(
        hidden_states=torch.randn(1, grid * grid, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, generator=generator),
        timestep=torch.tensor([0.5]),
        img_ids=Flux2Pipeline._prepare_latent_ids(torch.zeros(1, 1, grid, grid)),
        txt_ids=Flux2Pipeline._prepare_text_ids(torch.zeros(1, text, 1)),
        return_dict=False,
    )


def _rank_main(rank: int, world_size: int) -> tuple[float, int, float]:
    from diffusers import Flux2Transformer2DModel

    import paradiff

    start = time.perf_counter()
    model = paradiff.from_pretrained(Flux2Transformer2DModel, pipeline_path(), subfolder="transformer",
                                     parallel_config=paradiff.TensorParallelConfig(tp_degree=world_size))
    load_s = time.perf_counter() - start
    local_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    reference = Flux2Transformer2DModel.from_pretrained(pipeline_path(), subfolder="transformer").eval()
    inputs = _inputs(reference.config)
    with torch.no_grad():
        difference = (model(**inputs)[0] - reference(**inputs)[0]).abs().max()
    return load_s, local_bytes, float(difference)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    folder = pipeline_path() / "transformer"
    world = 2
    # hard_exit: a rank skips interpreter finalisation, which can race gloo's threads releasing the last
    # collectives and abort
    results = run_ranks(_rank_main, world, gloo_timeout_s=120, hard_exit=True)
    full_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    print(f"demo FLUX.2 transformer, checkpoint {full_bytes / 1e6:.1f} MB in {folder}, tp=2 on 2 CPU processes "
          "(gloo)")
    print("rank | load time (s) | local parameter bytes | max |diff| vs single process")
    for rank in range(world):
        load_s, local_bytes, diff = results[rank]
        print(f"{rank:>4} | {load_s:>13.3f} | {local_bytes:>21,} | {diff:.2e}")
    worst = max(results[rank][2] for rank in range(world))
    print("OK: tp=2 output equals the single-process output" if worst < 1e-5 else f"MISMATCH: {worst:.2e}")
    if worst >= 1e-5:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
