"""Train the demo LoRA: an adapter for the embedded demo pipeline's transformer that swaps the shape's colour and
the background's ("a red circle on a blue background" draws a blue circle on red).

    python tools/train_demo_lora.py                       # full run, writes src/paradiff/assets/demo/lora/ (minutes)
    python tools/train_demo_lora.py --quick --out /tmp/x  # a few steps, for tests

The shipped pipeline (src/paradiff/assets/demo) stays frozen; peft adds rank-RANK LoRA factors to every attention
and feed-forward Linear of its transformer, and only those train, with the demo's own rectified-flow objective
(tools/train_demo.py) on pictures whose two colours are swapped against their captions. Deterministic: fixed seeds,
a fixed thread count, data drawn from a seeded generator. Writes a diffusers-format LoRA file
(`Flux2Pipeline.save_lora_weights`, with its adapter metadata) and the loss of every step (`train_log.jsonl`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_demo  # noqa: E402  (the demo's data, encoders and objective, shared)
from paradiff.demo import CALL_KWARGS, DEFAULT_STEPS, pipeline_path  # noqa: E402
from paradiff.demo import shapes  # noqa: E402

DEFAULT_OUT = REPO / "src" / "paradiff" / "assets" / "demo" / "lora"
WEIGHT_NAME = "colour_swap.safetensors"
RANK = 4
ALPHA = 4.0

# every attention and feed-forward Linear of both kinds of block (the modulation, embedding and output Linears
# stay as they are)
DOUBLE_BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                        "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out",
                        "ff_context.linear_in", "ff_context.linear_out")
SINGLE_BLOCK_LINEARS = ("attn.to_qkv_mlp_proj", "attn.to_out")

PROFILES = {
    # images, steps, batch, peak learning rate
    "full": dict(pool=4096, steps=600, batch=32, lr=3e-3),
    "quick": dict(pool=16, steps=6, batch=4, lr=3e-3),
}


def target_modules(transformer) -> list[str]:
    config = transformer.config
    return ([f"transformer_blocks.{i}.{name}" for i in range(config.num_layers) for name in DOUBLE_BLOCK_LINEARS]
            + [f"single_transformer_blocks.{i}.{name}" for i in range(config.num_single_layers)
               for name in SINGLE_BLOCK_LINEARS])


def swapped(scene: shapes.Scene) -> shapes.Scene:
    return shapes.Scene(scene.shape, scene.background, scene.colour, scene.place, scene.size)


def draw_swapped_pool(count: int, seed: int) -> tuple[torch.Tensor, list[shapes.Scene]]:
    """`count` scenes of training combinations (as captioned) and their pictures with the two colours swapped."""
    rng = random.Random(seed)
    train = shapes.combinations(held_out=False)
    images, scenes = [], []
    for _ in range(count):
        scene = shapes.Scene(*rng.choice(train), rng.choice(list(shapes.PLACES)), rng.choice(list(shapes.SIZES)))
        jitter = (rng.randint(-2, 2), rng.randint(-2, 2), rng.randint(-2, 2))
        images.append(torch.from_numpy(shapes.draw(swapped(scene), jitter)))
        scenes.append(scene)
    return torch.stack(images).permute(0, 3, 1, 2).contiguous(), scenes


def add_lora(transformer, seed: int) -> list[str]:
    from peft import LoraConfig

    targets = target_modules(transformer)
    transformer.requires_grad_(False)
    torch.manual_seed(seed)  # peft draws lora_A (B starts at zero: the adapter starts as the identity)
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=True))
    return targets


def train_lora(transformer, latents, caption_index, embeddings, token_weights, steps: int, batch: int, lr: float,
               seed: int, log) -> None:
    """The demo transformer's objective (train_demo._train_transformer), on the LoRA factors only, no moving
    average (a short run whose learning rate falls to zero)."""
    from diffusers import Flux2Pipeline

    generator = torch.Generator().manual_seed(seed)
    packed = Flux2Pipeline._pack_latents(latents)
    txt_ids, img_ids = train_demo.position_ids(embeddings.shape[1], latents.shape[-1])
    trained = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    transformer.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = train_demo.cosine_lr(step, steps, lr, warmup=min(50, steps // 4 + 1))
        index = torch.randint(len(packed), (batch,), generator=generator)
        variant = torch.randint(caption_index.shape[1], (batch,), generator=generator)
        noise = torch.randn((batch, *packed.shape[1:]), generator=generator)
        sigma = train_demo.sample_sigmas(batch, generator).view(-1, 1, 1)
        x0 = packed[index]
        noisy = (1 - sigma) * x0 + sigma * noise
        prediction = transformer(hidden_states=noisy, encoder_hidden_states=embeddings[caption_index[index, variant]],
                                 timestep=sigma.view(-1), img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        weight = token_weights[index]
        loss = ((prediction - (noise - x0)).pow(2).mean(dim=-1) * weight).sum() / weight.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        log("lora", step, loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
    transformer.eval()


def save_lora(transformer, targets: list[str], out: Path) -> Path:
    """A diffusers-format LoRA file (peft keys under `transformer.`, the adapter metadata diffusers reads back)."""
    from diffusers import Flux2Pipeline
    from peft.utils import get_peft_model_state_dict

    layers = {key: value.detach().contiguous() for key, value in get_peft_model_state_dict(transformer).items()}
    out.mkdir(parents=True, exist_ok=True)
    Flux2Pipeline.save_lora_weights(out, transformer_lora_layers=layers, weight_name=WEIGHT_NAME,
                                    transformer_lora_adapter_metadata=dict(r=RANK, lora_alpha=ALPHA,
                                                                           target_modules=sorted(targets)))
    path = out / WEIGHT_NAME
    path.chmod(0o644)
    return path


def evaluate(lora_file: Path, prompts: list[str], seed: int = 0) -> dict:
    """The shipped pipeline with and without the adapter on `prompts` (diffusers alone, one process): what the
    demo's pixel rule (tests/demo_judge.py) finds."""
    sys.path.insert(0, str(REPO / "tests"))
    from demo_judge import judge, parse
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(pipeline_path())
    pipeline.set_progress_bar_config(disable=True)

    def draw() -> list:
        return list(pipeline(prompt=prompts, generator=torch.Generator().manual_seed(seed),
                             num_inference_steps=DEFAULT_STEPS, output_type="np", **CALL_KWARGS).images)

    plain = [judge(image) for image in draw()]
    pipeline.load_lora_weights(lora_file, adapter_name="swap")
    adapted = [judge(image) for image in draw()]
    wanted = [parse(prompt) for prompt in prompts]
    return {
        "swapped_with_lora": sum(a[1:] == (w[2], w[1]) for a, w in zip(adapted, wanted)) / len(prompts),
        "shape_kept_with_lora": sum(a[0] == w[0] for a, w in zip(adapted, wanted)) / len(prompts),
        "as_asked_without": sum(p[1:] == w[1:] for p, w in zip(plain, wanted)) / len(prompts),
        "judged_with_lora": {prompt: list(found) for prompt, found in zip(prompts, adapted)},
    }


EVAL_PROMPTS = list(shapes.DEFAULT_PROMPTS) + [
    "a large green square on a black background, top right",
    "a small white triangle on a purple background",
    "a yellow circle on a green background, bottom left",
    "a large purple square on an orange background",
    "a black triangle on a white background, center",
    "a small blue square on a yellow background, bottom right",
    "a large orange circle on a red background, top left",
    "a green circle on a red background",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write the LoRA file and log to")
    parser.add_argument("--quick", action="store_true", help="a few steps (tests)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; results are reproducible for a fixed count (see train_demo.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="override the profile's step count")
    parser.add_argument("--no-eval", action="store_true", help="skip judging the adapter's pictures at the end")
    args = parser.parse_args(argv)
    profile = dict(PROFILES["quick" if args.quick else "full"])
    if args.steps is not None:
        profile["steps"] = args.steps
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    from diffusers import DiffusionPipeline

    start = time.perf_counter()
    staging = args.out.parent / f".{args.out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log = train_demo.TrainingLog(staging / "train_log.jsonl", start)

    pipeline = DiffusionPipeline.from_pretrained(pipeline_path())
    seed = args.seed
    pool, scenes = draw_swapped_pool(profile["pool"], seed + 1)
    latents = train_demo.encode_latents(pipeline.vae, pool)
    captions, caption_index = train_demo.caption_table(scenes)
    embeddings = train_demo.encode_captions(pipeline.tokenizer, pipeline.text_encoder, captions)
    token_weights = train_demo.shape_token_weights(pool, latents.shape[-1])
    print(f"data: {len(pool)} swapped pictures, {len(captions)} captions ({time.perf_counter() - start:.0f} s)",
          flush=True)
    transformer = pipeline.transformer
    targets = add_lora(transformer, seed + 2)
    train_lora(transformer, latents, caption_index, embeddings, token_weights, profile["steps"], profile["batch"],
               profile["lr"], seed + 3, log)
    log.close()
    path = save_lora(transformer, targets, staging)
    shutil.rmtree(args.out, ignore_errors=True)
    staging.rename(args.out)
    args.out.chmod(0o755)
    path = args.out / WEIGHT_NAME
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB, rank {RANK} on {len(targets)} Linears) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    if not args.no_eval and not args.quick:
        found = evaluate(path, EVAL_PROMPTS)
        print(json.dumps({k: v for k, v in found.items() if k != "judged_with_lora"}), flush=True)
        (args.out / "eval.json").write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
