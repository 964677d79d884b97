"""Helpers of the tests: the device, the per-dtype tolerance table, the named relative-error
assert, NaN-poisoned buffers, left-padded prompts, the reference oracle of a model and the
loop that drives the C++ CPU step beside it. Imported by the test files (``from numerics
import ...``; pytest puts ``tests/`` on the path), never from ``conftest``."""

from __future__ import annotations

import math
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


def step_beside(ref: torch.nn.Module, ref_cache: Any, step: Any, cache: Any, steps: int, name: str) -> float:
    """Feed ``steps`` random one-token steps (seeded) to ``step`` (a ``DecodeStepCPU`` bound to
    ``cache``) and to ``ref`` with ``ref_cache``; each step's logits within the fp32 error bound
    of two summation orders (``bound``, ``sides=2``). Returns the largest q/k/v projection
    magnitude seen (``AbsSums.proj``), for bounding the cache the steps wrote (``cache_bound``)."""
    B, V = cache.batch_size, ref.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    with AbsSums(ref) as sums:
        for i in range(steps):
            tokens = torch.randint(0, V, (B, 1), generator=gen)
            want = ref(tokens, cache=ref_cache).logits[:, 0]
            got = step(tokens.view(-1), cache.length)
            cache.length += 1
            allowed = bound(ref.config, cache.length, sums.head[:, 0])
            assert_within(f"{name}[step {i}]", want, got, allowed, getattr(step, "isa", None))
    return sums.proj


def beside_reference(name: str, ref: torch.nn.Module, run: Any, got: torch.Tensor, positions: int) -> None:
    """``run()`` (a call of the reference ``ref`` returning a ``ModelOutput``) gives the logits
    ``got`` must match within the two-sided fp32 bound for ``positions`` cached slots."""
    with AbsSums(ref) as sums:
        want = run().logits
    assert_within(name, want, got, bound(ref.config, positions, sums.head))


def cache_bound(config: Any, positions: int, proj: float, steps: int) -> dict[str, float]:
    """Allowed differences of the cache buffers after ``steps`` steps whose q/k/v products had
    magnitudes up to ``proj``: k (rotated: two products per element) and v, 2·bound; the gate's
    running sum adds one rotated head-mean of q a step, 2·steps·bound."""
    one = float(bound(config, positions, proj))
    return {"k": 2 * one, "v": 2 * one, "gate_sum": 2 * steps * one}


# ------------------------------------------------------------------ tolerances from an error bound
# Two fp32 computations of the same function differ by their summation order (BLAS vs the C++
# step, one CPU's kernels vs another's). A sum of K products computed in fp32 in any order is
# within γ_K·Σ|w_i·x_i| of the exact sum in the worst case (γ_K ≈ K·u, u = 2⁻²⁴; Higham, Accuracy
# and Stability of Numerical Algorithms, §3.1), and within λ·√K·u·Σ|w_i·x_i| with probability at
# least 1 - 2·exp(-λ²(1-u)²/2) when the rounding errors are independent and of mean zero
# (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.
# 41(5), 2019, theorem 2.4). An output at the end of a chain of sums carries the relative errors
# of every sum on its path, to first order: the chain's total length K_chain (``chain_length``)
# stands for K, and the magnitudes Σ|w·x| of the last product are measured on the oracle's own
# activations (``AbsSums``). With λ = 6 a comparison fails by chance with probability ≤ 3.05·10⁻⁸ per
# element (< 10⁻² over the ~10⁵ logits of the largest test). One fp32 side is within
# λ·√K_chain·u·Σ|w·x| of the exact value (``sides=1``, against the float64 oracle), two fp32 sides
# within twice that of each other (``sides=2``). The worst-case form (K instead of λ√K) is ~10×
# looser still at these lengths and would miss real defects; the probabilistic one is what holds
# on any CPU and summation order and still catches a wrong weight
# (``tests/test_decode_step_cpu.py::test_bound_catches_a_perturbed_weight``).
LAMBDA = 6.0
U32 = 2.0**-24  # fp32 unit roundoff


def chain_length(config: Any, positions: int) -> int:
    """K_chain: the summed lengths of the sums on the path from the embedding to a logit, for
    ``positions`` cached slots: per layer the two norms' mean squares (d each), q/k/v (d), the
    gate's head-mean and products (H + D + H), the scores and the weighted values (D and
    ``positions``), W_o (d), W_up/W_bp (d), W_down (d_ff); then the final norm (d) and the head (d)."""
    d, H, D, F = config.d_model, config.n_heads, config.head_dim, config.d_ff
    per_layer = 2 * d + d + (2 * H + D) + D + positions + d + d + F
    return config.n_layers * per_layer + 2 * d


def platform_line(isa: str | None = None) -> str:
    """The CPU model, its vector flags and the ISA variant, for a failure message."""
    from wiola.fast.decode_step_cpu import cpu_info

    info = cpu_info()
    keep = ("avx", "fma", "amx", "f16c", "sse4", "asimd", "sve", "neon")
    flags = " ".join(f for f in info["flags"].split() if f.startswith(keep)) or "none"
    return f"CPU {info['name']!r} ({info['machine']}), flags: {flags}; ISA variant: {isa or 'n/a'}"


class AbsSums:
    """Forward hooks on a reference ``wiola.WiolaModel`` that record the magnitudes of the sums
    its forward computes: ``head`` (the latest call's ``(B, T, V)`` Σ_i |E_vi·x_i| of the tied head
    on the final normalised states) and ``proj`` (the largest Σ_i |W_ri·x_i| of any layer's q, k or
    v projection seen so far, a float). Use as a context manager; the hooks go on exit."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.head, self.proj, self.hooks = model, None, 0.0, []

    def __enter__(self) -> AbsSums:
        m = self.model
        self.hooks.append(m.norm.register_forward_hook(lambda _m, _i, out: self._head(out)))
        for layer in m.layers:
            a = layer.attn
            ws = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
            self.hooks.append(layer.attn_norm.register_forward_hook(lambda _m, _i, out, ws=ws: self._proj(out, ws)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.hooks:
            h.remove()

    @staticmethod
    def _x(out: Any) -> torch.Tensor:
        return (out[0] if isinstance(out, tuple) else out).detach().double().abs()

    def _head(self, out: Any) -> None:
        self.head = self._x(out) @ self.model.embed.weight.detach().double().abs().T

    def _proj(self, out: Any, ws: tuple[torch.Tensor, ...]) -> None:
        x = self._x(out)
        self.proj = max(self.proj, *(float((x @ w.detach().double().abs().T).max()) for w in ws))


U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)


def bound(
    config: Any, positions: int, magnitude: torch.Tensor | float, sides: int = 2, unit: float = U32
) -> torch.Tensor | float:
    """The largest difference the bound allows: ``sides · λ · √K_chain · unit · magnitude`` (see
    above; ``unit`` ``U_BF16`` for products whose inputs are rounded to bf16)."""
    return sides * LAMBDA * math.sqrt(chain_length(config, positions)) * unit * magnitude


def assert_within(name: str, want: torch.Tensor, got: torch.Tensor, allowed: Any, isa: str | None = None) -> None:
    """``|want - got| <= allowed`` elementwise (``allowed`` a tensor broadcasting to them, or a
    float); NaN fails. The message names the worst element, its ratio to the bound and the
    platform (``platform_line``)."""
    assert want.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in output (an element was never written?)"
    diff = (want.detach().double() - got.detach().double()).abs()
    allowed = torch.as_tensor(allowed, dtype=torch.float64).expand_as(diff)
    ratio = diff / allowed.clamp_min(1e-300)
    worst = int(ratio.argmax())
    assert float(ratio.max()) <= 1.0, (
        f"{name}: |difference| {float(diff.flatten()[worst]):.3e} at flat index {worst} exceeds the fp32 error "
        f"bound {float(allowed.flatten()[worst]):.3e} ({float(ratio.max()):.2f}x; max |reference| "
        f"{float(want.abs().max()):.3e}); {platform_line(isa)}"
    )


def log_softmax_bound(logit_bound: torch.Tensor | float, logits: torch.Tensor) -> torch.Tensor:
    """The largest difference allowed between two log-softmaxes (over the last dimension) of
    logits ``(..., V)`` that differ elementwise by at most ``logit_bound`` (a tensor broadcasting
    to ``logits``, or a float; e.g. ``bound``), each side computed in fp32 or better; ``logits``
    are one side's (float64 result, broadcasting to them).

    ``log_softmax(z)_i = z_i - logsumexp(z)``, and logsumexp moves by at most ``max_j |Δz_j|`` (its
    gradient is the softmax: nonnegative, summing to 1), so a value moves by at most twice the
    row's largest logit bound. Each side's own rounding of an fp32 log-softmax: ``z_j - max z``
    (``u·range`` through the exponentials), the sum of V exponentials (``λ·√V·u`` relative, as in
    ``bound``, plus ``2u`` for exp and log) and the result's rounding (``u·|log p|``)."""
    z = logits.detach().double()
    allowed = torch.as_tensor(logit_bound, dtype=torch.float64).expand_as(z)
    spread = z.amax(-1, keepdim=True) - z.amin(-1, keepdim=True)
    own = U32 * (spread + LAMBDA * math.sqrt(z.shape[-1]) + 2 + torch.log_softmax(z, -1).abs())
    return 2 * allowed.amax(-1, keepdim=True) + 2 * own
