"""Ideogram 4: two transformers of the same class, the conditional one on [text, image] tokens and the
unconditional one on the image tokens alone (asymmetric CFG, one call each a step); the text features are 13 layers
of a Qwen3-VL text model (36 layers here, 8 wide: 104 features a token), the prompt left-padded to
`max_sequence_length`. The FLUX.2 VAE of the flux2 family (factor 2) and 2 x 2 patches: 44 x 36 pixels are 99
image tokens."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Recipe, TinyFamily

LAYERS = 36  # the pipeline taps hidden states 0, 3, ..., 33, 35
WIDTH = 8


def components(seed: int) -> dict:
    import diffusers
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from paradiff_testkit.zoo.processors import QWEN_VL_CHAT_TEMPLATE

    tokenizer = tiny._qwen2_tokenizer()
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    with tiny._seeded(seed, 1):
        text_encoder = Qwen3VLModel(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=16,
                             num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             max_position_embeddings=1024,
                             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                              "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=WIDTH,
                               patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))).eval()
    return dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny.family_components("flux2", seed)["vae"],
                text_encoder=text_encoder, tokenizer=tokenizer, prompt_enhancer_head=None)


def unconditional_transformer(seed: int, parts: dict, config: dict):
    import diffusers

    return tiny.random_model(diffusers.Ideogram4Transformer2DModel, config, seed, 4)


FAMILIES = {
    "ideogram4": TinyFamily(
        transformer_class="Ideogram4Transformer2DModel",
        transformer=dict(in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
                         intermediate_size=96, adaln_dim=32, llm_features_dim=WIDTH * 13, mrope_section=(2, 2, 2)),
        components=components,
        call=dict(prompt="a small red fox running through the snow", guidance_scale=3.0, guidance_schedule=None,
                  num_inference_steps=2, max_sequence_length=24, output_type="np", height=44, width=36)),
}

RECIPES = {"Ideogram4Pipeline": Recipe(family="ideogram4",
                                       components=dict(unconditional_transformer=unconditional_transformer))}
