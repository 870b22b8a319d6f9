"""`make demo` for the transformer: tp=2 over 2 local CPU processes against the single-process forward.

Builds a tiny FLUX.2-architecture transformer with random weights once (cached under .cache/), loads it with
shard-on-read on each rank, runs one forward and prints per-rank load time, local parameter bytes and the max
difference to the single-process output.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .testing.dist import free_port

DEMO_CONFIG = dict(heads=8, head_dim=32, layers=2, single_layers=2)


def ensure_checkpoint(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    from .testing.models import build_model, save_model

    save_model(build_model("flux2", **DEMO_CONFIG), folder, sharded=True)
    return folder


def _rank_main(rank: int, world: int, port: int, folder: str, results: dict) -> None:
    import torch.distributed as dist
    from diffusers import Flux2Transformer2DModel

    import paradiff
    from paradiff.testing.models import Lengths, make_inputs, run_forward

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        start = time.perf_counter()
        model = paradiff.from_pretrained(Flux2Transformer2DModel, folder,
                                         parallel_config=paradiff.TensorParallelConfig(tp_degree=world))
        load_s = time.perf_counter() - start
        local_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        inputs = make_inputs("flux2", model.config, lengths=Lengths(height=16, width=16, text=32))
        output = run_forward(model, inputs)
        reference = run_forward(Flux2Transformer2DModel.from_pretrained(folder).eval(), inputs)
        results[rank] = (load_s, local_bytes, float((output - reference).abs().max()))
    finally:
        dist.destroy_process_group()
    # skip interpreter finalisation, which can race gloo's threads releasing the last collectives and abort
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=".cache/paradiff", help="where the tiny checkpoint is kept")
    args = parser.parse_args(argv)
    folder = ensure_checkpoint(Path(args.cache) / "demo-flux2-transformer")
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(world, free_port(), str(folder), results), nprocs=world, join=True)
        full_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        print(f"tiny FLUX.2 transformer, checkpoint {full_bytes / 1e6:.1f} MB in {folder}, tp=2 on 2 CPU processes (gloo)")
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
