"""How ``wiola.fast.WiolaModel`` runs the prompt path on a CPU: fp32, or bf16 matrix products, and
which fp32 GEMM its gradient-free CPU forwards use.

The prompt path (a forward of ``B × T`` positions, ``T > 1``, with a cache: the prefill before
decoding) is a few large matrix products, which a CPU's matrix units run faster in bf16 than in
fp32: oneDNN, under PyTorch's CPU autocast, runs ``torch.nn.functional.linear`` with bf16 inputs
and fp32 accumulation on AVX-512 BF16 (``vdpbf16ps``) or AMX tiles (``amx_bf16``) where the CPU has
them. The modes (``MODES``):

- ``fp32``: the reference's arithmetic (exact up to fp32 summation order; every exactness test);
- ``bf16``: the projections, the feed-forward products and the head under
  ``torch.autocast("cpu", torch.bfloat16)`` (weights cast once per weight version and kept, see
  ``wiola.model.DerivedWeights``); norms, the gate, softmax and the cache stay fp32. Not the
  reference's function: its quality is measured (``tests/test_prefill.py`` bounds the loss change
  on validation windows; ``bench.quality``'s table).

``select()`` reads ``$WIOLA_CPU_PREFILL`` (``auto``, ``fp32`` or ``bf16``; unset: ``auto``).
The quality rule of a prompt mode is a validation loss within 0.001 nats of fp32's; bf16
products (inputs rounded to 8 significant bits) measured +0.0023 nats on the test model
(``tests/test_prefill.py``), so ``auto`` resolves to ``fp32`` on every CPU, whatever bf16 units
its flags show (``AUTO``: flag -> mode, empty), and ``bf16`` is for a caller who accepts that
cost. ``describe()`` says which mode was chosen, why, and the CPU's bf16 units, for benchmark
records.

It applies only where the C++ decode step would (a plain CPU, no gradients, no autocast already
on, an fp32 unquantized model; ``applies``): a quantized model keeps the fp32 path on its
dequantized weights, its oracle.

**The fp32 GEMM.** Outside bf16, the fast model's gradient-free CPU forwards (a prompt, or a
scoring pass) run their products of more than 64 rows on one of ``wiola.ops.linear.CPU_GEMMS``:
``aten`` (``F.linear``: MKL's sgemm in PyTorch's x86 builds) or ``onednn`` (oneDNN's fp32
matmul). Both are fp32 arithmetic, within the same error bound of the products; they differ in
summation order, so in the last bits. ``select_gemm()`` reads ``$WIOLA_CPU_GEMM`` (``auto``,
``aten`` or ``onednn``; unset: ``auto``); ``auto`` looks the CPU's vendor and family up in
``GEMM_AUTO``, which holds only families where the two were measured, and takes ``aten``
elsewhere. ``gemm_applies`` says where the choice is used (quantized models included: their
products are fp32 on the dequantized weights).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

MODES = ("fp32", "bf16")
ENV = "WIOLA_CPU_PREFILL"
AUTO: dict[str, str] = {}  # CPU flag -> the mode ``auto`` picks where it is present (none meets the rule yet)

GEMM_ENV = "WIOLA_CPU_GEMM"
# (vendor, family) -> the fp32 GEMM ``auto`` picks there. AMD family 26 (Zen 5): oneDNN ran a
# 512-token prompt of the 13m preset 1.6x faster than MKL's sgemm (its products about 2x: MKL ran
# them at the rate of 256-bit code, and Zen 5 runs 512-bit FMAs at full width):
# bench/results/2026-12-04_cpu_prompt-gemm-amd-zen5/. Other CPUs were not measured against each other.
GEMM_AUTO: dict[tuple[str, str], str] = {("AuthenticAMD", "26"): "onednn"}


@functools.cache
def _cpu() -> dict[str, str]:
    """``decode_step_cpu.cpu_info()``, read once a process: every forward's choice reads it, and
    parsing ``/proc/cpuinfo`` grows with the core count."""
    from wiola.fast.decode_step_cpu import cpu_info

    return cpu_info()


def _flags() -> set[str]:
    return set(_cpu()["flags"].split())


def select(mode: str | None = None) -> str:
    """The prompt-path mode: ``mode`` if given, else ``$WIOLA_CPU_PREFILL``; ``auto`` (or unset)
    resolves from the CPU's flags (see the module). Raises ``ValueError`` naming a bad value."""
    source = "mode" if mode is not None else ENV
    requested = (mode if mode is not None else os.environ.get(ENV, "")).strip().lower()
    if requested in ("", "auto"):
        flags = _flags()
        return next((mode for flag, mode in AUTO.items() if flag in flags), "fp32")
    if requested not in MODES:
        raise ValueError(f"{source}={requested!r} is not one of auto, {', '.join(MODES)}")
    return requested


def select_gemm(name: str | None = None) -> str:
    """The fp32 GEMM: ``name`` if given, else ``$WIOLA_CPU_GEMM``; ``auto`` (or unset) looks up
    ``GEMM_AUTO`` by the CPU's vendor and family (``aten`` where absent, or where this torch has no
    oneDNN). Raises ``ValueError`` naming a bad value, or ``onednn`` forced without oneDNN."""
    from wiola.ops.linear import CPU_GEMMS, onednn_available

    source = "name" if name is not None else GEMM_ENV
    requested = (name if name is not None else os.environ.get(GEMM_ENV, "")).strip().lower()
    if requested in ("", "auto"):
        cpu = _cpu()
        chosen = GEMM_AUTO.get((cpu["vendor"], cpu["family"]), "aten")
        return chosen if chosen == "aten" or onednn_available() else "aten"
    if requested not in CPU_GEMMS:
        raise ValueError(f"{source}={requested!r} is not one of auto, {', '.join(CPU_GEMMS)}")
    if requested == "onednn" and not onednn_available():
        raise ValueError(f"{source}=onednn, but this torch has no oneDNN (torch.backends.mkldnn)")
    return requested


def _describe_gemm() -> str:
    chosen = select_gemm()
    forced = os.environ.get(GEMM_ENV, "").strip().lower()
    if forced and forced != "auto":
        return f"fp32 GEMM {chosen} (forced: {GEMM_ENV}={forced})"
    cpu = _cpu()
    key = (cpu["vendor"], cpu["family"])
    why = (
        f"{cpu['vendor']} family {cpu['family']} measured"
        if key in GEMM_AUTO
        else f"{cpu['vendor'] or cpu['machine']} family {cpu['family'] or '?'} not measured"
    )
    return f"fp32 GEMM {chosen} (auto: {why})"


def describe(mode: str | None = None) -> str:
    """One line: the chosen mode and why (forced, or the flag ``auto`` read), then the fp32 GEMM
    and why."""
    chosen = select(mode)
    gemm = _describe_gemm()
    forced = mode if mode is not None else os.environ.get(ENV, "").strip().lower()
    if forced and forced != "auto":
        return f"prefill {chosen} (forced: {ENV if mode is None else 'mode'}={forced}); {gemm}"
    flags = _flags()
    bf16_units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    why = f"CPU has {', '.join(bf16_units)}" if bf16_units else "CPU has no bf16 matrix units"
    return f"prefill {chosen} (auto: {why}; bf16 products miss the 0.001-nat quality rule); {gemm}"


def gemm_applies(model: Any, input_ids: Any) -> bool:
    """Whether this forward's products follow ``select_gemm()``: on a plain CPU, gradients and
    autocast off, an fp32 model (quantized or not), with or without a cache."""
    from wiola.fast.ops import kernels_usable

    return (
        isinstance(input_ids, torch.Tensor)
        and input_ids.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not kernels_usable(input_ids)
        and model.embed.weight.dtype == torch.float32
    )


def applies(model: Any, input_ids: Any, cache: Any) -> bool:
    """Whether the bf16 mode may run this forward: where ``gemm_applies``, for a prompt (``T > 1``)
    with a cache, of a model that is not quantized."""
    return (
        cache is not None
        and gemm_applies(model, input_ids)
        and input_ids.dim() == 2
        and input_ids.shape[1] > 1
        and getattr(model, "quantization", None) is None
    )


def context(model: Any, input_ids: Any, cache: Any) -> contextlib.AbstractContextManager:
    """The context to run this forward in: CPU bf16 autocast where ``select()`` says bf16 and
    ``applies``; else oneDNN's fp32 GEMM where ``select_gemm()`` says so and ``gemm_applies``;
    else a no-op."""
    if applies(model, input_ids, cache) and select() == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if gemm_applies(model, input_ids) and select_gemm() == "onednn":
        from wiola.ops.linear import cpu_gemm

        return cpu_gemm("onednn")
    return contextlib.nullcontext()
