"""Run on every rank by tests/test_families.py (the cases live in paradiff_testkit.families, shared with
tools/verify_plans.py)."""

from paradiff_testkit.families import (  # noqa: F401
    MODES,
    family_modes,
    family_modes_runs,
    family_modes_or_refusal,
    parallel_config,
    world_size,
    unplanned_modes,
    unsupported_input_message,
)


def sana_wm_camera_refused(mode: str) -> str:
    """SANA-WM's camera branch is not split: passing camera_conditions raises the plan's reason on every rank."""
    import torch

    import paradiff
    from paradiff.plan_tools import family_examples as examples

    model = paradiff.enable_parallelism(examples.build_example("sana_wm", "sana-wm"), parallel_config(mode))
    inputs = examples.example_inputs("sana_wm", "sana-wm", model.config)
    inputs["camera_conditions"] = torch.zeros(2, inputs["hidden_states"].shape[2], 20)
    try:
        examples.forward(model, inputs)
    except ValueError as exc:
        return str(exc)
    return "no error"
