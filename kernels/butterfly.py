"""The butterfly feed-forward block (docs/SPEC.md eq. 14-16), fused: the same function as
``wiola.ops.butterfly.butterfly``, forward and backward.

Forward, two kernels:

1. ``_up_kernel`` reads each ``(BLOCK_M, BLOCK_K)`` tile of ``x`` once and feeds three
   accumulators side by side — ``a`` and ``b`` (the two halves of ``W_up``) and ``c``
   (``W_bp``) — then writes only ``r = SiLU(a) ⊙ b + c``. Eager PyTorch reads ``x`` twice and
   writes ``[a ‖ b]``, ``c``, ``SiLU(a)``, ``SiLU(a) ⊙ b`` and ``r`` (five ``N × d_ff``-sized
   intermediates, three of them kept for the backward).
2. ``_down_kernel``: ``y = r W_downᵀ`` with the residual add in the epilogue. The matmul result
   is rounded to the branch dtype first and then added in fp32 and stored in the promoted dtype,
   exactly as the reference's ``F.linear(...) + residual`` does (fp32 residual stream + bf16
   branch gives fp32). cuBLAS could fuse the add only through ``addmm``'s ``beta·C``, which needs
   one dtype for C and the product, so it cannot serve the fp32-stream/bf16-branch case without
   a separate pass over ``y`` (``N·d`` written, read back, and the fp32 sum written). The down
   projection is small (K = d_ff = 512, N = d = 256 at the paper's shapes): it is bandwidth- not
   FLOP-bound, so saving that pass is worth more than cuBLAS's better mainloop. Unmeasured:
   ``bench/test_butterfly.py`` compares it with the eager and ``torch.compile`` references.

What the backward keeps (the memory/time trade-off): only ``x`` and ``r`` (``N·d + N·d_ff``
elements; ``r`` is needed for ``∂W_down = dyᵀ r`` and exists anyway as the down projection's
input). ``a`` and ``b`` are **recomputed** in the backward instead of saved: the backward
kernel already streams over ``d`` (K of ``dr = dy W_down``), so it reads the ``x`` tile of
the same rows alongside and accumulates ``a``, ``b`` next to ``dr`` — no extra launch, one
extra read of ``x`` (``N·d``) and ``2·N·d·2d_ff`` FLOPs (≈ 17% of the block's forward+backward
FLOPs). Saving them instead would cost ``2·N·d_ff`` elements per layer in memory (32 MB per
layer at N 16,384, d_ff 512, bf16; the eager reference keeps about ``4·N·d_ff``) plus writing
and reading them back (64 MB of traffic, ~20 µs at H200 bandwidth) — about what the recompute
costs in tensor-core time, so the recompute wins on memory at no expected loss in time.

Backward: ``_up_bwd_kernel`` computes ``dr = dy W_down`` and recomputes ``a, b`` in one pass
over K = d, and writes ``[da ‖ db ‖ dc]`` (``dc = dr``) into one ``(N, 3·d_ff)`` buffer. The
four remaining matmuls go to cuBLAS through ``torch.mm``: the weight gradients reduce over all
N rows (K = N = 16,384), which cuBLAS splits and schedules well and a hand-written Triton
kernel would need split-K plus a reduction to match; ``dx = [da ‖ db ‖ dc] [W_up; W_bp]`` is
one plain GEMM with K = 3·d_ff (one rounding instead of the reference's two partial sums).

Tiles: bf16/fp16 on CUDA are autotuned over a few configs (keyed on d, d_ff and N rounded up to
a power of two, so a decode step's batch does not fix the training tiles) when every width and
address is a multiple of 16 — the case Triton's JIT specializes into vectorised, pipelined loads;
each config is built ahead of time for sm_90 (wgmma) and sm_80 without spills. Launches of at most
``FEW_ROWS`` rows (decoding steps) also try narrow 16-row tiles that give the GPU more programs
and fewer K steps each. Anything else (fp32, the CPU interpreter, a width such as d = 100) takes
one small 32×32×32 tile, also built spill-free. fp32 uses
``tl.dot(..., input_precision="ieee")``, so fp32 results match the reference to ~1e-6 relative.
Frozen weights (``requires_grad=False``) skip their gradient GEMMs.
"""

from typing import Any

import torch
import triton
import triton.language as tl

from wiola_kernels._utils import (
    FLOAT_DTYPES,
    LaunchConfig,
    autotuned,
    check_runnable,
    check_tensor,
    empty,
    fail,
    launch,
)

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _output_tile(N, COLS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's (BLOCK_M, BLOCK_N) tile of an (N, COLS) output: its rows (int64, for the
    row offsets), columns and the K offsets of one step, and the row and column masks."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m.to(tl.int64), offs_n, tl.arange(0, BLOCK_K), offs_m < N, offs_n < COLS


@triton.jit
def _up_products(
    X, DY, W_UP, W3, rows, offs_n, offs_k, mask_m, mask_n, D, F,
    BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The three fp32 (BLOCK_M, BLOCK_N) products of one up-projection tile, one pass over K = D:
    ``a``, ``b`` (x times the two halves of W_upᵀ) and a third, ``c = x W_bpᵀ`` (W3 = W_bp, (F, D))
    or with BACKWARD ``dr = dy W_down`` (W3 = W_down, (D, F); DY is read only then)."""
    x_ptrs = X + rows[:, None] * D + offs_k[None, :]  # (BM, BK)
    if BACKWARD:
        dy_ptrs = DY + rows[:, None] * D + offs_k[None, :]  # (BM, BK)
    wa_ptrs = W_UP + offs_n[None, :] * D + offs_k[:, None]  # (BK, BN): W_up[n, k]
    wb_ptrs = wa_ptrs + F * D
    if BACKWARD:
        w3_ptrs = W3 + offs_k[:, None] * F + offs_n[None, :]  # (BK, BN): W_down[k, n]
    else:
        w3_ptrs = W3 + offs_n[None, :] * D + offs_k[:, None]  # (BK, BN): W_bp[n, k]
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        mask_k = offs_k < D - k0
        a_mask = mask_m[:, None] & mask_k[None, :]
        w_mask = mask_k[:, None] & mask_n[None, :]
        x = tl.load(x_ptrs, mask=a_mask, other=0.0)
        if BACKWARD:
            a3 = tl.load(dy_ptrs, mask=a_mask, other=0.0)
        else:
            a3 = x
        wa = tl.load(wa_ptrs, mask=w_mask, other=0.0)
        wb = tl.load(wb_ptrs, mask=w_mask, other=0.0)
        w3 = tl.load(w3_ptrs, mask=w_mask, other=0.0)
        acc_a = tl.dot(x, wa, acc_a, input_precision=PRECISION)
        acc_b = tl.dot(x, wb, acc_b, input_precision=PRECISION)
        acc_3 = tl.dot(a3, w3, acc_3, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        if BACKWARD:
            dy_ptrs += BLOCK_K
        wa_ptrs += BLOCK_K
        wb_ptrs += BLOCK_K
        if BACKWARD:
            w3_ptrs += BLOCK_K * F
        else:
            w3_ptrs += BLOCK_K
    return acc_a, acc_b, acc_3


@triton.jit
def _up_kernel(
    X,  # (N, D)
    W_UP,  # (2F, D): rows [0, F) give a, rows [F, 2F) give b
    W_BP,  # (F, D)
    R,  # (N, F) out: SiLU(a) ⊙ b + c
    N,
    D,
    F,
    N_BUCKET,  # only keys the autotuner
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows, offs_n, offs_k, mask_m, mask_n = _output_tile(N, F, BLOCK_M, BLOCK_N, BLOCK_K)
    acc_a, acc_b, acc_c = _up_products(X, X, W_UP, W_BP, rows, offs_n, offs_k, mask_m, mask_n, D, F, False,
                                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)  # fmt: skip
    r = acc_a * tl.sigmoid(acc_a) * acc_b + acc_c
    r_ptrs = R + rows[:, None] * F + offs_n[None, :]
    tl.store(r_ptrs, r.to(R.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    R,  # (N, F)
    W_DOWN,  # (D, F)
    RES,  # (N, D) residual (any float dtype), read only when HAS_RESIDUAL
    Y,  # (N, D) out, in the promoted dtype of (branch, residual)
    N,
    D,
    F,
    N_BUCKET,  # only keys the autotuner
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows, offs_n, offs_k, mask_m, mask_n = _output_tile(N, D, BLOCK_M, BLOCK_N, BLOCK_K)
    r_ptrs = R + rows[:, None] * F + offs_k[None, :]  # (BM, BK)
    w_ptrs = W_DOWN + offs_n[None, :] * F + offs_k[:, None]  # (BK, BN): W_down[n, k]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        mask_k = offs_k < F - k0
        r = tl.load(r_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(r, w, acc, input_precision=PRECISION)
        r_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # Round to the branch dtype like F.linear does, then add the residual in fp32.
    y = acc.to(R.dtype.element_ty).to(tl.float32)
    out_mask = mask_m[:, None] & mask_n[None, :]
    out_offs = rows[:, None] * D + offs_n[None, :]
    if HAS_RESIDUAL:
        y += tl.load(RES + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(Y + out_offs, y.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _up_bwd_kernel(
    DY,  # (N, D) gradient of the branch output, in the branch dtype
    X,  # (N, D)
    W_UP,  # (2F, D)
    W_DOWN,  # (D, F)
    DABC,  # (N, 3F) out: [da ‖ db ‖ dc]
    N,
    D,
    F,
    N_BUCKET,  # only keys the autotuner
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows, offs_n, offs_k, mask_m, mask_n = _output_tile(N, F, BLOCK_M, BLOCK_N, BLOCK_K)
    acc_a, acc_b, acc_dr = _up_products(X, DY, W_UP, W_DOWN, rows, offs_n, offs_k, mask_m, mask_n, D, F, True,
                                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)  # fmt: skip
    sig = tl.sigmoid(acc_a)
    silu = acc_a * sig
    # d SiLU(a)/da = σ(a) (1 + a (1 − σ(a)))
    da = acc_dr * acc_b * sig * (1.0 + acc_a * (1.0 - sig))
    db = acc_dr * silu
    out_mask = mask_m[:, None] & mask_n[None, :]
    d_ptrs = DABC + rows[:, None] * (3 * F) + offs_n[None, :]
    out_ty = DABC.dtype.element_ty
    tl.store(d_ptrs, da.to(out_ty), mask=out_mask)
    tl.store(d_ptrs + F, db.to(out_ty), mask=out_mask)
    tl.store(d_ptrs + 2 * F, acc_dr.to(out_ty), mask=out_mask)


# ----------------------------------------------------------------------------- configs


# bf16/fp16 autotune candidates, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). The up
# kernels hold three (BM, BN) fp32 accumulators (96 registers a thread at BM·BN = 4,096 per 128
# threads); BLOCK_M ≥ 64 and 4/8 warps let sm_90 use wgmma. Shared memory a stage: (BM + 3·BN)·BK·2
# bytes forward, (2·BM + 3·BN)·BK·2 backward. Every entry builds for sm_90 and sm_80 without spills
# (tests/test_compile.py); the backward's five operand tiles need BK = 32 for that on sm_80.
def _tile(m: int, n: int, k: int, warps: int, stages: int) -> LaunchConfig:
    return LaunchConfig({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)


_UP_CONFIGS = [_tile(64, 64, 64, 4, 3), _tile(128, 64, 64, 8, 3), _tile(128, 64, 32, 8, 4), _tile(64, 128, 32, 8, 3)]
_UP_BWD_CONFIGS = [_tile(64, 64, 32, 4, 4), _tile(128, 64, 32, 8, 4), _tile(64, 128, 32, 8, 3)]
_DOWN_CONFIGS = [_tile(64, 64, 64, 4, 4), _tile(128, 64, 64, 4, 4), _tile(64, 128, 64, 4, 4), _tile(128, 128, 64, 8, 3)]
# Few rows (a decoding step: N = batch): the tiles above give a 13m layer (d 256, d_ff 512) 4-8
# programs for the whole GPU, each walking K in 4-8 dependent steps of loads, so the step's
# time is a chain of memory latencies, not bandwidth. These cut the columns finer (16-32 wide:
# up to 32 programs) and take K in 1-4 longer steps; BLOCK_M 16 is tl.dot's least. Tried beside
# the tiles above for N up to FEW_ROWS (the autotuner keeps the faster); larger N never sees them.
FEW_ROWS = 64
_UP_FEW_ROW_CONFIGS = [_tile(16, 16, 256, 2, 2), _tile(16, 32, 64, 4, 3), _tile(16, 32, 128, 4, 2)]
_DOWN_FEW_ROW_CONFIGS = [_tile(16, 16, 256, 4, 2), _tile(16, 16, 128, 2, 3), _tile(16, 32, 128, 4, 3)]
# One small fixed tile for everything else: fp32 (ieee, no tensor cores), the CPU interpreter,
# and inputs whose widths or addresses are not multiples of 16 (the compiler then cannot
# vectorise loads, and the large tiles above would spill).
_SMALL_CONFIG = _tile(32, 32, 32, 4, 2)


# Tuned per (widths, N bucket): the best tiles depend on how many row blocks fill the GPU, so a
# decode step's N = batch must not fix the training tiles (or the reverse). Triton adds every
# tensor's dtype to the key (the residual's and output's included); PRECISION is always "ieee".
N_BUCKET_CAP = 16384  # beyond it every config fills the GPU many times over: one choice


def _n_bucket(N: int) -> int:
    """N rounded up to a power of two in [16, N_BUCKET_CAP] (always a multiple of 16)."""
    return min(N_BUCKET_CAP, max(16, triton.next_power_of_2(N)))


def _rows_class(named_args: dict[str, Any], constexprs: dict[str, Any]) -> tuple[str, int]:
    """The autotune class of a launch: ``"few"`` rows (N bucket ≤ FEW_ROWS) or ``"many"``."""
    return ("few" if named_args["N_BUCKET"] <= FEW_ROWS else "many"), 0


UP_CONFIGS = {"few": _UP_FEW_ROW_CONFIGS + _UP_CONFIGS, "many": _UP_CONFIGS}
DOWN_CONFIGS = {"few": _DOWN_FEW_ROW_CONFIGS + _DOWN_CONFIGS, "many": _DOWN_CONFIGS}
_up_tuned = autotuned(_up_kernel, UP_CONFIGS, ["N_BUCKET", "D", "F"], _rows_class)
_up_bwd_tuned = autotuned(_up_bwd_kernel, _UP_BWD_CONFIGS, key=["N_BUCKET", "D", "F"])
_down_tuned = autotuned(_down_kernel, DOWN_CONFIGS, ["N_BUCKET", "D", "F", "HAS_RESIDUAL"], _rows_class)


def _aligned(D: int, F: int, *tensors: torch.Tensor) -> bool:
    """Whether Triton's JIT will see every width and address as a multiple of 16 (the case the
    autotune configs are built and checked for)."""
    return D % 16 == 0 and F % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def _launch(
    kernel, tuned, grid_cols: int, N: int, D: int, F: int, *args, config: LaunchConfig | None = None, **constexprs
) -> None:
    """Launch ``kernel`` over (rows of N) × (columns of ``grid_cols``): ``config`` if given (tests
    force each tile with it); else autotuned for aligned bf16/fp16 on CUDA, the small fixed tile
    otherwise (and under the interpreter)."""
    if N == 0:
        return
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    tune = tensors[0].is_cuda and tensors[0].dtype != torch.float32 and _aligned(D, F, *tensors)
    launch(
        kernel,
        lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), triton.cdiv(grid_cols, meta["BLOCK_N"])),
        args,
        {**constexprs, "PRECISION": "ieee"},
        config=config,
        tuned=tuned if tune else None,
        interpret=_SMALL_CONFIG,
        default=_SMALL_CONFIG,
    )


def _up(
    x: torch.Tensor, w_up: torch.Tensor, w_bp: torch.Tensor, r: torch.Tensor, config: LaunchConfig | None = None
) -> None:
    """``r`` (N, F) ← SiLU(a) ⊙ b + c for contiguous ``x`` (N, D) and weights."""
    (N, D), F = x.shape, w_bp.shape[0]
    _launch(_up_kernel, _up_tuned, F, N, D, F, x, w_up, w_bp, r, N, D, F, _n_bucket(N), config=config)


def _down(
    r: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None,
    y: torch.Tensor,
    config: LaunchConfig | None = None,
) -> None:
    """``y`` (N, D) ← r W_downᵀ (+ residual) for contiguous ``r`` (N, F), ``w_down`` (D, F)."""
    (N, F), D = r.shape, w_down.shape[0]
    res = y if residual is None else residual  # y: a placeholder never read
    _launch(
        _down_kernel,
        _down_tuned,
        D,
        N,
        D,
        F,
        r,
        w_down,
        res,
        y,
        N,
        D,
        F,
        _n_bucket(N),
        config=config,
        HAS_RESIDUAL=residual is not None,
    )


def _up_bwd(dy: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, dabc: torch.Tensor) -> None:
    """``dabc`` (N, 3F) ← [da ‖ db ‖ dr] for contiguous ``dy``, ``x`` (N, D) and weights."""
    (N, D), F = x.shape, w_down.shape[1]
    _launch(_up_bwd_kernel, _up_bwd_tuned, F, N, D, F, dy, x, w_up, w_down, dabc, N, D, F, _n_bucket(N))


# ----------------------------------------------------------------------------- torch ops


@torch.library.custom_op("wiola::butterfly_fwd", mutates_args=())
def _butterfly_fwd(
    x: torch.Tensor, w_up: torch.Tensor, w_bp: torch.Tensor, w_down: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, d) → ``y`` (N, d) in the promoted dtype, and ``r`` (N, d_ff) kept for the backward."""
    x, w_up, w_bp, w_down = x.contiguous(), w_up.contiguous(), w_bp.contiguous(), w_down.contiguous()
    N, D = x.shape
    F = w_bp.shape[0]
    r = empty(N, F, dtype=x.dtype, device=x.device)
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = empty(N, D, dtype=out_dtype, device=x.device)
    _up(x, w_up, w_bp, r)
    _down(r, w_down, None if residual is None else residual.contiguous(), y)
    return y, r


@_butterfly_fwd.register_fake
def _(x, w_up, w_bp, w_down, residual):
    N, D = x.shape
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return x.new_empty(N, D, dtype=out_dtype), x.new_empty(N, w_bp.shape[0])


@torch.library.custom_op("wiola::butterfly_up_bwd", mutates_args=())
def _butterfly_up_bwd(dy: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``[da ‖ db ‖ dc]`` (N, 3·d_ff) from the branch gradient ``dy`` (N, d), recomputing a, b."""
    dy, x, w_up, w_down = dy.contiguous(), x.contiguous(), w_up.contiguous(), w_down.contiguous()
    N, D = x.shape
    F = w_down.shape[1]
    dabc = empty(N, 3 * F, dtype=x.dtype, device=x.device)
    _up_bwd(dy, x, w_up, w_down, dabc)
    return dabc


@_butterfly_up_bwd.register_fake
def _(dy, x, w_up, w_down):
    return x.new_empty(x.shape[0], 3 * w_down.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, w_up, w_bp, w_down, residual = inputs
    _, r = output
    ctx.mark_non_differentiable(r)
    ctx.save_for_backward(x, w_up, w_bp, w_down, r)
    ctx.residual_dtype = None if residual is None else residual.dtype


def _backward(ctx, dy: torch.Tensor, _dr: torch.Tensor | None):
    x, w_up, w_bp, w_down, r = ctx.saved_tensors
    F = w_bp.shape[0]
    dy_branch = dy.to(x.dtype)  # the gradient reaching W_down r (the reference's `y` before `+ residual`)
    need_x, need_up, need_bp, need_down, _ = ctx.needs_input_grad  # frozen weights skip their GEMMs
    dx = dw_up = dw_bp = dw_down = dres = None
    if need_x or need_up or need_bp:
        dabc = torch.ops.wiola.butterfly_up_bwd(dy_branch, x, w_up, w_down)  # (N, 3F)
        dx = dabc @ torch.cat([w_up, w_bp]) if need_x else None  # (N, D)
        dw_up = dabc[:, : 2 * F].t() @ x if need_up else None  # (2F, D)
        dw_bp = dabc[:, 2 * F :].t() @ x if need_bp else None  # (F, D)
    if need_down:
        dw_down = dy_branch.t() @ r  # (D, F)
    if ctx.residual_dtype is not None:
        dres = dy.to(ctx.residual_dtype)
    return dx, dw_up, dw_bp, dw_down, dres


torch.library.register_autograd("wiola::butterfly_fwd", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public function


def butterfly(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_bp: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W_down (SiLU(a) ⊙ b + W_bp x)`` with ``[a ‖ b] = x W_upᵀ``, plus ``residual`` if given.

    Fused twin of ``wiola.ops.butterfly.butterfly`` (same arguments, same result, same gradients).

    Args:
        x: ``(..., d)``, float32/bfloat16/float16, on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        w_up: ``(2·d_ff, d)``; w_bp: ``(d_ff, d)``; w_down: ``(d, d_ff)``, all in ``x``'s dtype.
        residual: optional ``(..., d)`` (float32/bfloat16/float16) added to the output, with
            torch's type promotion (an fp32 residual stream plus a bf16 branch gives fp32).

    Returns ``(..., d)`` in the matmul dtype, or the promoted dtype with ``residual``. Under
    ``torch.autocast`` the matmul inputs are cast to the autocast dtype first, as ``F.linear``
    does in the reference.

    Raises:
        ValueError: shapes that do not fit together, tensors on different devices, or tensors
            the kernels cannot run on (CPU without the Triton interpreter).
        TypeError: a dtype other than float32/bfloat16/float16, or weights whose dtype differs
            from ``x``'s outside autocast.
    """
    check_tensor("butterfly", "x", x, dtypes=FLOAT_DTYPES)
    check_tensor("butterfly", "w_bp", w_bp, shape=(None, None), dtypes=FLOAT_DTYPES, device=x.device)
    if x.dim() < 1:
        fail("butterfly", f"x must have at least one dimension, got shape {tuple(x.shape)}")
    d, d_ff = x.shape[-1], w_bp.shape[0]
    for name, t, shape in (("w_up", w_up, (2 * d_ff, d)), ("w_bp", w_bp, (d_ff, d)), ("w_down", w_down, (d, d_ff))):
        check_tensor("butterfly", name, t, shape=shape, dtypes=FLOAT_DTYPES, device=x.device)
    if residual is not None:
        check_tensor("butterfly", "residual", residual, shape=tuple(x.shape), dtypes=FLOAT_DTYPES, device=x.device)
    check_runnable("butterfly", x, "wiola.ops.butterfly")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w_up, w_bp, w_down = (t.to(dtype) for t in (x, w_up, w_bp, w_down))
    for name, t in (("w_up", w_up), ("w_bp", w_bp), ("w_down", w_down)):
        if t.dtype != x.dtype:
            fail(
                "butterfly", f"{name} must have x's dtype {x.dtype} (cast them to one dtype), got {t.dtype}", TypeError
            )

    lead = x.shape[:-1]
    res2d = None if residual is None else residual.reshape(-1, d)
    y, _ = torch.ops.wiola.butterfly_fwd(x.reshape(-1, d), w_up, w_bp, w_down, res2d)
    return y.view(*lead, d)
