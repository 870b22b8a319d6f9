"""Hunyuan-DiT pipelines: a BERT text encoder (77 tokens) and a T5 one (256 tokens: the transformer's attention pool
has a position for each), a four-level VAE (the pipeline lays its rotary grid out for a scale factor of 8) and 2 x 2 patches: 64 x 96
pixels are 4 x 6 = 24 image tokens. One transformer call a step on [uncond, cond]. The ControlNet (half the transformer's blocks less one)
reads the control image's latents; its residuals go to the transformer's second half."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily

TEXT_WIDTH, T5_WIDTH = 32, 24
SIZE = dict(height=64, width=96)
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_tokenizer():
    """A WordPiece vocabulary of the corpus's words and their characters (continuations too), BERT's specials first."""
    from transformers import BertTokenizer

    words = tiny._words(BertTokenizer(vocab={token: i for i, token in enumerate(BERT_SPECIALS)}).backend_tokenizer,
                        tiny._CORPUS)
    characters = sorted({c for word in words for c in word})
    tokens = BERT_SPECIALS + characters + [f"##{c}" for c in characters] + sorted(words)
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    return BertTokenizer(vocab=vocab, model_max_length=77)


def vae8(seed: int, **overrides):
    """A four-level AutoencoderKL: VAE scale factor 8."""
    return tiny._small_vae(seed, down_block_types=("DownEncoderBlock2D",) * 4,
                           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), **overrides)


def components(seed: int) -> dict:
    import diffusers
    from transformers import BertConfig, BertModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = bert_tokenizer(), tiny._t5_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = BertModel(BertConfig(
            vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=128, pad_token_id=0))
    with tiny._seeded(seed, 2):
        config = tiny._t5_config(T5Config, tokenizer_2, feed_forward_proj="gated-gelu")
        config.d_model = T5_WIDTH
        text_encoder_2 = T5EncoderModel(config)
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                                        beta_end=0.03, prediction_type="v_prediction", steps_offset=1,
                                        clip_sample=False)
    return dict(scheduler=scheduler, vae=vae8(seed, scaling_factor=0.13025), text_encoder=text_encoder,
                tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


FAMILIES = {
    "hunyuandit": TinyFamily(
        transformer_class="HunyuanDiT2DModel",
        transformer=dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=16,
                         hidden_size=64, num_layers=4, cross_attention_dim=TEXT_WIDTH, cross_attention_dim_t5=T5_WIDTH,
                         pooled_projection_dim=16, text_len=77, text_len_t5=256),
        components=components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  guidance_scale=5.0, num_inference_steps=2, output_type="np", use_resolution_binning=False, **SIZE)),
}

NO_SAFETY = dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)

RECIPES = {
    "HunyuanDiTPipeline": Recipe(family="hunyuandit", init=NO_SAFETY),
    # the ControlNet reads the control image's latents (4 channels) through its own patch embedding
    "HunyuanDiTControlNetPipeline": Recipe(
        extends="HunyuanDiTPipeline", controlnet=dict(conditioning_channels=4, transformer_num_layers=4),
        call=dict(control_image=Picture(**SIZE, seed=11), controlnet_conditioning_scale=0.8)),
    "HunyuanDiTPAGPipeline": Recipe(extends="HunyuanDiTPipeline", init=dict(pag_applied_layers="blocks.1"),
                                    call=dict(pag_scale=3.0)),
}
