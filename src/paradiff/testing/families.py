"""Run on every rank by tests/test_families.py and tools/verify_plans.py: each built-in family example in each parallel mode against the
single-process forward of the same weights and inputs."""

from __future__ import annotations

import paradiff
from paradiff.plan_tools import family_examples as examples

MODES = {  # mode -> (tp, ring, ulysses)
    "tp2": (2, 1, 1),
    "ulysses2": (1, 1, 2),
    "ring2": (1, 2, 1),
    "tp2xulysses2": (2, 1, 2),
    "unified2x2": (1, 2, 2),
    "tp4": (4, 1, 1),
}


def parallel_config(mode: str):
    tp, ring, ulysses = MODES[mode]
    return paradiff.ParallelConfig.from_degrees(tp=tp, ring=ring, ulysses=ulysses)


def family_modes(family: str, example: str, modes: list[str], checkpoint: str | None = None,
                 plan: str | None = None) -> dict:
    """{mode: relative difference, share of the single-process block FLOPs and block parameter bytes}.

    With `checkpoint`, each mode is also loaded shard-on-read through from_pretrained (no plan argument)."""
    reference = examples.build_example(family, example)
    inputs = examples.example_inputs(family, example, reference.config)
    expected, single_flops = examples.forward_with_flops(reference, inputs)
    single_bytes = examples.block_parameter_bytes(reference)
    results = {}
    for mode in modes:
        loaders = {"enable_parallelism": lambda: paradiff.enable_parallelism(
            examples.build_example(family, example), parallel_config(mode), plan=plan, cp_plan=plan)}
        if checkpoint:
            loaders["from_pretrained"] = lambda: paradiff.from_pretrained(
                type(reference), checkpoint, parallel_config=parallel_config(mode))
        for how, load in loaders.items():
            model = load()
            actual, flops = examples.forward_with_flops(model, inputs)
            results[f"{mode}/{how}" if checkpoint else mode] = {
                "diff": examples.relative_difference(actual, expected),
                "flop_share": flops / single_flops,
                "bytes_share": examples.block_parameter_bytes(model) / single_bytes,
            }
    return results


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
