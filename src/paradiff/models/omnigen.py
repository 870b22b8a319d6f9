"""OmniGen's prompt layout as its processor builds it (mask and positions of a left-padded prompt holding an input
image), for the example inputs plans/omnigen.py declares."""

import torch


def prompt_mask(text: int, padding: int, image: int, input_images: list[tuple[int, int]]) -> torch.Tensor:
    """OmniGen's mask for one sample, as its processor builds it: left padding; the prompt and the time token
    causal, the output image seeing every real token, each input image bidirectional within itself; padding rows
    see everything (1 = attend)."""
    length = text + 1 + image
    mask = torch.zeros(length, length)
    prompt_end = text + 1
    mask[padding:prompt_end, padding:prompt_end] = torch.ones(prompt_end - padding, prompt_end - padding).tril()
    mask[prompt_end:, padding:] = 1
    mask[:padding] = 1
    for start, end in input_images:
        mask[start:end, start:end] = 1
    return mask


def _paddings(batch: int, padding: int) -> list[int]:
    return [0] * (batch - 1) + [padding]  # only the last prompt is left-padded


def prompt_masks(batch: int, text: int, image: int, padding: int, input_image: tuple[int, int]) -> torch.Tensor:
    """(batch, tokens, tokens): the last prompt left-padded by `padding`, sample 0's prompt holding `input_image`."""
    return torch.stack([prompt_mask(text, pad, image, [input_image] if sample == 0 else [])
                        for sample, pad in enumerate(_paddings(batch, padding))])


def prompt_positions(batch: int, text: int, image: int, padding: int) -> torch.Tensor:
    """(batch, tokens): positions counted from each prompt's first real token, padding at 0."""
    return torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), torch.arange(text - pad + 1 + image)])
                        for pad in _paddings(batch, padding)])
