"""Inputs, float64 oracles and error bounds for the C++ prompt functions of
``wiola.fast.decode_step_cpu`` (attention over the cache, RMSNorm rows, the butterfly's SiLU gate),
shared by the x86 tests (``test_decode_step_cpu.py``) and the aarch64 ones under qemu
(``test_decode_step_arm.py``)."""

from __future__ import annotations

import math

import torch
from numerics import LAMBDA, U32, assert_within

# (B, T, H, D, S, start, pad): T new tokens at slot `start` of an S-slot cache; row 1 is padding
# up to slot `pad` (the last row up to pad // 2).
PROMPT_CASES = [
    (1, 2, 1, 16, 4, 0, 0),  # the smallest prompt
    (1, 37, 3, 32, 40, 0, 0),  # T not a multiple of the 8-query tile
    (3, 21, 2, 32, 70, 40, 45),  # a chunk after 40 cached slots; row 1's early queries see no key
    (2, 130, 4, 64, 140, 0, 20),  # D 64: two passes of values a tile on AVX-512; left padding
    (2, 19, 2, 48, 300, 250, 3),  # D 48: a pass of two vectors and one of one; a long prefix
    (2, 1, 2, 32, 30, 17, 5),  # one token after 17 cached slots (a step outside the C++ step); padding
    (2, 23, 2, 40, 50, 9, 4),  # D 40: whole vectors, then 8 (AVX-512) columns one at a time; padding
    (1, 17, 3, 10, 20, 0, 0),  # D 10: fewer columns than a vector's lanes on AVX2 and AVX-512
]


def prompt_inputs(B, T, H, D, S, start, pad, seed=0):
    """q, k, v (views of one (B, T, 3, H, D) projection, as the model's), g, cos, sin, a cache whose
    first `start` slots hold earlier keys and values, and its key mask."""
    from wiola.ops.rope import helix_frequencies, rope_tables

    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(B, T, 3, H, D, generator=gen).unbind(2)
    g = torch.rand(B, T, H, generator=gen)
    key_mask = torch.zeros(B, S, dtype=torch.bool)
    key_mask[:, : start + T] = True
    if B > 1:
        key_mask[1, :pad] = False
        key_mask[B - 1, : pad // 2] = False
    real = key_mask[:, start : start + T].long()
    positions = (torch.cumsum(real, 1) - real) + key_mask[:, :start].sum(1, keepdim=True)
    cos, sin = rope_tables(positions, helix_frequencies(D))
    k_cache, v_cache = torch.zeros(B, H, S, D), torch.zeros(B, H, S, D)
    k_cache[:, :, :start] = torch.randn(B, H, start, D, generator=gen)
    v_cache[:, :, :start] = torch.randn(B, H, start, D, generator=gen)
    return q, k, v, g, cos, sin, k_cache, v_cache, key_mask


def prompt_oracle(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start, reach=0):
    """float64, from SPEC's equations: the output (B, T, H, D), the keys it caches (B, H, T, D),
    and the bound's magnitudes: Σ_s p_s |v_s| (B, T, H, D), each query's largest score magnitude
    g/√D Σ_j |q̃_j k̃_j| (B, T, H, 1) and its count of real slots (B, T, 1, 1). ``reach``: how many
    slots past its own each query may see (1: a causal mask off by one, for the defect check)."""
    B, T, H, D = q.shape
    half = D // 2

    def rotate(x):  # (B, T, H, D), pair i = (x_i, x_{i + D/2})
        c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2)
        x1, x2 = x.double()[..., :half], x.double()[..., half:]
        return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)

    qr, kr = rotate(q), rotate(k)
    keys = torch.cat((k_cache.double()[:, :, :start], kr.transpose(1, 2)), dim=2)  # (B, H, end, D)
    values = torch.cat((v_cache.double()[:, :, :start], v.double().transpose(1, 2)), dim=2)
    end = start + T
    slots = torch.arange(end)
    allowed = (slots.view(1, end) <= (torch.arange(T) + start + reach).view(T, 1)).view(1, 1, T, end)
    allowed = allowed & key_mask[:, :end].view(B, 1, 1, end)  # (B, 1, T, end)
    scale = g.double().transpose(1, 2).unsqueeze(-1) / math.sqrt(D)  # (B, H, T, 1)
    scores = (qr.transpose(1, 2) @ keys.transpose(-1, -2)) * scale
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    out = (p @ values).transpose(1, 2)
    magnitude = (p @ values.abs()).transpose(1, 2)
    a = (qr.abs().transpose(1, 2) @ keys.abs().transpose(-1, -2)) * scale
    largest = a.masked_fill(~allowed, 0.0).amax(-1, keepdim=True).transpose(1, 2)
    count = allowed.sum(-1, keepdim=True).transpose(1, 2).double()  # (B, T, 1, 1)
    return out, kr.transpose(1, 2), magnitude, largest, count


def prompt_bound(D, magnitude, largest, count):
    """|error| of an output element: λ u Σ_s p_s |v_s| (√(2n) + 2 √(D + 4) max_s g/√D Σ_j |q̃_j k̃_j|).
    The softmax sum and the weighted values are sums of n terms (√(2n)); a score's error (its D
    products and the two rotations) moves each p_s by that much relative, which moves the output
    by at most twice the score error times Σ p_s |v_s|. Probabilistic, as ``numerics.bound``."""
    return LAMBDA * U32 * magnitude * ((2 * count).sqrt() + 2 * math.sqrt(D + 4) * largest)


def rows_inputs(rows, d, seed):
    """(rows, d) fp32 values whose rows differ in scale by powers of 10 from 1e-3 (where RMSNorm's
    eps 1e-6 matters) to 1e3, and some beyond ±87 (where e^-|x| underflows)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.arange(-3, 4, dtype=torch.float32).repeat(rows // 7 + 1)[:rows, None]
    x = torch.randn(rows, d, generator=gen) * scale
    x[::5, ::3] = torch.empty(len(range(0, rows, 5)), len(range(0, d, 3))).uniform_(-120, 120, generator=gen)
    return x


def rms_norm_oracle(h: torch.Tensor, w: torch.Tensor, eps: float, n: int | None = None) -> torch.Tensor:
    """float64 ``h / sqrt(Σh²/n + eps) ⊙ w`` (``n`` the width unless given: ``d - 1`` for the
    defect check)."""
    h64 = h.double()
    n = h.shape[-1] if n is None else n
    return h64 / torch.sqrt(h64.pow(2).sum(-1, keepdim=True) / n + eps) * w.double()


def rms_norm_bound(want: torch.Tensor) -> torch.Tensor:
    """λu(√(2d)/2 + 6)|out|: the mean of d squares (a sum of d positive terms, relative), then the
    add of eps, the square root, the reciprocal and two products, each one rounding."""
    d = want.shape[-1]
    return LAMBDA * U32 * (math.sqrt(2 * d) / 2 + 6) * want.abs()


def silu_gate_oracle(up: torch.Tensor, c: torch.Tensor, sign: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``SiLU(a) ⊙ b + c`` with ``[a ‖ b] = up`` (``sign`` -1: a sigmoid of the wrong sign,
    for the defect check), and its bound u(6|SiLU(a) b| + 2|SiLU(a) b + c|) + 1.1e-36|b|: e^-|x|
    within 7.9e-8, an add, a division and three products; the final add; and where e^-|x|
    underflows (below -87.34), |x| e^-|x| < 1.1e-36."""
    a, b = up.double().chunk(2, dim=-1)
    sb = a * torch.sigmoid(sign * a) * b
    want = sb + c.double()
    return want, U32 * (6 * sb.abs() + 2 * want.abs()) + 1.1e-36 * b.abs()


def cached_keys_bound(want_keys: torch.Tensor) -> torch.Tensor:
    """λu·4·max|k̃| per cached key (a rotation: two products and one sum per element)."""
    return LAMBDA * U32 * 4 * want_keys.abs().amax(-1, keepdim=True)


def check_prompt_attention(name, inputs, start, got, k_cache, v_cache, where):
    """Asserts what the C++ prompt attention wrote for ``inputs`` (``prompt_inputs``' tuple) at
    ``start``: ``got`` (B, T, H, D) within ``prompt_bound`` of the float64 oracle at real queries
    and zeros at padding queries, the new slots of ``k_cache`` the rotated keys within
    ``cached_keys_bound`` and of ``v_cache`` the values exactly. Returns ``(want, allowed, real)``
    for further checks."""
    q, k, v, g, cos, sin, _, _, key_mask = inputs
    T, D = q.shape[1], q.shape[3]
    want, want_keys, magnitude, largest, count = prompt_oracle(*inputs, start)
    allowed = prompt_bound(D, magnitude, largest, count)
    real = key_mask[:, start : start + T]
    assert torch.equal(got[~real], torch.zeros_like(got[~real])), f"{name}: a padding query got non-zeros"
    assert_within(name, want[real], got[real].double(), allowed[real], where)
    new = slice(start, start + T)
    assert_within(f"{name}: cached keys", want_keys, k_cache[:, :, new].double(), cached_keys_bound(want_keys), where)
    assert torch.equal(v_cache[:, :, new], v.transpose(1, 2)), f"{name}: cached values are not the values"
    return want, allowed, real


def check_rms_norm(name, x, residual, w, eps, out, h, where):
    """Asserts the C++ RMSNorm's ``h`` (bitwise fp32's ``x + residual``, or ``x`` without one) and
    ``out`` within ``rms_norm_bound`` of the float64 oracle. Returns ``(want, allowed)``."""
    if residual is not None:
        assert torch.equal(h, x + residual), f"{name}: h != x + residual in fp32"
    want = rms_norm_oracle(h, w, eps)
    allowed = rms_norm_bound(want)
    assert_within(name, want, out.double(), allowed, where)
    return want, allowed


def check_silu_gate(name, up, c, got, where):
    """Asserts the C++ SiLU gate's ``got`` within ``silu_gate_oracle``'s bound. Returns
    ``(want, allowed)``."""
    want, allowed = silu_gate_oracle(up, c)
    assert_within(name, want, got.double(), allowed, where)
    return want, allowed
