"""Run on every rank by tests/test_families.py (the cases live in paradiff.testing.families, shared with
tools/verify_plans.py)."""

from paradiff.testing.families import (  # noqa: F401
    MODES,
    family_modes,
    parallel_config,
    unplanned_modes,
    unsupported_input_message,
)
