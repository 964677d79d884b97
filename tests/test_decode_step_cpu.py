"""The C++ CPU decoding step (``wiola/fast/decode_step_cpu``) against the reference model's one-token
forward with a cache: logits and every cache buffer it writes, over odd shapes (row counts that
are not multiples of the 4-row blocks, widths that are not multiples of the 16, 8 or 4 SIMD
lanes), every gate variant, left padding, long caches, NaN-poisoned slots it must not read,
thread counts, each instruction-set variant this CPU runs (every variant this compiler builds
is compiled), the choice of variant and its refusal, the build-failure warning, and its use by
``wiola.fast.WiolaModel`` on a plain CPU (dispatch, rebinding, fallback). The same library's
prompt attention (``decode_attention`` for ``T ≥ 1`` new tokens) against the float64 equations: outputs and
cache writes within its error bound, NaN padding it must not read, bitwise batch and thread
invariance, what it declines, and its use by the fast model's prompt; likewise the prompt's
row functions (RMSNorm with the residual add, the butterfly's SiLU gate)."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ISAS_HERE, count_step_calls
from cpu_prompt_oracle import (
    PROMPT_CASES,
    check_prompt_attention,
    check_rms_norm,
    check_silu_gate,
    prompt_inputs,
    prompt_oracle,
    rms_norm_oracle,
    rows_inputs,
    silu_gate_oracle,
)
from gate_oracle import gate_float64, make_inputs
from numerics import (
    LAMBDA,
    U32,
    AbsSums,
    assert_within,
    beside_reference,
    bound,
    cache_bound,
    left_padded_prompt,
    platform_line,
    reference_on,
    step_beside,
)

import wiola
import wiola.fast
from wiola.fast import ops as fast_ops
from wiola.fast.quantize import matrix_bytes, quantize

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")

# Odd shapes: d 40 (K not a multiple of 16), head width 10 (below one SIMD vector), d_ff 72,
# V 301 (not a multiple of the 4-row blocks).
ODD = wiola.WiolaConfig(vocab_size=301, d_model=40, n_layers=2, n_heads=4, d_ff=72, max_seq_len=320)
SMALL = wiola.WiolaConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=320)
VARIANTS = {
    "odd": ODD,
    "gate-post-rope": dataclasses.replace(SMALL, gate_pre_rope=False),
    "no-gate": dataclasses.replace(SMALL, gate=False),
    "alpha0": dataclasses.replace(SMALL, helix_alpha=0.0),
    "13m-shape": dataclasses.replace(wiola.WiolaConfig.preset("13m"), vocab_size=2000, n_layers=2),
}


X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(autouse=True)
def _built():
    if decode_step_cpu.load() is None:
        pytest.fail(f"the CPU decode step did not build: {decode_step_cpu.BUILD_ERROR}")


def _reset(monkeypatch) -> None:
    """Forget every build and the CPU's detected features (for tests that change the compiler)."""
    monkeypatch.setattr(decode_step_cpu, "_BUILDS", {})
    monkeypatch.setattr(decode_step_cpu, "_FEATURES", {})
    monkeypatch.setattr(decode_step_cpu, "BUILD_ERROR", None)


def _model(config: wiola.WiolaConfig, seed: int = 0) -> wiola.WiolaModel:
    torch.manual_seed(seed)
    model = wiola.WiolaModel(config).eval()
    with torch.no_grad():  # larger than the init so that attention and the gates are far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _assert_caches_equal(ref: wiola.Cache, got: wiola.Cache, upto: int, allowed: dict[str, float]) -> None:
    """Masks and counts equal; k, v (real slots) and the gate sums within ``allowed`` (``cache_bound``)."""
    real = ref.key_mask[:, :upto]
    assert torch.equal(ref.key_mask, got.key_mask), "cache.key_mask differs"
    assert torch.equal(ref.n_real, got.n_real), f"cache.n_real {got.n_real.tolist()} != {ref.n_real.tolist()}"
    assert torch.equal(ref.gate_count, got.gate_count), "cache.gate_count differs"
    assert ref.length == got.length, f"cache.length {got.length} != {ref.length}"
    for name in ("k", "v"):
        r, g = getattr(ref, name)[:, :, :, :upto], getattr(got, name)[:, :, :, :upto]
        sel = real[None, :, None, :].expand_as(r[..., 0])
        assert_within(f"cache.{name}", r[sel], g[sel], allowed[name])
    assert_within("cache.gate_sum", ref.gate_sum, got.gate_sum, allowed["gate_sum"])


@torch.inference_mode()
@pytest.mark.parametrize("B,prompt,steps,pad", [(1, 1, 6, 0), (3, 17, 9, 6), (2, 290, 10, 30)], ids=lambda v: str(v))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_matches_reference_forward(variant, B, prompt, steps, pad, isa):
    """Logits and cache after each of ``steps`` one-token steps equal the reference's."""
    config = VARIANTS[variant]
    model = _model(config)
    ids, mask = left_padded_prompt(config.vocab_size, B, prompt, pad)
    S = prompt + steps
    ref_cache, cache = model.new_cache(B, S), model.new_cache(B, S)
    model(ids, attention_mask=mask, cache=ref_cache)
    model(ids, attention_mask=mask, cache=cache)
    # Slots the step must never read: everything past the current one, and the left padding.
    unread = ~cache.key_mask.clone()  # (B, S): padding and every slot not yet written
    for buf in (cache.k, cache.v):
        buf.masked_fill_(unread[None, :, None, :, None], float("nan"))
    step = decode_step_cpu.DecodeStepCPU(model, cache, isa=isa)
    assert step.isa == isa
    proj = step_beside(model, ref_cache, step, cache, steps, "logits")
    _assert_caches_equal(ref_cache, cache, S, cache_bound(config, S, proj, steps))


@torch.inference_mode()
def test_step_matches_float64_oracle(isa):
    """Independent of the reference model: the float64 computation from SPEC's equations."""
    from f64_reference import forward_row

    config = ODD
    model = _model(config, seed=3)
    ids, mask = left_padded_prompt(config.vocab_size, 3, 12, 4)
    nxt = torch.randint(0, config.vocab_size, (3, 1), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(3, 13)
    model(ids, attention_mask=mask, cache=cache)
    got = decode_step_cpu.DecodeStepCPU(model, cache, isa=isa)(nxt.view(-1), cache.length)
    full_ids = torch.cat([ids, nxt], dim=1)
    full_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    state = model.state_dict()
    want = torch.stack(
        [forward_row(state, config, full_ids[b].tolist(), full_mask[b].bool().tolist())[-1] for b in range(3)]
    )
    with AbsSums(model) as sums:  # the magnitudes of the head's sums, on the same positions
        model(full_ids, attention_mask=full_mask)
    allowed = bound(config, full_ids.shape[1], sums.head[:, -1], sides=1)
    assert_within("logits vs float64", want, got.double(), allowed, isa)


class _ThreadedSteps:
    """The 13m-shaped model (quantized to ``scheme`` unless fp32) with one thread per byte streamed
    (so that every thread count asked for is used): ``run(n)`` prefills 3 left-padded rows on the
    PyTorch path and returns the step's logits over 3 steps on ``n`` threads, with ``parts`` (a
    ``decode_step_cpu.balance`` setting) set before each step."""

    def __init__(self, scheme: str, isa: str, monkeypatch) -> None:
        model = wiola.fast.WiolaModel(VARIANTS["13m-shape"]).eval().requires_grad_(False)
        model.load_state_dict(_model(VARIANTS["13m-shape"]).state_dict())
        if scheme != "fp32":
            quantize(model, scheme)
        chosen = decode_step_cpu.choose_tuning
        monkeypatch.setattr(decode_step_cpu, "choose_tuning", lambda *a, **k: chosen(*a, **k) | {"bytes_per_thread": 1})
        self.model, self.scheme, self.isa = model, scheme, isa
        self.prefill = reference_on(model)  # the PyTorch path on the (dequantized) weights, no kernels
        self.ids, self.mask = left_padded_prompt(model.config.vocab_size, 3, 20, 5)

    def run(self, n: int, parts: dict[str, list[float]] | None = None) -> torch.Tensor:
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(n)
            cache = self.model.new_cache(3, 24)
            self.prefill(self.ids, attention_mask=self.mask, cache=cache)
            step = decode_step_cpu.DecodeStepCPU(self.model, cache, isa=self.isa)
            assert step.quantization == (None if self.scheme == "fp32" else self.scheme)
            out = []
            for t in range(3):
                if parts:
                    now = decode_step_cpu.balance(n, self.isa, parts)
                    assert all(now[k] == pytest.approx(v, rel=1e-6) for k, v in parts.items()), now
                out.append(step(self.ids[:, t].contiguous(), cache.length + t))
            return torch.stack(out)
        finally:
            torch.set_num_threads(threads)


@torch.inference_mode()
@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4", "bf16"])
def test_thread_count_does_not_change_results(scheme, isa, monkeypatch):
    """Each output is one dot product whatever the split between threads: the logits of 3 rows
    over 3 steps are bitwise equal on 1 to 4 threads and on 9 (4 on fewer cores: threads are
    descheduled mid-share and wait at the step's own barrier, yielding; 9: above the 8 it serves,
    where the step passes ``omp barrier`` and cuts evenly)."""
    steps = _ThreadedSteps(scheme, isa, monkeypatch)
    want = steps.run(1)
    for n in (2, 3, 4, 9):
        assert torch.equal(want, steps.run(n)), (
            f"{scheme}: logits on {n} threads differ from 1 thread's; {platform_line(isa)}"
        )


@torch.inference_mode()
@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4", "bf16"])
def test_balance_does_not_change_results(scheme, isa, monkeypatch):
    """The threads' parts of each product's rows (``decode_step_cpu.balance``, learned from their
    rates) move rows between threads, never a sum: with parts far from even, set before each step
    (2 threads at 9:1 and 1:7, 3 at 6:1:3 and 1:1:8; layers and head apart), the logits of 3 rows
    over 3 steps are bitwise the same as on 1 thread, and the parts the steps leave are
    fractions that sum to 1."""
    steps = _ThreadedSteps(scheme, isa, monkeypatch)
    cases = [
        (2, {"layers": [0.9, 0.1], "head": [0.125, 0.875]}),
        (3, {"layers": [0.6, 0.1, 0.3], "head": [0.1, 0.1, 0.8]}),
    ]
    try:
        want = steps.run(1)
        for n, parts in cases:
            assert torch.equal(want, steps.run(n, parts)), (
                f"{scheme}: logits with parts {parts} on {n} threads differ from 1 thread's; {platform_line(isa)}"
            )
            left = decode_step_cpu.balance(n, isa)
            assert all(len(v) == n and abs(sum(v) - 1) < 1e-5 for v in left.values()), left
    finally:
        for n, _ in cases:
            decode_step_cpu.balance(n, isa, {"layers": [], "head": []})


def _balance_next(isa: str, was: list[float], cut: list[float], ticks: list[int]) -> list[float] | None:
    """Balance's rule (``wiola_balance_next``): the next parts, or None when the step is not counted."""
    lib = decode_step_cpu.load(isa)
    n = len(was)
    out = (ctypes.c_float * n)()
    counted = lib.wiola_balance_next(
        n, (ctypes.c_float * n)(*was), (ctypes.c_double * (n + 1))(*cut), (ctypes.c_uint64 * n)(*ticks), out
    )
    return [float(v) for v in out] if counted else None


def test_balance_rule(isa):
    """Each step moves a thread's part an eighth of the way to its share of the threads' rates
    (rows a tick), from even before any measure; repeated, the parts settle where every thread
    takes the same time; a step with a thread 4x slower than another, or without ticks, is not
    counted; a part stays at least a quarter of an even one."""
    even = [0.5, 0.5]
    assert _balance_next(isa, [0.0, 0.0], [0, 0.5, 1], [100, 100]) == pytest.approx(even)
    # thread 1 half as fast: its rate share is 1/3, so 0.5 + (1/3 - 0.5)/8
    got = _balance_next(isa, [0.0, 0.0], [0, 0.5, 1], [100, 200])
    assert got == pytest.approx([0.5 + (2 / 3 - 0.5) / 8, 0.5 + (1 / 3 - 0.5) / 8], rel=1e-6)
    parts = even
    for _ in range(200):  # thread 1 half as fast on every row: ticks in proportion to its rows x 2
        cut = [0.0, parts[0], 1.0]
        parts = _balance_next(isa, parts, cut, [round(1e6 * parts[0]), round(2e6 * parts[1])])
    assert parts == pytest.approx([2 / 3, 1 / 3], abs=1e-3)
    three = _balance_next(isa, [0.2, 0.3, 0.5], [0, 0.2, 0.5, 1], [300, 300, 300])  # equal times: settled
    assert three == pytest.approx([0.2, 0.3, 0.5], rel=1e-6)
    three = _balance_next(isa, [0.2, 0.3, 0.5], [0, 0.2, 0.5, 1], [200, 300, 500])  # equal rates: toward even
    assert three == pytest.approx([0.2 + (1 / 3 - 0.2) / 8, 0.3 + (1 / 3 - 0.3) / 8, 0.5 + (1 / 3 - 0.5) / 8], rel=1e-6)
    # parts as set through balance() need not sum to 1: 2:3:5 moves as 0.2, 0.3, 0.5 do
    assert _balance_next(isa, [2.0, 3.0, 5.0], [0, 0.2, 0.5, 1], [200, 300, 500]) == pytest.approx(three, rel=1e-6)
    assert _balance_next(isa, even, [0, 0.5, 1], [100, 401]) is None  # an outlier: not counted
    assert _balance_next(isa, even, [0, 0.5, 1], [100, 399]) is not None
    assert _balance_next(isa, even, [0, 0.5, 1], [100, 0]) is None  # no time measured
    # a part far below a quarter of even (0.01 of 2, equal rates): moved to 0.07125 it would still be
    # under 0.125, so it is raised to 0.125 before the parts are scaled to sum to 1
    low = _balance_next(isa, [0.01, 0.99], [0, 0.01, 1], [1, 99])
    high = 0.99 + (0.5 - 0.99) / 8
    assert low == pytest.approx([0.125 / (0.125 + high), high / (0.125 + high)], rel=1e-6)


def test_balance_refuses_bad_parts(isa):
    """Parts of the wrong length, or not positive and finite, are refused, naming them, before any
    is set; 2 to 8 threads are kept."""
    decode_step_cpu.balance(2, isa, {"layers": [], "head": []})  # forget what earlier steps learned
    for bad in ([1.0, 0.0], [1.0], [1.0, float("inf")], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match="must be 2 positive finite numbers"):
            decode_step_cpu.balance(2, isa, {"head": bad})
        with pytest.raises(ValueError, match="positive finite"):  # the valid kind is not set either
            decode_step_cpu.balance(2, isa, {"layers": [0.5, 0.5], "head": bad})
    assert decode_step_cpu.balance(2, isa) == {"layers": [], "head": []}  # nothing was set
    with pytest.raises(ValueError, match="not one of"):
        decode_step_cpu.balance(2, isa, {"attention": [0.5, 0.5]})
    with pytest.raises(ValueError, match="not kept"):
        decode_step_cpu.balance(9, isa, {"layers": [1.0] * 9})
    assert decode_step_cpu.balance(1, isa) == {"layers": [], "head": []}


@pytest.mark.parametrize("knob,values", [("stream_head", (0, 1)), ("prefetch_rows", (0, 8, 32))])
def test_tuning_does_not_change_results(knob, values, isa, monkeypatch):
    """The tuning (the head's prefetch kind, the prefetch distance) moves bytes, never a sum:
    the logits of 3 rows over 3 steps are bitwise the same for every value of the knob."""
    model = _model(VARIANTS["13m-shape"])
    ids, mask = left_padded_prompt(model.config.vocab_size, 3, 20, 5)
    chosen = decode_step_cpu.choose_tuning

    def run(value: int) -> torch.Tensor:
        monkeypatch.setattr(decode_step_cpu, "choose_tuning", lambda *a, **k: chosen(*a, **k) | {knob: value})
        cache = model.new_cache(3, 24)
        model(ids, attention_mask=mask, cache=cache)
        step = decode_step_cpu.DecodeStepCPU(model, cache, isa=isa)
        assert step.tuning[knob] == value
        return torch.stack([step(ids[:, t].contiguous(), cache.length + t) for t in range(3)])

    want = run(values[0])
    for value in values[1:]:
        assert torch.equal(want, run(value)), (
            f"{knob}={value} changed the logits of {knob}={values[0]}; {platform_line(isa)}"
        )


@pytest.mark.parametrize(
    "matrix_bytes, threads",
    [(0, 1), (1, 1), ((2 << 20) - 1, 1), (4 << 20, 2), ((6 << 20) + 5, 3), (52 << 20, 5), (1 << 40, 5)],
)
def test_step_threads_take_one_per_2_mib_at_least_one_at_most_torchs(matrix_bytes, threads):
    """``step_threads``: one thread per ``bytes_per_thread`` (2 MiB) of matrices, rounded down,
    at least one (a model under 4 MiB runs on one), at most torch's count (here 5)."""
    before = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        chosen = {"matrix_bytes": matrix_bytes, "bytes_per_thread": decode_step_cpu.BYTES_PER_THREAD}
        assert decode_step_cpu.step_threads(chosen) == threads
    finally:
        torch.set_num_threads(before)
    assert decode_step_cpu.BYTES_PER_THREAD == 2 << 20


@pytest.mark.parametrize(
    "vendor,family,model,llc,scheme",
    [
        ("GenuineIntel", 6, 207, 260 << 20, None),  # everything fits
        ("GenuineIntel", 6, 106, 48 << 20, None),  # Ice Lake-SP: fp32's 52 MB past its 48 MiB L3
        ("GenuineIntel", 6, 106, 48 << 20, "bf16"),  # and bf16's 26 MB past half of it
        ("AuthenticAMD", 25, 17, 32 << 20, None),  # Zen 4: fp32 past the whole L3
        ("AuthenticAMD", 25, 17, 32 << 20, "bf16"),  # Zen 4: bf16 between half and all of it
        ("AuthenticAMD", 25, 17, 32 << 20, "int8"),  # Zen 4: int8's 13 MB within half
        ("AuthenticAMD", 25, 1, 32 << 20, None),  # Zen 3
        ("AuthenticAMD", 23, 49, 16 << 20, None),  # Zen 2 (not measured)
        ("GenuineIntel", 6, 143, None, None),  # no cache size known
    ],
)
def test_head_read_through_the_caches(vendor, family, model, llc, scheme, monkeypatch):
    """``choose_tuning`` reads the tied head through the caches (``STREAM_HEAD`` 0) on every CPU,
    whatever the matrices' size against the last-level cache, and records what it chose from."""
    lines = (f"vendor_id\t: {vendor}", f"cpu family\t: {family}", f"model\t\t: {model}", "model name\t: test CPU")
    monkeypatch.setattr(decode_step_cpu, "_cpuinfo_lines", lambda: lines)
    monkeypatch.setattr(decode_step_cpu, "last_level_cache_bytes", lambda: llc)
    config = wiola.WiolaConfig.preset("13m")
    got = decode_step_cpu.choose_tuning(config, scheme)
    assert got["stream_head"] == 0, got
    assert (got["vendor"], got["family"], got["model"], got["last_level_cache_bytes"]) == (
        vendor, str(family), str(model), llc,
    )  # fmt: skip
    assert got["matrix_bytes"] == matrix_bytes(config, scheme), got


@pytest.mark.parametrize("scheme", [None, "bf16", "int8", "int4"])
def test_matrix_bytes_are_what_the_step_streams(scheme):
    """``matrix_bytes`` (which sets the step's threads) counts every matrix the step streams, as
    stored, scales included: the fp32 model's embedding and seven projections a layer (W_up is
    2F x d), or a quantized model's packed matrices and scales."""
    config = wiola.WiolaConfig(vocab_size=600, d_model=64, n_layers=3, n_heads=4, d_ff=128, max_seq_len=32)
    torch.manual_seed(0)
    model = wiola.fast.WiolaModel(config).eval().requires_grad_(False)
    if scheme is None:
        slots = decode_step_cpu.matrix_slots(config.n_layers)
        params = decode_step_cpu.step_parameters(model)
        streamed = sum(params[i].numel() * params[i].element_size() for i in slots)
    else:
        _, packed, scales = decode_step_cpu._packed(quantize(model, scheme))
        streamed = sum(t.numel() * t.element_size() for t in packed + [s for s in scales if s is not None])
    assert matrix_bytes(config, scheme) == streamed


@pytest.mark.parametrize(
    "family,model,scheme,ahead",
    [
        (26, 2, "bf16", 16),  # Zen 5, bf16: 512-byte rows of the 13m preset, 8 KB ahead
        (26, 2, "int8", 32),  # Zen 5, int8
        (26, 2, "int4", 32),  # Zen 5, int4: int8's distance, measured for both
        (26, 2, None, 8),  # Zen 5, fp32: 8 rows are 8 KB
        (25, 17, "bf16", 0),  # Zen 4: each block's own rows, whatever the type
        (25, 17, "int8", 0),
        (25, 17, None, 0),
        (25, 1, None, 8),  # Zen 3: the default
        (26, 68, "bf16", 8),  # a Zen 5 desktop part (not measured): the default
        (26, 0, "bf16", 16),  # the ends of the Zen 5 EPYC's models, 0-31
        (26, 31, "bf16", 16),
        (26, 32, "bf16", 8),
        (25, 16, "bf16", 0),  # the ends of the Zen 4 EPYC's models, 16-31
        (25, 31, None, 0),
        (25, 15, None, 8),
        (25, 32, None, 8),
    ],
)
def test_prefetch_distance_choice(family, model, scheme, ahead, monkeypatch):
    """``choose_tuning`` prefetches ``PREFETCH_ROWS`` rows ahead, on the CPUs of
    ``PREFETCH_BYTES_CPUS`` (Zen 5 EPYC) at least ``PREFETCH_BYTES`` of the model's rows, and on
    those of ``PREFETCH_NEAR_CPUS`` (Zen 4 EPYC) none (each block's own rows)."""
    lines = ("vendor_id\t: AuthenticAMD", f"cpu family\t: {family}", f"model\t\t: {model}", "model name\t: test CPU")
    monkeypatch.setattr(decode_step_cpu, "_cpuinfo_lines", lambda: lines)
    monkeypatch.setattr(decode_step_cpu, "last_level_cache_bytes", lambda: 32 << 20)
    got = decode_step_cpu.choose_tuning(wiola.WiolaConfig.preset("13m"), scheme)
    assert got["prefetch_rows"] == ahead, got


X86_CPUINFO = (
    "vendor_id\t: AuthenticAMD",
    "cpu family\t: 25",
    "model\t\t: 17",
    "model name\t: AMD EPYC",
    "flags\t: avx2 fma",
)


@pytest.mark.parametrize(
    "lines, vendor, numbers, flags",
    [
        (X86_CPUINFO, "AuthenticAMD", ("25", "17"), "avx2 fma"),  # a VM names a Zen 3 and a Zen 4 alike
        (("processor\t: 0", "Features\t: fp asimd", "CPU part\t: 0xd0c"), "", ("", ""), "fp asimd"),  # aarch64
    ],
)
def test_cpu_info_names_the_cpu(lines, vendor, numbers, flags, monkeypatch):
    """``cpu_info`` reads the vendor, model name, family and model numbers and flags, and names the
    CPU with its numbers where it has them (benchmark records, failure messages)."""
    monkeypatch.setattr(decode_step_cpu, "_cpuinfo_lines", lambda: lines)
    info = decode_step_cpu.cpu_info()
    assert (info["vendor"], (info["family"], info["model_number"]), info["flags"]) == (vendor, numbers, flags), info
    if numbers[0]:
        assert info["model"] == "AMD EPYC" and info["name"] == "AMD EPYC (family 25, model 17)", info
    else:  # no model name: the platform's processor string, without numbers
        assert info["model"] and info["name"] == info["model"], info


def test_bad_bindings_name_the_tensor():
    model = _model(SMALL)
    with pytest.raises(ValueError, match="weight #0 must be a contiguous torch.float32"):
        decode_step_cpu.DecodeStepCPU(model.double(), wiola.Cache(SMALL, 1, 4))
    model = _model(SMALL)
    cache = model.new_cache(1, 4)
    cache.gate_count = cache.gate_count.int()
    with pytest.raises(ValueError, match="cache.gate_count must be a contiguous torch.int64"):
        decode_step_cpu.DecodeStepCPU(model, cache)
    other = dataclasses.replace(SMALL, n_layers=3)  # a cache made for another model
    with pytest.raises(ValueError, match=r"cache.k has shape \(3, 1, 2, 4, 32\), the model needs \(2, 1, 2, 4, 32\)"):
        decode_step_cpu.DecodeStepCPU(model, wiola.Cache(other, 1, 4))


@torch.inference_mode()
def test_every_entry_refuses_ids_slots_and_rows_out_of_range(plain_cpu):
    """The C++ indexes the embedding, the cache and its outputs with these numbers unchecked: each
    entry point refuses one out of range before the call. A cache made for another model is an
    error for ``cpu_decode_step``'s caller, not a reason to fall back to the PyTorch path."""
    model = wiola.fast.WiolaModel(SMALL).eval()
    model.load_state_dict(_model(SMALL).state_dict())
    other = wiola.Cache(dataclasses.replace(SMALL, n_layers=3), 1, 4)
    with pytest.raises(ValueError, match=r"cache.k has shape \(3, 1, 2, 4, 32\), the model needs"):
        fast_ops.cpu_decode_step(model, torch.tensor([[1]]), other)
    step = decode_step_cpu.DecodeStepCPU(model, model.new_cache(2, 4))
    V, t = SMALL.vocab_size, lambda *v: torch.tensor(v)
    ok = t(1, 2)
    for tokens, match in (
        (t(1, V), rf"tokens holds {V}, outside \[0, {V}\)"),
        (t(-1, 2), r"tokens holds -1, outside"),
        (ok.int(), "tokens must be a contiguous torch.int64"),
        (t(1), r"tokens has shape \(1,\), the model needs \(2,\)"),
    ):
        with pytest.raises(ValueError, match=match):
            step(tokens, 0)
    for slot in (4, -1, True):
        with pytest.raises(ValueError, match=rf"slot must be an int in \[0, max_len=4\), got {slot!r}"):
            step(ok, slot)
    for args, match in (
        ((t(0, 2), ok, t(0, 0)), r"rows holds 2, outside \[0, 2\)"),
        ((t(1, 1), ok, t(0, 0)), r"rows must be distinct, got \[1, 1\]"),
        ((t(0, 1), t(0, V), t(0, 0)), rf"tokens holds {V}"),
        ((t(0, 1), ok, t(0, 4)), r"slots holds 4, outside \[0, 4\)"),
    ):
        with pytest.raises(ValueError, match=match):
            step.rows(*args)
        with pytest.raises(ValueError, match=match):
            step.step_rows(*args, decode_step_cpu.Samplers(2, V, 1))
    with pytest.raises(ValueError, match="samplers made for"):
        step.step_rows(t(0, 1), ok, t(0, 0), decode_step_cpu.Samplers(3, V, 1))
    for n_logprobs in ((2, 0), (0, -1)):  # more than max_k would write into the next row's top ids
        samplers = decode_step_cpu.Samplers(2, V, 1)
        samplers.n_logprobs.copy_(torch.tensor(n_logprobs))
        with pytest.raises(ValueError, match=r"samplers.n_logprobs must be in \[0, max_k=1\]"):
            step.step_rows(t(0, 1), ok, t(0, 0), samplers)

    def loop(start=1, steps=(0, 3), out=None, eos=5, pad=0, temperature=0.0, log_noise=None):
        out = torch.zeros(2, 3, dtype=torch.int64) if out is None else out
        first, finished = torch.zeros(2, V), torch.zeros(2, dtype=torch.uint8)
        return step.generate_loop(start, steps, out, first, finished, temperature, None, None, log_noise, eos, pad)

    for kwargs, match in (
        (dict(pad=V), rf"pad must be None or an int in \[0, vocab_size={V}\), got {V}"),
        (dict(eos=-1), r"eos must be None or an int in"),
        (dict(steps=(0, 4)), r"steps \[0, 4\) from slot 1 are past out's 3 columns"),
        (dict(start=3), r"steps \[0, 3\) from slot 3 are past .* max_len=4"),
        (dict(steps=(1, 3), out=torch.full((2, 3), V)), rf"out\[:, 0\] holds {V}"),
        (dict(out=torch.zeros(3, 3, dtype=torch.int64)), r"out has shape \(3, 3\), the model needs \(2, 3\)"),
        (dict(temperature=1.0), "sampling .* needs log_noise"),
    ):
        with pytest.raises(ValueError, match=match):
            loop(**kwargs)
    assert loop(start=2) == 3  # the last slot a loop of 3 steps from slot 2 writes is max_len - 1


# ------------------------------------------------------------------ variants and their choice
@pytest.mark.parametrize("variant", decode_step_cpu.ISAS)
def test_every_variant_compiles(variant):
    """Every variant this compiler can target builds, whatever this CPU runs (the x86 ones on
    any x86-64 compiler, the portable one everywhere), and exports the step. Taken from the build
    cache where this source, variant, compiler and CPU were built before (its name hashes all of
    them, its digest proves the file whole), else compiled into it."""
    if variant != "portable" and not X86:
        pytest.skip(f"{variant} is an x86 variant; this is {platform.machine()}")
    target = decode_step_cpu.cached_build(variant)
    assert target == decode_step_cpu.library_path(decode_step_cpu._compiler(), variant)
    assert decode_step_cpu._intact(target)
    symbols = target.read_bytes()
    assert b"wiola_decode_step" in symbols and b"wiola_workspace_floats" in symbols


def test_variant_choice_and_refusal(monkeypatch):
    """The best variant the CPU's features allow; ``WIOLA_CPU_ISA`` forces one, and one the CPU
    lacks (or an unknown name) is refused naming the problem."""
    compiler = decode_step_cpu._compiler()
    monkeypatch.setattr(decode_step_cpu, "_FEATURES", {})
    monkeypatch.delenv("WIOLA_CPU_ISA", raising=False)
    amx = {"avx512f", "avx2", "fma", "avx512_bf16", "amx_tile", "amx_bf16"}
    for features, best in (
        (amx, "amx"),
        (amx - {"amx_tile"}, "avx512"),  # AMX that Linux did not grant (cpu_features drops it)
        ({"avx512f", "avx2", "fma"}, "avx512"),
        ({"avx2", "fma"}, "avx2"),
        ({"avx2"}, "portable"),
    ):
        decode_step_cpu._FEATURES[compiler] = (frozenset(features), "test")
        assert decode_step_cpu.select_isa() == best, features
    # an AVX2 CPU without AVX-512 (the machine that motivated the variants)
    decode_step_cpu._FEATURES[compiler] = (frozenset({"avx2", "fma"}), "test")
    monkeypatch.setenv("WIOLA_CPU_ISA", "portable")
    assert decode_step_cpu.select_isa() == "portable"
    monkeypatch.setenv("WIOLA_CPU_ISA", " AVX2 ")
    assert decode_step_cpu.select_isa() == "avx2"
    monkeypatch.setenv("WIOLA_CPU_ISA", "auto")
    assert decode_step_cpu.select_isa() == "avx2"
    monkeypatch.setenv("WIOLA_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match=r"WIOLA_CPU_ISA=avx512: this CPU lacks avx512f \(it has avx2, fma"):
        decode_step_cpu.load()
    monkeypatch.setenv("WIOLA_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="WIOLA_CPU_ISA='sse9' is not one of auto, amx, avx512, avx2, portable"):
        decode_step_cpu.load()
    with pytest.raises(ValueError, match="isa='neon' is not one of"):
        decode_step_cpu.select_isa("neon")


def test_amx_is_chosen_only_where_linux_grants_the_tiles(monkeypatch):
    """A CPU with AMX whose kernel refuses the process its tile registers (``amx_permitted``
    False) gets the avx512 variant: running a tile instruction would kill the process."""
    compiler = decode_step_cpu._compiler()
    monkeypatch.setattr(decode_step_cpu, "_FEATURES", {})
    monkeypatch.setattr(decode_step_cpu, "amx_permitted", lambda: False)
    monkeypatch.delenv("WIOLA_CPU_ISA", raising=False)
    features, where = decode_step_cpu.cpu_features(compiler)
    assert not features & {"amx_tile", "amx_bf16"}, (features, where)
    assert decode_step_cpu.select_isa() != "amx"
    if "avx512f" in features:
        assert decode_step_cpu.select_isa() == "avx512"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("N", "K"), [(64, 64), (37, 70), (5, 32)])
def test_tile_matrix_places_each_weight_where_the_tile_unit_reads_it(dtype, N, K):
    """``tile_matrix``: blocks of 16 rows by 32 columns, the blocks of each 16-row band in order of
    K, weight (n, k) at (k // 2)·32 + 2n + k % 2 inside its block (``tile_at`` in the source);
    rows padded with zeros to a multiple of 32, columns to a multiple of 32."""
    q = torch.arange(1, N * K + 1).remainder(120).add(1).to(dtype).view(N, K)
    t = decode_step_cpu.tile_matrix(q)
    n_pad, k_pad = -(-N // 32) * 32, -(-K // 32) * 32
    assert t.shape == (n_pad // 16, k_pad // 32, 512) and t.dtype == dtype and t.is_contiguous()
    flat = t.reshape(-1)
    for n in range(N):
        for k in range(K):
            at = ((n // 16) * (k_pad // 32) + k // 32) * 512 + (k % 32) // 2 * 32 + (n % 16) * 2 + k % 2
            assert flat[at] == q[n, k], (n, k)
    assert int((flat != 0).sum()) == N * K  # every other place is padding (q has no zeros)


@pytest.mark.skipif("amx" not in ISAS_HERE, reason="this CPU (or its kernel) runs no AMX tiles")
@pytest.mark.parametrize(("N", "K"), [(45, 70), (64, 64)])
def test_tiled_product_rows_are_within_the_bound_and_bitwise_alone(N, K):
    """The amx variant's bf16 product (``wiola_product_reps`` on a ``tile_matrix``): every row of
    batches of 1, 3, 12 and 13 (two passes of the tile unit's 10 rows) within one fp32 side's
    bound of float64 (each product exact, sums of K terms), and bitwise the same as that row
    multiplied alone. N = 45 ends in a part block of rows (padding), K = 70 in a part chunk of
    x's pieces (a masked load: nothing of x past K is read)."""
    model = wiola.fast.WiolaModel(SMALL).eval().requires_grad_(False)
    quantize(model, "bf16")
    step = decode_step_cpu.DecodeStepCPU(model, model.new_cache(1, 4), "amx")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    tiled = decode_step_cpu.tile_matrix(w)
    x = torch.randn(13, K, generator=gen) * torch.logspace(-3, 3, K)  # pieces of many magnitudes

    def product(rows: torch.Tensor) -> torch.Tensor:
        y = torch.full((1, rows.shape[0], N), float("nan"))
        # the rows followed by NaN: a read of x past the last row's K (into the padding of its last
        # chunk) would put NaN · 0 into the sums
        xs = torch.full((rows.numel() + 64,), float("nan"))
        xs[: rows.numel()] = rows.reshape(-1)
        rc = step.lib.wiola_product_reps(
            step.dims, tiled.data_ptr(), None, N, K, xs.data_ptr(), rows.shape[0], y.data_ptr(), 1, 1
        )
        assert rc == 0
        return y[0]

    alone = torch.stack([product(x[i : i + 1])[0] for i in range(13)])
    want = x.double() @ w.double().T
    # one fp32 side against float64 (numerics' probabilistic bound): sums of K exact products, and
    # the two adds of the three pieces' sums
    allowed = LAMBDA * math.sqrt(K + 2) * U32 * (x.double().abs() @ w.double().abs().T)
    assert_within(f"tiled product {N}x{K}", want, alone, allowed, "amx")
    for B in (3, 12, 13):
        got = product(x[:B])
        for i in range(B):
            assert torch.equal(got[i], alone[i]), f"amx: row {i} of {B} != the row alone ({N}x{K})"


def test_load_answers_from_its_cache_until_the_choice_changes(monkeypatch):
    """``load`` keeps its answer per ISA asked, ``WIOLA_CPU_ISA`` and compiler, and chooses again
    once the CPU features or the build it chose by are replaced (as a test that fakes a CPU does)."""
    compiler = decode_step_cpu._compiler()
    monkeypatch.delenv("WIOLA_CPU_ISA", raising=False)
    first = decode_step_cpu.load()
    assert decode_step_cpu.load() is first
    for isa in ISAS_HERE:
        monkeypatch.setenv("WIOLA_CPU_ISA", isa)
        assert decode_step_cpu.load() is decode_step_cpu._BUILDS[(compiler, isa)], isa
        assert decode_step_cpu.load(isa) is decode_step_cpu._BUILDS[(compiler, isa)], isa
    monkeypatch.delenv("WIOLA_CPU_ISA")
    assert decode_step_cpu.load() is first
    monkeypatch.setitem(decode_step_cpu._FEATURES, compiler, (frozenset(), "test"))  # no AVX2: portable
    assert decode_step_cpu.load() is decode_step_cpu._BUILDS[(compiler, "portable")]


def test_tuning_records_the_variant_the_step_builds(monkeypatch):
    """``tuning()`` (what every benchmark record holds) names the variant ``WIOLA_CPU_ISA`` forces,
    and the thread rule SPEC states: one thread per 2 MiB streamed."""
    for isa in ISAS_HERE:
        monkeypatch.setenv("WIOLA_CPU_ISA", isa)
        got = decode_step_cpu.tuning()
        assert got["isa"] == isa == decode_step_cpu.select_isa(), got
        assert got["bytes_per_thread"] == 2 << 20, got
    monkeypatch.delenv("WIOLA_CPU_ISA")
    assert decode_step_cpu.tuning()["isa"] == decode_step_cpu.select_isa()


def test_the_build_is_named_by_everything_it_depends_on(monkeypatch):
    """The cached library's name changes with the compiler's version, the CPU's flags and model
    name, and the variant, so a new compiler or another CPU (a VM moved to a host without AVX-512)
    builds again instead of loading a library made for another; a line that changes from boot to
    boot (the clock rate) does not."""
    cpu = {
        "lines": (
            "vendor_id\t: AuthenticAMD",
            "model name\t: AMD EPYC",
            "flags\t: avx2 fma avx512f",
            "cpu MHz\t: 2600.0",
        )
    }
    version = {"text": "g++ (GCC) 12.2.0\n"}
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[-1] == "--version":
            return subprocess.CompletedProcess(cmd, 0, stdout=version["text"], stderr="")
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(decode_step_cpu.subprocess, "run", run)
    monkeypatch.setattr(decode_step_cpu, "_cpuinfo_lines", lambda: cpu["lines"])

    def name(isa: str = "portable") -> str:
        return decode_step_cpu.library_path("g++", isa).name

    first = name()
    assert name() == first, "not a function of its inputs"
    cpu["lines"] = (*cpu["lines"][:3], "cpu MHz\t: 3000.0")
    assert name() == first, "a clock rate is not what the build depends on"
    changes = {
        "the compiler's version": lambda: version.update(text="g++ (GCC) 14.1.0\n"),
        "the CPU's flags": lambda: cpu.update(lines=(cpu["lines"][0], cpu["lines"][1], "flags\t: avx2 fma")),
        "the CPU's model name": lambda: cpu.update(
            lines=(cpu["lines"][0], "model name\t: Intel Xeon", *cpu["lines"][2:])
        ),
    }
    names = {first}
    for what, change in changes.items():
        change()
        assert name() not in names, f"{what} changed, and the build's name did not"
        names.add(name())
    assert name("avx2") not in names


@pytest.mark.parametrize(
    "sizes,want",
    [
        ((("Data", "32K"), ("Instruction", "32K"), ("Unified", "1024K"), ("Unified", "32768K")), 32 << 20),
        ((("Data", "48K"), ("Instruction", "64K"), ("Unified", "2M"), ("Unified", "260M")), 260 << 20),
        ((("Data", "32K"), ("Instruction", "4M")), 32 << 10),  # an instruction cache is not a data cache
        ((("Unified", "1G"),), 1 << 30),
        ((("Unified", "524288"),), 524288),  # no suffix: bytes
        ((), None),
    ],
)
def test_last_level_cache_size_from_sysfs(sizes, want, tmp_path):
    """The largest data or unified cache of a sysfs cache folder, whatever its units."""
    for i, (kind, size) in enumerate(sizes):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert decode_step_cpu.last_level_cache_bytes(tmp_path) == want


def test_settings_are_read_without_case_or_spaces(monkeypatch):
    """``WIOLA_CPU_ISA=" Portable "`` is the portable variant, for the model's check as for the step."""
    monkeypatch.setenv("WIOLA_CPU_ISA", " Portable ")
    wiola.fast.WiolaModel(SMALL)  # its check of the setting passes
    assert decode_step_cpu.select_isa() == "portable"


def test_forced_variant_runs_and_is_described(monkeypatch):
    """``WIOLA_CPU_ISA`` reaches the step bound by default and ``describe()``."""
    model = _model(SMALL)
    threads = torch.get_num_threads()
    for isa in ISAS_HERE:
        monkeypatch.setenv("WIOLA_CPU_ISA", isa)
        assert decode_step_cpu.DecodeStepCPU(model, model.new_cache(1, 4)).isa == isa
        assert decode_step_cpu.describe() == f"C++ step, {isa}, {threads} thread{'s' if threads != 1 else ''}"


def test_wiola_generate_names_the_path(plain_cpu, capsys, monkeypatch):
    """``wiola generate`` on a CPU prints the path that decodes to stderr, once: with torch on 16
    threads, the C++ step's own threads (one per ``bytes_per_thread`` of the tiny preset's
    matrices, fewer than 16); with ``WIOLA_FAST_KERNELS=off``, the PyTorch path and why."""
    from wiola.cli import main

    argv = ["generate", "--preset", "tiny", "--prompt", "Hi", "--max-new-tokens", "2", "--device", "cpu"]
    chosen = decode_step_cpu.choose_tuning(wiola.WiolaConfig.preset("tiny"))
    own = int(chosen["matrix_bytes"]) // int(chosen["bytes_per_thread"])
    assert 1 < own < 16, chosen  # the count tells the step's threads from torch's
    before = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        code = main(argv)
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert code == 0, err
    line = f"C++ step, {decode_step_cpu.select_isa()}, {own} threads"
    assert err.count("CPU decoding: ") == 1 and f"CPU decoding: {line}\n" in err, err

    # the variable is read when wiola.fast is imported: a new process, as a user runs it
    env = {**os.environ, "WIOLA_FAST_KERNELS": "off"}
    run = subprocess.run([sys.executable, "-m", "wiola", *argv], env=env, capture_output=True, text=True, timeout=300)
    off = "CPU decoding: PyTorch path: the model's kernels are off (WIOLA_FAST_KERNELS or use_kernels(False))\n"
    assert run.returncode == 0 and run.stderr.count("CPU decoding: ") == 1 and off in run.stderr, run.stderr

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels decode, on the CPU
    if wiola.fast.ops.kernels_usable(torch.empty(0)):
        assert main(argv) == 0
        assert "CPU decoding: Triton kernels (TRITON_INTERPRET=1)\n" in capsys.readouterr().err


def test_describe_cpu_decoding_names_what_keeps_the_step_off(plain_cpu):
    """``describe_cpu_decoding`` follows ``cpu_step_applies``' conditions that belong to the model: its
    switch, a feed-forward variant without a C++ step, a LoRA adapter; else the step's line."""
    from wiola.fast.quantize import quantize

    model = wiola.fast.WiolaModel(SMALL).eval()
    assert fast_ops.describe_cpu_decoding(model) == decode_step_cpu.describe(config=SMALL)
    int8 = quantize(wiola.fast.WiolaModel(SMALL).eval().requires_grad_(False), "int8")
    assert fast_ops.describe_cpu_decoding(int8) == decode_step_cpu.describe(config=SMALL, scheme="int8")
    assert "kernels are off" in fast_ops.describe_cpu_decoding(model.use_kernels(False))
    with pytest.warns(UserWarning, match="no fused kernel"):
        swiglu = wiola.fast.WiolaModel(dataclasses.replace(SMALL, ffn="swiglu"))
    assert fast_ops.describe_cpu_decoding(swiglu).startswith("PyTorch (wiola.fast: ffn='swiglu'")
    peft = pytest.importorskip("peft")
    lora = wiola.fast.WiolaModel(SMALL).eval()
    lora = peft.get_peft_model(lora, peft.LoraConfig(r=2, target_modules=["q_proj"])).base_model.model
    assert "LoRA adapter" in fast_ops.describe_cpu_decoding(lora)


# ------------------------------------------------------------------ use by wiola.fast


def _fast_pair(config: wiola.WiolaConfig) -> tuple[wiola.WiolaModel, wiola.fast.WiolaModel]:
    ref = _model(config)
    fast = wiola.fast.WiolaModel(config).eval()
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def test_fast_generate_uses_the_step_and_matches_reference(plain_cpu, monkeypatch):
    calls = count_step_calls(monkeypatch)
    loops = [0]
    original = decode_step_cpu.DecodeStepCPU.generate_loop

    def counted(self, *args, **kwargs):
        loops[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(decode_step_cpu.DecodeStepCPU, "generate_loop", counted)
    ref, fast = _fast_pair(VARIANTS["13m-shape"])
    ids, mask = left_padded_prompt(ref.config.vocab_size, 3, 17, 6)
    want = ref.generate(ids, 12, attention_mask=mask, temperature=0)
    got = fast.generate(ids, 12, attention_mask=mask, temperature=0)
    assert (loops[0], calls[0]) == (1, 0), f"{loops[0]} C++ loop calls and {calls[0]} steps for one greedy request"
    assert torch.equal(want, got), f"greedy tokens differ:\n{want}\n{got}"
    # eos: rows stop and are padded, as in the reference loop
    eos = int(want[0, 20])
    want = ref.generate(ids, 12, attention_mask=mask, temperature=0, eos_token_id=eos, pad_token_id=0)
    got = fast.generate(ids, 12, attention_mask=mask, temperature=0, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(want, got), f"greedy tokens with eos differ:\n{want}\n{got}"


def test_fast_forward_dispatch(plain_cpu, monkeypatch):
    """The step runs only for one-token, gradient-free fp32 CPU calls with a cache; the rest
    (chunks, masks, gradients, use_kernels(False)) keep the PyTorch path and still agree."""
    calls = count_step_calls(monkeypatch)
    ref, fast = _fast_pair(SMALL)
    ids, _ = left_padded_prompt(SMALL.vocab_size, 2, 9, 0)
    ref_cache, cache = ref.new_cache(2, 20), fast.new_cache(2, 20)
    with torch.no_grad():
        ref(ids, cache=ref_cache)
        fast(ids, cache=cache)  # a chunk of 9: PyTorch path
        assert calls[0] == 0
        tok = ids[:, :1]
        beside_reference("logits[step]", ref, lambda: ref(tok, cache=ref_cache), fast(tok, cache=cache).logits, 10)
        assert calls[0] == 1 and cache.length == 10
        ones = torch.ones(2, 11, dtype=torch.long)
        got = fast(tok, attention_mask=ones, cache=cache).logits
        beside_reference("logits[masked step]", ref, lambda: ref(tok, attention_mask=ones, cache=ref_cache), got, 11)
        with fast_ops.use_kernels(False):
            got = fast(tok, cache=cache).logits
            beside_reference("logits[kernels off]", ref, lambda: ref(tok, cache=ref_cache), got, 12)
    out = fast(tok, cache=cache)  # gradients on: autograd needs the PyTorch path
    assert out.logits.requires_grad
    assert calls[0] == 1, "the C++ step ran where it must not"
    with torch.no_grad():
        with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
            fast([[1], [2]], cache=cache)
        with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
            fast(torch.ones(2, 1), cache=cache)
        with pytest.raises(ValueError, match="token id 1000 is outside"):
            fast(torch.tensor([[1], [1000]]), cache=cache)
        full = fast.new_cache(2, 1)
        fast(tok, cache=full)
        with pytest.raises(ValueError, match="past the cache's max_len=1"):
            fast(tok, cache=full)


@torch.no_grad()
def test_fast_step_follows_weight_changes(plain_cpu):
    """In-place updates are read live; replaced or moved parameters rebind the step."""
    ref, fast = _fast_pair(SMALL)
    ids, _ = left_padded_prompt(SMALL.vocab_size, 1, 5, 0)
    cache = fast.new_cache(1, 20)

    def check(name: str) -> None:
        ref_cache = ref.new_cache(1, 20)
        ref(ids, cache=ref_cache)
        cache.reset()
        fast(ids, cache=cache)
        beside_reference(name, ref, lambda: ref(ids[:, :1], cache=ref_cache), fast(ids[:, :1], cache=cache).logits, 6)

    check("logits")
    for p, q in zip(ref.parameters(), fast.parameters()):
        p.mul_(1.5)
        q.mul_(1.5)
    check("logits after an in-place update")
    other = _model(SMALL, seed=11)
    ref.load_state_dict(other.state_dict())
    fast.load_state_dict(other.state_dict(), assign=True)
    check("logits after load_state_dict(assign=True)")


@torch.no_grad()
def test_is_current_sees_every_way_a_weight_changes(plain_cpu):
    """``is_current`` finds the model's tensors by path again only after some module attribute was
    set (torch's registration hooks): a parameter or block set anew, a parameter's
    ``.data`` swapped, a dtype round trip each make a binding stale; a parameter set anew on the
    same storage keeps it current, and a later move of that new parameter still makes it stale."""
    import copy

    from wiola.fast import step_layout

    _, fast = _fast_pair(SMALL)
    cache = fast.new_cache(1, 8)
    path = next(p for p, slot in step_layout.slots(SMALL.n_layers) if slot.matrix and p.startswith("layers.0."))
    owner, name = fast.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]

    def fresh() -> decode_step_cpu.DecodeStepCPU:
        step = decode_step_cpu.DecodeStepCPU(fast, cache)
        assert step.is_current() and step.is_current(), "a new binding is current"
        return step

    step = fresh()
    setattr(owner, name, torch.nn.Parameter(getattr(owner, name).detach().clone()))
    assert not step.is_current(), "a parameter set anew (another tensor)"
    step = fresh()
    setattr(owner, name, torch.nn.Parameter(getattr(owner, name).data))  # the same storage
    assert step.is_current(), "a parameter set anew on the same storage reads the same memory"
    getattr(owner, name).data = getattr(owner, name).data.clone()
    assert not step.is_current(), "the new parameter's data swapped (no registration)"
    step = fresh()
    fast.layers[0] = copy.deepcopy(fast.layers[0])
    assert not step.is_current(), "a block set anew"
    step = fresh()
    fast.double().float()
    assert not step.is_current(), "a dtype round trip moves every tensor"
    step = fresh()
    fast.norm.weight = torch.nn.Parameter(fast.norm.weight.detach().clone())
    assert not step.is_current(), "a norm's gain set anew"


def test_fallback_when_the_compiler_is_missing(plain_cpu, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setenv("WIOLA_CACHE_DIR", str(tmp_path))
    _reset(monkeypatch)
    monkeypatch.delitem(fast_ops.MISSING, "decode_step_cpu", raising=False)
    with pytest.warns(RuntimeWarning, match="`no-such-compiler-xyz` is not on PATH"):
        assert decode_step_cpu.load() is None
    assert "`no-such-compiler-xyz` is not on PATH" in decode_step_cpu.BUILD_ERROR
    ref, fast = _fast_pair(SMALL)
    ids, _ = left_padded_prompt(SMALL.vocab_size, 2, 6, 0)
    want = ref.generate(ids, 5, temperature=0)
    assert torch.equal(want, fast.generate(ids, 5, temperature=0)), "the PyTorch fallback differs"
    assert "no-such-compiler-xyz" in fast_ops.MISSING["decode_step_cpu"]


def test_build_failure_warns_once_naming_the_compiler_error(plain_cpu, monkeypatch, tmp_path):
    """A compiler that fails: one RuntimeWarning with its error on first use, however many
    steps follow; ``describe()`` names the PyTorch path and the error; decoding still agrees."""
    cxx = tmp_path / "failing-cxx"
    cxx.write_text("#!/bin/sh\necho 'failing-cxx: error: simulated failure 4321' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("WIOLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("WIOLA_CPU_ISA", raising=False)
    _reset(monkeypatch)
    monkeypatch.delitem(fast_ops.MISSING, "decode_step_cpu", raising=False)
    ref, fast = _fast_pair(SMALL)
    ids, _ = left_padded_prompt(SMALL.vocab_size, 2, 6, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fast.generate(ids, 5, temperature=0)
        got_again = fast.generate(ids, 5, temperature=0)
        line = decode_step_cpu.describe()
    ours = [w for w in caught if "C++ CPU decode step" in str(w.message)]
    assert len(ours) == 1, f"{len(ours)} build-failure warnings for 8 steps and a describe()"
    assert ours[0].category is RuntimeWarning
    assert "failing-cxx: error: simulated failure 4321" in str(ours[0].message)
    assert "exit status 1" in str(ours[0].message)
    assert line == "PyTorch path: the C++ step did not build (failing-cxx: error: simulated failure 4321)"
    want = ref.generate(ids, 5, temperature=0)
    assert torch.equal(want, got) and torch.equal(want, got_again), "the PyTorch fallback differs"
    assert not list((tmp_path / "cache").glob("*.so")), "a failed build left a library behind"


def test_compile_error_is_reported(monkeypatch, tmp_path):
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(decode_step_cpu, "SOURCE", bad)
    monkeypatch.setenv("WIOLA_CACHE_DIR", str(tmp_path / "cache"))
    _reset(monkeypatch)
    with pytest.warns(RuntimeWarning, match="broken.cpp"):
        assert decode_step_cpu.load() is None
    assert "failed" in decode_step_cpu.BUILD_ERROR and "broken.cpp" in decode_step_cpu.BUILD_ERROR
    assert decode_step_cpu.describe().startswith("PyTorch path: the C++ step did not build (")
    assert "error" in decode_step_cpu.describe()
    assert not list((tmp_path / "cache").glob("*.so")), "a failed build left a library behind"


# ------------------------------------------------------------------ the build cache
def test_build_cache_is_created_private(monkeypatch, tmp_path):
    cache = tmp_path / "new" / "cache"
    monkeypatch.setenv("WIOLA_CACHE_DIR", str(cache))
    _reset(monkeypatch)
    assert decode_step_cpu.load() is not None
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert len(list(cache.glob("decode_step_cpu-*.so"))) == 1


@pytest.mark.parametrize("how", ["other-owner", "world-writable", "group-writable", "tmp-fallback"])
def test_build_cache_others_can_write_is_refused(how, plain_cpu, monkeypatch, tmp_path):
    """A cache folder owned by another user, or one the group or others can write, is refused:
    the step is not built or loaded from it, ``describe()`` says why, and decoding falls back to
    the PyTorch path (the tests run as root, which can create another user's folder)."""
    cache = tmp_path / "cache"
    if how == "tmp-fallback":  # home unusable: $TMPDIR/wiola-<uid>, planted world-writable first
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
        (tmp_path / "a-file").write_text("not a folder")
        monkeypatch.delenv("WIOLA_CACHE_DIR", raising=False)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        cache = tmp_path / f"wiola-{os.getuid()}"
    else:
        monkeypatch.setenv("WIOLA_CACHE_DIR", str(cache))
    cache.mkdir(mode=0o700)
    if how == "other-owner":
        if os.getuid() != 0:
            pytest.skip("creating a folder owned by another uid needs root")
        os.chown(cache, 12345, 12345)
        match = f"owned by uid 12345, not by this user \\(uid {os.getuid()}\\)"
    else:
        mode = 0o770 if how == "group-writable" else 0o777
        os.chmod(cache, mode)  # past the umask
        match = f"its mode {mode:#o} lets other users write into it"
    _reset(monkeypatch)
    monkeypatch.delitem(fast_ops.MISSING, "decode_step_cpu", raising=False)
    with pytest.warns(RuntimeWarning, match=match):
        assert decode_step_cpu.load() is None
    assert f"refusing the build cache {cache}" in decode_step_cpu.BUILD_ERROR
    line = decode_step_cpu.describe()
    assert line.startswith(
        f"PyTorch path: the C++ step did not build (PermissionError: refusing the build cache {cache}"
    )
    assert not list(cache.iterdir()), "something was built into a refused folder"
    ref, fast = _fast_pair(SMALL)
    ids, _ = left_padded_prompt(SMALL.vocab_size, 2, 6, 0)
    assert torch.equal(ref.generate(ids, 5, temperature=0), fast.generate(ids, 5, temperature=0))
    assert "refusing the build cache" in fast_ops.MISSING["decode_step_cpu"]


def _load_in_a_process(env: dict[str, str]) -> Path:
    """The library ``load()`` gives a fresh process with ``env``: its path (the process exits 0)."""
    code = "from wiola.fast import decode_step_cpu as d; lib = d.load(); print(lib._name)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"load() in a fresh process: exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    return Path(proc.stdout.strip().splitlines()[-1])


def test_a_damaged_cached_library_is_built_again(tmp_path):
    """A cached library cut short or overwritten after its build (a full disk, a partial copy of
    the cache) fails its digest and is built again, never loaded: loading a cut-off one killed the
    process (SIGBUS inside dlopen). The compiler is given as a launcher and its program
    (``CXX="env g++"``, the form of ``ccache g++``): a fresh process finds the intact library
    under the name it computes, then builds a cut-off one again."""
    env = {**os.environ, "WIOLA_CACHE_DIR": str(tmp_path), "WIOLA_CPU_ISA": "portable"}
    env["CXX"] = f"env {decode_step_cpu._compiler()}"
    built = decode_step_cpu.cached_build("portable")  # the build cache of the test run's environment
    target = tmp_path / built.name
    for source in (built, decode_step_cpu._digest_path(built)):
        shutil.copyfile(source, tmp_path / source.name)
    whole, before = target.read_bytes(), target.stat()
    assert _load_in_a_process(env) == target
    after = target.stat()  # a build renames a new file over the old one: another inode
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "an intact library was built again"
    cut = whole[: len(whole) // 3]
    for damage in (b"", os.urandom(4096), whole[:-1] + bytes([whole[-1] ^ 1]), cut):
        target.write_bytes(damage)
        assert not decode_step_cpu._intact(target), f"a damaged library of {len(damage)} bytes passed as whole"
    assert _load_in_a_process(env) == target
    assert decode_step_cpu._intact(target) and target.stat().st_size > len(cut), "not built again"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc driver")
def test_a_c_compiler_driver_builds_a_loadable_step(tmp_path):
    """``CXX=gcc`` (the C driver, which does not link libstdc++ by itself) builds a library that
    loads: the build names libstdc++."""
    env = {**os.environ, "WIOLA_CACHE_DIR": str(tmp_path), "WIOLA_CPU_ISA": "portable", "CXX": "gcc"}
    assert decode_step_cpu._intact(_load_in_a_process(env))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch's thread count and OpenMP's default agree")
def test_the_step_takes_torchs_thread_count_in_a_new_thread():
    """A thread that has run no parallel torch op has OpenMP's default count (every core) until
    torch sets its own; the step's calls set it first, so ``torch.set_num_threads(1)`` holds there."""
    script = textwrap.dedent("""
        import threading, torch, wiola
        from wiola.fast import decode_step_cpu as d
        torch.set_num_threads(1)
        config = wiola.WiolaConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8)
        model = wiola.WiolaModel(config).eval()
        step = d.DecodeStepCPU(model, model.new_cache(1, 4))
        seen = []
        def worker():
            step(torch.tensor([1]), 0)
            seen.append(step.lib.wiola_sample_scratch_floats(1) // 4)  # 4 * V * omp_get_max_threads() here
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        print(seen[0])
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "1", f"the step ran {proc.stdout.split()[-1]} OpenMP threads, torch's count is 1"


def test_build_cache_paths_as_users_write_them(monkeypatch, tmp_path):
    """``WIOLA_CACHE_DIR`` with ``~`` (as a service file or a Docker ENV writes it) is the home's;
    one naming a file is refused as not a folder, naming the variable; a relative
    ``XDG_CACHE_HOME`` is ignored, as the XDG spec says."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WIOLA_CACHE_DIR", "~/wiola-cache")
    assert decode_step_cpu._cache_dir() == tmp_path / "wiola-cache"
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("WIOLA_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.raises(PermissionError, match=r"a-file is not a folder; choose another WIOLA_CACHE_DIR"):
        decode_step_cpu._cache_dir()
    monkeypatch.delenv("WIOLA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert decode_step_cpu._cache_dir() == tmp_path / ".cache" / "wiola"


@pytest.mark.parametrize(
    "env,value,allowed",
    [
        ("WIOLA_FAST_KERNELS", "maybe", "1, true, yes, on"),
        ("WIOLA_CPU_ISA", "sse", "auto, amx, avx512, avx2, portable"),
        ("WIOLA_CPU_PREFILL", "garbage", "auto, fp32, bf16"),
        ("WIOLA_CPU_GEMM", "mkl", "auto, measure, aten, onednn"),
    ],
)
def test_a_mistyped_setting_is_named_when_the_model_is_made(env, value, allowed, monkeypatch):
    """Whether or not this model's calls would read it (a one-token prompt reads no prefill mode,
    a GPU no CPU variant), a setting no path takes is named when the fast model is made."""
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=rf"{env}='{value}' is not one of {allowed}"):
        wiola.fast.WiolaModel(SMALL)


@pytest.mark.parametrize("value,on", [("", True), ("1", True), ("On", True), ("false", False), (" OFF ", False)])
def test_fast_kernels_setting_reads_words(value, on, monkeypatch):
    monkeypatch.setenv("WIOLA_FAST_KERNELS", value)
    assert fast_ops.kernels_setting() is on


@torch.inference_mode()
@pytest.mark.parametrize("where,fraction", [("embed.weight", 0.01), ("layers.1.ffn.down_proj.weight", 0.5)])
def test_bound_catches_a_perturbed_weight(where, fraction, isa):
    """The error bound is tight enough to fail on a real defect: a single weight of the step's
    model off by ``fraction`` of its matrix's largest weight (a wrong int4 nibble is off by 1/7 of
    the group's largest, in every row) is caught, while the same comparison on the unperturbed
    weights passes (the unperturbed step measured at ~2% of the bound here)."""
    config = VARIANTS["13m-shape"]
    model = _model(config)
    ref = wiola.WiolaModel(config).eval()
    ref.load_state_dict(model.state_dict())
    ids, _ = left_padded_prompt(config.vocab_size, 2, 9, 0)
    for perturb in (False, True):
        if perturb:
            w = dict(model.named_parameters())[where]
            row = int(ids[0, 0]) if where == "embed.weight" else 0  # a row the step reads
            w[row, 0] += fraction * w.abs().max()
        ref_cache, cache = ref.new_cache(2, 13), model.new_cache(2, 13)
        ref(ids, cache=ref_cache)
        ref(ids, cache=cache)
        step = decode_step_cpu.DecodeStepCPU(model, cache, isa=isa)
        if not perturb:
            step_beside(ref, ref_cache, step, cache, 4, "logits")
        else:
            with pytest.raises(AssertionError, match="exceeds the fp32 error bound"):
                step_beside(ref, ref_cache, step, cache, 4, "logits")


# ------------------------------------------------------------------------- the prompt's attention
@pytest.mark.parametrize("case", PROMPT_CASES, ids=lambda c: "B{}-T{}-H{}-D{}-S{}-start{}-pad{}".format(*c))
def test_prompt_attention_matches_float64(case, isa):
    """The C++ prompt attention's output and cache writes against the float64 oracle, within the
    error bound; padding slots and every slot past the prompt hold NaN, which it must not read;
    the same oracle with the causal mask off by one lies outside the bound (the test can fail)."""
    B, T, H, D, S, start, pad = case
    inputs = prompt_inputs(*case)
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = inputs
    unread = ~key_mask.clone()  # padding and every slot past start + T
    kc, vc = k_cache.clone(), v_cache.clone()
    for buf in (kc, vc):
        buf.masked_fill_(unread[:, None, :, None], float("nan"))
    with torch.inference_mode():
        got = decode_step_cpu.decode_attention(q, k, v, g, cos, sin, kc, vc, key_mask, start, isa=isa)
    assert got is not None, "the C++ prompt attention did not apply"
    want, allowed, real = check_prompt_attention(f"prompt attention {case}", inputs, start, got, kc, vc, isa)
    untouched = unread.clone()
    untouched[:, start : start + T] = False  # the new slots are written, padding or not (as the reference)
    for name, buf in (("key", kc), ("value", vc)):
        assert torch.isnan(buf[untouched[:, None, :, None].expand_as(buf)]).all(), (
            f"a {name} slot outside the prompt was written"
        )
    # a causal mask off by one: a slot too far (a single query has none past its own: one too few)
    off_by_one = prompt_oracle(*inputs, start, reach=1 if T > 1 else -1)[0]
    assert bool(((off_by_one - want).abs() > allowed)[real].any()), "the bound cannot tell a causal mask off by one"


def _divide(x: torch.Tensor, d: float, exact: bool, isa: str) -> tuple[int, torch.Tensor]:
    """The library's ``wiola_divide`` of ``x`` by ``d`` (``exact``: ``quotient`` alone): its status
    and the quotients."""
    lib = decode_step_cpu.load(isa)
    x = x.contiguous()
    out = torch.full_like(x, float("nan"))
    status = lib.wiola_divide(x.data_ptr(), x.numel(), d, int(exact), out.data_ptr())
    return status, out


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where ``got`` holds ``want``'s bits (any NaN for a NaN: the payload is not compared)."""
    both_nan = torch.isnan(got) & torch.isnan(want)
    return (got.view(torch.int32) == want.view(torch.int32)) | both_nan


def test_divide_is_the_division(isa):
    """The prompt attention's division (``divide``: Markstein's quotient from ``1/d``, where every
    lane and ``d`` lie in its domain, else the division) gives the division's bits: the quotient
    alone on its stated domain (``|x|`` in ``[2^-100, 2^100]`` or ``+0``, ``d`` in ``[2^-20, 2^20]``:
    random significands and exponents, significands of all ones, powers of two, both ends), and
    ``divide`` on anything (zeros of both signs, subnormals, values past the domain, infinities,
    NaN, divisors outside it); a quotient without its correction (``x · RN(1/d)``) differs from the
    division on the same sample, so the comparison can fail."""
    gen = torch.Generator().manual_seed(7)
    n = 1 << 16
    significand = 1.0 + torch.rand(n, generator=gen, dtype=torch.float64)
    exponent = torch.randint(-100, 100, (n,), generator=gen).double()
    x = (significand * torch.exp2(exponent)).float()
    x = torch.where(torch.rand(n, generator=gen) < 0.5, x, -x)
    edges = [2.0**-100, -(2.0**-100), 2.0**100, -(2.0**100), 0.0, 1.0, 1.9999999, 1.5, 3.0, 2.0**-99 * 1.9999999]
    x = torch.cat([torch.tensor(edges, dtype=torch.float32), x])
    divisors = [
        2.0**-20,
        2.0**20,
        1.0,
        1.9999999,
        1.0000001,
        3.0,
        7.0,
        *(float(D) ** 0.5 for D in (10, 16, 32, 40, 64, 128)),
    ]
    logs = torch.empty(64, dtype=torch.float64).uniform_(-20.0, 20.0, generator=gen)
    divisors += [float(torch.exp2(e).float()) for e in logs]
    naive_wrong = 0
    for d in divisors:
        want = x / torch.tensor(d, dtype=torch.float32)
        status, got = _divide(x, d, True, isa)
        if isa == "portable":
            assert status == 1, "the portable variant has no vector FMA: quotient must not claim exactness"
        else:
            assert status == 0, f"{isa}: d={d!r} refused, though inside [2^-20, 2^20]"
            bad = ~_same_bits(got, want)
            assert not bad.any(), (
                f"{isa}: quotient(x, {d!r}) differs from x / d at x={x[bad][:4].tolist()}: "
                f"{got[bad][:4].tolist()} against {want[bad][:4].tolist()}; {platform_line(isa)}"
            )
        naive = x * torch.tensor(1.0 / torch.tensor(d, dtype=torch.float32).item(), dtype=torch.float32)
        naive_wrong += int((~_same_bits(naive, want)).sum())
    assert naive_wrong > 0, "x times 1/d never differed from x / d: the sample cannot tell the correction is there"
    hostile = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-45, 2.0**-101, 2.0**101, 3e38, float("inf"), float("-inf"), float("nan"), 1.0, -2.5],
        dtype=torch.float32,
    )
    mixed = torch.cat([x[:64], hostile, x[64:200], hostile.flip(0)])  # hostile lanes in vectors of plain ones
    for d in [*divisors[:12], 1e-30, 1e30, 2.0**21, 2.0**-21, float("inf"), float("nan"), 0.0, -3.0]:
        want = mixed / torch.tensor(d, dtype=torch.float32)
        status, got = _divide(mixed, d, False, isa)
        assert status == 0
        bad = ~_same_bits(got, want)
        assert not bad.any(), f"{isa}: divide(x, {d!r}) differs from x / d at x={mixed[bad][:4].tolist()}"
        if not (2.0**-20 <= d <= 2.0**20):
            assert _divide(mixed, d, True, isa)[0] == 1, f"{isa}: quotient claimed exact for d={d!r}"


@pytest.mark.parametrize("D", [32, 40, 10])
def test_prompt_attention_batch_and_threads_bitwise(isa, D):
    """A row's outputs and cached keys are bitwise the same alone and as row 1 of 3, and on 1, 2
    or 3 threads: every number a query gets is independent of the batch, tile and thread (head
    widths that are and are not a multiple of the vectors' lanes)."""
    B, T, H, S, start = 3, 45, 2, 60, 7
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = prompt_inputs(B, T, H, D, S, start, 0, seed=4)
    runs = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            kc = k_cache.clone()
            out = decode_step_cpu.decode_attention(q, k, v, g, cos, sin, kc, v_cache.clone(), key_mask, start, isa=isa)
            runs[f"{n} threads"] = (out[1], kc[1])
        row = slice(1, 2)
        kc = k_cache[row].clone()
        one = (q[row], k[row], v[row], g[row], cos[row], sin[row])
        out = decode_step_cpu.decode_attention(*one, kc, v_cache[row].clone(), key_mask[row], start, isa=isa)
        runs["alone"] = (out[0], kc[0])
    finally:
        torch.set_num_threads(threads)
    first = runs["1 threads"]
    for name, (out, keys) in runs.items():
        assert torch.equal(out, first[0]) and torch.equal(keys, first[1]), f"{isa} D={D}: row 1 {name} != on 1 thread"


@pytest.mark.parametrize("queries", [1, 7, 9, 45])
def test_prompt_attention_of_the_last_queries_is_bitwise_the_full_ones(isa, queries):
    """``queries=n``: the last ``n`` outputs of the full call bitwise (each query's numbers do not
    depend on the tile it sits in, so fewer queries change none of them) and the same cache
    written, with left padding and after cached tokens; the name of the problem for ``n`` past ``T``."""
    B, T, H, D, S, start = 3, 45, 2, 32, 60, 7
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = prompt_inputs(B, T, H, D, S, start, 5, seed=9)
    runs = {}
    for n in (None, queries):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = decode_step_cpu.decode_attention(q, k, v, g, cos, sin, kc, vc, key_mask, start, queries=n, isa=isa)
        runs[n] = (out, kc, vc)
    out, kc, vc = runs[queries]
    assert out.shape == (B, queries, H, D)
    assert torch.equal(out, runs[None][0][:, T - queries :]), (
        f"{isa}: the last {queries} queries differ from the full call"
    )
    assert torch.equal(kc, runs[None][1]) and torch.equal(vc, runs[None][2]), f"{isa}: another cache written"
    with pytest.raises(ValueError, match="queries=46"):
        decode_step_cpu.decode_attention(q, k, v, g, cos, sin, k_cache.clone(), v_cache.clone(), key_mask, start,
                                         queries=T + 1, isa=isa)  # fmt: skip


def test_prompt_attention_declines_what_it_does_not_cover():
    """None (the caller's PyTorch path) for other dtypes, a tensor start, a cache of other rows
    and a start whose T positions do not all fit in the cache (nothing written); any head width
    applies, and a single token (a step the C++ step does not take: a model with adapters)."""
    inputs = list(prompt_inputs(1, 5, 2, 32, 8, 0, 0))
    assert decode_step_cpu.decode_attention(*inputs, 0) is not None
    assert decode_step_cpu.decode_attention(*inputs, 3) is not None, "the last 5 of 8 slots declined"
    for start in (4, -1):
        caches = [t.clone() for t in inputs[6:8]]
        assert decode_step_cpu.decode_attention(*inputs, start) is None, f"start {start} of 5 positions in 8 slots"
        assert all(torch.equal(a, b) for a, b in zip(caches, inputs[6:8])), f"start {start}: the cache was written"
    odd = list(prompt_inputs(1, 5, 2, 38, 8, 0, 0))
    assert decode_step_cpu.decode_attention(*odd, 0) is not None, "D 38 declined"
    one = list(prompt_inputs(1, 1, 2, 32, 8, 0, 0))
    assert decode_step_cpu.decode_attention(*one, 0) is not None, "T 1 declined"
    half = [t.double() if t.is_floating_point() else t for t in inputs]
    assert decode_step_cpu.decode_attention(*half, 0) is None, "float64 applied"
    assert decode_step_cpu.decode_attention(*inputs, torch.tensor(0)) is None, "a tensor start applied"
    wide = [*inputs[:6], torch.zeros(2, 2, 8, 32), torch.zeros(2, 2, 8, 32), torch.ones(2, 8, dtype=torch.bool)]
    assert decode_step_cpu.decode_attention(*wide, 0) is None, "a cache of 2 rows applied to 1"


@pytest.mark.parametrize("rows,d,residual", [(7, 256, True), (300, 256, True), (9, 40, False), (3, 5, True)])
def test_rms_norm_rows_matches_float64(rows, d, residual, isa):
    """The C++ RMSNorm of the prompt (``decode_step_cpu.rms_norm``) against float64: ``h = x +
    residual`` equals fp32's sum bitwise; each output within λu(√(2d)/2 + 6) of its value (the
    mean of d squares, then the add of eps, square root, reciprocal and two products), on rows
    from 1e-3 (eps matters) to 1e3, widths with and without a SIMD tail; the same bound misses a
    mean over d - 1 elements and a dropped eps (it can fail)."""
    x = rows_inputs(rows, d, seed=d)
    r = rows_inputs(rows, d, seed=d + 1) if residual else None
    w = torch.randn(d, generator=torch.Generator().manual_seed(3))
    eps = 1e-6
    got = decode_step_cpu.rms_norm(x, w, eps, r, isa=isa)
    assert got is not None, f"{isa}: the C++ RMSNorm did not apply"
    out, h = got if residual else (got, x)
    want, allowed = check_rms_norm(f"rms_norm rows {rows}x{d}", x, r, w, eps, out, h, isa)
    assert ((rms_norm_oracle(h, w, eps, n=d - 1) - want).abs() > allowed).any(), (
        "the bound cannot tell a mean over d - 1"
    )
    assert ((rms_norm_oracle(h, w, 0.0) - want).abs() > allowed).any(), "the bound cannot tell a dropped eps"


@pytest.mark.parametrize("rows,F", [(300, 512), (5, 37), (2, 3)])
def test_silu_gate_rows_matches_float64(rows, F, isa):
    """The butterfly's middle in C++ (``decode_step_cpu.silu_gate``): ``SiLU(a) ⊙ b + c`` against
    float64 within u(6|SiLU(a) b| + 2|SiLU(a) b + c|) (e^-|x| within 7.9e-8, an add, a division
    and three products; the final add) plus 1.1e-36|b| where e^-|x| underflows (|x| e^-|x| below
    it past -87.34), over inputs from 1e-3 to 1e3 and past ±87, with and without a SIMD tail; a
    sigmoid of the wrong sign lies outside the bound."""
    up = rows_inputs(rows, 2 * F, seed=F)
    c = rows_inputs(rows, F, seed=F + 1)
    got = decode_step_cpu.silu_gate(up, c, isa=isa)
    assert got is not None, f"{isa}: the C++ SiLU gate did not apply"
    want, allowed = check_silu_gate(f"silu gate rows {rows}x{F}", up, c, got, isa)
    wrong = silu_gate_oracle(up, c, sign=-1.0)[0]
    assert ((wrong - want).abs() > allowed).any(), "the bound cannot tell a sigmoid of the wrong sign"


def test_row_functions_batch_and_threads_bitwise(isa):
    """A row's RMSNorm and SiLU gate are bitwise the same alone and within 300 rows (two threads'
    share each), on 1 or 2 threads."""
    x, r, up, c = (rows_inputs(300, n, seed=n) for n in (256, 257, 1024, 512))
    x, r = x, r[:, :256].contiguous()
    w = torch.randn(256, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    runs = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, h = decode_step_cpu.rms_norm(x, w, 1e-6, r, isa=isa)
            runs[f"{n} threads"] = (out[150], h[150], decode_step_cpu.silu_gate(up, c, isa=isa)[150])
        out, h = decode_step_cpu.rms_norm(x[150:151], w, 1e-6, r[150:151], isa=isa)
        runs["alone"] = (out[0], h[0], decode_step_cpu.silu_gate(up[150:151], c[150:151], isa=isa)[0])
    finally:
        torch.set_num_threads(threads)
    first = runs["1 threads"]
    for name, got in runs.items():
        for what, a, b in zip(("rms_norm", "h", "silu_gate"), got, first):
            assert torch.equal(a, b), f"{isa}: row 150's {what} {name} != on 1 thread"


def _gate_inputs(B, T, H, D, *, rotate, pad, carry, seed=0):
    """``gate_oracle.make_inputs`` as plain CPU tensors: q (a strided view of the fused projection),
    the weights, cos and sin (or None), a left-padding mask (or None), the carry (or None)."""
    qkv, weights, mask, rope, state = make_inputs(
        B, T, H, D, pad="left" if pad else "none", rotate=rotate, carry=carry, seed=seed
    )
    q = qkv.detach().cpu().unbind(2)[0]
    w1, w2, b2 = (w.detach().cpu() for w in weights)
    cos, sin = (rope[k].cpu() for k in ("cos", "sin")) if rope else (None, None)
    state = None if state is None else (state[0].detach().cpu(), state[1].cpu())
    return q, (w1, w2, b2), cos, sin, None if mask is None else mask.cpu(), state


GATE_CASES = [
    (3, 37, 8, 32, False, True, False),
    (2, 23, 4, 16, True, True, False),
    (3, 40, 4, 32, True, True, True),
    (1, 1, 8, 32, False, False, True),  # a decoding step's gate
    (2, 300, 8, 32, False, True, True),  # enough positions for 2 and 3 threads to share them
]


@pytest.mark.parametrize(
    "B,T,H,D,rotate,pad,carry", GATE_CASES, ids=lambda v: str(v) if not isinstance(v, bool) else ("y" if v else "n")
)
def test_gate_within_its_bound_and_each_row_bitwise_alone(isa, B, T, H, D, rotate, pad, carry):
    """``decode_step_cpu.gate`` (the step's own gate, position by position: what the fast model's
    CPU prompt runs) within its first-order fp32 bound of the float64 formulas, with and without
    rotation, left padding and a carry (and not a gate with a row of W1 off by 10⁻³); the count as
    the formulas give it; each row's gates bitwise the same alone, within the batch on 1, 2 or 3
    threads, and in two chunks with the carry between them."""
    q, (w1, w2, b2), cos, sin, mask, state = _gate_inputs(B, T, H, D, rotate=rotate, pad=pad, carry=carry)
    got = decode_step_cpu.gate(q, w1, w2, b2, cos, sin, mask, state, isa=isa)
    assert got is not None, f"{isa}: the C++ gate did not apply"
    g, total, count = got
    want, _, allowed = gate_float64(q, w1, w2, b2, cos, sin, mask, state)
    assert_within(f"gate {B}x{T}x{H}x{D}", want, g, allowed, isa)
    off = w1.clone()
    off[0] *= 1 + 1e-3
    wrong = decode_step_cpu.gate(q, off, w2, b2, cos, sin, mask, state, isa=isa)[0]
    assert ((wrong.double() - want).abs() > allowed).any(), "the bound cannot tell a row of W1 off by 1e-3"
    real = mask.sum(1) if mask is not None else torch.full((B,), T)
    assert torch.equal(count, real + (state[1] if state is not None else 0)), f"{isa}: count {count.tolist()}"
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(decode_step_cpu.gate(q, w1, w2, b2, cos, sin, mask, state, isa=isa)[0], g), (
                f"{isa}: other gates on {n} threads"
            )
    finally:
        torch.set_num_threads(threads)
    for b in range(B):
        row = slice(b, b + 1)
        pick = (
            None if cos is None else cos[row], None if sin is None else sin[row], None if mask is None else mask[row],
            None if state is None else (state[0][row], state[1][row]),
        )  # fmt: skip
        alone = decode_step_cpu.gate(q[row], w1, w2, b2, *pick, isa=isa)
        assert torch.equal(alone[0][0], g[b]) and torch.equal(alone[1][0], total[b]), (
            f"{isa}: row {b}'s gates alone differ from the same row among {B}; {platform_line(isa)}"
        )
    if T > 1:
        cut = T // 2 + 1
        part = lambda t, i: None if t is None else t[:, i]
        first = decode_step_cpu.gate(q[:, :cut], w1, w2, b2, part(cos, slice(0, cut)), part(sin, slice(0, cut)),
                                     part(mask, slice(0, cut)), state, isa=isa)  # fmt: skip
        second = decode_step_cpu.gate(q[:, cut:], w1, w2, b2, part(cos, slice(cut, None)), part(sin, slice(cut, None)),
                                      part(mask, slice(cut, None)), first[1:], isa=isa)  # fmt: skip
        assert torch.equal(torch.cat([first[0], second[0]], 1), g) and torch.equal(second[1], total), (
            f"{isa}: the gate in two chunks differs from one pass"
        )


def test_gate_declines_what_it_does_not_cover():
    """None (the caller's PyTorch path) for float64, a copy of q laid out otherwise, mismatched
    weights or tables, a mask or carry of another shape."""
    q, (w1, w2, b2), cos, sin, mask, state = _gate_inputs(2, 5, 4, 16, rotate=True, pad=True, carry=True)
    assert decode_step_cpu.gate(q, w1, w2, b2, cos, sin, mask, state) is not None
    assert decode_step_cpu.gate(q.double(), w1.double(), w2.double(), b2.double()) is None, "float64 applied"
    assert decode_step_cpu.gate(q.transpose(2, 3), w1, w2, b2) is None, "heads of another stride applied"
    assert decode_step_cpu.gate(q, w1[:, :8].contiguous(), w2, b2) is None, "w1 of another width applied"
    assert decode_step_cpu.gate(q, w1, w2, b2, cos) is None, "cos without sin applied"
    assert decode_step_cpu.gate(q, w1, w2, b2, cos[:, :3].contiguous(), sin[:, :3].contiguous()) is None, "short tables"
    assert decode_step_cpu.gate(q, w1, w2, b2, None, None, mask[:, :3]) is None, "a mask of another length applied"
    assert decode_step_cpu.gate(q, w1, w2, b2, None, None, None, (state[0][:1], state[1][:1])) is None, "a short carry"


PRODUCT_SHAPES = [(1, 256, 768), (12, 40, 301), (64, 256, 1024), (300, 72, 33), (200, 32, 8)]


@pytest.mark.parametrize("M,K,N", PRODUCT_SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in PRODUCT_SHAPES])
def test_product_within_the_bound_and_each_row_bitwise_alone(isa, M, K, N):
    """``decode_step_cpu.product`` (the step's own product, which the fast model's CPU products of
    at most 64 positions a sequence run on) within λ·√K·u·Σ|w·x| of the float64 product, rows of
    magnitudes 1e-3 to 1e3; each row bitwise the same alone, within any run of rows at any offset,
    and on 1, 2 or 3 threads."""
    x = rows_inputs(M, K, seed=K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)) / K**0.5
    got = decode_step_cpu.product(x, w, isa=isa)
    assert got is not None and got.shape == (M, N), f"{isa}: the C++ product did not apply"
    want = x.double() @ w.double().T
    allowed = LAMBDA * K**0.5 * U32 * (x.double().abs() @ w.double().abs().T)
    assert_within(f"product {M}x{K}x{N}", want, got, allowed, isa)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(decode_step_cpu.product(x, w, isa=isa), got), f"{isa}: other numbers on {n} threads"
    finally:
        torch.set_num_threads(threads)
    for start, rows in ((0, 1), (M - 1, 1), (M // 3, max(1, M // 2)), (1, M - 1)):
        if rows < 1 or start + rows > M:
            continue
        alone = decode_step_cpu.product(x[start : start + rows].contiguous(), w, isa=isa)
        assert torch.equal(alone, got[start : start + rows]), (
            f"{isa}: rows {start}..{start + rows} alone differ from the same rows among {M}; {platform_line(isa)}"
        )


def test_product_declines_what_it_does_not_cover():
    """None (the caller's PyTorch path) for other dtypes, non-contiguous tensors, mismatched K, no rows."""
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    assert decode_step_cpu.product(x, w) is not None
    assert decode_step_cpu.product(x.double(), w.double()) is None, "float64 applied"
    assert decode_step_cpu.product(torch.randn(8, 4).t(), w) is None, "a transposed x applied"
    assert decode_step_cpu.product(x, torch.randn(8, 5).t()) is None, "a transposed weight applied"
    assert decode_step_cpu.product(x, torch.randn(5, 7)) is None, "K 8 against 7 applied"
    assert decode_step_cpu.product(torch.randn(0, 8), w) is None, "no rows applied"
    assert decode_step_cpu.product(x.view(2, 2, 8), w) is None, "a 3-D x applied"


def test_row_functions_decline_what_they_do_not_cover():
    """None (the caller's PyTorch path) for other dtypes, non-contiguous tensors, a weight or a
    residual of another shape, halves that do not pair."""
    x, w, up, c = torch.randn(4, 8), torch.randn(8), torch.randn(4, 16), torch.randn(4, 8)
    assert decode_step_cpu.rms_norm(x, w, 1e-6) is not None and decode_step_cpu.silu_gate(up, c) is not None
    assert decode_step_cpu.rms_norm(x.double(), w.double(), 1e-6) is None, "float64 applied"
    assert decode_step_cpu.rms_norm(x.t(), torch.randn(4), 1e-6) is None, "a transposed x applied"
    assert decode_step_cpu.rms_norm(x, torch.randn(7), 1e-6) is None, "a weight of 7 applied to rows of 8"
    assert decode_step_cpu.rms_norm(x, w, 1e-6, torch.randn(4, 1)) is None, "a residual of another shape applied"
    assert decode_step_cpu.silu_gate(up, torch.randn(4, 7)) is None, "halves of 8 applied to a width of 7"
    assert decode_step_cpu.silu_gate(up.double(), c.double()) is None, "float64 applied"
    assert decode_step_cpu.silu_gate(torch.randn(16, 4).t(), c) is None, "a transposed up applied"


@torch.inference_mode()
@pytest.mark.parametrize("chunks", [(40,), (17, 1, 22)], ids=lambda c: "+".join(map(str, c)))
def test_fast_prompt_uses_cpp_attention_and_matches_float64_oracle(chunks, plain_cpu, monkeypatch):
    """wiola.fast on a plain CPU: a left-padded prompt with a cache, whole or in chunks, runs the
    C++ prompt attention, RMSNorm and SiLU gate in every layer for each chunk, the chunk of one
    included (with an attention mask the one-token step does not take it, and a step on ATen's
    SDPA and norms would follow the batch), and its logits lie within the model's error bound of
    the float64 oracle."""
    from f64_reference import forward_row

    config = dataclasses.replace(SMALL, n_heads=4)  # D 16
    model = _model(config, seed=5)
    fast = wiola.fast.WiolaModel(config).eval()
    fast.load_state_dict(model.state_dict())
    calls: dict[str, int] = {}

    def counted(name):
        real_fn = getattr(decode_step_cpu, name)

        def call(*a, **kw):
            out = real_fn(*a, **kw)
            calls[name] = calls.get(name, 0) + (out is not None)
            return out

        monkeypatch.setattr(decode_step_cpu, name, call)

    for name in ("decode_attention", "rms_norm", "silu_gate"):
        counted(name)
    ids, mask = left_padded_prompt(config.vocab_size, 3, sum(chunks), 9)
    cache, pieces, at = fast.new_cache(3, 48), [], 0
    for n in chunks:
        pieces.append(fast(ids[:, at : at + n], attention_mask=mask[:, : at + n], cache=cache).logits)
        at += n
    got = torch.cat(pieces, dim=1)
    prompts = len(chunks)
    L = config.n_layers
    expected = {"decode_attention": L * prompts, "rms_norm": (2 * L + 1) * prompts, "silu_gate": L * prompts}
    assert calls == expected, f"the C++ prompt functions ran {calls} times, not {expected}"
    state = model.state_dict()
    want = [forward_row(state, config, ids[b].tolist(), mask[b].bool().tolist()) for b in range(3)]
    with AbsSums(model) as sums:
        model(ids, attention_mask=mask)
    allowed = bound(config, ids.shape[1], sums.head, sides=1)
    for b in range(3):
        real = mask[b].bool()
        assert_within(f"row {b} logits vs float64 ({chunks})", want[b][real], got[b][real].double(), allowed[b][real])
