"""Cached decoding equals the full-sequence pass (docs/SPEC.md exactness claim 1)."""

from __future__ import annotations

import pytest
import torch
from numerics import AbsSums, assert_within, bound, platform_line

from wiola import Cache, WiolaConfig, WiolaModel


@pytest.fixture(scope="module")
def model_13m() -> WiolaModel:
    torch.manual_seed(0)
    return WiolaModel(WiolaConfig.preset("13m", max_seq_len=512)).eval()


@pytest.fixture(scope="module")
def model_13m_far() -> WiolaModel:
    """The 13m preset with N(0, 0.3²) added to every weight (as ``tests/test_decode_step_cpu.py``'s
    ``_model``). At the init scale every gate is ~0.5 and attention near uniform, so a running sum
    lost between chunks moves the logits by less than claim 1's tolerance; here the gates spread
    over (0, 1) and attention is sharp, so the logits depend on what the cache carries."""
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig.preset("13m", max_seq_len=512)).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


CHUNKINGS = {
    "one-call": [300],
    "token-by-token-tail": [290] + [1] * 10,
    "uneven": [1, 16, 83, 100, 7, 93],
    "halves": [150, 150],
}


def _full_and_chunked(model: WiolaModel, chunks: list[int]) -> dict:
    """One full pass (no cache) and the same ids fed in ``chunks`` through a cache: the full
    pass's logits, their head magnitudes (``AbsSums.head``), each layer's normalised input
    (float64) and gates ``(L, B, T, H)``; the chunked logits and the cache."""
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, sum(chunks)))
    xs, gates = [], []
    hooks = [m.attn_norm.register_forward_hook(lambda _m, _i, o: xs.append(_first(o).double())) for m in model.layers]
    hooks += [m.attn.gate.register_forward_hook(lambda _m, _i, g: gates.append(g.detach())) for m in model.layers]
    try:
        with torch.no_grad(), AbsSums(model) as sums:
            full = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        cache = model.new_cache(2, 320)
        pieces, start = [], 0
        for n in chunks:
            pieces.append(model(ids[:, start : start + n], cache=cache).logits)
            start += n
    got = torch.cat(pieces, dim=1)
    return {"full": full, "head": sums.head, "x": xs, "gates": torch.stack(gates), "got": got, "cache": cache}


def _first(out) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).detach()


def _assert_gate_state(model: WiolaModel, run: dict, T: int) -> None:
    """The cache's per-layer running sum of head-mean queries against the float64 sum of the full
    pass's queries (its normalised inputs times ``W_q``, gate before rotation), and the counts.

    Bound: each query element the chunked pass computes is within ``bound(config, T, Σ_i|W_q·x_i|)``
    of the full pass's (two fp32 sides, the whole chain's length standing for the path to q);
    the head mean and the sum over the T positions add those errors, ``bound(config, T, M)`` with
    ``M = Σ_t mean_h Σ_i|W_q·x_i|`` per element (``bound`` is linear in the magnitude); the fp32
    sums of H and T terms in any order (head mean, cumulative sum, carries) add at most
    ``λ·√(T+H)·u·M`` per side, below the same amount since ``K_chain > T + H``: twice it in all."""
    config, cache = model.config, run["cache"]
    assert config.gate_pre_rope, "the oracle below sums unrotated queries"
    B, H, D = cache.batch_size, config.n_heads, config.head_dim
    want, mag = [], []
    for x, layer in zip(run["x"], model.layers):
        w = layer.attn.q_proj.weight.detach().double()
        want.append((x @ w.T).view(B, T, H, D).mean(2).sum(1))
        mag.append((x.abs() @ w.abs().T).view(B, T, H, D).mean(2).sum(1))
    assert cache.gate_sum.dtype == torch.float32
    assert_within("cache.gate_sum", torch.stack(want), cache.gate_sum, 2 * bound(config, T, torch.stack(mag)))
    assert torch.equal(cache.gate_count, torch.full((config.n_layers, B), T)), (
        f"cache.gate_count {cache.gate_count.tolist()}"
    )


@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
def test_chunked_prefill_and_decode_match_full_pass(model_13m, chunks):
    """Claim 1 as docs/SPEC.md states it (max abs diff ≤ 1e-4 on a random 13M-shaped model at its
    init), the logits also within the two-sided fp32 bound, and the gate's carried state."""
    run = _full_and_chunked(model_13m, chunks)
    full, got = run["full"], run["got"]
    err = (got - full).abs().max().item()
    assert err <= 1e-4, (
        f"cached logits differ from the full pass by {err:.2e} (scale {full.abs().max():.1f}); {platform_line()}"
    )
    assert_within("cached logits", full, got, bound(model_13m.config, 300, run["head"]))
    cache = run["cache"]
    assert cache.length == 300
    assert torch.equal(cache.n_real, torch.tensor([300, 300]))
    _assert_gate_state(model_13m, run, 300)


@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
def test_chunked_matches_full_pass_with_gates_far_from_half(model_13m_far, chunks):
    """Claim 1 on weights far from the init: logits within the two-sided fp32 bound (the fixed
    1e-4 is for the init scale; these logits reach ~30), and the gate's carried sums and counts."""
    run = _full_and_chunked(model_13m_far, chunks)
    gates = run["gates"]
    assert float(gates.min()) < 0.05 and float(gates.max()) > 0.95, (
        f"the perturbed model's gates span only [{float(gates.min()):.3f}, {float(gates.max()):.3f}]"
    )
    assert_within("cached logits", run["full"], run["got"], bound(model_13m_far.config, 300, run["head"]))
    cache = run["cache"]
    assert cache.length == 300
    assert torch.equal(cache.n_real, torch.tensor([300, 300]))
    _assert_gate_state(model_13m_far, run, 300)


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


@torch.no_grad()
def test_reorder_keeps_every_buffer_of_the_rows_it_picks() -> None:
    """``reorder(index)`` gives each row every buffer of the row ``index`` names (keys, values,
    the gate's running sum and count, positions, mask), exactly: no buffer keeps another row's."""
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16))
    for p in model.parameters():
        p.normal_(0, 0.5)
    ids = torch.randint(0, 64, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :2] = 0  # rows of different lengths: every buffer differs between them
    mask[2, :4] = 0
    cache = model.new_cache(3, 9)
    model(ids, attention_mask=mask, cache=cache)
    before = {name: t.clone() for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}
    assert set(before) == {"k", "v", "key_mask", "gate_sum", "gate_count", "n_real"}, sorted(before)
    index = torch.tensor([2, 0, 1])
    cache.reorder(index)
    for name, t in before.items():
        row_dim = 0 if name in ("key_mask", "n_real") else 1  # the per-layer buffers: (L, B, ...)
        assert not torch.equal(t, t.index_select(row_dim, index)), f"{name}: the rows do not differ"
        assert torch.equal(getattr(cache, name), t.index_select(row_dim, index)), f"reorder left {name} of other rows"


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
@pytest.mark.parametrize("keep", [1, 3])
def test_logits_to_keep_prefill_writes_the_same_cache(model_13m_far, fast, keep, plain_cpu):
    """A prefill that keeps the last ``keep`` positions' logits (what generation and serving run:
    the last block computes those positions alone after its keys, values and gate sums) gives the
    full pass's logits there within the two-sided fp32 bound, writes every cache buffer bitwise as
    the prefill of every position does, and the next step's logits are then bitwise the same. The
    fast model on a plain CPU (no interpreter) runs the C++ prompt attention for the kept queries
    alone and the C++ step after."""
    import wiola.fast

    model = model_13m_far
    if fast:
        model = wiola.fast.WiolaModel(model_13m_far.config).eval().requires_grad_(False)
        model.load_state_dict(model_13m_far.state_dict())
    T = 100
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), AbsSums(model_13m_far) as sums:
        full = model_13m_far(ids).logits
    head = sums.head
    with torch.no_grad():
        caches, logits = {}, {}
        for k in (0, keep):
            caches[k] = model.new_cache(2, T + 1)
            logits[k] = model(ids, cache=caches[k], logits_to_keep=k).logits
        assert logits[keep].shape == (2, keep, model.config.vocab_size)
        assert_within(f"kept logits ({'fast' if fast else 'reference'})", full[:, -keep:], logits[keep],
                      bound(model.config, T, head[:, -keep:]))  # fmt: skip
        a, b = caches[0], caches[keep]
        for name in ("k", "v", "key_mask", "gate_sum", "gate_count", "n_real"):
            assert torch.equal(getattr(a, name), getattr(b, name)), f"logits_to_keep={keep}: cache.{name} differs"
        assert a.length == b.length == T
        step = torch.randint(0, model.config.vocab_size, (2, 1), generator=torch.Generator().manual_seed(4))
        assert torch.equal(model(step, cache=a).logits, model(step, cache=b).logits), (
            f"the step after a prefill that kept {keep} positions differs; {platform_line()}"
        )
