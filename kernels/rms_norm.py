"""RMSNorm with the residual add fused: the same function as ``wiola.ops.rms_norm.rms_norm``,
forward and backward.

Forward, one pass: each program loads a ``(BLOCK_R, BLOCK_D)`` block of rows (a whole row per
block row, so any width up to 8,192 fits one load), forms ``h = x + residual`` rounded to the
promoted dtype exactly as the reference's ``x + residual`` is, stores ``h`` (the updated
residual stream), and normalises with fp32 statistics. Eager PyTorch makes five passes (add,
cast, square-mean, scale, cast); this makes one, reading ``x`` and ``residual`` and writing
``y``, ``h`` and one fp32 ``1/rms`` per row.

Backward keeps ``h`` (or ``x`` without a residual) and ``1/rms``; one pass per row block gives
``dh = (dy·γ − ĥ · mean(dy·γ·ĥ)) / rms + dh_upstream`` (``ĥ = h / rms``), written once in each
input's dtype (``x`` and ``residual`` share the tensor when their dtypes agree, as PyTorch's own
``add`` backward does). ``dγ = Σ_rows dy ⊙ ĥ`` is summed per program in fp32 over a fixed,
strided set of row blocks and the ``(programs, d)`` partials are reduced afterwards: no
atomics, bit-identical run to run.
"""

import torch
import triton
import triton.language as tl

from wiola_kernels._utils import FLOAT_DTYPES, LaunchConfig, check_runnable, check_tensor, empty, fail, sm_count

MAX_WIDTH = 8192

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _fwd_kernel(
    X,  # (N, D)
    RES,  # (N, D), read only when HAS_RESIDUAL
    W,  # (D,) γ
    Y,  # (N, D) out, in h's dtype
    H,  # (N, D) out h = x + residual, written only when HAS_RESIDUAL
    RSTD,  # (N,) fp32 out: 1 / sqrt(mean(h²) + eps)
    N,
    D,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < N
    mask = row_mask[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        h_out = h.to(H.dtype.element_ty)  # the reference adds in the promoted dtype
        tl.store(H + offs, h_out, mask=mask)
        h = h_out.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + eps)  # (BLOCK_R,)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = h * rstd[:, None] * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _bwd_kernel(
    DY,  # (N, D) gradient of y
    DH,  # (N, D) gradient flowing into the returned h, read only when HAS_DH
    HX,  # (N, D) h (with a residual) or x (without)
    W,  # (D,)
    RSTD,  # (N,) fp32
    DX,  # (N, D) out, x's dtype
    DRES,  # (N, D) out, residual's dtype, written only when SEPARATE_DRES
    DW_PARTIAL,  # (programs, D) fp32 out: this program's Σ dy ⊙ ĥ
    N,
    D,
    HAS_DH: tl.constexpr,
    SEPARATE_DRES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for block in range(pid, tl.cdiv(N, BLOCK_R), n_programs):
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < N
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        h_hat = tl.load(HX + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        dw += dy * h_hat
        wdy = dy * w[None, :]
        proj = tl.sum(wdy * h_hat, axis=1) / D  # (BLOCK_R,)
        dh = (wdy - h_hat * proj[:, None]) * rstd[:, None]
        if HAS_DH:
            dh += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dh.to(DX.dtype.element_ty), mask=mask)
        if SEPARATE_DRES:
            tl.store(DRES + offs, dh.to(DRES.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * D + cols, tl.sum(dw, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------- launch shapes


def _block(D: int) -> LaunchConfig:
    """``BLOCK_R`` rows of ``BLOCK_D`` and the warps of a launch: whole rows, up to 16 of them and ≥ 4,096 elements a block.
    One row a block: 8 elements a thread (one 16-byte load of bf16); at 16 a thread the 8,192-wide
    backward with an unaligned width spilled (16 warps cap a thread at 128 registers). Several
    rows a block: at most 8 warps (16 elements a thread); with 16, sm_90 reserved 8 bytes of
    stack for the unaligned 4 x 1,024 bf16 forward at 40 registers."""
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(16, 4096 // block_d))
    warps = max(4, min(32 if block_r == 1 else 8, block_r * block_d // 256))
    return LaunchConfig({"BLOCK_R": block_r, "BLOCK_D": block_d}, num_warps=warps, num_stages=1)


def _bwd_programs(device: torch.device, n_blocks: int) -> int:
    """Programs of the backward: a few per SM, each looping over a fixed stride of row blocks,
    so the dγ partials stay small ((programs, d) fp32) and their order never changes."""
    limit = 4 * sm_count(device)
    return max(1, min(n_blocks, limit))


def _forward(x, weight, eps: float, residual, y, h, rstd) -> None:
    """``y`` (and ``h`` with a residual) (N, D) and ``rstd`` (N,) from contiguous ``x`` (N, D)."""
    N, D = x.shape
    if N == 0:
        return
    cfg = _block(D)
    _fwd_kernel[(triton.cdiv(N, cfg["BLOCK_R"]),)](
        x, x if residual is None else residual, weight, y, y if residual is None else h, rstd, N, D, eps,
        HAS_RESIDUAL=residual is not None, **cfg.kwargs(),
    )  # fmt: skip


def _backward_partial(dy, dh, hx, weight, rstd, dx, dres, partial) -> None:
    """``dx`` (and ``dres`` when given) (N, D) and the dγ ``partial`` (programs, D) from contiguous
    inputs; ``partial.shape[0]`` is the number of programs (see ``_bwd_programs``)."""
    N, D = hx.shape
    _bwd_kernel[(partial.shape[0],)](
        dy, dy if dh is None else dh, hx, weight, rstd, dx, dx if dres is None else dres, partial, N, D,
        HAS_DH=dh is not None, SEPARATE_DRES=dres is not None, **_block(D).kwargs(),
    )  # fmt: skip


# ----------------------------------------------------------------------------- torch ops


@torch.library.custom_op("wiola::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, D) → ``y``, ``h`` (empty without a residual) and fp32 ``rstd`` (N,)."""
    x, weight = x.contiguous(), weight.contiguous()
    N, D = x.shape
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = empty(N, D, dtype=h_dtype, device=x.device)
    h = empty(N if residual is not None else 0, D, dtype=h_dtype, device=x.device)
    rstd = empty(N, dtype=torch.float32, device=x.device)
    _forward(x, weight, eps, None if residual is None else residual.contiguous(), y, h, rstd)
    return y, h, rstd


@_rms_norm_fwd.register_fake
def _(x, weight, eps, residual):
    N, D = x.shape
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    h = x.new_empty(N if residual is not None else 0, D, dtype=h_dtype)
    return x.new_empty(N, D, dtype=h_dtype), h, x.new_empty(N, dtype=torch.float32)


@torch.library.custom_op("wiola::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    hx: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dx`` (x's dtype), ``dres`` (residual's dtype; empty when there is no residual or it
    shares x's dtype, then ``dx`` serves both) and ``dγ`` (weight's dtype)."""
    dy, hx, weight = dy.contiguous(), hx.contiguous(), weight.contiguous()
    dh = None if dh is None else dh.contiguous()
    N, D = hx.shape
    separate = residual_dtype is not None and residual_dtype != x_dtype
    dx = empty(N, D, dtype=x_dtype, device=hx.device)
    dres = empty(N if separate else 0, D, dtype=residual_dtype or x_dtype, device=hx.device)
    if N == 0:
        return dx, dres, torch.zeros_like(weight)
    partial = empty(
        _bwd_programs(hx.device, triton.cdiv(N, _block(D)["BLOCK_R"])), D, dtype=torch.float32, device=hx.device
    )
    _backward_partial(dy, dh, hx, weight, rstd, dx, dres if separate else None, partial)
    return dx, dres, partial.sum(dim=0).to(weight.dtype)


@_rms_norm_bwd.register_fake
def _(dy, dh, hx, weight, rstd, x_dtype, residual_dtype):
    N, D = hx.shape
    separate = residual_dtype is not None and residual_dtype != x_dtype
    dres = hx.new_empty(N if separate else 0, D, dtype=residual_dtype or x_dtype)
    return hx.new_empty(N, D, dtype=x_dtype), dres, torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _eps, residual = inputs
    _y, h, rstd = output
    ctx.mark_non_differentiable(rstd)
    if residual is None:
        ctx.mark_non_differentiable(h)
    ctx.save_for_backward(x if residual is None else h, weight, rstd)
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype


def _backward(ctx, dy: torch.Tensor, dh: torch.Tensor | None, _drstd: torch.Tensor | None):
    hx, weight, rstd = ctx.saved_tensors
    if ctx.residual_dtype is None:
        dh = None
    dx, dres, dw = torch.ops.wiola.rms_norm_bwd(dy, dh, hx, weight, rstd, ctx.x_dtype, ctx.residual_dtype)
    if ctx.residual_dtype is None:
        return dx, dw, None, None
    return dx, dw, None, dx if ctx.residual_dtype == ctx.x_dtype else dres


torch.library.register_autograd("wiola::rms_norm_fwd", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public function


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x / sqrt(mean(x²) + eps) ⊙ γ`` over the last dimension, statistics in float32.

    Fused twin of ``wiola.ops.rms_norm.rms_norm`` (same arguments, results and gradients).

    Args:
        x: ``(..., d)`` with ``1 ≤ d ≤ 8192``, float32/bfloat16/float16, on CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        weight: ``(d,)`` γ, any of those dtypes.
        eps: added to the mean square.
        residual: optional ``(..., d)``; then ``h = x + residual`` (torch's type promotion, so
            a bf16 branch plus an fp32 stream gives fp32) is normalised instead of ``x``.

    Returns ``y`` (``(..., d)``, dtype of ``h``), or ``(y, h)`` with ``residual``.

    Raises:
        ValueError: mismatched shapes, ``d`` above 8,192, tensors on different devices, or tensors
            the kernels cannot run on (CPU without the Triton interpreter).
        TypeError: a dtype other than float32/bfloat16/float16.
    """
    check_tensor("rms_norm", "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        fail("rms_norm", f"x must have at least one dimension, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    check_tensor("rms_norm", "weight", weight, shape=(d,), dtypes=FLOAT_DTYPES, device=x.device)
    if residual is not None:
        check_tensor("rms_norm", "residual", residual, shape=tuple(x.shape), dtypes=FLOAT_DTYPES, device=x.device)
    if not 1 <= d <= MAX_WIDTH:
        fail("rms_norm", f"row width must be in 1..{MAX_WIDTH}, got {d}")
    check_runnable("rms_norm", x, "wiola.ops.rms_norm")
    lead = x.shape[:-1]
    res2d = None if residual is None else residual.reshape(-1, d)
    y, h, _ = torch.ops.wiola.rms_norm_fwd(x.reshape(-1, d), weight, float(eps), res2d)
    if residual is None:
        return y.view(*lead, d)
    return y.view(*lead, d), h.view(*lead, d)
