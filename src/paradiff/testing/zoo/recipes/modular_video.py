"""Modular Diffusers video pipelines built from the zoo's standard video recipes (`ModularRecipe(standard=...)`).

Which standard recipe each class loads: Wan 2.2 T2V, I2V and VACE are the A14B layout, two experts split at the
folder's `boundary_ratio`, a guider each (`guider`, `guider_2`); diffusers maps a Wan folder with a boundary ratio to
the Wan 2.2 classes. VACE, LTX-2 and HunyuanVideo 1.5 folders map to no modular class in diffusers: the zoo builds the
key's class from its default blocks. A guided modular pipeline's guidance scale is its guider's, not an argument of
the call: the standard call's scales are dropped. Wan 2.1 FLF2V's modular blocks crop the last image with
torchvision, which this environment lacks: no recipe for it."""

from paradiff.testing.zoo import ModularRecipe

GUIDER_SCALES = ("guidance_scale",)
VIDEOS = dict(drop=GUIDER_SCALES, output="videos")

RECIPES = {
    "Wan22ModularPipeline": ModularRecipe(standard="WanPipeline@wan2.2-a14b", **VIDEOS),
    "Wan22Image2VideoModularPipeline": ModularRecipe(standard="WanImageToVideoPipeline@wan2.2-a14b", **VIDEOS),
    "Wan22VaceModularPipeline": ModularRecipe(standard="WanVACEPipeline@wan2.2-a14b", **VIDEOS),
}
