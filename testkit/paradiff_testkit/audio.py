"""A tiny, random-weight Stable Audio Open pipeline (`StableAudioPipeline`), saved as a real pipeline folder: a
StableAudioDiTModel with 4 heads, the Oobleck VAE, a T5 text encoder with its locally learnt tokenizer, and the
number conditioner. Nothing is downloaded. Its sampling rate is 16 Hz, so a 2-second sound is 32 samples."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from paradiff_testkit.pipelines import _seeded, _t5_config, _t5_tokenizer

SAMPLING_RATE = 16
CALL_KWARGS = dict(prompt="a dog barking in the rain", negative_prompt="noise", guidance_scale=3.0,
                   num_inference_steps=3, audio_end_in_s=2.0, output_type="np")


def build_stable_audio(seed: int = 0):
    import diffusers
    from transformers import T5Config, T5EncoderModel

    tokenizer = _t5_tokenizer()
    with _seeded(seed, 1):
        text_encoder = T5EncoderModel(_t5_config(T5Config, tokenizer, feed_forward_proj="relu"))
    with _seeded(seed, 2):
        projection_model = diffusers.StableAudioProjectionModel(
            text_encoder_dim=text_encoder.config.d_model, conditioning_dim=16, min_value=0, max_value=32)
    with _seeded(seed, 3):
        # hop length 2 x 2 = 4 samples per latent step
        vae = diffusers.AutoencoderOobleck(
            encoder_hidden_size=6, downsampling_ratios=[2, 2], decoder_channels=6, decoder_input_channels=4,
            audio_channels=2, channel_multiples=[2, 4], sampling_rate=SAMPLING_RATE)
    with _seeded(seed, 0):
        transformer = diffusers.StableAudioDiTModel(
            sample_size=8, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            num_key_value_attention_heads=2, out_channels=4, cross_attention_dim=16, time_proj_dim=16,
            global_states_input_dim=32, cross_attention_input_dim=16)
        with torch.no_grad():
            for param in transformer.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    scheduler = diffusers.CosineDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential")
    pipe = diffusers.StableAudioPipeline(vae=vae, text_encoder=text_encoder, projection_model=projection_model,
                                         tokenizer=tokenizer, transformer=transformer, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_stable_audio(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny Stable Audio pipeline as a folder; does nothing if `folder/model_index.json` exists."""
    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return folder
    pipe = build_stable_audio(seed)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    os.chmod(staging, 0o755)
    try:
        pipe.save_pretrained(staging, safe_serialization=True)
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
