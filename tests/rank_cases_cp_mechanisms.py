"""Run on every rank by tests/test_cp_mechanisms.py: the CP runtime's mask handling against single-process torch."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paradiff.context_parallel.attention import local_chunk
from paradiff.context_parallel.runtime import ContextParallelRuntime


def _runtime(mode: str) -> ContextParallelRuntime:
    world = dist.group.WORLD
    return ContextParallelRuntime(mode=mode, cp_group=world, ring_group=world if mode == "ring" else None,
                                  ulysses_group=world if mode == "ulysses" else None)


def _qkv(batch=2, heads=2, tokens=11, dim=8):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, tokens, dim, generator=generator) for _ in range(3)]


def padding_mask_attention(mode: str) -> float:
    """A (batch, 1, tokens, tokens) mask valid[q] & valid[k]: the sequence-split result equals SDPA's on the full
    sequence, including the zero rows of padded queries."""
    q, k, v = _qkv()
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[0, 4:6] = False
    valid[1, -3:] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, :, None] & valid[:, None, None, :])
    runtime = _runtime(mode)
    rank, size = runtime.cp_rank, runtime.cp_size
    local = [local_chunk(t, 2, rank, size) for t in (q, k, v)]
    local_valid = local_chunk(valid, 1, rank, size)
    out = runtime.attention(*local, attn_mask=local_valid[:, None, :, None] & local_valid[:, None, None, :])
    return float((out - local_chunk(expected, 2, rank, size)).abs().max())


def causal_mask_is_refused(mode: str) -> str:
    q, k, v = _qkv()
    runtime = _runtime(mode)
    local = [local_chunk(t, 2, runtime.cp_rank, runtime.cp_size) for t in (q, k, v)]
    causal = torch.ones(local[0].shape[2], local[0].shape[2], dtype=torch.bool).tril()[None, None]
    try:
        runtime.attention(*local, attn_mask=causal.expand(2, 1, -1, -1))
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


def local_attention_with_any_mask(mode: str) -> float:
    """Replicated keys (cross-attention) with a per-head (batch, heads, queries, keys) additive mask: as plain SDPA."""
    q, k, v = _qkv()
    generator = torch.Generator().manual_seed(1)
    mask = torch.randn(2, 2, 11, 11, generator=generator).clamp(max=0) * 1000
    runtime = _runtime(mode)
    local_q = local_chunk(q, 2, runtime.cp_rank, runtime.cp_size)
    local_mask = local_chunk(mask, 2, runtime.cp_rank, runtime.cp_size)
    out = runtime.attention(local_q, k, v, attn_mask=local_mask, local=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return float((out - local_chunk(expected, 2, runtime.cp_rank, runtime.cp_size)).abs().max())


def cross_attention_between_split_sequences(mode: str) -> float:
    """Queries of one split sequence attend keys of another (LTX-2's video <-> audio), with a key mask on the
    second: equal to SDPA on both whole sequences."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 11, 8, generator=generator)
    k, v = (torch.randn(2, 4, 6, 8, generator=generator) for _ in range(2))
    key_valid = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    key_valid[1, ..., -2:] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid)
    runtime = _runtime(mode)
    rank, size = runtime.cp_rank, runtime.cp_size
    out = runtime.attention(local_chunk(q, 2, rank, size), local_chunk(k, 2, rank, size),
                            local_chunk(v, 2, rank, size), attn_mask=local_chunk(key_valid, 3, rank, size))
    return float((out - local_chunk(expected, 2, rank, size)).abs().max())


def gathered_pieces_and_model_outputs() -> dict:
    """runtime.gathered over uneven pieces (rank r holds r + 2 rows), and a ModelOutput gathered by position."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    from paradiff.context_parallel.apply import _output_gatherer

    runtime = _runtime("ulysses")
    rank, size = runtime.cp_rank, runtime.cp_size
    full = torch.arange(2 * sum(r + 2 for r in range(size)) * 3, dtype=torch.float32).view(2, -1, 3)
    start = sum(r + 2 for r in range(rank))
    local = full[:, start:start + rank + 2]
    whole, where = runtime.gathered(local, 1)
    output = _output_gatherer({0: 1}, runtime)(None, None, Transformer2DModelOutput(sample=local.clone()))
    return {"equal": torch.equal(whole, full), "start": where, "expected_start": start,
            "model_output": type(output).__name__, "sample_equal": torch.equal(output.sample, full)}


def split_linear_recurrence(steps: int) -> dict:
    """S_t = S_{t-1} W_t + U_t forwards and backwards over `steps` steps split unevenly over the ranks: each rank's
    states from its incoming state equal the single-process scan's."""
    from paradiff.context_parallel.attention import even_sizes
    from paradiff.context_parallel.scan import compose, incoming_state

    runtime = _runtime("ulysses")
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(2, steps, 4, 4, generator=generator, dtype=torch.float64) * 0.4
    updates = torch.randn(2, steps, 3, 4, generator=generator, dtype=torch.float64)

    def scan(state, order):
        states = {}
        for step in order:
            state = state @ weights[:, step] + updates[:, step]
            states[step] = state
        return states

    expected_fwd, expected_bwd = scan(torch.zeros(2, 3, 4, dtype=torch.float64), range(steps)), scan(
        torch.zeros(2, 3, 4, dtype=torch.float64), range(steps - 1, -1, -1))
    sizes = even_sizes(steps, runtime.cp_size)
    start = sum(sizes[: runtime.cp_rank])
    mine = range(start, start + sizes[runtime.cp_rank])
    worst = 0.0
    for reverse, expected in ((False, expected_fwd), (True, expected_bwd)):
        local_w, local_u = weights[:, mine.start:mine.stop], updates[:, mine.start:mine.stop]
        if reverse:
            local_w, local_u = local_w.flip(1), local_u.flip(1)
        state = incoming_state(*compose(local_w, local_u, 1), runtime, reverse=reverse)
        got = scan(state, reversed(mine) if reverse else mine)
        worst = max(worst, max(float((got[s] - expected[s]).abs().max()) for s in mine))
    return {"diff": worst, "steps": len(mine)}


def ranks_given_different_lengths(mode: str) -> str:
    """A FLUX transformer under CP called with a 3 x 5 latent grid on rank 0 and 4 x 5 on rank 1: every rank raises
    (before, each split its own sequence and the gather joined pieces of both: a wrong output, silently)."""
    import paradiff
    from paradiff.errors import DistributedError
    from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward

    model = build_model("flux")
    config = paradiff.ContextParallelConfig(ring_degree=2) if mode == "ring" else \
        paradiff.ContextParallelConfig(ulysses_degree=2)
    paradiff.enable_parallelism(model, config)
    inputs = make_inputs("flux", model.config, lengths=Lengths(3 + dist.get_rank(), 5, 7))
    try:
        run_forward(model, inputs)
    except DistributedError as exc:
        return str(exc)
    return "no error"
