"""``x · Wᵀ`` with a CPU decoding fast path through a re-laid-out copy of ``W``."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# Up to this many rows, a CPU product in inference mode may read a re-laid-out copy of W.
_GEMV_ROWS = 64
# From this many outputs (the tied head), the copy is split in one slice per thread.
_SPLIT_OUT = 8192


class DecodeLayout(NamedTuple):
    """``W`` ``(out, in)`` as ``(s, in, ⌈out/s⌉)``: ``s`` column slices of ``Wᵀ`` (zero-padded)."""

    slices: torch.Tensor
    out_features: int


def decode_layout(weight: torch.Tensor) -> DecodeLayout:
    """The copy of ``weight`` that ``linear`` reads when decoding on a CPU. It depends on the
    thread count (one slice per thread for the tied head): key a cache of it on that too."""
    out_features, in_features = weight.shape
    s = torch.get_num_threads() if out_features >= _SPLIT_OUT else 1
    width = -(-out_features // s)
    wt = weight.new_zeros(in_features, s * width)
    wt[:, :out_features] = weight.t()
    return DecodeLayout(wt.view(in_features, s, width).transpose(0, 1).contiguous(), out_features)


def uses_decode_layout(x: torch.Tensor) -> bool:
    """Whether ``linear(x, W, layout)`` reads ``layout``: a CPU product of at most 64 rows with
    gradients off, not while tracing."""
    return (
        not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.numel() <= _GEMV_ROWS * x.shape[-1]
        and not torch.compiler.is_compiling()
    )


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts matmul inputs to on ``x``'s device, or None outside autocast."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def linear(x: torch.Tensor, weight: torch.Tensor, layout: DecodeLayout | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias); ``x`` ``(..., in)``, ``weight`` ``(out, in)``.

    Decoding a few tokens on a CPU is bound by reading the weights, and MKL's matrix-vector
    product there is slow twice over: about half the speed on the ``(out, in)`` layout that
    ``nn.Linear`` stores as on a contiguous ``(in, out)`` one, and single-threaded. So when
    ``layout`` (``decode_layout(weight)``, kept by the caller) is given and
    ``uses_decode_layout(x)``, the product reads it instead, cut into one slice per thread for
    the tied head so that a batched product reads it with every core. Everywhere else this is
    exactly ``F.linear``.
    """
    if layout is None or not uses_decode_layout(x):
        return F.linear(x, weight)
    slices = layout.slices  # (s, in, width)
    rows = x.reshape(-1, x.shape[-1])
    if slices.shape[0] == 1:
        y = rows @ slices[0]
    else:  # one batched product, one slice per thread: (s, rows, width) -> (rows, s·width)
        y = torch.bmm(rows.expand(slices.shape[0], *rows.shape), slices).transpose(0, 1).reshape(rows.shape[0], -1)
    return y[:, : layout.out_features].reshape(*x.shape[:-1], layout.out_features)
