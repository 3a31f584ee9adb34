"""A counter-based 32-bit hash: random numbers as pure functions of a seed and an index, with
no generator state, so that every rank, layout and `opttx.stacked` slice computes the same
numbers (Dion's starting factor, `opttx.transforms.dion`; PSGD-Kron's probes,
`opttx.transforms.kron`).
"""

from __future__ import annotations

import torch

__all__ = ["hash32"]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` below 2^32 and a 32-bit ``c``, in 16-bit halves of
    ``c`` so that no product leaves int64's range."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 tensors, computed below 2^32 (no
    product overflows).

    Example:
      >>> h = hash32(torch.arange(3))    # int64 values in [0, 2**32)
    """
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
