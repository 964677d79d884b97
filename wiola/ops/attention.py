"""Gated helical attention (docs/SPEC.md eq. 11-13), reference implementation that materialises
the scores. It is the oracle for ``kernels/attention.py`` and the CPU path of the model."""

from __future__ import annotations

import math

import torch

from wiola.ops.rope import apply_rope, upcast


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    q_start: int = 0,
) -> torch.Tensor:
    """Causal softmax attention with the per-query, per-head gate inside the softmax.

    Args:
        q: ``(B, Tq, H, D)`` rotated queries; query ``t`` sits at key slot ``q_start + t``.
        k, v: ``(B, S, H, D)`` rotated keys and values, ``S >= q_start + Tq``.
        g: ``(B, Tq, H)`` gate, float32.
        key_mask: ``(B, S)``, nonzero for real keys.

    Returns ``(B, Tq, H, D)`` in ``q.dtype``; scores and softmax in float32. A query with no
    real key at or before it (a left-padding position) returns zeros.
    """
    B, Tq, H, D = q.shape
    S = k.shape[1]
    qh, kh, vh = (upcast(t).transpose(1, 2) for t in (q, k, v))  # (B, H, ·, D)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(D)  # (B, H, Tq, S)
    scores = scores * upcast(g).transpose(1, 2).unsqueeze(-1)  # gate g_t^(h) scales row t of head h
    t = torch.arange(Tq, device=q.device).view(-1, 1) + q_start
    s = torch.arange(S, device=q.device).view(1, -1)
    allowed = (s <= t).view(1, 1, Tq, S)
    if key_mask is not None:
        allowed = allowed & key_mask.to(device=q.device, dtype=torch.bool).view(B, 1, 1, S)
    has_key = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~(allowed | ~has_key), float("-inf"))
    p = torch.softmax(scores, dim=-1) * has_key
    return (p @ vh).transpose(1, 2).to(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-sequence gated helical attention.

    Args:
        q, k, v: ``(B, T, H, D)`` projections, not yet rotated (any strides).
        g: ``(B, T, H)`` float32 gate.
        cos, sin: ``(B, T, D/2)`` float32 rotation tables of each token's position.
        attention_mask: ``(B, T)``, 1 for real tokens, 0 for padding keys.

    Returns ``o`` of shape ``(B, T, H, D)`` in the input dtype.
    """
    return gated_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, g, attention_mask)
