"""The butterfly feed-forward block (docs/SPEC.md eq. 14-16), reference implementation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wiola.ops.linear import DecodeLayout, linear


def butterfly(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_bp: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None = None,
    layouts: tuple[DecodeLayout, DecodeLayout, DecodeLayout] | None = None,
) -> torch.Tensor:
    """``W_down (SiLU(a) ⊙ b + W_bp x)`` with ``[a ‖ b] = x W_upᵀ``, plus ``residual`` if given.

    Args:
        x: ``(..., d)``. w_up: ``(2·d_ff, d)``; w_bp: ``(d_ff, d)``; w_down: ``(d, d_ff)``.
        residual: optional ``(..., d)`` added to the output.
        layouts: optional ``decode_layout`` copies of ``(w_up, w_bp, w_down)`` for CPU decoding
            (``wiola.ops.linear.linear``); the fused kernel has no use for them.

    Returns ``(..., d)`` in the dtype of the matmuls (autocast-aware).
    """
    up, bp, down = layouts or (None, None, None)
    a, b = linear(x, w_up, up).chunk(2, dim=-1)  # (..., d_ff) each
    r = F.silu(a) * b + linear(x, w_bp, bp)
    y = linear(r, w_down, down)
    return y if residual is None else y + residual
