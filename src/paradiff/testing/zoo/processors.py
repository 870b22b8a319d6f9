"""Processors the tiny pipelines need that this environment's transformers cannot build.

transformers 5 checks every sub-processor of a `Qwen2VLProcessor` against its base class, the video processor's
included, and that class (`VideoProcessorMixin`) exists only with torchvision installed: without it no
`Qwen2VLProcessor` can be made or loaded at all, though the Qwen-Image edit pipelines only ever give it text and
images. `TinyQwen2VLProcessor` is that processor without a video processor: the same tokenizer, the same image
processor, the same `__call__`; saved and loaded as those two parts.
"""

from __future__ import annotations

from transformers import AutoTokenizer, ProcessorMixin, Qwen2VLImageProcessor, Qwen2VLProcessor

__all__ = ["TinyQwen2VLProcessor", "ProcessorMixin"]  # diffusers finds the loading methods through ProcessorMixin


class TinyQwen2VLProcessor(Qwen2VLProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None:  # no video processor
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def save_pretrained(self, save_directory, **kwargs):
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)
        return [str(save_directory)]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        return cls(image_processor=Qwen2VLImageProcessor.from_pretrained(pretrained_model_name_or_path),
                   tokenizer=AutoTokenizer.from_pretrained(pretrained_model_name_or_path))
