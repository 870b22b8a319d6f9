"""Quantized loading, stepping and image quality (BENCHMARKS.md, "Quantization").

Parts (--parts, default all):
  load     the FLUX.2-dev-width cut of bench_tp_load.py (2.78B parameters, bf16, 4 shards): per-rank load time, peak
           RssAnon and the bytes each rank holds, for paradiff tp=2 in bf16, int8 weight-only (torchao), NF4
           (bitsandbytes, compute bf16) and GGUF Q4_K (a file of the same model, random codes: loading only), next
           to diffusers loading the same quantized model in one process (int8: TorchAoConfig; NF4: its
           BitsAndBytesConfig path with the GPU check patched out, as on a CPU-only machine it refuses; Q4_K:
           from_single_file). Fresh processes, round-robin over --rounds rounds; tp=2 ranks one thread each, one
           process two threads (the same two cores). Every process imports the quantization backends before the
           measured window (their first import is not the load's memory). --cut small: a 0.70B-parameter cut for a
           machine that cannot load the 2.78B one quantized in time.
  step     one transformer forward at tp=2 on the same cut (16 image + 16 text tokens: weight-bound, as a step at
           small batch is), bf16 vs the three quantized forms; median of --steps after one warm-up.
  quality  the trained demo pipeline (paradiff.demo, 8 prompts, 8 steps, one process: a tp=2 run holds the slices of
           these weights, tests/test_quantization.py) in bf16 and quantized: PSNR of each quantized image against
           the bf16 one, worst and median of the 8. GGUF with gguf-py's own quantizers (Q8_0, Q4_0; it has no
           K-quant quantizer).
  paper    FLUX.2-dev at tp=4 with NF4 and int8: per-GPU bytes of transformer + text encoder (Mistral-Small-3.1
           24B) + VAE from the real configs on the meta device and paradiff's plans, next to one GPU.

    .venv/bin/python benchmarks/bench_quant.py [--parts load,step,quality,paper] [--rounds 2] [--steps 2] [--cut small]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testkit"))  # paradiff_testkit (docs/testing.md)

from _common import (  # noqa: E402
    GB,
    LoadWindow,
    MemorySampler,
    foreign_cpu,
    machine_line,
    markdown_table,
    quiet_diffusers,
    read_io,
    read_status,
    run_ranks,
    wait_for_quiet,
)
from results import figure, write_result  # noqa: E402
from bench_tp_load import CONFIG, DEFAULT_FOLDER, ensure_checkpoint, touch_pages, warm_page_cache  # noqa: E402

# --cut small: FLUX.2-dev's head width and depth cut, half its heads and text width (0.70B parameters), for runs the
# shared 2-core machine cannot finish at 2.78B within 20 minutes (bitsandbytes quantizes ~7M weights a second here)
CUTS = {"full": CONFIG, "small": {**CONFIG, "num_attention_heads": 24, "joint_attention_dim": 7680}}
FOLDERS = {"full": DEFAULT_FOLDER, "small": DEFAULT_FOLDER.with_name("flux2-wide-small")}
GGUF_FILE = DEFAULT_FOLDER.with_name("flux2-wide-q4k.gguf")  # set for the chosen cut in main()
METHODS = {
    "paradiff_tp2_bf16": ("paradiff tp=2 bf16", 2, "bf16"),
    "paradiff_tp2_int8": ("paradiff tp=2 int8", 2, "int8"),
    "paradiff_tp2_nf4": ("paradiff tp=2 NF4", 2, "nf4"),
    "paradiff_tp2_q4k": ("paradiff tp=2 GGUF Q4_K", 2, "q4k"),
    "diffusers_bf16": ("diffusers 1 process bf16", 1, "bf16"),
    "diffusers_int8": ("diffusers 1 process int8", 1, "int8"),
    "diffusers_nf4": ("diffusers 1 process NF4 (GPU check patched)", 1, "nf4"),
    "diffusers_q4k": ("diffusers 1 process GGUF Q4_K", 1, "q4k"),
}


# ----------------------------------------------------------------------------------------------------------------
# the GGUF file


def build_cut(rank: int, world_size: int, folder: str, config: dict) -> dict:
    """bench_tp_load.py's checkpoint builder for another config."""
    import bench_tp_load

    bench_tp_load.CONFIG = config
    return bench_tp_load.build_checkpoint(rank, world_size, folder)


def ensure_cut(folder: Path, config: dict) -> dict:
    marker = folder / "BENCH_COMPLETE.json"
    if marker.is_file() and json.loads(marker.read_text()).get("config") == json.loads(json.dumps(config)):
        return json.loads(marker.read_text())
    if config == CONFIG:
        return ensure_checkpoint(folder)
    print(f"building the checkpoint {folder} (once) ...", flush=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return run_ranks(build_cut, 1, timeout_s=1800, folder=str(folder), config=config)[0]


def build_gguf(rank: int, world_size: int, path: str, config: dict) -> dict:
    """The cut under BFL's original names (diffusers' converter maps them back), every 2-D weight whose rows are
    whole 256-blocks in Q4_K (seeded random codes with small super-block scales), the others F16 / F32."""
    import gguf
    import numpy as np
    import torch
    from diffusers import Flux2Transformer2DModel

    from paradiff_testkit.gguf import _K_SCALES, flux2_original_state_dict

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**config)
    shapes = {name: tuple(t.shape) for name, t in flux2_original_state_dict(model).items()}
    writer = gguf.GGUFWriter(path + ".partial", arch="flux")
    generator = np.random.default_rng(0)
    q4k = gguf.GGMLQuantizationType.Q4_K
    block, type_size = gguf.GGML_QUANT_SIZES[q4k]
    offsets, scale = _K_SCALES["Q4_K"]
    types = {}
    for name, shape in shapes.items():
        if len(shape) == 2 and shape[1] % block == 0:
            codes = generator.integers(0, 256, size=(shape[0], shape[1] // block, type_size), dtype=np.uint8)
            for offset in offsets:
                scales = (scale * generator.uniform(0.5, 1.5, size=codes.shape[:2])).astype(np.float16)
                codes[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*codes.shape[:2], 2)
            writer.add_tensor(name, codes.reshape(shape[0], -1), raw_dtype=q4k)
            types[name] = "Q4_K"
        else:
            values = (0.02 * generator.standard_normal(shape)).astype(np.float16 if len(shape) == 2 else np.float32)
            writer.add_tensor(name, values)
            types[name] = "F16" if len(shape) == 2 else "F32"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(path + ".partial").rename(path)
    return {"types": {kind: sum(1 for t in types.values() if t == kind) for kind in set(types.values())}}


def ensure_gguf(path: Path, config: dict) -> None:
    if not path.is_file():
        print(f"building the Q4_K GGUF file {path} (once) ...", flush=True)
        print(run_ranks(build_gguf, 1, timeout_s=1800, path=str(path), config=config)[0], flush=True)


# ----------------------------------------------------------------------------------------------------------------
# loading


def _patch_diffusers_bnb_for_cpu() -> str:
    """diffusers' bitsandbytes 4-bit quantizer refuses a machine without a GPU and places the model on cuda:0; on
    CPU it works once both are lifted (bitsandbytes quantizes on CPU at the `.to("cpu")` of each weight)."""
    from diffusers.quantizers.bitsandbytes.bnb_quantizer import BnB4BitDiffusersQuantizer

    BnB4BitDiffusersQuantizer.validate_environment = lambda self, *args, **kwargs: None
    BnB4BitDiffusersQuantizer.update_device_map = lambda self, device_map: device_map or {"": "cpu"}
    return "diffusers BnB4BitDiffusersQuantizer: GPU check off, device_map {'': 'cpu'}"


def load_model(method: str, folder: str, gguf_file: str, world_size: int):
    import torch
    from diffusers import BitsAndBytesConfig, Flux2Transformer2DModel, GGUFQuantizationConfig, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    import paradiff

    scheme = METHODS[method][2]
    dtype = torch.bfloat16
    config = {"bf16": None, "int8": TorchAoConfig(Int8WeightOnlyConfig()),
              "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype),
              "q4k": GGUFQuantizationConfig(compute_dtype=dtype)}[scheme]
    if method.startswith("paradiff"):
        parallel = paradiff.TensorParallelConfig(tp_degree=world_size) if world_size > 1 else None
        source = gguf_file if scheme == "q4k" else folder
        extra = {"config": folder} if scheme == "q4k" else {}
        return paradiff.from_pretrained(Flux2Transformer2DModel, source, torch_dtype=dtype, quantization_config=config,
                                        parallel_config=parallel, progress=False, **extra)
    if scheme == "q4k":
        return Flux2Transformer2DModel.from_single_file(gguf_file, config=folder, quantization_config=config,
                                                        torch_dtype=dtype)
    return Flux2Transformer2DModel.from_pretrained(folder, torch_dtype=dtype, quantization_config=config)


def _plain_tensors(model) -> list:
    """Every tensor holding the model's bytes: quantized weights' inner tensors and states included."""
    from paradiff.runtime.memory import _plain_tensors as inner

    import torch

    out = []
    for tensor in list(model.parameters()) + list(model.buffers()):
        if type(tensor).__name__ in ("Params4bit", "GGUFParameter"):  # their bytes, as a plain tensor
            out.append(tensor.data.as_subclass(torch.Tensor))
        else:
            out += inner(tensor)
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            out.append(state.absmax)
    return out


def _import_backends() -> None:
    """Import every quantization backend and the loaders' lazily imported modules before the measured window."""
    import importlib

    for name in ("bitsandbytes", "bitsandbytes.functional", "gguf", "torchao.quantization",
                 "diffusers.quantizers.bitsandbytes", "diffusers.quantizers.gguf", "diffusers.quantizers.torchao",
                 "paradiff.api.single_file", "paradiff.quant.apply", "paradiff.quant.saved"):
        importlib.import_module(name)


def load_worker(rank: int, world_size: int, method: str, folder: str, gguf_file: str) -> dict:
    import resource

    import torch
    import torch.distributed as dist

    from paradiff.quant.apply import quantization_summary

    torch.set_num_threads(1 if world_size > 1 else 2)
    quiet_diffusers()
    patches = [_patch_diffusers_bnb_for_cpu()] if method == "diffusers_nf4" else []
    _import_backends()  # their first import (up to 0.2 GB of RssAnon) is not the load's
    gc.collect()
    if world_size > 1:
        dist.barrier()
    baseline = read_status()[0]
    io_before = read_io()
    with MemorySampler() as sampler, LoadWindow() as window:
        start = time.perf_counter()
        model = load_model(method, folder, gguf_file, world_size)
        loaded = time.perf_counter()
        touch_pages(_plain_tensors(model))
        wall = time.perf_counter() - start
    io_after = read_io()
    held = quantization_summary(model)
    return dict(method=method, rank=rank, wall_s=wall, touch_s=wall - (loaded - start), cpu_s=window.own,
                window=dict(system=window.system, own=window.own, wall=window.wall), patches=patches,
                baseline_anon=baseline["RssAnon"], peak_anon=sampler.peak["RssAnon"],
                peak_file=sampler.peak["RssFile"], rchar=io_after["rchar"] - io_before["rchar"],
                held=held["quantized_bytes"] + held["full_precision_bytes"], quantized_bytes=held["quantized_bytes"],
                quantized_linears=held["quantized_linears"],
                maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def run_load(folder: Path, rounds: int, methods: list[str], wait: bool, figures: list[dict]) -> dict:
    """Every load, by method; the goals' figures are appended to `figures`."""
    runs: dict[str, list[list[dict]]] = {method: [] for method in methods}
    for index in range(rounds):  # round-robin: slow phases of the shared machine hit every method alike
        for method in methods:
            label, world, _ = METHODS[method]
            busy = wait_for_quiet(timeout_s=30) if wait else 0.0
            results = run_ranks(load_worker, world, timeout_s=1800, method=method, folder=str(folder),
                                gguf_file=str(GGUF_FILE))
            runs[method].append(results)
            print(f"  #{index + 1} {label}: " + ", ".join(
                f"rank {r['rank']} {r['wall_s']:.1f}s (cpu {r['cpu_s']:.1f}s) peak RssAnon +"
                f"{(r['peak_anon'] - r['baseline_anon']) / GB:.2f} GB, holds {r['held'] / GB:.2f} GB"
                for r in results) + f"; busy before {busy:.2f}, other processes "
                f"{foreign_cpu([r['window'] for r in results]):.1f} CPU-s", flush=True)
    rows, best = [], {}
    for method, repeats in runs.items():
        label, _, scheme = METHODS[method]
        walls = [max(r["wall_s"] for r in ranks) for ranks in repeats]
        chosen = repeats[sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]]
        best[method] = dict(wall=statistics.median(walls), walls=walls, ranks=chosen)
        for r in chosen:
            rank_walls = [ranks[r["rank"]]["wall_s"] for ranks in repeats]
            rank_cpus = [ranks[r["rank"]]["cpu_s"] for ranks in repeats]
            rows.append([label, r["rank"], f"{statistics.median(rank_walls):.1f} ({min(rank_walls):.1f}–"
                         f"{max(rank_walls):.1f})", f"{statistics.median(rank_cpus):.1f}",
                         f"{(r['peak_anon'] - r['baseline_anon']) / GB:.2f}", f"{r['peak_file'] / GB:.2f}",
                         f"{r['held'] / GB:.2f}", f"{r['quantized_bytes'] / GB:.2f}", r["quantized_linears"],
                         f"{r['rchar'] / GB:.2f}",
                         " ".join(f"{foreign_cpu([x['window'] for x in ranks]):.0f}" for ranks in repeats)])
    header = ["method", "rank", "wall s median (min–max)", "CPU s", "peak − pre-load RssAnon GB", "peak RssFile GB",
              "held GB", "of which quantized GB", "quantized linears", "rchar GB",
              "other processes' CPU-s per round"]
    print()
    print(markdown_table(header, rows))
    print()
    for scheme in ("bf16", "int8", "nf4", "q4k"):
        ours, theirs = best.get(f"paradiff_tp2_{scheme}"), best.get(f"diffusers_{scheme}")
        if ours is None or theirs is None:
            continue
        ratio = ours["wall"] / theirs["wall"]
        share = max(r["held"] for r in ours["ranks"]) / theirs["ranks"][0]["held"]
        print(f"{scheme}: tp=2 slowest-rank wall {ours['wall']:.1f}s / one process {theirs['wall']:.1f}s = "
              f"{ratio:.2f} (goal <= 0.5: {'MET' if ratio <= 0.5 else 'MISSED'}); per-rank held / one process "
              f"held = {share:.3f} (goal <= 0.55: {'MET' if share <= 0.55 else 'MISSED'})")
        if scheme != "bf16":  # diffusers' bf16 load is a lazy mmap: no reference
            figures += [figure(f"{scheme} load, tp=2 slowest rank / diffusers one process (wall)", round(ratio, 3),
                               "x", "<= 0.5", note=f"{ours['wall']:.1f} s vs {theirs['wall']:.1f} s"),
                        figure(f"{scheme}: bytes held a rank / one process", round(share, 3), "x", "<= 0.55")]
    patches = sorted({p for repeats in runs.values() for ranks in repeats for r in ranks for p in r["patches"]})
    if patches:
        print("patches: " + "; ".join(patches))
    return runs


# ----------------------------------------------------------------------------------------------------------------
# stepping


def step_worker(rank: int, world_size: int, method: str, folder: str, gguf_file: str, steps: int) -> dict:
    import torch

    from paradiff.testing.models import Lengths, make_inputs

    torch.set_num_threads(1)
    quiet_diffusers()
    model = load_model(method, folder, gguf_file, world_size)
    inputs = make_inputs("flux2", model.config, lengths=Lengths(height=4, width=4, text=16), seed=3)
    inputs = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and k not in ("img_ids",
              "txt_ids") else v for k, v in inputs.items()}
    times = []
    with torch.no_grad(), LoadWindow() as window:
        for index in range(steps + 1):
            start = time.perf_counter()
            out = model(**inputs, return_dict=False)[0]
            if index:  # the first is the warm-up
                times.append(time.perf_counter() - start)
    return dict(method=method, rank=rank, times=times, window=dict(system=window.system, own=window.own,
                                                                     wall=window.wall),
                out=out.float().flatten()[:4096].tolist())


def run_step(folder: Path, steps: int, wait: bool) -> None:
    rows, outputs = [], {}
    for method in ("paradiff_tp2_bf16", "paradiff_tp2_int8", "paradiff_tp2_nf4", "paradiff_tp2_q4k"):
        if wait:
            wait_for_quiet(timeout_s=30)
        results = run_ranks(step_worker, 2, timeout_s=3600, method=method, folder=str(folder),
                            gguf_file=str(GGUF_FILE), steps=steps)
        slowest = [max(r["times"][i] for r in results) for i in range(steps)]
        outputs[method] = results[0]["out"]
        rows.append([METHODS[method][0], f"{statistics.median(slowest):.1f}", " ".join(f"{t:.1f}" for t in slowest),
                     f"{foreign_cpu([r['window'] for r in results]):.0f}"])
        print(f"  {METHODS[method][0]}: {rows[-1][1]} s", flush=True)
    import numpy as np

    base = np.asarray(outputs["paradiff_tp2_bf16"])
    for row, method in zip(rows, outputs):
        diff = np.abs(np.asarray(outputs[method]) - base).max() / np.abs(base).max()
        row.append("—" if method.endswith("bf16") else ("random weights" if method.endswith("q4k")
                                                          else f"{diff:.3f}"))
    print()
    print(markdown_table(["tp=2 forward (16 + 16 tokens)", "slowest-rank step s (median)", "each step s",
                          "other processes' CPU-s", "max |out − bf16 out| / max |bf16 out|"], rows))


# ----------------------------------------------------------------------------------------------------------------
# image quality


def _psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def quality_worker(rank: int, world_size: int, schemes: list[str], out: str) -> dict:
    import numpy as np
    import torch
    from diffusers import GGUFQuantizationConfig, PipelineQuantizationConfig

    import paradiff
    from paradiff.demo import CALL_KWARGS, DEFAULT_PROMPTS, DEFAULT_STEPS, pipeline_path
    from paradiff.quant.schemes import pipeline_quantization_config
    from paradiff_testkit.gguf import save_flux2_gguf

    torch.set_num_threads(2)
    quiet_diffusers()
    dtype = torch.bfloat16
    folder = pipeline_path()
    kwargs = dict(CALL_KWARGS, num_inference_steps=DEFAULT_STEPS, output_type="np")

    def draw(pipe) -> list:
        pipe.set_progress_bar_config(disable=True)
        return [pipe(prompt=prompt, seed=index, **kwargs).images[0] for index, prompt in enumerate(DEFAULT_PROMPTS)]

    images = {"bf16": draw(paradiff.load_pipeline(folder, torch_dtype=dtype, device="cpu"))}
    transformer = None
    for scheme in schemes:
        extra = {}
        if scheme in ("int8", "fp8", "nf4"):
            extra["quantization_config"] = pipeline_quantization_config(scheme, dtype)
        else:  # gguf-q8_0 / gguf-q4_0: the trained transformer written by gguf-py's quantizer
            if transformer is None:
                from diffusers import Flux2Transformer2DModel

                transformer = Flux2Transformer2DModel.from_pretrained(folder / "transformer")
            kind = scheme.split("-")[1].upper()
            file = Path(out) / f"demo-{kind}.gguf"
            save_flux2_gguf(transformer, file, lambda name, tensor, kind=kind: kind if tensor.dim() == 2
                            and tensor.shape[-1] % 32 == 0 else ("F16" if tensor.dim() == 2 else "F32"))
            extra = {"transformer_file": str(file), "quantization_config": PipelineQuantizationConfig(
                quant_mapping={"transformer": GGUFQuantizationConfig(compute_dtype=dtype)})}
        images[scheme] = draw(paradiff.load_pipeline(folder, torch_dtype=dtype, device="cpu", **extra))
    psnr = {scheme: [_psnr(a, b) for a, b in zip(images[scheme], images["bf16"])] for scheme in schemes}
    spread = float(np.mean([np.asarray(image).std() for image in images["bf16"]]))
    return {"psnr": psnr, "spread": spread, "pixels": list(np.asarray(images["bf16"][0]).shape)}


def run_quality(out: Path) -> None:
    schemes = ["int8", "fp8", "nf4", "gguf-q8_0", "gguf-q4_0"]
    out.mkdir(parents=True, exist_ok=True)
    result = run_ranks(quality_worker, 1, timeout_s=3600, schemes=schemes, out=str(out))[0]
    rows = [[scheme, f"{min(values):.1f}", f"{statistics.median(values):.1f}", " ".join(f"{v:.1f}" for v in values)]
            for scheme, values in result["psnr"].items()]
    print(f"demo pipeline images {result['pixels']}, mean per-image pixel std of the bf16 images "
          f"{result['spread']:.3f}")
    print(markdown_table(["scheme (transformer)", "worst PSNR dB (8 prompts)", "median PSNR dB", "each prompt"],
                         rows))


# ----------------------------------------------------------------------------------------------------------------
# on paper


MISTRAL_SMALL_31 = dict(  # Mistral-Small-3.1-24B (FLUX.2-dev's text_encoder), its published config.json
    text_config=dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                     max_position_embeddings=131072, rope_theta=1e9, tie_word_embeddings=False),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, num_channels=3),
    spatial_merge_size=2, multimodal_projector_bias=False, projector_hidden_act="gelu", vision_feature_layer=-1,
    tie_word_embeddings=False,
)
FLUX2_DEV = dict(num_attention_heads=48, attention_head_dim=128, joint_attention_dim=15360, mlp_ratio=3.0,
                 num_layers=8, num_single_layers=48, in_channels=128, timestep_guidance_channels=256,
                 axes_dims_rope=(32, 32, 32, 32), guidance_embeds=True, patch_size=1)


def _bytes(model, resolved, scheme: str, quantize) -> tuple[int, int]:
    """(bytes on one device, bytes of tp rank 0) of `model`'s parameters in bf16, its linears `quantize(name)`
    in `scheme` (int8: one byte a weight + fp32 scale and int8 zero point a row; nf4: half a byte a weight + one
    fp32 absmax a 64-block)."""
    import torch

    def cost(shape, quantized: bool) -> int:
        count = 1
        for size in shape:
            count *= size
        if not quantized or scheme == "bf16":
            return 2 * count
        if scheme == "int8":
            return count + 5 * shape[0]
        return count // 2 + count // 64 * 4

    whole = local = 0
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            quantized = leaf == "weight" and isinstance(module, torch.nn.Linear) and quantize(module_name)
            spec = resolved.spec_for(name) if resolved is not None else None
            whole += cost(tuple(param.shape), quantized)
            local += cost(tuple(spec.local_shape(param.shape)) if spec else tuple(param.shape), quantized)
    return whole, local


def run_paper(tp: int = 4) -> None:
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from paradiff.plans import plan_for
    from paradiff.tensor_parallel.plan import as_plan, resolve_plan

    with torch.device("meta"):
        transformer = Flux2Transformer2DModel(**FLUX2_DEV)
        encoder = Mistral3ForConditionalGeneration(Mistral3Config(**MISTRAL_SMALL_31))
        vae = AutoencoderKLFlux2()
    plans = {"transformer": resolve_plan(transformer, as_plan(plan_for(transformer, None, "tensor")), 0, tp),
             "text_encoder": resolve_plan(encoder, as_plan(plan_for(encoder, None, "tensor")), 0, tp)}
    # which linears each loader quantizes: diffusers' rule for the transformer (every Linear); transformers' for the
    # encoder (every Linear but the output head, which it keeps); the VAE is never quantized (convolutions)
    rules = {"transformer": lambda name: True, "text_encoder": lambda name: name != "lm_head",
             "vae": lambda name: False}
    rows = []
    for scheme in ("bf16", "int8", "nf4"):
        totals = [0, 0]
        cells = []
        for name, model in (("transformer", transformer), ("text_encoder", encoder), ("vae", vae)):
            whole, local = _bytes(model, plans.get(name), scheme, rules[name])
            totals[0] += whole
            totals[1] += local
            cells.append(f"{whole / GB:.1f} / {local / GB:.1f}")
        rows.append([scheme, *cells, f"{totals[0] / GB:.1f}", f"{totals[1] / GB:.1f}"])
    params = {name: sum(p.numel() for p in model.parameters()) / 1e9
              for name, model in (("transformer", transformer), ("text_encoder", encoder), ("vae", vae))}
    print("parameters (B): " + ", ".join(f"{name} {count:.2f}" for name, count in params.items()))
    print(markdown_table(["weights", "transformer GB (1 GPU / per GPU at tp=4)", "text encoder GB (1 / tp=4)",
                          "VAE GB (1 / tp=4: whole)", "one GPU total GB", f"per GPU at tp={tp} GB"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="load,step,quality,paper")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cut", choices=sorted(CUTS), default="full")
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    print(f"machine: {machine_line()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    global GGUF_FILE
    folder = FOLDERS[args.cut]
    GGUF_FILE = folder.with_name(folder.name + "-q4k.gguf")
    started = time.time()
    runs = None
    figures: list[dict] = []
    if "load" in parts or "step" in parts:
        info = ensure_cut(folder, CUTS[args.cut])
        ensure_gguf(GGUF_FILE, CUTS[args.cut])
        warm = warm_page_cache(folder)
        with open(GGUF_FILE, "rb", buffering=0) as handle:
            while handle.read(64 << 20):
                pass
        print(f"checkpoint {folder}: {info['parameters'] / 1e9:.2f}B parameters, {info['bytes'] / GB:.2f} GB bf16; "
              f"GGUF {GGUF_FILE.stat().st_size / GB:.2f} GB; page cache warmed ({warm:.0f} s)", flush=True)
    if "load" in parts:
        runs = run_load(folder, args.rounds, [m.strip() for m in args.methods.split(",") if m.strip()],
                        not args.no_wait, figures)
        if figures:
            write_result("bench_quant", f"Quantized loading at tp=2 vs diffusers in one process ({args.cut} cut)",
                         figures)
    if "step" in parts:
        run_step(folder, args.steps, not args.no_wait)
    if "quality" in parts:
        run_quality(DEFAULT_FOLDER.with_name("quant-quality"))
    if "paper" in parts:
        run_paper()
    print(f"total {time.time() - started:.0f} s")
    if args.json and runs is not None:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
