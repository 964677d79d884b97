"""bench/roofline.py: each counting function against values worked out by hand for a small shape
(the arithmetic is written out next to each number), plus cross-checks of the FLOPs against
torch's own FLOP counter on the reference ops and against ``wiola.budget``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

import wiola  # noqa: E402
from bench import roofline as rl  # noqa: E402
from bench.roofline import Cost  # noqa: E402
from wiola.ops import butterfly, gated_attention, linear_cross_entropy  # noqa: E402

# A small model for the whole-model counts: d 8, L 2, H 2 (D 4), d_ff 16, V 50.
SMALL = wiola.WiolaConfig(vocab_size=50, d_model=8, n_layers=2, n_heads=2, d_ff=16, max_seq_len=16)
# Parameters: V·d = 400; per layer 4·8² = 256 (q,k,v,o) + 2·4 + 2·2 + 2 = 14 (gate)
# + 4·8·16 = 512 (butterfly) + 2·8 = 16 (norms) = 798; total 400 + 2·798 + 8 = 2004.
SMALL_PARAMS = 2004
# Matrix FLOPs per token and layer: 2·4·8² = 512 (projections) + 8·8·16 = 1024 (butterfly)
# + 2·(4·2 + 2·2) = 24 (gate) = 1560.
SMALL_LAYER = 1560


def test_attention_counts() -> None:
    # B 2, T 4, H 3, D 8, bf16. Causal pairs: B·H·T(T+1)/2 = 2·3·10 = 60.
    # One (B,T,H,D) tensor: 2·4·3·8·2 = 384 B; gate (B,T,H) fp32: 96 B; cos+sin 2·(2·4·4)·4 = 256 B;
    # lse (B,H,T) fp32: 96 B.
    fwd = rl.attention(2, 4, 3, 8, torch.bfloat16, "fwd")
    assert fwd == Cost(4 * 8 * 60, 3 * 384 + 96 + 256 + 384 + 96), f"attention fwd {fwd}"
    assert fwd == Cost(1920, 1984)
    bwd = rl.attention(2, 4, 3, 8, torch.bfloat16, "bwd")
    # reads q,k,v,o,dO + g + lse + tables = 1920 + 96 + 96 + 256; writes dq,dk,dv + dg = 1152 + 96
    assert bwd == Cost(10 * 8 * 60, 2368 + 1248), f"attention bwd {bwd}"
    assert rl.attention(2, 4, 3, 8, "bfloat16", "fwd_bwd") == Cost(6720, 5600)


def test_gate_counts() -> None:
    # B 2, T 4 (N 8 tokens), H 3, D 8, fp32. Per token fwd: H·D 24 + 2D 16 + 2DH 48 + 2H² 18 = 106.
    # Weights (3·8 + 9 + 3)·4 = 144 B; q 8·3·8·4 = 768 B; g 8·3·4 = 96 B.
    assert rl.gate(2, 4, 3, 8, torch.float32, "fwd") == Cost(8 * 106, 768 + 144 + 96)
    # Per token bwd: 2·(48 + 18) + 2D 16 + H·D 24 = 172; reads q, dg, weights, writes dq, dW.
    assert rl.gate(2, 4, 3, 8, torch.float32, "bwd") == Cost(8 * 172, 768 + 96 + 144 + 768 + 144)


def test_butterfly_counts() -> None:
    # N 5, d 4, d_ff 6, bf16: up 2·5·4·12 = 480, bypass 2·5·4·6 = 240, down 2·5·6·4 = 240 -> 960.
    # x and y (5·4·2) 40 B each; weights (48 + 24 + 24)·2 = 192 B.
    assert rl.butterfly(5, 4, 6, torch.bfloat16, "fwd") == Cost(960, 40 + 192 + 40)
    assert rl.butterfly(5, 4, 6, torch.bfloat16, "fwd", residual=True) == Cost(960, 312)
    # bwd: 2·960 FLOPs; reads x, dy, weights; writes dx, dW.
    assert rl.butterfly(5, 4, 6, torch.bfloat16, "bwd") == Cost(1920, 40 + 40 + 192 + 40 + 192)


def test_rms_norm_counts() -> None:
    # N 3, d 8, fp16: one (N, d) tensor 48 B, γ 16 B.
    # residual: 5 FLOPs/element -> 120; reads x, residual, γ; writes y, h.
    assert rl.rms_norm(3, 8, torch.float16, "fwd") == Cost(120, 48 + 48 + 16 + 48 + 48)
    assert rl.rms_norm(3, 8, torch.float16, "fwd", residual=False) == Cost(96, 48 + 16 + 48)
    # bwd with residual: 9 FLOPs/element -> 216; reads dy, h, dh, γ; writes dx, dγ.
    assert rl.rms_norm(3, 8, torch.float16, "bwd") == Cost(216, 3 * 48 + 16 + 48 + 16)
    # bwd without: 8 FLOPs/element -> 192; reads dy, h, γ; writes dx, dγ.
    assert rl.rms_norm(3, 8, torch.float16, "bwd", residual=False) == Cost(192, 2 * 48 + 16 + 48 + 16)


def test_linear_cross_entropy_counts() -> None:
    # N 3, d 4, V 10, bf16: logits 2·3·4·10 = 240 FLOPs.
    # h 24 B, W 80 B, labels 3·8 = 24 B, loss 4 B, lse 12 B.
    assert rl.linear_cross_entropy(3, 4, 10, torch.bfloat16, "fwd") == Cost(240, 24 + 80 + 24 + 4 + 12)
    # bwd: dh and dW 4·3·4·10 = 480; reads h, W, labels, lse; writes dh, dW.
    assert rl.linear_cross_entropy(3, 4, 10, torch.bfloat16, "bwd") == Cost(480, 24 + 80 + 24 + 12 + 24 + 80)


def test_small_config_parameter_count() -> None:
    assert wiola.WiolaModel(SMALL).num_parameters() == SMALL_PARAMS
    assert rl._matrix_params(SMALL) == SMALL_PARAMS
    assert rl._layer_matrix_flops(SMALL) == SMALL_LAYER


def test_decode_step_counts() -> None:
    # batch 3, context 5, fp32. Per row: L·(1560 + 4·d·(context+1)) + 2·d·V = 2·(1560 + 192) + 800 = 4304.
    # Bytes: weights 2004·4 = 8016; cached K,V 3·2·2·5·8·4 = 1920; new K,V 3·2·2·8·4 = 384; ids 24;
    # logits 3·50·4 = 600.
    assert rl.decode_step(SMALL, 3, 5, torch.float32) == Cost(3 * 4304, 8016 + 1920 + 384 + 24 + 600)
    two = rl.decode(SMALL, 1, 5, 2, torch.float32)
    assert two == rl.decode_step(SMALL, 1, 5, torch.float32) + rl.decode_step(SMALL, 1, 6, torch.float32)


def test_prefill_counts() -> None:
    # batch 2, T 3, fp32. Layers: 2·3·2·1560 = 18720; attention: L·4·d·B·T(T+1)/2 = 2·4·8·2·6 = 768;
    # head on the last token of each row: 2·8·50·2 = 1600.
    # Bytes: weights 8016, ids 2·3·8 = 48, K,V written 2·2·2·3·8·4 = 768, logits 2·50·4 = 400.
    assert rl.prefill(SMALL, 2, 3, torch.float32) == Cost(18720 + 768 + 1600, 8016 + 48 + 768 + 400)
    # every position's logits: head 2·8·50·6 = 4800 FLOPs, logits 6·50·4 = 1200 B.
    assert rl.prefill(SMALL, 2, 3, torch.float32, all_logits=True) == Cost(24288, 8016 + 48 + 768 + 1200)


def test_train_step_counts() -> None:
    # 3 × the all-logits prefill's FLOPs: 3·24288 = 72864. Bytes (bf16 weights, P = 2004):
    # weights read twice 2·2004·2 = 8016; fp32 gradients written and read 2·2004·4 = 16032;
    # AdamW reads and writes weights, m, v in fp32: 6·2004·4 = 48096; ids and labels 2·6·8 = 96; loss 4.
    assert rl.train_step(SMALL, 2, 3, torch.bfloat16) == Cost(72864, 8016 + 16032 + 48096 + 96 + 4)
    # Same FLOPs as wiola.budget's training count (3 × forward per token, T = 3) over 6 tokens.
    assert rl.train_step(SMALL, 2, 3).flops == pytest.approx(wiola.budget(SMALL, 3).training_flops * 6)


def _counted(fn, *args) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def test_flops_match_torch_flop_counter() -> None:
    torch.manual_seed(0)
    B, T, H, D = 2, 6, 3, 8
    q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
    g = torch.rand(B, T, H)
    # The reference materialises all T² scores; the causal count keeps T(T+1)/2 of them.
    full = _counted(gated_attention, q, k, v, g)
    assert rl.attention(B, T, H, D, mode="fwd").flops == full * (T + 1) / (2 * T)
    out = gated_attention(q, k, v, g)
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    # backward of the two einsums: 4 products over all pairs; our count adds the recomputed scores (1 more)
    assert rl.attention(B, T, H, D, mode="bwd").flops == counter.get_total_flops() * 5 / 4 * (T + 1) / (2 * T)

    N, d, f, V = 7, 8, 12, 30
    x = torch.randn(N, d, requires_grad=True)
    w_up, w_bp, w_down = torch.randn(2 * f, d), torch.randn(f, d), torch.randn(d, f)
    ws = [w.requires_grad_() for w in (w_up, w_bp, w_down)]
    assert rl.butterfly(N, d, f, mode="fwd").flops == _counted(butterfly, x, *ws)
    y = butterfly(x, *ws)
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(y, [x, *ws], torch.randn_like(y))
    assert rl.butterfly(N, d, f, mode="bwd").flops == counter.get_total_flops()

    h, w = torch.randn(N, d, requires_grad=True), torch.randn(V, d, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    assert rl.linear_cross_entropy(N, d, V, mode="fwd").flops == _counted(linear_cross_entropy, h, w, labels)
    loss = linear_cross_entropy(h, w, labels)
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(loss, (h, w))
    assert rl.linear_cross_entropy(N, d, V, mode="bwd").flops == counter.get_total_flops()


def test_cost_arithmetic_and_floor() -> None:
    a, b = Cost(10, 4), Cost(2, 6)
    assert a + b == Cost(12, 10)
    assert 3 * a == a * 3 == Cost(30, 12)
    assert a.intensity() == 2.5
    # 2e12 FLOPs at 1e15 FLOP/s = 2 ms; 1e9 B at 1e12 B/s = 1 ms -> compute-bound, 2 ms.
    assert Cost(2e12, 1e9).floor_s(1e15, 1e12) == pytest.approx(2e-3)
    assert Cost(1e9, 3e9).floor_s(1e15, 1e12) == pytest.approx(3e-3)  # memory-bound
    with pytest.raises(ValueError, match="ceilings must be positive"):
        a.floor_s(0, 1e12)


def test_bad_arguments() -> None:
    assert rl.dtype_bytes(torch.bfloat16) == 2 and rl.dtype_bytes("float32") == 4 and rl.dtype_bytes(8) == 8
    with pytest.raises(ValueError, match="unknown dtype name"):
        rl.dtype_bytes("bfloat17")
    with pytest.raises(ValueError, match="bytes per element"):
        rl.dtype_bytes(3)
    with pytest.raises(ValueError, match="mode must be one of"):
        rl.attention(1, 2, 1, 4, mode="forward")
    with pytest.raises(ValueError, match="T must be a positive int"):
        rl.attention(1, 0, 1, 4)
    with pytest.raises(ValueError, match="context must be a positive int"):
        rl.decode_step(SMALL, 1, -1)


def test_quantized_weight_bytes() -> None:
    # Packed matrices: V·d = 400 + 2·(4·8² + 4·8·16) = 1536 -> 1936 weights; rows with an int8 scale:
    # V 50 + 2·(5·8 + 3·16) = 226 (q, k, v, o: 8 each; up 32, bypass 16, down 8); the other
    # 2004 - 1936 = 68 weights (norms, gate) stay fp32.
    assert rl.weight_bytes(SMALL) == 2004 * 4
    assert rl.weight_bytes(SMALL, "int8") == 1936 + 226 * 4 + 68 * 4
    assert rl.weight_bytes(SMALL, "bf16") == 1936 * 2 + 68 * 4
    assert rl.weight_bytes(SMALL, "int8", 2) == 1936 + 226 * 4 + 68 * 2  # the rest at dtype's 2 bytes
    assert rl.weight_bytes(SMALL, None, torch.bfloat16) == 2004 * 2
    with pytest.raises(ValueError, match="scheme='int2'"):
        rl.weight_bytes(SMALL, "int2")
    # and against what a quantized model holds
    import wiola.fast
    from wiola.fast.quantize import quantize

    # int4 (groups of 32, so the 13m preset): packed 32,000·256 + 6·(4·256² + 4·256·512) = 12,910,592
    # weights at half a byte, one fp32 scale per 32 of them, the other 12,915,888 - 12,910,592 = 5,296 fp32.
    assert rl.weight_bytes(wiola.WiolaConfig.preset("13m"), "int4") == 12_910_592 // 2 + 403_456 * 4 + 5_296 * 4

    for scheme in ("int8", "bf16"):
        model = quantize(wiola.fast.WiolaModel(SMALL).eval().requires_grad_(False), scheme)
        packed = {n: (q, s) for n, (q, s) in model.quantized.items()}
        held = sum(q.nbytes + (0 if s is None else s.nbytes) for q, s in packed.values())
        held += sum(p.nbytes for n, p in model.named_parameters() if n not in packed)
        assert rl.weight_bytes(SMALL, scheme) == held
    step = rl.decode_step(SMALL, 3, 5, torch.float32, weights=3112)
    assert step == rl.decode_step(SMALL, 3, 5, torch.float32) + Cost(0, 3112 - 8016)


@pytest.mark.parametrize("gate", [True, False])
def test_layer_products_and_weights_follow_wiola_budget_with_and_without_the_gate(gate) -> None:
    """Every layer's matrix products (projections, gate, butterfly) as ``wiola.budget`` counts them,
    and every weight as the model holds it: a model without the gate has neither its products nor
    its parameters."""
    import dataclasses

    from wiola import WiolaModel, budget

    config = dataclasses.replace(SMALL, gate=gate)
    per_token = budget(config, seq_len=1).forward_flops_per_token
    want = per_token["attention projections"] + per_token["gate"] + per_token["butterfly"]
    assert rl._layer_matrix_flops(config) * config.n_layers == want
    assert (per_token["gate"] > 0) == gate
    assert rl.weight_bytes(config) == WiolaModel(config).num_parameters() * 4
