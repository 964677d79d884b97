"""Cross-entropy of a linear head, reference implementation (materialises the logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wiola.ops.rope import upcast


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``logits = h · weightᵀ`` against ``labels`` in float32.

    Args:
        h: ``(N, d)`` hidden states; weight: ``(V, d)``; labels: ``(N,)`` integer targets,
            ``ignore_index`` marks rows that do not count.

    Returns a float32 scalar: the sum of the per-row losses over the counted rows divided by
    their number. When every row is ignored the loss is defined as ``0.0`` (with zero
    gradients) instead of ``0/0``.
    """
    logits = upcast(F.linear(h, weight))
    total = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum().clamp(min=1)
    return total / count
