"""Z-Image (`ZImageTransformer2DModel`): refiner stacks for the image and the caption, then one stack over the
joined sequence; inputs and outputs are per-sample lists. Its ControlNet (`ZImageControlNetModel`) borrows the
transformer's embedders and refiners (`from_transformer`, in the pipeline's `__init__`: split by the transformer's
plans) and owns only its control patch embedder, its control-context refiner blocks and its control blocks (each a
Z-Image block reading the control stream, with zero-initialised projections in and out): its plans split those.

The model pads every sequence to a multiple of 32 tokens itself, so its token counts always divide 2 and 4 ranks;
the uneven split paths are exercised by the other families."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, PerSample, Uniform


def _stacks(config) -> tuple[str, ...]:
    refiners = ("noise_refiner", "context_refiner") + (("siglip_refiner",) if config.siglip_feat_dim else ())
    return refiners + ("layers",)


MODEL_CLASSES = ("ZImageTransformer2DModel", "ZImageControlNetModel")
CONTROLNET = "ZImageControlNetModel"


def _block_styles(stack: str) -> dict[str, str]:
    return {
        f"{stack}.*.attention.to_q": "colwise", f"{stack}.*.attention.to_k": "colwise",
        f"{stack}.*.attention.to_v": "colwise", f"{stack}.*.attention.to_out.0": "rowwise",
        f"{stack}.*.feed_forward.w1": "colwise", f"{stack}.*.feed_forward.w3": "colwise",
        f"{stack}.*.feed_forward.w2": "rowwise",
    }


def _control_stacks(config) -> dict[str, bool]:
    """The ControlNet's own block stacks -> whether they are control blocks (which take the control stream `c` and
    the stream it joins `x`, and return the stack of their residuals and the stream, tokens on dim 2). The control-
    context refiner is plain Z-Image blocks unless `add_control_noise_refiner` names it (control blocks) or puts the
    control blocks in its place ("control_layers": none of its own)."""
    stacks = {"control_layers": True}
    if config.add_control_noise_refiner != "control_layers":
        stacks["control_noise_refiner"] = config.add_control_noise_refiner == "control_noise_refiner"
    return stacks


def tensor_parallel_plan(config, model_class: str = "ZImageTransformer2DModel") -> TensorParallelPlan:
    if model_class == CONTROLNET:
        # every control block reads and returns whole streams, as the transformer's blocks do: the projections in
        # and out (dim x dim) read a replicated stream, split by input features and summed; the control patch
        # embedder stays whole
        styles = {}
        for stack, control in _control_stacks(config).items():
            styles.update(_block_styles(stack))
            styles[f"{stack}.*.adaLN_modulation.0"] = "rowwise_split_input"
            if control:  # the projection in belongs to the stack's first block only
                styles.update({f"{stack}.0.before_proj": "rowwise_split_input",
                               f"{stack}.*.after_proj": "rowwise_split_input"})
        return TensorParallelPlan(styles=styles)
    styles = {"t_embedder.mlp.0": "colwise", "t_embedder.mlp.2": "rowwise", "cap_embedder.1": "rowwise_split_input"}
    for stack in _stacks(config):
        styles.update(_block_styles(stack))
    for stack in ("noise_refiner", "layers"):  # the caption (and SigLIP) refiners are not modulated
        styles[f"{stack}.*.adaLN_modulation.0"] = "rowwise_split_input"
    return TensorParallelPlan(styles=styles)


def _controlnet_context_plan(config) -> ContextParallelPlan:
    # Each of its stacks splits its stream at its first block, with the key mask and rotary table at every block,
    # and gathers it after its last: the residuals leave whole, and the transformer splits them with its joined
    # sequence (its `controlnet_block_samples`). A control block takes the stream it joins (`x`) at block 0 only.
    split_inputs, gather_outputs = {}, {}
    for stack, control in _control_stacks(config).items():
        last = (len(config.control_layers_places) if stack == "control_layers" else config.n_refiner_layers) - 1
        split_inputs[f"{stack}.0"] = {"c": Split(1), "x": Split(1)} if control else {"x": Split(1)}
        split_inputs[f"{stack}.*"] = {"attn_mask": Split(1), "freqs_cis": Split(1)}
        gather_outputs[f"{stack}.{last}"] = 2 if control else 1
    return ContextParallelPlan(split_inputs=split_inputs, gather_outputs=gather_outputs)


def context_parallel_plan(config, model_class: str = "ZImageTransformer2DModel") -> ContextParallelPlan:
    if model_class == CONTROLNET:
        return _controlnet_context_plan(config)
    # Each stack's sequence is split at its first block with its key mask, rotary table and per-token noise mask
    # at every block, and gathered after its last: the model joins the refined sequences sample by sample.
    split_inputs, gather_outputs = {}, {}
    for stack in _stacks(config):
        split_inputs[f"{stack}.0"] = {"x": Split(1)}
        split_inputs[f"{stack}.*"] = {"attn_mask": Split(1), "freqs_cis": Split(1), "noise_mask": Split(1)}
        if stack != "layers":
            gather_outputs[f"{stack}.{config.n_refiner_layers - 1}"] = 1
    # The joined sequence stays split through the (token-wise) final layer, gathered after it: a ControlNet's
    # residuals (ZImageControlNetModel: layer index -> the joined sequence's) are added after a layer, the last one
    # too, and are split with the sequence.
    for patch, frames in zip(config.all_patch_size, config.all_f_patch_size):
        split_inputs[f"all_final_layer.{patch}-{frames}"] = {"noise_mask": Split(1)}
        gather_outputs[f"all_final_layer.{patch}-{frames}"] = 1
    split_inputs[""] = {"controlnet_block_samples": Split(1)}
    return ContextParallelPlan(split_inputs=split_inputs, gather_outputs=gather_outputs)


EXAMPLES = {"z-image": ("ZImageTransformer2DModel", dict(
    in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=24,
    axes_dims=[4, 6, 6], axes_lens=[128, 64, 64]))}


# per-sample lists; the last caption pads to 64 tokens, the others to 32, so the batch carries a key mask
INPUTS = dict(
    x=PerSample(Noise(("in_channels", 1, "2 * height", "2 * width"))),
    cap_feats=PerSample(Noise(("text + 32 * (index == batch - 1)", "cap_feat_dim"))),
    t=Uniform(),
    return_dict=False,
)


FAMILY = Family.of(__name__)
