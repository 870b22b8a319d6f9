"""Text-encoder benchmark: real widths, depth cut to a few layers, bf16 checkpoints saved by transformers.

Models (random weights):
  mistral3  Mistral3ForConditionalGeneration at Mistral-Small-3.1 widths (FLUX.2-dev's encoder): text 5120 wide,
            32 heads / 8 K/V heads, MLP 32768, vocabulary 131072, untied LM head; Pixtral vision tower 1024 wide.
  umt5      UMT5EncoderModel at UMT5-XXL widths (Wan's encoder): 4096 wide, 64 heads, gated MLP 10240,
            vocabulary 256384.

Methods, each in fresh processes (gloo, torch.set_num_threads(1)), one after another, warm page cache:
  transformers tp=1   plain `from_pretrained(dtype=bf16)`, the reference
  transformers tp=2   `from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))`, where it runs
  paradiff tp=1       `paradiff.from_pretrained` (no mesh)
  paradiff tp=2       `paradiff.from_pretrained(parallel_config=TensorParallelConfig(2))`
Per rank: load wall time; peak RssAnon and RssFile (transformers maps the checkpoint: its weights page in on first
use, so the peaks cover the load and every encode, sampled every 5 ms); the bytes of parameters the rank holds; the
encode time of one prompt (`--tokens` ids, output_hidden_states=True): the first call (which pages mapped weights
in) and the median of the next `--repeats - 1`; the last hidden state's max difference to transformers tp=1,
relative to its max.

    .venv/bin/python benchmarks/bench_text_encoders.py [--models mistral3,umt5] [--layers N] [--tokens 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    GB,
    LoadWindow,
    MemorySampler,
    foreign_cpu,
    machine_line,
    markdown_table,
    run_ranks,
    wait_for_quiet,
)
from results import figure, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench" / "text-encoders"
METHODS = {
    "transformers_tp1": ("transformers from_pretrained", 1),
    "transformers_tp2": ('transformers tp_plan="auto"', 2),
    "paradiff_tp1": ("paradiff tp=1", 1),
    "paradiff_tp2": ("paradiff tp=2", 2),
}


def model_spec(name: str, layers: int):
    """(class name, config) at the real widths with `layers` layers."""
    import transformers

    if name == "mistral3":
        text = transformers.MistralConfig(
            vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
            rms_norm_eps=1e-5, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e9},
        )
        vision = transformers.PixtralVisionConfig(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=16, image_size=1540,
            patch_size=14, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )
        config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=10,
                                             spatial_merge_size=2, multimodal_projector_bias=False,
                                             tie_word_embeddings=False)
        return "Mistral3ForConditionalGeneration", config
    if name == "umt5":
        config = transformers.UMT5Config(
            vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers, num_heads=64,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
            is_encoder_decoder=False, use_cache=False,  # the encoder's token table is `shared`, stored once
        )
        return "UMT5EncoderModel", config
    raise SystemExit(f"unknown model {name!r}; known: mistral3, umt5")


def build_checkpoint(rank: int, world_size: int, name: str, layers: int, folder: str) -> dict:
    """Random bf16 weights without an fp32 copy: built on meta, allocated in bf16, drawn uniformly."""
    import torch
    import transformers

    class_name, config = model_spec(name, layers)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    model.to_empty(device="cpu")
    model.to(torch.bfloat16)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.02, 0.02, generator=generator) if param.dim() > 1 else param.uniform_(
                0.9, 1.1, generator=generator)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="2GB")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    (Path(folder) / "BENCH_COMPLETE.json").write_text(json.dumps({"bytes": total, "class": class_name}))
    return {"bytes": total}


def load_and_encode(rank: int, world_size: int, method: str, folder: str, class_name: str, tokens: int,
                    repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import transformers

    import paradiff

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cls = getattr(transformers, class_name)
    if world_size > 1:
        dist.barrier()
    error = None
    model = None
    memory = MemorySampler().__enter__()  # through the load and the encodes: mapped weights page in at first use
    with LoadWindow() as window:
        try:
            if method == "transformers_tp1":
                model = cls.from_pretrained(folder, dtype=torch.bfloat16)
            elif method == "transformers_tp2":
                from transformers.distributed import DistributedConfig

                model = cls.from_pretrained(folder, dtype=torch.bfloat16,
                                            distributed_config=DistributedConfig(tp_plan="auto"))
            elif method == "paradiff_tp1":
                model = paradiff.from_pretrained(cls, folder, torch_dtype=torch.bfloat16)
            else:
                model = paradiff.from_pretrained(cls, folder, torch_dtype=torch.bfloat16,
                                                 parallel_config=paradiff.TensorParallelConfig(2))
        except Exception as exc:  # noqa: BLE001 - reported as the method's outcome
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    result = {
        "rank": rank, "error": error, "load_s": window.wall, "load_cpu_s": window.own,
        "load_window": {"system": window.system, "own": window.own},
        "after_load_anon": memory.peak.get("RssAnon", 0), "after_load_file": memory.peak.get("RssFile", 0),
    }
    if model is None:
        memory.__exit__(None, None, None)
        return result
    seen = set()
    local = 0
    for param in model.parameters():
        # transformers' TP holds DTensors whose local shards are views into the mapped file: count the shard itself
        data = param.to_local() if hasattr(param, "to_local") else param
        if data.data_ptr() not in seen:
            seen.add(data.data_ptr())
            local += data.numel() * data.element_size()
    result["local_bytes"] = local
    vocab = getattr(model.config, "text_config", None) or model.config
    ids = torch.randint(0, vocab.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    times, foreign = [], []
    with torch.no_grad():
        for _ in range(repeats):
            if world_size > 1:
                dist.barrier()
            with LoadWindow() as encode_window:
                output = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            times.append(encode_window.wall)
            foreign.append({"system": encode_window.system, "own": encode_window.own})
    last = output.hidden_states[-1]
    last = last.full_tensor() if hasattr(last, "full_tensor") else last
    memory.__exit__(None, None, None)
    # a numpy copy: a tensor would travel as a shared-memory handle that dies with this process
    result.update(encode_s=times, encode_windows=foreign, last_hidden=last.float().numpy().copy(),
                  peak_anon=memory.peak.get("RssAnon", 0),
                  peak_file=memory.peak.get("RssFile", 0))
    return result


def run(args) -> list[dict]:
    rows = []
    for name in args.models:
        folder = CACHE / f"{name}-{args.layers}l"
        marker = folder / "BENCH_COMPLETE.json"
        if not marker.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            run_ranks(build_checkpoint, 1, timeout_s=3600, name=name, layers=args.layers, folder=str(folder))
        total = json.loads(marker.read_text())["bytes"]
        class_name = json.loads(marker.read_text())["class"]
        reference = None
        for method in args.methods:
            label, world = METHODS[method]
            busy = wait_for_quiet(timeout_s=args.quiet_timeout)
            started = datetime.datetime.now().isoformat(timespec="seconds")
            try:
                results = run_ranks(load_and_encode, world, timeout_s=3600, method=method, folder=str(folder),
                                    class_name=class_name, tokens=args.tokens, repeats=args.repeats)
            except RuntimeError as exc:
                results = [{"rank": 0, "error": str(exc).splitlines()[-1][:300]}]
            for result in results:
                if result.get("last_hidden") is not None and method == "transformers_tp1":
                    reference = result["last_hidden"]
            windows = [r.get("encode_windows", []) for r in results]
            encode_foreign = [foreign_cpu([w[i] for w in windows]) for i in range(min(map(len, windows)))]
            for result in results:
                result.pop("encode_windows", None)
                hidden = result.pop("last_hidden", None)
                diff = None
                if hidden is not None and reference is not None:
                    diff = float(abs(hidden - reference).max() / abs(reference).max())
                rows.append({"model": name, "method": method, "label": label, "world": world, "total_bytes": total,
                             "busy_cores_before": busy, "started": started, "diff_vs_transformers_tp1": diff,
                             "foreign_cpu_s": foreign_cpu([r["load_window"] for r in results if "load_window" in r]),
                             "encode_foreign_cpu_s": encode_foreign,
                             **result})
            print(json.dumps([{k: v for k, v in row.items() if k != "load_window"} for row in rows[-len(results):]],
                             default=str), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    body = []
    for row in rows:
        if row.get("error"):
            body.append([row["model"], row["label"], row["rank"], "fails: " + row["error"], "", "", "", "", ""])
            continue
        first, rest = row["encode_s"][0], statistics.median(row["encode_s"][1:] or row["encode_s"])
        anon = row["peak_anon"] / row["local_bytes"]
        body.append([
            row["model"], row["label"], row["rank"], f"{row['load_s']:.1f}",
            f"{row['peak_anon'] / GB:.2f} ({anon:.2f}x)", f"{row['peak_file'] / GB:.2f}",
            f"{row['local_bytes'] / GB:.2f} ({row['local_bytes'] / row['total_bytes']:.3f})", f"{first:.2f}",
            f"{rest:.2f}",
            "-" if row["diff_vs_transformers_tp1"] is None else f"{row['diff_vs_transformers_tp1']:.1e}",
        ])
    return markdown_table(["model", "method", "rank", "load s", "peak RssAnon GB (/ local)", "peak RssFile GB",
                           "local GB (/ total)", "1st encode s", "encode s (median of rest)",
                           "rel. diff vs transformers tp=1"], body)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mistral3,umt5", type=lambda s: s.split(","))
    parser.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","))
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-timeout", type=float, default=120.0)
    parser.add_argument("--out", default=str(ROOT / ".cache" / "bench" / "text_encoders.json"))
    args = parser.parse_args()
    print(machine_line(), flush=True)
    rows = run(args)
    Path(args.out).write_text(json.dumps(rows, indent=2, default=str))
    print(table(rows))
    figures = []
    for row in rows:
        if row.get("method") == "paradiff_tp2" and row.get("rank") == 0 and not row.get("error"):
            figures += [figure(f"{row['model']} tp=2: parameter bytes a rank / whole",
                               round(row["local_bytes"] / row["total_bytes"], 3), "x"),
                        figure(f"{row['model']} tp=2: peak RssAnon / local params",
                               round(row["peak_anon"] / row["local_bytes"], 2), "x")]
            if row["diff_vs_transformers_tp1"] is not None:
                figures.append(figure(f"{row['model']} tp=2 vs transformers tp=1, relative",
                                      float(f"{row['diff_vs_transformers_tp1']:.2g}"), "rel"))
    if figures:
        write_result("bench_text_encoders", f"Text encoders at real widths ({', '.join(args.models)}), "
                     f"{args.layers} layer(s): paradiff TP vs transformers", figures)


if __name__ == "__main__":
    main()
