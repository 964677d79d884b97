"""Cached decoding equals the full-sequence pass (docs/SPEC.md exactness claim 1)."""

from __future__ import annotations

import pytest
import torch

from wiola import Cache, WiolaConfig, WiolaModel


@pytest.fixture(scope="module")
def model_13m() -> WiolaModel:
    torch.manual_seed(0)
    return WiolaModel(WiolaConfig.preset("13m", max_seq_len=512)).eval()


CHUNKINGS = {
    "one-call": [300],
    "token-by-token-tail": [290] + [1] * 10,
    "uneven": [1, 16, 83, 100, 7, 93],
    "halves": [150, 150],
}


@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
def test_chunked_prefill_and_decode_match_full_pass(model_13m, chunks):
    torch.manual_seed(1)
    ids = torch.randint(0, 32000, (2, sum(chunks)))
    with torch.no_grad():
        full = model_13m(ids).logits
        cache = model_13m.new_cache(2, 320)
        pieces, start = [], 0
        for n in chunks:
            pieces.append(model_13m(ids[:, start : start + n], cache=cache).logits)
            start += n
    got = torch.cat(pieces, dim=1)
    err = (got - full).abs().max().item()
    assert err <= 1e-4, f"cached logits differ from the full pass by {err:.2e} (scale {full.abs().max():.1f})"
    assert cache.length == 300
    assert torch.equal(cache.n_real, torch.tensor([300, 300]))
    assert torch.equal(cache.gate_count[:, 0], torch.full((6,), 300))


def test_cache_state_is_what_the_gate_summed(model_13m):
    """The cache carries, per layer, the fp32 running sum of head-mean queries and the count."""
    ids = torch.randint(0, 32000, (1, 9))
    cache = model_13m.new_cache(1, 16)
    with torch.no_grad():
        model_13m(ids, cache=cache)
        layer = model_13m.layers[0]
        x = torch.nn.functional.rms_norm(model_13m.embed(ids), (256,), layer.attn_norm.weight, eps=1e-6)
        q = layer.attn.q_proj(x).view(1, 9, 8, 32)
    want = q.mean(dim=2).sum(dim=1)[0]
    assert cache.gate_sum.dtype == torch.float32
    assert (cache.gate_sum[0, 0] - want).abs().max() < 1e-5


def test_cache_reset_and_reuse(model_13m):
    ids = torch.randint(0, 32000, (1, 20))
    cache = model_13m.new_cache(1, 20)
    with torch.no_grad():
        first = model_13m(ids, cache=cache).logits
        cache.reset()
        again = model_13m(ids, cache=cache).logits
    assert torch.equal(first, again)


def test_cache_buffers_are_static(model_13m):
    cache = Cache(model_13m.config, 1, 64)
    ptrs = [cache.k.data_ptr(), cache.v.data_ptr(), cache.gate_sum.data_ptr()]
    with torch.no_grad():
        model_13m(torch.randint(0, 32000, (1, 5)), cache=cache)
        for _ in range(3):
            model_13m(torch.randint(0, 32000, (1, 1)), cache=cache)
    assert ptrs == [cache.k.data_ptr(), cache.v.data_ptr(), cache.gate_sum.data_ptr()]
    assert cache.length == 8


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("n_layers", [1, 2])
def test_backward_through_a_cached_forward_is_refused_by_name(fast, n_layers):
    """Each layer writes the cache in place: a backward through a cached forward raises a message
    that says so (not autograd's in-place error, nor, with one layer, gradients of the new tokens
    only); the forward itself, and under no_grad, is unchanged."""
    import wiola.fast

    torch.manual_seed(0)
    cfg = WiolaConfig(vocab_size=97, d_model=32, n_layers=n_layers, n_heads=2, d_ff=48, max_seq_len=32)
    model = (wiola.fast.WiolaModel if fast else WiolaModel)(cfg)
    ids = torch.randint(0, 97, (2, 9))
    out = model(ids, labels=ids, cache=model.new_cache(2), return_logits=True)
    with torch.no_grad():
        plain = model(ids, cache=model.new_cache(2)).logits
    assert torch.equal(out.logits.detach(), plain) and not plain.requires_grad
    for t in (out.loss, out.logits.sum()):
        with pytest.raises(RuntimeError, match="backward through a forward with a cache is not supported"):
            t.backward(retain_graph=True)
