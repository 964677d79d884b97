"""Fused helical-RoPE gated flash attention (docs/SPEC.md eq. 4-13), forward and backward: the
launch configs, launchers, ``torch.library`` ops and the public ``attention``. The Triton kernels,
and the design they follow, are in ``wiola_kernels.attention_triton``.

Computes exactly what ``wiola.ops.attention.attention`` computes::

    q̃, k̃   = rope(q), rope(k)                       rotate-half pairs (x_i, x_{i+D/2})
    A[t, s] = g[t] · ⟨q̃_t, k̃_s⟩ / sqrt(D)            allowed iff s ≤ t and key s is real
    o_t     = Σ_s softmax_s(A[t, ·]) v_s              a query with no allowed key gives 0
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import triton

from wiola_kernels._utils import FLOAT_DTYPES, LaunchConfig, autotuned, check_runnable, empty, fail, launch
from wiola_kernels.attention_triton import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess, _attn_fwd

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)

# ----------------------------------------------------------------------------------------------
# Configurations: autotune lists (GPU) and the fixed interpreter configs
# ----------------------------------------------------------------------------------------------


def _tile(
    block_m: int, block_n: int, warps: int, stages: int, head_dims: tuple[int, ...] = SUPPORTED_HEAD_DIMS
) -> LaunchConfig:
    """BLOCK_M query rows and BLOCK_N key rows per tile, for the head widths it compiles for without
    spills (sm_90 and sm_80)."""
    return LaunchConfig({"BLOCK_M": block_m, "BLOCK_N": block_n}, warps, stages, head_dims)


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
        _tile(128, 64, 4, 3, (16, 32)),
        _tile(128, 128, 8, 3, (16, 32)),
        _tile(128, 64, 8, 3, (16, 32, 64)),
        _tile(64, 64, 4, 3, (16, 32, 64)),
        _tile(128, 32, 8, 2, (128,)),
        _tile(64, 32, 4, 3, (128,)),
    ],
    "fp32": [
        _tile(128, 32, 8, 2, (16, 32)),
        _tile(64, 32, 8, 2, (16,)),
        _tile(64, 32, 4, 2, (32,)),
        _tile(64, 16, 8, 2, (64, 128)),
        _tile(32, 16, 4, 2, (16, 64)),
        _tile(16, 16, 4, 2, (128,)),
    ],
}
DQ_CONFIGS = {
    "half": [
        _tile(128, 32, 4, 3, (32,)),
        _tile(128, 64, 8, 3, (16, 32)),
        _tile(64, 64, 4, 3, (16, 32)),
        _tile(64, 32, 4, 3, (16, 32)),
        _tile(128, 32, 8, 3, (64,)),
        _tile(64, 16, 4, 3, (64,)),
        _tile(32, 32, 4, 2, (128,)),
        _tile(32, 16, 4, 2, (128,)),
    ],
    "fp32": [
        _tile(64, 64, 8, 2, (16,)),
        _tile(64, 32, 8, 2, (16, 32)),
        _tile(32, 32, 4, 2, (16, 32)),
        _tile(32, 16, 4, 2, (32, 64)),
        _tile(64, 16, 8, 2, (64,)),
        _tile(32, 32, 8, 2, (64,)),
        _tile(32, 16, 8, 2, (128,)),
        _tile(16, 16, 4, 2, (128,)),
    ],
}
DKDV_CONFIGS = {
    "half": [
        _tile(16, 64, 4, 3, (16, 32, 64)),
        _tile(16, 128, 8, 3, (16, 32, 64)),
        _tile(32, 64, 8, 3, (16, 32)),
        _tile(32, 128, 8, 3, (32,)),
        _tile(32, 32, 4, 2, (128,)),
        _tile(16, 32, 4, 3, (128,)),
    ],
    "fp32": [
        _tile(16, 64, 8, 2, (16, 32)),
        _tile(16, 32, 4, 2, (16, 32)),
        _tile(32, 32, 8, 2, (64,)),
        _tile(16, 16, 4, 2, (64,)),
        _tile(16, 16, 8, 2, (128,)),
        _tile(16, 16, 4, 1, (128,)),
    ],
}
PREPROCESS_BLOCK_M = 64
# Under TRITON_INTERPRET the autotuner cannot time anything: one small fixed config per kernel,
# small enough that the tests' T = 17/64/300 cross several blocks and ragged ends.
INTERPRET_FWD = _tile(32, 16, 4, 1)
INTERPRET_DQ = _tile(32, 16, 4, 1)
INTERPRET_DKDV = _tile(16, 32, 4, 1)

# Everything that changes the kernel body or its best tiles. Triton adds every tensor argument's
# dtype to the key itself (so bf16, fp16 and fp32 tune apart); HALF_PAD follows from D and
# DOT_PRECISION from the dtype. The dq/dkdv kernels have no STORE_RESIDUAL.
_AUTOTUNE_KEY = ["T_BUCKET", "D", "HAS_MASK"]


def _dtype_class(dtype: torch.dtype | str) -> str:
    """The config list a dtype tunes over: ``"fp32"`` or ``"half"`` (bf16, fp16)."""
    return "fp32" if dtype in (torch.float32, "fp32") else "half"


def _classify(named_args: dict[str, Any], constexprs: dict[str, Any]) -> tuple[str, int]:
    """A launch tries only the configs of its own dtype class (q's dtype) listed for its head width."""
    return _dtype_class(named_args["Q"].dtype), named_args.get("D", constexprs.get("D"))


_attn_fwd_tuned = autotuned(_attn_fwd, FWD_CONFIGS, [*_AUTOTUNE_KEY, "STORE_RESIDUAL"], _classify)
_attn_bwd_dq_tuned = autotuned(_attn_bwd_dq, DQ_CONFIGS, _AUTOTUNE_KEY, _classify)
_attn_bwd_dkdv_tuned = autotuned(_attn_bwd_dkdv, DKDV_CONFIGS, _AUTOTUNE_KEY, _classify)


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


def _input_strides(q, k, v, g, cos, stride_mb: int) -> list[int]:
    """The strides every attention kernel takes, in its argument order: (B, T, H) of q, k, v and g,
    (B, T) of cos/sin, B of the key mask."""
    return [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:3], *cos.stride()[:2], stride_mb]


def _t_bucket(T: int) -> int:
    return max(16, triton.next_power_of_2(T))


def _launch(tuned, fn, fixed: LaunchConfig, config: LaunchConfig | None, grid_rows: int, grid_cols: int, args, meta):
    """Run ``fn`` over (blocks of ``grid_rows``, ``grid_cols``): the held block is BLOCK_N for dkdv,
    BLOCK_M otherwise; the config by ``launch``'s rule (``fixed`` under the interpreter)."""
    block = "BLOCK_N" if fn is _attn_bwd_dkdv else "BLOCK_M"
    grid = lambda blocks: (triton.cdiv(grid_rows, blocks[block]), grid_cols)
    launch(fn, grid, args, meta, config=config, tuned=tuned, interpret=fixed)


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
    config: LaunchConfig | None = None,
) -> None:
    """Write ``o`` (B, T, H, D; any strides with unit last stride) and ``lse`` ((B, H, T) contiguous
    fp32, base 2) for already validated inputs; ``o_res`` (same shape, dtype and strides as ``o``),
    when given, receives ``o_fp32 − o`` for the backward. ``config`` forces one block configuration."""
    B, T, H, D = q.shape
    if q.numel() == 0:
        return
    if o_res is not None and (o_res.stride() != o.stride() or o_res.dtype != o.dtype):
        fail("attention", "o_res must have the dtype and strides of o")
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    cos, sin = _tables(cos, sin)
    km, stride_mb = _key_mask(attention_mask, q)
    args = [
        q, k, v, g, cos, sin, km, o, o if o_res is None else o_res, lse,
        *_input_strides(q, k, v, g, cos, stride_mb), *o.stride()[:3],
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
    dq_config: LaunchConfig | None = None,
    dkdv_config: LaunchConfig | None = None,
) -> None:
    """Write ``dq, dk, dv`` (B, T, H, D; one shared set of strides, unit last stride) and ``dg``
    (B, T, H) fp32 from the upstream gradient ``do`` and the forward's ``o``, ``lse`` and, for
    bf16/fp16, ``o_res`` (without it Δ uses the rounded ``o``: less exact dg and dk)."""
    B, T, H, D = q.shape
    if q.numel() == 0:
        return
    if not (dq.stride() == dk.stride() == dv.stride()) or dq.stride(-1) != 1:
        fail("attention", "dq, dk, dv must share strides with a unit last stride")
    q, k, v, do, o = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(do), _unit_last(o)
    if o_res is not None and o_res.stride() != o.stride():
        o, o_res = o.contiguous(), o_res.contiguous()
    cos, sin = _tables(cos, sin)
    km, stride_mb = _key_mask(attention_mask, q)
    meta = _meta(q, attention_mask is not None)
    delta = empty(B, H, T, dtype=torch.float32, device=q.device)
    pre_grid = (triton.cdiv(T, PREPROCESS_BLOCK_M), B * H)
    _attn_bwd_preprocess[pre_grid](
        o, o if o_res is None else o_res, do, delta, o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2), T, H,
        D=D, BLOCK_M=PREPROCESS_BLOCK_M, HAS_RESIDUAL=o_res is not None, num_warps=4, num_stages=1,
    )  # fmt: skip
    common = [*_input_strides(q, k, v, g, cos, stride_mb), *do.stride()[:3], *dq.stride()[:3]]
    scalars = [T, H, _t_bucket(T), LOG2E / math.sqrt(D), 1.0 / math.sqrt(D)]
    dkdv_args = [q, k, v, g, cos, sin, km, do, lse, delta, dk, dv, *common, *scalars]
    _launch(_attn_bwd_dkdv_tuned, _attn_bwd_dkdv, INTERPRET_DKDV, dkdv_config, T, B * H, dkdv_args, meta)
    dq_args = [q, k, v, g, cos, sin, km, do, lse, delta, dq, dg, *common, *dg.stride()[:3]]
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
    o = empty(B, T, H, D, dtype=q.dtype, device=q.device)
    lse = empty(B, H, T, dtype=torch.float32, device=q.device)
    o_res = empty(*((B, T, H, D) if store_residual else (0,)), dtype=q.dtype, device=q.device)
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
    dq, dk, dv = (empty(B, T, H, D, dtype=q.dtype, device=q.device) for _ in range(3))
    dg = empty(B, T, H, dtype=torch.float32, device=q.device)
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
            fail("attention", f"{name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
    if q.dim() != 4:
        fail("attention", f"q must be (B, T, H, D), got shape {tuple(q.shape)}")
    B, T, H, D = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            fail("attention", f"{name} shape {tuple(x.shape)} != q shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        fail("attention", f"q/k/v must be float32, float16 or bfloat16, got {q.dtype}", TypeError)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail("attention", f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})", TypeError)
    if D not in SUPPORTED_HEAD_DIMS:
        fail("attention", f"head dim D={D} not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if g.shape != (B, T, H):
        fail("attention", f"g shape {tuple(g.shape)} != (B, T, H) = {(B, T, H)}")
    if g.dtype != torch.float32:
        fail("attention", f"g must be float32, got {g.dtype}", TypeError)
    for name, x in (("cos", cos), ("sin", sin)):
        if x.dim() != 3 or x.shape[0] not in (1, B) or x.shape[1:] != (T, D // 2):
            fail("attention", f"{name} shape {tuple(x.shape)} != (B, T, D/2) = {(B, T, D // 2)}")
        if x.dtype != torch.float32:
            fail("attention", f"{name} must be float32, got {x.dtype}", TypeError)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            fail(
                "attention", f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}", TypeError
            )
        if attention_mask.shape != (B, T):
            fail("attention", f"attention_mask shape {tuple(attention_mask.shape)} != (B, T) = {(B, T)}")
        if attention_mask.is_complex():
            fail("attention", "attention_mask must be bool, integer or real", TypeError)
    tensors = [("q", q), ("k", k), ("v", v), ("g", g), ("cos", cos), ("sin", sin)]
    if attention_mask is not None:
        tensors.append(("attention_mask", attention_mask))
    for name, x in tensors[1:]:
        if x.device != q.device:
            fail("attention", f"{name} is on {x.device} but q is on {q.device}")
    check_runnable("attention", q, "wiola.ops.attention")


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
