"""The Triton kernels of fused helical-RoPE gated flash attention (docs/SPEC.md eq. 4-13), forward
and backward; their configs, launchers and the op are in ``wiola_kernels.attention``.

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

Performance trade-offs (expected from the design; not measured on a GPU)
-----------------------------------------------------------------------
At the model's shapes (D = 32, T 512-4096) the MMAs are tiny (K = 16 per half) and the kernel is
bound by loads, the exp2 of every score and the per-key-block rotation, not by tensor cores. So:
large query tiles (BLOCK_M 128) to amortise each K/V/cos/sin tile over more queries; exp2 with
the log2(e) folded into the per-row scale; the rotation of a K block done once per load (it is
loaded once per query block anyway; writing rotated k to memory would save those FMAs but costs
a full extra read and write of k). cos/sin for keys are fp32
``(BLOCK_N, D/2)`` tiles — more bytes than the bf16 k tile itself — but they are shared by all H
heads and stay in L2. Query blocks are scheduled heaviest (last) first for load balance in the
causal triangle. The fp32 path uses ``input_precision="ieee"`` (tf32 would miss the 1e-5 bar).

Costs of this design: the fp32 cos/sin key tiles are the largest part
of each pipelined stage's shared memory (for D = 32, BLOCK_N = 64: 8 KB of tables against 4 KB
each of k and v), and the held tiles make register pressure the limit, not shared memory — the
autotune lists (``wiola_kernels.attention``) keep only configs that compile without spills for both sm_90 and sm_80,
so wide heads (D = 128) get narrow tiles and, for dq/dkdv, 32-row blocks without wgmma. If a GPU
shows the table bytes matter, bf16 tables would halve them at the cost of exactness (the
reference rotates in fp32); computing angles in-kernel from positions would remove them but
changes the public signature. Backward splits dkdv and dq into two kernels (both recompute P) so
that neither needs atomics; the launch of each is sized by its own autotuned block.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
def _load_rows(X, rows, row_ok, stride_xt, D: tl.constexpr):
    """Rows of a (T, D) matrix with unit last stride as one (rows, D) tile; zero past T."""
    offs_d = tl.arange(0, D)
    return tl.load(X + rows[:, None] * stride_xt + offs_d[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _program_tile(H, BLOCK: tl.constexpr, LAST_FIRST: tl.constexpr):
    """This program's (batch · head) index ``bh``, its batch ``b`` and head ``h`` (int64), and the
    first row of its block of BLOCK rows; LAST_FIRST walks the blocks from the last one."""
    if LAST_FIRST:
        block = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        block = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    return block * BLOCK, bh, b, h


@triton.jit
def _query_tile(
    Q, K, V, G, COS, SIN, KMASK,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_vb, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_cb, stride_ct, stride_mb,
    T, H,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """What a program holding one query block (forward, dq) starts from, heaviest (last) blocks first.

    Returns the block's first row ``diag_lo``, ``bh``, ``b``, ``h``, its rows ``offs_m`` and
    ``m_ok``, the offsets of a key block and of a half head, the rotated q̃ halves in q's dtype,
    the gate ``g`` of its rows, and the (batch, head) bases of k, v, cos, sin and the key mask.
    """
    diag_lo, bh, b, h = _program_tile(H, BLOCK_M, True)
    offs_m = diag_lo + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_PAD)
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
    return diag_lo, bh, b, h, offs_m, m_ok, offs_n0, offs_h, q1, q2, g, K_bh, V_bh, COS_b, SIN_b, KMASK_b


@triton.jit
def _key_block(
    q1, q2, K_bh, COS_b, SIN_b, start_n, offs_n0, offs_h, T, stride_kt, stride_ct,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One key block of a query block's walk: its rows ``offs_n`` and ``n_ok``, the rotated k̃
    halves in q's dtype, and the scores ⟨q̃, k̃⟩ (BLOCK_M, BLOCK_N) in fp32."""
    offs_n = start_n + offs_n0
    n_ok = offs_n < T
    k1, k2 = _load_rotated(K_bh, COS_b, SIN_b, offs_n, n_ok, stride_kt, stride_ct, offs_h, HALF, HALF_PAD)
    k1 = k1.to(q1.dtype)
    qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    k2 = k2.to(q2.dtype)
    qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PRECISION)
    return offs_n, n_ok, k1, k2, qk


@triton.jit
def _allowed_only(x, fill, offs_m, offs_n, n_ok, KMASK_b, CAUSAL_DIAG: tl.constexpr, HAS_MASK: tl.constexpr):
    """``x`` (BLOCK_M, BLOCK_N) where query ``offs_m`` may see key ``offs_n`` (s ≤ t on the diagonal
    blocks, a real key when there is a mask), ``fill`` elsewhere."""
    if CAUSAL_DIAG:
        allowed = offs_m[:, None] >= offs_n[None, :]
        if HAS_MASK:
            allowed = allowed & (tl.load(KMASK_b + offs_n, mask=n_ok, other=0) != 0)[None, :]
        x = tl.where(allowed, x, fill)
    elif HAS_MASK:
        x = tl.where((tl.load(KMASK_b + offs_n, mask=n_ok, other=0) != 0)[None, :], x, fill)
    return x


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q1, q2, row_scale, offs_m,
    K_bh, V_bh, COS_b, SIN_b, KMASK_b,
    stride_kt, stride_vt, stride_ct,
    lo, hi, T, offs_n0, offs_h,
    D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, n_ok, k1, k2, qk = _key_block(q1, q2, K_bh, COS_b, SIN_b, start_n, offs_n0, offs_h, T, stride_kt,
                                              stride_ct, HALF, HALF_PAD, DOT_PRECISION)  # fmt: skip
        s = qk * row_scale[:, None]  # (BLOCK_M, BLOCK_N): gated score in log2 units
        s = _allowed_only(s, float("-inf"), offs_m, offs_n, n_ok, KMASK_b, CAUSAL_DIAG, HAS_MASK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row whose keys so far are all masked keeps m = -inf; subtract 0 instead (p = 0, no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V_bh, offs_n, n_ok, stride_vt, D)
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
    diag_lo, bh, b, h, offs_m, m_ok, offs_n0, offs_h, q1, q2, g, K_bh, V_bh, COS_b, SIN_b, KMASK_b = _query_tile(
        Q, K, V, G, COS, SIN, KMASK, stride_qb, stride_qt, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_gb, stride_gt, stride_gh, stride_cb, stride_ct, stride_mb, T, H, HALF, HALF_PAD, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    row_scale = g * qk_scale  # g_t · log2(e) / sqrt(D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # Stage 1: key blocks entirely below the diagonal (all < T, no causal mask).
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q1, q2, row_scale, offs_m, K_bh, V_bh, COS_b, SIN_b, KMASK_b,
                                    stride_kt, stride_vt, stride_ct, 0, diag_lo, T, offs_n0, offs_h,
                                    D, HALF, HALF_PAD, BLOCK_N, False, HAS_MASK, DOT_PRECISION)  # fmt: skip
    # Stage 2: the diagonal blocks, causally masked.
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q1, q2, row_scale, offs_m, K_bh, V_bh, COS_b, SIN_b, KMASK_b,
                                    stride_kt, stride_vt, stride_ct, diag_lo, tl.minimum(diag_lo + BLOCK_M, T), T,
                                    offs_n0, offs_h, D, HALF, HALF_PAD, BLOCK_N, True, HAS_MASK,
                                    DOT_PRECISION)  # fmt: skip

    has_key = l_i > 0.0  # False only for a query with no allowed key: o = 0, lse = +inf
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.math.log2(tl.where(has_key, l_i, 1.0)), float("inf"))
    tl.store(LSE + bh * T + offs_m, lse, mask=m_ok)
    o_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + tl.arange(0, D)[None, :]
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
    lo, hi, T, qk_scale, offs_m0, offs_h,
    D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dk̃ (times sqrt(D)) and dv of one key block over the query blocks in [lo, hi)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < T
        q1, q2 = _load_rotated(Q_bh, COS_b, SIN_b, offs_m, m_ok, stride_qt, stride_ct, offs_h, HALF, HALF_PAD)
        q1 = q1.to(k1.dtype)
        q2 = q2.to(k1.dtype)
        do = _load_rows(DO_bh, offs_m, m_ok, stride_dot, D)
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
    # The first key blocks see the most queries: launched first.
    start_n, bh, b, h = _program_tile(H, BLOCK_N, False)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF_PAD)
    n_ok = offs_n < T
    COS_b = COS + b * stride_cb
    SIN_b = SIN + b * stride_cb
    k1, k2 = _load_rotated(K + b * stride_kb + h * stride_kh, COS_b, SIN_b, offs_n, n_ok, stride_kt, stride_ct,
                           offs_h, HALF, HALF_PAD)  # fmt: skip
    k1 = k1.to(K.dtype.element_ty)
    k2 = k2.to(K.dtype.element_ty)
    v = _load_rows(V + b * stride_vb + h * stride_vh, offs_n, n_ok, stride_vt, D)
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
                                        diag_hi, T, qk_scale, offs_m0, offs_h, D, HALF, HALF_PAD, BLOCK_M,
                                        True, HAS_MASK, DOT_PRECISION)  # fmt: skip
    dk1, dk2, dv = _attn_bwd_dkdv_inner(dk1, dk2, dv, k1, k2, v, offs_n, Q_bh, DO_bh, G_bh, COS_b, SIN_b,
                                        LSE_bh, DELTA_bh, stride_qt, stride_dot, stride_gt, stride_ct,
                                        start_n + BLOCK_N, T, T, qk_scale, offs_m0, offs_h, D, HALF, HALF_PAD,
                                        BLOCK_M, False, HAS_MASK, DOT_PRECISION)  # fmt: skip

    if HAS_MASK:
        # Padding keys get no probability, so no gradient. Each row of dk/dv depends only on its
        # own key's row of P, so the mask is applied once here instead of to every score.
        key_ok = tl.load(KMASK + b * stride_mb + offs_n, mask=n_ok, other=0) != 0
        dv = tl.where(key_ok[:, None], dv, 0.0)
        dk1 = tl.where(key_ok[:, None], dk1, 0.0)
        dk2 = tl.where(key_ok[:, None], dk2, 0.0)
    grad_off = b * stride_gradb + h * stride_gradh
    tl.store(DV + grad_off + offs_n[:, None] * stride_gradt + tl.arange(0, D)[None, :], dv.to(DV.dtype.element_ty),
             mask=n_ok[:, None])  # fmt: skip
    _store_unrotated(DK + grad_off, COS_b, SIN_b, offs_n, n_ok, stride_gradt, stride_ct, offs_h, dk1 * sm_scale,
                     dk2 * sm_scale, HALF, HALF_PAD)  # fmt: skip


@triton.jit
def _attn_bwd_dq_inner(
    dq1, dq2, q1, q2, do, lse, delta, row_scale, offs_m,
    K_bh, V_bh, COS_b, SIN_b, KMASK_b,
    stride_kt, stride_vt, stride_ct,
    lo, hi, T, offs_n0, offs_h,
    D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate Σ_s dA_ts k̃_s of one query block over the key blocks in [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, n_ok, k1, k2, qk = _key_block(q1, q2, K_bh, COS_b, SIN_b, start_n, offs_n0, offs_h, T, stride_kt,
                                              stride_ct, HALF, HALF_PAD, DOT_PRECISION)  # fmt: skip
        v = _load_rows(V_bh, offs_n, n_ok, stride_vt, D)
        p = tl.math.exp2(qk * row_scale[:, None] - lse[:, None])
        p = _allowed_only(p, 0.0, offs_m, offs_n, n_ok, KMASK_b, CAUSAL_DIAG, HAS_MASK)
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
    diag_lo, bh, b, h, offs_m, m_ok, offs_n0, offs_h, q1, q2, g, K_bh, V_bh, COS_b, SIN_b, KMASK_b = _query_tile(
        Q, K, V, G, COS, SIN, KMASK, stride_qb, stride_qt, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_gb, stride_gt, stride_gh, stride_cb, stride_ct, stride_mb, T, H, HALF, HALF_PAD, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    do = _load_rows(DO + b * stride_dob + h * stride_doh, offs_m, m_ok, stride_dot, D)
    lse = tl.load(LSE + bh * T + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + bh * T + offs_m, mask=m_ok, other=0.0)

    dq1 = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
    dq2 = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
    dq1, dq2 = _attn_bwd_dq_inner(dq1, dq2, q1, q2, do, lse, delta, g * qk_scale, offs_m, K_bh, V_bh, COS_b, SIN_b,
                                  KMASK_b, stride_kt, stride_vt, stride_ct, 0, diag_lo, T, offs_n0, offs_h,
                                  D, HALF, HALF_PAD, BLOCK_N, False, HAS_MASK, DOT_PRECISION)  # fmt: skip
    dq1, dq2 = _attn_bwd_dq_inner(dq1, dq2, q1, q2, do, lse, delta, g * qk_scale, offs_m, K_bh, V_bh, COS_b, SIN_b,
                                  KMASK_b, stride_kt, stride_vt, stride_ct, diag_lo,
                                  tl.minimum(diag_lo + BLOCK_M, T), T, offs_n0, offs_h, D, HALF, HALF_PAD, BLOCK_N,
                                  True, HAS_MASK, DOT_PRECISION)  # fmt: skip

    # dg_t = ⟨q̃_t, Σ_s dA_ts k̃_s⟩ / sqrt(D), from the same rounded q̃ the MMAs used.
    dg = (tl.sum(q1.to(tl.float32) * dq1, 1) + tl.sum(q2.to(tl.float32) * dq2, 1)) * sm_scale
    tl.store(DG + b * stride_dgb + offs_m * stride_dgt + h * stride_dgh, dg, mask=m_ok)
    dscale = (g * sm_scale)[:, None]
    _store_unrotated(DQ + b * stride_gradb + h * stride_gradh, COS_b, SIN_b, offs_m, m_ok, stride_gradt, stride_ct,
                     offs_h, dq1 * dscale, dq2 * dscale, HALF, HALF_PAD)  # fmt: skip
