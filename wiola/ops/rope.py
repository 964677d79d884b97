"""Helical rotary position encoding (docs/SPEC.md eq. 4-7), rotate-half pair layout."""

from __future__ import annotations

import math

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 if it already is: the precision of every reduction here."""
    return x if x.dtype == torch.float64 else x.float()


def helix_frequencies(
    head_dim: int, base: float = 10000.0, alpha: float = 0.05, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-pair angular frequencies ``θ̃_i = base^(-2i/d_h) · (1 + α·sqrt(i+1)/sqrt(d_h/2))``.

    Returns a tensor of shape ``(head_dim // 2,)`` (float32 by default). ``alpha = 0`` gives
    standard RoPE.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    theta = base ** (-2.0 * i / head_dim)
    phi = 1.0 + alpha * torch.sqrt(i + 1.0) / math.sqrt(half)
    return (theta * phi).to(dtype)


def positions_from_mask(
    attention_mask: torch.Tensor | None, batch: int, seq_len: int, offset=0, device: torch.device | None = None
) -> torch.Tensor:
    """Position of each token = number of real tokens before it in its row (``(B, T)`` int64).

    ``offset`` (int or ``(B,)`` tensor) is the number of real tokens already seen, e.g. in a
    decoding cache. Padding tokens get the position of the next real token (clamped; their
    value never matters because they are masked as keys and ignored as queries). ``device``:
    where to build positions without a mask (no host-to-device copy, which CUDA graphs cannot
    capture and which synchronises).
    """
    if attention_mask is None:
        pos = torch.arange(seq_len, dtype=torch.int64, device=device).expand(batch, seq_len)
    else:
        m = attention_mask.to(torch.int64)
        pos = torch.cumsum(m, dim=1) - m  # exclusive count of real tokens before t
    if isinstance(offset, torch.Tensor):
        pos = pos.to(offset.device) + offset.to(torch.int64).view(-1, 1)
    elif offset:
        pos = pos + offset
    return pos


def rope_tables(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of ``Θ = positions · freqs`` in ``freqs``' dtype (float32 for every
    model but a float64 one), each ``(B, T, D/2)``."""
    dtype = upcast(freqs).dtype
    angles = positions.to(dtype).unsqueeze(-1) * freqs.to(positions.device, dtype)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, T, H, D)`` with ``cos, sin`` of shape ``(B, T, D/2)``.

    Pair ``i`` is ``(x_i, x_{i+D/2})``; the rotation is done in float32 (float64 for float64
    input) and the result is cast back to ``x.dtype``.
    """
    half = x.shape[-1] // 2
    xf = upcast(x)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, T, 1, D/2), broadcast over heads
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)
