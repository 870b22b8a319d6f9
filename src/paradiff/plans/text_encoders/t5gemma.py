"""T5Gemma encoders: Stable Audio 3's `T5GemmaEncoderModel` (Gemma 2 decoder layers run bidirectionally) and
Motif-Video's `T5Gemma2Encoder` (Gemma 3 layers; its SigLIP vision tower and projector stay whole).

PRX's `T5GemmaEncoder` (diffusers' wrapper of transformers' bare encoder) is built from the `encoder` part of the
encoder-decoder config its checkpoint keeps, as the wrapper's own `from_pretrained` does.

T5Gemma 2's token table stays whole: its forward puts a learnt end-of-image vector at every end-of-image token id,
which a table holding a slice of the rows would read against its local ids."""

from paradiff.plans.text_encoders.common import decoder_text_model
from paradiff.plans.family import Family

PATHS = {"T5GemmaEncoderModel": ("encoder", None), "T5GemmaEncoder": ("", None), "T5Gemma2Encoder": ("text_model", None)}
MODEL_CLASSES = tuple(PATHS)


def tensor_parallel_plan(config, model_class: str):
    if model_class == "T5Gemma2Encoder":
        return decoder_text_model(config, model_class, PATHS, split_vocab=False)
    # the encoder-decoder config keeps the encoder's sizes under `encoder` (T5GemmaEncoder is built from that part)
    return decoder_text_model(config, model_class, PATHS, text_config=getattr(config, "encoder", config))


def model_config(config, model_class: str):
    """T5GemmaEncoder takes the encoder's own config; its folder holds the encoder-decoder one."""
    return getattr(config, "encoder", config) if model_class == "T5GemmaEncoder" else config


FAMILY = Family.of(__name__)
