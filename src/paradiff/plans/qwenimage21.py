"""Qwen-Image 2.1 (`QwenImage21Transformer2DModel`): one single-stream joint text/image sequence with block-causal
attention (causal text, each image block bidirectional), and one modulation projection shared by every block."""

import torch

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Full, Noise, PerSample, Uniform, Value, text_mask

MODEL_CLASSES = ("QwenImage21Transformer2DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **attention("transformer_blocks.*.attn"),  # its QK-norms are per head: nothing to split
        "transformer_blocks.*.img_mlp.proj": "colwise",
        "transformer_blocks.*.img_mlp.gate_layer": "colwise",
        "transformer_blocks.*.img_mlp.out": "rowwise",
        # dim -> 4 dim, shared by all blocks: the largest replicated weight left outside them
        "modulation.1": "rowwise_split_input",
        **mlp("txt_in", "in_layer", "out_layer"),
        **mlp("time_text_embed.timestep_embedder"),
        "norm_out.linear": "rowwise_split_input",
    })


def block_causal_mask(arguments: dict) -> dict:
    """The processor's per-segment prefill (queries sliced at full-sequence positions) as one whole-sequence mask:
    a text segment's queries see the keys before them and themselves, an image block's see everything up to its
    end, the target image's see all keys; padded text keys are never seen. Every rank builds the same mask."""
    segments, mask = arguments.get("segments"), arguments.get("attention_mask")
    if segments is None:
        if mask is not None and not torch.is_tensor(mask):
            raise ValueError(f"Qwen-Image 2.1 under context parallelism runs QwenImage21AttnProcessor; its attention "
                             f"got a {type(mask).__name__} (QwenImage21FlexAttnProcessor's block mask), which bypasses "
                             "the context-parallel attention. Use model.set_attn_processor(QwenImage21AttnProcessor()).")
        return {}
    tokens = arguments["rotary_emb"].shape[0]
    allowed = torch.ones(tokens, tokens, dtype=torch.bool)
    for start, end, is_text in segments:
        allowed[start:end, end:] = False
        if is_text:
            allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    allowed = allowed[None, None].to(arguments["hidden_states"].device)
    key_valid = arguments.get("key_valid")
    if key_valid is not None:
        allowed = allowed & key_valid.bool()[:, None, None, :]
    return {"segments": None, "attention_mask": allowed, "key_valid": None}


def context_parallel_plan(config) -> ContextParallelPlan:
    # The joint sequence is assembled inside the model (condition latents dropped into the text's image slots), so
    # it is split at the first block; the rotary table and the target-token mask are per joint token.
    return ContextParallelPlan(
        rewrite_inputs={"transformer_blocks.*": block_causal_mask},
        split_inputs={
            "transformer_blocks.0": {"hidden_states": Split(1)},
            "transformer_blocks.*": {"rotary_emb": Split(0), "target_token_mask": Split(0)},
            "norm_out": {"target_token_mask": Split(0)},
        },
        gather_outputs={"proj_out": 1},
        unsupported_inputs={"": {"kv_cache": "the cached decode recomputes only the target image's tokens, sliced "
                                             "from the whole joint sequence; run without kv_cache"}},
    )


EXAMPLES = {"qwen-image-2.1": ("QwenImage21Transformer2DModel", dict(
    patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
    context_in_dim=32, mlp_ratio=3, axes_dims_rope=(4, 6, 6)))}


# One 2 x 2 condition image (one vision-language slot) inside the prompt, then the target image, whose tokens
# must fill whole slots of 4: 7 text + 4 condition + 24 target = 35 joint tokens, which 2 and 4 ranks do not divide.
# The prompt has text + 1 vision-language positions, one of them the condition image's slot.
INPUTS = dict(
    hidden_states=Noise(("batch", "4 + (height + 1) * (width + 1)", "in_channels")),
    encoder_hidden_states=Noise(("batch", "text + 1", "context_in_dim")),
    timestep=Uniform(),
    img_shapes=PerSample(Value("[(1, 2, 2), (1, height + 1, width + 1)]")),
    img_mask=Full(("batch", "text + 1 + (height + 1) * (width + 1) // 4"), False, "bool",
                  set=((":, 3", True), (":, text + 1:", True))),
    # the last prompt is padded: exercises the key mask
    encoder_hidden_states_mask=text_mask(keep="text - 1", length="text + 1"),
    return_dict=False,
)


FAMILY = Family.of(__name__)
