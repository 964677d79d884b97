"""``x · Wᵀ`` with a CPU decoding fast path through a re-laid-out copy of ``W``, and a choice of
fp32 GEMM for larger gradient-free CPU products."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Up to this many rows, a CPU product in inference mode may read a re-laid-out copy of W.
_GEMV_ROWS = 64
# From this many outputs (the tied head), the copy is split in one slice per thread.
_SPLIT_OUT = 8192

# The fp32 GEMM of a gradient-free CPU product of more than _GEMV_ROWS rows: "aten" is F.linear (MKL's
# sgemm in PyTorch's x86 builds), "onednn" oneDNN's fp32 matmul (torch.ops.mkldnn._linear_pointwise).
# Both are fp32 arithmetic with fp32 accumulation, in their own summation orders. Set for a block of
# code with cpu_gemm(); wiola.fast.prefill chooses it per CPU for the fast model's gradient-free forwards.
CPU_GEMMS = ("aten", "onednn")
_CPU_GEMM: contextvars.ContextVar[str] = contextvars.ContextVar("wiola_cpu_gemm", default="aten")


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its fp32 linear op (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows · weightᵀ`` on oneDNN's fp32 matmul (2-D fp32 CPU tensors; see ``onednn_available``)."""
    return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")


@contextlib.contextmanager
def cpu_gemm(name: str) -> Iterator[None]:
    """Within the block, ``linear``'s larger gradient-free fp32 CPU products run on GEMM ``name``
    (one of ``CPU_GEMMS``). Raises ``ValueError`` for another name, or for ``onednn`` where this
    torch has no oneDNN."""
    if name not in CPU_GEMMS:
        raise ValueError(f"CPU GEMM {name!r} is not one of {', '.join(CPU_GEMMS)}")
    if name == "onednn" and not onednn_available():
        raise ValueError("CPU GEMM 'onednn' asked for, but this torch has no oneDNN (torch.backends.mkldnn)")
    token = _CPU_GEMM.set(name)
    try:
        yield
    finally:
        _CPU_GEMM.reset(token)


def _strict_fp32() -> bool:
    """Whether torch's fp32 matmul precision is strict (its default): a caller who allows bf16 or
    TF32 (``torch.set_float32_matmul_precision``, ``torch.backends.mkldnn``) gets ``F.linear``'s
    behaviour, not oneDNN's strict fp32."""
    mkldnn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    return torch.get_float32_matmul_precision() == "highest" and mkldnn in ("none", "ieee")


def _onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs this product on oneDNN: chosen (``cpu_gemm``), fp32 on a CPU, more
    than ``_GEMV_ROWS`` rows, nothing to differentiate, no autocast, strict fp32 precision, not
    while tracing."""
    return (
        not torch.compiler.is_compiling()  # first: Dynamo does not trace ContextVar.get
        and _CPU_GEMM.get() == "onednn"
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.dim() >= 2
        and x.shape[-1] == weight.shape[1]
        and x.numel() > _GEMV_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.is_autocast_enabled("cpu")
        and _strict_fp32()
    )


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
    the tied head so that a batched product reads it with every core. A larger gradient-free fp32
    CPU product runs on the GEMM ``cpu_gemm`` chose (oneDNN's fp32 matmul ran a 512-token prompt's
    products about twice as fast as MKL's sgemm on an AMD EPYC Zen 5). Everywhere else this is
    exactly ``F.linear``.
    """
    if layout is None or not uses_decode_layout(x):
        if _onednn_applies(x, weight):
            return onednn_linear(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight)
    slices = layout.slices  # (s, in, width)
    rows = x.reshape(-1, x.shape[-1])
    if slices.shape[0] == 1:
        y = rows @ slices[0]
    else:  # one batched product, one slice per thread: (s, rows, width) -> (rows, s·width)
        y = torch.bmm(rows.expand(slices.shape[0], *rows.shape), slices).transpose(0, 1).reshape(rows.shape[0], -1)
    return y[:, : layout.out_features].reshape(*x.shape[:-1], layout.out_features)
