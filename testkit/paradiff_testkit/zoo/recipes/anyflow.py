"""AnyFlow and AnyFlow FAR: Wan's text encoder and VAE around AnyFlow's flow-map transformers (two timesteps per
frame), FlowMapEulerDiscreteScheduler; CFG as one call on the [uncond, cond] batch.

AnyFlow: 48 x 48 pixels through the factor-8 Wan VAE are 3 x 3 tokens a latent frame, 5 frames 3 latent frames (27
tokens). FAR compresses context frames with 4 x 4 patches, so its latents' sides are multiples of 4: 64 x 64 pixels,
16 tokens a full frame, 4 a compressed one; three one-frame chunks, the first compressed once two are full."""

from paradiff_testkit import pipelines as tiny
from paradiff_testkit.zoo import Recipe, TinyFamily
from paradiff_testkit.zoo.recipes.wan_video import LATENT, SIZE, VIDEO, factor8_vae


def anyflow_components(seed: int) -> dict:
    import diffusers

    parts = tiny.family_components("wan", seed)
    parts.update(vae=factor8_vae(seed, {}, {}),
                 scheduler=diffusers.FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0))
    return parts


_WAN = tiny.transformer_config("wan")
ANYFLOW = dict(patch_size=(1, 2, 2), num_attention_heads=_WAN["num_attention_heads"],
               attention_head_dim=_WAN["attention_head_dim"], in_channels=LATENT, out_channels=LATENT,
               text_dim=_WAN["text_dim"], freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
               deltatime_type="t-r")
GUIDED = dict(tiny.default_call_kwargs("wan"), guidance_scale=5.0)

FAMILIES = {
    "anyflow": TinyFamily(transformer_class="AnyFlowTransformer3DModel", transformer=ANYFLOW,
                          components=anyflow_components, call=GUIDED),
    "anyflow_far": TinyFamily(transformer_class="AnyFlowFARTransformer3DModel",
                              transformer=dict(ANYFLOW, compressed_patch_size=(1, 4, 4), full_chunk_limit=2,
                                               chunk_partition=(1, 1, 1)),
                              components=anyflow_components, call=GUIDED),
}

RECIPES = {
    "AnyFlowPipeline": Recipe(family="anyflow", call=SIZE),
    # the first latent frames given (a video's), timestep 0 there
    "AnyFlowPipeline@video": Recipe(extends="AnyFlowPipeline", call=dict(video=VIDEO[:3], num_frames=5)),
    # chunk by chunk: each chunk's steps attend to the KV cache of the chunks before it (written once per chunk by a
    # cache-encoding call); diffusers 0.42.1's use_kv_cache=False path fails single-process (its transformer returns
    # one value where the pipeline unpacks two), so the default is the only one to verify
    "AnyFlowFARPipeline": Recipe(family="anyflow_far", call=dict(height=64, width=64, num_frames=5)),
}
