"""Fused helical-RoPE gated flash attention (docs/SPEC.md eq. 4-13), forward and backward, in Triton.

Computes exactly what ``wiola.ops.attention.attention`` computes::

    q̃, k̃   = rope(q), rope(k)                       rotate-half pairs (x_i, x_{i+D/2})
    A[t, s] = g[t] · ⟨q̃_t, k̃_s⟩ / sqrt(D)            allowed iff s ≤ t and key s is real
    o_t     = Σ_s softmax_s(A[t, ·]) v_s              a query with no allowed key gives 0

Layout and kernels
------------------
* ``q, k, v`` are read in place as ``(B, T, H, D)`` strided views (e.g. the three slices of one
  fused QKV projection); only the head-dim stride must be 1. ``o, dq, dk, dv`` are written as
  contiguous ``(B, T, H, D)``, the layout of the inputs; ``lse`` and ``Δ`` are ``(B, H, T)`` fp32.
* The rotation happens in registers. Each q/k tile is loaded as its two halves
  ``x1 = x[:, :D/2]``, ``x2 = x[:, D/2:]`` (two ``(rows, D/2)`` tiles, together exactly one read of
  the tile) with the matching ``(rows, D/2)`` cos/sin tiles, rotated in fp32
  (``x̃1 = x1·c − x2·s``, ``x̃2 = x1·s + x2·c``), rounded to the input dtype (the reference rounds
  the rotated tensors the same way) and used as two chained ``tl.dot``s with K = D/2:
  ``q̃·k̃ᵀ = q̃1·k̃1ᵀ + q̃2·k̃2ᵀ``. Keeping halves (rather than a permuted partner copy of the
  full tile) reads each byte once, needs no register shuffles, and makes the inverse rotation of
  ``dq̃, dk̃`` — fused into their stores — the same two-tile formula. ``tl.dot`` needs K ≥ 16, so
  for D = 16 the halves are zero-padded to 16 columns (``HALF_PAD``; masked loads and stores):
  double MMA work for a head width the model does not use.
* Scores are ``⟨q̃, k̃⟩ · (g_t · log2(e) / sqrt(D))`` in fp32 — the gate is applied to the fp32
  score rather than folded into a rounded copy of q̃, so bf16 rounding matches the reference —
  followed by a base-2 online softmax with fp32 accumulators. The forward saves the base-2
  log-sum-exp (``+inf`` for a query with no allowed key, which makes every recomputed
  probability of that row 0 in the backward: zero output, zero gradient).
* Causal structure: the key blocks strictly below the diagonal run without a causal mask; the
  diagonal blocks run with it (``CAUSAL_DIAG``, a constexpr stage flag, selects one body). Padded
  keys (``attention_mask == 0``, any pattern: left, right or holes) are masked only when a mask
  is given (``HAS_MASK``); every load and store is masked at the ragged end of T. In dkdv the
  key mask is applied once to the finished dk/dv rows (each row depends only on its own key's
  row of P) instead of to every recomputed probability.
* Backward: ``_attn_bwd_preprocess`` computes Δ = rowsum(o ⊙ do); ``_attn_bwd_dkdv`` holds one key
  block and walks the query blocks at and after it; ``_attn_bwd_dq`` holds one query block and
  walks the key blocks up to it. Each recomputes P from the saved lse, so neither needs atomics
  and the result is deterministic. With dA = P ⊙ (dP − Δ):
  ``dq̃_t = g_t/sqrt(D) · Σ_s dA_ts k̃_s``, ``dk̃_s = 1/sqrt(D) · Σ_t g_t dA_ts q̃_t`` and
  ``dg_t = 1/sqrt(D) · Σ_s dA_ts ⟨q̃_t, k̃_s⟩ = ⟨q̃_t, Σ_s dA_ts k̃_s⟩ / sqrt(D)``: the gate
  gradient is one D-wide dot of q̃ with the dq accumulator at the end of the dq kernel, not an
  extra multiply-reduce per score in the inner loop (it uses the same rounded dA the dq MMA
  uses, so it is as exact as dq).

Performance trade-offs (reasoned, not measured: no GPU was available while writing this)
---------------------------------------------------------------------------------------------
At the model's shapes (D = 32, T 512-4096) the MMAs are tiny (K = 16 per half) and the kernel is
bound by loads, the exp2 of every score and the per-key-block rotation, not by tensor cores. So:
large query tiles (BLOCK_M 128) to amortise each K/V/cos/sin tile over more queries; exp2 with
the log2(e) folded into the per-row scale; the rotation of a K block done once per load (it is
loaded once per query block anyway; writing rotated k to memory would save those FMAs but costs
a full extra read+write of k, which the brief rules out). cos/sin for keys are fp32
``(BLOCK_N, D/2)`` tiles — more bytes than the bf16 k tile itself — but they are shared by all H
heads and stay in L2. Query blocks are scheduled heaviest (last) first for load balance in the
causal triangle. The fp32 path uses ``input_precision="ieee"`` (tf32 would miss the 1e-5 bar).

Costs of this design, for whoever measures it: the fp32 cos/sin key tiles are the largest part
of each pipelined stage's shared memory (for D = 32, BLOCK_N = 64: 8 KB of tables against 4 KB
each of k and v), and the held tiles make register pressure the limit, not shared memory — the
autotune lists (below) keep only configs that compile without spills for both sm_90 and sm_80,
so wide heads (D = 128) get narrow tiles and, for dq/dkdv, 32-row blocks without wgmma. If a GPU
shows the table bytes matter, bf16 tables would halve them at the cost of exactness (the
reference rotates in fp32); computing angles in-kernel from positions would remove them but
changes the public signature. Backward splits dkdv and dq into two kernels (both recompute P) so
that neither needs atomics; the launch of each is sized by its own autotuned block.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from wiola_kernels._utils import TRITON_DTYPE, AotSpec, interpreting, kernels_usable

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_rotated(X, C, S, rows, row_ok, stride_xt, stride_ct, offs_h, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Load rows of x (two (rows, HALF_PAD) halves) and rotate them in fp32 by their cos/sin rows."""
    mask = row_ok[:, None]
    if HALF_PAD != HALF:
        mask = mask & (offs_h < HALF)[None, :]
    x_ptr = X + rows[:, None] * stride_xt + offs_h[None, :]
    cs_off = rows[:, None] * stride_ct + offs_h[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(C + cs_off, mask=mask, other=0.0)
    s = tl.load(S + cs_off, mask=mask, other=0.0)
    return x1 * c - x2 * s, x1 * s + x2 * c


@triton.jit
def _store_unrotated(
    X, C, S, rows, row_ok, stride_xt, stride_ct, offs_h, d1, d2, HALF: tl.constexpr, HALF_PAD: tl.constexpr
):
    """Store the gradient w.r.t. the unrotated x given the gradient (d1, d2) w.r.t. the rotated x."""
    mask = row_ok[:, None]
    if HALF_PAD != HALF:
        mask = mask & (offs_h < HALF)[None, :]
    cs_off = rows[:, None] * stride_ct + offs_h[None, :]
    c = tl.load(C + cs_off, mask=mask, other=0.0)
    s = tl.load(S + cs_off, mask=mask, other=0.0)
    x_ptr = X + rows[:, None] * stride_xt + offs_h[None, :]
    tl.store(x_ptr, (d1 * c + d2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(x_ptr + HALF, (d2 * c - d1 * s).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q1, q2, row_scale, offs_m,
    K_bh, V_bh, COS_b, SIN_b, KMASK_b,
    stride_kt, stride_vt, stride_ct,
    lo, hi, T,
    offs_n0, offs_h, offs_d,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < T
        k1, k2 = _load_rotated(K_bh, COS_b, SIN_b, offs_n, n_ok, stride_kt, stride_ct, offs_h, HALF, HALF_PAD)
        qk = tl.dot(q1, tl.trans(k1.to(q1.dtype)), input_precision=DOT_PRECISION)
        qk = tl.dot(q2, tl.trans(k2.to(q2.dtype)), qk, input_precision=DOT_PRECISION)
        s = qk * row_scale[:, None]  # (BLOCK_M, BLOCK_N): gated score in log2 units
        if CAUSAL_DIAG:
            allowed = offs_m[:, None] >= offs_n[None, :]
            if HAS_MASK:
                allowed = allowed & (tl.load(KMASK_b + offs_n, mask=n_ok, other=0) != 0)[None, :]
            s = tl.where(allowed, s, float("-inf"))
        elif HAS_MASK:
            s = tl.where((tl.load(KMASK_b + offs_n, mask=n_ok, other=0) != 0)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row whose keys so far are all masked keeps m = -inf; subtract 0 instead (p = 0, no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_bh + offs_n[:, None] * stride_vt + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, G, COS, SIN, KMASK, O, O_RES, LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_cb, stride_ct, stride_mb,
    stride_ob, stride_ot, stride_oh,
    T, H, T_BUCKET, qk_scale,
    D: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M query rows, batch, head) tile of o and lse (and o's rounding residual, O_RES,
    same strides as O, when STORE_RESIDUAL). T_BUCKET only keys the autotuner."""
    HALF: tl.constexpr = D // 2
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest query blocks first
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_PAD)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < T

    COS_b = COS + b * stride_cb
    SIN_b = SIN + b * stride_cb
    KMASK_b = KMASK + b * stride_mb
    K_bh = K + b * stride_kb + h * stride_kh
    V_bh = V + b * stride_vb + h * stride_vh
    q1, q2 = _load_rotated(Q + b * stride_qb + h * stride_qh, COS_b, SIN_b, offs_m, m_ok, stride_qt, stride_ct,
                           offs_h, HALF, HALF_PAD)  # fmt: skip
    q1 = q1.to(Q.dtype.element_ty)
    q2 = q2.to(Q.dtype.element_ty)
    g = tl.load(G + b * stride_gb + offs_m * stride_gt + h * stride_gh, mask=m_ok, other=0.0)
    row_scale = g * qk_scale  # g_t · log2(e) / sqrt(D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    diag_lo = start_m * BLOCK_M
    # Stage 1: key blocks entirely below the diagonal (all < T, no causal mask).
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q1, q2, row_scale, offs_m, K_bh, V_bh, COS_b, SIN_b, KMASK_b,
                                    stride_kt, stride_vt, stride_ct, 0, diag_lo, T, offs_n0, offs_h, offs_d,
                                    HALF, HALF_PAD, BLOCK_N, False, HAS_MASK, DOT_PRECISION)  # fmt: skip
    # Stage 2: the diagonal blocks, causally masked.
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q1, q2, row_scale, offs_m, K_bh, V_bh, COS_b, SIN_b, KMASK_b,
                                    stride_kt, stride_vt, stride_ct, diag_lo, tl.minimum(diag_lo + BLOCK_M, T), T,
                                    offs_n0, offs_h, offs_d, HALF, HALF_PAD, BLOCK_N, True, HAS_MASK,
                                    DOT_PRECISION)  # fmt: skip

    has_key = l_i > 0.0  # False only for a query with no allowed key: o = 0, lse = +inf
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.math.log2(tl.where(has_key, l_i, 1.0)), float("inf"))
    tl.store(LSE + bh * T + offs_m, lse, mask=m_ok)
    o_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    o_low = o.to(O.dtype.element_ty)
    tl.store(O + o_off, o_low, mask=m_ok[:, None])
    if STORE_RESIDUAL:
        # What rounding o to bf16/fp16 lost: the backward's Δ = rowsum(o ⊙ do) needs the fp32 o,
        # or its error breaks the Σ_s dA_ts = 0 cancellation behind dg (and dk at wide heads).
        tl.store(O_RES + o_off, (o - o_low.to(tl.float32)).to(O.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _attn_bwd_preprocess(
    O, O_RES, DO, DELTA,
    stride_ob, stride_ot, stride_oh,
    stride_dob, stride_dot, stride_doh,
    T, H,
    D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Δ[b, h, t] = Σ_d o[b, t, h, d] · do[b, t, h, d] in fp32, o = O + O_RES when HAS_RESIDUAL."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < T
    o_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    o = tl.load(O + o_off, mask=m_ok[:, None], other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        o += tl.load(O_RES + o_off, mask=m_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=m_ok[:, None], other=0.0)  # fmt: skip
    delta = tl.sum(o * do.to(tl.float32), 1)
    tl.store(DELTA + bh * T + offs_m, delta, mask=m_ok)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk1, dk2, dv, k1, k2, v, offs_n,
    Q_bh, DO_bh, G_bh, COS_b, SIN_b, LSE_bh, DELTA_bh,
    stride_qt, stride_dot, stride_gt, stride_ct,
    lo, hi, T, qk_scale,
    offs_m0, offs_h, offs_d,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dk̃ (times sqrt(D)) and dv of one key block over the query blocks in [lo, hi)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < T
        q1, q2 = _load_rotated(Q_bh, COS_b, SIN_b, offs_m, m_ok, stride_qt, stride_ct, offs_h, HALF, HALF_PAD)
        q1 = q1.to(k1.dtype)
        q2 = q2.to(k1.dtype)
        do = tl.load(DO_bh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        # Rows past T: lse = +inf makes their probabilities 0.
        lse = tl.load(LSE_bh + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(DELTA_bh + offs_m, mask=m_ok, other=0.0)
        g = tl.load(G_bh + offs_m * stride_gt, mask=m_ok, other=0.0)
        qkT = tl.dot(k1, tl.trans(q1), input_precision=DOT_PRECISION)
        qkT = tl.dot(k2, tl.trans(q2), qkT, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT * (g * qk_scale)[None, :] - lse[None, :])
        if CAUSAL_DIAG:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if HAS_MASK:
            # A padding key's row is zeroed after the loop; until then keep its unnormalised
            # "probabilities" finite (a real one is ≤ 1) so nothing overflows fp16.
            pT = tl.minimum(pT, 1.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = (pT * (dpT - delta[None, :]) * g[None, :]).to(q1.dtype)  # g_t · dA_ts
        dk1 = tl.dot(dsT, q1, dk1, input_precision=DOT_PRECISION)
        dk2 = tl.dot(dsT, q2, dk2, input_precision=DOT_PRECISION)
    return dk1, dk2, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, G, COS, SIN, KMASK, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_cb, stride_ct, stride_mb,
    stride_dob, stride_dot, stride_doh,
    stride_gradb, stride_gradt, stride_gradh,
    T, H, T_BUCKET, qk_scale, sm_scale,
    D: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dk and dv of one (BLOCK_N keys, batch, head) tile; dk stored through the inverse rotation."""
    HALF: tl.constexpr = D // 2
    start_n = tl.program_id(0) * BLOCK_N  # the first key blocks see the most queries: launched first
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF_PAD)
    offs_d = tl.arange(0, D)
    n_ok = offs_n < T
    COS_b = COS + b * stride_cb
    SIN_b = SIN + b * stride_cb
    k1, k2 = _load_rotated(K + b * stride_kb + h * stride_kh, COS_b, SIN_b, offs_n, n_ok, stride_kt, stride_ct,
                           offs_h, HALF, HALF_PAD)  # fmt: skip
    k1 = k1.to(K.dtype.element_ty)
    k2 = k2.to(K.dtype.element_ty)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                mask=n_ok[:, None], other=0.0)  # fmt: skip
    Q_bh = Q + b * stride_qb + h * stride_qh
    DO_bh = DO + b * stride_dob + h * stride_doh
    G_bh = G + b * stride_gb + h * stride_gh
    LSE_bh = LSE + bh * T
    DELTA_bh = DELTA + bh * T

    dk1 = tl.zeros([BLOCK_N, HALF_PAD], tl.float32)
    dk2 = tl.zeros([BLOCK_N, HALF_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    diag_hi = tl.minimum(start_n + BLOCK_N, T)
    # Query blocks on the diagonal (causally masked), then every later query block (unmasked).
    dk1, dk2, dv = _attn_bwd_dkdv_inner(dk1, dk2, dv, k1, k2, v, offs_n, Q_bh, DO_bh, G_bh, COS_b, SIN_b,
                                        LSE_bh, DELTA_bh, stride_qt, stride_dot, stride_gt, stride_ct, start_n,
                                        diag_hi, T, qk_scale, offs_m0, offs_h, offs_d, HALF, HALF_PAD, BLOCK_M,
                                        True, HAS_MASK, DOT_PRECISION)  # fmt: skip
    dk1, dk2, dv = _attn_bwd_dkdv_inner(dk1, dk2, dv, k1, k2, v, offs_n, Q_bh, DO_bh, G_bh, COS_b, SIN_b,
                                        LSE_bh, DELTA_bh, stride_qt, stride_dot, stride_gt, stride_ct,
                                        start_n + BLOCK_N, T, T, qk_scale, offs_m0, offs_h, offs_d, HALF, HALF_PAD,
                                        BLOCK_M, False, HAS_MASK, DOT_PRECISION)  # fmt: skip

    if HAS_MASK:
        # Padding keys get no probability, so no gradient. Each row of dk/dv depends only on its
        # own key's row of P, so the mask is applied once here instead of to every score.
        key_ok = tl.load(KMASK + b * stride_mb + offs_n, mask=n_ok, other=0) != 0
        dv = tl.where(key_ok[:, None], dv, 0.0)
        dk1 = tl.where(key_ok[:, None], dk1, 0.0)
        dk2 = tl.where(key_ok[:, None], dk2, 0.0)
    grad_off = b * stride_gradb + h * stride_gradh
    tl.store(DV + grad_off + offs_n[:, None] * stride_gradt + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=n_ok[:, None])  # fmt: skip
    _store_unrotated(DK + grad_off, COS_b, SIN_b, offs_n, n_ok, stride_gradt, stride_ct, offs_h, dk1 * sm_scale,
                     dk2 * sm_scale, HALF, HALF_PAD)  # fmt: skip


@triton.jit
def _attn_bwd_dq_inner(
    dq1, dq2, q1, q2, do, lse, delta, row_scale, offs_m,
    K_bh, V_bh, COS_b, SIN_b, KMASK_b,
    stride_kt, stride_vt, stride_ct,
    lo, hi, T,
    offs_n0, offs_h, offs_d,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate Σ_s dA_ts k̃_s of one query block over the key blocks in [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < T
        k1, k2 = _load_rotated(K_bh, COS_b, SIN_b, offs_n, n_ok, stride_kt, stride_ct, offs_h, HALF, HALF_PAD)
        k1 = k1.to(q1.dtype)
        k2 = k2.to(q1.dtype)
        v = tl.load(V_bh + offs_n[:, None] * stride_vt + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PRECISION)
        p = tl.math.exp2(qk * row_scale[:, None] - lse[:, None])
        if CAUSAL_DIAG:
            allowed = offs_m[:, None] >= offs_n[None, :]
            if HAS_MASK:
                allowed = allowed & (tl.load(KMASK_b + offs_n, mask=n_ok, other=0) != 0)[None, :]
            p = tl.where(allowed, p, 0.0)
        elif HAS_MASK:
            p = tl.where((tl.load(KMASK_b + offs_n, mask=n_ok, other=0) != 0)[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(q1.dtype)  # dA_ts
        dq1 = tl.dot(ds, k1, dq1, input_precision=DOT_PRECISION)
        dq2 = tl.dot(ds, k2, dq2, input_precision=DOT_PRECISION)
    return dq1, dq2


@triton.jit
def _attn_bwd_dq(
    Q, K, V, G, COS, SIN, KMASK, DO, LSE, DELTA, DQ, DG,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_cb, stride_ct, stride_mb,
    stride_dob, stride_dot, stride_doh,
    stride_gradb, stride_gradt, stride_gradh,
    stride_dgb, stride_dgt, stride_dgh,
    T, H, T_BUCKET, qk_scale, sm_scale,
    D: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dq (through the inverse rotation) and dg of one (BLOCK_M queries, batch, head) tile."""
    HALF: tl.constexpr = D // 2
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest query blocks first
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_PAD)
    offs_d = tl.arange(0, D)
    m_ok = offs_m < T
    COS_b = COS + b * stride_cb
    SIN_b = SIN + b * stride_cb
    q1, q2 = _load_rotated(Q + b * stride_qb + h * stride_qh, COS_b, SIN_b, offs_m, m_ok, stride_qt, stride_ct,
                           offs_h, HALF, HALF_PAD)  # fmt: skip
    q1 = q1.to(Q.dtype.element_ty)
    q2 = q2.to(Q.dtype.element_ty)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=m_ok[:, None], other=0.0)  # fmt: skip
    lse = tl.load(LSE + bh * T + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + bh * T + offs_m, mask=m_ok, other=0.0)
    g = tl.load(G + b * stride_gb + offs_m * stride_gt + h * stride_gh, mask=m_ok, other=0.0)
    K_bh = K + b * stride_kb + h * stride_kh
    V_bh = V + b * stride_vb + h * stride_vh
    KMASK_b = KMASK + b * stride_mb

    dq1 = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
    dq2 = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
    diag_lo = start_m * BLOCK_M
    dq1, dq2 = _attn_bwd_dq_inner(dq1, dq2, q1, q2, do, lse, delta, g * qk_scale, offs_m, K_bh, V_bh, COS_b, SIN_b,
                                  KMASK_b, stride_kt, stride_vt, stride_ct, 0, diag_lo, T, offs_n0, offs_h, offs_d,
                                  HALF, HALF_PAD, BLOCK_N, False, HAS_MASK, DOT_PRECISION)  # fmt: skip
    dq1, dq2 = _attn_bwd_dq_inner(dq1, dq2, q1, q2, do, lse, delta, g * qk_scale, offs_m, K_bh, V_bh, COS_b, SIN_b,
                                  KMASK_b, stride_kt, stride_vt, stride_ct, diag_lo,
                                  tl.minimum(diag_lo + BLOCK_M, T), T, offs_n0, offs_h, offs_d, HALF, HALF_PAD,
                                  BLOCK_N, True, HAS_MASK, DOT_PRECISION)  # fmt: skip

    # dg_t = ⟨q̃_t, Σ_s dA_ts k̃_s⟩ / sqrt(D), from the same rounded q̃ the MMAs used.
    dg = (tl.sum(q1.to(tl.float32) * dq1, 1) + tl.sum(q2.to(tl.float32) * dq2, 1)) * sm_scale
    tl.store(DG + b * stride_dgb + offs_m * stride_dgt + h * stride_dgh, dg, mask=m_ok)
    dscale = (g * sm_scale)[:, None]
    _store_unrotated(DQ + b * stride_gradb + h * stride_gradh, COS_b, SIN_b, offs_m, m_ok, stride_gradt, stride_ct,
                     offs_h, dq1 * dscale, dq2 * dscale, HALF, HALF_PAD)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Configurations: autotune lists (GPU), the fixed interpreter config, and the AOT registry
# ----------------------------------------------------------------------------------------------


ALL_D = SUPPORTED_HEAD_DIMS


@dataclass(frozen=True)
class _Cfg:
    BLOCK_M: int  # query rows per tile
    BLOCK_N: int  # key rows per tile
    num_warps: int
    num_stages: int
    head_dims: tuple[int, ...] = ALL_D  # the head widths it compiles for without spills (sm_90 and sm_80)

    def kwargs(self) -> dict:
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N}

    def tag(self) -> str:
        return f"BM{self.BLOCK_M},BN{self.BLOCK_N},w{self.num_warps},s{self.num_stages}"

    def key(self) -> tuple[int, int, int, int]:
        return (self.BLOCK_M, self.BLOCK_N, self.num_warps, self.num_stages)


# Per dtype class: "half" (bf16/fp16: tensor-core MMAs) and "fp32" (ieee dots on the FMA units,
# whose operands live in registers, so its tiles are much smaller). Forward and dq hold a query
# block and stream key blocks (BLOCK_M % BLOCK_N == 0: the diagonal is whole key blocks); dkdv
# holds a key block and streams query blocks (BLOCK_N % BLOCK_M == 0). The held block is the M of
# every MMA: ≥ 64 lets sm_90 use wgmma. Each config is limited to the head widths where its sm_80
# and sm_90 builds of that dtype do not spill (tests/test_compile.py builds them all): the held
# q̃/k̃ halves, v or do, and the fp32 accumulators grow with D, so wide heads get narrower streamed
# tiles. D = 128 dq/dkdv need 32-row held blocks on sm_80 (mma.sync, no wgmma). fp32 holds each
# dot's operand rows per thread: its tiles are a quarter to an eighth of half's, and some spill
# on one target only (sm_90 reserves 8 bytes of stack for a few otherwise small builds).
FWD_CONFIGS = {
    "half": [
        _Cfg(128, 64, 4, 3, (16, 32)),
        _Cfg(128, 128, 8, 3, (16, 32)),
        _Cfg(128, 64, 8, 3, (16, 32, 64)),
        _Cfg(64, 64, 4, 3, (16, 32, 64)),
        _Cfg(128, 32, 8, 2, (128,)),
        _Cfg(64, 32, 4, 3, (128,)),
    ],
    "fp32": [
        _Cfg(128, 32, 8, 2, (16, 32)),
        _Cfg(64, 32, 8, 2, (16,)),
        _Cfg(64, 32, 4, 2, (32,)),
        _Cfg(64, 16, 8, 2, (64, 128)),
        _Cfg(32, 16, 4, 2, (16, 64)),
        _Cfg(16, 16, 4, 2, (128,)),
    ],
}
DQ_CONFIGS = {
    "half": [
        _Cfg(128, 32, 4, 3, (32,)),
        _Cfg(128, 64, 8, 3, (16, 32)),
        _Cfg(64, 64, 4, 3, (16, 32)),
        _Cfg(64, 32, 4, 3, (16, 32)),
        _Cfg(128, 32, 8, 3, (64,)),
        _Cfg(64, 16, 4, 3, (64,)),
        _Cfg(32, 32, 4, 2, (128,)),
        _Cfg(32, 16, 4, 2, (128,)),
    ],
    "fp32": [
        _Cfg(64, 64, 8, 2, (16,)),
        _Cfg(64, 32, 8, 2, (16, 32)),
        _Cfg(32, 32, 4, 2, (16, 32)),
        _Cfg(32, 16, 4, 2, (32, 64)),
        _Cfg(64, 16, 8, 2, (64,)),
        _Cfg(32, 32, 8, 2, (64,)),
        _Cfg(32, 16, 8, 2, (128,)),
        _Cfg(16, 16, 4, 2, (128,)),
    ],
}
DKDV_CONFIGS = {
    "half": [
        _Cfg(16, 64, 4, 3, (16, 32, 64)),
        _Cfg(16, 128, 8, 3, (16, 32, 64)),
        _Cfg(32, 64, 8, 3, (16, 32)),
        _Cfg(32, 128, 8, 3, (32,)),
        _Cfg(32, 32, 4, 2, (128,)),
        _Cfg(16, 32, 4, 3, (128,)),
    ],
    "fp32": [
        _Cfg(16, 64, 8, 2, (16, 32)),
        _Cfg(16, 32, 4, 2, (16, 32)),
        _Cfg(32, 32, 8, 2, (64,)),
        _Cfg(16, 16, 4, 2, (64,)),
        _Cfg(16, 16, 8, 2, (128,)),
        _Cfg(16, 16, 4, 1, (128,)),
    ],
}
PREPROCESS_BLOCK_M = 64
# Under TRITON_INTERPRET the autotuner cannot time anything: one small fixed config per kernel,
# small enough that the tests' T = 17/64/300 cross several blocks and ragged ends.
INTERPRET_FWD = _Cfg(32, 16, 4, 1)
INTERPRET_DQ = _Cfg(32, 16, 4, 1)
INTERPRET_DKDV = _Cfg(16, 32, 4, 1)

# Everything that changes the kernel body or its best tiles. Triton adds every tensor argument's
# dtype to the key itself (so bf16, fp16 and fp32 tune apart); HALF_PAD follows from D and
# DOT_PRECISION from the dtype. The dq/dkdv kernels have no STORE_RESIDUAL.
_AUTOTUNE_KEY = ["T_BUCKET", "D", "HAS_MASK"]


def _dtype_class(dtype: torch.dtype | str) -> str:
    """The config list a dtype tunes over: ``"fp32"`` or ``"half"`` (bf16, fp16)."""
    return "fp32" if dtype in (torch.float32, "fp32") else "half"


def _autotuned(fn, configs: dict[str, list[_Cfg]], key: list[str]):
    """``fn`` under ``triton.autotune`` over the configs of every dtype class; a launch tries only
    the configs of its own dtype class (q's dtype) that are listed for its head width."""
    allowed: dict[tuple, tuple[int, ...]] = {}
    for cls, cfgs in configs.items():
        for c in cfgs:
            assert (cls, c.key()) not in allowed, f"duplicate {cls} autotune config {c.tag()}"
            allowed[cls, c.key()] = c.head_dims
    union = list(dict.fromkeys(c.key() for cfgs in configs.values() for c in cfgs))

    def prune(candidates, named_args, **kwargs):
        cls, d = _dtype_class(named_args["Q"].dtype), named_args.get("D", kwargs.get("D"))
        ckey = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
        return [c for c in candidates if d in allowed.get((cls, ckey(c)), ())]

    return triton.autotune(
        configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in union],
        key=key,
        prune_configs_by={"early_config_prune": prune},
    )(fn)


_attn_fwd_tuned = _autotuned(_attn_fwd, FWD_CONFIGS, [*_AUTOTUNE_KEY, "STORE_RESIDUAL"])
_attn_bwd_dq_tuned = _autotuned(_attn_bwd_dq, DQ_CONFIGS, _AUTOTUNE_KEY)
_attn_bwd_dkdv_tuned = _autotuned(_attn_bwd_dkdv, DKDV_CONFIGS, _AUTOTUNE_KEY)


# ----------------------------------------------------------------------------------------------
# Launchers: plain functions over preallocated outputs (the tests pass NaN-poisoned ones)
# ----------------------------------------------------------------------------------------------


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1; copy only in the rare case it is not."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin share one set of strides in the kernels (stride 0 on batch is kept)."""
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def _key_mask(attention_mask: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, T) uint8 key mask (1 = real key) and its batch stride; a 1-byte dummy when there is none."""
    if attention_mask is None:
        return torch.empty(1, dtype=torch.uint8, device=like.device), 0
    km = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    km = km.view(torch.uint8)
    km = km if km.stride(-1) == 1 else km.contiguous()
    return km, km.stride(0)


def _meta(q: torch.Tensor, has_mask: bool) -> dict:
    D = q.shape[-1]
    return {
        "D": D,
        "HALF_PAD": max(16, D // 2),
        "HAS_MASK": has_mask,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


def _t_bucket(T: int) -> int:
    return max(16, triton.next_power_of_2(T))


def _launch(tuned, fn, fixed: _Cfg, config: _Cfg | None, grid_rows: int, grid_cols: int, args: list, meta: dict):
    """Run ``fn`` with an explicit config, the fixed interpreter config, or the autotuner."""
    if config is None and interpreting():
        config = fixed
    if config is not None:
        grid = (triton.cdiv(grid_rows, config.BLOCK_M if fn is not _attn_bwd_dkdv else config.BLOCK_N), grid_cols)
        fn[grid](*args, **meta, **config.kwargs(), num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        block = "BLOCK_N" if fn is _attn_bwd_dkdv else "BLOCK_M"
        tuned[lambda META: (triton.cdiv(grid_rows, META[block]), grid_cols)](*args, **meta)


def attention_fwd_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_mask: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    o_res: torch.Tensor | None = None,
    config: _Cfg | None = None,
) -> None:
    """Write ``o`` (B, T, H, D; any strides with unit last stride) and ``lse`` ((B, H, T) contiguous
    fp32, base 2) for already validated inputs; ``o_res`` (same shape, dtype and strides as ``o``),
    when given, receives ``o_fp32 − o`` for the backward. ``config`` forces one block configuration."""
    B, T, H, D = q.shape
    if q.numel() == 0:
        return
    if o_res is not None and (o_res.stride() != o.stride() or o_res.dtype != o.dtype):
        raise ValueError("o_res must have the dtype and strides of o")
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    cos, sin = _tables(cos, sin)
    km, stride_mb = _key_mask(attention_mask, q)
    args = [
        q, k, v, g, cos, sin, km, o, o if o_res is None else o_res, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        cos.stride(0), cos.stride(1), stride_mb,
        o.stride(0), o.stride(1), o.stride(2),
        T, H, _t_bucket(T), LOG2E / math.sqrt(D),
    ]  # fmt: skip
    meta = {**_meta(q, attention_mask is not None), "STORE_RESIDUAL": o_res is not None}
    _launch(_attn_fwd_tuned, _attn_fwd, INTERPRET_FWD, config, T, B * H, args, meta)


def attention_bwd_launch(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_mask: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dg: torch.Tensor,
    o_res: torch.Tensor | None = None,
    dq_config: _Cfg | None = None,
    dkdv_config: _Cfg | None = None,
) -> None:
    """Write ``dq, dk, dv`` (B, T, H, D; one shared set of strides, unit last stride) and ``dg``
    (B, T, H) fp32 from the upstream gradient ``do`` and the forward's ``o``, ``lse`` and, for
    bf16/fp16, ``o_res`` (without it Δ uses the rounded ``o``: less exact dg and dk)."""
    B, T, H, D = q.shape
    if q.numel() == 0:
        return
    if not (dq.stride() == dk.stride() == dv.stride()) or dq.stride(-1) != 1:
        raise ValueError("dq, dk, dv must share strides with a unit last stride")
    q, k, v, do, o = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(do), _unit_last(o)
    if o_res is not None and o_res.stride() != o.stride():
        o, o_res = o.contiguous(), o_res.contiguous()
    cos, sin = _tables(cos, sin)
    km, stride_mb = _key_mask(attention_mask, q)
    meta = _meta(q, attention_mask is not None)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    pre_grid = (triton.cdiv(T, PREPROCESS_BLOCK_M), B * H)
    _attn_bwd_preprocess[pre_grid](
        o, o if o_res is None else o_res, do, delta, o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2), T, H,
        D=D, BLOCK_M=PREPROCESS_BLOCK_M, HAS_RESIDUAL=o_res is not None, num_warps=4, num_stages=1,
    )  # fmt: skip
    common = [
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        cos.stride(0), cos.stride(1), stride_mb,
        do.stride(0), do.stride(1), do.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
    ]  # fmt: skip
    scalars = [T, H, _t_bucket(T), LOG2E / math.sqrt(D), 1.0 / math.sqrt(D)]
    dkdv_args = [q, k, v, g, cos, sin, km, do, lse, delta, dk, dv, *common, *scalars]
    _launch(_attn_bwd_dkdv_tuned, _attn_bwd_dkdv, INTERPRET_DKDV, dkdv_config, T, B * H, dkdv_args, meta)
    dq_args = [q, k, v, g, cos, sin, km, do, lse, delta, dq, dg, *common, dg.stride(0), dg.stride(1), dg.stride(2)]
    _launch(_attn_bwd_dq_tuned, _attn_bwd_dq, INTERPRET_DQ, dq_config, T, B * H, [*dq_args, *scalars], meta)


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (torch.compile traces them; no host syncs, so CUDA graphs capture them)
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("wiola::attention_fwd", mutates_args=())
def _attention_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_mask: Optional[torch.Tensor],  # noqa: UP045 (torch.library reads the annotation)
    store_residual: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, D = q.shape
    o = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    o_res = torch.empty((B, T, H, D) if store_residual else (0,), dtype=q.dtype, device=q.device)
    attention_fwd_launch(q, k, v, g, cos, sin, attention_mask, o, lse, o_res if store_residual else None)
    return o, lse, o_res


@_attention_fwd_op.register_fake
def _(q, k, v, g, cos, sin, attention_mask, store_residual):
    B, T, H, D = q.shape
    o_res = q.new_empty((B, T, H, D) if store_residual else (0,))
    return q.new_empty((B, T, H, D)), q.new_empty((B, H, T), dtype=torch.float32), o_res


@torch.library.custom_op("wiola::attention_bwd", mutates_args=())
def _attention_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_mask: Optional[torch.Tensor],  # noqa: UP045
    o: torch.Tensor,
    lse: torch.Tensor,
    o_res: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, D = q.shape
    dq, dk, dv = (torch.empty((B, T, H, D), dtype=q.dtype, device=q.device) for _ in range(3))
    dg = torch.empty((B, T, H), dtype=torch.float32, device=q.device)
    res = o_res if o_res.numel() > 0 else None
    attention_bwd_launch(do, q, k, v, g, cos, sin, attention_mask, o, lse, dq, dk, dv, dg, res)
    return dq, dk, dv, dg


@_attention_bwd_op.register_fake
def _(do, q, k, v, g, cos, sin, attention_mask, o, lse, o_res):
    B, T, H, D = q.shape
    return (*(q.new_empty((B, T, H, D)) for _ in range(3)), q.new_empty((B, T, H), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, cos, sin, attention_mask, _ = inputs
    o, lse, o_res = output
    ctx.mark_non_differentiable(lse, o_res)
    ctx.save_for_backward(q, k, v, g, cos, sin, attention_mask, o, lse, o_res)


def _backward(ctx, do, _dlse, _do_res):
    q, k, v, g, cos, sin, attention_mask, o, lse, o_res = ctx.saved_tensors
    dq, dk, dv, dg = torch.ops.wiola.attention_bwd(do, q, k, v, g, cos, sin, attention_mask, o, lse, o_res)
    return dq, dk, dv, dg, None, None, None, None


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def _check_inputs(q, k, v, g, cos, sin, attention_mask) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("cos", cos), ("sin", sin)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4:
        raise ValueError(f"attention: q must be (B, T, H, D), got shape {tuple(q.shape)}")
    B, T, H, D = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"attention: {name} shape {tuple(x.shape)} != q shape {tuple(q.shape)}")
    if q.dtype not in TRITON_DTYPE:
        raise TypeError(f"attention: q/k/v must be float32, float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention: head dim D={D} not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if g.shape != (B, T, H):
        raise ValueError(f"attention: g shape {tuple(g.shape)} != (B, T, H) = {(B, T, H)}")
    if g.dtype != torch.float32:
        raise TypeError(f"attention: g must be float32, got {g.dtype}")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.dim() != 3 or x.shape[0] not in (1, B) or x.shape[1:] != (T, D // 2):
            raise ValueError(f"attention: {name} shape {tuple(x.shape)} != (B, T, D/2) = {(B, T, D // 2)}")
        if x.dtype != torch.float32:
            raise TypeError(f"attention: {name} must be float32, got {x.dtype}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention: attention_mask must be a tensor or None, got {type(attention_mask).__name__}")
        if attention_mask.shape != (B, T):
            raise ValueError(f"attention: attention_mask shape {tuple(attention_mask.shape)} != (B, T) = {(B, T)}")
        if attention_mask.is_complex():
            raise TypeError("attention: attention_mask must be bool, integer or real")
    tensors = [("q", q), ("k", k), ("v", v), ("g", g), ("cos", cos), ("sin", sin)]
    if attention_mask is not None:
        tensors.append(("attention_mask", attention_mask))
    for name, x in tensors[1:]:
        if x.device != q.device:
            raise ValueError(f"attention: {name} is on {x.device} but q is on {q.device}")
    if not kernels_usable(q):
        raise ValueError(
            f"attention: the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got "
            f"{q.device}; use wiola.ops.attention on this device"
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused gated helical causal attention; same function as ``wiola.ops.attention.attention``.

    Args:
        q, k, v: ``(B, T, H, D)`` projections, not yet rotated, float32/float16/bfloat16 (one dtype),
            D in {16, 32, 64, 128}. Any strides (e.g. views of one fused QKV output) — they are read
            in place when the last stride is 1.
        g: ``(B, T, H)`` float32 gate.
        cos, sin: ``(B, T, D/2)`` (or ``(1, T, D/2)``) float32 rotation tables; stride 0 on batch is fine.
        attention_mask: optional ``(B, T)`` bool/integer, 0 marks a padding key (any pattern). A query
            with no allowed key returns 0 and receives zero gradient.

    Returns ``o`` of shape ``(B, T, H, D)`` in the input dtype. Differentiable w.r.t. q, k, v, g
    (cos, sin and the mask get no gradient); works under ``torch.compile(fullgraph=True)``.

    Raises:
        TypeError: a non-tensor argument, unsupported or mismatched dtypes, g/cos/sin not float32.
        ValueError: mismatched shapes, unsupported D, tensors on different devices, or a device the
            kernels cannot run on (CPU without ``TRITON_INTERPRET=1``).
    """
    _check_inputs(q, k, v, g, cos, sin, attention_mask)
    if cos.shape[0] != q.shape[0]:
        cos, sin = cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1)
    # bf16/fp16 with a backward ahead: also keep what rounding o lost (exact Δ for dg and dk).
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g))
    store_residual = needs_grad and q.dtype != torch.float32
    o, _, _ = torch.ops.wiola.attention_fwd(q, k, v, g, cos, sin, attention_mask, store_residual)
    return o


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compile specs: every kernel x autotune config x {bf16, fp16} x head width
# ----------------------------------------------------------------------------------------------

_FP32_POINTERS = {"G", "COS", "SIN", "LSE", "DELTA", "DG"}
_INT_ARGS = {"T", "H", "T_BUCKET"}


def _signature(fn, dtype: str) -> dict[str, str]:
    sig = {}
    for name, param in inspect.signature(fn.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            sig[name] = "constexpr"
        elif name.startswith("stride_") or name in _INT_ARGS:
            sig[name] = "i32"
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        elif name == "KMASK":
            sig[name] = "*u8"
        else:
            sig[name] = "*fp32" if name in _FP32_POINTERS else f"*{dtype}"
    return sig


def _divisible(fn, D: int) -> tuple[str, ...]:
    """The arguments Triton's JIT sees as multiples of 16 in the common case (and specialises on):
    every pointer (fresh allocations; q/k/v slices of a fused QKV at multiples of H·D elements),
    the (B, T, H) strides of (B, T, H, D) tensors, T_BUCKET, and the cos/sin strides when D/2 ≥ 16.
    T itself and the gate/mask strides (multiples of H or T only) are left unaligned."""
    tensor_strides = {f"stride_{x}{d}" for x in ("q", "k", "v", "o", "do", "grad") for d in "bth"}
    if D >= 32:
        tensor_strides |= {"stride_cb", "stride_ct"}
    aligned = []
    for name, param in inspect.signature(fn.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            continue
        pointer = name.isupper() and name not in ("T", "H", "T_BUCKET")
        if pointer or name in tensor_strides or name == "T_BUCKET":
            aligned.append(name)
    return tuple(aligned)


def _spec(kernel: str, cfg: _Cfg, dtype: str, D: int, has_mask: bool, store_residual: bool = False) -> AotSpec:
    """One build of the forward (``kernel="attention_fwd"``), dq or dkdv kernel as the launcher runs it."""
    fn = {"attention_fwd": _attn_fwd, "attention_bwd_dq": _attn_bwd_dq, "attention_bwd_dkdv": _attn_bwd_dkdv}[kernel]
    constexprs = {"D": D, "HALF_PAD": max(16, D // 2), "HAS_MASK": has_mask,
                  "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32", **cfg.kwargs()}  # fmt: skip
    flags = ",mask" if has_mask else ""
    if fn is _attn_fwd:
        constexprs["STORE_RESIDUAL"] = store_residual
        flags += ",res" if store_residual else ""
    held = cfg.BLOCK_N if fn is _attn_bwd_dkdv else cfg.BLOCK_M
    return AotSpec(
        name=f"{kernel}[{dtype},D{D},{cfg.tag()}{flags}]",
        fn=fn,
        signature=_signature(fn, dtype),
        constexprs=constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        expect_wgmma=held >= 64 and dtype != "fp32",
        divisible_by_16=_divisible(fn, D),
    )


def aot_specs() -> list[AotSpec]:
    """Every kernel x autotune config of its dtype's list x head width x dtype, unmasked and masked;
    the half-precision forward with and without the residual store (training and inference)."""
    specs = []
    for dtype in ("bf16", "fp16", "fp32"):
        has_residual = dtype != "fp32"
        for D in SUPPORTED_HEAD_DIMS:
            specs.append(
                AotSpec(
                    name=f"attention_bwd_preprocess[{dtype},D{D},BM{PREPROCESS_BLOCK_M}{',res' if has_residual else ''}]",
                    fn=_attn_bwd_preprocess,
                    signature=_signature(_attn_bwd_preprocess, dtype),
                    constexprs={"D": D, "BLOCK_M": PREPROCESS_BLOCK_M, "HAS_RESIDUAL": has_residual},
                    num_warps=4,
                    num_stages=1,
                    divisible_by_16=_divisible(_attn_bwd_preprocess, D),
                )
            )
            for kernel, configs in (("attention_fwd", FWD_CONFIGS), ("attention_bwd_dq", DQ_CONFIGS),
                                    ("attention_bwd_dkdv", DKDV_CONFIGS)):  # fmt: skip
                for cfg in configs[_dtype_class(dtype)]:
                    if D not in cfg.head_dims:
                        continue
                    for has_mask in (False, True):
                        for store_residual in (False, True) if kernel == "attention_fwd" and has_residual else (False,):
                            specs.append(_spec(kernel, cfg, dtype, D, has_mask, store_residual))
    return specs
