"""``x · Wᵀ`` with a CPU decoding fast path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many rows, a CPU product in inference mode uses a cached re-laid-out copy of W.
_GEMV_ROWS = 64
# From this many outputs (the tied head), the copy is split in one slice per thread.
_SPLIT_OUT = 8192


def _decode_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``(out, in)`` as ``(s, in, ⌈out/s⌉)``: ``s`` column slices of ``Wᵀ`` (zero-padded)."""
    out_features, in_features = weight.shape
    s = torch.get_num_threads() if out_features >= _SPLIT_OUT else 1
    width = -(-out_features // s)
    wt = weight.new_zeros(in_features, s * width)
    wt[:, :out_features] = weight.t()
    return wt.view(in_features, s, width).transpose(0, 1).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias); ``x`` ``(..., in)``, ``weight`` ``(out, in)``.

    Decoding a few tokens on a CPU is bound by reading the weights, and MKL's matrix-vector
    product there is slow twice over: about half the speed on the ``(out, in)`` layout that
    ``nn.Linear`` stores as on a contiguous ``(in, out)`` one, and single-threaded. So with
    gradients off, on a CPU, for at most 64 rows, the product uses a ``(in, out)`` copy kept on
    the weight tensor (rebuilt when the weight changes: version counter, storage, thread
    count), cut into one slice per thread for the tied head so that a batched product reads
    it with every core. Everywhere else this is exactly ``F.linear``.
    """
    if (
        torch.is_grad_enabled()
        or x.device.type != "cpu"
        or x.numel() > _GEMV_ROWS * x.shape[-1]
        or torch.compiler.is_compiling()
    ):
        return F.linear(x, weight)
    # Inference tensors have no version counter; the only one passed here is the fused QKV
    # matrix, which wiola.model rebuilds (a new tensor) whenever a projection changes.
    version = None if weight.is_inference() else weight._version
    stamp = (weight.data_ptr(), version, weight.dtype, torch.get_num_threads())
    cached = getattr(weight, "_wiola_t", None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, _decode_layout(weight))
        weight._wiola_t = cached
    slices = cached[1]  # (s, in, width)
    rows = x.reshape(-1, x.shape[-1])
    if slices.shape[0] == 1:
        y = rows @ slices[0]
    else:  # one batched product, one slice per thread: (s, rows, width) -> (rows, s·width)
        y = torch.bmm(rows.expand(slices.shape[0], *rows.shape), slices).transpose(0, 1).reshape(rows.shape[0], -1)
    return y[:, : weight.shape[0]].reshape(*x.shape[:-1], weight.shape[0])
