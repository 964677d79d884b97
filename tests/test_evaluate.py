"""Evaluation numbers against direct float64 computations; gate statistics; the PNG figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import wiola.ops as ops
from wiola import WiolaConfig, WiolaModel
from wiola.ops.rope import positions_from_mask, rope_tables
from wiola.tokenizer import TiktokenTokenizer
from wiola.train.corpus import generate_stories
from wiola.train.evaluate import evaluate, gate_statistics, token_byte_lengths
from wiola.train.plots import plot_gate_heatmap, plot_loss_curve
from wiola.train.token_cache import TokenSplit

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(d_model=32, n_layers=3, n_heads=4, d_ff=48, max_seq_len=64)


@pytest.fixture(scope="module")
def enc(offline_tokenizer):
    from wiola.tokenizer import get_encoding

    return get_encoding("gpt2-32k")


def _model(seed: int = 0, **overrides) -> WiolaModel:
    torch.manual_seed(seed)
    model = WiolaModel(WiolaConfig.preset("tiny", **{**SMALL, **overrides}))
    with torch.no_grad():  # spread the gates: at init every gate is ~0.5 and layer mix-ups would go unseen
        for layer in model.layers:
            if model.config.gate:
                layer.attn.gate_w1.weight.normal_(0, 1.0)
                layer.attn.gate_w2.weight.normal_(0, 1.5)
                layer.attn.gate_w2.bias.normal_(0, 1.5)
    return model.eval()


def test_evaluate_matches_float64_per_window(enc) -> None:
    stories = generate_stories(6, seed=3)
    tokens = np.array([t for s in stories for t in [enc.eot_token, *enc.encode_ordinary(s)]], dtype=np.uint16)
    split = TokenSplit([tokens[:300], tokens[300:]], documents=len(stories), text_bytes=0)
    T, n_windows = 24, 13
    model = _model()
    got = evaluate(model, split, token_byte_lengths(TiktokenTokenizer(enc)), T, batch_size=5, max_windows=n_windows)

    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for k in range(n_windows):
            window = torch.from_numpy(tokens[k * T : k * T + T + 1].astype(np.int64))[None]
            logits = model(window).logits[0, :-1].double()
            nats += float(F.cross_entropy(logits, window[0, 1:], reduction="sum"))
            n_bytes += len(enc.decode_bytes([t for t in window[0, 1:].tolist() if t != enc.eot_token]))
    n_tokens = n_windows * T
    assert got.tokens == n_tokens and got.bytes == n_bytes and got.windows == n_windows, f"counts {got}"
    assert abs(got.loss - nats / n_tokens) <= 1e-6 * nats / n_tokens, f"loss {got.loss} vs {nats / n_tokens}"
    assert abs(got.perplexity - math.exp(nats / n_tokens)) <= 1e-5 * got.perplexity, "perplexity"
    ref_bpb = nats / math.log(2) / n_bytes
    assert abs(got.bits_per_byte - ref_bpb) <= 1e-6 * ref_bpb, f"bits per byte {got.bits_per_byte} vs {ref_bpb}"
    assert model.training is False
    model.train()
    evaluate(model, split, token_byte_lengths(TiktokenTokenizer(enc)), T, max_windows=2)
    assert model.training, "evaluate must restore training mode"


def test_evaluate_honours_the_precision(enc) -> None:
    """``precision="bf16"`` scores under bf16 autocast (on a CPU too), as training does; ``"auto"``
    on a CPU is fp32."""
    stories = generate_stories(6, seed=3)
    tokens = np.array([t for s in stories for t in [enc.eot_token, *enc.encode_ordinary(s)]], dtype=np.uint16)
    split = TokenSplit([tokens], documents=len(stories), text_bytes=0)
    T, n_windows = 24, 13
    model = _model()
    with torch.no_grad():
        model.embed.weight.mul_(25)  # large logits: bf16 rounding then moves the loss measurably
    got = {
        p: evaluate(
            model,
            split,
            token_byte_lengths(TiktokenTokenizer(enc)),
            T,
            batch_size=5,
            max_windows=n_windows,
            precision=p,
        ).loss
        for p in ("auto", "fp32", "bf16")
    }
    nats = 0.0
    with torch.no_grad():
        for k in range(n_windows):
            window = torch.from_numpy(tokens[k * T : k * T + T + 1].astype(np.int64))[None]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(window).logits[0, :-1]
            nats += float(F.cross_entropy(logits.double(), window[0, 1:], reduction="sum"))
    ref = nats / (n_windows * T)
    assert got["auto"] == got["fp32"], "precision 'auto' on a CPU is fp32"
    # bf16 autocast vs the same under a float64 loss: ~2e-7 relative; bf16 vs fp32: ~3e-5.
    assert abs(got["bf16"] - ref) <= 2e-6 * ref, f"bf16 loss {got['bf16']} vs bf16 reference {ref}"
    assert abs(got["bf16"] - got["fp32"]) >= 1e-5 * ref, "precision='bf16' scored in fp32"


@torch.no_grad()
def _replay_gates(model: WiolaModel, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The forward pass rebuilt from the model's modules and the wiola.ops functions."""
    cfg = model.config
    B, T = ids.shape
    H, D = cfg.n_heads, cfg.head_dim
    cos, sin = rope_tables(positions_from_mask(mask, B, T), model.rope_freqs)
    bool_mask = None if mask is None else mask.bool()
    h = model.embed(ids)
    means = []
    for layer in model.layers:
        a = layer.attn
        x = ops.rms_norm(h, layer.attn_norm.weight, cfg.norm_eps)
        q, k, v = (F.linear(x, w).view(B, T, H, D) for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
        g, _, _ = ops.gate(q, a.gate_w1.weight, a.gate_w2.weight, a.gate_w2.bias, attention_mask=bool_mask)
        real = torch.ones(B, T) if mask is None else mask.float()
        means.append((g.double() * real[..., None]).sum((0, 1)) / real.sum())
        o = ops.attention(q, k, v, g, cos, sin, bool_mask)
        h = h + F.linear(o.reshape(B, T, H * D), a.o_proj.weight)
        f = layer.ffn
        h = h + ops.butterfly(ops.rms_norm(h, layer.ffn_norm.weight, cfg.norm_eps), f.up_proj.weight,
                              f.bypass_proj.weight, f.down_proj.weight)  # fmt: skip
    return torch.stack(means)


@pytest.mark.parametrize("padded", [False, True], ids=["B3-T17-H4", "B3-T17-H4-right-padded"])
def test_gate_statistics_match_replay(padded) -> None:
    model = _model(seed=1)
    torch.manual_seed(5)
    ids = torch.randint(0, 32000, (3, 17))
    mask = None
    if padded:
        mask = torch.ones(3, 17, dtype=torch.int64)
        mask[1, 11:] = 0
        mask[2, 5:] = 0
    got = gate_statistics(model, ids, mask)
    assert got.shape == (3, 4) and got.dtype == torch.float64
    ref = _replay_gates(model, ids, mask)
    err = float((got - ref).abs().max())
    assert err <= 1e-6, f"gate means: max abs error {err:.2e}"
    assert float(got.std()) > 0.05, "gates barely vary: the test would not catch a layer or head mix-up"
    assert "ops" not in vars(model), "gate_statistics left its spy on the model"


def test_gate_statistics_layer0_float64_from_spec() -> None:
    model = _model(seed=2)
    torch.manual_seed(6)
    ids = torch.randint(0, 32000, (2, 9))
    cfg = model.config
    H, D = cfg.n_heads, cfg.head_dim
    e = model.embed.weight.double()[ids]  # (B, T, d)
    x = e / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * model.layers[0].attn_norm.weight.double()
    q = (x @ model.layers[0].attn.q_proj.weight.double().T).view(2, 9, H, D)
    m = q.mean(dim=2)  # (B, T, D) mean over heads
    c = m.cumsum(1) / torch.arange(1, 10, dtype=torch.float64)[None, :, None]
    a = model.layers[0].attn
    g = torch.sigmoid(F.silu(c @ a.gate_w1.weight.double().T) @ a.gate_w2.weight.double().T + a.gate_w2.bias.double())
    ref = g.mean(dim=(0, 1)).detach()
    got = gate_statistics(model, ids)[0]
    assert float((got - ref).abs().max()) <= 1e-5, f"layer 0 gate means {got.tolist()} vs {ref.tolist()}"


def test_gate_statistics_without_gate_are_ones() -> None:
    model = _model(gate=False)
    got = gate_statistics(model, torch.randint(0, 100, (1, 5)))
    assert torch.equal(got, torch.ones(3, 4, dtype=torch.float64)), "a gate-less model has every gate at 1"


# ------------------------------------------------------------------------------------------ plots
def _png(path) -> np.ndarray:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name}: not a PNG"
    return mpimg.imread(path)


def test_gate_heatmap_png(tmp_path) -> None:
    low = _png(plot_gate_heatmap(np.full((4, 4), 0.1), tmp_path / "low.png"))
    high = _png(plot_gate_heatmap(np.full((4, 4), 0.9), tmp_path / "high.png"))
    assert low.shape == high.shape and low.shape[0] > 100, f"heat map size {low.shape}"
    h, w = low.shape[:2]
    # The cells' colour follows the value: the centre of the map differs between 0.1 and 0.9.
    centre = (slice(h // 3, h // 2), slice(w // 4, w // 2))
    assert np.abs(low[centre][..., :3].mean() - high[centre][..., :3].mean()) > 0.1, "heat map colours ignore values"
    with pytest.raises(ValueError, match="2-D"):
        plot_gate_heatmap(np.zeros(4), tmp_path / "bad.png")


def test_loss_curve_png(tmp_path) -> None:
    records = [{"kind": "train", "step": s, "loss": 8.0 / s} for s in range(1, 40)]
    records += [{"kind": "eval", "step": s, "loss": 7.0 / s} for s in (10, 20, 30)]
    records += [{"kind": "reference", "step": 0, "name": "unigram entropy", "value": 5.0}]
    img = _png(plot_loss_curve(records, tmp_path / "loss.png"))
    assert img.shape[0] > 200 and img.shape[1] > 300, f"loss curve size {img.shape}"
    assert not list(tmp_path.glob(".*tmp*")), "temporary PNG left behind"
