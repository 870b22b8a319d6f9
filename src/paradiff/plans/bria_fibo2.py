"""Bria FIBO 2 (`BriaFibo2Transformer2DModel`): Z-Image-style single-stream blocks. A noise refiner runs on the image
(and context image) tokens; a Perceiver squeezes the text into gist tokens; the main blocks run on [gist, image,
context] (gist last when a batch pads its gist tokens), some of them also cross-attending to a text bundle."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.common import attention, mlp
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform, text_mask

MODEL_CLASSES = ("BriaFibo2Transformer2DModel",)


def _ffn(prefix: str) -> dict:
    return {f"{prefix}.w1": "colwise", f"{prefix}.w3": "colwise", f"{prefix}.w2": "rowwise"}


def _block(prefix: str) -> dict:
    return {**attention(f"{prefix}.attention"), **_ffn(f"{prefix}.feed_forward"),
            f"{prefix}.adaLN_modulation.0": "rowwise_split_input"}


def tensor_parallel_plan(config) -> TensorParallelPlan:
    styles = {
        **_block("noise_refiner.*"), **_block("layers.*"),
        # the Perceiver's gist tokens: cross-attention to the text, self-attention, FFN
        **attention("perceiver.layers.*.cross_attention"), **attention("perceiver.layers.*.self_attention"),
        **_ffn("perceiver.layers.*.ffn"),
        **mlp("t_embedder.mlp", "0", "2"),
        "final_layer.adaLN_modulation.1": "rowwise_split_input",
    }
    for index in config.injection_layer_ids:
        styles.update(attention(f"layers.{index}.cross_attention"))
    return TensorParallelPlan(styles=styles)


def context_parallel_plan(config) -> ContextParallelPlan:
    # Two sequences, split and gathered each on its own: the refiner's [image, context] tokens, gathered before the
    # model puts the gist beside them, and the main stream, gathered before the model slices the image tokens out.
    # The Perceiver's gist tokens stay whole on every rank (their attention runs locally).
    per_token = {"freqs_cis": Split(1), "noise_mask": Split(1)}
    return ContextParallelPlan(
        split_inputs={
            "noise_refiner.0": {"x": Split(1)},
            "noise_refiner.*": per_token,
            "layers.0": {"x": Split(1)},
            "layers.*": {**per_token, "attn_mask": Split(1)},
        },
        gather_outputs={f"noise_refiner.{config.n_refiner_layers - 1}": 1, f"layers.{config.n_layers - 1}": 1},
        local_attention=("perceiver.layers.*.cross_attention", "perceiver.layers.*.self_attention",
                         *(f"layers.{index}.cross_attention" for index in config.injection_layer_ids)),
    )


EXAMPLES = {"bria-fibo2": ("BriaFibo2Transformer2DModel", dict(
    in_channels=4, patch_size=2, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4, cap_feat_dim=24,
    injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=2, max_num_gist_tokens=4, gist_step=1,
    gist_min_text_len=2, gist_max_text_len=8, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16)))}


# The padded last prompt gets 3 gist tokens, the others 4: the batch pads the gist (masked, placed last).
# Refiner stream: 15 image + 4 context tokens; main stream: 19 + 4 gist.
INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "height * patch_size", "width * patch_size")),
    timestep=Uniform(),
    encoder_hidden_states=Noise(("batch", "1 + len(injection_layer_ids)", "text", "cap_feat_dim")),
    encoder_attention_mask=text_mask(),
    context_latents=[Noise(("batch", "in_channels", "2 * patch_size", "2 * patch_size"))],
    return_dict=False,
)


FAMILY = Family.of(__name__)
