"""Local attention kernels: output and log-sum-exp against the math reference, and the LSE merge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paradiff.context_parallel.kernels import (
    BACKENDS,
    RETURNS_LSE,
    available_backends,
    check_backend,
    math_attention,
    aligned_bias,
    merge_lse,
)
from paradiff.errors import ParallelConfigError


def _qkv(batch=2, heads=3, queries=7, keys=11, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = lambda s: torch.randn(batch, heads, s, dim, generator=generator)  # noqa: E731
    return shape(queries), shape(keys), shape(keys)


def _mask(batch=2, keys=11):
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    mask[0, ..., -3:] = False
    return mask


@pytest.mark.parametrize("masked", [False, True])
def test_math_reference_matches_torch_sdpa(masked):
    q, k, v = _qkv()
    mask = _mask() if masked else None
    out, lse = math_attention(q, k, v, mask, q.shape[-1] ** -0.5)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["native", "sdpa"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_math(backend, masked, dtype):
    q, k, v = (t.to(dtype) for t in _qkv())
    mask = _mask() if masked else None
    scale = q.shape[-1] ** -0.5
    out, lse = BACKENDS[backend](q, k, v, mask, scale)
    ref_out, ref_lse = math_attention(q, k, v, mask, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out, atol=tolerance, rtol=tolerance)
    if RETURNS_LSE[backend]:
        torch.testing.assert_close(lse, ref_lse, atol=tolerance, rtol=tolerance)
    else:
        assert lse is None


@pytest.mark.parametrize("backend", ["native", "sdpa"])
def test_backend_reads_features_strided_in_memory(backend):
    # heads cut from a channels-first activation (Cosmos' VAE attention at batch 1): the features are the
    # outermost dim in memory, stride(-1) != 1; the fused CPU kernel read other memory for them
    q, k, v = (t.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0) for t in _qkv())
    assert q.stride(-1) != 1
    mask, scale = _mask(), q.shape[-1] ** -0.5
    out, _ = BACKENDS[backend](q, k, v, mask, scale)
    ref_out, _ = math_attention(q.contiguous(), k.contiguous(), v.contiguous(), mask, scale)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-5, rtol=1e-5)


def _query_masks(batch=2, heads=3, queries=7, keys=11):
    """Query-dependent masks: a bool (batch, 1, q, k) mask and a per-head additive bias with -inf entries, one row of
    each fully masked."""
    generator = torch.Generator().manual_seed(5)
    boolean = torch.rand(batch, 1, queries, keys, generator=generator) > 0.4
    boolean[..., 0] = True
    boolean[0, 0, 2] = False
    bias = torch.randn(batch, heads, queries, keys, generator=generator)
    bias = bias.masked_fill(torch.rand(bias.shape, generator=generator) < 0.3, float("-inf"))
    bias[..., 1] = 0.0
    bias[1, 2, 4] = float("-inf")
    return {"bool": boolean, "bias": bias}


@pytest.mark.parametrize("backend", ["native", "math", "sdpa"])
@pytest.mark.parametrize("kind", ["bool", "bias"])
def test_query_dependent_masks_and_biases(backend, kind):
    q, k, v = _qkv()
    mask = _query_masks()[kind]
    out, lse = BACKENDS[backend](q, k, v, mask, 0.25)
    live = (mask.any(-1) if kind == "bool" else ~torch.isneginf(mask).all(-1)).expand(2, 3, 7)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out[live], expected[live], atol=1e-5, rtol=1e-5)
    if RETURNS_LSE[backend]:  # ours: fully masked rows give zeros and lse = -inf, neutral in a merge
        assert torch.equal(out[~live], torch.zeros_like(out[~live])) and (~live).any()
        scores = (q @ k.transpose(-1, -2)) * 0.25
        scores = scores.masked_fill(~mask, float("-inf")) if kind == "bool" else scores + mask
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _qkv(batch=1)
    mask = torch.zeros(1, 1, 1, k.shape[2], dtype=torch.bool)
    for backend in ("native", "math"):
        out, lse = BACKENDS[backend](q, k, v, mask, 0.25)
        assert torch.isneginf(lse).all(), backend
        assert torch.equal(out, torch.zeros_like(out)), backend


@pytest.mark.parametrize("cuts", [[11], [4, 7], [1, 5, 0, 5], [3, 3, 3, 2]])
def test_merging_blocks_equals_full_attention(cuts):
    q, k, v = _qkv()
    mask = _mask()
    scale = 0.25
    out = lse = None
    start = 0
    for length in cuts:
        block = slice(start, start + length)
        start += length
        if length == 0:
            continue
        block_out, block_lse = math_attention(q, k[:, :, block], v[:, :, block], mask[..., block], scale)
        out, lse = merge_lse(out, lse, block_out, block_lse)
    full_out, full_lse = math_attention(q, k, v, mask, scale)
    torch.testing.assert_close(out, full_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)


def test_merge_with_an_all_masked_block_is_neutral():
    q, k, v = _qkv(batch=1)
    out, lse = math_attention(q, k, v, None, 0.25)
    dead_out, dead_lse = math_attention(q, k, v, torch.zeros(1, 1, 1, k.shape[2], dtype=torch.bool), 0.25)
    merged_out, merged_lse = merge_lse(out, lse, dead_out, dead_lse)
    torch.testing.assert_close(merged_out, out)
    torch.testing.assert_close(merged_lse, lse)
    both_dead = merge_lse(dead_out, dead_lse, dead_out, dead_lse)
    assert not torch.isnan(both_dead[0]).any() and torch.isneginf(both_dead[1]).all()


def test_backend_checks():
    assert {"native", "math", "sdpa"} <= set(available_backends())
    check_backend("math", "ring")
    check_backend("sdpa", "ulysses")
    with pytest.raises(ParallelConfigError, match="'sdpa' returns no log-sum-exp.*unified"):
        check_backend("sdpa", "unified")
    with pytest.raises(ParallelConfigError, match="Unknown attention backend 'xformers'"):
        check_backend("xformers", "ring")
    if "flash" not in available_backends():
        with pytest.raises(ParallelConfigError, match="'flash' is not available here"):
            check_backend("flash", "ring")


def test_a_mask_bias_is_handed_to_cuda_kernels_with_aligned_strides():
    """CUDA's memory-efficient attention refuses a bias whose strides (but the last) are not multiples of 8 (found
    on an H200 with 131 keys); the bias keeps its values and shape, as a view into padded rows."""
    bias = torch.randn(2, 1, 7, 131)
    aligned = aligned_bias(bias)
    assert aligned.shape == bias.shape and torch.equal(aligned, bias)
    assert all(stride % 16 == 0 for stride in aligned.stride()[:-1]) and aligned.stride(-1) == 1
    assert aligned_bias(torch.zeros(2, 1, 1, 32)).stride() == (32, 32, 32, 1)
