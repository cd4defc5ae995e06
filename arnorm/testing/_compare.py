"""Distances between a result and the reference, in the units the numerics contract uses."""

from __future__ import annotations

from typing import Any

__all__ = ["ulp_distance"]


def ulp_distance(a: Any, b: Any) -> int:
    """Largest distance in units in the last place between two tensors of one float dtype.

    Bit patterns are mapped to a monotonic integer line (sign-magnitude to two's complement), so
    neighbours across zero are one apart and ``+0`` and ``-0`` coincide.
    """
    import torch

    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    ia, ib = a.contiguous().view(bits).long(), b.contiguous().view(bits).long()
    top = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + top), ia)
    ib = torch.where(ib < 0, -(ib + top), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0
