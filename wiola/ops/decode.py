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
    queries: int | None = None,
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
        queries: attend with the last ``queries`` new tokens only (``1 ≤ queries ≤ T``; None:
            all); every new token's key and value is still written. What a forward that keeps
            the last positions' logits needs of its last layer.

    Returns ``(B, T, H, D)`` (``(B, queries, H, D)``) in ``q.dtype``, equal to what the
    full-sequence pass gives at those positions.
    """
    T = q.shape[1]
    end = start + T
    n = check_queries(queries, T)
    k_cache[:, :, start:end] = apply_rope(k, cos, sin).transpose(1, 2).to(k_cache.dtype)
    v_cache[:, :, start:end] = v.transpose(1, 2).to(v_cache.dtype)
    keys = k_cache[:, :, :end].transpose(1, 2)  # (B, end, H, D)
    values = v_cache[:, :, :end].transpose(1, 2)
    q_rot = apply_rope(q[:, T - n :], cos[:, T - n :], sin[:, T - n :])
    return gated_attention(q_rot, keys, values, g[:, T - n :], key_mask[:, :end], q_start=end - n)


def check_queries(queries: int | None, T: int) -> int:
    """How many of ``T`` new tokens attend (``decode_attention``'s ``queries``; None: all);
    ``ValueError`` for anything but an int from 1 to ``T``."""
    n = T if queries is None else queries
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= T:
        raise ValueError(f"queries={queries!r}: the last queries to attend must be an int from 1 to T={T}")
    return n
