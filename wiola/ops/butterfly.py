"""The butterfly feed-forward block (SPEC.md eq. 14-16), reference implementation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wiola.ops.linear import linear


def butterfly(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_bp: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W_down (SiLU(a) ⊙ b + W_bp x)`` with ``[a ‖ b] = x W_upᵀ``, plus ``residual`` if given.

    Args:
        x: ``(..., d)``. w_up: ``(2·d_ff, d)``; w_bp: ``(d_ff, d)``; w_down: ``(d, d_ff)``.
        residual: optional ``(..., d)`` added to the output.

    Returns ``(..., d)`` in the dtype of the matmuls (autocast-aware).
    """
    a, b = linear(x, w_up).chunk(2, dim=-1)  # (..., d_ff) each
    r = F.silu(a) * b + linear(x, w_bp)
    y = linear(r, w_down)
    return y if residual is None else y + residual
