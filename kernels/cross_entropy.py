"""Linear cross-entropy for the tied head without materialising the ``(N, V)`` logits.

``linear_cross_entropy(h, weight, labels)`` computes what ``wiola.ops.linear_cross_entropy``
computes — the fp32 mean of ``cross_entropy(h · weightᵀ, labels)`` over the rows whose label is
not ``ignore_index`` — forward and backward, while holding at most one chunk of logits.

Design: chunked over rows (Liger-Kernel style), not blockwise (Cut Cross-Entropy style)
----------------------------------------------------------------------------------------
For each chunk of ``C`` rows: ``logits = h_c · Wᵀ`` (cuBLAS, into one reused ``C × V`` buffer in
the input dtype, rows padded to a multiple of 128 columns for aligned loads); one Triton program per row computes the fp32 log-sum-exp online over
``V`` blocks and the row's loss, then overwrites the logits *in place* with the softmax gradient
``(softmax − onehot) / n_counted``; ``dh_c = G · W`` (cuBLAS) and ``dW += Gᵀ · h_c`` (a Triton
GEMM that accumulates in fp32 and writes the input dtype after the last chunk).

- **Memory.** Extra bytes ≈ ``C·V·s`` (the chunk, ``s`` = element size) ``+ 4·V·d`` (the fp32
  ``dW`` accumulator; only for fp16/bf16 with more than one chunk) ``+ 4·N`` (per-row losses).
  ``chunk_rows`` picks the largest power of two ``C`` in [128, 1024] that keeps this within
  ``MEMORY_FRACTION`` (5 %) of the fp32 logits ``4·N·V``. At N 16,384,
  V 50,257, d 256, bf16: ``C`` = 1,024, 103.0 MB + 51.5 MB + 64 KB = 154.6 MB = 4.7 % of the
  3.29 GB avoided; the gradients ``dh`` (8.4 MB) and ``dW`` (25.7 MB), which every
  implementation returns, come on top. Cut Cross-Entropy needs almost nothing (the per-row
  LSE), but the 5 % target does not need that.
- **Bytes of the fp32 dW accumulator.** Every chunk but the first reads it and every chunk but
  the last writes it (``8·V·d`` per chunk), the last writes ``dW`` in the input dtype: with
  ``k = ⌈N/C⌉`` chunks, ``(k − 1)·8·V·d + s·V·d``. The larger ``C``, the fewer round trips, so
  the chunk is the largest the memory target allows (not the smallest that would do). The 13m
  preset's training step (N 32×512 = 16,384, V 32,000, d 256, bf16), ``V·d`` = 8.19 M:
  at ``C`` = 512 (the 4 % target before) k = 32: 31 × 65.5 MB + 16.4 MB = **2.05 GB** per step;
  at ``C`` = 1,024 (now; extra memory 65.5 + 32.8 MB = 98.4 MB = 4.7 % of 2.10 GB) k = 16:
  15 × 65.5 MB + 16.4 MB = **0.999 GB**, half. For scale, the chunks' own traffic (GEMM write,
  row kernel 2 reads + 1 write, the two gradient GEMMs' reads: 6·N·V·s) is 6.29 GB either way.
  Dropping the round trip entirely needs the whole ``G`` at once (the logits we avoid) or a
  second logits GEMM (chunking over V after an LSE pass), neither worth 1 GB at d 256.
- **Time.** Three GEMMs of ``2·N·V·d`` FLOPs — the minimum, because the gradient is formed
  while the logits chunk is still in memory — on cuBLAS plus one Triton GEMM, and one
  memory-bound pass that reads the chunk twice and writes it once. Cut Cross-Entropy avoids the
  ``N·V`` memory traffic but recomputes the logits in the backward (four GEMMs, all in Triton)
  and filters small gradient tiles; at d 256 the head GEMMs are short in K, so the extra GEMM
  is not free. Which one is faster on an H200 at these shapes has not been measured.
- **Determinism.** No atomics: every ``dW`` tile belongs to one program, chunks are added in a
  fixed order, the loss is ``torch.sum`` of the per-row losses. Bitwise reproducible run to run.
  Blockwise CCE needs atomics (or per-block partial buffers) for ``dh`` and ``dW``.
- **Complexity.** Two small Triton kernels; the data-heavy GEMMs stay with cuBLAS.

Gradients are computed in the forward
-------------------------------------
When ``torch.is_grad_enabled()`` and ``h`` (or ``weight``) requires grad — decided in the Python
wrapper, hence at trace time under ``torch.compile`` — the op also returns ``dh`` (and ``dW``)
for an upstream gradient of 1; autograd saves them and the backward only multiplies them by the
upstream scalar. So the logits are never recomputed, and between forward and backward the op
holds ``dh`` (N × d) and ``dW`` (V × d) in the input dtype instead of any logits. Under
``torch.no_grad()``/``inference_mode`` only the loss is computed (one GEMM per chunk, no
gradient buffers). Consequences: the backward is not itself differentiable (no double
backward); a loss computed with grad enabled but never backpropagated wasted its gradient work
(evaluate under ``torch.no_grad()``).

Numerics match the reference: logits are produced in the input dtype (as ``F.linear`` does),
the log-sum-exp and the loss are fp32 and stable for logits of ±1e4 (max subtracted,
``loss = (max − logit_label) + log Σ exp(logit − max)``), the softmax gradient is rounded to the
input dtype before the two gradient GEMMs (as autograd does through ``.float()``), and all
GEMMs accumulate in fp32, ``dW`` across chunks too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wiola_kernels._utils import (
    TRITON_DTYPE,
    LaunchConfig,
    check_tensor,
    empty,
    fail,
    interpreting,
    kernels_usable,
    launch,
)

MEMORY_FRACTION = 0.05  # extra memory target, as a fraction of the fp32 logits 4·N·V
MIN_CHUNK_ROWS = 128  # below this the GEMMs are launch-bound; N ≤ 128 runs as one chunk
MAX_CHUNK_ROWS = 1024  # beyond this cuBLAS gains little and memory grows
BLOCK_V = 4096  # vocabulary block of the row kernel (fp32 statistics over 16 values per thread)
ROW_WARPS = 8
V_ALIGN = 128  # the chunk's rows are padded to a multiple of 128 columns: aligned, unmasked loads
_HALF = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _softmax_grad_rows_kernel(
    LOGITS,  # (R, V) in the input dtype: read, then overwritten with the gradient
    stride_row,
    LABELS,  # (R,) int64
    LOSS,  # (R,) fp32 per-row loss
    INV_COUNT,  # () fp32: 1 / max(number of counted rows, 1)
    R,
    V,
    ignore_index,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    label = tl.load(LABELS + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    ignored = label == ignore_index
    valid = (label >= 0) & (label < V)
    live = row_ok & ~ignored  # ignored rows read nothing (masked loads) and get a zero gradient
    target = tl.where(live & valid, label, -1).to(tl.int32)
    base = LOGITS + rows.to(tl.int64)[:, None] * stride_row  # (BLOCK_ROWS, 1)
    offs = tl.arange(0, BLOCK_V)[None, :]

    # Online max and sum of exponentials in fp32. m_safe keeps dead rows at exp(-inf) = 0.
    m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_ROWS,), tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=live[:, None] & (cols < V), other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(live, m_new, 0.0)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
    m = tl.where(live, m, 0.0)
    s = tl.where(live, s, 1.0)
    x_target = tl.load(base + tl.maximum(target, 0)[:, None], mask=(target >= 0)[:, None], other=0.0)
    # (m − x_target) is exact for nearby values: no cancellation at logits of ±1e4.
    loss = (m - tl.sum(x_target.to(tl.float32), axis=1)) + tl.log(s)
    loss = tl.where(ignored, 0.0, tl.where(valid, loss, float("nan")))
    tl.store(LOSS + rows, loss, mask=row_ok)
    if COMPUTE_GRAD:
        scale = tl.where(ignored, 0.0, tl.where(valid, tl.load(INV_COUNT), float("nan")))
        inv_s = 1.0 / s
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            x = tl.load(base + cols, mask=live[:, None] & (cols < V), other=float("-inf")).to(tl.float32)
            p = tl.exp(x - m[:, None]) * inv_s[:, None]
            p = tl.where(cols == target[:, None], p - 1.0, p)
            g = (p * scale[:, None]).to(LOGITS.dtype.element_ty)
            tl.store(base + cols, g, mask=row_ok[:, None] & (cols < V))


@triton.jit
def _dw_accumulate_kernel(
    G,  # (R, ≥ V) softmax gradient of this chunk, input dtype; columns padded to a multiple of BLOCK_V
    H,  # (R, D) hidden states of this chunk, input dtype
    ACC,  # (V, D) fp32 (or the output itself for fp32): read when ACCUMULATE
    OUT,  # (V, D) written: fp32 accumulator or the final gradient in the weight's dtype
    R,
    V,
    D,
    stride_g,
    stride_h,
    stride_out,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # d tiles vary fastest, so the programs that read one tile of G run together (L2 reuse).
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    v0 = tl.program_id(1) * BLOCK_V
    offs_v = tl.arange(0, BLOCK_V)  # relative to v0: the int64 part of the offsets is a scalar
    offs_r = tl.arange(0, BLOCK_R)
    # Columns of G past V are padding inside the buffer: read unmasked (a V mask here stops
    # Triton from pipelining the loads) and dropped by the masked store.
    g_ptrs = G + v0 + offs_r[:, None] * stride_g + offs_v[None, :]  # (BLOCK_R, BLOCK_V)
    h_ptrs = H + offs_r[:, None] * stride_h + offs_d[None, :]  # (BLOCK_R, BLOCK_D)
    acc = tl.zeros((BLOCK_V, BLOCK_D), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        g = tl.load(g_ptrs, mask=offs_r[:, None] < R - r0, other=0.0)
        x = tl.load(h_ptrs, mask=(offs_r[:, None] < R - r0) & (offs_d[None, :] < D), other=0.0)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=INPUT_PRECISION)
        g_ptrs += BLOCK_R * stride_g
        h_ptrs += BLOCK_R * stride_h
    base = v0.to(tl.int64) * stride_out
    tile = offs_v[:, None] * stride_out + offs_d[None, :]
    mask = (offs_v[:, None] < V - v0) & (offs_d[None, :] < D)
    if ACCUMULATE:
        acc += tl.load(ACC + base + tile, mask=mask, other=0.0)
    tl.store(OUT + base + tile, acc.to(OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch wrappers (with a PyTorch fallback when Triton cannot run on the tensors)
# --------------------------------------------------------------------------------------------
# The row kernel: one row per program on the GPU (num_stages: Triton's default). The interpreter's
# cost is per operation, not per element, so there it runs 64 rows per program (same code, same masks).
ROW_CONFIG = LaunchConfig({"BLOCK_ROWS": 1, "BLOCK_V": BLOCK_V}, num_warps=ROW_WARPS, num_stages=3)


def _interpret_row_config(v: int) -> LaunchConfig:
    return LaunchConfig(
        {"BLOCK_ROWS": 64, "BLOCK_V": min(BLOCK_V, triton.next_power_of_2(v))}, num_warps=1, num_stages=3
    )


def _dw_config(dtype: torch.dtype) -> LaunchConfig:
    """Tile sizes of the dW GEMM: V tiles of ``V_ALIGN`` (the chunk's column padding), d tiles
    of 64, rows in steps of 64 (16 for fp32, whose ieee dots hold their operands in registers:
    at 32, triton 3.9's sm_80 build needed 255 registers and 16 bytes of stack)."""
    rows = 16 if dtype == torch.float32 else 64
    return LaunchConfig({"BLOCK_V": V_ALIGN, "BLOCK_D": 64, "BLOCK_R": rows}, num_warps=8, num_stages=3)


INTERPRET_DW_CONFIG = LaunchConfig({"BLOCK_V": V_ALIGN, "BLOCK_D": 64, "BLOCK_R": 64}, num_warps=1, num_stages=1)


def _padded(v: int) -> int:
    return triton.cdiv(v, V_ALIGN) * V_ALIGN


def _softmax_grad_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_rows: torch.Tensor,
    inv_count: torch.Tensor,
    ignore_index: int,
    compute_grad: bool,
) -> None:
    """Per-row fp32 loss into ``loss_rows``; with ``compute_grad`` the logits (R, V) are
    overwritten with ``(softmax − onehot) · inv_count`` (0 for ignored rows, NaN for labels
    outside [0, V))."""
    rows, v = logits.shape
    if rows == 0:
        return
    if kernels_usable(logits):
        launch(
            _softmax_grad_rows_kernel,
            lambda blocks: (triton.cdiv(rows, blocks["BLOCK_ROWS"]),),
            (logits, logits.stride(0), labels, loss_rows, inv_count, rows, v, ignore_index),
            {"COMPUTE_GRAD": compute_grad},
            interpret=_interpret_row_config(v),
            default=ROW_CONFIG,
        )
        return
    x = logits.float()  # (R, V)
    m = x.amax(dim=1, keepdim=True)
    e = torch.exp(x - m)
    s = e.sum(dim=1, keepdim=True)
    ignored = labels == ignore_index
    valid = (labels >= 0) & (labels < v)
    target = torch.where(valid, labels, 0)[:, None]
    loss = ((m - x.gather(1, target)) + s.log()).squeeze(1)
    nan = torch.full_like(loss, float("nan"))
    loss_rows.copy_(torch.where(ignored, torch.zeros_like(loss), torch.where(valid, loss, nan)))
    if compute_grad:
        p = e.div_(s)
        p.scatter_add_(1, target, torch.where(valid & ~ignored, -1.0, 0.0)[:, None].to(p.dtype))
        scale = torch.where(ignored, 0.0, torch.where(valid, inv_count, nan))
        logits.copy_(p.mul_(scale[:, None]))


def _accumulate_dw(g: torch.Tensor, h: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out = (acc if accumulate else 0) + gᵀ · h`` with fp32 accumulation; g (R, V), h (R, d).
    ``g``'s rows must be padded in memory to ``_padded(V)`` columns (the kernel reads them)."""
    rows, v = g.shape
    d = h.shape[1]
    # Triton 3.6's interpreter multiplies bf16 bit patterns as integers in tl.dot: not there.
    if kernels_usable(g) and not (interpreting() and g.dtype == torch.bfloat16):
        assert g.stride(1) == 1 and g.stride(0) >= _padded(v), "g must be a view of a V_ALIGN-padded buffer"
        launch(
            _dw_accumulate_kernel,
            lambda blocks: (triton.cdiv(d, blocks["BLOCK_D"]), triton.cdiv(v, blocks["BLOCK_V"])),
            (g, h, acc, out, rows, v, d, g.stride(0), h.stride(0), out.stride(0)),
            {"ACCUMULATE": accumulate, "INPUT_PRECISION": "ieee"},
            interpret=INTERPRET_DW_CONFIG,
            default=_dw_config(g.dtype),
        )
        return
    prod = torch.mm(g.t(), h).float()
    if accumulate:
        prod += acc
    out.copy_(prod)


def chunk_rows(n: int, v: int, d: int, dtype: torch.dtype, need_dw: bool = True) -> int:
    """Rows per logits chunk: the largest power of two in [MIN_CHUNK_ROWS, MAX_CHUNK_ROWS] (at
    most ``n``) whose extra memory (``extra_bytes``) stays within ``MEMORY_FRACTION`` of the
    fp32 logits ``4·n·v``; ``MIN_CHUNK_ROWS`` when no power of two fits."""
    if n <= MIN_CHUNK_ROWS:
        return max(n, 1)
    size = torch.finfo(dtype).bits // 8
    budget = MEMORY_FRACTION * 4 * n * v
    accumulator = 4 * v * d if (need_dw and dtype in _HALF) else 0
    rows = MAX_CHUNK_ROWS
    while rows > MIN_CHUNK_ROWS and rows * _padded(v) * size + accumulator + 4 * n > budget:
        rows //= 2
    return min(rows, n)


def extra_bytes(n: int, v: int, d: int, dtype: torch.dtype, need_grad: bool = True) -> int:
    """Bytes the op allocates beyond its inputs and the gradients it returns (``dh``, ``dW``):
    the logits chunk, the fp32 ``dW`` accumulator (fp16/bf16 with more than one chunk), the
    per-row losses, and a few scalars (counted as 64 B)."""
    size = torch.finfo(dtype).bits // 8
    rows = chunk_rows(n, v, d, dtype, need_grad)
    accumulator = 4 * v * d if (need_grad and dtype in _HALF and rows < n) else 0
    return min(rows, n) * _padded(v) * size + accumulator + 4 * n + 64


# --------------------------------------------------------------------------------------------
# The op: torch.library custom op with a fake (meta) implementation and an autograd formula
# --------------------------------------------------------------------------------------------
def _check_labels(labels: torch.Tensor, v: int, ignore_index: int) -> None:
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= v))
    if labels.device.type == "cpu":
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            fail(
                "linear_cross_entropy",
                f"labels: {int(bad.sum())} value(s) outside [0, {v}) that are not ignore_index ({ignore_index}), "
                f"e.g. labels[{i}] = {int(labels[i])}",
            )
    else:  # no host sync (CUDA graphs, torch.compile): a device-side assert; the loss is NaN too
        torch._assert_async(~bad.any(), f"linear_cross_entropy: a label is outside [0, {v}) and not ignore_index")


def _forward(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, need_dh: bool, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's body. Returns ``(loss, dh, dW)``: the fp32 mean loss and its gradients for an
    upstream gradient of 1 (empty tensors where not requested)."""
    h, weight, labels = h.contiguous(), weight.contiguous(), labels.contiguous().long()
    n, d = h.shape
    v = weight.shape[0]
    dev, dtype = h.device, h.dtype
    _check_labels(labels, v, ignore_index)
    count = (labels != ignore_index).sum().clamp(min=1)  # all rows ignored: loss 0/1 = 0
    inv_count = count.to(torch.float32).reciprocal()
    compute_grad = need_dh or need_dw
    rows = chunk_rows(n, v, d, dtype, need_dw)
    chunks = list(range(0, n, rows))

    v_pad = _padded(v)
    logits = empty(min(rows, n), v_pad, dtype=dtype, device=dev)  # (C, V_pad): rows V_ALIGN-aligned, reused
    logits[:, v:].zero_()  # the padding, read (and discarded) by the dW kernel
    logits = logits[:, :v]
    loss_rows = empty(n, dtype=torch.float32, device=dev)
    dh = empty(n, d, dtype=dtype, device=dev) if need_dh else h.new_empty(0)
    dw = empty(v, d, dtype=dtype, device=dev) if need_dw else weight.new_empty(0)
    if need_dw and n == 0:
        dw.zero_()
    # fp32 across chunks; fp32 weights accumulate in the output itself
    acc = empty(v, d, dtype=torch.float32, device=dev) if need_dw and dtype in _HALF and len(chunks) > 1 else dw

    for i, r0 in enumerate(chunks):
        r1 = min(r0 + rows, n)
        h_c, g = h[r0:r1], logits[: r1 - r0]  # (c, d), (c, V)
        torch.mm(h_c, weight.t(), out=g)
        _softmax_grad_rows(g, labels[r0:r1], loss_rows[r0:r1], inv_count, ignore_index, compute_grad)
        if need_dh:
            torch.mm(g, weight, out=dh[r0:r1])
        if need_dw:
            _accumulate_dw(g, h_c, acc, dw if i == len(chunks) - 1 else acc, accumulate=i > 0)
    loss = loss_rows.sum() / count
    return loss, dh, dw


@torch.library.custom_op("wiola::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, need_dh: bool, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(h, weight, labels, ignore_index, need_dh, need_dw)


@_linear_cross_entropy_op.register_fake
def _(h, weight, labels, ignore_index, need_dh, need_dw):
    loss = h.new_empty((), dtype=torch.float32)
    dh = h.new_empty(h.shape) if need_dh else h.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    return loss, dh, dw


def _setup_context(ctx, inputs, output):
    _, dh, dw = output
    ctx.need = inputs[4:6]
    ctx.save_for_backward(dh, dw)


def _backward(ctx, grad_loss, _grad_dh, _grad_dw):
    dh, dw = ctx.saved_tensors
    need_dh, need_dw = ctx.need
    grad_h = dh * grad_loss.to(dh.dtype) if need_dh else None
    grad_w = dw * grad_loss.to(dw.dtype) if need_dw else None
    return grad_h, grad_w, None, None, None, None


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public function (same name, signature and result as wiola.ops.linear_cross_entropy)
# --------------------------------------------------------------------------------------------
def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``logits = h · weightᵀ`` against ``labels``, in float32, without
    materialising the logits (see the module docstring for the memory bound).

    Args:
        h: ``(N, d)`` hidden states, float32, bfloat16 or float16 (any strides).
        weight: ``(V, d)`` head weight (the tied embedding), same dtype as ``h``. Under
            ``torch.autocast`` both are cast to the autocast dtype first, as ``F.linear`` would.
        labels: ``(N,)`` integer targets in ``[0, V)``; rows equal to ``ignore_index`` do not count.
        ignore_index: label value of rows that do not count.

    Returns a float32 scalar: the sum of the counted rows' losses divided by their number.
    When every row is ignored the loss is ``0.0`` and the gradients are zero (no NaN).
    Gradients flow to ``h`` and ``weight`` (adding to any other gradient of a tied weight);
    they are computed during the forward when grad is enabled (module docstring).

    Raises:
        TypeError: ``h``/``weight`` not floating or of different dtypes; ``labels`` not integer.
        ValueError: wrong ranks, mismatched sizes or devices; on CPU, a label outside ``[0, V)``
            that is not ``ignore_index`` (on CUDA: an asynchronous device-side assert and a NaN
            loss, since checking on the host would need a synchronisation).
    """
    for name, t in (("h", h), ("weight", weight), ("labels", labels)):
        check_tensor("linear_cross_entropy", name, t)
    if h.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        fail(
            "linear_cross_entropy",
            f"expected h (N, d), weight (V, d), labels (N,); got h {tuple(h.shape)}, "
            f"weight {tuple(weight.shape)}, labels {tuple(labels.shape)}",
        )
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, weight = h.to(dtype), weight.to(dtype)
    if h.dtype not in TRITON_DTYPE or weight.dtype != h.dtype:
        fail(
            "linear_cross_entropy",
            f"h and weight must share one dtype among float32, bfloat16, float16; "
            f"got h {h.dtype}, weight {weight.dtype}",
            TypeError,
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        fail("linear_cross_entropy", f"labels must be an integer tensor, got {labels.dtype}", TypeError)
    if h.shape[1] != weight.shape[1]:
        fail("linear_cross_entropy", f"h has width {h.shape[1]} but weight {tuple(weight.shape)} has {weight.shape[1]}")
    if labels.shape[0] != h.shape[0]:
        fail("linear_cross_entropy", f"labels has {labels.shape[0]} rows but h has {h.shape[0]}")
    if weight.shape[0] == 0:
        fail("linear_cross_entropy", "weight has no rows (vocabulary of size 0)")
    if not (h.device == weight.device == labels.device):
        fail(
            "linear_cross_entropy",
            f"h, weight, labels on different devices ({h.device}, {weight.device}, {labels.device})",
        )
    grad = torch.is_grad_enabled()
    loss, _, _ = _linear_cross_entropy_op(
        h, weight, labels, int(ignore_index), grad and h.requires_grad, grad and weight.requires_grad
    )
    return loss
