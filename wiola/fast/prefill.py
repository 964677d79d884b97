"""How ``wiola.fast.WiolaModel`` runs the prompt path on a CPU: fp32, or bf16 matrix products.

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
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

MODES = ("fp32", "bf16")
ENV = "WIOLA_CPU_PREFILL"
AUTO: dict[str, str] = {}  # CPU flag -> the mode ``auto`` picks where it is present (none meets the rule yet)


def _flags() -> set[str]:
    from wiola.fast.decode_step_cpu import cpu_info

    return set(cpu_info()["flags"].split())


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


def describe(mode: str | None = None) -> str:
    """One line: the chosen mode and why (forced, or the flag ``auto`` read)."""
    chosen = select(mode)
    forced = mode if mode is not None else os.environ.get(ENV, "").strip().lower()
    if forced and forced != "auto":
        return f"prefill {chosen} (forced: {ENV if mode is None else 'mode'}={forced})"
    flags = _flags()
    bf16_units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    why = f"CPU has {', '.join(bf16_units)}" if bf16_units else "CPU has no bf16 matrix units"
    return f"prefill {chosen} (auto: {why}; bf16 products miss the 0.001-nat quality rule)"


def applies(model: Any, input_ids: Any, cache: Any) -> bool:
    """Whether the bf16 mode may run this forward: a prompt (``T > 1``) with a cache, on a plain
    CPU, gradients and autocast off, an fp32 model that is not quantized."""
    from wiola.fast.ops import kernels_usable

    return (
        cache is not None
        and isinstance(input_ids, torch.Tensor)
        and input_ids.dim() == 2
        and input_ids.shape[1] > 1
        and input_ids.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not kernels_usable(input_ids)
        and getattr(model, "quantization", None) is None
        and model.embed.weight.dtype == torch.float32
    )


def context(model: Any, input_ids: Any, cache: Any) -> contextlib.AbstractContextManager:
    """The context to run this forward in: CPU bf16 autocast where ``select()`` says bf16 and
    ``applies``, else a no-op."""
    if applies(model, input_ids, cache) and select() == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
