"""Parallel VAE decode and encode: a VAE's encoder and decoder split by rows across ranks, exactly.

Mechanism: `layout` (which rows each rank holds and needs), `conv` (halo convolutions), `norm` (group norms with
whole-image statistics), `attention` (mid-block attention over every rank's tokens), `apply` (`parallelize_vae`).
Per-VAE knowledge: `paradiff/plans/vae.py`.
"""

from .apply import is_supported, parallelize_vae, supported_vaes
from .runtime import get_vae_runtime

__all__ = ["get_vae_runtime", "is_supported", "parallelize_vae", "supported_vaes"]
