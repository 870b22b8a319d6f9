"""Tiny `transformers` text and image encoders with random weights, saved as real checkpoints, and batch-2 inputs
for them (text padded to different lengths): one per encoder class a diffusers DiT pipeline loads that paradiff
has a plan for. Used by tests/test_encoder_classes.py; nothing is downloaded.

Head counts divide 2 and 3 (12 query and 6 K/V heads for the decoders, 6 heads for BERT / CLIP / SigLIP), so every
class runs at tp2 and tp3, the decoders with grouped K/V heads split (not replicated) at both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

VOCAB = 99  # does not divide 2 or 3: the vocabulary splits unevenly
TEXT_LENGTHS = (7, 4)  # the second prompt is right-padded
IMAGE_SIZE, PATCH = 16, 4

# a Llama-style decoder: 12 query heads of 8, 6 K/V heads
_DECODER = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=96, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=6, head_dim=8)
_MROPE = dict(rope_type="default", mrope_section=[2, 1, 1], rope_theta=10000.0)  # sums to head_dim / 2
# Gemma 4: global layers with their own head size and no V projection (V is K), the last two layers reusing the
# K/V of the first two, double-wide MLPs there, per-layer token embeddings
_GEMMA4_TEXT = dict(_DECODER, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                    sliding_window=4, global_head_dim=16, num_global_key_value_heads=6, attention_k_eq_v=True,
                    num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                    vocab_size_per_layer_input=VOCAB)
# a BERT / CLIP / SigLIP tower: 6 heads of 4
_TOWER = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=6, intermediate_size=48)
_VISION = dict(_TOWER, image_size=IMAGE_SIZE, patch_size=PATCH)
_SMALL_VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


# head counts and MLP widths no TP degree divides: 5 query heads over 1 K/V head, 6 over 3, a 37-wide MLP
_UNEVEN_DECODER = dict(_DECODER, hidden_size=40, intermediate_size=37, num_attention_heads=5, num_key_value_heads=1)
_UNEVEN_TOWER = dict(hidden_size=20, num_hidden_layers=2, num_attention_heads=5, intermediate_size=37)


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    return {
        # "<class>@uneven": the class with heads and widths split floor/ceil at tp2 and tp3
        "Qwen3Model@uneven": lambda: tf.Qwen3Config(**_UNEVEN_DECODER),
        "GlmModel@uneven": lambda: tf.GlmConfig(**dict(_UNEVEN_DECODER, hidden_size=48, num_attention_heads=6,
                                                       num_key_value_heads=3), partial_rotary_factor=0.5),
        "BertModel@uneven": lambda: tf.BertConfig(vocab_size=VOCAB, pad_token_id=0, max_position_embeddings=16,
                                                 **_UNEVEN_TOWER),
        "T5EncoderModel@uneven": lambda: tf.T5Config(vocab_size=VOCAB, d_model=20, d_kv=4, d_ff=37, num_layers=2,
                                                     num_heads=5, feed_forward_proj="gated-gelu",
                                                     is_encoder_decoder=False),
        "BertModel": lambda: tf.BertConfig(vocab_size=VOCAB, pad_token_id=0, max_position_embeddings=16, **_TOWER),
        "Gemma4UnifiedForConditionalGeneration": lambda: tf.Gemma4UnifiedConfig(text_config={
            k: v for k, v in _GEMMA4_TEXT.items() if "per_layer_input" not in k}),
        "Gemma4TextModel": lambda: tf.Gemma4TextConfig(**_GEMMA4_TEXT),
        "GlmModel": lambda: tf.GlmConfig(**_DECODER, partial_rotary_factor=0.5),
        "GemmaModel": lambda: tf.GemmaConfig(**_DECODER),
        "Gemma3ForConditionalGeneration": lambda: tf.Gemma3Config(
            text_config=dict(_DECODER, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(_SMALL_VISION, image_size=8, patch_size=4), mm_tokens_per_image=4,
            image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3),
        "SmolLM3ForCausalLM": lambda: tf.SmolLM3Config(**_DECODER, no_rope_layer_interval=2),
        # PRX's text encoder: diffusers' wrapper of the bare encoder, whose folder keeps the encoder-decoder config
        "T5GemmaEncoder": lambda: tf.T5GemmaConfig(encoder=dict(_DECODER), decoder=dict(_DECODER),
                                                   is_encoder_decoder=False, vocab_size=VOCAB),
        "T5GemmaEncoderModel": lambda: tf.T5GemmaConfig(encoder=dict(_DECODER), decoder=dict(_DECODER),
                                                        is_encoder_decoder=False, vocab_size=VOCAB),
        "T5Gemma2Encoder": lambda: tf.T5Gemma2EncoderConfig(
            text_config=dict(_DECODER, dropout_rate=0.0), vision_config=dict(_SMALL_VISION, image_size=8, patch_size=4),
            mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3),
        "Qwen2VLForConditionalGeneration": lambda: tf.Qwen2VLConfig(
            text_config=dict(_DECODER, rope_parameters=_MROPE),
            vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=96, patch_size=2, spatial_merge_size=1,
                               temporal_patch_size=1, mlp_ratio=2)),
        "Qwen3VLForConditionalGeneration": lambda: tf.Qwen3VLConfig(
            text_config=dict(_DECODER, rope_parameters=_MROPE),
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=96,
                               patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
                               deepstack_visual_indexes=[0])),
        "Qwen3VLModel": lambda: _configs()["Qwen3VLForConditionalGeneration"](),
        "LlavaForConditionalGeneration": lambda: tf.LlavaConfig(
            text_config=dict(_DECODER, model_type="llama"),
            vision_config=dict(_SMALL_VISION, model_type="clip_vision_model", image_size=8, patch_size=4),
            image_token_index=VOCAB - 1),
        "CLIPVisionModel": lambda: tf.CLIPVisionConfig(**_VISION),
        "CLIPVisionModelWithProjection": lambda: tf.CLIPVisionConfig(**_VISION, projection_dim=12),
        "SiglipVisionModel": lambda: tf.SiglipVisionConfig(**_VISION),
        "SiglipModel": lambda: tf.SiglipConfig(
            text_config=dict(_TOWER, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=1, eos_token_id=2),
            vision_config=_VISION),
        "Siglip2VisionModel": lambda: tf.Siglip2VisionConfig(**_TOWER, patch_size=PATCH,
                                                             num_patches=(IMAGE_SIZE // PATCH) ** 2),
    }


ENCODER_CLASSES = tuple(_configs())


def encoder_class(name: str) -> type:
    import transformers

    name = name.partition("@")[0]
    if name == "T5GemmaEncoder":  # defined by diffusers' PRX pipeline package, not exported by transformers
        from diffusers.pipelines.prx import T5GemmaEncoder

        return T5GemmaEncoder
    return getattr(transformers, name)


# The text encoders of FLUX.2, Qwen-Image and Wan with 64-wide heads and 128-wide inputs: at tp2 every slice of every
# linear they split (rows or columns) is whole NF4 blocks of 64 elements (docs/quantization.md). Mistral keeps one
# K/V head (replicated at tp2), Qwen2.5-VL two (split).
_BLOCK_DECODER = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=128,
                      intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, head_dim=64)


def _block_wide_configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    return {
        "Mistral3ForConditionalGeneration": lambda: tf.Mistral3Config(
            text_config=dict(_BLOCK_DECODER, model_type="mistral", num_key_value_heads=1, sliding_window=None),
            vision_config=dict(_SMALL_VISION, model_type="pixtral", image_size=8, patch_size=4),
            image_token_index=VOCAB - 1, spatial_merge_size=2, multimodal_projector_bias=False,
            tie_word_embeddings=False),
        "Qwen2_5_VLForConditionalGeneration": lambda: tf.Qwen2_5_VLConfig(
            text_config=dict(_BLOCK_DECODER, num_key_value_heads=2,
                             rope_parameters=dict(rope_type="default", mrope_section=[8, 12, 12], rope_theta=1e4)),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                               spatial_merge_size=1, temporal_patch_size=1, out_hidden_size=128,
                               fullatt_block_indexes=[0])),
        "UMT5EncoderModel": lambda: tf.UMT5Config(vocab_size=VOCAB, d_model=128, d_kv=64, d_ff=256, num_layers=2,
                                                  num_heads=2, feed_forward_proj="gated-gelu",
                                                  is_encoder_decoder=False),
    }


BLOCK_WIDE_ENCODERS = tuple(_block_wide_configs())


def build_encoder(name: str, seed: int = 0, block_wide: bool = False) -> nn.Module:
    """The class with its tiny config (`block_wide`: the one of BLOCK_WIDE_ENCODERS) and random weights; norms and
    biases perturbed too, so a wrong slice cannot hide behind ones and zeros."""
    from paradiff.plans import model_config

    torch.manual_seed(seed)
    cls = encoder_class(name)
    model = cls(model_config(cls, (_block_wide_configs() if block_wide else _configs())[name]()))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def save_encoder(name: str, folder: Path, seed: int = 0, block_wide: bool = False) -> Path:
    build_encoder(name, seed, block_wide).save_pretrained(folder, safe_serialization=True)
    if name == "T5GemmaEncoder":  # as PRX ships it: the encoder-decoder config beside the encoder's weights
        _configs()[name]().save_pretrained(folder)
    return Path(folder)


def encoder_inputs(name: str, config: Any, seed: int = 1) -> dict[str, torch.Tensor]:
    """Batch-2 forward kwargs: token ids with an attention mask of two lengths for text encoders, pixels for image
    encoders (SigLIP 2: patches with a patch mask of two lengths), both for SiglipModel."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(TEXT_LENGTHS)
    mask = torch.tensor([[1] * n + [0] * (longest - n) for n in TEXT_LENGTHS])
    ids = torch.randint(1, VOCAB - 1, (2, longest), generator=generator) * mask  # padding is token 0
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    if name == "Siglip2VisionModel":
        side = IMAGE_SIZE // PATCH
        patches = torch.randn(2, side * side, 3 * PATCH * PATCH, generator=generator)
        patch_mask = torch.ones(2, side * side, dtype=torch.long)
        patch_mask[1, side * (side - 1):] = 0  # the second image is one row of patches shorter
        shapes = torch.tensor([[side, side], [side - 1, side]])
        return dict(pixel_values=patches, pixel_attention_mask=patch_mask, spatial_shapes=shapes)
    if name.startswith(("CLIPVision", "SiglipVision")):
        return dict(pixel_values=pixels)
    if name == "SiglipModel":
        return dict(input_ids=ids, pixel_values=pixels)  # SigLIP's text tower is trained without a mask
    return dict(input_ids=ids, attention_mask=mask)


def encoder_outputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor a pipeline could read: all hidden states (pipelines pick layers), the last hidden state, the
    pooled / projected outputs and the logits, whichever the class returns."""
    with torch.no_grad():
        output = model(**inputs, output_hidden_states=True, return_dict=True)
    tensors = []

    def collect(value) -> None:
        if torch.is_tensor(value):
            tensors.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                collect(item)
        elif hasattr(value, "to_tuple"):
            collect(value.to_tuple())

    collect(output.to_tuple())
    return tensors


def save_wan_i2v_encoders(folder: Path) -> Path:
    """The tiny Wan pipeline as a `WanImageToVideoPipeline` folder, with the tiny `CLIPVisionModel` as its image
    encoder and a CLIP image processor at IMAGE_SIZE: enough for `encode_prompt` and `encode_image` (its transformer
    takes no image tokens, so it does not generate image-to-video)."""
    import json

    from transformers import CLIPImageProcessor

    from paradiff_testkit.pipelines import save_pipeline

    folder = save_pipeline("wan", folder)
    save_encoder("CLIPVisionModel", folder / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
                       ).save_pretrained(folder / "image_processor")
    index = json.loads((folder / "model_index.json").read_text())
    index.update(_class_name="WanImageToVideoPipeline", image_encoder=["transformers", "CLIPVisionModel"],
                 image_processor=["transformers", "CLIPImageProcessor"])
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder


def sample_images(seed: int = 2) -> list:
    """Two different RGB images, larger than IMAGE_SIZE (the processor resizes and crops them)."""
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(seed)
    return [Image.fromarray(generator.integers(0, 256, (24, 20, 3), dtype=np.uint8)) for _ in range(2)]


def save_cogview4_pipeline(folder: Path, seed: int = 0) -> Path:
    """A tiny CogView4 pipeline (GLM text encoder of 4 query / 2 K/V heads, three layers as the pipeline reads the
    second to last; the family's tiny transformer; a 4-block VAE), saved as a pipeline folder."""
    import diffusers
    from transformers import GlmConfig, GlmModel

    from paradiff.plans.cogview4 import EXAMPLES
    from paradiff_testkit.pipelines import _qwen2_tokenizer

    tokenizer = _qwen2_tokenizer()  # GLM-4's tokenizer is a byte-level BPE too
    torch.manual_seed(seed)
    text_encoder = GlmModel(GlmConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, eos_token_id=None))
    _, transformer_config = EXAMPLES["cogview4"]
    transformer = diffusers.CogView4Transformer2DModel(**transformer_config)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        latent_channels=transformer_config["in_channels"], norm_num_groups=4, sample_size=64)
    for module in (text_encoder, transformer, vae):
        with torch.no_grad():
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear")
    pipe = diffusers.CogView4Pipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                                      transformer=transformer, scheduler=scheduler)
    pipe.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


# a negative prompt of its own: the tiny tokenizer adds no special tokens, so "" would be zero tokens
COGVIEW4_CALL = dict(height=64, width=64, num_inference_steps=2, guidance_scale=4.0, output_type="np",
                     negative_prompt=["blurry", "blurry, low quality"])
