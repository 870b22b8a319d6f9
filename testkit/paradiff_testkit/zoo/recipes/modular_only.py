"""Models diffusers 0.42.1 ships only as Modular Diffusers pipelines: each builder makes the pipeline class from its
default blocks and sets every component its blocks load (`update_components`), tiny, seeded, nothing downloaded.
Where the zoo has the model's standard pipeline (Qwen-Image 2.1, Helios pyramid, LTX-2), its tiny components are
reused (`zoo.build` of that recipe); the others are built here at the sizes of paradiff's family examples
(plans/<family>.py `EXAMPLES`), their text encoders from the tokenizers paradiff_testkit.pipelines learns locally.
Each builder's docstring says what its model needs; the distilled checkpoints whose blocks keep a disabled guider
(Helios pyramid, Wan-Animate 2) run with it on (`guider=`), so that the cfg modes have branches to split.
"""

from __future__ import annotations

# imported with the recipes: a modular folder names this module as its processors' library, and diffusers loads
# only from modules already imported
import paradiff_testkit.zoo.processors  # noqa: F401
from paradiff_testkit.zoo import ModularRecipe, Picture

PROMPT = "a small red fox running through the snow"
COSMOS3_CALL = dict(prompt=PROMPT, height=48, width=64, num_frames=5, use_system_prompt=False, output_type="np")
WAN_ANIMATE2_CALL = dict(
    prompt=PROMPT, image=Picture(48, 64), driving_video=[Picture(48, 64, seed=20 + frame) for frame in range(9)],
    height=48, width=64, segment_frame_length=5, prev_segment_conditioning_frames=1, num_inference_steps=2,
    max_sequence_length=16, output_type="np")
# a distilled checkpoint's guider is made disabled (guidance 1): the recipe turns it on, so the cfg modes have two
# branches to split
DISTILLED_GUIDANCE = dict(guidance_scale=3.0)
DISTILLED_NOTE = "guider on (guidance 3) though the distilled checkpoint runs without"
FLUX3_CALL = dict(prompt=PROMPT, height=44, width=36, num_inference_steps=2, max_new_tokens=4,
                  text_encoder_out_layers=(2, 4), max_sequence_length=64, output_type="np")


def _modular(class_name: str, components: dict, optional: tuple[str, ...] = ()):
    """`class_name` from its default blocks, with those of `components` its blocks expect (every one it loads from
    weights but those of `optional`, which the recipe's call does not use)."""
    import diffusers

    pipe = getattr(diffusers, class_name)()
    pipe.update_components(**{name: component for name, component in components.items()
                              if name in pipe._component_specs and component is not None})
    missing = sorted(name for name, spec in pipe._component_specs.items()
                     if spec.default_creation_method == "from_pretrained" and getattr(pipe, name, None) is None
                     and name not in optional)
    if missing:
        raise TypeError(f"the tiny {class_name} has no {missing}")
    return pipe


def _standard_parts(key: str, seed: int) -> dict:
    """The components of the zoo's tiny standard pipeline `key`."""
    from paradiff_testkit import zoo

    return dict(zoo.build(key, seed).components)


def qwenimage21_turbo(seed: int):
    """The zoo's Qwen-Image 2.1 components (a Qwen3-VL encoder read through a Qwen3VLProcessor), but a VAE whose four
    downsamplings are its whole 16x compression: the modular blocks read the factor as 2 ** len(temperal_downsample)
    (the standard pipeline fixes it at 16). Guidance-distilled (no guider); the KV cache off, as in the standard
    recipe."""
    import diffusers

    from paradiff_testkit import pipelines as tiny

    parts = _standard_parts("QwenImage21Pipeline", seed)
    with tiny._seeded(seed, 3):
        parts["vae"] = diffusers.AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True, True, True], is_residual=True, in_channels=3, out_channels=3,
            patch_size=1, scale_factor_temporal=8, scale_factor_spatial=16, latents_mean=[0.0] * 16,
            latents_std=[1.0] * 16)
    return _modular("QwenImage21TurboModularPipeline", parts)


def helios_pyramid_distilled(seed: int):
    """The zoo's Helios pyramid components with the DMD scheduler of the distilled checkpoint."""
    import diffusers

    parts = _standard_parts("HeliosPyramidPipeline", seed)
    parts["scheduler"] = diffusers.HeliosDMDScheduler.from_config(parts["scheduler"].config)
    return _modular("HeliosPyramidDistilledModularPipeline", parts)


def anima(seed: int):
    """Cosmos Predict2's DiT (the zoo's cosmos2 config, 16 latent channels) on a one-level Qwen-Image VAE (factor 2),
    a Qwen3 text encoder whose last hidden states the text conditioner cross-attends from T5 token embeddings."""
    import diffusers
    from transformers import Qwen3Config, Qwen3Model

    from paradiff_testkit import pipelines as tiny
    from paradiff_testkit.zoo.recipes.cosmos import _TRANSFORMER
    from paradiff_testkit.zoo.recipes.qwen3vl import qwen_vae

    tokenizer, t5_tokenizer = tiny._qwen2_tokenizer(), tiny._t5_tokenizer()
    with tiny._seeded(seed, 1):
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512)).eval()
    config = dict(_TRANSFORMER, in_channels=16, out_channels=16)
    conditioner = tiny.random_model(diffusers.AnimaTextConditioner, dict(
        source_dim=32, target_dim=config["text_embed_dim"], model_dim=32, num_layers=1, num_attention_heads=2,
        target_vocab_size=len(t5_tokenizer), min_sequence_length=16), seed, 4)
    return _modular("AnimaModularPipeline", dict(
        transformer=tiny.random_model(diffusers.CosmosTransformer3DModel, config, seed, 0), vae=qwen_vae(seed, 16),
        text_encoder=text_encoder, tokenizer=tokenizer, t5_tokenizer=t5_tokenizer, text_conditioner=conditioner,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler()))


def echo(seed: int):
    """The zoo's LTX-2 components; the transformer with LTX-2.3's gated attention and cross-attention modulation
    (Echo is an LTX-2.3 DMD checkpoint: one call a step, no guidance)."""
    import diffusers

    from paradiff_testkit import pipelines as tiny
    from paradiff_testkit import zoo

    parts = _standard_parts("LTX2Pipeline", seed)
    config = dict(zoo.transformer_config("LTX2Pipeline"), gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
                  audio_cross_attn_mod=True)
    parts["transformer"] = tiny.random_model(diffusers.LTX2VideoTransformer3DModel, config, seed, 0)
    return _modular("EchoModularPipeline", parts)


def _prompt_upsampler(seed: int, tokenizer):
    """A two-layer Qwen3.5 (one linear-attention layer, one full) that rewrites the prompt greedily."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from paradiff_testkit import pipelines as tiny

    ids = tokenizer.convert_tokens_to_ids
    with tiny._seeded(seed, 6):
        return Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                             layer_types=["linear_attention", "full_attention"], max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                              "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                              "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16,
                               patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64),
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))).eval()


def _flux3(class_name: str, seed: int, flow_map: bool = False):
    """FLUX.3: the prompt rewritten by the upsampler, then encoded by a Qwen3-VL (layers 2 and 4 of 32 stacked: 64
    text channels) read through a Qwen3VLProcessor; the FLUX.2 VAE (4 channels, factor 2) and 2 x 2 patches."""
    import diffusers

    from paradiff.plans.flux3 import _TINY
    from paradiff_testkit import pipelines as tiny
    from paradiff_testkit.zoo.recipes.qwen3vl import qwen3vl_encoder, qwen3vl_processor

    tokenizer = tiny._qwen2_tokenizer()
    config = dict(_TINY, joint_attention_dim=64, cond_in_channels=16, flow_map=flow_map)
    return _modular(class_name, dict(
        transformer=tiny.random_model(diffusers.Flux3Transformer2DModel, config, seed, 0),
        vae=tiny.family_components("flux2", seed)["vae"], text_encoder=qwen3vl_encoder(seed, tokenizer),
        tokenizer=qwen3vl_processor(tokenizer), prompt_upsampler=_prompt_upsampler(seed, tokenizer),
        prompt_upsampler_processor=qwen3vl_processor(tokenizer)))


def flux3(seed: int):
    return _flux3("Flux3ModularPipeline", seed)


def flux3_distilled(seed: int):
    return _flux3("Flux3DistilledModularPipeline", seed, flow_map=True)  # a flow-map transformer


def minimax_music3(seed: int):
    """MiniMax Music 3: a one-layer Qwen3 language model (its vocabulary reaches the checkpoint's fixed audio-code ids,
    151675 + 16384) samples one semantic code a frame, a depth decoder one residual code (2 codebooks); their hidden
    states condition the flow-matching transformer through the condition encoder. Rates: 25 frames/s, 4 latents a
    frame, 4 samples a latent (400 Hz audio)."""
    import diffusers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from paradiff.plans.minimax_music3 import EXAMPLES
    from paradiff_testkit import pipelines as tiny

    markers = ["<|caption_start|>", "<|caption_end|>", "<|lyrics_start|>", "<|lyrics_end|>", "<|audio_start|>"]
    tokenizer = tiny._qwen2_tokenizer()
    tokenizer.add_tokens(markers, special_tokens=True)
    hidden = 16
    with tiny._seeded(seed, 1):
        language_model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=151675 + 16384 + 5, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024)).eval()
    depth = tiny.random_model(diffusers.MiniMaxMusic3RVQDepthDecoder, dict(
        hidden_size=hidden, num_layers=1, num_attention_heads=2, intermediate_size=32, audio_vocab_size=16,
        num_codebooks=2, max_position_embeddings=4), seed, 2)
    _, config = EXAMPLES["minimax-music-3"]
    condition = tiny.random_model(diffusers.MiniMaxMusic3ConditionEncoder, dict(
        condition_hidden_dim=hidden, num_condition_layers=2, out_dim=config["condition_dim"], input_sampling_rate=100,
        input_hop_length=4, output_sampling_rate=400, output_hop_length=4), seed, 4)
    vocoder = tiny.random_model(diffusers.MiniMaxMusic3Vocoder, dict(
        latent_channels=config["in_channels"], decoder_input_dim=16, decoder_hidden_dim=16,
        upsampling_ratios=(2, 2), sampling_rate=400), seed, 5)
    return _modular("MiniMaxMusic3ModularPipeline", dict(
        transformer=tiny.random_model(diffusers.MiniMaxMusic3Transformer1DModel, config, seed, 0),
        tokenizer=tokenizer, language_model=language_model, rvq_depth_decoder=depth, condition_encoder=condition,
        vocoder=vocoder, scheduler=diffusers.FlowMatchEulerDiscreteScheduler()))


def minimax_h3(seed: int):
    """MiniMax-H3 (text to video and audio, guidance-distilled): a 51-layer Qwen3-VL (the pipeline reads hidden state
    50), the transformer of the family example, a video VAE of factor 4 in space and 64 in time (192-frame chunks of 3
    latent frames, 1 dropped: 195 frames, the shortest 17 n + 5 analogue above the 5-second floor, are 5 latent
    frames) with a one-layer ViT decoder, and a stereo audio VAE of hop 4 (160 Hz: 40 latents a second)."""
    import diffusers

    from paradiff.plans.minimax_h3 import EXAMPLES
    from paradiff_testkit import pipelines as tiny
    from paradiff_testkit.zoo.recipes.qwen3vl import qwen3vl_encoder, qwen3vl_processor

    _, config = EXAMPLES["minimax-h3"]
    tokenizer = tiny._qwen2_tokenizer()
    vae = tiny.random_model(diffusers.AutoencoderKLMiniMaxH3, dict(
        latent_channels=config["in_channels"], block_out_channels=(8, 8, 8), layers_per_block=1,
        spatial_downsample_factors=(2, 2, 1), temporal_downsample_factors=(4, 4, 4), norm_num_groups=4,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, decoder_ffn_mult=2, clip_length=192, token_drop=1,
        latents_mean=(0.0,) * config["in_channels"], latents_std=(1.0,) * config["in_channels"]), seed, 3)
    audio_vae = tiny.random_model(diffusers.AutoencoderKLMiniMaxH3Audio, dict(
        encoder_dim=8, encoder_rates=(2, 2), latent_dim=16, latent_channels=config["audio_in_channels"],
        num_attention_heads=2, decoder_dim=16, decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3),), sampling_rate=160,
        latents_mean=[0.0] * config["audio_in_channels"], latents_std=[1.0] * config["audio_in_channels"]), seed, 4)
    transformer = tiny.random_model(diffusers.MiniMaxH3Transformer3DModel, config, seed, 0)
    return _modular("MiniMaxH3ModularPipeline", dict(
        transformer=transformer, vae=vae, audio_vae=audio_vae,
        text_encoder=qwen3vl_encoder(seed, tokenizer, layers=51, width=config["text_dim"]), tokenizer=tokenizer,
        processor=qwen3vl_processor(tokenizer), scheduler=diffusers.MiniMaxH3Scheduler(),
        audio_scheduler=diffusers.MiniMaxH3Scheduler()), optional=("transformer_ref",))


def _cosmos3(class_name: str, seed: int, scheduler, **config):
    """Cosmos 3: no text encoder (the transformer reads the prompt's token ids itself, the tokenizer's chat template
    around them); the transformer of the family example; a Wan VAE of factor 8 in space and 4 in time. The safety
    checker (NVIDIA's guardrail models, downloaded) is switched off in the pipeline's config."""
    import diffusers

    from paradiff.plans.cosmos3 import EXAMPLES
    from paradiff_testkit import pipelines as tiny
    from paradiff_testkit.zoo.processors import QWEN_VL_CHAT_TEMPLATE
    from paradiff_testkit.zoo.recipes.wan_video import temporal4_vae

    tokenizer = tiny._qwen2_tokenizer()
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    _, transformer = EXAMPLES["cosmos3-omni"]
    transformer = dict(transformer, vocab_size=len(tokenizer))
    pipe = _modular(class_name, dict(
        transformer=tiny.random_model(diffusers.Cosmos3OmniTransformer, transformer, seed, 0), text_tokenizer=tokenizer,
        vae=temporal4_vae(seed, {}, {}), scheduler=scheduler), optional=("sound_tokenizer",))
    pipe.register_to_config(enable_safety_checker=False, **config)
    return pipe


def cosmos3_omni(seed: int):
    import diffusers

    return _cosmos3("Cosmos3OmniModularPipeline", seed, diffusers.UniPCMultistepScheduler())


def cosmos3_distilled(seed: int):
    import diffusers

    # the distilled checkpoint's sampling grid is its config's: two steps here
    return _cosmos3("Cosmos3DistilledModularPipeline", seed, diffusers.FlowMatchEulerDiscreteScheduler(),
                    distilled_sigmas=[1.0, 0.5])


def _wan_animate2(class_name: str, seed: int):
    """Wan-Animate 2: the zoo's Wan text encoder, Wan-Animate's VAE (factor 8 in space, 4 in time), the transformer of
    the family example reading 16 text tokens (12 input channels: the latents, the mask and the reference image's
    latents), and a two-layer CLIP vision tower 1280 wide (the transformer's image
    projection takes 1280 features; the pipeline resizes every frame to 224 x 224: 7 x 7 patches of 32)."""
    import diffusers
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from paradiff.plans.wan_animate2 import EXAMPLES
    from paradiff_testkit import pipelines as tiny
    from paradiff_testkit.zoo.recipes.wan_video import temporal4_vae

    _, config = EXAMPLES["wan-animate2"]
    text = tiny.family_components("wan", seed)
    with tiny._seeded(seed, 8):
        image_encoder = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=1280, intermediate_size=64, num_hidden_layers=2, num_attention_heads=16, image_size=224,
            patch_size=32, projection_dim=32)).eval()
    return _modular(class_name, dict(
        transformer=tiny.random_model(diffusers.WanAnimate2Transformer3DModel, dict(config, text_len=16, in_dim=12),
                                      seed, 0),
        text_encoder=text["text_encoder"], tokenizer=text["tokenizer"], image_encoder=image_encoder,
        vae=temporal4_vae(seed, {}, {}), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)))


def wan_animate2(seed: int):
    return _wan_animate2("WanAnimate2ModularPipeline", seed)


def wan_animate2_distilled(seed: int):
    return _wan_animate2("WanAnimate2DistilledModularPipeline", seed)


def ltx25(seed: int):
    """LTX-2.5: the zoo's LTX-2 components; an LTX-2.3-style transformer (gated attention, cross-attention modulation,
    perturbed attention for its spatio-temporal guidance); the LTX-2.5 diffusion decoder at the tiny VAE's factors
    (2 in space and time: one spatial and one temporal upsampling, patch 1)."""
    import diffusers
    from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoDiffusionDecoderModel

    from paradiff_testkit import pipelines as tiny
    from paradiff_testkit import zoo

    parts = _standard_parts("LTX2Pipeline", seed)
    config = dict(zoo.transformer_config("LTX2Pipeline"), gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
                  audio_cross_attn_mod=True, perturbed_attn=True)
    parts["transformer"] = tiny.random_model(diffusers.LTX2VideoTransformer3DModel, config, seed, 0)
    parts["diffusion_decoder"] = tiny.random_model(LTX2VideoDiffusionDecoderModel, dict(
        latent_channels=4, patch_size=1, decoder_head_dim=8, decoder_stage_channels=(16, 8, 8, 8, 8),
        decoder_stage_depths=(1, 1, 1, 1, 1), decoder_stage_kernels=((3, 3, 3),) * 4,
        decoder_upsample_strides=((1, 2, 2), (2, 1, 1), (1, 1, 1), (1, 1, 1)),
        decoder_upsample_channel_reductions=(2, 1, 1, 1), decoder_stage5_kernel=(3, 3, 3), decoder_t_emb_dim=16,
        spatial_compression_ratio=2, temporal_compression_ratio=2), seed, 6)
    return _modular("LTX25ModularPipeline", parts, optional=("prompt_enhancer", "processor", "duration_head"))


RECIPES = {
    # 96 x 160 pixels: 6 x 10 = 60 image tokens after the prompt's (sizes are multiples of 32)
    "QwenImage21TurboModularPipeline": ModularRecipe(build=qwenimage21_turbo, call=dict(
        prompt=PROMPT, height=96, width=160, num_inference_steps=2, use_kv_cache=False, output_type="np")),
    # two chunks of 2 latent frames, the second with the first as history; stages of 1 x 1, 2 x 2 and 4 x 4 tokens
    "HeliosPyramidDistilledModularPipeline": ModularRecipe(
        build=helios_pyramid_distilled, output="videos", guider=DISTILLED_GUIDANCE, note=DISTILLED_NOTE, call=dict(
        prompt=PROMPT, height=64, width=64, num_frames=9, history_sizes=[4, 2, 1], num_latent_frames_per_chunk=2,
        pyramid_num_inference_steps_list=[1, 1, 1], max_sequence_length=32, output_type="np")),
    # CFG through its guider (guidance 4); 36 x 44 pixels are 18 x 22 latents, 9 x 11 = 99 tokens of 2 x 2 patches
    "AnimaModularPipeline": ModularRecipe(build=anima, call=dict(
        prompt=PROMPT, negative_prompt="blurry, low quality", height=36, width=44, num_inference_steps=2,
        max_sequence_length=16, output_type="np")),
    # DMD: the sigmas are the call's; 32 x 32 pixels, 5 frames
    "EchoModularPipeline": ModularRecipe(build=echo, output="videos", call=dict(
        prompt=PROMPT, height=32, width=32, num_frames=5, frame_rate=25.0, sigmas=(1.0, 0.6, 0.0),
        max_sequence_length=16, output_type="np")),
    # guided by its two LTX2Guidance guiders (CFG, spatio-temporal and modality branches); num_frames given, so no
    # duration head
    "LTX25ModularPipeline": ModularRecipe(build=ltx25, output="videos", call=dict(
        prompt=PROMPT, negative_prompt="blurry, low quality", height=32, width=32, num_frames=5, frame_rate=25.0,
        num_inference_steps=2, max_sequence_length=16, output_type="np")),
    # the upsampler writes at most 4 tokens; 44 x 36 pixels are 11 x 9 = 99 tokens of 4 x 4 pixels
    "Flux3ModularPipeline": ModularRecipe(build=flux3, call=dict(FLUX3_CALL, negative_prompt="blurry, low quality")),
    "Flux3DistilledModularPipeline": ModularRecipe(build=flux3_distilled, call=FLUX3_CALL),
    # 0.2 s: at most 5 frames of codes, 20 latents
    "MiniMaxMusic3ModularPipeline": ModularRecipe(build=minimax_music3, output="audios", call=dict(
        prompt="calm piano", lyrics="[verse]\nla la la", audio_duration=0.2, num_inference_steps=2,
        output_type="np")),
    # 32 x 40 pixels: 4 x 5 tokens a latent frame, 5 latent frames; 8.1 s of stereo audio, 650 audio rows; 3 sigmas
    # are 2 transformer calls
    "MiniMaxH3ModularPipeline": ModularRecipe(build=minimax_h3, output="videos", call=dict(
        prompt=PROMPT, height=32, width=40, num_frames=195, num_inference_steps=3, output_type="np")),
    # 48 x 64 pixels, 5 frames: 2 latent frames of 3 x 4 tokens after the prompt's (no system prompt: its long text)
    "Cosmos3OmniModularPipeline": ModularRecipe(build=cosmos3_omni, output="videos", call=dict(
        COSMOS3_CALL, negative_prompt="blurry, low quality", num_inference_steps=2, guidance_scale=4.0)),
    "Cosmos3DistilledModularPipeline": ModularRecipe(build=cosmos3_distilled, output="videos", call=COSMOS3_CALL),
    # a reference image and a 9-frame driving video, in segments of 5 frames (one conditioning frame each): 2 segments
    # of 2 latent frames (and the reference's slot) of 3 x 4 tokens
    "WanAnimate2ModularPipeline": ModularRecipe(build=wan_animate2, output="videos", call=dict(
        WAN_ANIMATE2_CALL, negative_prompt="blurry, low quality")),
    # the distilled checkpoints' guiders are off (guidance 1); on here, so that the cfg modes split two branches
    "WanAnimate2DistilledModularPipeline": ModularRecipe(build=wan_animate2_distilled, output="videos",
                                                         call=WAN_ANIMATE2_CALL, guider=DISTILLED_GUIDANCE,
                                                         note=DISTILLED_NOTE),
}
