"""Train the embedded demo pipeline: a tiny FLUX.2 (`Flux2Pipeline`) that draws the captioned shapes data set.

    python tools/train_demo.py                      # full run, writes src/paradiff/assets/demo/ (~45 min, 2 cores)
    python tools/train_demo.py --quick --out /tmp/x # a few steps of each stage, for tests

Stages, each deterministic (fixed seeds, fixed thread count, data drawn from a seeded generator):
1. tokenizer and text encoder, built here: a word-level tokenizer over the captions' words with FLUX.2's chat
   format, and a 30-layer Mistral3 text encoder of width 32 with seeded random weights, kept frozen (the pipeline
   stacks its layers 10, 20 and 30, as for the real model). Every training caption is encoded once, by the
   pipeline's own encoding function.
2. the autoencoder (`AutoencoderKLFlux2`, 4x downsampling to 16x16x4 latents) trained on the images; its
   batch-norm statistics, which the pipeline uses to normalise latents, set to those of the encoded data set; then
   its decoder alone trained further on the (now fixed) latents, for sharper edges.
3. the transformer (`Flux2Transformer2DModel`) trained with the rectified-flow objective on cached latents and
   caption embeddings, at noise levels drawn logit-normally over the scheduler's range; an exponential moving average of its
   weights is what is saved.
The loss of every step is logged to `<out>/train_log.jsonl`. Checkpoints go to `--work` (the autoencoder after its
stage, the transformer every 250 steps); a rerun resumes from them and ends with the same weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paradiff.demo import shapes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "paradiff" / "assets" / "demo"

TEXT_WIDTH = 32
TEXT_LAYERS = 30
MAX_SEQUENCE_LENGTH = 20
LATENT_CHANNELS = 4
VAE_CHANNELS = (8, 16, 32)

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]

# Mistral's chat format as FLUX.2 uses it: the pipeline sends a system message and the user's prompt.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def build_tokenizer():
    """Word-level, lower-cased; FLUX.2's fixed system message is one token, so prompts fit in 20 tokens."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for caption in shapes.all_captions(False) + shapes.all_captions(True)
                    for word in caption.replace(",", " , ").split()})
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_tokens([AddedToken(SYSTEM_MESSAGE, normalized=False, special=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens=SPECIALS[4:], chat_template=CHAT_TEMPLATE, model_max_length=MAX_SEQUENCE_LENGTH,
    )


def build_text_encoder(tokenizer, seed: int):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text_config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=64, num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    # The class needs a vision tower; text-to-image never runs it, so it is as small as the config allows.
    vision_config = PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
        patch_size=4, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    torch.manual_seed(seed)
    encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text_config, vision_config=vision_config,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        multimodal_projector_bias=False, tie_word_embeddings=False,
    ))
    with torch.no_grad():
        # Unit-scale word vectors: the residual stream then carries each word clearly through the 30 random layers
        # (at the default 0.02 the layers' random mixing would dominate it).
        embeddings = encoder.get_input_embeddings().weight
        embeddings.normal_(0.0, 1.0)
    return encoder.eval().requires_grad_(False)


def encode_captions(tokenizer, text_encoder, captions: list[str], batch: int = 256) -> torch.Tensor:
    """(len(captions), MAX_SEQUENCE_LENGTH, 3 * TEXT_WIDTH) through the pipeline's own encoding function."""
    from diffusers import Flux2Pipeline

    out = []
    with torch.no_grad():
        for i in range(0, len(captions), batch):
            out.append(Flux2Pipeline._get_mistral_3_small_prompt_embeds(
                text_encoder, tokenizer, captions[i:i + batch], dtype=torch.float32, device=torch.device("cpu"),
                max_sequence_length=MAX_SEQUENCE_LENGTH))
    return torch.cat(out)


# --- data -------------------------------------------------------------------------------------------------------


def draw_pool(count: int, seed: int) -> tuple[torch.Tensor, list[shapes.Scene]]:
    """`count` training images (uint8, N x 3 x 64 x 64) and their scenes, drawn from a seeded generator."""
    rng = random.Random(seed)
    train = shapes.combinations(held_out=False)
    images, scenes = [], []
    for _ in range(count):
        scene = shapes.Scene(*rng.choice(train), rng.choice(list(shapes.PLACES)), rng.choice(list(shapes.SIZES)))
        jitter = (rng.randint(-2, 2), rng.randint(-2, 2), rng.randint(-2, 2))
        images.append(torch.from_numpy(shapes.draw(scene, jitter)))
        scenes.append(scene)
    return torch.stack(images).permute(0, 3, 1, 2).contiguous(), scenes


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float [-1, 1], the VAE's range (what the pipeline's image processor inverts)."""
    return images.float() / 127.5 - 1.0


# --- autoencoder ------------------------------------------------------------------------------------------------


def build_vae(seed: int, channels=VAE_CHANNELS):
    import diffusers

    torch.manual_seed(seed)
    return diffusers.AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels), block_out_channels=channels, layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=shapes.IMAGE_SIZE, patch_size=(2, 2),
        mid_block_add_attention=False,
    )


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_vae(vae, pool: torch.Tensor, steps: int, batch: int, lr: float, seed: int, log) -> None:
    """L1 reconstruction from the posterior mean plus fixed small noise, and a small KL term.

    The pipeline only ever uses the posterior mode, so the decoder learns from the mean; the noise (0.1) and the KL
    term keep the latent space smooth and centred for the transformer. Sampling with the posterior's own variance,
    which starts at 1, would drown the latent in noise for hundreds of steps. The shape's pixels weigh 5x: they are
    a tenth of the picture but all of its content, and without the weight backgrounds are learnt long before shapes.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    vae.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=min(20, steps // 4))
        index = torch.randint(len(pool), (batch,), generator=generator)
        x = to_unit(pool[index])
        shape_pixels = (x - x[:, :, :1, :1]).abs().amax(dim=1, keepdim=True) > 0.05
        weight = 1.0 + 4.0 * shape_pixels.float()
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + 0.1 * torch.randn(posterior.mean.shape, generator=generator)
        reconstruction = vae.decode(z).sample
        l1 = ((reconstruction - x).abs() * weight).mean() / weight.mean()
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        loss = l1 + 1e-3 * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        log("vae", step, loss=loss.item(), l1=l1.item(), kl=kl.item())
    vae.eval()


def train_decoder(vae, pool: torch.Tensor, steps: int, batch: int, lr: float, seed: int, log) -> None:
    """The decoder alone, from the posterior mode with a little noise (0.02): the encoder, and so the latents the
    transformer learns, stay as they are, while the decoder, no longer fighting the stage's larger noise, learns
    sharp edges."""
    generator = torch.Generator().manual_seed(seed)
    vae.requires_grad_(False)
    trained = list(vae.decoder.parameters())
    if vae.post_quant_conv is not None:
        trained += list(vae.post_quant_conv.parameters())
    for parameter in trained:
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    vae.decoder.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=min(20, steps // 4))
        index = torch.randint(len(pool), (batch,), generator=generator)
        x = to_unit(pool[index])
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mode()
        z = z + 0.02 * torch.randn(z.shape, generator=generator)
        weight = 1.0 + 4.0 * ((x - x[:, :, :1, :1]).abs().amax(dim=1, keepdim=True) > 0.05).float()
        l1 = ((vae.decode(z).sample - x).abs() * weight).mean() / weight.mean()
        optimizer.zero_grad(set_to_none=True)
        l1.backward()
        optimizer.step()
        log("decoder", step, loss=l1.item())
    vae.eval().requires_grad_(False)


def latent_statistics(vae, pool: torch.Tensor, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and variance of the patchified latents, which the pipeline (de)normalises with."""
    latents = encode_latents(vae, pool, batch, normalise=False)
    return latents.mean(dim=(0, 2, 3)), latents.var(dim=(0, 2, 3))


def encode_latents(vae, pool: torch.Tensor, batch: int = 256, normalise: bool = True) -> torch.Tensor:
    """The pipeline's view of each image: the posterior mode, patchified (2x2) and batch-normalised."""
    from diffusers import Flux2Pipeline

    out = []
    with torch.no_grad():
        for i in range(0, len(pool), batch):
            latents = Flux2Pipeline._patchify_latents(vae.encode(to_unit(pool[i:i + batch])).latent_dist.mode())
            if normalise:
                mean = vae.bn.running_mean.view(1, -1, 1, 1)
                std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
                latents = (latents - mean) / std
            out.append(latents)
    return torch.cat(out)


# --- transformer ------------------------------------------------------------------------------------------------


def build_transformer(seed: int):
    import diffusers

    torch.manual_seed(seed)
    head_dim = 32
    return diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, out_channels=None, num_layers=2, num_single_layers=2,
        attention_head_dim=head_dim, num_attention_heads=4, joint_attention_dim=3 * TEXT_WIDTH,
        timestep_guidance_channels=64, mlp_ratio=3.0, axes_dims_rope=(head_dim // 4,) * 4, rope_theta=2000,
        guidance_embeds=False,
    )


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # A fixed shift of 1, no resolution-dependent shifting: the pipeline's empirical shift (made for megapixel
    # images) at 64 tokens and 8 steps ends the schedule at sigma 0.49, leaving half the noise to the last step.
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT, use_dynamic_shifting=False)


SCHEDULER_SHIFT = 1.0


def sample_sigmas(count: int, generator: torch.Generator) -> torch.Tensor:
    """Noise levels drawn logit-normally (the logit of sigma ~ N(0, 1), as in Stable Diffusion 3's training): most
    draws fall in the middle of the schedule, where the steps decide which shape stands where; the ends, where the
    velocity is easy (all noise, or nearly clean), are drawn less often. The scheduler's shift of 1 keeps these the
    sigmas it samples with."""
    return torch.sigmoid(torch.randn(count, generator=generator))


def position_ids(text_length: int, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (t, h, w, l) ids the pipeline gives text and image tokens."""
    from diffusers import Flux2Pipeline

    txt_ids = Flux2Pipeline._prepare_text_ids(torch.zeros(1, text_length, 1))[0]
    img_ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(1, 1, grid, grid))[0]
    return txt_ids, img_ids


def shape_token_weights(pool: torch.Tensor, grid: int, weight: float = 5.0) -> torch.Tensor:
    """(N, grid * grid) loss weights of the image tokens in the pipeline's (row-major) order: `weight` where a token's
    pixels hold part of the shape, 1 elsewhere. The shape is a tenth of the picture but all of what a caption asks
    beyond the background; unweighted, the background colour is learnt long before the shape is."""
    x = pool.float()
    shape_pixels = (x - x[:, :, :1, :1]).abs().amax(dim=1) > 12  # (N, H, W): differs from the corner's colour
    block = pool.shape[-1] // grid
    touched = shape_pixels.view(len(pool), grid, block, grid, block).any(dim=4).any(dim=2)
    return 1.0 + (weight - 1.0) * touched.reshape(len(pool), grid * grid).float()


def train_transformer(transformer, latents: torch.Tensor, caption_index: torch.Tensor, embeddings: torch.Tensor,
                      token_weights: torch.Tensor,
                      steps: int, batch: int, lr: float, seed: int, log, ranks: int = 1,
                      checkpoint: Path | None = None, stop: int | None = None):
    """Rectified flow: x_s = (1 - s) x_0 + s e, the transformer predicts e - x_0 (the velocity the Euler scheduler
    integrates from s = 1 to 0). `caption_index[i]` lists the embeddings of image i's caption variants.

    With `ranks` > 1, data parallel over that many local processes (gloo): every rank draws the same full batch and
    takes its slice; gradients are averaged, so every rank makes the same update. Returns the moving average.
    `checkpoint`: a file written every CHECKPOINT_EVERY steps, and resumed from when it exists."""
    if ranks == 1:
        return _train_transformer(0, 1, transformer, latents, caption_index, embeddings, token_weights, steps, batch,
                                  lr, seed, log,
                                  checkpoint, stop)
    import tempfile

    from paradiff.distributed.spawn import run_ranks

    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "ema.pt"
        run_ranks(_train_transformer_rank, ranks, kwargs=dict(result=result, transformer=transformer, args=(
            latents, caption_index, embeddings, token_weights, steps, batch, lr, seed, log, checkpoint, stop)),
            timeout_s=float("inf"), gloo_timeout_s=30 * 60)
        ema = copy.deepcopy(transformer)
        ema.load_state_dict(torch.load(result))
    return ema.eval().requires_grad_(False)


def _train_transformer_rank(rank: int, world_size: int, result: Path, transformer, args: tuple) -> None:
    torch.use_deterministic_algorithms(True)
    # spawn hands over tensors in shared memory: a copy of its own, so ranks never update one another's weights
    ema = _train_transformer(rank, world_size, copy.deepcopy(transformer), *args)
    if rank == 0:
        torch.save(ema.state_dict(), result)
        log = args[8]  # the TrainingLog, in _train_transformer's order
        # before the result reaches the parent: once it has every result it stops ranks slow to exit (a loaded
        # machine), and the buffered loss records of this process would be lost with it
        log.close()


def _train_transformer(rank: int, ranks: int, transformer, latents, caption_index, embeddings, token_weights, steps,
                       batch, lr,
                       seed, log, checkpoint: Path | None = None, stop: int | None = None):
    from diffusers import Flux2Pipeline

    generator = torch.Generator().manual_seed(seed)
    grid = latents.shape[-1]
    packed = Flux2Pipeline._pack_latents(latents)  # (N, grid*grid, channels)
    txt_ids, img_ids = position_ids(embeddings.shape[1], grid)
    ema = copy.deepcopy(transformer).requires_grad_(False)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    mine = slice(rank * batch // ranks, (rank + 1) * batch // ranks)
    first = 0
    if checkpoint is not None and checkpoint.is_file():
        # everything the next step depends on, so a resumed run continues exactly as an uninterrupted one
        state = torch.load(checkpoint)
        transformer.load_state_dict(state["transformer"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        first = state["step"] + 1
        if rank == 0:
            print(f"transformer: resumed after step {state['step']} from {checkpoint}", flush=True)
    transformer.train()
    for step in range(first, steps if stop is None else min(stop, steps)):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=min(100, steps // 4))
        index = torch.randint(len(packed), (batch,), generator=generator)
        variant = torch.randint(caption_index.shape[1], (batch,), generator=generator)
        noise = torch.randn((batch, *packed.shape[1:]), generator=generator)[mine]
        sigma = sample_sigmas(batch, generator)[mine].view(-1, 1, 1)
        index, variant = index[mine], variant[mine]
        x0 = packed[index]
        text = embeddings[caption_index[index, variant]]
        noisy = (1 - sigma) * x0 + sigma * noise
        prediction = transformer(hidden_states=noisy, encoder_hidden_states=text, timestep=sigma.view(-1),
                                 img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        weight = token_weights[index]
        loss = ((prediction - (noise - x0)).pow(2).mean(dim=-1) * weight).sum() / weight.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if ranks > 1:
            _average_gradients(transformer, loss)
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for average, current in zip(ema.parameters(), transformer.parameters()):
                average.lerp_(current, 1 - decay)
        if rank == 0:
            log("transformer", step, loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
            if checkpoint is not None and (step + 1) % CHECKPOINT_EVERY == 0 and step + 1 < steps:
                torch.save({"step": step, "transformer": transformer.state_dict(), "ema": ema.state_dict(),
                            "optimizer": optimizer.state_dict(), "generator": generator.get_state()},
                           checkpoint.with_suffix(".tmp"))
                checkpoint.with_suffix(".tmp").replace(checkpoint)
                log.flush()
    transformer.eval()
    return ema.eval()


CHECKPOINT_EVERY = 250


def _average_gradients(model, loss: torch.Tensor) -> None:
    """One all-reduce of every gradient and the loss (for the log), flattened together, divided by the ranks."""
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    loss.data.copy_(flat[-1])


class TrainingLog:
    """Loss records, one JSON line each, appended to `path` by whichever process trains; every 50th printed."""

    def __init__(self, path: Path, start: float) -> None:
        self.path, self.start, self._file = path, start, None

    def __getstate__(self) -> dict:
        return {"path": self.path, "start": self.start, "_file": None}

    def __call__(self, stage: str, step: int, **values: float) -> None:
        if self._file is None:
            self._file = self.path.open("a")
        # perf_counter is CLOCK_MONOTONIC: one clock for all processes of the machine
        record = {"stage": stage, "step": step, "time_s": round(time.perf_counter() - self.start, 2), **values}
        self._file.write(json.dumps(record) + "\n")
        if step % 50 == 0:
            self.flush()
            print(json.dumps(record), flush=True)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# --- the whole run ----------------------------------------------------------------------------------------------


def caption_table(scenes: list[shapes.Scene]) -> tuple[list[str], torch.Tensor]:
    """Every caption variant (with and without size and place) of every scene, and per scene the index of each."""
    captions: dict[str, int] = {}
    rows = []
    for scene in scenes:
        row = []
        for with_size in (False, True):
            for with_place in (False, True):
                row.append(captions.setdefault(scene.caption(with_size, with_place), len(captions)))
        rows.append(row)
    return list(captions), torch.tensor(rows)


def save_pipeline(components: dict, out: Path) -> None:
    """Write the pipeline folder beside `out` and swap it into place, so a failed save never leaves half a folder."""
    from diffusers import Flux2Pipeline

    pipeline = Flux2Pipeline(**components)
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    pipeline.save_pretrained(staging, safe_serialization=True)
    for path in staging.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # some writers create 0600 files; package data is read by all
    staging.chmod(0o755)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


PROFILES = {
    # images for the VAE, its steps, batch and peak learning rate, the decoder's steps and peak learning rate;
    # images for the transformer, its steps, batch, peak learning rate and data-parallel processes
    "full": dict(vae_pool=4096, vae_steps=600, vae_batch=32, vae_lr=3e-3, decoder_steps=400, decoder_lr=2e-3,
                 pool=8192, steps=12000, batch=32, lr=1e-3, ranks=2),
    "quick": dict(vae_pool=32, vae_steps=30, vae_batch=8, vae_lr=3e-3, decoder_steps=4, decoder_lr=2e-3,
                  pool=32, steps=12, batch=8, lr=1e-3, ranks=2),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="pipeline folder to write")
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "train_demo",
                        help="checkpoints of each stage (a rerun resumes after the last finished stage)")
    parser.add_argument("--quick", action="store_true", help="a few steps of each stage (tests)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; results are reproducible for a fixed count (1: on a shared 2-core "
                             "machine, 2 threads spin-wait on each other and run 10x slower)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end the transformer's training after this many steps of its (unchanged) schedule and "
                             "save its moving average then; with a checkpoint of that step in --work, only saves")
    args = parser.parse_args(argv)
    profile = PROFILES["quick" if args.quick else "full"]
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One file per finished stage (the transformer's also every CHECKPOINT_EVERY steps); a rerun resumes from them.
    # --quick never resumes.
    checkpoints = {stage: args.work / f"{stage}.pt" for stage in ("vae", "decoder", "transformer")}
    partial = args.work / "transformer_checkpoint.pt"
    finished = {stage for stage, path in checkpoints.items() if path.is_file() and not args.quick}
    done_steps = torch.load(partial)["step"] if partial.is_file() and not args.quick else -1
    log_path = args.work / "train_log.jsonl"
    kept = [record for record in map(json.loads, log_path.read_text().splitlines() if log_path.is_file() else [])
            if record["stage"] in finished or (record["stage"] == "transformer" and record["step"] <= done_steps)]
    log_path.write_text("".join(json.dumps(record) + "\n" for record in kept))
    start = time.perf_counter()
    log = TrainingLog(log_path, start)

    seed = args.seed
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer, seed + 1)

    vae = build_vae(seed + 2)
    if "vae" in finished:
        vae.load_state_dict(torch.load(checkpoints["vae"]))
    else:
        vae_pool, _ = draw_pool(profile["vae_pool"], seed + 3)
        train_vae(vae, vae_pool, profile["vae_steps"], profile["vae_batch"], profile["vae_lr"], seed + 4, log)
        mean, var = latent_statistics(vae, vae_pool)
        vae.bn.running_mean.copy_(mean)
        vae.bn.running_var.copy_(var)
        torch.save(vae.state_dict(), checkpoints["vae"])
    vae.eval().requires_grad_(False)

    # the decoder's further training leaves the encoder, and so everything the transformer sees, as it was
    final_vae = copy.deepcopy(vae)
    if "decoder" in finished:
        final_vae.load_state_dict(torch.load(checkpoints["decoder"]))
    else:
        vae_pool, _ = draw_pool(profile["vae_pool"], seed + 3)
        train_decoder(final_vae, vae_pool, profile["decoder_steps"], profile["vae_batch"], profile["decoder_lr"],
                      seed + 8, log)
        torch.save(final_vae.state_dict(), checkpoints["decoder"])

    transformer = build_transformer(seed + 6)
    if "transformer" in finished:
        ema = copy.deepcopy(transformer)
        ema.load_state_dict(torch.load(checkpoints["transformer"]))
        ema.eval().requires_grad_(False)
    else:
        pool, scenes = draw_pool(profile["pool"], seed + 5)
        latents = encode_latents(vae, pool)
        captions, caption_index = caption_table(scenes)
        token_weights = shape_token_weights(pool, latents.shape[-1])
        embeddings = encode_captions(tokenizer, text_encoder, captions)
        print(f"data: {len(pool)} images, latents {tuple(latents.shape[1:])}, {len(captions)} captions "
              f"{tuple(embeddings.shape[1:])} ({time.perf_counter() - start:.0f} s)", flush=True)
        log.close()  # the training processes append to it
        ema = train_transformer(transformer, latents, caption_index, embeddings, token_weights, profile["steps"],
                                profile["batch"],
                                profile["lr"], seed + 7, log, ranks=profile["ranks"],
                                checkpoint=None if args.quick else partial, stop=args.stop_after)
        if args.stop_after is None or args.stop_after >= profile["steps"]:  # a stopped run is not a finished stage
            torch.save(ema.state_dict(), checkpoints["transformer"])
    log.close()
    save_pipeline(dict(scheduler=build_scheduler(), vae=final_vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=ema), args.out)
    shutil.copy(log_path, args.out / "train_log.jsonl")
    size = sum(p.stat().st_size for p in args.out.rglob("*.safetensors"))
    print(f"wrote {args.out} ({size / 1e6:.1f} MB of weights) in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
