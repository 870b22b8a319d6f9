"""Modular Diffusers video pipelines built from the zoo's standard video recipes (`ModularRecipe(standard=...)`).

Which standard recipe each class loads: Wan 2.2 T2V, I2V and VACE are the A14B layout, two experts split at the
folder's `boundary_ratio`, a guider each (`guider`, `guider_2`); diffusers maps a Wan folder with a boundary ratio to
the Wan 2.2 classes. VACE, LTX-2 and HunyuanVideo 1.5 folders map to no modular class in diffusers: the zoo builds the
key's class from its default blocks. A guided modular pipeline's guidance scale is its guider's, not an argument of
the call: the standard call's scales are dropped. Wan 2.1 FLF2V's modular blocks crop the last image with
torchvision, which this environment lacks: no recipe for it."""

from paradiff_testkit.zoo import ModularRecipe
from paradiff_testkit.zoo.recipes.ltx2 import CFG_ONLY

GUIDER_SCALES = ("guidance_scale",)
VIDEOS = dict(drop=GUIDER_SCALES, output="videos")
# LTX-2's guiders (LTX2Guidance, video and audio) run CFG, spatio-temporal guidance and modality isolation: the
# standard call's knobs for them are the guiders' config here; STG perturbs block 1 of the tiny 2 (default: 28)
LTX2_GUIDED = dict(drop=tuple(key for key in CFG_ONLY if key != "use_cross_timestep"), output="videos",
                   guider=dict(spatio_temporal_guidance_blocks=[1]))

RECIPES = {
    "Wan22ModularPipeline": ModularRecipe(standard="WanPipeline@wan2.2-a14b", **VIDEOS),
    "WanImage2VideoModularPipeline": ModularRecipe(standard="WanImageToVideoPipeline", **VIDEOS),
    "Wan22Image2VideoModularPipeline": ModularRecipe(standard="WanImageToVideoPipeline@wan2.2-a14b", **VIDEOS),
    "Wan22VaceModularPipeline": ModularRecipe(standard="WanVACEPipeline@wan2.2-a14b", **VIDEOS),
    "LTXModularPipeline": ModularRecipe(standard="LTXPipeline", **VIDEOS),
    # image-to-video through the same class (its auto blocks switch on `image`): the clean first frame's tokens
    "LTXModularPipeline@image": ModularRecipe(standard="LTXImageToVideoPipeline", **VIDEOS),
    "LTX2ModularPipeline": ModularRecipe(standard="LTX2Pipeline", **LTX2_GUIDED),
    "LTX2ModularPipeline@image": ModularRecipe(standard="LTX2ImageToVideoPipeline", **LTX2_GUIDED),
    "HunyuanVideo15ModularPipeline": ModularRecipe(standard="HunyuanVideo15Pipeline", **VIDEOS),
    # image-to-video: the SigLIP image tokens and the image's latents
    "HunyuanVideo15ModularPipeline@image": ModularRecipe(standard="HunyuanVideo15ImageToVideoPipeline", **VIDEOS),
    "HeliosModularPipeline": ModularRecipe(standard="HeliosPipeline", **VIDEOS),
    # the image's latents as history; a video's latents as history
    "HeliosModularPipeline@image": ModularRecipe(standard="HeliosPipeline@image", **VIDEOS),
    "HeliosModularPipeline@video": ModularRecipe(standard="HeliosPipeline@video", **VIDEOS),
    "HeliosPyramidModularPipeline": ModularRecipe(standard="HeliosPyramidPipeline", **VIDEOS),
}
