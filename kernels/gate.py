"""Fused causal cumulative-mean gate (docs/SPEC.md eq. 8-10), forward and backward, in Triton.

Computes exactly what ``wiola.ops.gate.gate`` computes::

    m_s = mean_h q_s^(h)               (rotated by cos/sin when given)
    c_t = (carry + Σ_{s≤t, s real} m_s) / max(n_t, 1)
    g_t = sigmoid(W_2 · SiLU(W_1 · c_t) + b_2)

Layout of the work. Every program owns one row ``b`` and one *span* of ``SPAN`` consecutive
tokens, which it walks in blocks of ``BLOCK_T`` tokens: per block it reads the ``H`` head rows
of ``q`` once (strided, straight out of the fused QKV projection), forms the head mean in fp32,
rotates it in registers, takes the causal prefix sum with ``tl.cumsum`` on top of a running
sum carried from block to block, divides by the real-token count and runs the two small
matrices head by head (no ``tl.dot``: ``H`` is 1-32 and fp32 accuracy must be exact). When a
row is split into several spans (short batches, long ``T``, so that the GPU has enough
programs), a small pre-pass first writes each span's sum and count; every span then starts
from the carry plus the sums of the spans before it — a two-level scan with no atomics and no
inter-program waiting. With one span per row (decoding, large batches) the pre-pass is skipped
and the forward is a single kernel.

The backward recomputes the forward block by block from the span prefixes saved by the
forward, and needs two kernels:

1. ``_gate_bwd_kernel``: ``dz = dg·g(1-g)``, ``dW_2``, ``db_2``, ``dW_1`` (per-program partials,
   summed afterwards in a fixed order: deterministic) and ``e_t = (W_1^T da_t) / max(n_t, 1)``,
   the gradient of the running sum at ``t``; writes ``e`` and each span's ``Σ e``.
2. ``_gate_bwd_scan_kernel``: the reverse scan ``d(sum)_s = d(sum_out) + Σ_{t≥s} e_t``, zeroed at
   padding, inverse-rotated, divided by ``H`` and broadcast to every head of ``dq``; span 0
   also writes the gradient of the carried sum.

Gradients: ``q``, ``w1``, ``w2``, ``b2`` and the carried fp32 sum (if it requires grad — a cache
normally does not). None for cos/sin, the mask and the integer counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wiola_kernels._utils import FLOAT_DTYPES, LaunchConfig, check_runnable, empty, fail, sm_count

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _masked_mean_block(
    Q, COS, SIN, MASK, b, s, i, SPAN, t_end, offs_d, d_ok, H, HALF,
    stride_qb, stride_qt, stride_qh, stride_cb, stride_ct, stride_mb, stride_mt,
    ROTATE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HEADS_AT_ONCE: tl.constexpr,
):  # fmt: skip
    """Head mean of block ``i`` of span ``s`` of row ``b`` (tokens before ``t_end``), rotated if
    ROTATE, zero at padding.

    The heads are added in order 0..H-1, ``HEADS_AT_ONCE`` of them (a divisor of ``H``) per
    iteration with their loads issued together, so that at one token a row (a decoding step)
    the loads overlap instead of each waiting for the one before (a chain of ``H`` memory
    latencies).

    Returns the block's tokens ``offs_t`` and ``t_ok`` (inside the span), the two halves ``m1, m2``
    ``(BLOCK_T, BLOCK_HALF)`` fp32 and ``real`` ``(BLOCK_T,)`` int32 (1 for a real token inside the
    sequence, else 0).
    """
    offs_t = s * SPAN + i * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < t_end
    ok = t_ok[:, None] & d_ok[None, :]
    ptr = Q + b.to(tl.int64) * stride_qb + offs_t[:, None] * stride_qt + offs_d[None, :]
    m1 = tl.zeros([BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    for h0 in range(0, H, HEADS_AT_ONCE):
        for j in tl.static_range(HEADS_AT_ONCE):
            m1 += tl.load(ptr + (h0 + j) * stride_qh, mask=ok, other=0.0).to(tl.float32)
            m2 += tl.load(ptr + (h0 + j) * stride_qh + HALF, mask=ok, other=0.0).to(tl.float32)
    m1 = m1 / H
    m2 = m2 / H
    if ROTATE:
        rot = b.to(tl.int64) * stride_cb + offs_t[:, None] * stride_ct + offs_d[None, :]
        cos = tl.load(COS + rot, mask=ok, other=1.0)
        sin = tl.load(SIN + rot, mask=ok, other=0.0)
        m1, m2 = m1 * cos - m2 * sin, m1 * sin + m2 * cos
    if HAS_MASK:
        real = (tl.load(MASK + b.to(tl.int64) * stride_mb + offs_t * stride_mt, mask=t_ok, other=0) != 0).to(tl.int32)
    else:
        real = t_ok.to(tl.int32)
    realf = real.to(tl.float32)[:, None]
    return offs_t, t_ok, m1 * realf, m2 * realf, real


@triton.jit
def _running_mean(m1, m2, real, run1, run2, n):
    """``max(n_t, 1)`` (``(BLOCK_T, 1)`` fp32) and the two halves of ``c_t`` (``(BLOCK_T, BLOCK_HALF)``)
    for a block's head means ``m1, m2`` and ``real``, given the running sum (``run1, run2``) and count
    ``n`` before it."""
    count = tl.maximum(tl.cumsum(real, 0) + n, 1).to(tl.float32)[:, None]
    c1 = tl.fdiv(tl.cumsum(m1, 0) + run1[None, :], count, ieee_rounding=False)
    c2 = tl.fdiv(tl.cumsum(m2, 0) + run2[None, :], count, ieee_rounding=False)
    return count, c1, c2


@triton.jit
def _span_program(HALF, BLOCK_HALF: tl.constexpr):
    """This program's span ``s`` and row ``b``, and the columns of one half of a head row
    (``offs_d``, ``d_ok``)."""
    offs_d = tl.arange(0, BLOCK_HALF)
    return tl.program_id(0), tl.program_id(1), offs_d, offs_d < HALF


@triton.jit
def _gate_weights(W1, W2, B2, H, HALF, offs_h, h_ok, offs_d, d_ok):
    """W_1 as two ``(BLOCK_H, BLOCK_HALF)`` halves, W_2 ``(BLOCK_H, BLOCK_H)``, b_2; zero-padded."""
    w_ok = h_ok[:, None] & d_ok[None, :]
    w1 = W1 + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    w1a = tl.load(w1, mask=w_ok, other=0.0)
    w1b = tl.load(w1 + HALF, mask=w_ok, other=0.0)
    w2 = tl.load(W2 + offs_h[:, None] * H + offs_h[None, :], mask=h_ok[:, None] & h_ok[None, :], other=0.0)
    b2 = tl.load(B2 + offs_h, mask=h_ok, other=0.0)
    return w1a, w1b, w2, b2


@triton.jit
def _gate_span_sums_kernel(
    Q, COS, SIN, MASK, SPAN_SUM, SPAN_COUNT,
    T, H, HALF, SPAN, NS,
    stride_qb, stride_qt, stride_qh, stride_cb, stride_ct, stride_mb, stride_mt,
    ROTATE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HEADS_AT_ONCE: tl.constexpr,
):  # fmt: skip
    """Pre-pass of the two-level scan: Σ m_s and the real-token count of span ``s`` of row ``b``."""
    s, b, offs_d, d_ok = _span_program(HALF, BLOCK_HALF)
    acc1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    n = tl.full([], 0, tl.int32)
    t_end = tl.minimum(s * SPAN + SPAN, T)
    for i in range(0, tl.cdiv(t_end - s * SPAN, BLOCK_T)):
        _, _, m1, m2, real = _masked_mean_block(
            Q, COS, SIN, MASK, b, s, i, SPAN, t_end, offs_d, d_ok, H, HALF,
            stride_qb, stride_qt, stride_qh, stride_cb, stride_ct, stride_mb, stride_mt,
            ROTATE, HAS_MASK, BLOCK_T, BLOCK_HALF, HEADS_AT_ONCE,
        )  # fmt: skip
        acc1 += tl.sum(m1, 0)
        acc2 += tl.sum(m2, 0)
        n += tl.sum(real, 0)
    out = SPAN_SUM + (b * NS + s).to(tl.int64) * (2 * HALF) + offs_d
    tl.store(out, acc1, mask=d_ok)
    tl.store(out + HALF, acc2, mask=d_ok)
    tl.store(SPAN_COUNT + b * NS + s, n)


@triton.jit
def _span_start(
    SPAN_SUM, SPAN_COUNT, CARRY_SUM, CARRY_COUNT, b, s, NS, HALF, offs_d, d_ok,
    HAS_CARRY: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Running sum (two halves) and count at the first token of span ``s``: carry + earlier spans."""
    if HAS_CARRY:
        run1 = tl.load(CARRY_SUM + b * (2 * HALF) + offs_d, mask=d_ok, other=0.0)
        run2 = tl.load(CARRY_SUM + b * (2 * HALF) + HALF + offs_d, mask=d_ok, other=0.0)
        n = tl.load(CARRY_COUNT + b).to(tl.int32)
    else:
        run1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        run2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        n = tl.full([], 0, tl.int32)
    for p in range(0, s):
        row = SPAN_SUM + (b * NS + p).to(tl.int64) * (2 * HALF) + offs_d
        run1 += tl.load(row, mask=d_ok, other=0.0)
        run2 += tl.load(row + HALF, mask=d_ok, other=0.0)
        n += tl.load(SPAN_COUNT + b * NS + p)
    return run1, run2, n


@triton.jit
def _gate_fwd_kernel(
    Q, COS, SIN, MASK, W1, W2, B2, CARRY_SUM, CARRY_COUNT, SPAN_SUM, SPAN_COUNT,
    G, SUM_OUT, COUNT_OUT, PREFIX_SUM, PREFIX_COUNT,
    T, H, HALF, SPAN, NS,
    stride_qb, stride_qt, stride_qh, stride_cb, stride_ct, stride_mb, stride_mt,
    ROTATE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_CARRY: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS_AT_ONCE: tl.constexpr,
):  # fmt: skip
    """g for span ``s`` of row ``b``; the last span also writes the final running sum and count."""
    s, b, offs_d, d_ok = _span_program(HALF, BLOCK_HALF)
    D = 2 * HALF
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    run1, run2, n = _span_start(
        SPAN_SUM, SPAN_COUNT, CARRY_SUM, CARRY_COUNT, b, s, NS, HALF, offs_d, d_ok, HAS_CARRY, BLOCK_HALF
    )
    # Saved for the backward, which recomputes this span from here.
    prefix = PREFIX_SUM + (b * NS + s).to(tl.int64) * D + offs_d
    tl.store(prefix, run1, mask=d_ok)
    tl.store(prefix + HALF, run2, mask=d_ok)
    tl.store(PREFIX_COUNT + b * NS + s, n)
    w1a, w1b, w2, b2 = _gate_weights(W1, W2, B2, H, HALF, offs_h, h_ok, offs_d, d_ok)

    t_end = tl.minimum(s * SPAN + SPAN, T)
    for i in range(0, tl.cdiv(t_end - s * SPAN, BLOCK_T)):
        offs_t, t_ok, m1, m2, real = _masked_mean_block(
            Q, COS, SIN, MASK, b, s, i, SPAN, t_end, offs_d, d_ok, H, HALF,
            stride_qb, stride_qt, stride_qh, stride_cb, stride_ct, stride_mb, stride_mt,
            ROTATE, HAS_MASK, BLOCK_T, BLOCK_HALF, HEADS_AT_ONCE,
        )  # fmt: skip
        count, c1, c2 = _running_mean(m1, m2, real, run1, run2, n)
        a = tl.dot(c1, tl.trans(w1a), input_precision="ieee")  # (BLOCK_T, BLOCK_H) = c W_1^T
        a = tl.dot(c2, tl.trans(w1b), a, input_precision="ieee")
        z = tl.dot(a * tl.sigmoid(a), tl.trans(w2), input_precision="ieee")
        g = tl.sigmoid(z + b2[None, :])
        g_ptr = G + (b.to(tl.int64) * T + offs_t[:, None]) * H + offs_h[None, :]
        tl.store(g_ptr, g, mask=t_ok[:, None] & h_ok[None, :])
        run1 += tl.sum(m1, 0)
        run2 += tl.sum(m2, 0)
        n += tl.sum(real, 0)

    # Masked stores, not a branch: fewer live predicates across the loop. The scalar test is
    # broadcast to a block before the `&`: triton 3.9's interpreter rejects block & scalar masks.
    last = d_ok & ((offs_d * 0 + s) == NS - 1)
    tl.store(SUM_OUT + b * D + offs_d, run1, mask=last)
    tl.store(SUM_OUT + b * D + HALF + offs_d, run2, mask=last)
    tl.store(COUNT_OUT + b, n.to(tl.int64), mask=s == NS - 1)


@triton.jit
def _gate_bwd_kernel(
    Q, COS, SIN, MASK, W1, W2, B2, PREFIX_SUM, PREFIX_COUNT, DG,
    E, E_SPAN, C, DA, DW2_PART, DB2_PART,
    T, H, HALF, SPAN, NS,
    stride_qb, stride_qt, stride_qh, stride_cb, stride_ct, stride_mb, stride_mt,
    stride_gb, stride_gt, stride_gh,
    ROTATE: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS_AT_ONCE: tl.constexpr,
):  # fmt: skip
    """Recompute span ``s`` of row ``b``: writes c_t, da_t (for dW_1), e_t = dc_t / max(n_t, 1) and
    the span's partial dW_2, db_2 (dW_1 = Σ da ⊗ c is one matmul afterwards: holding it here spills)."""
    s, b, offs_d, d_ok = _span_program(HALF, BLOCK_HALF)
    D = 2 * HALF
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    prefix = PREFIX_SUM + (b * NS + s).to(tl.int64) * D + offs_d
    run1 = tl.load(prefix, mask=d_ok, other=0.0)
    run2 = tl.load(prefix + HALF, mask=d_ok, other=0.0)
    n = tl.load(PREFIX_COUNT + b * NS + s)
    dw2 = tl.zeros([BLOCK_H, BLOCK_H], dtype=tl.float32)
    db2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    esum1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    esum2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)

    t_end = tl.minimum(s * SPAN + SPAN, T)
    for i in range(0, tl.cdiv(t_end - s * SPAN, BLOCK_T)):
        offs_t, t_ok, m1, m2, real = _masked_mean_block(
            Q, COS, SIN, MASK, b, s, i, SPAN, t_end, offs_d, d_ok, H, HALF,
            stride_qb, stride_qt, stride_qh, stride_cb, stride_ct, stride_mb, stride_mt,
            ROTATE, HAS_MASK, BLOCK_T, BLOCK_HALF, HEADS_AT_ONCE,
        )  # fmt: skip
        # Weights reloaded per block (L1-resident) rather than held live across the loop.
        w1a, w1b, w2, b2 = _gate_weights(W1, W2, B2, H, HALF, offs_h, h_ok, offs_d, d_ok)
        count, c1, c2 = _running_mean(m1, m2, real, run1, run2, n)
        a = tl.dot(c1, tl.trans(w1a), input_precision="ieee")  # forward again
        a = tl.dot(c2, tl.trans(w1b), a, input_precision="ieee")
        sig = tl.sigmoid(a)
        act = a * sig  # SiLU(a), (BLOCK_T, BLOCK_H)
        g = tl.sigmoid(tl.dot(act, tl.trans(w2), input_precision="ieee") + b2[None, :])
        dg_ptr = DG + b.to(tl.int64) * stride_gb + offs_t[:, None] * stride_gt + offs_h[None, :] * stride_gh
        dg = tl.load(dg_ptr, mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        dz = dg * g * (1.0 - g)  # (BLOCK_T, BLOCK_H), zero outside the span and past H
        db2 += tl.sum(dz, 0)
        dw2 = tl.dot(tl.trans(dz), act, dw2, input_precision="ieee")  # Σ_t dz_t ⊗ SiLU(a_t)
        da = tl.dot(dz, w2, input_precision="ieee") * sig * (1.0 + a * (1.0 - sig))  # SiLU' = σ(1 + a(1-σ))
        row = b.to(tl.int64) * T + offs_t[:, None]
        tl.store(DA + row * H + offs_h[None, :], da, mask=t_ok[:, None] & h_ok[None, :])
        c_ok = t_ok[:, None] & d_ok[None, :]
        tl.store(C + row * D + offs_d[None, :], c1, mask=c_ok)
        tl.store(C + row * D + HALF + offs_d[None, :], c2, mask=c_ok)
        dc1 = tl.dot(da, w1a, input_precision="ieee")  # W_1^T da, (BLOCK_T, BLOCK_HALF)
        dc2 = tl.dot(da, w1b, input_precision="ieee")
        e1 = tl.fdiv(dc1, count, ieee_rounding=False)  # d loss / d running_t
        e2 = tl.fdiv(dc2, count, ieee_rounding=False)
        tl.store(E + row * D + offs_d[None, :], e1, mask=c_ok)
        tl.store(E + row * D + HALF + offs_d[None, :], e2, mask=c_ok)
        esum1 += tl.sum(e1, 0)
        esum2 += tl.sum(e2, 0)
        run1 += tl.sum(m1, 0)
        run2 += tl.sum(m2, 0)
        n += tl.sum(real, 0)

    pid = (b * NS + s).to(tl.int64)
    tl.store(E_SPAN + pid * D + offs_d, esum1, mask=d_ok)
    tl.store(E_SPAN + pid * D + HALF + offs_d, esum2, mask=d_ok)
    tl.store(DW2_PART + pid * H * H + offs_h[:, None] * H + offs_h[None, :], dw2, mask=h_ok[:, None] & h_ok[None, :])
    tl.store(DB2_PART + pid * H + offs_h, db2, mask=h_ok)


@triton.jit
def _gate_bwd_scan_kernel(
    COS, SIN, MASK, E, E_SPAN, DSUM, DQ, DCARRY,
    T, H, HALF, SPAN, NS,
    stride_cb, stride_ct, stride_mb, stride_mt,
    ROTATE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DSUM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Reverse scan of e over span ``s`` of row ``b``, written to every head of dq (/H)."""
    s, b, offs_d, d_ok = _span_program(HALF, BLOCK_HALF)
    D = 2 * HALF
    # Gradient reaching the running sum at the end of this span: d(sum_out) + Σ e of later spans.
    if HAS_DSUM:
        acc1 = tl.load(DSUM + b * D + offs_d, mask=d_ok, other=0.0)
        acc2 = tl.load(DSUM + b * D + HALF + offs_d, mask=d_ok, other=0.0)
    else:
        acc1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    for p in range(s + 1, NS):
        row = E_SPAN + (b * NS + p).to(tl.int64) * D + offs_d
        acc1 += tl.load(row, mask=d_ok, other=0.0)
        acc2 += tl.load(row + HALF, mask=d_ok, other=0.0)

    t_start = s * SPAN
    t_end = tl.minimum(t_start + SPAN, T)
    n_blocks = tl.cdiv(t_end - t_start, BLOCK_T)
    for i in range(0, n_blocks):
        offs_t = t_start + (n_blocks - 1 - i) * BLOCK_T + tl.arange(0, BLOCK_T)  # last block first
        t_ok = offs_t < t_end
        ok = t_ok[:, None] & d_ok[None, :]
        e_ptr = E + (b.to(tl.int64) * T + offs_t[:, None]) * D + offs_d[None, :]
        e1 = tl.load(e_ptr, mask=ok, other=0.0)
        e2 = tl.load(e_ptr + HALF, mask=ok, other=0.0)
        dm1 = tl.cumsum(e1, 0, reverse=True) + acc1[None, :]  # Σ_{t≥s} e_t
        dm2 = tl.cumsum(e2, 0, reverse=True) + acc2[None, :]
        acc1 += tl.sum(e1, 0)
        acc2 += tl.sum(e2, 0)
        if HAS_MASK:
            real = tl.load(MASK + b.to(tl.int64) * stride_mb + offs_t * stride_mt, mask=t_ok, other=0) != 0
            dm1 = tl.where(real[:, None], dm1, 0.0)
            dm2 = tl.where(real[:, None], dm2, 0.0)
        if ROTATE:  # transpose of the rotation
            rot = b.to(tl.int64) * stride_cb + offs_t[:, None] * stride_ct + offs_d[None, :]
            cos = tl.load(COS + rot, mask=ok, other=1.0)
            sin = tl.load(SIN + rot, mask=ok, other=0.0)
            dm1, dm2 = dm1 * cos + dm2 * sin, dm2 * cos - dm1 * sin
        dq1 = (dm1 / H).to(DQ.dtype.element_ty)
        dq2 = (dm2 / H).to(DQ.dtype.element_ty)
        dq_ptr = DQ + (b.to(tl.int64) * T + offs_t[:, None]) * H * D + offs_d[None, :]
        for h in range(H):
            tl.store(dq_ptr + h * D, dq1, mask=ok)
            tl.store(dq_ptr + h * D + HALF, dq2, mask=ok)

    if s == 0:
        tl.store(DCARRY + b * D + offs_d, acc1, mask=d_ok)
        tl.store(DCARRY + b * D + HALF + offs_d, acc2, mask=d_ok)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------

NUM_STAGES = 2


def _configs(H: int, D: int, dtype: torch.dtype) -> dict[str, LaunchConfig]:
    """The launches for one ``(H, D)`` and dtype: ``"scan"`` (the backward's reverse scan),
    ``"sums"`` (the forward pre-pass: the scan's blocks and ``HEADS_AT_ONCE``), ``"fwd"`` and
    ``"bwd"`` (the recomputing backward: 16-token blocks, more live tensors). Chosen so that
    every build compiles without spills for sm_80 and sm_90 (tests/test_compile.py builds each
    of them).

    tl.dot needs every dimension >= 16; the fp32 ``ieee`` dots run on FMA units and hold whole
    operand rows per thread, so wide H x D tiles get 8 warps.
    """
    block_half = max(16, triton.next_power_of_2(D // 2))
    block_h = max(16, triton.next_power_of_2(H))
    warps = 8 if block_h * block_half >= 2048 else 4
    warps_bwd = 4 if block_h == 16 and block_half <= 32 else 8
    if dtype == torch.float32 and (block_h, block_half) == (16, 64):
        warps_bwd = 16  # with 8, sm_80 reserves 8 bytes of stack at 128 registers
    block_t = 16 if dtype == torch.float32 and block_h * block_half <= 256 else 32  # fp32: else 8 B of stack
    scan = LaunchConfig({"BLOCK_T": block_t, "BLOCK_HALF": block_half}, num_warps=warps, num_stages=NUM_STAGES)
    heads = _heads_at_once(H, block_half)
    return {
        "scan": scan,
        "sums": LaunchConfig({**scan.blocks, "HEADS_AT_ONCE": heads}, num_warps=warps, num_stages=NUM_STAGES),
        "fwd": LaunchConfig(
            {**scan.blocks, "BLOCK_H": block_h, "HEADS_AT_ONCE": heads}, num_warps=warps, num_stages=NUM_STAGES
        ),
        "bwd": LaunchConfig(
            # One head at a time: the backward holds more live tensors, and its blocks are full
            # (training), where the loads' latency is spread over BLOCK_T tokens.
            {"BLOCK_T": 16, "BLOCK_H": block_h, "BLOCK_HALF": block_half, "HEADS_AT_ONCE": 1},
            num_warps=warps_bwd,
            num_stages=NUM_STAGES,
        ),
    }


def _heads_at_once(H: int, block_half: int) -> int:
    """How many heads' loads the forward's head mean issues together: for half-rows of at most
    16 values (D <= 32, the 13m preset's 32), the largest power of two that divides ``H``, at
    most 8; else 1. The wider tiles spilled registers in the sm_90 ahead-of-time builds with 2
    or 4 heads at once (triton 3.6, the version the builds are held spill-free for)."""
    if block_half > 16:
        return 1
    heads = 1
    while heads < 8 and H % (heads * 2) == 0:
        heads *= 2
    return heads


def _span_tokens(B: int, T: int, block_t: int, device: torch.device) -> int:
    """Tokens per program: split rows along T until there are about two programs per SM.

    Under the interpreter the target is 4 programs, so small tests exercise the multi-span scan.
    """
    target = 2 * sm_count(device)
    n_blocks = triton.cdiv(T, block_t)
    spans = min(n_blocks, max(1, triton.cdiv(target, B)))
    return triton.cdiv(n_blocks, spans) * block_t


def _flag_args(q, cos, sin, mask):
    """Kernel arguments for the optional rotation and mask (dummy pointers when absent)."""
    if cos is not None:
        cos, sin = cos.float(), sin.float()
        if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = torch.broadcast_tensors(cos, sin)
            cos, sin = cos.contiguous(), sin.contiguous()
        # A broadcast (size-1) batch or time dimension is read with stride 0, never expanded.
        rot = (cos, sin, cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1) if cos.shape[1] > 1 else 0)
    else:
        rot = (q, q, 0, 0)
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        masks = (mask, mask.stride(0), mask.stride(1))
    else:
        masks = (q, 0, 0)
    return rot, masks


def _q_strides(q: torch.Tensor) -> torch.Tensor:
    return q if q.stride(-1) == 1 else q.contiguous()


# --------------------------------------------------------------------------------------------
# torch.library custom ops
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("wiola::gate_fwd", mutates_args=())
def _gate_fwd(
    q: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor | None,
    carry_sum: torch.Tensor | None,
    carry_count: torch.Tensor | None,
    span: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``g, sum, count`` and, for the backward, each span's starting sum and count."""
    B, T, H, D = q.shape
    total = empty(B, D, device=q.device, dtype=torch.float32)
    count = empty(B, device=q.device, dtype=torch.int64)
    return _gate_fwd_into(q, w1, w2, b2, cos, sin, mask, carry_sum, carry_count, span, total, count)


def _gate_fwd_into(q, w1, w2, b2, cos, sin, mask, carry_sum, carry_count, span, total, count):
    """``_gate_fwd``'s body, the new running sum and count written into ``total`` and ``count``
    (which may be the carry's own tensors when there is one span: its one program a row reads
    the carry's row before it writes it)."""
    B, T, H, D = q.shape
    ns = triton.cdiv(T, span)
    dev = q.device
    g = empty(B, T, H, device=dev, dtype=torch.float32)
    prefix_sum = empty(B, ns, D, device=dev, dtype=torch.float32)
    prefix_count = empty(B, ns, device=dev, dtype=torch.int32)
    if B == 0:
        return g, total, count, prefix_sum, prefix_count
    q = _q_strides(q)
    w1, w2, b2 = w1.float().contiguous(), w2.float().contiguous(), b2.float().contiguous()
    (cos, sin, s_cb, s_ct), (mask, s_mb, s_mt) = _flag_args(q, cos, sin, mask)
    has_carry = carry_sum is not None
    if has_carry:
        carry_sum, carry_count = carry_sum.float().contiguous(), carry_count.contiguous()
    else:
        carry_sum, carry_count = total, count  # dummies, never read
    cfg = _configs(H, D, q.dtype)
    strides = (q.stride(0), q.stride(1), q.stride(2), s_cb, s_ct, s_mb, s_mt)
    flags = {"ROTATE": cos is not q, "HAS_MASK": mask is not q}
    span_sum, span_count = prefix_sum, prefix_count  # read only when ns > 1
    if ns > 1:
        span_sum = empty(B, ns, D, device=dev, dtype=torch.float32)
        span_count = empty(B, ns, device=dev, dtype=torch.int32)
        _gate_span_sums_kernel[(ns, B)](
            q, cos, sin, mask, span_sum, span_count, T, H, D // 2, span, ns, *strides, **flags, **cfg["sums"].kwargs()
        )
    _gate_fwd_kernel[(ns, B)](
        q, cos, sin, mask, w1, w2, b2, carry_sum, carry_count, span_sum, span_count,
        g, total, count, prefix_sum, prefix_count,
        T, H, D // 2, span, ns, *strides,
        **flags, HAS_CARRY=has_carry, **cfg["fwd"].kwargs(),
    )  # fmt: skip
    return g, total, count, prefix_sum, prefix_count


@_gate_fwd.register_fake
def _(q, w1, w2, b2, cos, sin, mask, carry_sum, carry_count, span):
    B, T, H, D = q.shape
    ns = (T + span - 1) // span
    return (
        q.new_empty(B, T, H, dtype=torch.float32),
        q.new_empty(B, D, dtype=torch.float32),
        q.new_empty(B, dtype=torch.int64),
        q.new_empty(B, ns, D, dtype=torch.float32),
        q.new_empty(B, ns, dtype=torch.int32),
    )


@torch.library.custom_op("wiola::gate_bwd", mutates_args=())
def _gate_bwd(
    dg: torch.Tensor,
    dsum: torch.Tensor | None,
    q: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor | None,
    prefix_sum: torch.Tensor,
    prefix_count: torch.Tensor,
    span: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``dq`` (q's dtype, contiguous), ``dw1, dw2, db2`` (the weights' dtypes), ``dcarry_sum``."""
    B, T, H, D = q.shape
    ns = triton.cdiv(T, span)
    dev = q.device
    dq = empty(B, T, H, D, device=dev, dtype=q.dtype)
    dcarry = empty(B, D, device=dev, dtype=torch.float32)
    if B == 0:
        return dq, torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(b2), dcarry
    q = _q_strides(q)
    w1f, w2f, b2f = w1.float().contiguous(), w2.float().contiguous(), b2.float().contiguous()
    (cos, sin, s_cb, s_ct), (mask, s_mb, s_mt) = _flag_args(q, cos, sin, mask)
    dg = dg.float()
    cfg = _configs(H, D, q.dtype)
    e = empty(B, T, D, device=dev, dtype=torch.float32)
    e_span = empty(B, ns, D, device=dev, dtype=torch.float32)
    c = empty(B, T, D, device=dev, dtype=torch.float32)
    da = empty(B, T, H, device=dev, dtype=torch.float32)
    dw2_part = empty(B * ns, H, H, device=dev, dtype=torch.float32)
    db2_part = empty(B * ns, H, device=dev, dtype=torch.float32)
    flags = {"ROTATE": cos is not q, "HAS_MASK": mask is not q}
    _gate_bwd_kernel[(ns, B)](
        q, cos, sin, mask, w1f, w2f, b2f, prefix_sum, prefix_count, dg,
        e, e_span, c, da, dw2_part, db2_part,
        T, H, D // 2, span, ns,
        q.stride(0), q.stride(1), q.stride(2), s_cb, s_ct, s_mb, s_mt, dg.stride(0), dg.stride(1), dg.stride(2),
        **flags, **cfg["bwd"].kwargs(),
    )  # fmt: skip
    has_dsum = dsum is not None
    dsum = dsum.float().contiguous() if has_dsum else dcarry  # dummy when absent
    _gate_bwd_scan_kernel[(ns, B)](
        cos, sin, mask, e, e_span, dsum, dq, dcarry, T, H, D // 2, span, ns, s_cb, s_ct, s_mb, s_mt,
        **flags, HAS_DSUM=has_dsum, **cfg["scan"].kwargs(),
    )  # fmt: skip
    # Fixed-order sums of the per-program partials: deterministic, no atomics.
    dw1 = (da.view(B * T, H).t() @ c.view(B * T, D)).to(w1.dtype)  # Σ_t da_t ⊗ c_t
    dw2 = dw2_part.sum(0).to(w2.dtype)
    db2 = db2_part.sum(0).to(b2.dtype)
    return dq, dw1, dw2, db2, dcarry


@_gate_bwd.register_fake
def _(dg, dsum, q, w1, w2, b2, cos, sin, mask, prefix_sum, prefix_count, span):
    B, T, H, D = q.shape
    return (
        q.new_empty(B, T, H, D),
        torch.empty_like(w1),
        torch.empty_like(w2),
        torch.empty_like(b2),
        q.new_empty(B, D, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    q, w1, w2, b2, cos, sin, mask, carry_sum, carry_count, span = inputs
    _, _, _, prefix_sum, prefix_count = output
    ctx.save_for_backward(q, w1, w2, b2, cos, sin, mask, prefix_sum, prefix_count)
    ctx.span = span


def _backward(ctx, dg, dsum, dcount, dprefix_sum, dprefix_count):
    q, w1, w2, b2, cos, sin, mask, prefix_sum, prefix_count = ctx.saved_tensors
    if dg is None:
        dg = q.new_zeros(q.shape[:3], dtype=torch.float32)
    dq, dw1, dw2, db2, dcarry = _gate_bwd(dg, dsum, q, w1, w2, b2, cos, sin, mask, prefix_sum, prefix_count, ctx.span)
    need = ctx.needs_input_grad
    return (
        dq if need[0] else None,
        dw1 if need[1] else None,
        dw2 if need[2] else None,
        db2 if need[3] else None,
        None,
        None,
        None,
        dcarry if need[7] else None,
        None,
        None,
    )


_gate_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("wiola::gate_fwd_update_carry", mutates_args=("carry_sum", "carry_count"))
def _gate_fwd_update_carry(
    q: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    mask: torch.Tensor | None,
    carry_sum: torch.Tensor,
    carry_count: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """``g``, the carry advanced in place (one span a row, no gradient): a decoding step's gate
    without the two copies of a new running state into the cache."""
    return _gate_fwd_into(q, w1, w2, b2, cos, sin, mask, carry_sum, carry_count, span, carry_sum, carry_count)[0]


@_gate_fwd_update_carry.register_fake
def _(q, w1, w2, b2, cos, sin, mask, carry_sum, carry_count, span):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def _check(q, w1, w2, b2, cos, sin, attention_mask, carry) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        fail("gate", f"q must be a (B, T, H, D) tensor, got {getattr(q, 'shape', type(q))}")
    if not q.is_floating_point():
        fail("gate", f"q must be a floating-point tensor, got {q.dtype}", TypeError)
    if q.dtype not in FLOAT_DTYPES:
        fail("gate", f"q dtype {q.dtype} is not supported (float32, float16, bfloat16)", TypeError)
    B, T, H, D = q.shape
    if T == 0:
        fail("gate", "q has no tokens (T = 0)")
    if D % 2:
        fail("gate", f"head width D must be even, got {D}")
    check_runnable("gate", q, "wiola.ops.gate")
    for name, t, shape in (("w1", w1, (H, D)), ("w2", w2, (H, H)), ("b2", b2, (H,))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            fail("gate", f"{name} must have shape {shape} for q of shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if not t.is_floating_point():
            fail("gate", f"{name} must be a floating-point tensor, got {t.dtype}", TypeError)
        if t.device != q.device:
            fail("gate", f"{name} is on {t.device}, q on {q.device}")
    if (cos is None) != (sin is None):
        fail("gate", "cos and sin must be given together")
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 3 or t.shape[-1] != D // 2:
                fail("gate", f"{name} must have shape (B, T, D/2) = {(B, T, D // 2)}, got {tuple(t.shape)}")
            if any(n not in (1, want) for n, want in zip(t.shape, (B, T, D // 2))):
                fail("gate", f"{name} of shape {tuple(t.shape)} does not broadcast to {(B, T, D // 2)}")
            if not t.is_floating_point():
                fail("gate", f"{name} must be a floating-point tensor, got {t.dtype}", TypeError)
            if t.device != q.device:
                fail("gate", f"{name} is on {t.device}, q on {q.device}")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, T):
            fail("gate", f"attention_mask must have shape (B, T) = {(B, T)}, got {tuple(attention_mask.shape)}")
        if attention_mask.device != q.device:
            fail("gate", f"attention_mask is on {attention_mask.device}, q on {q.device}")
    if carry is not None:
        if not isinstance(carry, (tuple, list)) or len(carry) != 2:
            fail("gate", "carry must be a (sum, count) pair")
        total, count = carry
        if tuple(total.shape) != (B, D) or total.dtype != torch.float32:
            fail("gate", f"carry sum must be float32 of shape {(B, D)}, got {total.dtype} {tuple(total.shape)}")
        if tuple(count.shape) != (B,) or count.is_floating_point() or count.dtype == torch.bool:
            fail(
                "gate", f"carry count must be an integer tensor of shape {(B,)}, got {count.dtype} {tuple(count.shape)}"
            )
        if total.device != q.device or count.device != q.device:
            fail("gate", f"carry is on {total.device}/{count.device}, q on {q.device}")


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
    """Per-query, per-head gate ``g_t = sigmoid(W2 · SiLU(W1 · c_t) + b2)``, fused (Triton).

    Same arguments and returns as ``wiola.ops.gate.gate``.

    Args:
        q: ``(B, T, H, D)`` queries before rotation, float32/float16/bfloat16, any strides with a
            unit last stride (a view out of a fused QKV projection is read in place).
        w1: ``(H, D)``; w2: ``(H, H)``; b2: ``(H,)``; any float dtype (computed in float32,
            gradients returned in the weight's dtype).
        cos, sin: float ``(B, T, D/2)`` rotation tables (or broadcastable to it). When given, the
            gate is computed from rotated queries (``gate_pre_rope=False``).
        attention_mask: ``(B, T)`` bool or integer, nonzero for real tokens; padding (left or
            right) is left out of the running mean and gets no gradient.
        carry: ``(sum (B, D) float32, count (B,) integer)`` from earlier chunks of the same rows.
        update_carry: write the new running sum and count into ``carry``'s tensors (a cache's
            state) and return those. Where no gradient is needed, ``carry`` is contiguous
            float32 and int64 and each row is one program's span (a decoding step), the kernel
            writes them in place (no copies); else they are copied in.

    Returns:
        ``g`` ``(B, T, H)`` float32, and the new carry ``(sum (B, D) float32, count (B,) int64)``.
        A query with no real token at or before it uses ``c_t = 0``.

    Differentiable in ``q``, ``w1``, ``w2``, ``b2`` and the carried sum; the returned sum is
    differentiable too. Raises ``ValueError``/``TypeError`` naming a bad shape, dtype or device,
    and ``ValueError`` for CPU tensors unless ``TRITON_INTERPRET=1``.
    """
    _check(q, w1, w2, b2, cos, sin, attention_mask, carry)
    B, T, H, D = q.shape
    span = _span_tokens(B, T, _configs(H, D, q.dtype)["fwd"]["BLOCK_T"], q.device)
    carry_sum, carry_count = (None, None) if carry is None else carry
    if update_carry and carry is None:
        fail("gate", "update_carry needs a carry")
    if update_carry and _updatable_in_place(q, w1, w2, b2, carry_sum, carry_count, span):
        g = _gate_fwd_update_carry(q, w1, w2, b2, cos, sin, attention_mask, carry_sum, carry_count, span)
        return g, carry_sum, carry_count
    g, total, count, _, _ = _gate_fwd(q, w1, w2, b2, cos, sin, attention_mask, carry_sum, carry_count, span)
    if update_carry:
        carry_sum.copy_(total)
        carry_count.copy_(count)
        return g, carry_sum, carry_count
    return g, total, count


def _updatable_in_place(q, w1, w2, b2, carry_sum, carry_count, span) -> bool:
    """The kernel can write the carry itself: one span a row, no gradient, the kernel's layouts."""
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, w1, w2, b2, carry_sum))
    return (
        not grads
        and q.shape[1] <= span
        and carry_sum.dtype == torch.float32
        and carry_sum.is_contiguous()
        and carry_count.dtype == torch.int64
        and carry_count.is_contiguous()
    )
