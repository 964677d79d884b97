"""The op functions of ``wiola.fast.WiolaModel``: each has the name and signature of its
reference in ``wiola.ops`` and dispatches per call.

- Triton kernel (``kernels/<op>.py``) when ``wiola_kernels._utils.kernels_usable(tensor)``: on CUDA,
  or on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them). Custom ops do not go
  through autocast, so under ``torch.autocast`` these wrappers cast the fp32 master weights
  and activations to the autocast dtype themselves, the way autocast would for the reference.
- Otherwise (a plain CPU, no triton, or the kernels switched off) a PyTorch path at least as
  fast as the reference: ``scaled_dot_product_attention`` with the gate folded into the rotated
  query (``g ⟨q̃, k̃⟩ = ⟨g q̃, k̃⟩``) instead of materialised scores, and the reference functions
  where they are already one or two library calls.
- On a plain CPU, a one-token decoding step (fp32, gradients off) runs as one call of the C++
  step in ``wiola/fast/decode_step_cpu.py`` (every layer and the head), see ``cpu_decode_step``.

Each op is written once, a method of ``_Ops`` holding both paths: ``KERNEL_OPS`` is the table
that dispatches (the fast model's default; its functions are also this module's ``rms_norm``,
``gate``, ...) and ``TORCH_OPS`` the one that never picks a kernel (a model's
``use_kernels(False)``). The
``use_kernels(enabled)`` context manager switches the kernels off (or back on) for the code
inside it, per thread and task (a ``ContextVar``; default from ``WIOLA_FAST_KERNELS``).

``KERNELS`` names the kernel of every op that was imported; ``MISSING`` gives the reason for the
others (no triton, no ``kernels`` package, the C++ step not built). With triton importable, a
kernel module that fails to import raises: a broken kernel is an error, not a silent fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

import wiola.ops as reference
from wiola.model import Ops, has_adapters
from wiola.ops.decode import check_queries
from wiola.ops.gate import write_carry
from wiola.ops.linear import DecodeLayout, autocast_dtype, by_sequence, linear
from wiola.ops.rope import apply_rope, upcast

_KERNEL_MODULES = (
    ("rms_norm", "rms_norm"),
    ("gate", "gate"),
    ("attention", "attention"),
    ("decode_attention", "decode"),
    ("write_cache", "decode"),
    ("butterfly", "butterfly"),
    ("linear_cross_entropy", "cross_entropy"),
)
KERNELS: dict[str, Callable[..., Any]] = {}
MISSING: dict[str, str] = {}


_HAVE_KERNELS = importlib.util.find_spec("wiola_kernels") is not None  # an install may lack kernels/


def _import_kernels() -> None:
    """Fill ``KERNELS``, or ``MISSING`` with the reason when triton or ``kernels/`` is absent."""
    if not _HAVE_KERNELS:
        reason = "the kernels package is not installed"
    elif importlib.util.find_spec("triton") is None:
        reason = "triton is not installed"
    else:
        reason = None
    for name, module in _KERNEL_MODULES:
        if reason is not None:
            MISSING[name] = f"wiola_kernels.{module}.{name}: {reason}"
        else:  # any exception here is a bug in the kernel module: let it propagate
            KERNELS[name] = getattr(importlib.import_module(f"wiola_kernels.{module}"), name)


_import_kernels()
if _HAVE_KERNELS:
    from wiola_kernels._utils import kernels_usable
else:  # pragma: no cover - an install without kernels/ still gets the torch path

    def kernels_usable(t: torch.Tensor) -> bool:
        return False


# The head widths the attention kernels (training, prefill and decoding) are built for; another
# width (d_model 48 with 2 heads: 24) runs those ops on the PyTorch path, the other kernels stay.
if "attention" in KERNELS:
    from wiola_kernels.attention import SUPPORTED_HEAD_DIMS as ATTENTION_HEAD_DIMS
else:
    ATTENTION_HEAD_DIMS: tuple[int, ...] = ()

KERNELS_ENV = "WIOLA_FAST_KERNELS"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def kernels_setting() -> bool:
    """``$WIOLA_FAST_KERNELS`` as a bool: unset or empty, ``1``/``true``/``yes``/``on`` (any case)
    is on, ``0``/``false``/``no``/``off`` off; ``ValueError`` naming the variable otherwise."""
    value = os.environ.get(KERNELS_ENV, "").strip().lower()
    if value in ("", *_ON):
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{KERNELS_ENV}={value!r} is not one of {', '.join(_ON)} (on), {', '.join(_OFF)} (off)")


def _kernels_default() -> bool:
    # Read at import: a bad value is named when a fast model is made (check_settings), and the
    # kernels stay on meanwhile.
    try:
        return kernels_setting()
    except ValueError:
        return True


_KERNELS_DEFAULT = _kernels_default()
_KERNELS_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("wiola_fast_kernels", default=_KERNELS_DEFAULT)


@contextlib.contextmanager
def use_kernels(enabled: bool) -> Iterator[None]:
    """Turn the Triton kernels (and the C++ CPU step) on or off inside a ``with`` block: the
    PyTorch path runs instead. Per thread and asyncio task; the default comes from the
    environment variable ``WIOLA_FAST_KERNELS`` (``0``, ``false``, ``no`` or ``off`` disables). A model's own switch,
    ``WiolaModel.use_kernels(False)``, turns them off for that model alone.
    """
    token = _KERNELS_ON.set(bool(enabled))
    try:
        yield
    finally:
        _KERNELS_ON.reset(token)


def kernels_on() -> bool:
    """Whether ``use_kernels`` leaves the kernels on here (under ``torch.compile``: its value
    when the graph was traced)."""
    return _KERNELS_ON.get()


# What `torch.compiler.assume_constant_result` sets, without importing torch._dynamo (and with it
# torch.hub and tqdm) when wiola.fast is imported.
kernels_on._dynamo_marked_constant = True  # type: ignore[attr-defined]


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Kernels whose bf16 matrix products Triton's interpreter (NumPy, which has no bfloat16) gets wrong:
# the training attention and the butterfly (a model under CPU bf16 autocast gave gradients 1e12x off
# with them; with the norms, gate, loss and decoding kernels alone it stays within the reference's
# bf16 error). Under the interpreter, bf16 runs these two on the PyTorch path. The launch-count
# tests, which count kernels rather than read their numbers, empty it. The decoding kernel's
# products take the cache's dtype: fp32 under autocast (right), bf16 in a bf16 model's cache (wrong
# under the interpreter: a relative error of about 1.5 in the logits), so a bf16 cache on the CPU
# also takes the PyTorch path (``_Ops.decode_attention``) while "attention" is in this set.
INTERPRETER_BF16_WRONG: frozenset[str] = frozenset({"attention", "butterfly"})


def _kernel(name: str, t: torch.Tensor) -> Callable[..., Any] | None:
    if t.dtype in _KERNEL_DTYPES and kernels_usable(t) and kernels_on():
        if name in INTERPRETER_BF16_WRONG and not t.is_cuda and torch.bfloat16 in (t.dtype, autocast_dtype(t)):
            return None
        return KERNELS.get(name)
    return None


def _cast(dtype: torch.dtype | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


# --------------------------------------------------------------------------- ops
class _Ops:
    """The op functions, each the kernel where usable and else the PyTorch path, both in one body.

    ``_Ops(True)`` gives ``KERNEL_OPS``; ``_Ops(False)`` never picks a kernel: ``TORCH_OPS``."""

    def __init__(self, kernels: bool) -> None:
        self.kernels = kernels

    def __reduce__(self) -> tuple:
        return (_ops_table, (self.kernels,))  # a pickled model gets this module's own tables back

    def _kernel(self, name: str, t: torch.Tensor) -> Callable[..., Any] | None:
        return _kernel(name, t) if self.kernels else None

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``wiola.ops.rms_norm``: the fused residual add + RMSNorm kernel where usable; on a plain
        CPU for ``T > 1`` fp32 positions, or any where ``by_sequence`` (a step outside the C++ step:
        its rows must not depend on the batch), the C++ rows (``decode_step_cpu.rms_norm``, the
        one-token step's RMSNorm); else one ATen ``rms_norm`` for fp32 tensors (the reference for other
        dtypes)."""
        kernel = self._kernel("rms_norm", x)
        if kernel is not None:
            # A bf16 autocast output with the fp32 stream goes in as it is: the kernel adds in the
            # promoted dtype itself, as the reference's ``x + residual`` does (no cast copy first).
            return kernel(x, weight, eps, residual)
        if self.kernels and x.dim() == 3 and (x.shape[1] > 1 or by_sequence(x)) and _plain_cpu(x):
            from wiola.fast import decode_step_cpu

            out = decode_step_cpu.rms_norm(x, weight, eps, residual)
            if out is not None:
                return out
        if (
            x.dtype == torch.float32
            and weight.dtype == torch.float32
            and (residual is None or residual.dtype == x.dtype)
        ):
            h = x if residual is None else x + residual
            y = F.rms_norm(h, (h.shape[-1],), weight, eps)  # one fused ATen op, fp32 statistics
            return y if residual is None else (y, h)
        return reference.rms_norm(x, weight, eps, residual)

    def gate(
        self,
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
        """``wiola.ops.gate``: the gate kernel (head mean, carried prefix sum, MLP) where usable,
        else the reference (one new token after a carried sum: ``_gate_step``).

        Computes in fp32 from the queries' dtype, as the reference does; the small gate weights
        are read as they are (fp32 master weights under autocast).
        """
        kernel = self._kernel("gate", q)
        if kernel is not None:
            return kernel(
                q, w1, w2, b2, cos=cos, sin=sin, attention_mask=attention_mask, carry=carry, update_carry=update_carry
            )
        if by_sequence(q):  # the fast model's gradient-free CPU forward: the C++ gate, row by row
            from wiola.fast import decode_step_cpu

            out = decode_step_cpu.gate(q, w1, w2, b2, cos, sin, attention_mask, carry)
            if out is not None:
                return write_carry(carry, *out) if update_carry else out
        if q.shape[1] == 1 and carry is not None and cos is None and not torch.is_autocast_enabled(q.device.type):
            out = _gate_step(q, w1, w2, b2, attention_mask, carry)
            return write_carry(carry, *out) if update_carry else out
        return reference.gate(
            q, w1, w2, b2, cos=cos, sin=sin, attention_mask=attention_mask, carry=carry, update_carry=update_carry
        )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``wiola.ops.attention``: the fused helical-RoPE gated flash-attention kernel where usable,
        else SDPA on the rotated, gate-scaled queries."""
        kernel = self._kernel("attention", q) if q.shape[-1] in ATTENTION_HEAD_DIMS else None
        if kernel is not None:
            return kernel(q, k, v, g, cos, sin, attention_mask)
        q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        key_mask = None if attention_mask is None else attention_mask.to(torch.bool)
        return _sdpa(q_rot, k_rot, v, g, key_mask, q_start=0)

    def decode_attention(
        self,
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
        unpadded: bool = False,
        queries: int | None = None,
    ) -> torch.Tensor:
        """``wiola.ops.decode_attention``; ``start`` may be a one-element device tensor (CUDA graphs).
        With ``queries``, the last ``queries`` tokens' outputs: the C++ prompt attention and the
        PyTorch path attend with those queries alone, the kernels compute every one and keep those.

        Kernels: a prefill into an empty cache (``start == 0``, ``T > 1``) writes the cache with the
        decode write kernel and runs the training attention kernel, so it equals the full pass
        exactly; everything else (one token, or a chunk after cached tokens) runs the
        flash-decoding kernel. On a plain CPU (no kernels), ``T > 1`` in fp32 with gradients off, or
        one token where ``by_sequence`` (a step outside the C++ step, as with adapters: SDPA's rows
        follow the batch), runs the C++ prompt attention
        (``wiola.fast.decode_step_cpu.decode_attention``) where it applies.
        PyTorch path: slice writes and SDPA over the filled slots.
        With ``unpadded`` (the caller had no ``attention_mask``), the prefill runs the unmasked
        attention variant (``mask=None``) and does not read ``key_mask``.
        """
        T = q.shape[1]
        n = check_queries(queries, T)
        decode = self._kernel("decode_attention", q) if q.shape[-1] in ATTENTION_HEAD_DIMS else None
        if (
            decode is not None
            and k_cache.dtype == torch.bfloat16
            and not k_cache.is_cuda
            and "attention" in INTERPRETER_BF16_WRONG
        ):
            decode = None  # the interpreter's bf16 tl.dot (see INTERPRETER_BF16_WRONG)
        if decode is not None:
            flash = self._kernel("attention", q)
            if flash is not None and isinstance(start, int) and start == 0 and T > 1:
                KERNELS["write_cache"](k, v, cos, sin, k_cache, v_cache, 0)
                return flash(q, k, v, g, cos, sin, None if unpadded else key_mask[:, :T])[:, T - n :]
            return decode(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start)[:, T - n :]
        if isinstance(start, torch.Tensor):
            start = int(start)  # host sync: the PyTorch path is not for CUDA graphs
        if (T > 1 or by_sequence(q)) and self.kernels and _plain_cpu(q):
            from wiola.fast import decode_step_cpu

            o = decode_step_cpu.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start, queries=n)
            if o is not None:
                return o
        end = start + T
        if T == 1 and q.dtype == torch.float32 and k_cache.dtype == torch.float32:
            q_rot, k_rot = _rotate_pair(q, k, cos, sin)
            real = key_mask[:, :end]
        else:
            q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            real = None if unpadded and start == 0 else key_mask[:, :end]  # None: SDPA's causal fast path
        k_cache[:, :, start:end] = k_rot.transpose(1, 2)  # (B, H, T, D)
        v_cache[:, :, start:end] = v.transpose(1, 2)
        keys = k_cache[:, :, :end].transpose(1, 2)  # (B, end, H, D)
        values = v_cache[:, :, :end].transpose(1, 2)
        return _sdpa(q_rot[:, T - n :], keys, values, g[:, T - n :], real, q_start=end - n)

    def butterfly(
        self,
        x: torch.Tensor,
        w_up: torch.Tensor,
        w_bp: torch.Tensor,
        w_down: torch.Tensor,
        residual: torch.Tensor | None = None,
        layouts: tuple[DecodeLayout, DecodeLayout, DecodeLayout] | None = None,
    ) -> torch.Tensor:
        """``wiola.ops.butterfly``: the fused up/bypass GEMM with the SiLU-gate epilogue and the down
        projection where usable (inputs cast to the autocast dtype first; ``layouts`` unused there);
        on a plain CPU for ``T > 1`` positions, or any where ``by_sequence``, the middle in C++
        (``_butterfly_cpu``); else the reference."""
        kernel = self._kernel("butterfly", x)
        if kernel is None and self.kernels and x.dim() == 3 and (x.shape[1] > 1 or by_sequence(x)) and _plain_cpu(x):
            return _butterfly_cpu(x, w_up, w_bp, w_down, residual, layouts)
        if kernel is None:
            return reference.butterfly(x, w_up, w_bp, w_down, residual, layouts)
        dtype = autocast_dtype(x)
        x, w_up, w_bp, w_down = _cast(dtype, x, w_up, w_bp, w_down)
        if residual is not None and dtype is not None:
            (residual,) = _cast(torch.promote_types(dtype, residual.dtype), residual)
        return kernel(x, w_up, w_bp, w_down, residual)

    def linear_cross_entropy(
        self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """``wiola.ops.linear_cross_entropy``: the chunked kernel (no ``(N, V)`` logits) where usable,
        else the reference."""
        kernel = self._kernel("linear_cross_entropy", h)
        if kernel is None:
            return reference.linear_cross_entropy(h, weight, labels, ignore_index)
        h, weight = _cast(autocast_dtype(h), h, weight)
        return kernel(h, weight, labels, ignore_index)


_KERNEL_OPS, _TORCH_OPS = _Ops(True), _Ops(False)


def _ops_table(kernels: bool) -> _Ops:
    return _KERNEL_OPS if kernels else _TORCH_OPS


KERNEL_OPS = Ops.of(_KERNEL_OPS)
TORCH_OPS = Ops.of(_TORCH_OPS)
# The dispatching op functions by their names, for callers outside the model's modules.
rms_norm, gate, attention = KERNEL_OPS.rms_norm, KERNEL_OPS.gate, KERNEL_OPS.attention
decode_attention, butterfly = KERNEL_OPS.decode_attention, KERNEL_OPS.butterfly
linear_cross_entropy = KERNEL_OPS.linear_cross_entropy


def cpu_decode_step(
    model: Any, input_ids: torch.Tensor, cache: Any
) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """The C++ one-token step bound to ``model`` and ``cache``, or None where it does not apply.

    It applies on a plain CPU (not under ``TRITON_INTERPRET=1``, where the Triton kernels run)
    with the model's kernels on (``model.kernels_enabled``), gradients and CPU autocast off,
    not while tracing, to one new token per row (``input_ids`` ``(B, 1)``) of an fp32 model and
    cache, once the library has been built (``wiola.fast.decode_step_cpu.load``; the first call
    compiles it). The binding lives in the model's ``derived_weights``, per cache, and is
    rebuilt when a weight is replaced or moved. None too for weights the step does not read
    (``decode_step_cpu.UnsupportedWeights``); the binding's other errors propagate (a cache made
    for another model, a quantized model whose weights changed after ``quantize``).
    """
    if (
        input_ids.device.type != "cpu"
        or input_ids.dim() != 2
        or input_ids.shape[1] != 1
        or kernels_usable(input_ids)
        or not cpu_step_applies(model, cache)
    ):
        return None
    from wiola.fast import decode_step_cpu

    if decode_step_cpu.load() is None:
        MISSING.setdefault("decode_step_cpu", f"wiola.fast.decode_step_cpu: {decode_step_cpu.BUILD_ERROR}")
        return None

    def bind() -> Any:
        try:
            return decode_step_cpu.DecodeStepCPU(model, cache)
        except decode_step_cpu.UnsupportedWeights:  # a non-contiguous or non-fp32 weight: the PyTorch path's
            return False  # (a foreign cache or a stale quantized model raises: never computed on other weights)

    step = model.derived_weights.bound("cpu_decode_step", cache, bind, lambda s: s is not False and s.is_current())
    return step or None


def describe_cpu_decoding(model: Any) -> str:
    """One line saying how the one-token CPU steps of ``model`` (a ``wiola.fast.WiolaModel``)
    decode: the PyTorch path and why where the model itself keeps the C++ step off (its kernels
    off, by ``WIOLA_FAST_KERNELS`` or ``use_kernels(False)``; a feed-forward variant the step does
    not implement; a LoRA adapter), the Triton kernels under ``TRITON_INTERPRET=1``, else
    ``decode_step_cpu.describe(config=, scheme=)``, with the model's own weights and threads."""
    if not model.kernels_enabled:
        return f"PyTorch path: the model's kernels are off ({KERNELS_ENV} or use_kernels(False))"
    if model.config.ffn != "butterfly":
        return f"PyTorch ({model.describe()})"
    if has_adapters(model):
        return "PyTorch path: the C++ step reads the base weights, not a LoRA adapter's"
    if kernels_usable(torch.empty(0)):
        return "Triton kernels (TRITON_INTERPRET=1)"
    from wiola.fast import decode_step_cpu

    return decode_step_cpu.describe(config=model.config, scheme=getattr(model, "quantization", None))


def cpu_step_applies(model: Any, cache: Any) -> bool:
    """Whether the C++ step may compute ``model`` on ``cache`` in this context (the conditions of
    ``cpu_decode_step`` that are not about the input): the model's kernels on, the paper's
    butterfly block, an fp32 model and CPU cache, gradients and CPU autocast off, not tracing,
    no LoRA adapter (the step reads the base weights only)."""
    return not (
        not model.kernels_enabled
        or model.config.ffn != "butterfly"  # the C++ step implements the paper's block only
        or torch.is_grad_enabled()
        or torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
        or cache.dtype != torch.float32
        or cache.device.type != "cpu"
        or getattr(cache, "device_slot", False)
        or model.embed.weight.dtype != torch.float32
        or model.embed.weight.device.type != "cpu"
        or has_adapters(model)  # the C++ step reads the base weights, never a LoRA adapter
    )


def _plain_cpu(t: torch.Tensor) -> bool:
    """Whether the C++ CPU code may run on ``t``'s op here: a CPU tensor outside Triton's
    interpreter, the kernels on in this context, gradients and CPU autocast off, not tracing."""
    return (
        t.device.type == "cpu"
        and kernels_on()
        and not kernels_usable(t)
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


# --------------------------------------------------------------------------- PyTorch path
def _butterfly_cpu(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_bp: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor | None,
    layouts: tuple[DecodeLayout, DecodeLayout, DecodeLayout] | None,
) -> torch.Tensor:
    """``wiola.ops.butterfly`` for many positions on a plain CPU: the reference's three products,
    its middle ``SiLU(a) ⊙ b + x W_bpᵀ`` in one C++ pass (``decode_step_cpu.silu_gate``) instead
    of four ATen ops over the ``(…, d_ff)`` activations (those ops where it does not apply)."""
    from wiola.fast import decode_step_cpu

    up, bp, down = layouts or (None, None, None)
    ab, c = linear(x, w_up, up), linear(x, w_bp, bp)
    r = decode_step_cpu.silu_gate(ab, c)
    if r is None:
        a, b = ab.chunk(2, dim=-1)
        r = F.silu(a) * b + c
    y = linear(r, w_down, down)
    return y if residual is None else y + residual


def _gate_step(
    q: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    attention_mask: torch.Tensor | None,
    carry: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference gate for one new token after a carried sum: no scans, half the ops, in the
    reference's precision (fp32, or float64 for a float64 model)."""
    m = upcast(q).mean(dim=2)[:, 0]  # (B, D) head mean
    if attention_mask is None:
        running, count = carry[0].to(m.dtype) + m, carry[1] + 1
    else:
        real = attention_mask[:, -1].to(torch.int64)  # (B,)
        running, count = carry[0].to(m.dtype) + m * real.unsqueeze(-1).to(m.dtype), carry[1] + real
    c = running / count.clamp(min=1).to(m.dtype).unsqueeze(-1)
    g = torch.sigmoid(F.linear(F.silu(F.linear(c, upcast(w1))), upcast(w2), upcast(b2)))
    return g.unsqueeze(1), running, count


def _rotate_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope`` of one new token's ``q`` and ``k`` ``(B, 1, H, D)`` in one pass: the same
    products and sums (bitwise equal), half the launches."""
    half = q.shape[-1] // 2
    qk = torch.stack((q, k))  # (2, B, 1, H, D)
    c = torch.cat((cos, cos), dim=-1).unsqueeze(-2)  # (B, 1, 1, D)
    s = torch.cat((sin, sin), dim=-1).unsqueeze(-2)
    rotated = qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s
    return rotated[0], rotated[1]


def _sdpa(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    key_mask: torch.Tensor | None,
    q_start: int,
) -> torch.Tensor:
    """Gated causal attention through SDPA: ``(B, Tq, H, D)`` rotated queries, ``(B, S, H, D)``
    rotated keys and values, gate ``(B, Tq, H)``; query ``t`` sits at slot ``q_start + t``.

    Returns ``(B, Tq, H, D)`` in ``q_rot.dtype``; a query with no real key (left padding) gets
    zeros, as in the reference.
    """
    B, Tq, H, D = q_rot.shape
    S = k_rot.shape[1]
    q = (q_rot * g.unsqueeze(-1).to(q_rot.dtype)).transpose(1, 2)  # (B, H, Tq, D), gate folded in
    k, v = k_rot.transpose(1, 2), v.transpose(1, 2)
    scale = 1.0 / math.sqrt(D)
    if key_mask is None and q_start == 0 and Tq == S:
        # A branch, not is_causal=Tq > 1: under torch.compile a traced length makes that a SymBool,
        # which SDPA refuses; the branch is a guard and leaves a plain bool.
        causal = True if Tq > 1 else False
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return o.transpose(1, 2)
    if Tq > 1 or q_start + Tq != S:
        t = torch.arange(Tq, device=q.device).view(-1, 1) + q_start
        allowed = (torch.arange(S, device=q.device).view(1, -1) <= t).view(1, 1, Tq, S)
        if key_mask is not None:
            allowed = allowed & key_mask.view(B, 1, 1, S)
    elif key_mask is not None:  # one query at the last slot sees every key: the mask alone
        allowed = key_mask.view(B, 1, 1, S)
    else:
        allowed = torch.ones(1, 1, Tq, S, dtype=torch.bool, device=q.device)
    has_key = allowed.any(dim=-1, keepdim=True)  # (B|1, 1, Tq, 1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~has_key, scale=scale)
    return (o * has_key.to(o.dtype)).transpose(1, 2)
