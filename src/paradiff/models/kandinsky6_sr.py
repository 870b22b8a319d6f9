"""Kandinsky 6 SR's tiny examples as torch's FLOP counter can run them, for plans/kandinsky6_sr.py."""

from paradiff.runtime.patches import set_processor
from paradiff.context_parallel.nabla import NablaAttentionProcessor


def prepare_example(model) -> None:
    # Eager flex attention runs neither under torch's FLOP counter nor block-sparse (on CPU it attends every key,
    # ignoring the BlockMask diffusers builds): the examples attend through the same NABLA block choice on SDPA, the
    # block-sparse result compiled flex attention computes (tests/test_cp_mechanisms.py checks both halves)
    for block in model.visual_transformer_blocks:
        set_processor(block.self_attention, NablaAttentionProcessor(), by="example", through_setter=True)
