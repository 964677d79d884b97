"""The CPU prompt path's modes (``wiola.fast.prefill``): the choice from the CPU's flags and
``$WIOLA_CPU_PREFILL``, where bf16 applies, and what bf16 products cost: logits within the bf16
error bound of the fp32 prompt; ``auto`` never picks a mode whose validation loss is more than
0.001 nats from fp32's. The fp32 GEMM (``$WIOLA_CPU_GEMM``): its choice from the CPU's vendor
and family, where it applies, and the model's logits on each GEMM within the fp32 bound of each
other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import U_BF16, AbsSums, assert_within, bound, left_padded_prompt

import wiola
import wiola.fast
from wiola.fast import prefill
from wiola.fast.quantize import quantize
from wiola.ops import linear

CONFIG = wiola.WiolaConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=160)


def _model(seed: int = 0) -> wiola.fast.WiolaModel:
    torch.manual_seed(seed)
    model = wiola.fast.WiolaModel(CONFIG).eval().requires_grad_(False)
    with torch.no_grad():  # larger than the init: peaked, input-dependent predictions
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def test_choice_from_flags_and_environment(monkeypatch):
    monkeypatch.delenv(prefill.ENV, raising=False)
    monkeypatch.setenv(prefill.GEMM_ENV, "aten")
    monkeypatch.setattr(prefill, "AUTO", {"amx_bf16": "bf16"})  # the table auto reads: flag -> mode
    for flags, want in (({"avx512_bf16", "amx_bf16", "amx_tile"}, "bf16"), ({"avx512_bf16"}, "fp32"), (set(), "fp32")):
        monkeypatch.setattr(prefill, "_flags", lambda flags=flags: flags)
        assert prefill.select() == want, flags
    gemm = "fp32 GEMM aten (forced: WIOLA_CPU_GEMM=aten)"
    assert (
        prefill.describe()
        == f"prefill fp32 (auto: CPU has no bf16 matrix units; bf16 products miss the 0.001-nat quality rule); {gemm}"
    )
    monkeypatch.setenv(prefill.ENV, " BF16 ")
    assert prefill.select() == "bf16" and prefill.describe() == f"prefill bf16 (forced: WIOLA_CPU_PREFILL=bf16); {gemm}"
    monkeypatch.setenv(prefill.ENV, "int8")
    with pytest.raises(ValueError, match="WIOLA_CPU_PREFILL='int8' is not one of auto, fp32, bf16"):
        prefill.select()
    with pytest.raises(ValueError, match="mode='fp16' is not one of"):
        prefill.select("fp16")


@torch.inference_mode()
def test_bf16_applies_only_to_a_gradient_free_fp32_prompt(plain_cpu, monkeypatch):
    monkeypatch.setenv(prefill.ENV, "bf16")
    model = _model()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(2, 9)
    assert prefill.applies(model, ids, cache)
    assert not prefill.applies(model, ids, None)  # a full pass (scoring, training) stays fp32
    assert not prefill.applies(model, ids[:, :1], cache)  # one token: the C++ step
    with torch.enable_grad():
        assert not prefill.applies(model, ids, cache)
    assert not prefill.applies(quantize(_model(), "int8"), ids, cache)  # its oracle is the fp32 path
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not prefill.applies(model, ids, cache)


@torch.inference_mode()
def test_bf16_prompt_within_the_bf16_bound(plain_cpu, monkeypatch):
    """The bf16 prompt's logits differ from fp32's (bf16 products ran) by no more than the error
    bound with bf16's unit roundoff; the cache it writes is fp32 and decoding continues from it."""
    model = _model()
    ids, mask = left_padded_prompt(CONFIG.vocab_size, 3, 40, 6)
    logits = {}
    for mode in ("fp32", "bf16"):
        monkeypatch.setenv(prefill.ENV, mode)
        cache = model.new_cache(3, 42)
        with AbsSums(model) as sums:
            logits[mode] = model(ids, attention_mask=mask, cache=cache).logits
        assert cache.k.dtype == torch.float32
        nxt = model(ids[:, -1:], cache=cache).logits  # the C++ step continues from the bf16 prompt's cache
        assert torch.isfinite(nxt).all()
    real = mask.bool()
    assert not torch.equal(logits["fp32"][real], logits["bf16"][real]), "the bf16 mode computed in fp32"
    allowed = bound(CONFIG, 40, sums.head, unit=U_BF16)[real]
    assert_within("bf16 prompt logits", logits["fp32"][real], logits["bf16"][real], allowed, "oneDNN bf16")


@torch.inference_mode()
def test_auto_picks_only_modes_within_a_thousandth_of_a_nat(plain_cpu, monkeypatch):
    """The quality rule of a prompt mode: the mean next-token loss over validation windows (here
    8 windows of 128 tokens of a model whose predictions depend on the input) within 0.001 nats
    of fp32's. ``auto`` may pick bf16 on some CPU only if bf16 meets it."""
    model = _model(seed=1)
    windows = torch.randint(0, CONFIG.vocab_size, (8, 129), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():  # the teacher's own greedy continuations: targets the model predicts well
        windows = model.generate(windows[:, :1], 128, temperature=0)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    loss = {}
    for mode in ("fp32", "bf16"):
        monkeypatch.setenv(prefill.ENV, mode)
        logits = model(inputs, cache=model.new_cache(8, 128)).logits
        loss[mode] = float(F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size).double(), targets.reshape(-1)))
    assert loss["bf16"] != loss["fp32"], "the bf16 mode computed in fp32"
    if abs(loss["bf16"] - loss["fp32"]) > 1e-3:
        assert "bf16" not in prefill.AUTO.values(), f"auto picks bf16 on some CPU, whose loss is off by {loss}"


def test_gemm_choice_from_cpu_and_environment(monkeypatch):
    monkeypatch.delenv(prefill.GEMM_ENV, raising=False)
    monkeypatch.setattr(prefill, "GEMM_AUTO", {("AuthenticAMD", "26"): "onednn"})
    monkeypatch.setattr(linear, "onednn_available", lambda: True)
    for vendor, family, want in (
        ("AuthenticAMD", "26", "onednn"),
        ("AuthenticAMD", "25", "aten"),
        ("GenuineIntel", "6", "aten"),
    ):
        cpu = {"vendor": vendor, "family": family, "machine": "x86_64", "flags": ""}
        monkeypatch.setattr(prefill, "_cpu", lambda cpu=cpu: cpu)
        assert prefill.select_gemm() == want, (vendor, family)
    assert prefill._describe_gemm() == "fp32 GEMM aten (auto: GenuineIntel family 6 not measured)"
    monkeypatch.setattr(prefill, "_cpu", lambda: {"vendor": "AuthenticAMD", "family": "26", "machine": "x86_64"})
    assert prefill._describe_gemm() == "fp32 GEMM onednn (auto: AuthenticAMD family 26 measured)"
    monkeypatch.setattr(linear, "onednn_available", lambda: False)  # a torch without oneDNN: auto takes ATen
    assert prefill.select_gemm() == "aten"
    with pytest.raises(ValueError, match="WIOLA_CPU_GEMM=onednn, but this torch has no oneDNN"):
        monkeypatch.setenv(prefill.GEMM_ENV, "onednn")
        prefill.select_gemm()
    monkeypatch.setenv(prefill.GEMM_ENV, " ATEN ")
    assert prefill.select_gemm() == "aten"
    assert prefill._describe_gemm() == "fp32 GEMM aten (forced: WIOLA_CPU_GEMM=aten)"
    monkeypatch.setenv(prefill.GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="WIOLA_CPU_GEMM='mkl' is not one of auto, aten, onednn"):
        prefill.select_gemm()


@torch.inference_mode()
def test_gemm_applies_to_gradient_free_cpu_forwards(plain_cpu):
    model = _model()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    assert prefill.gemm_applies(model, ids)  # a prompt or a scoring pass alike
    assert prefill.gemm_applies(quantize(_model(), "int8"), ids)  # fp32 products on the dequantized weights
    with torch.enable_grad():
        assert not prefill.gemm_applies(model, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not prefill.gemm_applies(model, ids)


@pytest.mark.skipif(not linear.onednn_available(), reason="this torch has no oneDNN")
@torch.inference_mode()
def test_onednn_prompt_within_the_fp32_bound(plain_cpu, monkeypatch):
    """The prompt (3 rows of 70 tokens, one left-padded: 210-row products) on oneDNN and on ATen:
    every product of more than 64 rows counted on oneDNN and none on ATen, the logits within the
    fp32 bound of each other (two fp32 sides), and decoding continues from oneDNN's cache."""
    model = _model(seed=3)
    ids, mask = left_padded_prompt(CONFIG.vocab_size, 3, 70, 9)
    calls, real = [], linear._onednn_applies
    monkeypatch.setattr(linear, "_onednn_applies", lambda x, w: calls.append(ran := real(x, w)) or ran)
    logits = {}
    for gemm in ("aten", "onednn"):
        monkeypatch.setenv(prefill.GEMM_ENV, gemm)
        calls.clear()
        cache = model.new_cache(3, 72)
        with AbsSums(model) as sums:
            logits[gemm] = model(ids, attention_mask=mask, cache=cache).logits
        ran = sum(calls)  # per layer q/k/v, o, up, bp and down; then the head
        assert ran == (5 * CONFIG.n_layers + 1 if gemm == "onednn" else 0), f"{gemm}: {ran} products on oneDNN"
        assert torch.isfinite(model(ids[:, -1:], cache=cache).logits).all()
    real_rows = mask.bool()
    allowed = bound(CONFIG, 70, sums.head)[real_rows]
    got, want = logits["onednn"][real_rows], logits["aten"][real_rows]
    assert_within("oneDNN prompt logits against ATen's", want, got, allowed, "oneDNN fp32 GEMM")
