"""Row layouts of a split VAE (pure arithmetic): every rank's rows, kept rows and halo windows, checked against a
whole-image convolution for random geometries and random splits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paradiff.vae.layout import ConvRows, plan_halo, ranges_from_heights, split_rows


def test_split_rows_whole_units_and_remainder_last():
    assert split_rows(34, 2, 8) == [(0, 16), (16, 34)]  # 4 whole units of 8, 2 leftover rows to the last rank
    assert split_rows(34, 4, 8) == [(0, 8), (8, 16), (16, 24), (24, 34)]
    assert split_rows(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert split_rows(20, 4, 4) == [(0, 8), (8, 12), (12, 16), (16, 20)]


def test_strided_conv_halves_an_aligned_split():
    # Downsample2D: pad one row at the bottom, 3 rows, stride 2
    conv = ConvRows(extent=3, stride=2, pad_top=0, pad_bottom=1)
    assert conv.out_ranges([(0, 8), (8, 18)], 18) == [(0, 4), (4, 9)]
    plan = plan_halo(conv, [8, 10], rank=0)
    assert plan.mine.keep == (0, 3) and plan.mine.fixes == ((3, 4),)  # only the last row reads the next rank
    assert plan.receives == ((1, (8, 9)),) and plan.sends == ()


def _pad(x: torch.Tensor, top: int, bottom: int, mode: str) -> torch.Tensor:
    if not (top or bottom):
        return x
    return F.pad(x, (top, bottom), mode="replicate" if mode == "replicate" else "constant")


@settings(max_examples=150, deadline=None)
@given(
    extent=st.integers(1, 5), stride=st.integers(1, 3), own=st.integers(0, 2), pre_top=st.integers(0, 2),
    pre_bottom=st.integers(0, 2), mode=st.sampled_from(["constant", "replicate"]),
    heights=st.lists(st.integers(1, 9), min_size=2, max_size=4),
)
def test_kept_rows_are_exact_and_windows_are_covered(extent, stride, own, pre_top, pre_bottom, mode, heights):
    """A 1-D convolution over rows (the height as the last axis) split by `heights`:
    - the output rows partition the whole output in rank order;
    - the rows a rank keeps from its local convolution equal the whole convolution's;
    - every row a fix reads is the rank's own or received, and what a rank receives is what its peer sends."""
    height = sum(heights)
    conv = ConvRows(extent=extent, stride=stride, pad_top=pre_top + own, pad_bottom=pre_bottom + own)
    if conv.out_height(height) < 1:
        return
    x = torch.randn(1, 1, height, dtype=torch.float64)
    weight = torch.randn(1, 1, extent, dtype=torch.float64)
    whole = F.conv1d(_pad(x, pre_top, pre_bottom, mode), weight, stride=stride, padding=own)
    in_ranges = ranges_from_heights(heights)
    plans = [plan_halo(conv, heights, rank) for rank in range(len(heights))]
    assert tuple(p.mine.out_rows for p in plans) == plans[0].out_ranges
    starts = [first for first, _ in plans[0].out_ranges]
    assert starts[0] == 0 and plans[0].out_ranges[-1][1] == whole.shape[-1]
    assert all(a[1] == b[0] for a, b in zip(plans[0].out_ranges, plans[0].out_ranges[1:]))
    for rank, plan in enumerate(plans):
        start, stop = in_ranges[rank]
        mine = plan.mine
        if mine.local_out:
            local = F.conv1d(_pad(x[..., start:stop], pre_top, pre_bottom, mode), weight, stride=stride, padding=own)
            assert local.shape[-1] == mine.local_out
            kept = local[..., mine.keep[0] - mine.local_first: mine.keep[1] - mine.local_first]
            # Exact up to a few float64 ulps: the local and the whole convolution have different lengths, and oneDNN
            # may pick a different kernel (another summation order) for each, and even between two calls of one
            # shape; seen: 2.2e-16 on values of order 1. A wrong row is off by O(1), far outside this bound.
            ulps = 4 * torch.finfo(torch.float64).eps * float(x.abs().max() * weight.abs().sum())
            torch.testing.assert_close(kept, whole[..., mine.keep[0]:mine.keep[1]], rtol=0, atol=ulps)
        available = set(range(start, stop))
        for peer, (low, high) in plan.receives:
            assert (rank, (low, high)) in plans[peer].sends
            available |= set(range(low, high))
        for fix in mine.fixes:
            low, high = conv.reads(*fix)
            assert set(range(max(low, 0), min(high, height))) <= available
        pieces = sorted([mine.keep] * (mine.keep[0] < mine.keep[1]) + list(mine.fixes))
        assert sum(high - low for low, high in pieces) == mine.out_rows[1] - mine.out_rows[0]
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert not pieces or (pieces[0][0], pieces[-1][1]) == mine.out_rows
