"""Wan 2.1 / 2.2 conditioned pipelines and the pipelines built on Wan's transformer: image-to-video (CLIP image
tokens, first / last frame), video-to-video, VACE, Lucy Edit, ChronoEdit.

Sizes: the pipelines take multiples of 16 pixels; a Wan VAE of spatial factor 8 and 2 x 2 patches make 16 pixels
one token, so 48 x 48 pixels are 3 x 3 tokens a latent frame and 5 frames (temporal factor 2) 3 latent frames: 27
tokens, a count two and four ranks do not divide. Wan 2.1 I2V's attention takes everything before the last 512
context tokens as the image's (`transformer_wan.py`): its calls encode the prompt to 512 tokens."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Mask, Picture, Recipe

LATENT = 4  # the tiny Wan VAE's z_dim
SIZE = dict(height=48, width=48, num_frames=5)
SIZE_2D = dict(height=48, width=48)
IMAGE = Picture(48, 48)
VIDEO = [Picture(48, 48, seed=20 + frame) for frame in range(5)]
# the mask channels Wan 2.1 I2V puts before the image's latents: one per frame the VAE folds into a latent frame
I2V_IN = LATENT + 2 + LATENT


def factor8_vae(seed: int, parts: dict, config: dict):
    """Wan 2.1's VAE, three spatial downsamplings (one also temporal): 16 pixels are one 2 x 2 patch."""
    import diffusers

    with tiny._seeded(seed, 3):
        return diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=LATENT, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False, True, False], latents_mean=tiny._latent_stats(seed, 0.0),
            latents_std=tiny._latent_stats(seed, 1.0), scale_factor_temporal=2, scale_factor_spatial=8)


def temporal4_vae(seed: int, parts: dict, config: dict):
    """Wan-Animate's VAE: as `factor8_vae`, two of the downsamplings also temporal (factor 4, 5 frames are 2 latent
    frames): its transformer takes exactly 4 mask channels, one per frame folded into a latent frame."""
    import diffusers

    with tiny._seeded(seed, 3):
        return diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=LATENT, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
            temperal_downsample=[False, True, True], latents_mean=tiny._latent_stats(seed, 0.0),
            latents_std=tiny._latent_stats(seed, 1.0), scale_factor_temporal=4, scale_factor_spatial=8)


def clip_vision(seed: int, parts: dict, config: dict):
    """A CLIP vision tower (16 pixels, 4 x 4 patches: 17 tokens of 24; 6 heads)."""
    from paradiff_testkit.encoders import build_encoder

    with tiny._seeded(seed, 8):
        return build_encoder("CLIPVisionModel", seed)


def clip_vision_projection(seed: int, parts: dict, config: dict):
    from paradiff_testkit.encoders import build_encoder

    with tiny._seeded(seed, 8):
        return build_encoder("CLIPVisionModelWithProjection", seed)


def clip_image_processor(seed: int, parts: dict, config: dict):
    from transformers import CLIPImageProcessor

    from paradiff_testkit.encoders import IMAGE_SIZE

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def vace_transformer(seed: int, parts: dict, config: dict):
    """Wan's transformer with VACE blocks after blocks 0 and 1 of 2; the control video's latents (inactive and
    reactive halves) and the 8 x 8 mask channels per latent pixel go into them."""
    import diffusers

    vace = dict(config, vace_layers=[0, 1], vace_in_channels=2 * LATENT + 8 * 8)
    return tiny.random_model(diffusers.WanVACETransformer3DModel, vace, seed, 0)


def vace_transformer_2(seed: int, parts: dict, config: dict):
    """Wan 2.2 VACE (A14B): the low-noise expert, a second VACE transformer of the same config (other weights)."""
    import diffusers

    vace = dict(config, vace_layers=[0, 1], vace_in_channels=2 * LATENT + 8 * 8)
    return tiny.random_model(diffusers.WanVACETransformer3DModel, vace, seed, 4)


def chronoedit_transformer(seed: int, parts: dict, config: dict):
    import diffusers

    return tiny.random_model(diffusers.ChronoEditTransformer3DModel, config, seed, 0)


def animate_transformer(seed: int, parts: dict, config: dict):
    """Wan-Animate: Wan 2.1 I2V blocks on the noise, the reference frame's latents and mask (10 channels), pose
    latents added to the patch embedding, a motion encoder of 16-pixel faces and a face adapter after each block."""
    import diffusers

    animate = dict(config, in_channels=2 * LATENT + 4, latent_channels=LATENT, image_dim=24, added_kv_proj_dim=64,
                   motion_encoder_size=16, motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8},
                   motion_style_dim=16, motion_dim=8, motion_encoder_dim=16, face_encoder_hidden_dim=16,
                   face_encoder_num_heads=2, inject_face_latents_blocks=1, motion_encoder_batch_size=4)
    return tiny.random_model(diffusers.WanAnimateTransformer3DModel, animate, seed, 0)


WAN21 = dict(vae=factor8_vae)
# the CLIP image tokens: their own K/V projections in every cross-attention
IMAGE_TOKENS = dict(in_channels=I2V_IN, image_dim=24, added_kv_proj_dim=64)
WAN21_I2V = dict(WAN21, image_encoder=clip_vision, image_processor=clip_image_processor)
GUIDED = dict(negative_prompt="blurry, low quality", guidance_scale=5.0)
VACE_CALL = dict(SIZE, video=VIDEO, mask=[Mask(48, 48)] * 5, reference_images=[Picture(48, 48, seed=9)],
                 conditioning_scale=0.8)

RECIPES = {
    # Wan 2.1 I2V: the image's latents and a first-frame mask beside the noise (10 channels), the image's CLIP
    # tokens before the 512 text tokens
    "WanImageToVideoPipeline": Recipe(family="wan", components=WAN21_I2V, transformer=IMAGE_TOKENS,
                                      call=dict(SIZE, image=IMAGE, max_sequence_length=512)),
    # first and last frame (FLF2V): both images' CLIP tokens side by side (2 x 17, with position embeddings), the
    # mask open in the middle frames only
    "WanImageToVideoPipeline@flf2v": Recipe(extends="WanImageToVideoPipeline", transformer=dict(pos_embed_seq_len=34),
                                            call=dict(last_image=Picture(48, 48, seed=9))),
    # Wan 2.2 TI2V: the image is the first latent frame (per-token timesteps 0 there), no image encoder
    "WanImageToVideoPipeline@wan2.2": Recipe(family="wan2.2", call=dict(SIZE, image=IMAGE)),
    # Wan 2.2 I2V (A14B): Wan 2.1 I2V's latent condition (mask and image latents beside the noise) on the two experts,
    # no image encoder
    "WanImageToVideoPipeline@wan2.2-a14b": Recipe(family="wan2.2-a14b", components=WAN21,
                                                  transformer=dict(in_channels=I2V_IN),
                                                  call=dict(SIZE, image=IMAGE, num_inference_steps=3)),
    "WanVideoToVideoPipeline": Recipe(family="wan", components=WAN21,
                                      drop=("num_frames",), call=dict(SIZE_2D, video=VIDEO, strength=0.6,
                                                                      num_inference_steps=4)),
    # VACE: a reference image (one more latent frame before the video's: 36 tokens) and a control video with a mask
    "WanVACEPipeline": Recipe(family="wan", components=dict(WAN21, transformer=vace_transformer), call=VACE_CALL),
    # Wan 2.2 VACE (A14B): VACE on both experts
    "WanVACEPipeline@wan2.2-a14b": Recipe(
        family="wan2.2-a14b", components=dict(WAN21, transformer=vace_transformer, transformer_2=vace_transformer_2),
        call=dict(VACE_CALL, num_inference_steps=3)),
    # Lucy Edit: the source video's latents beside the noise (8 channels)
    "LucyEditPipeline": Recipe(family="wan", components=WAN21, transformer=dict(in_channels=2 * LATENT),
                               call=dict(SIZE, video=VIDEO)),
    # ChronoEdit: Wan 2.1 I2V's transformer, the input image and the edit as two temporal positions
    "ChronoEditPipeline": Recipe(family="wan", components=dict(WAN21_I2V, transformer=chronoedit_transformer),
                                 transformer=IMAGE_TOKENS,
                                 call=dict(SIZE, image=IMAGE, max_sequence_length=512)),
    # temporal reasoning: 9 frames (5 latent frames, 45 tokens) for the first step, then only the first and last
    # latent frames (18 tokens): the sequence shrinks mid-call
    "ChronoEditPipeline@temporal-reasoning": Recipe(extends="ChronoEditPipeline", call=dict(
        num_frames=9, enable_temporal_reasoning=True, num_temporal_reasoning_steps=1, num_inference_steps=3)),
    # Wan-Animate: 9 pose / face frames in two segments of 5 frames (2 latent frames and the reference image's: 27
    # tokens), the second continuing from the first's last frame; CFG blanks the face for the unconditional call
    "WanAnimatePipeline": Recipe(
        family="wan", components=dict(WAN21_I2V, vae=temporal4_vae, transformer=animate_transformer),
        drop=("num_frames",),
        call=dict(SIZE_2D, image=IMAGE, pose_video=[Picture(48, 48, seed=30 + f) for f in range(9)],
                  face_video=[Picture(16, 16, seed=40 + f) for f in range(9)], segment_frame_length=5,
                  prev_segment_conditioning_frames=1, max_sequence_length=512)),
    # character replacement: a background video and the character's mask
    "WanAnimatePipeline@replace": Recipe(extends="WanAnimatePipeline", call=dict(
        mode="replace", background_video=[Picture(48, 48, seed=50 + f) for f in range(9)],
        mask_video=[Mask(48, 48)] * 9)),
}
