"""What each benchmarked op must do, counted from the math: FLOPs and bytes of memory traffic.

One counting function per op. Each returns a ``Cost(flops, bytes)`` for one call at the given
shape, so a benchmark turns its measured time into achieved TFLOP/s and GB/s, and, with the
ceilings measured on the same GPU, into a floor time (the roofline) and the share of it reached.

Counting conventions (the same for every op):

- A multiply-add is 2 FLOPs. Matrix products are counted exactly. Elementwise work is counted
  only for ops that have no matrix product worth the name (RMSNorm, the gate's scan), at the
  per-element counts written in each docstring; softmax, RoPE, SiLU and sigmoid are left out
  of attention and the FFN, where the products dominate.
- Causal attention counts the pairs ``s ≤ t`` only: ``T (T + 1) / 2`` per row and head.
- Bytes are the compulsory traffic: every input read once and every output written once, in
  its storage dtype (activations in ``dtype``, gates, statistics and rotation tables in fp32,
  token ids and labels in int64). Intermediates a perfect fusion never writes are not counted,
  so the floor is a true lower bound and "% of floor" is never flattered.
- ``mode`` is ``"fwd"``, ``"bwd"`` or ``"fwd_bwd"``; ``fwd_bwd`` is the sum of the two (the
  forward's saved outputs are written by the forward and read again by the backward).
- A backward of a matrix product costs two products (one per input gradient): 2× the forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

Mode = Literal["fwd", "bwd", "fwd_bwd"]
_MODES = ("fwd", "bwd", "fwd_bwd")
FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of memory traffic of one call."""

    flops: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, k: float) -> Cost:
        return Cost(self.flops * k, self.bytes * k)

    __rmul__ = __mul__

    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte (``inf`` for no traffic)."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def floor_s(self, peak_flops: float, peak_bytes_per_s: float) -> float:
        """The roofline time: the larger of the compute time and the memory time at the ceilings.

        Args:
            peak_flops: FLOP/s ceiling (e.g. a measured bf16 matmul rate).
            peak_bytes_per_s: bytes/s ceiling (e.g. a measured device-to-device copy rate).
        """
        if peak_flops <= 0 or peak_bytes_per_s <= 0:
            raise ValueError(f"ceilings must be positive, got {peak_flops} FLOP/s and {peak_bytes_per_s} B/s")
        return max(self.flops / peak_flops, self.bytes / peak_bytes_per_s)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def dtype_bytes(dtype: torch.dtype | int | str) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype``, its name such as ``"bfloat16"``, or an int)."""
    if isinstance(dtype, bool):
        raise TypeError(f"dtype must be a torch.dtype, a dtype name or a byte count, got {dtype!r}")
    if isinstance(dtype, int):
        if dtype not in (1, 2, 4, 8):
            raise ValueError(f"bytes per element must be 1, 2, 4 or 8, got {dtype}")
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"unknown dtype name {dtype!r}")
        dtype = found
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, a dtype name or a byte count, got {type(dtype).__name__}")
    return torch.empty((), dtype=dtype).element_size()


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _by_mode(fwd: Cost, bwd: Cost, mode: str) -> Cost:
    _check_mode(mode)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]


# ------------------------------------------------------------------------------ single ops
def attention(B: int, T: int, H: int, D: int, dtype: torch.dtype | int | str = 2, mode: Mode = "fwd") -> Cost:
    """Causal gated helical attention over ``(B, T, H, D)`` q, k, v (``kernels/attention.py``).

    FLOPs: per causal pair, ``2D`` for ``q̃·k̃`` and ``2D`` for ``p·v``; the backward does five
    products (recomputed scores, ``dP = dO·Vᵀ``, dV, dQ, dK): ``10D`` per pair.
    Bytes, forward: read q, k, v (dtype), g ``(B, T, H)`` fp32, cos and sin ``(B, T, D/2)``
    fp32; write o (dtype) and the log-sum-exp ``(B, H, T)`` fp32.
    Backward: read q, k, v, o, dO (dtype), g, lse, cos, sin; write dq, dk, dv (dtype), dg fp32.
    """
    _check_sizes(B=B, T=T, H=H, D=D)
    b = dtype_bytes(dtype)
    pairs = B * H * T * (T + 1) / 2
    act = B * T * H * D * b  # one (B, T, H, D) tensor
    gate = B * T * H * FP32
    tables = 2 * B * T * (D // 2) * FP32
    lse = B * H * T * FP32
    fwd = Cost(4 * D * pairs, 3 * act + gate + tables + act + lse)
    bwd = Cost(10 * D * pairs, (5 * act + gate + lse + tables) + (3 * act + gate))
    return _by_mode(fwd, bwd, mode)


def gate(B: int, T: int, H: int, D: int, dtype: torch.dtype | int | str = 2, mode: Mode = "fwd") -> Cost:
    """The causal cumulative-mean gate from ``(B, T, H, D)`` queries to ``g`` ``(B, T, H)`` fp32.

    FLOPs per token, forward: head mean ``H·D`` adds, prefix sum ``D``, the division by the count
    ``D``, ``W_1`` ``2·D·H``, ``W_2`` ``2·H·H`` (SiLU, bias and sigmoid left out). Backward: twice
    the two products, plus the reverse scan ``D``, the division ``D`` and the broadcast of the
    head mean ``H·D``.
    Bytes, forward: read q (dtype) and the fp32 weights ``W_1 (H, D)``, ``W_2 (H, H)``, ``b_2 (H,)``;
    write g fp32. Backward: read q, dg fp32 and the weights; write dq (dtype) and the three
    weight gradients fp32.
    """
    _check_sizes(B=B, T=T, H=H, D=D)
    b = dtype_bytes(dtype)
    N = B * T
    weights = (H * D + H * H + H) * FP32
    q = N * H * D * b
    g = N * H * FP32
    fwd = Cost(N * (H * D + 2 * D + 2 * D * H + 2 * H * H), q + weights + g)
    bwd = Cost(N * (2 * (2 * D * H + 2 * H * H) + 2 * D + H * D), q + g + weights + q + weights)
    return _by_mode(fwd, bwd, mode)


def butterfly(
    N: int, d: int, d_ff: int, dtype: torch.dtype | int | str = 2, mode: Mode = "fwd", residual: bool = False
) -> Cost:
    """The butterfly FFN on ``N`` rows: ``W_down (SiLU(a) ⊙ b + W_bp x)``, ``[a ‖ b] = x W_upᵀ``.

    FLOPs, forward: ``2·N·d·(2 d_ff)`` (up) + ``2·N·d·d_ff`` (bypass) + ``2·N·d_ff·d`` (down)
    = ``8·N·d·d_ff``; backward twice that.
    Bytes, forward: read x ``(N, d)`` and the weights ``4·d·d_ff`` (all dtype), write y ``(N, d)``;
    with ``residual`` also read the residual ``(N, d)``. Backward: read x, dy and the weights,
    write dx and the weight gradients (the residual's gradient is dy itself: no traffic).
    """
    _check_sizes(N=N, d=d, d_ff=d_ff)
    b = dtype_bytes(dtype)
    rows = N * d * b
    weights = 4 * d * d_ff * b
    fwd = Cost(8 * N * d * d_ff, rows + weights + rows + (rows if residual else 0))
    bwd = Cost(16 * N * d * d_ff, 2 * rows + weights + rows + weights)
    return _by_mode(fwd, bwd, mode)


def rms_norm(N: int, d: int, dtype: torch.dtype | int | str = 2, mode: Mode = "fwd", residual: bool = True) -> Cost:
    """RMSNorm of ``N`` rows of width ``d``, with the residual add fused when ``residual``.

    FLOPs per element, forward: square and sum 2, scale by ``rstd`` and ``γ`` 2, plus 1 for the
    residual add. Backward: ``dy·γ`` 1, its dot with ``x̂`` 2, ``dγ`` accumulation 2, the
    ``dx`` formula 3, plus 1 for adding the residual stream's incoming gradient.
    Bytes, forward: read x (and the residual) and γ, write y (and the new residual stream h),
    all in dtype. Backward: read dy, h (the normalised input) and γ (and the residual stream's
    gradient dh), write dx (which is also the residual's gradient) and dγ.
    """
    _check_sizes(N=N, d=d)
    b = dtype_bytes(dtype)
    rows = N * d * b
    r = 1 if residual else 0
    fwd = Cost(N * d * (4 + r), (1 + r) * rows + d * b + (1 + r) * rows)
    bwd = Cost(N * d * (8 + r), (2 + r) * rows + d * b + rows + d * b)
    return _by_mode(fwd, bwd, mode)


def linear_cross_entropy(N: int, d: int, V: int, dtype: torch.dtype | int | str = 2, mode: Mode = "fwd") -> Cost:
    """Mean cross-entropy of ``h · Wᵀ`` (``h`` ``(N, d)``, ``W`` ``(V, d)``) against int64 labels.

    FLOPs: the logits ``2·N·d·V``; the backward's two products (dh and dW) ``4·N·d·V``.
    Recomputing the logits in the backward (as chunked kernels do) is extra work and is not
    counted: the floor is what the math requires.
    Bytes, forward: read h, W (dtype) and labels, write the fp32 loss and the per-row log-sum-exp
    ``(N,)`` fp32. Backward: read h, W, labels and the lse, write dh and dW (dtype). The
    ``(N, V)`` logits are never counted: not writing them is the point of the fused op.
    """
    _check_sizes(N=N, d=d, V=V)
    b = dtype_bytes(dtype)
    h, w, labels, lse = N * d * b, V * d * b, N * INT64, N * FP32
    fwd = Cost(2 * N * d * V, h + w + labels + FP32 + lse)
    bwd = Cost(4 * N * d * V, h + w + labels + lse + h + w)
    return _by_mode(fwd, bwd, mode)


# --------------------------------------------------------------------------- whole model
def _layer_matrix_flops(config) -> int:
    """Forward FLOPs per token of one layer's matrix products, attention scores excluded."""
    d, H, D, f = config.d_model, config.n_heads, config.head_dim, config.d_ff
    gate_flops = 2 * (D * H + H * H) if config.gate else 0
    return 2 * 4 * d * d + 8 * d * f + gate_flops


def _matrix_params(config) -> int:
    """Parameters read by every forward: all weights (the tied embedding once), norms included."""
    d, L, H, D, f, V = (config.d_model, config.n_layers, config.n_heads, config.head_dim, config.d_ff,
                        config.vocab_size)  # fmt: skip
    gate_params = H * D + H * H + H if config.gate else 0
    return V * d + L * (4 * d * d + gate_params + 4 * d * f + 2 * d) + d


def weight_bytes(config, scheme: str | None = None, dtype: torch.dtype | int | str = 4) -> int:
    """Bytes of the weights one forward reads: every weight at ``dtype``, or with ``scheme``
    (``"int8"`` / ``"int4"`` / ``"bf16"``) the embedding/head and the layers' seven projection
    matrices as ``wiola.fast.quantize.matrix_bytes`` counts them (with their scales), the rest
    (norms, gate) at ``dtype``."""
    if scheme is None:
        return _matrix_params(config) * dtype_bytes(dtype)
    if scheme not in ("int8", "int4", "bf16"):
        raise ValueError(f"scheme={scheme!r} is not one of int8, int4, bf16")
    from wiola.fast.quantize import matrix_bytes

    d, L, f, V = config.d_model, config.n_layers, config.d_ff, config.vocab_size
    packed = V * d + L * (4 * d * d + 4 * d * f)
    return matrix_bytes(config, scheme) + (_matrix_params(config) - packed) * dtype_bytes(dtype)


def decode_step(
    config, batch: int, context: int, dtype: torch.dtype | int | str = 2, weights: int | None = None
) -> Cost:
    """One greedy decoding step: one new token per row after ``context`` cached tokens.

    FLOPs per row: every layer's products (``_layer_matrix_flops``), attention over the
    ``context + 1`` keys (``4·d`` per key and layer), and the tied head ``2·d·V``.
    Bytes: every weight once (shared by the batch; dtype), the cached keys and values of every
    row (``2·L·context·d``, dtype), the new keys and values written (``2·L·d`` per row), the
    input ids (int64) and the fp32 logits ``(batch, V)``. ``weights``: the weights' bytes when
    they are not all of ``dtype`` (``weight_bytes`` of a quantized model).
    """
    _check_sizes(batch=batch, context=context)
    b = dtype_bytes(dtype)
    d, L, V = config.d_model, config.n_layers, config.vocab_size
    per_row = L * (_layer_matrix_flops(config) + 4 * d * (context + 1)) + 2 * d * V
    traffic = (
        (_matrix_params(config) * b if weights is None else weights)
        + batch * 2 * L * context * d * b
        + batch * 2 * L * d * b
        + batch * INT64
        + batch * V * FP32
    )
    return Cost(batch * per_row, traffic)


def decode(
    config, batch: int, prompt: int, new_tokens: int, dtype: torch.dtype | int | str = 2, weights: int | None = None
) -> Cost:
    """``new_tokens`` decoding steps after a ``prompt``-token prefill (the prefill not included)."""
    _check_sizes(prompt=prompt, new_tokens=new_tokens)
    total = Cost(0.0, 0.0)
    for i in range(new_tokens):
        total = total + decode_step(config, batch, prompt + i, dtype, weights)
    return total


def prefill(config, batch: int, T: int, dtype: torch.dtype | int | str = 2, all_logits: bool = False) -> Cost:
    """A forward pass over ``batch`` prompts of ``T`` tokens that fills a decoding cache.

    FLOPs: ``B·T`` tokens through every layer's products, causal attention (``4·d`` per causal
    pair and layer, ``T (T + 1) / 2`` pairs per row), and the head for the last token of each
    row only (``2·d·V`` per row), or for every token with ``all_logits``.
    Bytes: every weight once, the input ids, the keys and values written to the cache
    (``2·L·B·T·d``, dtype) and the fp32 logits of the rows (or of every token).
    """
    _check_sizes(batch=batch, T=T)
    b = dtype_bytes(dtype)
    d, L, V = config.d_model, config.n_layers, config.vocab_size
    head_rows = batch * T if all_logits else batch
    flops = batch * T * L * _layer_matrix_flops(config) + L * 4 * d * batch * T * (T + 1) / 2 + 2 * d * V * head_rows
    traffic = _matrix_params(config) * b + batch * T * INT64 + 2 * L * batch * T * d * b + head_rows * V * FP32
    return Cost(flops, traffic)


def train_step(config, batch: int, T: int, dtype: torch.dtype | int | str = 2) -> Cost:
    """One training step: forward with the loss on every token, backward, and AdamW.

    FLOPs: 3 × the forward's products (the backward does two products per forward product)
    over ``B·T`` tokens, with the head on every token; AdamW's elementwise work is left out.
    Bytes (a lower bound; activations that a perfect fusion keeps on chip are not counted):
    the weights read by the forward and the backward (dtype), their gradients written and read
    (fp32), AdamW reading and writing the fp32 master weights and both moments, the input ids
    and labels (int64) and the fp32 loss.
    """
    fwd = prefill(config, batch, T, dtype, all_logits=True)
    b = dtype_bytes(dtype)
    P = _matrix_params(config)
    traffic = 2 * P * b + 2 * P * FP32 + 6 * P * FP32 + 2 * batch * T * INT64 + FP32
    return Cost(3 * fwd.flops, traffic)
