"""T5Gemma encoders: Stable Audio 3's `T5GemmaEncoderModel` (Gemma 2 decoder layers run bidirectionally) and
Motif-Video's `T5Gemma2Encoder` (Gemma 3 layers; its SigLIP vision tower and projector stay whole).

T5Gemma 2's token table stays whole: its forward puts a learnt end-of-image vector at every end-of-image token id,
which a table holding a slice of the rows would read against its local ids. (PRX's `T5GemmaEncoder` is not listed:
its checkpoint keeps the composite encoder-decoder config, which diffusers' wrapper unpacks in its own
`from_pretrained`; it stays whole, loaded by diffusers.)"""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {"T5GemmaEncoderModel": ("encoder", None), "T5Gemma2Encoder": ("text_model", None)}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    if model_class == "T5Gemma2Encoder":
        return decoder_text_model(config, model_class, PATHS, split_vocab=False)
    # the encoder-decoder config keeps the encoder's sizes under `encoder`
    return decoder_text_model(config, model_class, PATHS, text_config=config.encoder)


FAMILY = Family(name="t5gemma", model_classes=MODEL_CLASSES, tensor_parallel_plan=tensor_parallel_plan)
