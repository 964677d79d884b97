"""RMSNorm with an optional fused residual add, reference implementation."""

from __future__ import annotations

import torch

from wiola.ops.rope import upcast


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / sqrt(mean(x²) + eps) ⊙ γ`` over the last dimension, statistics in float32.

    With ``residual``, first forms ``h = x + residual`` and returns ``(rms_norm(h), h)``: the
    normalised output and the updated residual stream. Outputs keep the dtype of ``x + residual``.
    """
    h = x if residual is None else x + residual
    hf = upcast(h)
    y = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps) * upcast(weight)
    y = y.to(h.dtype)
    return y if residual is None else (y, h)
