"""The feed-forward blocks the ablations compare with the butterfly (docs/SPEC.md, Feed-forward
variants), reference implementations. No fused kernel exists for them: both model classes run
these functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wiola.ops.linear import DecodeLayout, linear


def swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None = None,
    layouts: tuple[DecodeLayout, DecodeLayout, DecodeLayout] | None = None,
) -> torch.Tensor:
    """``W_down (SiLU(W_gate x) ⊙ W_up x)`` (Shazeer 2020), plus ``residual`` if given.

    Args:
        x: ``(..., d)``. w_gate, w_up: ``(d_ff, d)``; w_down: ``(d, d_ff)``; each may be the
            module of an adapted projection instead (``linear`` calls it).
        residual: optional ``(..., d)`` added to the output.
        layouts: optional ``decode_layout`` copies of ``(w_gate, w_up, w_down)`` for CPU decoding.

    Returns ``(..., d)`` in the dtype of the matmuls (autocast-aware).
    """
    gate, up, down = layouts or (None, None, None)
    y = linear(F.silu(linear(x, w_gate, gate)) * linear(x, w_up, up), w_down, down)
    return y if residual is None else y + residual


def gelu_mlp(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None = None,
    layouts: tuple[DecodeLayout, DecodeLayout] | None = None,
) -> torch.Tensor:
    """``W_down GELU(W_up x)`` with the exact (erf) GELU, plus ``residual`` if given.

    Args:
        x: ``(..., d)``. w_up: ``(d_ff, d)``; w_down: ``(d, d_ff)``; each may be the module of an
            adapted projection instead (``linear`` calls it).
        residual: optional ``(..., d)`` added to the output.
        layouts: optional ``decode_layout`` copies of ``(w_up, w_down)`` for CPU decoding.

    Returns ``(..., d)`` in the dtype of the matmuls (autocast-aware).
    """
    up, down = layouts or (None, None)
    y = linear(F.gelu(linear(x, w_up, up)), w_down, down)
    return y if residual is None else y + residual
