"""Audio pipelines. Their outputs are waveforms (`audios`): the check compares every sample (relative 1e-5).

Stable Audio Open: the tiny pipeline of paradiff_testkit.audio (Oobleck VAE of hop 4 at 16 Hz, a T5 encoder with
its locally learnt tokenizer, the number conditioner); batch CFG, one call on [uncond, cond]. The transformer always
denoises its `sample_size` (8) latent steps, 2 seconds (32 samples), the call's length cut from them: with the
global-conditioning token in front, 9 tokens, which two ranks do not divide."""

from paradiff_testkit.zoo import Recipe, TinyFamily


def stable_audio_components(seed: int) -> dict:
    from paradiff_testkit.audio import build_stable_audio

    parts = dict(build_stable_audio(seed).components)
    parts.pop("transformer")
    return parts


FAMILIES = {
    "stable_audio": TinyFamily(
        transformer_class="StableAudioDiTModel",
        transformer=dict(sample_size=8, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                         num_key_value_attention_heads=2, out_channels=4, cross_attention_dim=16, time_proj_dim=16,
                         global_states_input_dim=32, cross_attention_input_dim=16),
        components=stable_audio_components,
        call=dict(prompt="a dog barking in the rain", negative_prompt="noise", guidance_scale=3.0,
                  num_inference_steps=2, audio_end_in_s=2.0, output_type="np")),
}

RECIPES = {
    "StableAudioPipeline": Recipe(family="stable_audio"),
}


# --- Stable Audio 3 --------------------------------------------------------------------------------------------------
# A T5Gemma encoder (Gemma's tokenizer, learnt locally; the pipeline pads prompts to 256 tokens), the SAME
# autoencoder (patches of 2 samples, one stride-2 level: 4 samples per latent step, 16 Hz), 3 learnt memory tokens
# in front of the audio. 2.5 seconds are 40 samples, 10 latent steps: 13 tokens, which two ranks do not divide.
SA3_TEXT_WIDTH = 32


def stable_audio3_components(seed: int) -> dict:
    import diffusers
    from transformers import T5GemmaConfig, T5GemmaEncoderModel, T5GemmaModuleConfig

    from paradiff_testkit import pipelines as tiny

    tokenizer = tiny._gemma_tokenizer()
    module = T5GemmaModuleConfig(
        vocab_size=len(tokenizer), hidden_size=SA3_TEXT_WIDTH, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512, sliding_window=512,
        layer_types=["full_attention", "full_attention"], pad_token_id=tokenizer.pad_token_id)
    with tiny._seeded(seed, 1):
        text_encoder = T5GemmaEncoderModel(T5GemmaConfig(encoder=module.to_dict(), decoder=module.to_dict(),
                                                         is_encoder_decoder=False))
    # every weight perturbed: the autoencoder zero-initialises layers that would make its output ignore the latents
    vae = tiny.random_model(diffusers.AutoencoderSAME, dict(
        audio_channels=2, patch_size=2, encoder_channels=8, encoder_c_mults=(2,), encoder_strides=(2,),
        encoder_transformer_depths=(1,), latent_dim=8, use_differential_attention=False, dim_heads=4, ff_mult=2,
        sampling_rate=16), seed, 3, std=0.2)
    with tiny._seeded(seed, 2):
        duration_embedder = diffusers.StableAudio3DurationEmbedder(output_dim=SA3_TEXT_WIDTH, fourier_dim=16)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0,
                                                          stochastic_sampling=False)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                duration_embedder=duration_embedder)


def _waveform(seconds: float, seed: int):
    import torch

    return torch.randn(1, 2, int(16 * seconds), generator=torch.Generator().manual_seed(seed)) * 0.3


SA3_SECONDS = 2.5
FAMILIES["stable_audio3"] = TinyFamily(
    transformer_class="StableAudio3DiTModel",
    transformer=dict(io_channels=8, patch_size=1, embed_dim=64, depth=2, num_heads=4, cond_token_dim=SA3_TEXT_WIDTH,
                     global_cond_dim=SA3_TEXT_WIDTH, local_add_cond_dim=9, timestep_features_dim=16, ff_mult=2.0,
                     num_memory_tokens=3, use_differential_attention=True),
    components=stable_audio3_components,
    call=dict(prompt="a dog barking in the rain", negative_prompt="noise", guidance_scale=3.0, duration=SA3_SECONDS,
              num_inference_steps=2, output_type="np"))

RECIPES.update({
    "StableAudio3Pipeline": Recipe(family="stable_audio3"),
    # audio to audio: the reference waveform's latents mixed with noise (distilled: no guidance)
    "StableAudio3AudioToAudioPipeline": Recipe(
        extends="StableAudio3Pipeline", drop=("negative_prompt", "guidance_scale"),
        call=dict(audio=_waveform(SA3_SECONDS, 5), init_noise_level=0.7)),
    # inpainting: the reference outside [0.5 s, 1.5 s) kept, its latents and the mask added to every block's audio
    # positions (local_add_cond: 8 latent channels + the mask)
    "StableAudio3InpaintPipeline": Recipe(
        extends="StableAudio3Pipeline", drop=("negative_prompt", "guidance_scale"),
        call=dict(audio=_waveform(SA3_SECONDS, 5), mask_start_seconds=0.5, mask_end_seconds=1.5)),
})


# --- LongCat-AudioDiT ------------------------------------------------------------------------------------------------
# A UMT5 encoder (the T5 tokenizer), the LongCat audio VAE at 16 Hz with one stride-2 level; CFG as two calls (the
# prompt's, then the negative prompt's). 1.4 seconds are 11 latent steps, which two ranks do not divide.
def longcat_audio_components(seed: int) -> dict:
    import diffusers
    from transformers import UMT5Config, UMT5EncoderModel

    from paradiff_testkit import pipelines as tiny

    tokenizer = tiny._t5_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = UMT5EncoderModel(tiny._t5_config(UMT5Config, tokenizer, feed_forward_proj="gated-gelu"))
    vae = tiny.random_model(diffusers.LongCatAudioDiTVae, dict(
        in_channels=1, channels=16, c_mults=[1, 2], strides=[2], latent_dim=8, encoder_latent_dim=16,
        downsampling_ratio=2, sample_rate=16), seed, 3)
    return dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0, invert_sigmas=True))


FAMILIES["longcat_audio"] = TinyFamily(
    transformer_class="LongCatAudioDiTTransformer",
    transformer=dict(dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32, latent_dim=8, text_conv=False),
    components=longcat_audio_components,
    call=dict(prompt="a dog barking in the rain", negative_prompt="noise", guidance_scale=3.0, audio_duration_s=1.4,
              num_inference_steps=2, output_type="np"))
RECIPES["LongCatAudioDiTPipeline"] = Recipe(family="longcat_audio")


# --- ACE-Step 1.5 ----------------------------------------------------------------------------------------------------
# A Qwen3 text encoder (the Qwen3 chat tokenizer, learnt locally) for the prompt and the lyrics, the condition
# encoder (lyrics and timbre encoders, the learnt null condition), the Oobleck VAE at 50 Hz with one stride-2 level
# (25 latent steps a second), patches of 2 latent steps; batch CFG on [cond, uncond] with the null condition
# (APG). The audio tokenizer and detokenizer only serve cover / audio-code tasks: left out.
def ace_step_components(seed: int) -> dict:
    import diffusers
    from transformers import Qwen3Config, Qwen3Model

    from paradiff_testkit import pipelines as tiny

    tokenizer = tiny._qwen3_chat_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id))
    condition_encoder = tiny.random_model(diffusers.AceStepConditionEncoder, dict(
        hidden_size=32, intermediate_size=64, text_hidden_dim=32, timbre_hidden_dim=8,
        num_lyric_encoder_hidden_layers=2, num_timbre_encoder_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=10000.0, sliding_window=16), seed, 2)
    with tiny._seeded(seed, 3):
        vae = diffusers.AutoencoderOobleck(
            encoder_hidden_size=6, downsampling_ratios=[1, 2], decoder_channels=6, decoder_input_channels=8,
            audio_channels=2, channel_multiples=[2, 4], sampling_rate=50)
    return dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, condition_encoder=condition_encoder,
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0),
                audio_tokenizer=None, audio_token_detokenizer=None)


FAMILIES["ace_step"] = TinyFamily(
    transformer_class="AceStepTransformer1DModel",
    transformer=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8, patch_size=2,
                     rope_theta=10000.0, sliding_window=16),
    components=ace_step_components,
    call=dict(prompt="a beautiful piano piece", lyrics="[verse]\nsoft notes in the morning", audio_duration=0.88,
              guidance_scale=3.0, num_inference_steps=2, max_text_length=32, output_type="np"))
RECIPES["AceStepPipeline"] = Recipe(family="ace_step")
