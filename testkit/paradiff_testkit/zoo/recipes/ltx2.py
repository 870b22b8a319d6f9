"""LTX-2 pipelines: video and audio denoised together by one transformer (LTX2VideoTransformer3DModel), a Gemma 3
text encoder whose stacked hidden states go through the text connectors, the LTX-2 video VAE, the audio VAE and
the vocoder (sizes after diffusers' own LTX-2 test). Their guidance runs up to four branches a step (CFG, spatio-
temporal guidance, modality isolation), which CFG parallelism does not split (plans/pipelines.py, cfg_not_split):
the recipes guide with CFG alone (STG and modality guidance off), the cfg modes record the refusal."""

from dataclasses import dataclass

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Picture, Recipe, TinyFamily

TEXT_WIDTH = 32
TEXT_LAYERS = 2
SIZE = dict(height=32, width=32, num_frames=5, frame_rate=25.0)


@dataclass(frozen=True)
class FrameCondition(Picture):
    """An LTX2VideoCondition: one seeded picture at frame `index` (no H.264 re-compression)."""

    index: int = 0

    def make(self):
        from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

        return LTX2VideoCondition(frames=Picture(self.height, self.width, self.seed).make(), index=self.index,
                                  strength=1.0, crf=0)


@dataclass(frozen=True)
class ReferenceVideo(Picture):
    """A reference video of `frames` seeded pictures for the in-context (IC-LoRA) or HDR pipeline's
    `reference_conditions`."""

    frames: int = 5
    hdr: bool = False

    def make(self):
        from diffusers.pipelines.ltx2.pipeline_ltx2_hdr_lora import LTX2HDRReferenceCondition
        from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition

        frames = [Picture(self.height, self.width, self.seed + i).make() for i in range(self.frames)]
        return (LTX2HDRReferenceCondition if self.hdr else LTX2ReferenceCondition)(frames=frames, strength=1.0)


def temporal_upsampler(seed: int, parts: dict, config: dict):
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    with tiny._seeded(seed, 6):  # its GroupNorms take 32 groups
        return LTX2LatentUpsamplerModel(in_channels=4, mid_channels=32, num_blocks_per_stage=1, dims=3,
                                        spatial_upsample=False, temporal_upsample=True).eval()


def rf_ancestral_scheduler(seed: int, parts: dict, config: dict):
    import diffusers

    return diffusers.LTXEulerAncestralRFScheduler(eta=0.5)


def _seeded(shape: tuple[int, ...], seed: int):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def components(seed: int) -> dict:
    import diffusers
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = tiny._gemma_tokenizer()
    vocab = len(tokenizer)
    with tiny._seeded(seed, 1):
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=dict(vocab_size=vocab + 3, hidden_size=TEXT_WIDTH, intermediate_size=64,
                             num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             max_position_embeddings=2048, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
                             bos_token_id=2),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=8, patch_size=4),
            mm_tokens_per_image=4, image_token_index=vocab + 2, boi_token_index=vocab + 1,
            eoi_token_index=vocab)).eval()
    with tiny._seeded(seed, 2):
        connectors = LTX2TextConnectors(
            caption_channels=TEXT_WIDTH, text_proj_in_factor=TEXT_LAYERS + 1, video_connector_num_attention_heads=4,
            video_connector_attention_head_dim=8, video_connector_num_layers=1,
            video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
            audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
            rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    with tiny._seeded(seed, 3):
        vae = diffusers.AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
            layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
            downsample_type=("spatial",), upsample_residual=(False,), upsample_factor=(1,),
            timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    with tiny._seeded(seed, 4):
        audio_vae = diffusers.AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
            resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    with tiny._seeded(seed, 5):
        vocoder = LTX2Vocoder(
            in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, vae=vae, audio_vae=audio_vae,
                vocoder=vocoder, scheduler=diffusers.FlowMatchEulerDiscreteScheduler())


CFG_ONLY = dict(guidance_scale=3.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=3.0,
                audio_stg_scale=0.0, audio_modality_scale=1.0, audio_guidance_rescale=0.0,
                spatio_temporal_guidance_blocks=None, use_cross_timestep=False)

# the STG / modality / rescale knobs the HDR and DFR pipelines do not take
NO_CFG_SCALES = ("stg_scale", "modality_scale", "guidance_rescale", "audio_guidance_scale", "audio_stg_scale",
                 "audio_modality_scale", "audio_guidance_rescale")

FAMILIES = {
    "ltx2": TinyFamily(
        transformer_class="LTX2VideoTransformer3DModel",
        transformer=dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=4,
                         attention_head_dim=8, cross_attention_dim=32, audio_in_channels=4, audio_out_channels=4,
                         audio_num_attention_heads=4, audio_attention_head_dim=4, audio_cross_attention_dim=16,
                         num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=TEXT_WIDTH,
                         rope_double_precision=False, rope_type="split"),
        components=components,
        call=dict(prompt="a small red fox running through the snow", negative_prompt="blurry, low quality",
                  num_inference_steps=2, max_sequence_length=16, output_type="np", **CFG_ONLY, **SIZE)),
}

RECIPES = {
    "LTX2Pipeline": Recipe(family="ltx2"),
    "LTX2ImageToVideoPipeline": Recipe(extends="LTX2Pipeline", call=dict(image=Picture(32, 32), image_crf=0)),
    "LTX2ConditionPipeline": Recipe(extends="LTX2Pipeline", call=dict(conditions=[FrameCondition(32, 32)])),
    # a reference video's tokens join the noise tokens (in-context LoRA), and a first-frame condition
    "LTX2InContextPipeline": Recipe(extends="LTX2Pipeline", call=dict(
        reference_conditions=[ReferenceVideo(32, 32, seed=40)], conditions=[FrameCondition(32, 32)])),
    "LTX2HDRPipeline": Recipe(extends="LTX2Pipeline", drop=NO_CFG_SCALES, call=dict(
        reference_conditions=[ReferenceVideo(32, 32, seed=40, hdr=True)])),
    # one temporal refine round on a prior DFR pass's output (seeded stand-ins of its shapes: the 32 x 32 canvas of
    # 4 latent frames, one carried keyframe at pixel frame 6, the frozen audio latents)
    "LTX2DFRTemporalRefinePipeline": Recipe(
        extends="LTX2DFRPipeline", components=dict(temporal_latent_upsampler=temporal_upsampler,
                                                   scheduler=rf_ancestral_scheduler),
        drop=("num_frames", "frame_rate"),
        call=dict(latents=_seeded((1, 4, 4, 16, 16), 50), keyframes_latents=_seeded((1, 4, 1, 16, 16), 51),
                  keyframe_positions=[6], audio_latents=_seeded((1, 2, 7, 2), 52), num_frames=7, frame_rate=25.0)),
    # distilled: its own sigma schedule, no negative branch (never guides); keyframe slots need the learnt marker
    "LTX2DFRPipeline": Recipe(extends="LTX2Pipeline", transformer=dict(use_keyframes_abs_pos_embedding=True),
                              drop=("negative_prompt", "num_inference_steps") + tuple(CFG_ONLY),
                              call=dict(use_cross_timestep=False)),
}
