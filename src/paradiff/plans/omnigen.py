"""OmniGen (`OmniGenTransformer2DModel`): how it splits under tensor and context parallelism.

One sequence of [prompt tokens (with input-image tokens in place), time token, output-image tokens] under a mask
that is causal over the prompt and bidirectional over each image: a query-dependent mask, which reaches the
attention whole; ring attention takes its local rows and each travelling block's columns, Ulysses all of it.
"""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import DEFAULT_HEAD_ATTRS, TensorParallelPlan
from paradiff.tensor_parallel.styles import ColwiseHeads, PackedColwise
from paradiff.plans.common import Grid, mlp
from paradiff.plans.family import Family

MODEL_CLASSES = ("OmniGenTransformer2DModel",)


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        "layers.*.self_attn.to_q": "colwise",
        "layers.*.self_attn.to_k": ColwiseHeads(_head_dim),  # grouped K/V heads when num_key_value_heads < heads
        "layers.*.self_attn.to_v": ColwiseHeads(_head_dim),
        "layers.*.self_attn.to_out.0": "rowwise",
        "layers.*.mlp.gate_up_proj": PackedColwise([1, 1]),  # gate and up halves
        "layers.*.mlp.down_proj": "rowwise",
        **mlp("time_token"),
        **mlp("t_embedder"),
        "norm_out.linear": "rowwise_split_input",
    }, head_attrs=DEFAULT_HEAD_ATTRS + ("out_dim",))  # the processor reshapes its output to attn.out_dim


def context_parallel_plan(config) -> ContextParallelPlan:
    # the model keeps the output-image tokens from the end of the whole sequence, so it is gathered after `norm`
    return ContextParallelPlan(
        split_inputs={"layers.0": {"hidden_states": Split(1)}, "layers.*": {"image_rotary_emb": Split(0)}},
        gather_outputs={"norm": 1},
    )


EXAMPLES = {
    "omnigen": ("OmniGenTransformer2DModel", dict(
        in_channels=4, patch_size=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, num_layers=2, pad_token_id=0, vocab_size=64, pos_embed_max_size=16, time_step_dim=32,
        rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8})),
}


def _prompt_mask(text: int, padding: int, image: int, input_images: list[tuple[int, int]]) -> torch.Tensor:
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


def example_inputs(name: str, config, batch: int, grid: Grid, generator: torch.Generator) -> dict:
    p = config.patch_size
    text, image = grid.text, grid.height * grid.width  # 7 prompt + 1 time + 15 image tokens
    paddings = [0] * (batch - 1) + [2]  # the last prompt is left-padded
    input_image = (1, 5)  # sample 0's prompt holds a 2 x 2-patch input image at tokens 1..4
    input_ids = torch.randint(1, config.vocab_size, (batch, text), generator=generator)
    masks, positions = [], []
    for sample, padding in enumerate(paddings):
        input_ids[sample, :padding] = config.pad_token_id
        masks.append(_prompt_mask(text, padding, image, [input_image] if sample == 0 else []))
        positions.append(torch.cat([torch.zeros(padding, dtype=torch.long), torch.arange(text - padding + 1 + image)]))
    return dict(
        hidden_states=torch.randn(batch, config.in_channels, grid.height * p, grid.width * p, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        input_ids=input_ids,
        input_img_latents=[torch.randn(1, config.in_channels, 2 * p, 2 * p, generator=generator)],
        input_image_sizes={0: [input_image]},
        attention_mask=torch.stack(masks),
        position_ids=torch.stack(positions),
        return_dict=False,
    )


FAMILY = Family.of(__name__)
