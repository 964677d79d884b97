"""Helical RoPE: the frequency formula, alpha = 0 is standard RoPE, relative-offset property."""

from __future__ import annotations

import math

import pytest
import torch

from wiola.ops import apply_rope, helix_frequencies, positions_from_mask, rope_tables


def test_frequencies_follow_eq_4_to_6():
    D = 32
    got = helix_frequencies(D, 10000.0, 0.05, torch.float64)
    for i in range(D // 2):
        want = 10000.0 ** (-2 * i / D) * (1 + 0.05 * math.sqrt(i + 1) / math.sqrt(D / 2))
        assert abs(got[i].item() - want) < 1e-15 * max(1.0, want)
    phi = got / helix_frequencies(D, 10000.0, 0.0, torch.float64)
    assert abs(phi[0].item() - (1 + 0.05 / 4)) < 1e-12 and abs(phi[-1].item() - 1.05) < 1e-12  # paper: 1.0125 .. 1.05


def standard_rope_adjacent(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Su et al.'s RoPE on adjacent pairs (2i, 2i+1), written independently."""
    D = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(D // 2):
        theta = base ** (-2 * i / D)
        ang = pos.view(-1, 1).double() * theta
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * torch.cos(ang) - b * torch.sin(ang)
        out[..., 2 * i + 1] = a * torch.sin(ang) + b * torch.cos(ang)
    return out


def test_alpha_zero_is_standard_rope_up_to_the_pair_permutation():
    torch.manual_seed(0)
    T, H, D = 11, 2, 16
    x = torch.randn(1, T, H, D, dtype=torch.float64)
    pos = torch.arange(T)
    cos, sin = rope_tables(pos[None], helix_frequencies(D, 10000.0, 0.0, torch.float64))
    ours = apply_rope(x, cos, sin)
    # rotate-half pair i = (i, i + D/2) is the adjacent pair (2i, 2i+1) after this permutation
    perm = torch.stack((torch.arange(D // 2), torch.arange(D // 2) + D // 2), dim=1).reshape(-1)
    theirs = standard_rope_adjacent(x[..., perm], pos)
    assert (ours[..., perm] - theirs).abs().max() < 1e-12


@pytest.mark.parametrize("alpha", [0.0, 0.05])
def test_rotated_dot_product_depends_on_offset_only(alpha):
    torch.manual_seed(1)
    D = 32
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    freqs = helix_frequencies(D, 10000.0, alpha, torch.float64)

    def rot(v, m):
        c, s = rope_tables(torch.tensor([[m]]), freqs)
        return apply_rope(v.view(1, 1, 1, D), c, s).view(D)

    for offset in (0, 3, 40):
        dots = [rot(q, t + offset) @ rot(k, t) for t in (0, 7, 123, 999)]
        assert max(dots) - min(dots) < 1e-9, f"offset {offset}: dot products vary with absolute position"


def test_positions_count_real_tokens_before_each_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pos = positions_from_mask(mask, 3, 5)
    assert pos.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3], [0, 1, 2, 3, 4]]
    assert positions_from_mask(None, 2, 3, offset=torch.tensor([4, 0])).tolist() == [[4, 5, 6], [0, 1, 2]]
