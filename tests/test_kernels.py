"""Local attention kernels: output and log-sum-exp against the math reference, and the LSE merge."""

from __future__ import annotations

import re

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


# ----------------------------------------------------------------------------------------------------------------
# One backend interface (paradiff/attention/): every backend against the reference, or refused with the reason


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_matches_the_math_reference_or_says_why_it_cannot_run(name):
    backend = BACKENDS[name]
    q, k, v = _qkv()
    mask = _mask()
    reason = backend.supports(q.device, q.dtype, mask=True, needs_lse=backend.returns_lse, head_dim=q.shape[-1])
    if reason is not None:  # on this machine: named, with the reason and the backends that can
        with pytest.raises(ParallelConfigError, match=f"Attention backend '{name}' cannot run here: it "
                                                      f"{re.escape(reason)}; backends that can: \\[.*'math'"):
            backend.attend(q, k, v, mask, 0.25, return_lse=backend.returns_lse)
        return
    expected, expected_lse = math_attention(q, k, v, mask, 0.25)
    if backend.returns_lse:
        out, lse = backend.attend(q, k, v, mask, 0.25, return_lse=True)
        torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)
    else:
        out = backend.attend(q, k, v, mask, 0.25)
        with pytest.raises(ParallelConfigError, match=f"'{name}' cannot run here: it returns no log-sum-exp"):
            backend.attend(q, k, v, mask, 0.25, return_lse=True)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_supports_says_what_each_backend_cannot_do():
    assert BACKENDS["math"].supports("cpu", torch.float64, mask=True, needs_lse=True, head_dim=512) is None
    assert BACKENDS["sdpa"].supports(needs_lse=True) == "returns no log-sum-exp"
    flash = BACKENDS["sdpa-flash"]  # CPU and CUDA: its CUDA limits are checked on any machine
    assert flash.supports("cuda", torch.float32) == "takes float16, bfloat16 on CUDA, not float32"
    assert flash.supports("cuda", torch.bfloat16, mask=True) == "takes no attention mask on CUDA"
    assert flash.supports("cuda", torch.bfloat16, head_dim=512) == "takes heads of up to 256 channels on CUDA, not 512"
    assert flash.supports("cpu", torch.float32, mask=True, head_dim=512) is None
    assert BACKENDS["flex"].supports("mps") == "runs on cpu or cuda only, not mps"
    if not torch.cuda.is_available():
        assert BACKENDS["sdpa-cudnn"].available() == "needs a CUDA device"
        with pytest.raises(ParallelConfigError, match="'sdpa-efficient' is not available here \\(needs a CUDA device\\)"):
            check_backend("sdpa-efficient", "ulysses")
    assert set(available_backends()) >= {"native", "math", "sdpa", "sdpa-flash", "flex"}


def test_a_backend_that_cannot_serve_a_cp_call_is_refused_before_any_collective():
    """attend() checks the backend against the call first: with no process group at all, any collective would fail
    otherwise."""
    from paradiff.context_parallel.dispatch import attend

    q, k, v = _qkv()
    with pytest.raises(ParallelConfigError, match="'sdpa' cannot run here: it returns no log-sum-exp; backends that "
                                                  "can: \\['native', 'math'"):
        attend(q, k, v, None, 0.25, "ring", "sdpa", False, None, None, None)
    if not torch.cuda.is_available():
        with pytest.raises(ParallelConfigError, match="'sdpa-cudnn' cannot run here: it needs a CUDA device"):
            attend(q, k, v, None, 0.25, "ulysses", "sdpa-cudnn", False, None, None, None)


@pytest.mark.parametrize("call", ["heads", "tokens", "causal", "grouped", "bias"])
def test_the_route_gives_what_sdpa_gives_for_each_way_of_calling_it(call):
    """Without CP, a model's SDPA calls reach the backend through `sdpa_call`, in every form SDPA takes."""
    from paradiff.attention.route import sdpa_call

    q, k, v = _qkv(keys=7)
    kwargs = {}
    if call == "tokens":  # (batch, tokens, dim): no head dim, a (queries, keys) mask
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        kwargs = {"attn_mask": torch.rand(7, 7, generator=torch.Generator().manual_seed(1)) > 0.3}
        kwargs["attn_mask"][:, 0] = True
    elif call == "causal":
        kwargs = {"is_causal": True}
    elif call == "grouped":
        k, v = k[:, :1], v[:, :1]
        kwargs = {"enable_gqa": True}
    elif call == "bias":
        kwargs = {"attn_mask": torch.randn(1, 3, 7, 7, generator=torch.Generator().manual_seed(2)), "scale": 0.3}
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(sdpa_call(BACKENDS["math"], q, k, v, **kwargs), expected, atol=1e-5, rtol=1e-5)


def test_a_kernel_traces_into_one_graph_for_a_compiled_model_without_cp():
    """Without CP the backend runs inside the compiled blocks (paradiff.compile, fullgraph): no data-dependent branch,
    and a row with every key masked still gives zeros."""
    q, k, v = _qkv(batch=1)
    mask = torch.ones(1, 1, 7, 11, dtype=torch.bool)
    mask[0, 0, 3] = False
    compiled = torch.compile(lambda *args: BACKENDS["math"](*args), fullgraph=True, backend="eager")
    out, lse = compiled(q, k, v, mask, 0.25)
    expected, expected_lse = math_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3])) and torch.isneginf(lse[0, :, 3]).all()
