"""T5Gemma encoders: Stable Audio 3's `T5GemmaEncoderModel`, whose layers are Gemma 2 decoder layers run
bidirectionally. (PRX's `T5GemmaEncoder` is not listed: its checkpoint keeps the composite encoder-decoder config,
which diffusers' wrapper unpacks in its own `from_pretrained`; it stays whole, loaded by diffusers.)"""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {"T5GemmaEncoderModel": ("encoder", None)}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    # the encoder-decoder config keeps the encoder's sizes under `encoder`
    return decoder_text_model(config, model_class, PATHS, text_config=config.encoder)


FAMILY = Family(name="t5gemma", model_classes=MODEL_CLASSES, tensor_parallel_plan=tensor_parallel_plan)
