"""Audio pipelines. Their outputs are waveforms (`audios`): the check compares every sample (relative 1e-5).

Stable Audio Open: the tiny pipeline of paradiff.testing.audio (Oobleck VAE of hop 4 at 16 Hz, a T5 encoder with
its locally learnt tokenizer, the number conditioner); batch CFG, one call on [uncond, cond]. The transformer always
denoises its `sample_size` (8) latent steps, 2 seconds (32 samples), the call's length cut from them: with the
global-conditioning token in front, 9 tokens, which two ranks do not divide."""

from paradiff.testing.zoo import Recipe, TinyFamily


def stable_audio_components(seed: int) -> dict:
    from paradiff.testing.audio import build_stable_audio

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
