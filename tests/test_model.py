"""The reference model against an independent float64 computation of docs/SPEC.md."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from f64_reference import forward_row

from wiola import WiolaConfig, WiolaModel
from wiola.ops import gated_attention


def small_config(**kw) -> WiolaConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=256)
    return WiolaConfig(**{**base, **kw})


def randomised(model: WiolaModel, seed: int) -> WiolaModel:
    """Give every parameter (norm gains, gate bias too) a random value, so nothing is trivially 1 or 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "gate" in name:
                p.copy_(torch.randn(p.shape, generator=g))  # strong gates, far from 0.5
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("T", [1, 17, 130], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("gate_pre_rope", [True, False], ids=["pre", "post"])
@pytest.mark.parametrize("alpha", [0.0, 0.05], ids=["a0", "a0.05"])
def test_logits_match_float64(T, gate_pre_rope, alpha):
    cfg = small_config(gate_pre_rope=gate_pre_rope, helix_alpha=alpha)
    torch.manual_seed(T)
    model = randomised(WiolaModel(cfg), seed=T).double()
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    want = forward_row(model.state_dict(), cfg, ids[0].tolist())
    got = model(ids).logits[0]
    err = (got - want).abs().max().item()
    assert err <= 1e-10 * want.abs().max().item(), f"logits differ from the float64 SPEC computation by {err:.3e}"


@pytest.mark.parametrize("cls", ["reference", "fast"])
def test_logits_to_keep_is_the_last_positions_of_the_full_pass(cls):
    """``logits_to_keep=k``: the last ``k`` positions' logits (shape ``(B, k, V)``), those of the
    full pass (float64: equal but for the head product's order), for k of 1, 2 and the whole."""
    import wiola.fast

    cfg = small_config()
    model = randomised((WiolaModel if cls == "reference" else wiola.fast.WiolaModel)(cfg), seed=6).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    full = model(ids).logits
    for k in (1, 2, 9):
        kept = model(ids, logits_to_keep=k).logits
        assert kept.shape == (2, k, cfg.vocab_size), (k, kept.shape)
        torch.testing.assert_close(kept, full[:, -k:], rtol=1e-12, atol=1e-12 * full.abs().max().item())


def test_fp32_model_close_to_float64():
    cfg = small_config()
    model = randomised(WiolaModel(cfg), seed=3)
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    want = forward_row(model.state_dict(), cfg, ids[0].tolist())
    got = model(ids).logits[0].double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_no_gate_is_plain_causal_attention():
    """gate=False computes the model with every gate at 1 (SPEC claim 3)."""
    cfg = small_config(gate=False)
    model = randomised(WiolaModel(cfg), seed=5).double()
    assert not any("gate" in n for n, _ in model.named_parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, 23))
    want = forward_row(model.state_dict(), cfg, ids[0].tolist())
    assert (model(ids).logits[0] - want).abs().max() <= 1e-10 * want.abs().max()


def test_gate_of_one_equals_sdpa_causal():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 19, 3, 8, dtype=torch.float64) for _ in range(3))
    ones = torch.ones(2, 19, 3, dtype=torch.float64)
    got = gated_attention(q, k, v, ones)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    assert (got - want.transpose(1, 2)).abs().max() < 1e-12


def test_gates_start_at_one_half():
    """b_2 = 0 at init; W_2 ~ N(0, 0.02²) keeps |W_2·SiLU(W_1 c)| tiny, so every gate is ≈ 0.5."""
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig.preset("13m"))
    x = model.embed(torch.randint(0, 32000, (2, 64)))
    from wiola.ops import gate, rms_norm

    for layer in model.layers:
        assert torch.count_nonzero(layer.attn.gate_w2.bias) == 0
        h = rms_norm(x, layer.attn_norm.weight)
        q = layer.attn.q_proj(h).view(2, 64, 8, 32)
        g, _, _ = gate(q, layer.attn.gate_w1.weight, layer.attn.gate_w2.weight, layer.attn.gate_w2.bias)
        assert (g - 0.5).abs().max() < 1e-3, f"gate at init deviates from 0.5 by {(g - 0.5).abs().max():.2e}"


def test_init_statistics():
    torch.manual_seed(0)
    model = WiolaModel(WiolaConfig.preset("13m"))
    w = model.embed.weight
    assert w.abs().max() <= 0.04 + 1e-7, "truncated normal must stay within ±2σ"
    assert abs(w.std().item() - 0.02 * 0.8796) < 5e-4  # std of N(0,σ²) truncated at ±2σ is 0.8796σ
    assert all(torch.all(layer.attn_norm.weight == 1) for layer in model.layers)


def test_loss_is_shifted_mean_cross_entropy():
    cfg = small_config()
    model = randomised(WiolaModel(cfg), seed=1).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    labels = ids.clone()
    labels[0, 5] = -100
    out = model(ids, labels=labels)
    logp = torch.log_softmax(out.logits, -1)
    terms = [-logp[b, t, labels[b, t + 1]] for b in range(2) for t in range(11) if labels[b, t + 1] != -100]
    assert out.loss.dtype == torch.float64 or out.loss.dtype == torch.float32
    assert abs(out.loss.item() - torch.stack(terms).mean().item()) < 1e-10


def test_model_built_under_inference_mode_decodes():
    """Parameters created under ``torch.inference_mode`` have no version counter; the CPU
    inference caches must not read one (this crashed on the first forward)."""
    torch.manual_seed(0)
    config = WiolaConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
    ids = torch.randint(0, 100, (2, 9))
    with torch.inference_mode():
        model = WiolaModel(config)
        cache = model.new_cache(2, 9)
        steps = [model(ids[:, :5], cache=cache).logits] + [
            model(ids[:, t : t + 1], cache=cache).logits for t in range(5, 9)
        ]
        full = model(ids).logits
    err = float((torch.cat(steps, dim=1) - full).abs().max())
    assert err <= 1e-5, f"cached logits differ from the full pass by {err:.2e}"
