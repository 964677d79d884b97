"""Helpers of the tests: the device, the per-dtype tolerance table, the named relative-error
assert, NaN-poisoned buffers, left-padded prompts, the reference oracle of a model and the
loop that drives the C++ CPU step beside it. Imported by the test files (``from numerics
import ...``; pytest puts ``tests/`` on the path), never from ``conftest``."""

from __future__ import annotations

from typing import Any

import torch

from bench.frame import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Largest allowed relative error per dtype, max|ref - got| / max|ref| (``rel_err``), in units of the
# dtype's unit roundoff u: bf16 2e-2 ≈ 5u (u = 3.9e-3), fp16 5e-3 ≈ 10u (u = 4.9e-4): a kernel and its
# reference round the same fp32 values a few times in a different order; fp32 1e-5 ≈ 170u (u = 6e-8):
# fp32 sums over a few hundred terms accumulated in another order.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}

# Kernel tests run fp32 everywhere and the half types only on CUDA (the interpreter's numpy
# has no bfloat16 arithmetic worth trusting).
KERNEL_DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    """Relative max error of ``got`` against ``ref`` within ``tol``; NaN anywhere fails."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in output (an element was never written?)"
    err = rel_err(ref, got)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def poisoned(*shape: int, dtype: torch.dtype = torch.float32, device: str = DEVICE) -> torch.Tensor:
    """A buffer full of NaN: any element a kernel forgets to write shows up as NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def left_padded_prompt(vocab_size: int, B: int, T: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` random ids (seeded by the shape) and a mask that left-pads row 1 by ``pad`` and
    the last row by ``pad // 2`` (no padding for ``B == 1`` or ``pad == 0``)."""
    gen = torch.Generator().manual_seed(B * 100 + T)
    ids = torch.randint(0, vocab_size, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    if B > 1 and pad:
        mask[1, :pad] = 0
        mask[B - 1, : pad // 2] = 0
    return ids, mask


def reference_on(model: torch.nn.Module) -> torch.nn.Module:
    """The reference ``wiola.WiolaModel`` (eval mode) on ``model``'s weights: for a model quantized
    by ``wiola.fast.quantize``, its dequantized weights (the oracle of the C++ step and exports)."""
    import wiola

    ref = wiola.WiolaModel(model.config).eval().requires_grad_(False)  # an oracle, never trained
    ref.load_state_dict(model.state_dict())
    return ref


def step_beside(ref: torch.nn.Module, ref_cache: Any, step: Any, cache: Any, steps: int, name: str, tol: float) -> None:
    """Feed ``steps`` random one-token steps (seeded) to ``step`` (a ``DecodeStepCPU`` bound to
    ``cache``) and to ``ref`` with ``ref_cache``; each step's logits within ``tol``."""
    B, V = cache.batch_size, ref.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    for i in range(steps):
        tokens = torch.randint(0, V, (B, 1), generator=gen)
        want = ref(tokens, cache=ref_cache).logits[:, 0]
        got = step(tokens.view(-1), cache.length)
        cache.length += 1
        assert_close(f"{name}[step {i}]", want, got, tol)
