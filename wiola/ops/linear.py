"""``x · Wᵀ`` with a CPU decoding fast path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many rows, a CPU product in inference mode uses a cached (in, out) copy of W.
_GEMV_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias); ``x`` ``(..., in)``, ``weight`` ``(out, in)``.

    Decoding a few tokens on a CPU is bound by reading the weights, and MKL's matrix-vector
    product is about twice as fast on a contiguous ``(in, out)`` matrix as on the ``(out, in)``
    one ``nn.Linear`` stores. So with gradients off, on a CPU, for at most 64 rows, the product
    uses a transposed copy kept on the weight tensor and rebuilt when the weight changes
    (version counter or storage). Everywhere else this is exactly ``F.linear``.
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
    stamp = (weight.data_ptr(), version, weight.dtype)
    cached = getattr(weight, "_wiola_t", None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, weight.t().contiguous())
        weight._wiola_t = cached
    return x @ cached[1]
