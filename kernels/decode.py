"""Flash-decoding for Wiola: new tokens attend over a static cache, split along its length.

Three kernels, launched in this order by ``decode_attention``:

1. ``_decode_write_kernel`` (grid ``(B·T, H)``): rotates the new keys at their positions
   (helical RoPE, fp32) and writes them, with the values, into the cache slots
   ``[start, start + T)``.
2. ``_decode_partial_kernel`` (grid ``(B·H, splits, ⌈T/BLOCK_M⌉)``): each program takes one
   split of the filled cache ``[0, start + T)`` (split size rounded up to ``BLOCK_N``, computed
   on the device from ``start``), rotates its queries in registers, and runs a base-2 online
   softmax with the gate ``g_t / sqrt(D)`` applied to the scores, the causal bound
   ``s ≤ start + t`` and the key mask. It writes a partial ``(max, sum, acc)`` per query.
3. ``_decode_reduce_kernel`` (grid ``(B·H, T)``): merges the partials of every split.

Splitting the cache (flash-decoding) lets batch 1 fill the GPU. The split is over the part
of the cache that is filled *now*, with ``start`` read from device memory when it is a
tensor, so one fixed launch grid serves every step of a CUDA-graph-captured decode loop.
Slots at or past ``start + T`` are never read.

The gate's running sum and count are not touched here: the gate kernel updates them with
its ``carry`` (``WiolaModel.forward`` does that before calling this).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from wiola_kernels._utils import FLOAT_DTYPES, LaunchConfig, empty, fail, sm_count
from wiola_kernels.attention import SUPPORTED_HEAD_DIMS

LOG2E = 1.4426950408889634
BLOCK_M = 16  # query rows per program (tl.dot needs >= 16; decoding has T = 1, so most are masked)
BLOCK_N = 64  # cache slots per inner step
BLOCK_S = 16  # splits merged per step of the reduction
MIN_SPLIT = 128  # fewest cache slots worth a split of their own


WRITE_CONFIG = LaunchConfig({}, num_warps=1, num_stages=3)  # num_stages: Triton's default
REDUCE_CONFIG = LaunchConfig({"BLOCK_S": BLOCK_S}, num_warps=1, num_stages=3)


def _partial_config(head_dim: int, ieee: bool) -> LaunchConfig:
    """The partial kernel's launch: 8 warps from D = 64 up keep it under 255 registers (no spills on
    sm_80); fp32 (ieee dots) at D = 16 takes 8 too: with 4, sm_80 reserves 8 bytes of stack at 80 registers."""
    warps = 4 if head_dim == 32 or (head_dim == 16 and not ieee) else 8
    return LaunchConfig({"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}, num_warps=warps, num_stages=2)


# --------------------------------------------------------------------------- kernels
@triton.jit
def _load_start(START, start, START_IN_MEMORY: tl.constexpr):
    if START_IN_MEMORY:
        return tl.load(START).to(tl.int32)
    else:
        return start


@triton.jit
def _decode_write_kernel(
    K, V, COS, SIN, KC, VC, START, start, T, H,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_cb, stride_ct,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
    HEAD_DIM: tl.constexpr, START_IN_MEMORY: tl.constexpr,
):  # fmt: skip
    pid_bt = tl.program_id(0)
    h = tl.program_id(1)
    b = (pid_bt // T).to(tl.int64)
    t = pid_bt % T
    slot = _load_start(START, start, START_IN_MEMORY) + t
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)
    swap = (offs_d + HALF) % HEAD_DIM
    sign = tl.where(offs_d < HALF, -1.0, 1.0)

    k_row = K + b * stride_kb + t * stride_kt + h * stride_kh
    k = tl.load(k_row + offs_d).to(tl.float32)
    k_swap = tl.load(k_row + swap).to(tl.float32)
    cos = tl.load(COS + b * stride_cb + t * stride_ct + offs_d % HALF)
    sin = tl.load(SIN + b * stride_cb + t * stride_ct + offs_d % HALF)
    # Round to the input dtype first, as the reference's apply_rope does, then to the cache's.
    k_rot = (k * cos + sign * k_swap * sin).to(K.dtype.element_ty)
    tl.store(KC + b * stride_kcb + h * stride_kch + slot * stride_kcs + offs_d, k_rot.to(KC.dtype.element_ty))
    v = tl.load(V + b * stride_vb + t * stride_vt + h * stride_vh + offs_d)
    tl.store(VC + b * stride_vcb + h * stride_vch + slot * stride_vcs + offs_d, v.to(VC.dtype.element_ty))


@triton.jit
def _decode_partial_kernel(
    Q, G, COS, SIN, KC, VC, MASK, START, start, M_OUT, L_OUT, ACC_OUT,
    T, H, num_splits, qk_scale,
    stride_qb, stride_qt, stride_qh, stride_gb, stride_gt,
    stride_cb, stride_ct,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_mb,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    START_IN_MEMORY: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    start = _load_start(START, start, START_IN_MEMORY)
    HALF: tl.constexpr = HEAD_DIM // 2

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index t
    row_ok = offs_m < T
    offs_d = tl.arange(0, HEAD_DIM)
    swap = (offs_d + HALF) % HEAD_DIM
    sign = tl.where(offs_d < HALF, -1.0, 1.0)

    # Rotate the queries in registers: q̃ = q·cos + (−q₂ ‖ q₁)·sin, the swapped half loaded directly.
    q_rows = Q + b * stride_qb + offs_m[:, None] * stride_qt + h * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_swap = tl.load(q_rows + swap[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    cs_rows = b * stride_cb + offs_m[:, None] * stride_ct + (offs_d % HALF)[None, :]
    cos = tl.load(COS + cs_rows, mask=row_ok[:, None], other=0.0)
    sin = tl.load(SIN + cs_rows, mask=row_ok[:, None], other=0.0)
    q_rot = (q * cos + sign[None, :] * q_swap * sin).to(Q.dtype.element_ty).to(KC.dtype.element_ty)
    g = tl.load(G + b * stride_gb + offs_m * stride_gt + h, mask=row_ok, other=0.0)
    row_scale = g * qk_scale  # g_t / sqrt(D) · log2(e)

    # This split's share of the slots filled now; this query tile needs slots < start + last row + 1.
    filled = start + T
    split_size = tl.cdiv(tl.cdiv(filled, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_size
    hi = tl.minimum(lo + split_size, start + tl.minimum(pid_m * BLOCK_M + BLOCK_M, T))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = KC + b * stride_kcb + h * stride_kch
    v_base = VC + b * stride_vcb + h * stride_vch
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        k = tl.load(k_base + offs_n[:, None] * stride_kcs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        real = tl.load(MASK + b * stride_mb + offs_n, mask=col_ok, other=0)
        if IEEE:
            scores = tl.dot(q_rot, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q_rot, tl.trans(k))
        scores = scores * row_scale[:, None]
        allowed = (col_ok & (real != 0))[None, :] & (offs_n[None, :] <= start + offs_m[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vcs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(VC.dtype.element_ty), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(VC.dtype.element_ty), v)
        m_i = m_new

    part = (pid_bh * num_splits + split).to(tl.int64) * T + offs_m  # row of the (B·H, splits, T) partials
    tl.store(M_OUT + part, m_i, mask=row_ok)
    tl.store(L_OUT + part, l_i, mask=row_ok)
    tl.store(ACC_OUT + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    M_IN, L_IN, ACC_IN, O, T, H, num_splits,
    stride_ob, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    t = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ok = offs_s < num_splits
        part = (pid_bh * num_splits + offs_s).to(tl.int64) * T + t
        m = tl.load(M_IN + part, mask=ok, other=float("-inf"))
        l = tl.load(L_IN + part, mask=ok, other=0.0)
        a = tl.load(ACC_IN + part[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(m - m_safe)  # splits with no key (m = -inf) weigh 0
        alpha = tl.exp2(m_run - m_safe)
        l_run = l_run * alpha + tl.sum(w * l, 0)
        acc = acc * alpha + tl.sum(w[:, None] * a, 0)
        m_run = m_new
    # A query with no real key at or before it (left padding) gets zeros, like the reference.
    out = tl.where(l_run > 0, acc / tl.where(l_run > 0, l_run, 1.0), 0.0)
    tl.store(O + b * stride_ob + t * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty))


# --------------------------------------------------------------------------- launchers
def default_num_splits(batch: int, heads: int, q_tiles: int, max_len: int, device: torch.device) -> int:
    """Splits per (row, head): enough programs to fill the device twice, at least MIN_SPLIT slots each.

    Depends only on static shapes (the cache's ``max_len``, not its fill), so a CUDA graph keeps it.
    """
    want = max(1, (2 * sm_count(device)) // max(1, batch * heads * q_tiles))
    return max(1, min(want, triton.cdiv(max_len, MIN_SPLIT), 64))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_write(k, v, cos, sin, k_cache, v_cache, start_tensor, start) -> None:
    B, T, H, D = k.shape
    in_memory = start_tensor is not None
    _decode_write_kernel[(B * T, H)](
        k, v, cos, sin, k_cache, v_cache, start_tensor if in_memory else cos, start, T, H,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cos.stride(0), cos.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=D, START_IN_MEMORY=in_memory, **WRITE_CONFIG.kwargs(),
    )  # fmt: skip


@torch.library.custom_op("wiola::decode_write_cache", mutates_args=("k_cache", "v_cache"))
def _write_cache_op(
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_tensor: torch.Tensor | None,
    start: int,
) -> None:
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _launch_write(k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, start_tensor, start)


@torch.library.custom_op("wiola::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_mask: torch.Tensor,
    start_tensor: torch.Tensor | None,
    start: int,
    num_splits: int,
) -> torch.Tensor:
    B, T, H, D = q.shape
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    g = g.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    key_mask = key_mask.contiguous().view(torch.uint8)
    in_memory = start_tensor is not None
    start_ptr = start_tensor if in_memory else key_mask  # any pointer; not read when start is an int
    _launch_write(k, v, cos, sin, k_cache, v_cache, start_tensor, start)

    q_tiles = triton.cdiv(T, BLOCK_M)
    m_part = empty(B * H, num_splits, T, device=q.device, dtype=torch.float32)
    l_part = empty(B * H, num_splits, T, device=q.device, dtype=torch.float32)
    acc_part = empty(B * H, num_splits, T, D, device=q.device, dtype=torch.float32)
    _decode_partial_kernel[(B * H, num_splits, q_tiles)](
        q, g, cos, sin, k_cache, v_cache, key_mask, start_ptr, start, m_part, l_part, acc_part,
        T, H, num_splits, LOG2E / math.sqrt(D),
        q.stride(0), q.stride(1), q.stride(2), g.stride(0), g.stride(1),
        cos.stride(0), cos.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), key_mask.stride(0),
        HEAD_DIM=D, START_IN_MEMORY=in_memory, IEEE=k_cache.dtype == torch.float32,
        **_partial_config(D, k_cache.dtype == torch.float32).kwargs(),
    )  # fmt: skip

    o = empty(B, T, H, D, device=q.device, dtype=q.dtype)
    _decode_reduce_kernel[(B * H, T)](
        m_part, l_part, acc_part, o, T, H, num_splits,
        o.stride(0), o.stride(1), o.stride(2),
        HEAD_DIM=D, **REDUCE_CONFIG.kwargs(),
    )  # fmt: skip
    return o


@_decode_attention_op.register_fake
def _(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start_tensor, start, num_splits):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _check(op: str, q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start) -> None:
    if q.dim() != 4:
        fail(op, f"q must have shape (B, T, H, D), got {tuple(q.shape)}")
    B, T, H, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        fail(op, f"k {tuple(k.shape)} and v {tuple(v.shape)} must match q {tuple(q.shape)}")
    if D not in SUPPORTED_HEAD_DIMS:
        fail(op, f"head width D={D} is not supported by the decode kernel (supported: {SUPPORTED_HEAD_DIMS})")
    if g.shape != (B, T, H) or g.dtype != torch.float32:
        fail(op, f"g must be float32 of shape {(B, T, H)}, got {g.dtype} {tuple(g.shape)}")
    if cos.shape != (B, T, D // 2) or sin.shape != cos.shape:
        fail(op, f"cos/sin must have shape {(B, T, D // 2)}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        fail(op, f"cos/sin must be float32, got {cos.dtype} / {sin.dtype}")
    if k_cache.dim() != 4 or k_cache.shape[:2] != (B, H) or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        fail(
            op,
            f"k_cache/v_cache must have shape (B={B}, H={H}, S, D={D}), "
            f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}",
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        fail(op, "k_cache and v_cache must be contiguous along the head width (written in place)")
    if k_cache.dtype not in FLOAT_DTYPES or v_cache.dtype != k_cache.dtype:
        fail(op, f"k_cache/v_cache must share a float dtype, got {k_cache.dtype} / {v_cache.dtype}", TypeError)
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        fail(op, f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}", TypeError)
    S = k_cache.shape[2]
    if key_mask.shape != (B, S) or key_mask.dtype != torch.bool:
        fail(op, f"key_mask must be bool of shape {(B, S)}, got {key_mask.dtype} {tuple(key_mask.shape)}")
    if isinstance(start, torch.Tensor):
        if start.numel() != 1 or start.dtype not in (torch.int32, torch.int64) or start.device != q.device:
            fail(op, "a tensor start must be a one-element int32/int64 tensor on the device of q")
    elif isinstance(start, bool) or not isinstance(start, int):
        fail(op, f"start must be an int or a 0-d integer tensor, got {type(start).__name__}", TypeError)
    elif not 0 <= start <= S - T:
        fail(op, f"start={start} with T={T} new tokens does not fit a cache of {S} slots")


# --------------------------------------------------------------------------- public
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_mask: torch.Tensor,
    start: int | torch.Tensor,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Write the new tokens into one layer's cache and attend over everything cached (fused).

    Same contract as ``wiola.ops.decode.decode_attention``:

    Args:
        q, k, v: ``(B, T, H, D)`` projections of the new tokens, not yet rotated; any strides
            (e.g. views of one fused QKV output), fp32/fp16/bf16. ``D`` in {16, 32, 64, 128}.
        g: ``(B, T, H)`` float32 gate of the new tokens.
        cos, sin: ``(B, T, D/2)`` float32 rotation tables at the new tokens' positions.
        k_cache, v_cache: ``(B, H, S, D)`` one layer's buffers (contiguous along ``D``);
            slots ``[start, start + T)`` are overwritten with the rotated keys and the values.
        key_mask: ``(B, S)`` bool, already True for the new tokens that are real.
        start: the slot of the first new token: an int, or a one-element int32/int64 device
            tensor (read on the device: a CUDA graph captured once serves every step).
        num_splits: splits of the filled cache per (row, head); default fills the device.

    Returns ``(B, T, H, D)`` in ``q.dtype``. Cache slots at or past ``start + T`` are never read.
    Not differentiable (decoding only). Raises ``ValueError``/``TypeError`` naming a bad shape,
    dtype or start.
    """
    _check("decode_attention", q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start)
    B, T, H, _ = q.shape
    if num_splits is None:
        num_splits = default_num_splits(B, H, triton.cdiv(T, BLOCK_M), k_cache.shape[2], q.device)
    if num_splits < 1:
        fail("decode_attention", f"num_splits must be >= 1, got {num_splits}")
    if isinstance(start, torch.Tensor):
        return _decode_attention_op(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start.reshape(()), 0, num_splits)
    return _decode_attention_op(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, None, start, num_splits)


def write_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int | torch.Tensor,
) -> None:
    """Only the cache write of ``decode_attention``: rotated ``k`` and ``v`` into slots
    ``[start, start + T)`` of ``k_cache``/``v_cache`` (``(B, H, S, D)``), in place.

    ``k, v``: ``(B, T, H, D)`` not yet rotated; ``cos, sin``: ``(B, T, D/2)`` float32. Used for a
    prefill whose attention runs on the training kernel. Raises like ``decode_attention``.
    """
    B, T, H, D = k.shape
    g = torch.empty(B, T, H, device=k.device, dtype=torch.float32)  # shape-checks only
    mask = torch.empty(B, k_cache.shape[2], device=k.device, dtype=torch.bool)
    _check("write_cache", k, k, v, g, cos, sin, k_cache, v_cache, mask, start)
    if isinstance(start, torch.Tensor):
        _write_cache_op(k, v, cos, sin, k_cache, v_cache, start.reshape(()), 0)
    else:
        _write_cache_op(k, v, cos, sin, k_cache, v_cache, None, start)
