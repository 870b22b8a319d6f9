"""Processors the tiny pipelines need that this environment's transformers cannot build.

transformers 5 checks every sub-processor of a `Qwen2VLProcessor` against its base class, the video processor's
included, and that class (`VideoProcessorMixin`) exists only with torchvision installed: without it no
`Qwen2VLProcessor` can be made or loaded at all, though the Qwen-Image edit pipelines only ever give it text and
images. `TinyQwen2VLProcessor` is that processor without a video processor: the same tokenizer, the same image
processor, the same `__call__`; saved and loaded as those two parts.
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer, ProcessorMixin, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen3VLProcessor

__all__ = ["TinyQwen2VLProcessor", "TinyQwen3VLProcessor", "ProcessorMixin"]  # diffusers finds the loading methods through ProcessorMixin


class _WithoutVideoProcessor:
    """A Qwen-VL processor made and saved without its video processor: its tokenizer and image processor only."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None:  # no video processor
            return None
        return super().check_argument_for_proper_class(argument_name, argument)

    def save_pretrained(self, save_directory, **kwargs):
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)
        return [str(save_directory)]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder: str | None = None, **kwargs):
        # a standard pipeline names the processor's own folder; Modular Diffusers names the pipeline's and a subfolder
        path = os.path.join(pretrained_model_name_or_path, subfolder) if subfolder else pretrained_model_name_or_path
        return cls(image_processor=Qwen2VLImageProcessor.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path))


class TinyQwen2VLProcessor(_WithoutVideoProcessor, Qwen2VLProcessor):
    pass


# Qwen-VL's chat layout: a message's content is a string or a list of {"type": "text" | "image", ...} parts
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class TinyQwen3VLProcessor(_WithoutVideoProcessor, Qwen3VLProcessor):
    """A Qwen3VLProcessor without a video processor (the same reason as TinyQwen2VLProcessor's), with Qwen-VL's chat
    template; saved and loaded as its tokenizer and image processor."""

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                         chat_template=chat_template or QWEN_VL_CHAT_TEMPLATE, **kwargs)
