"""The ablations' feed-forward blocks (``ffn = "swiglu" | "gelu"``, beside the butterfly):
``wiola.ops.mlp`` and whole models against the float64 oracle (forward and every gradient),
exact parameter counts against ``wiola.budget``, the matched-parameter rule, ``wiola.fast``
against the reference, checkpoints, and the paths that implement only the butterfly refusing
the others by name."""

from __future__ import annotations

import dataclasses
import json
import platform

import pytest
import torch
from f64_reference import feed_forward, forward_row
from numerics import DEVICE, TOL, assert_close

from wiola import WiolaConfig, WiolaModel
from wiola.budget import MATCH_TOLERANCE, budget, match_params
from wiola.config import FFN_KINDS, PRESETS
from wiola.ops import butterfly, gelu_mlp, swiglu

CPU = platform.processor() or platform.machine()
SMALL = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=64)
FUNCTIONS = {"butterfly": butterfly, "swiglu": swiglu, "gelu": gelu_mlp}


def _block_weights(kind: str, d: int, f: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    shapes = {
        "butterfly": {"up_proj": (2 * f, d), "bypass_proj": (f, d), "down_proj": (d, f)},
        "swiglu": {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)},
        "gelu": {"up_proj": (f, d), "down_proj": (d, f)},
    }[kind]
    return {n: torch.randn(s, generator=g) * s[1] ** -0.5 for n, s in shapes.items()}


@pytest.mark.parametrize("kind", FFN_KINDS)
@pytest.mark.parametrize(("lead", "d", "f"), [((1,), 16, 24), ((3, 17), 64, 96)], ids=["N1", "B3-T17"])
def test_block_matches_float64_oracle(kind, lead, d, f):
    """fp32 ``wiola.ops`` block against the oracle written from SPEC (forward and every gradient),
    to fp32's table tolerance: sums of at most max(d, d_ff) <= 96 products of O(1) terms."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, d, generator=g)
    w = _block_weights(kind, d, f, g)
    inputs = [x, *w.values()]
    inputs32 = [t.clone().to(DEVICE).requires_grad_() for t in inputs]
    inputs64 = [t.double().requires_grad_() for t in inputs]
    got = FUNCTIONS[kind](*inputs32)
    want = feed_forward(kind, inputs64[0].reshape(-1, d), dict(zip(w, inputs64[1:]))).reshape(*lead, d)
    dy = torch.randn(got.shape, generator=g)
    got_grads = torch.autograd.grad(got, inputs32, dy.to(DEVICE))
    want_grads = torch.autograd.grad(want, inputs64, dy.double())
    where = f" ({kind}, CPU {CPU}, device {DEVICE})"
    assert_close("y" + where, want, got, TOL[torch.float32])
    for name, r, gt in zip(["dx", *w], want_grads, got_grads):
        assert_close(f"d{name}{where}", r, gt, TOL[torch.float32])


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_block_residual_and_dtype(kind):
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    w = list(_block_weights(kind, 16, 24, g).values())
    assert torch.equal(FUNCTIONS[kind](x, *w, residual=res), FUNCTIONS[kind](x, *w) + res)
    with torch.autocast("cpu", torch.bfloat16):
        assert FUNCTIONS[kind](x, *w).dtype == torch.bfloat16


def _randomised(model: WiolaModel, seed: int) -> WiolaModel:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else 0.2
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "nogate"])
def test_model_matches_float64_oracle(kind, gate):
    """The float64 model of each variant equals the oracle to float64 rounding."""
    cfg = WiolaConfig(**SMALL, ffn=kind, gate=gate)
    model = _randomised(WiolaModel(cfg), seed=2).double()
    ids = torch.randint(0, cfg.vocab_size, (1, 19), generator=torch.Generator().manual_seed(3))
    want = forward_row(model.state_dict(), cfg, ids[0].tolist())
    got = model(ids).logits[0]
    assert (got - want).abs().max() <= 1e-10 * want.abs().max(), f"{kind}: logits differ from the oracle"


@pytest.mark.parametrize("kind", FFN_KINDS)
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "nogate"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_budget_counts_are_exact(preset, gate, kind):
    config = WiolaConfig.preset(preset, ffn=kind, gate=gate)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = WiolaModel(config)
    counted = budget(config).total_params
    assert model.num_parameters() == counted, f"{preset} {kind} gate={gate}"


@pytest.mark.parametrize("kind", FFN_KINDS)
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "nogate"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_match_params_within_tolerance(preset, gate, kind):
    base = WiolaConfig.preset(preset)
    matched = match_params(WiolaConfig.preset(preset, ffn=kind, gate=gate), base)
    target, total = budget(base).total_params, budget(matched).total_params
    assert abs(total - target) <= MATCH_TOLERANCE * target
    # No other d_ff is nearer (the rule picks the nearest).
    for other in (matched.d_ff - 1, matched.d_ff + 1):
        near = budget(dataclasses.replace(matched, d_ff=other)).total_params
        assert abs(near - target) >= abs(total - target)
    if kind == "butterfly" and gate:
        assert matched == base


def test_match_params_breaks_a_tie_toward_the_smaller_d_ff():
    """A swiglu base of d_ff 65 lies exactly between gelu's d_ff 97 and 98 (32 parameters each
    way): the smaller is taken, as the docstring says."""
    shape = dict(vocab_size=1000, d_model=32, n_heads=2, n_layers=1, max_seq_len=64)
    base = WiolaConfig(**shape, d_ff=65, ffn="swiglu")
    cfg = WiolaConfig(**shape, d_ff=1, ffn="gelu")
    target = budget(base).total_params
    gaps = [budget(dataclasses.replace(cfg, d_ff=f)).total_params - target for f in (97, 98)]
    assert gaps == [-32, 32], f"not a tie: {gaps}"
    assert match_params(cfg, base).d_ff == 97


def test_match_params_refuses_what_cannot_match():
    base = WiolaConfig(**SMALL)
    with pytest.raises(ValueError, match="no d_ff matches"):
        match_params(WiolaConfig(**{**SMALL, "d_model": 64, "n_heads": 4}), base)
    with pytest.raises(ValueError, match="ffn must be one of"):
        WiolaConfig(**SMALL, ffn="moe")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_fast_model_equals_reference(kind):
    """``wiola.fast`` runs the variant (PyTorch block, fast ops elsewhere), warns, and computes
    the reference's logits, loss, gradients and greedy tokens."""
    from wiola.fast import WiolaModel as Fast

    cfg = WiolaConfig(**{**SMALL, "d_model": 64}, ffn=kind)  # head width 16: the kernels' smallest
    ref = _randomised(WiolaModel(cfg), seed=4).to(DEVICE)
    with pytest.warns(UserWarning, match=f"ffn='{kind}' has no fused kernel"):
        fast = Fast(cfg)
    fast.load_state_dict(ref.state_dict())
    fast.to(DEVICE)
    assert "runs on PyTorch" in fast.describe()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out_r = ref(ids, labels=ids)
    out_f = fast(ids, labels=ids, return_logits=True)
    assert_close(f"logits ({kind})", out_r.logits, out_f.logits, TOL[torch.float32])
    assert_close(f"loss ({kind})", out_r.loss, out_f.loss, TOL[torch.float32])
    out_r.loss.backward()
    out_f.loss.backward()
    grads_f = dict(fast.named_parameters())
    for name, p in ref.named_parameters():
        assert_close(f"d{name} ({kind})", p.grad, grads_f[name].grad, TOL[torch.float32])
    with torch.no_grad():
        assert torch.equal(ref.generate(ids[:, :5], 3), fast.generate(ids[:, :5], 3))


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_checkpoint_round_trip(kind, tmp_path):
    model = _randomised(WiolaModel(WiolaConfig(**SMALL, ffn=kind)), seed=6)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["config"]["ffn"] == kind
    loaded = WiolaModel.from_pretrained(tmp_path)
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_without_ffn_is_butterfly(tmp_path):
    """Checkpoints written before the variants existed have no ``ffn``: they are butterflies."""
    model = WiolaModel(WiolaConfig(**SMALL))
    model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    del meta["config"]["ffn"]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    assert WiolaModel.from_pretrained(tmp_path).config.ffn == "butterfly"


def test_butterfly_only_paths_refuse_variants():
    import warnings

    from wiola.checkpoint import export_wiola13m
    from wiola.export.onnx import export_onnx
    from wiola.fast import WiolaModel as Fast
    from wiola.fast import quantize
    from wiola.fast.decode_step_cpu import DecodeStepCPU, load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = Fast(WiolaConfig(**SMALL, ffn="gelu")).requires_grad_(False)
    with pytest.raises(ValueError, match="quantize supports only the butterfly.*ffn='gelu'"):
        quantize.quantize(fast, "int8")
    with pytest.raises(ValueError, match="export supports only the butterfly.*ffn='gelu'"):
        export_onnx(fast, "unused.onnx")
    with pytest.raises(ValueError, match="wiola13m format supports only the butterfly"):
        export_wiola13m(fast, "unused")
    if load() is not None:
        with pytest.raises(ValueError, match="C\\+\\+ CPU decode step supports only the butterfly"):
            DecodeStepCPU(fast, fast.new_cache(1))


def test_wiola_generate_names_the_pytorch_path(tmp_path, capsys):
    """``wiola generate`` on a CPU says which path decodes a variant (not the C++ step) and
    prints the reference's greedy text."""
    from wiola.cli import main
    from wiola.tokenizer import encoding_for_vocab

    model = _randomised(WiolaModel(WiolaConfig.preset("tiny", d_model=32, n_layers=1, n_heads=2, ffn="gelu")), 7)
    model.save_pretrained(tmp_path)
    enc = encoding_for_vocab(model.config.vocab_size)
    prompt = torch.tensor([enc.encode("Once")])
    want = "Once" + enc.decode(model.generate(prompt, 3, temperature=0)[0, prompt.shape[1] :].tolist()) + "\n"
    with pytest.warns(UserWarning, match="has no fused kernel"):
        code = main(["generate", "--checkpoint", str(tmp_path), "--prompt", "Once", "--max-new-tokens", "3",
                     "--temperature", "0", "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0 and out.out == want
    assert "CPU decoding: PyTorch (wiola.fast: ffn='gelu' has no fused kernel" in out.err
