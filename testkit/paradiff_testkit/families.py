"""Run on every rank by tests/test_families.py and tools/verify_plans.py: each built-in family example in each parallel mode against the
single-process forward of the same weights and inputs."""

from __future__ import annotations

from typing import Callable

import paradiff
from paradiff.config import mode_world_size
from paradiff.plan_tools import family_examples as examples

# the family examples' modes: a label (the coverage table's column) -> the mode in parse_mode's spelling
MODES = {"tp2": "tp2", "ulysses2": "ulysses2", "ring2": "ring2", "tp2xulysses2": "tp2xulysses2",
         "unified2x2": "ring2xulysses2", "tp4": "tp4", "tp3": "tp3"}


def world_size(mode: str) -> int:
    return mode_world_size(MODES.get(mode, mode))


def parallel_config(mode: str):
    return paradiff.ParallelConfig.from_mode(MODES.get(mode, mode))


def single_process_figures(family: str, example: str, config_overrides: dict | None = None) -> dict:
    """The single-process forward of an example: its outputs, its projection FLOPs inside the block stacks and its
    block parameter bytes. The same on every rank, so a test computes it once and hands it to family_modes."""
    reference = examples.build_example(family, example, config_overrides=config_overrides)
    inputs = examples.example_inputs(family, example, reference.config)
    expected, flops = examples.forward_with_flops(reference, inputs)
    return {"expected": expected, "flops": flops, "bytes": examples.block_parameter_bytes(reference)}


def family_modes(family: str, example: str, modes: list[str], checkpoint: str | None = None,
                 plan: str | None = None, config_overrides: dict | None = None, single: dict | None = None,
                 loaders: tuple[str, ...] = ("enable_parallelism", "from_pretrained")) -> dict:
    """{mode: relative difference, share of the single-process block FLOPs and block parameter bytes}.

    With `checkpoint`, each mode is also loaded shard-on-read through from_pretrained (no plan argument); `loaders`
    chooses which of the two ways run. `config_overrides` change the example's config (e.g. a head count the TP
    degree does not divide). `single`: single_process_figures of the same example, computed here when not given."""
    def build():
        return examples.build_example(family, example, config_overrides=config_overrides)

    # The reference: its config gives the inputs and its parameters, copied before any split, the full tensors each
    # rank's slices are checked against. The builds are seeded, so the first enable_parallelism load takes this very
    # model instead of building the same one again (a build costs more than the tiny forward).
    reference = build()
    inputs = examples.example_inputs(family, example, reference.config)
    full = {name: param.detach().clone() for name, param in reference.named_parameters()}
    model_class, unused = type(reference), [reference]
    if single is None:
        single = single_process_figures(family, example, config_overrides)
    expected, single_flops, single_bytes = single["expected"], single["flops"], single["bytes"]
    results = {}
    for mode in modes:
        ways = {"enable_parallelism": lambda: paradiff.enable_parallelism(
            unused.pop() if unused else build(), parallel_config(mode), plan=plan, cp_plan=plan)}
        if checkpoint:
            ways["from_pretrained"] = lambda: paradiff.from_pretrained(
                model_class, checkpoint, parallel_config=parallel_config(mode))
        ways = {how: load for how, load in ways.items() if how in loaders}
        for how, load in ways.items():
            model = load()
            actual, flops = examples.forward_with_flops(model, inputs)
            results[f"{mode}/{how}" if checkpoint else mode] = {
                "diff": examples.relative_difference(actual, expected),
                "flop_share": flops / single_flops,
                "bytes_share": examples.block_parameter_bytes(model) / single_bytes,
                "wrong_slices": wrong_slices(model, full),
            }
    return results


def family_modes_runs(runs: list[dict]) -> list[dict]:
    """family_modes for each keyword set of `runs`, in order: several configurations in one rank-pool case."""
    return [family_modes(**run) for run in runs]


def wrong_slices(model, reference) -> list[str]:
    """The split parameters of `model` that are not exactly the slice their spec names of `reference`'s full
    tensor (empty when every rank holds its own whole heads / features). `reference`: the whole model, or its
    parameters by name."""
    import torch

    from paradiff.runtime.state import get_state
    from paradiff.tensor_parallel.shard import slice_tensor

    state = get_state(model)
    resolved = None if state is None else state.tp_plan
    if resolved is None:
        return []
    full = dict(reference) if isinstance(reference, dict) else dict(reference.named_parameters())
    local = dict(model.named_parameters())
    wrong = []
    for module_name, linear in resolved.linears.items():
        for leaf, spec in linear.specs.items():
            name = f"{module_name}.{leaf}" if module_name else leaf
            if spec is None or name not in full or name not in local:
                continue
            if not torch.equal(local[name].detach(), slice_tensor(full[name].detach(), spec)):
                wrong.append(name)
    return wrong


# Head-count configs of the examples whose config ties the head count to other widths in ways the generic search of
# uneven_head_overrides cannot guess: `h` heads for every attention the plan splits (one K/V head where the example
# groups them), each entry naming the keys that must move with the heads and why (read from diffusers 0.42.1).
UNEVEN_HEAD_CONFIGS: dict[tuple[str, str], Callable[[int], dict]] = {
    # the head width is sum(axes_dims) = 16 (the rotary axes): h heads need a 16h-wide model; Kandinsky 6's audio
    # stream has its own width (32: 2 heads, which tp3 refuses), also 16h
    ("kandinsky5", "kandinsky-5"): lambda h: dict(model_dim=16 * h),
    ("kandinsky6", "kandinsky6"): lambda h: dict(model_dim=16 * h, model_dim_a=16 * h),
    ("kandinsky6", "kandinsky6-video"): lambda h: dict(model_dim=16 * h, model_dim_a=16 * h),
    ("kandinsky6_sr", "kandinsky6-sr"): lambda h: dict(model_dim=16 * h),
    # dim = heads x sum(axes_dims) (16); Z-Image's K/V heads equal its query heads (no grouping), so they move too
    ("z_image", "z-image"): lambda h: dict(n_heads=h, n_kv_heads=h, dim=16 * h),
    # the same Z-Image blocks; the Perceiver's and the injected cross-attentions take n_heads too
    ("bria_fibo2", "bria-fibo2"): lambda h: dict(n_heads=h, dim=16 * h),
    # the model width names no head width key (dit_dim = heads x 16)
    ("longcat_audio", "longcat-audio-dit"): lambda h: dict(dit_heads=h, dit_dim=16 * h),
    # two streams, each with its own heads: video attn1/attn2/audio_to_video_attn, audio audio_attn1/audio_attn2/
    # video_to_audio_attn. cross_attention_dim is the caption width the caption projection makes (= video inner
    # width, h x 8); audio_cross_attention_dim sizes the audio-video cross-attentions' rotary tables (= audio inner)
    **{("ltx2", name): lambda h: dict(num_attention_heads=h, audio_num_attention_heads=h, cross_attention_dim=8 * h,
                                      audio_cross_attention_dim=8 * h) for name in ("ltx-2", "ltx-2.3")},
    # head width = hidden_size / heads (16; the rope factors cover 8 = 16 / 2); K/V heads equal the query heads
    ("omnigen", "omnigen"): lambda h: dict(num_attention_heads=h, num_key_value_heads=h, hidden_size=16 * h),
    # the CogVideoX blocks (heads x attention_head_dim) and the perceiver cross-attentions (cross_attn_num_heads, 2
    # in the example, which tp3 refuses); their K/V input is 2/3 of the inner width (16h), which the face
    # extractor's output (LFE_output_dim) must match (32 for 3 heads; no whole width for 5 or 7). The face extractor
    # itself is not split.
    ("consisid", "consisid"): lambda h: dict(num_attention_heads=h, cross_attn_num_heads=h,
                                             LFE_output_dim=32 * h // 3),
    # hidden_size = heads x attention_head_dim (the generic search moves the heads alone or hidden_size only with a
    # head width key it reads from the config, which the ControlNet's class computes instead)
    ("hunyuandit", "hunyuandit-controlnet"): lambda h: dict(num_attention_heads=h, hidden_size=16 * h),
    # the cross-attention groups 4 query heads over 2 K/V heads (num_key_value_attention_heads): h over 1
    ("stable_audio", "stable-audio-open"): lambda h: dict(num_attention_heads=h, num_key_value_attention_heads=1),
    # embed_dim = heads x 16 (the differential attention's packed q1/q2/k1/k2/v each h heads)
    ("stable_audio3", "stable-audio-3"): lambda h: dict(num_heads=h, embed_dim=16 * h),
    # The generic search builds these, but leaves a second attention at an even count:
    # Krea 2's text-fusion blocks count their own heads (text_num_attention_heads, head width 8)
    ("krea2", "krea2"): lambda h: dict(num_attention_heads=h, num_key_value_heads=1, text_hidden_dim=8 * h,
                                       text_num_attention_heads=h, text_num_key_value_heads=1),
    # Sana's cross-attention has its own heads and head width (2 x 32): h x 16, the 16h-wide inner width
    **{(family, name): lambda h: dict(num_attention_heads=h, cross_attention_dim=16 * h, num_cross_attention_heads=h,
                                      cross_attention_head_dim=16)
       for family, name in (("sana", "sana-1.0"), ("sana", "sana-sprint"), ("sana", "sana-controlnet"), ("sana_video", "sana-video-t2v"),
                            ("sana_video", "sana-video-i2v"))},
    # SANA-WM's refiner is LTX-2's two-stream transformer: the audio heads too
    **{("sana_wm_refiner", name): lambda h: dict(num_attention_heads=h, audio_num_attention_heads=h,
                                                 cross_attention_dim=8 * h, audio_cross_attention_dim=8 * h)
       for name in ("sana-wm-refiner", "sana-wm-refiner-split-rope")},
}


def uneven_head_overrides(family: str, example: str, heads: int = 3) -> dict | None:
    """Config overrides giving the example `heads` attention heads (one K/V head where it groups them), or None
    where no such config builds and runs.

    UNEVEN_HEAD_CONFIGS first (taken as it is for 3 heads, which the suite checks; tried for other counts). Then the
    head count alone; then also every config width equal to 1, 2 or 4 times the old inner width (heads x head width:
    hidden sizes, cross-attention and caption widths), scaled to the new head count."""
    from paradiff.plans import builtin_plan
    from paradiff.tensor_parallel.plan import as_plan

    if (family, example) in UNEVEN_HEAD_CONFIGS:
        candidate = UNEVEN_HEAD_CONFIGS[(family, example)](heads)
        return candidate if heads == 3 or _runs(family, example, candidate) else None
    module = examples.family_module(family)
    _, config = module.examples[example]
    # the plan as the product builds it: a family serving several classes (HunyuanDiT and its ControlNet) is told
    # which one, its config keys differing
    built = examples.build_example(family, example)
    key = as_plan(builtin_plan(built, built.config, "tensor")).heads_config_key
    old = config.get(key, getattr(built.config, key, None))
    if not isinstance(old, int):
        return None
    overrides = {key: heads}
    for kv_key in ("num_key_value_heads", "num_kv_heads", "kv_heads", "num_key_value_attention_heads"):
        if config.get(kv_key) is not None:  # grouped: one K/V head; not grouped: as many as the query heads
            overrides[kv_key] = heads if config[kv_key] == old else 1
    candidates = [overrides]
    head_dim = next((config[k] for k in ("attention_head_dim", "head_dim", "dim_head") if isinstance(config.get(k), int)),
                    None)
    if head_dim is None:
        hidden = next((config[k] for k in ("hidden_size", "dim", "inner_dim", "d_model")
                       if isinstance(config.get(k), int)), None)
        head_dim = hidden // old if hidden and hidden % old == 0 else None
    if head_dim is not None:
        inner = old * head_dim
        scaled = {k: v // inner * heads * head_dim for k, v in config.items()
                  if isinstance(v, int) and not isinstance(v, bool) and k != key and v in (inner, 2 * inner, 4 * inner)}
        candidates.append({**overrides, **scaled})
    return next((candidate for candidate in candidates if _runs(family, example, candidate)), None)


def _runs(family: str, example: str, overrides: dict) -> bool:
    """Whether the example builds and runs a forward with these config overrides."""
    import torch

    try:
        model = examples.build_example(family, example, config_overrides=overrides)
        with torch.no_grad():
            examples.forward(model, examples.example_inputs(family, example, model.config))
    except Exception:  # noqa: BLE001 - any failure means the config does not take this head count
        return False
    return True


def family_modes_or_refusal(family: str, example: str, modes: list[str], **kwargs) -> dict:
    """family_modes, or {"refused": message} where the plan refuses the degree (more ranks than some heads)."""
    from paradiff.errors import PlanError

    try:
        return family_modes(family, example, modes, **kwargs)
    except PlanError as exc:
        return {"refused": str(exc)}


def unplanned_modes(modes: list[str], plan: str = "auto") -> dict:
    """The model no built-in plan knows, with plan='auto' / cp_plan='auto', against its single-process forward."""
    import torch

    from paradiff.testing.models import UnplannedTransformer

    def build():
        torch.manual_seed(0)
        model = UnplannedTransformer()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        return model.eval()

    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 15, 8, generator=generator),
                  encoder_hidden_states=torch.randn(2, 7, 16, generator=generator), return_dict=False)
    reference = build()
    expected, single_flops = examples.forward_with_flops(reference, inputs)
    results = {}
    for mode in modes:
        model = paradiff.enable_parallelism(build(), parallel_config(mode), plan=plan, cp_plan=plan)
        actual, flops = examples.forward_with_flops(model, inputs)
        results[mode] = {"diff": examples.relative_difference(actual, expected), "flop_share": flops / single_flops,
                         "bytes_share": examples.block_parameter_bytes(model) / examples.block_parameter_bytes(reference)}
    return results


def unsupported_input_message() -> str:
    """Stable Audio 3's inpainting input under Ulysses: refused with the plan's reason, on every rank alike."""
    import torch

    model = paradiff.enable_parallelism(examples.build_example("stable_audio3", "stable-audio-3"),
                                        parallel_config("ulysses2"))
    inputs = examples.example_inputs("stable_audio3", "stable-audio-3", model.config)
    inputs["local_add_cond"] = torch.zeros(2, model.config.local_add_cond_dim, inputs["hidden_states"].shape[-1])
    try:
        examples.forward(model, inputs)
    except ValueError as exc:
        return str(exc)
    return "no error"
