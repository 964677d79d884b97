"""``x · Wᵀ`` with a CPU decoding fast path through a re-laid-out copy of ``W``, and a choice of
fp32 GEMM for larger gradient-free CPU products."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

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
# A product function ((M, K), (N, K)) -> (M, N) or None whose rows do not depend on M or on the
# rows beside them (the fast model: the C++ step's product), set with cpu_gemm(..., rows=f). Within
# it a gradient-free fp32 CPU product runs one sequence at a time, as that sequence alone would run:
# at most _GEMV_ROWS positions a sequence on f (all sequences in one call: its rows are independent
# anyway), more on the chosen GEMM once a sequence. A GEMM picks its kernels by the row count and
# the shapes, so one product over a batch's rows can give a row other last bits than the product
# over that row's sequence alone; with this, a row's numbers are the same alone and in a batch.
RowProduct = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
_ROW_PRODUCT: contextvars.ContextVar[RowProduct | None] = contextvars.ContextVar("wiola_row_product", default=None)


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its fp32 linear op (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows · weightᵀ`` on oneDNN's fp32 matmul (2-D fp32 CPU tensors; see ``onednn_available``)."""
    return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")


@contextlib.contextmanager
def cpu_gemm(name: str, rows: RowProduct | None = None) -> Iterator[None]:
    """Within the block, ``linear``'s larger gradient-free fp32 CPU products run on GEMM ``name``
    (one of ``CPU_GEMMS``); with ``rows``, a sequence at a time (``_ROW_PRODUCT``'s comment):
    those of at most 64 positions a sequence on ``rows`` (where it returns None, the usual path),
    longer ones on the GEMM once a sequence, and so do the ``F.linear`` calls inside a module
    that wraps a projection (``project``). Raises ``ValueError`` for another name, or for
    ``onednn`` where this torch has no oneDNN."""
    if name not in CPU_GEMMS:
        raise ValueError(f"CPU GEMM {name!r} is not one of {', '.join(CPU_GEMMS)}")
    if name == "onednn" and not onednn_available():
        raise ValueError("CPU GEMM 'onednn' asked for, but this torch has no oneDNN (torch.backends.mkldnn)")
    token, row_token = _CPU_GEMM.set(name), _ROW_PRODUCT.set(rows)
    try:
        yield
    finally:
        _ROW_PRODUCT.reset(row_token)
        _CPU_GEMM.reset(token)


def project(x: torch.Tensor, module: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``module(x)`` for a module that wraps a projection (peft's LoRA layer: its base layer plus
    the adapter's two products, each an ``F.linear`` of its own), called so that its adapter
    runs. Where ``linear`` would run a sequence at a time (``by_sequence(x)``), so do the
    ``F.linear`` calls inside it (``SequenceLinears``), so that a row's numbers are the same alone
    and in a batch there too."""
    if not by_sequence(x):
        return module(x)
    with SequenceLinears():
        return module(x)


class SequenceLinears(TorchFunctionMode):
    """Every ``F.linear`` call in the block that ``by_sequence`` covers runs as ``linear`` runs its
    product there (a sequence at a time), the bias added after; every other call runs as it is.
    ``project`` enters it around a module that wraps a projection: a torch function mode sees
    each call made inside it (a few µs each), so it covers no more than that module."""

    def __torch_function__(
        self, func: Callable[..., Any], types: tuple[type, ...], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and by_sequence(x, weight):
                y = _sequence_products(x, weight)
                if y is not None:
                    return y if bias is None else y + bias
        return func(*args, **kwargs)


def row_positions(x: torch.Tensor) -> int:
    """The positions a sequence of ``x`` holds: ``T`` of ``(..., T, K)``, the rows of a 2-D ``(M, K)``."""
    return x.shape[-2] if x.dim() >= 2 else 1


def by_sequence(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` runs this product a sequence at a time (``cpu_gemm``'s ``rows`` set):
    fp32 ``x`` (and ``weight``, where given) on a CPU, gradients off, no autocast, strict fp32
    precision, not while tracing. The fast model's gate runs a sequence at a time where this holds
    for its queries (``wiola.fast.ops``), as its element-wise parts are vectorized by the tensor."""
    return (
        not torch.compiler.is_compiling()
        and _ROW_PRODUCT.get() is not None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() >= 2
        and x.numel() > 0
        and (weight is None or (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2))
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and _strict_fp32()
    )


def _gemm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows · weightᵀ`` (2-D) on the GEMM ``cpu_gemm`` chose."""
    return onednn_linear(rows, weight) if _onednn_applies(rows, weight) else F.linear(rows, weight)


def _sequence_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x · weightᵀ`` a sequence at a time (``_ROW_PRODUCT``'s comment), or None where the row
    product declines (the caller's usual path)."""
    K, N, T = x.shape[-1], weight.shape[0], row_positions(x)
    w = weight.contiguous()
    if T <= _GEMV_ROWS:
        y = _ROW_PRODUCT.get()(x.reshape(-1, K).contiguous(), w)  # type: ignore[misc]
        return None if y is None else y.reshape(*x.shape[:-1], N)
    seqs = x.reshape(-1, T, K)
    if seqs.shape[0] == 1:
        return _gemm(_aligned(seqs[0]), w).reshape(*x.shape[:-1], N)
    out = torch.empty(seqs.shape[0], T, N, dtype=torch.float32)
    for b in range(seqs.shape[0]):
        out[b] = _gemm(_aligned(seqs[b]), w)
    return out.reshape(*x.shape[:-1], N)


def _aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` contiguous at a 64-byte boundary (a copy where it is not): MKL's sgemm takes another
    path, with other last bits, for an input at another offset from a 16-byte boundary, so every
    sequence is handed over aligned as a new tensor of its own is."""
    if rows.is_contiguous() and rows.data_ptr() % 64 == 0:
        return rows
    return rows.clone(memory_format=torch.contiguous_format)


def _strict_fp32() -> bool:
    """Whether torch's fp32 matmul precision is strict (its default): a caller who allows bf16 or
    TF32 (``torch.set_float32_matmul_precision``, ``torch.backends.mkldnn``) gets ``F.linear``'s
    behaviour, not oneDNN's strict fp32."""
    mkldnn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    if mkldnn not in ("none", "ieee"):  # first: torch refuses the legacy getter once this is set
        return False
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # another backend's precision set through the new API: the CPU's is strict
        return True


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
    gradients off, not while tracing, and not one that ``cpu_gemm``'s ``rows`` takes (which reads
    ``W`` as it is)."""
    return (
        not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.numel() <= _GEMV_ROWS * x.shape[-1]
        and not torch.compiler.is_compiling()
        and not by_sequence(x)
    )


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts matmul inputs to on ``x``'s device, or None outside autocast."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def linear(
    x: torch.Tensor, weight: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], layout: DecodeLayout | None = None
) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias); ``x`` ``(..., in)``, ``weight`` ``(out, in)``, or a
    module that wraps a projection (a peft LoRA layer), which is called instead (``project``).

    Decoding a few tokens on a CPU is bound by reading the weights, and MKL's matrix-vector
    product there is slow twice over: about half the speed on the ``(out, in)`` layout that
    ``nn.Linear`` stores as on a contiguous ``(in, out)`` one, and single-threaded. So when
    ``layout`` (``decode_layout(weight)``, kept by the caller) is given and
    ``uses_decode_layout(x)``, the product reads it instead, cut into one slice per thread for
    the tied head so that a batched product reads it with every core. A larger gradient-free fp32
    CPU product runs on the GEMM ``cpu_gemm`` chose (oneDNN's fp32 matmul ran a 512-token prompt's
    products about twice as fast as MKL's sgemm on an AMD EPYC Zen 5), and within
    ``cpu_gemm(..., rows=f)`` a sequence at a time: at most 64 positions a sequence on ``f``, whose
    rows do not depend on the rows beside them, more on the GEMM once a sequence. Everywhere else
    this is exactly ``F.linear``.
    """
    if not isinstance(weight, torch.Tensor):
        return project(x, weight)
    if by_sequence(x, weight):
        y = _sequence_products(x, weight)
        if y is not None:
            return y
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
