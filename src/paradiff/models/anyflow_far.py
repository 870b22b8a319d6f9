"""AnyFlow FAR's tiny examples as torch's FLOP counter can run them, for plans/anyflow_far.py."""

from paradiff.runtime.patches import set_processor
from paradiff.context_parallel.flex import MaskModAttentionProcessor


def prepare_example(model) -> None:
    # eager flex attention cannot run under torch's FLOP counter: the examples attend through the same mask on SDPA
    # (tests/test_cp_mechanisms.py checks it equal to diffusers' flex processor)
    for block in model.blocks:
        set_processor(block.attn1, MaskModAttentionProcessor(), by="example", through_setter=True)
