"""The causal cumulative-mean gate (docs/SPEC.md eq. 8-10), reference implementation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wiola.ops.rope import apply_rope, upcast


def gate(
    q: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    update_carry: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-query, per-head gate ``g_t = sigmoid(W2 · SiLU(W1 · c_t) + b2)``.

    Args:
        q: ``(B, T, H, D)`` queries before rotation, any float dtype.
        w1: ``(H, D)``; w2: ``(H, H)``; b2: ``(H,)``.
        cos, sin: ``(B, T, D/2)`` float32 rotation tables. When given, the gate is computed
            from rotated queries (``gate_pre_rope=False``); the head mean is rotated, which
            equals the mean of the rotated heads because the rotation is linear.
        attention_mask: ``(B, T)``, nonzero (1, True) for real tokens, 0 for padding; padding
            is left out of the running mean. Any nonzero value counts as one token, as in the
            kernel and the C++ step.
        carry: ``(sum (B, D) float32, count (B,) int64)`` from earlier chunks of the same rows.
        update_carry: write the new carry into ``carry``'s tensors (a cache's running state)
            and return those tensors.

    Returns:
        ``g`` ``(B, T, H)`` float32, and the new carry ``(sum (B, D) float32, count (B,) int64)``.
        A query with no real token at or before it (left padding) uses ``c_t = 0``.
    """
    B, T, H, D = q.shape
    m = upcast(q).mean(dim=2)  # (B, T, D): head mean, float32
    if cos is not None:
        m = apply_rope(m.unsqueeze(2), cos, sin).squeeze(2)
    if attention_mask is None:
        real = torch.ones(B, T, dtype=m.dtype, device=q.device)
    else:
        real = attention_mask.to(device=q.device, dtype=torch.bool).to(m.dtype)
        m = m * real.unsqueeze(-1)
    running = torch.cumsum(m, dim=1)  # (B, T, D), fp32
    count = torch.cumsum(real, dim=1)  # (B, T)
    if carry is not None:
        running = running + carry[0].to(m.dtype).unsqueeze(1)
        count = count + carry[1].to(m.dtype).unsqueeze(1)
    c = running / count.clamp(min=1.0).unsqueeze(-1)
    hidden = F.silu(c @ upcast(w1).t())  # (B, T, H)
    g = torch.sigmoid(hidden @ upcast(w2).t() + upcast(b2))
    total, n = running[:, -1], count[:, -1].to(torch.int64)
    return write_carry(carry, g, total, n) if update_carry else (g, total, n)


def write_carry(
    carry: tuple[torch.Tensor, torch.Tensor] | None, g: torch.Tensor, total: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``update_carry``'s end for a gate that computed the new state aside: ``total`` and
    ``count`` copied into ``carry``'s tensors; returns ``g`` and those tensors."""
    if carry is None:
        raise ValueError("gate: update_carry needs a carry")
    carry[0].copy_(total)
    carry[1].copy_(count)
    return g, carry[0], carry[1]
