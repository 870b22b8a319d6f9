"""Adapters per sample (api/lora_slots.py) on a small FLUX.2 transformer, single process, CPU, fp32: a mixed batch of
4 (4 different adapters in one call) against a same-adapter batch of 4 and against 4 single calls (one sample each,
with its adapter); the time of loading an adapter into a slot next to loading the transformer; and the graphs Dynamo
compiles when the compiled model switches every sample's adapter.

Model: FLUX.2 with 8 heads x 64 (512 wide), 2 double + 2 single blocks, saved once; inputs 256 image + 64 text tokens
(a 16 x 16 latent grid). Adapters: four random rank-32 LoRAs (alpha 32) on every Linear of the first double and first
single block and `proj_out`, diffusers-format safetensors files. Slots: max_loras 4, max_lora_rank 32.

Rounds interleave the three variants (mixed, same adapter, 4 singles); each figure is the median over rounds of the
per-round ratio. Written to benchmarks/results/bench_lora_batch.json (results.py: write_result, which notes a machine
under load).

    python benchmarks/bench_lora_batch.py [--rounds 5] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from results import figure, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print, do not write benchmarks/results")
    args = parser.parse_args()

    import torch

    from paradiff.api.lora_slots import enable_adapter_slots, load_slot_adapter, set_sample_adapters
    from paradiff_testkit.compile import RecordingBackend
    from paradiff_testkit.lora import random_lora, save_lora
    from paradiff.testing.models import Lengths, build_model, make_inputs, model_class, run_forward, save_model

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-batch-"))
    model = build_model("flux2", heads=8, head_dim=64, layers=2, single_layers=2)
    folder = save_model(model, work / "model")
    targets = tuple(name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
                    and (name.startswith(("transformer_blocks.0.", "single_transformer_blocks.0.")) or
                         name == "proj_out"))
    names = [f"a{i}" for i in range(4)]
    files = {name: save_lora(work / f"{name}.safetensors", random_lora(model, targets, 32, seed=i), rank=32, alpha=32)
             for i, name in enumerate(names)}
    del model

    started = time.perf_counter()
    model = model_class("flux2").from_pretrained(folder).eval()
    model_load_s = time.perf_counter() - started
    enable_adapter_slots(model, max_loras=4, max_lora_rank=32)
    load_times = []
    for name in names:
        started = time.perf_counter()
        load_slot_adapter(model, name, str(files[name]), use_safetensors=True)
        load_times.append(time.perf_counter() - started)
    batch = make_inputs("flux2", model.config, batch=4, lengths=Lengths(height=16, width=16, text=64))
    singles = [make_inputs("flux2", model.config, batch=1, lengths=Lengths(height=16, width=16, text=64), seed=i)
               for i in range(4)]

    def timed(call) -> float:
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    def mixed() -> None:
        set_sample_adapters(model, names)
        run_forward(model, batch)

    def same() -> None:
        set_sample_adapters(model, [names[0]] * 4)
        run_forward(model, batch)

    def four_singles() -> None:
        for name, inputs in zip(names, singles):
            set_sample_adapters(model, [name])
            run_forward(model, inputs)

    for call in (mixed, same, four_singles):  # warm-up
        call()
    rounds = []
    for _ in range(args.rounds):
        rounds.append({"mixed": timed(mixed), "same": timed(same), "singles": timed(four_singles)})
    vs_same = statistics.median(r["mixed"] / r["same"] for r in rounds)
    vs_singles = statistics.median(r["mixed"] / r["singles"] for r in rounds)
    load_ratio = statistics.median(load_times) / model_load_s

    import paradiff

    torch._dynamo.reset()
    recorder = RecordingBackend()
    paradiff.compile(model, backend=recorder)
    mixed()
    graphs_before = len(recorder.graphs)
    set_sample_adapters(model, names[1:] + names[:1])
    run_forward(model, batch)
    set_sample_adapters(model, [None, names[2], None, names[3]])
    run_forward(model, batch)
    recompiles = len(recorder.graphs) - graphs_before

    figures = [
        figure("mixed batch of 4 / same-adapter batch of 4", round(vs_same, 3), "x", "<= 1.15",
               note=f"median of {args.rounds} interleaved rounds"),
        figure("mixed batch of 4 / 4 single calls", round(vs_singles, 3), "x", "<= 0.7",
               note=f"median of {args.rounds} interleaved rounds, one thread"),
        figure("adapter load into a slot / transformer load", round(100 * load_ratio, 2), "%", "< 2",
               note=f"median of 4 adapter loads ({statistics.median(load_times):.3f} s) against one "
                    f"from_pretrained of the transformer ({model_load_s:.2f} s): a small transformer (2 + 2 "
                    "blocks, 512 wide), not a pipeline of gigabytes, so this ratio overstates the share"),
        figure("graphs compiled on an adapter switch (compiled)", recompiles, "graphs", "== 0",
               note=f"paradiff.compile, a recording aot_eager backend: {graphs_before} graphs for the first call, "
                    "then every sample switched and two set to no adapter"),
    ]
    for item in figures:
        print(f"{item['name']:<52} {item['value']:>10} {item['unit']}")
    if not args.no_write:
        write_result("bench_lora_batch",
                     "Adapters per sample: a mixed batch of 4 adapters in one call (small FLUX.2, CPU, fp32)", figures)


if __name__ == "__main__":
    main()
