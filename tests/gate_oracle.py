"""The gate's test inputs and its float64 oracle, shared by ``tests/test_gate.py`` (the Triton
kernel and the reference) and ``tests/test_decode_step_cpu.py`` (the C++ gate)."""

from __future__ import annotations

import torch
from numerics import DEVICE, LAMBDA, U32

from wiola.ops.rope import helix_frequencies, positions_from_mask, rope_tables


def make_inputs(B, T, H, D, *, dtype=torch.float32, pad="none", rotate=False, alpha=0.05, carry=False, seed=0):
    """q as a strided view of a fused (B, T, 3, H, D) projection, weights, mask, rope tables, carry."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3, H, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    w1 = (0.4 * torch.randn(H, D, generator=gen)).to(DEVICE).requires_grad_()
    w2 = (0.4 * torch.randn(H, H, generator=gen)).to(DEVICE).requires_grad_()
    b2 = (0.1 * torch.randn(H, generator=gen)).to(DEVICE).requires_grad_()
    mask = None
    if pad != "none":
        mask = torch.ones(B, T, dtype=torch.bool)
        lengths = torch.randint(0, T // 2 + 1, (B,), generator=gen)
        for b in range(B):
            n = int(lengths[b]) if b else max(1, T // 3)  # row 0 always has some padding
            if pad in ("left", "both"):
                mask[b, : min(n, T - 1)] = False
            if pad in ("right", "both"):
                mask[b, T - max(1, n // 2) :] = False
        mask = mask.to(DEVICE)
    rope = {}
    if rotate:
        positions = positions_from_mask(mask.cpu() if mask is not None else None, B, T)
        cos, sin = rope_tables(positions, helix_frequencies(D, alpha=alpha))
        rope = {"cos": cos.to(DEVICE), "sin": sin.to(DEVICE)}
    state = None
    if carry:
        total = torch.randn(B, D, generator=gen).to(DEVICE).requires_grad_()
        state = (total, torch.randint(0, 6, (B,), generator=gen).to(DEVICE))
    return qkv, (w1, w2, b2), mask, rope, state


def gate_float64(q, w1, w2, b2, cos=None, sin=None, mask=None, carry=None):
    """The SPEC's formulas token by token in float64, an oracle independent of wiola.ops: ``(g
    (B, T, H), the final running sums (B, D), allowed)``, where ``allowed`` is the first-order bound
    of an fp32 evaluation's error per gate: each step's rounding (λ·√n·u·Σ|terms| for a sum of n, u
    for each division, product and rotation, 4u for SiLU's and σ's exponentials) carried forward
    through the later steps' derivatives (|SiLU'| <= 1.1, σ' <= 1/4). Differentiable in q and the
    weights (the bound is not)."""
    B, T, H, D = q.shape
    half, u, lam = D // 2, U32, LAMBDA
    q, w1, w2, b2 = q.double(), w1.double(), w2.double(), b2.double()
    g = torch.zeros(B, T, H, dtype=torch.float64)
    allowed = torch.zeros(B, T, H, dtype=torch.float64)
    sums = []
    for b in range(B):
        running = carry[0][b].detach().double().clone() if carry is not None else torch.zeros(D, dtype=torch.float64)
        n = int(carry[1][b]) if carry is not None else 0
        run_err, run_abs = torch.zeros(D, dtype=torch.float64), running.abs()
        for t in range(T):
            m = q[b, t].mean(0)
            with torch.no_grad():
                m_err = lam * H**0.5 * u * q[b, t].abs().mean(0) + u * m.abs()
            if cos is not None:
                c, s = cos[b, t].double(), sin[b, t].double()
                m1, m2 = m[:half], m[half:]
                with torch.no_grad():
                    e1, e2 = m_err[:half], m_err[half:]
                    scale = torch.cat(
                        (m1.abs() * c.abs() + m2.abs() * s.abs(), m1.abs() * s.abs() + m2.abs() * c.abs())
                    )
                    m_err = torch.cat((e1 * c.abs() + e2 * s.abs(), e1 * s.abs() + e2 * c.abs())) + 2 * u * scale
                m = torch.cat((m1 * c - m2 * s, m1 * s + m2 * c))
            if mask is None or bool(mask[b, t]):
                running, n = running + m, n + 1
                with torch.no_grad():
                    run_abs, run_err = run_abs + m.abs(), run_err + m_err
            ct = running / max(n, 1)
            a = w1 @ ct
            hidden = a * torch.sigmoid(a)
            z = w2 @ hidden + b2
            g[b, t] = torch.sigmoid(z)
            with torch.no_grad():
                c_err = (run_err + lam * max(n, 1) ** 0.5 * u * run_abs) / max(n, 1) + u * ct.abs()
                a_err = lam * D**0.5 * u * (w1.abs() @ ct.abs()) + w1.abs() @ c_err
                h_err = 1.1 * a_err + 4 * u * hidden.abs()
                z_err = lam * (H + 1) ** 0.5 * u * (w2.abs() @ hidden.abs() + b2.abs()) + w2.abs() @ h_err
                allowed[b, t] = z_err / 4 + 4 * u * torch.sigmoid(z)
        sums.append(running)
    return g, torch.stack(sums), allowed
