"""Attention of new tokens over a static decoding cache, reference implementation."""

from __future__ import annotations

import torch

from wiola.ops.attention import gated_attention
from wiola.ops.rope import apply_rope


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_mask: torch.Tensor,
    start: int,
    *,
    unpadded: bool = False,
) -> torch.Tensor:
    """Write the new tokens into one layer's cache and attend over everything cached.

    Args:
        q, k, v: ``(B, T, H, D)`` projections of the new tokens, not yet rotated.
        g: ``(B, T, H)`` float32 gate of the new tokens.
        cos, sin: ``(B, T, D/2)`` float32 rotation tables at the new tokens' positions.
        k_cache, v_cache: ``(B, H, S, D)`` one layer's buffers; slots ``[start, start + T)``
            are overwritten with the rotated keys and the values.
        key_mask: ``(B, S)`` bool, already True for the new tokens that are real.
        start: the slot of the first new token.
        unpadded: True when the caller gave no ``attention_mask`` (every new token is real).
            A hint for fused implementations, which may then skip masking a prefill; the
            result is the same either way, and this reference reads ``key_mask`` regardless.

    Returns ``(B, T, H, D)`` in ``q.dtype``, equal to what the full-sequence pass gives at
    those positions.
    """
    T = q.shape[1]
    end = start + T
    k_cache[:, :, start:end] = apply_rope(k, cos, sin).transpose(1, 2).to(k_cache.dtype)
    v_cache[:, :, start:end] = v.transpose(1, 2).to(v_cache.dtype)
    keys = k_cache[:, :, :end].transpose(1, 2)  # (B, end, H, D)
    values = v_cache[:, :, :end].transpose(1, 2)
    return gated_attention(apply_rope(q, cos, sin), keys, values, g, key_mask[:, :end], q_start=start)
