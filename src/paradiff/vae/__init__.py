"""Parallel VAE decode and encode: a VAE's encoder and decoder split by rows across ranks, exactly.

Mechanism: `layout` (which rows each rank holds and needs), `conv` (halo convolutions), `norm` (group norms with
whole-image statistics), `attention` (mid-block attention over every rank's tokens), `apply` (`split_vae`, given a plan).
Per-VAE knowledge: `paradiff/plans/vae.py`, which `paradiff.parallelize_vae` (`paradiff/vae_api.py`) hands in.
"""

from paradiff.vae.apply import split_vae
from paradiff.vae.runtime import get_vae_runtime

__all__ = ["get_vae_runtime", "split_vae"]
