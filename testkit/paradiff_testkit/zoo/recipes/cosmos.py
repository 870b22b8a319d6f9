"""Cosmos pipelines (1.0 Text2World / Video2World, Predict2 Text2Image / Video2World): a T5 text encoder, two
transformer calls a step (the prompt, then the negative prompt), a safety checker the pipelines will not run without
(`PassThroughGuardrail`: NVIDIA's guardrail models are large and downloaded; this one lets every prompt and frame
through). Predict2 decodes with a Wan VAE (factor 4 in space, 2 in time): 32 x 48 pixels are 4 x 6 tokens of
1 x 2 x 2 patches; 5 frames are 3 latent frames, 72 tokens. The transformers' padding-mask channel is off
(`concat_padding_mask` resizes the mask with torchvision, not installed here)."""

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_utils import ModelMixin

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily


class PassThroughGuardrail(ModelMixin, ConfigMixin):
    """A Cosmos safety checker that finds every prompt safe and returns every video unchanged (one buffer, so that it
    saves and loads as a model)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("anchor", torch.zeros(1))

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames: np.ndarray) -> np.ndarray:
        return frames


def guardrail(seed: int, parts: dict, config: dict):
    return PassThroughGuardrail()


def predict2_components(seed: int) -> dict:
    import diffusers

    text = tiny.family_components("pixart_sigma", seed)  # a T5 encoder and its tokenizer
    return dict(text_encoder=text["text_encoder"], tokenizer=text["tokenizer"],
                vae=tiny.family_components("wan", seed)["vae"],
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True))


def cosmos1_components(seed: int) -> dict:
    import diffusers

    text = tiny.family_components("pixart_sigma", seed)
    with tiny._seeded(seed, 3):
        # Haar-wavelet patches of 4, then factor 4 in space and time: 9 frames -> 3 latent frames
        vae = diffusers.AutoencoderKLCosmos(
            in_channels=3, out_channels=3, latent_channels=4, encoder_block_out_channels=(8, 8, 8, 8),
            decode_block_out_channels=(8, 8, 8, 8), attention_resolutions=(8,), resolution=64, num_layers=2,
            patch_size=4, patch_type="haar", scaling_factor=1.0, spatial_compression_ratio=4,
            temporal_compression_ratio=4)
    scheduler = diffusers.EDMEulerScheduler(
        sigma_min=0.002, sigma_max=80, sigma_data=0.5, sigma_schedule="karras", num_train_timesteps=1000,
        prediction_type="epsilon", rho=7.0, final_sigmas_type="sigma_min")
    return dict(text_encoder=text["text_encoder"], tokenizer=text["tokenizer"], vae=vae, scheduler=scheduler)


_CHAT = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
         "{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}")


def predict2_5_components(seed: int) -> dict:
    """Predict2.5 / Transfer2.5: a Qwen2.5-VL whose every layer's normalised hidden states are concatenated (2
    layers of 32: 64 text channels), the prompt in a chat of the tokenizer's template, UniPC sampling."""
    import diffusers

    qwen = tiny.family_components("qwenimage", seed)
    tokenizer = qwen["tokenizer"]
    tokenizer.chat_template = _CHAT
    return dict(text_encoder=qwen["text_encoder"], tokenizer=tokenizer,
                vae=tiny.family_components("wan", seed)["vae"], scheduler=diffusers.UniPCMultistepScheduler())


_TRANSFORMER = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                    mlp_ratio=2, text_embed_dim=32, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
                    rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable")
# the latents: the pipelines round the decoded frames to 8 bits for the safety checker, so the pixels of two runs
# that differ by float rounding differ by whole 1/255 steps
_CALL = dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
             guidance_scale=3.0, num_inference_steps=2, max_sequence_length=16, output_type="latent")

FAMILIES = {
    "cosmos2": TinyFamily(transformer_class="CosmosTransformer3DModel", transformer=_TRANSFORMER,
                          components=predict2_components, call=dict(_CALL, height=32, width=48)),
    "cosmos1": TinyFamily(transformer_class="CosmosTransformer3DModel", transformer=_TRANSFORMER,
                          components=cosmos1_components, call=dict(_CALL, height=32, width=48, num_frames=9)),
    "cosmos2_5": TinyFamily(transformer_class="CosmosTransformer3DModel",
                            transformer=dict(_TRANSFORMER, in_channels=5, text_embed_dim=64),
                            components=predict2_5_components, call=dict(_CALL, height=32, width=48, num_frames=5)),
}

RECIPES = {
    "Cosmos2TextToImagePipeline": Recipe(family="cosmos2", components=dict(safety_checker=guardrail)),
    # the image is the first latent frame (a condition-mask channel marks it), then 2 frames to generate
    "Cosmos2VideoToWorldPipeline": Recipe(extends="Cosmos2TextToImagePipeline", transformer=dict(in_channels=5),
                                          call=dict(image=Picture(32, 48), num_frames=5)),
    # Predict2.5 Text2World (its image and video inputs go through torchvision, not installed here)
    "Cosmos2_5_PredictBasePipeline": Recipe(family="cosmos2_5", components=dict(safety_checker=guardrail)),
    # Cosmos 1.0: the Cosmos VAE and EDM sampling; 9 frames are 3 latent frames of 4 x 6 tokens
    "CosmosTextToWorldPipeline": Recipe(family="cosmos1", components=dict(safety_checker=guardrail)),
    # 4 steps: with 2, EDM jumps from sigma 80 straight to 0.002 and the conditioned latents come out as the
    # difference of values ~200 times their size, whose float32 resolution (2^-16 = 1.5e-5) is above the tolerance:
    # scaling the transformer's weights by 1 + 1e-7 moved them by 1.5e-5 in one process (1.4e-6 with 4 steps)
    "CosmosVideoToWorldPipeline": Recipe(extends="CosmosTextToWorldPipeline", transformer=dict(in_channels=5),
                                         call=dict(image=Picture(32, 48), num_inference_steps=4)),
}


# --- Cosmos 3 Omni ----------------------------------------------------------------------------------------------------
# One packed sequence per call ([text, video], no batch axis), two calls a step (the prompt's pack, then the negative
# prompt's), the Wan VAE (factor 4 in space, 2 in time: 5 frames are 3 latent frames of 8 x 12 latents, 2 x 2
# patches: 4 x 6 tokens a frame), the tokenizer alone (the transformer embeds the token ids itself). Its guardrail
# is switched off by the pipeline's own flag (`enable_safety_checker=False`).
def cosmos3_components(seed: int) -> dict:
    import diffusers

    tokenizer = tiny._qwen2_tokenizer()
    tokenizer.chat_template = _COSMOS3_CHAT
    if len(tokenizer) > COSMOS3_VOCAB:
        raise ValueError(f"the tiny Qwen tokenizer has {len(tokenizer)} tokens, the transformer embeds {COSMOS3_VOCAB}")
    return dict(text_tokenizer=tokenizer, vae=tiny.family_components("wan", seed)["vae"],
                scheduler=diffusers.UniPCMultistepScheduler())


COSMOS3_VOCAB = 1024  # at least the tiny Qwen tokenizer's
# Qwen's chat layout, the message contents plain text
_COSMOS3_CHAT = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


FAMILIES["cosmos3"] = TinyFamily(
    transformer_class="Cosmos3OmniTransformer",
    transformer=dict(head_dim=16, hidden_size=64, intermediate_size=128, latent_channel=4, latent_patch_size=2,
                     num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16,
                     rope_theta=10000.0, vocab_size=COSMOS3_VOCAB, sound_gen=False, rope_axes_dim=[4, 2, 2]),
    components=cosmos3_components,
    call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
              guidance_scale=3.0, num_inference_steps=2, height=32, width=48, num_frames=5, output_type="latent"))
RECIPES["Cosmos3OmniPipeline"] = Recipe(family="cosmos3", init=dict(enable_safety_checker=False))
