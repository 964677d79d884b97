"""The flash-decoding kernel against ``wiola.ops.decode_attention``: outputs, the cache it
writes, split counts, left padding, a device-tensor ``start``, and NaN-poisoned cache slots
past ``start + T`` that must never be read."""

from __future__ import annotations

import pytest
import torch
from numerics import DEVICE, KERNEL_DTYPES, TOL, assert_close, poisoned

from wiola.ops.decode import decode_attention as reference
from wiola.ops.rope import helix_frequencies, rope_tables

decode = pytest.importorskip("wiola_kernels.decode")

# (B, T, H, D, S, start, num_splits, left_pad): T new tokens written at slot `start` of an S-slot cache.
CASES = [
    (1, 1, 4, 32, 70, 40, 1, 0),
    (1, 1, 4, 32, 70, 40, 3, 0),  # 41 filled slots over 3 splits of 64: two splits are empty
    (3, 1, 4, 32, 300, 250, 4, 7),  # 251 filled slots: not a multiple of the split size
    (3, 5, 4, 16, 90, 40, 2, 45),  # a chunk of 5; row 1 is padding up to slot 45: early queries see no key
    (3, 17, 2, 64, 40, 0, 2, 3),  # prefill into an empty cache
    (2, 20, 4, 32, 200, 130, 5, 0),  # chunk after a long prefix, 2 query tiles
    (1, 1, 1, 32, 130, 129, 2, 0),  # the last slot
]


def _id(case) -> str:
    B, T, H, D, S, start, splits, pad = case
    return f"B{B}-T{T}-H{H}-D{D}-S{S}-start{start}-splits{splits}-pad{pad}"


def _inputs(B, T, H, D, S, start, left_pad, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    qkv = randn(B, T, 3, H, D)  # q, k, v as strided views of one projection, like the model's
    q, k, v = qkv.unbind(2)
    g = torch.rand(B, T, H, generator=gen).to(DEVICE)
    positions = torch.arange(start, start + T).expand(B, T)
    cos, sin = rope_tables(positions.to(DEVICE), helix_frequencies(D).to(DEVICE))
    k_cache, v_cache = poisoned(B, H, S, D, dtype=dtype), poisoned(B, H, S, D, dtype=dtype)
    k_cache[:, :, :start] = randn(B, H, start, D)
    v_cache[:, :, :start] = randn(B, H, start, D)
    key_mask = torch.zeros(B, S, dtype=torch.bool, device=DEVICE)
    key_mask[:, : start + T] = True
    if B > 1:
        key_mask[1, :left_pad] = False
        key_mask[B - 1, : min(left_pad, 2)] = False
    return q, k, v, g, cos, sin, k_cache, v_cache, key_mask


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode_matches_reference(case, dtype):
    B, T, H, D, S, start, splits, left_pad = case
    start_kind = "tensor" if CASES.index(case) % 2 else "int"  # every other case reads start from memory
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = _inputs(B, T, H, D, S, start, left_pad, dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_o = reference(q, k, v, g, cos, sin, ref_k, ref_v, key_mask, start)
    start_arg = torch.tensor(start, device=DEVICE) if start_kind == "tensor" else start
    o = decode.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, start_arg, num_splits=splits)
    end = start + T
    assert o.dtype == q.dtype and o.shape == q.shape, f"o: {o.dtype} {tuple(o.shape)}"
    assert_close("o", ref_o, o, TOL[dtype])
    assert_close("k_cache[:start+T]", ref_k[:, :, :end], k_cache[:, :, :end], TOL[dtype])
    assert_close("v_cache[:start+T]", ref_v[:, :, :end], v_cache[:, :, :end], TOL[dtype])
    assert torch.isnan(k_cache[:, :, end:]).all() and torch.isnan(v_cache[:, :, end:]).all(), (
        "cache slots past start + T were written"
    )


@pytest.mark.parametrize("splits", [1, 2, 7, 20])
def test_split_counts_agree(splits):
    """Any split count gives the same output (20 splits of a 70-slot fill: most are empty)."""
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = _inputs(2, 1, 4, 32, 100, 69, 9, torch.float32, seed=1)
    ref_o = reference(q, k, v, g, cos, sin, k_cache.clone(), v_cache.clone(), key_mask, 69)
    o = decode.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, 69, num_splits=splits)
    assert_close(f"o[splits={splits}]", ref_o, o, TOL[torch.float32])


def test_all_keys_masked_gives_zeros():
    """A query with no real key at or before it (inside left padding) returns zeros, not NaN."""
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = _inputs(1, 3, 2, 32, 64, 10, 0, torch.float32)
    key_mask[:] = False
    o = decode.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, 10, num_splits=2)
    assert not torch.isnan(o).any(), "o: NaN for a query with no key"
    assert (o == 0).all(), f"o: expected zeros, max |o| = {o.abs().max():.3e}"


def test_write_cache_matches_reference():
    B, T, H, D, S = 2, 9, 4, 32, 50
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = _inputs(B, T, H, D, S, 6, 0, torch.float32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference(q, k, v, g, cos, sin, ref_k, ref_v, key_mask, 6)
    decode.write_cache(k, v, cos, sin, k_cache, v_cache, torch.tensor(6, device=DEVICE))
    assert_close("k_cache", ref_k[:, :, : 6 + T], k_cache[:, :, : 6 + T], TOL[torch.float32])
    assert_close("v_cache", ref_v[:, :, : 6 + T], v_cache[:, :, : 6 + T], TOL[torch.float32])
    assert torch.isnan(k_cache[:, :, 6 + T :]).all(), "k_cache: slots past start + T were written"


def test_default_splits_depend_on_static_shapes_only():
    """The split count comes from the cache size, not its fill: one CUDA graph fits every step."""
    n = decode.default_num_splits(1, 8, 1, 1024, torch.device(DEVICE))
    assert n >= 1 and n == decode.default_num_splits(1, 8, 1, 1024, torch.device(DEVICE))
    assert decode.default_num_splits(1, 8, 1, 100, torch.device(DEVICE)) == 1, "a 100-slot cache needs no split"


def test_bad_inputs_raise():
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = _inputs(1, 2, 2, 32, 16, 4, 0, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        decode.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, 15)
    with pytest.raises(ValueError, match="key_mask"):
        decode.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, key_mask[:, :8], 4)
    with pytest.raises(ValueError, match="g must be float32"):
        decode.decode_attention(q, k, v, g.double(), cos, sin, k_cache, v_cache, key_mask, 4)
    with pytest.raises(TypeError, match="start"):
        decode.decode_attention(q, k, v, g, cos, sin, k_cache, v_cache, key_mask, 4.0)
    with pytest.raises(ValueError, match="head width"):
        x = torch.zeros(1, 2, 2, 24, device=DEVICE)
        decode.decode_attention(x, x, x, g, cos[..., :12], sin[..., :12], k_cache[..., :24], v_cache[..., :24],
                                key_mask, 4)  # fmt: skip


@pytest.mark.parametrize("queries", [1, 3, 5])
def test_queries_attend_with_the_last_tokens_only(queries):
    """``decode_attention(..., queries=n)``: the last ``n`` new tokens' outputs of the full call,
    every key and value written all the same, for the reference and the fast ops' PyTorch path in
    float64 (equal but for the products' shapes: sums of at most 45 terms of magnitude about 4, so
    about 1e-14 apart at most, within 1e-12), and for the fast ops' kernels in fp32 bitwise (they
    compute every query and keep the last ones), both the prefill into an empty cache (flash
    attention) and a chunk after cached tokens (flash decoding); the name of the problem for ``n``
    outside ``1 .. T`` or not an int. (The C++ path's bitwise equality:
    ``tests/test_decode_step_cpu.py``.)"""
    import wiola.fast.ops as fast_ops

    B, T, H, D, S, start, pad = 3, 5, 4, 16, 90, 40, 45
    inputs = [t.cpu() for t in _inputs(B, T, H, D, S, start, pad, torch.float64)]
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = inputs
    g = g.double()
    for name, op in (("reference", reference), ("fast ops, PyTorch path", fast_ops.TORCH_OPS.decode_attention)):
        caches = {}
        outs = {}
        for n in (None, queries):
            kc, vc = k_cache.clone(), v_cache.clone()
            outs[n] = op(q, k, v, g, cos, sin, kc, vc, key_mask, start, queries=n)
            caches[n] = (kc, vc)
        assert outs[queries].shape == (B, queries, H, D), (name, outs[queries].shape)
        torch.testing.assert_close(outs[queries], outs[None][:, T - queries :], rtol=1e-12, atol=1e-12)
        for a, b in zip(caches[None], caches[queries]):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{name}: queries={queries} wrote another cache"
    for start_k in (0, start):  # the kernels: the prefill's flash attention, then flash decoding
        q, k, v, g, cos, sin, k_cache, v_cache, key_mask = _inputs(B, T, H, D, S, start_k, 0, torch.float32)
        runs = {}
        for n in (None, queries):
            kc, vc = k_cache.clone(), v_cache.clone()
            runs[n] = (
                fast_ops.KERNEL_OPS.decode_attention(q, k, v, g, cos, sin, kc, vc, key_mask, start_k, queries=n),
                kc,
                vc,
            )
        out = runs[queries][0]
        assert out.shape == (B, queries, H, D)
        assert torch.equal(out, runs[None][0][:, T - queries :]), f"kernels at start {start_k}: other outputs"
        for a, b in zip(runs[None][1:], runs[queries][1:]):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"kernels at start {start_k}: another cache"
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = inputs
    for bad in (0, T + 1, 1.5, True):
        with pytest.raises(ValueError, match=r"queries=.*an int from 1 to T=5"):
            reference(q, k, v, g, cos, sin, k_cache.clone(), v_cache.clone(), key_mask, start, queries=bad)
