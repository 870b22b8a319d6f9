"""Image- and video-conditioned variants of the tiny HunyuanVideo, LTX-Video and CogVideoX pipelines (their
text-to-video recipes are in others.py): the conditioning latents reach the transformer concatenated to the noise
latents along the channels (SkyReels, CogVideoX I2V / Fun Control), as clean first-frame tokens with their own
per-token timestep (LTX I2V, LTX Condition), or as the start of the noised latents (CogVideoX video-to-video)."""

from paradiff_testkit.zoo import Picture, Recipe


def fixed_shift_scheduler(seed: int, parts: dict, config: dict):
    # LTX Condition sets its own sigmas and passes no `mu`: a scheduler without dynamic shifting
    import diffusers

    return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)

LATENT_CHANNELS = 4
# the tiny LTX VAE: 4 in space, 2 in time; LTX pipelines take multiples of 32 pixels
LTX_IMAGE = Picture(32, 32)
# the tiny CogVideoX VAE: 8 in space, 4 in time
COGVIDEOX_VIDEO = [Picture(32, 32, seed=20 + i) for i in range(9)]

def rf_ancestral_scheduler(seed: int, parts: dict, config: dict):
    # the long multi-prompt pipeline's own sampler (it warns with any other)
    import diffusers

    return diffusers.LTXEulerAncestralRFScheduler()


RECIPES = {
    # SkyReels V1 I2V: the HunyuanVideo transformer reads the image's latents beside the noise (twice the channels),
    # true CFG against the negative prompt (two calls)
    "HunyuanSkyreelsImageToVideoPipeline": Recipe(
        extends="HunyuanVideoPipeline", transformer=dict(in_channels=2 * LATENT_CHANNELS),
        call=dict(image=Picture(32, 32), guidance_scale=1.0)),
    # the first latent frame is the image's, clean (timestep 0 on its tokens), the rest noise
    "LTXImageToVideoPipeline": Recipe(extends="LTXPipeline", call=dict(image=LTX_IMAGE)),
    # a conditioning image at frame 0: its latents replace the first frame's, with their own timestep and coordinates
    "LTXConditionPipeline": Recipe(extends="LTXPipeline", components=dict(scheduler=fixed_shift_scheduler),
                                   call=dict(image=LTX_IMAGE, frame_rate=25)),
    # sliding temporal windows (one here: the tile is longer than the video), a conditioning image at the head,
    # batch CFG per window; the decode tiled 1 x 1
    "LTXI2VLongMultiPromptPipeline": Recipe(
        extends="LTXPipeline", components=dict(scheduler=rf_ancestral_scheduler),
        call=dict(cond_image=LTX_IMAGE, num_frames=9, temporal_tile_size=16, temporal_overlap=8, frame_rate=25,
                  decode_horizontal_tiles=1, decode_vertical_tiles=1)),
    "CogVideoXImageToVideoPipeline": Recipe(
        extends="CogVideoXPipeline", transformer=dict(in_channels=2 * LATENT_CHANNELS),
        call=dict(image=Picture(32, 32))),
    # CogVideoX-5b I2V's layout: a 3-D rotary table over the video tokens (split with them) and learnt positions
    "CogVideoXImageToVideoPipeline@5b": Recipe(
        extends="CogVideoXImageToVideoPipeline",
        transformer=dict(use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True)),
    # CogVideoX 1.5 I2V: 2-frame temporal patches (3 latent frames padded to 4), the ofs embedding, rotary
    "CogVideoXImageToVideoPipeline@1.5": Recipe(
        extends="CogVideoXImageToVideoPipeline",
        transformer=dict(use_rotary_positional_embeddings=True, patch_size_t=2, ofs_embed_dim=8, patch_bias=False)),
    "CogVideoXVideoToVideoPipeline": Recipe(
        extends="CogVideoXPipeline", drop=("num_frames",), call=dict(video=COGVIDEOX_VIDEO, strength=0.6,
                                                                     num_inference_steps=4)),
    "CogVideoXFunControlPipeline": Recipe(
        extends="CogVideoXPipeline", transformer=dict(in_channels=2 * LATENT_CHANNELS), drop=("num_frames",),
        call=dict(control_video=COGVIDEOX_VIDEO)),
}
