"""The C++ CPU decode step on ARM64, without ARM hardware: ``tests/arm/harness.cpp`` (which
includes ``wiola/fast/decode_step_cpu.cpp`` whole) is cross-compiled for aarch64 with Debian's
``g++-aarch64-linux-gnu`` in the ``portable`` variant, whose 4-lane GCC vectors become NEON there
(checked in the disassembly), and run under ``qemu-user`` (``qemu-aarch64``, two OpenMP threads)
on files this test writes: the weights (fp32, bf16, int8 with per-row scales, or int4 with group scales), the cache after
a prefill and the tokens of a few steps. The oracle is the reference ``wiola.WiolaModel`` on the
same (dequantized) weights, run here on x86: the ARM logits of every step and the cache it wrote
equal it to fp32 rounding, as on x86 (``tests/test_quantize.py``). The same harness runs the
prompt's C++ functions (attention over the cache, RMSNorm rows, the SiLU gate) against their
float64 oracles within the x86 tests' bounds (``cpu_prompt_oracle``).

Skips, saying which, only when the cross compiler or qemu is absent (``.ci/run`` installs both).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from cpu_prompt_oracle import (
    PROMPT_CASES,
    check_prompt_attention,
    check_rms_norm,
    check_silu_gate,
    prompt_inputs,
    rows_inputs,
)
from generator_states import crafted, hard_units
from numerics import LAMBDA, U32, AbsSums, assert_within, bound, cache_bound, reference_on

import wiola
import wiola.fast
from wiola.fast.quantize import GROUP, quantize

decode_step_cpu = pytest.importorskip("wiola.fast.decode_step_cpu")
ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "arm" / "harness.cpp"
CROSS_CXX = "aarch64-linux-gnu-g++"
CROSS_OBJDUMP = "aarch64-linux-gnu-objdump"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # the cross toolchain's libc, libstdc++ and libgomp

ODD = wiola.WiolaConfig(vocab_size=301, d_model=40, n_layers=2, n_heads=4, d_ff=72, max_seq_len=320)
VARIANTS = {"odd": ODD, "no-gate": dataclasses.replace(ODD, gate=False)}


@pytest.fixture(scope="module")
def arm_harness(tmp_path_factory) -> Path:
    """The harness built for aarch64 with the product's flags (less -shared -fPIC) and the
    portable variant's."""
    missing = [tool for tool in (CROSS_CXX, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not installed: the ARM proof needs Debian's g++-aarch64-linux-gnu "
            "and qemu-user (apt-get install -y g++-aarch64-linux-gnu qemu-user)"
        )
    flags = [f for f in decode_step_cpu.FLAGS if f not in ("-shared", "-fPIC")]
    out = tmp_path_factory.mktemp("arm") / "harness"
    cmd = [CROSS_CXX, *flags, *decode_step_cpu.ISA_FLAGS["portable"], f"-I{ROOT}", str(HARNESS), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"`{' '.join(cmd)}` failed:\n{proc.stderr[-3000:]}"
    return out


def test_portable_variant_compiles_to_neon(arm_harness):
    """On aarch64 the portable variant's 16-byte vectors are NEON: fused multiply-adds on four
    fp32 lanes (``fmla vN.4s``) in the step's products."""
    if shutil.which(CROSS_OBJDUMP) is None:
        pytest.skip(f"{CROSS_OBJDUMP} not installed (binutils-aarch64-linux-gnu)")
    text = subprocess.run([CROSS_OBJDUMP, "-d", str(arm_harness)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"fmla\s+v\d+\.4s", text), "no 4-lane NEON fmla in the aarch64 build"


def _bytes(t: torch.Tensor | None) -> bytes:
    if t is None:
        return struct.pack("<q", 0)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return struct.pack("<q", len(raw)) + raw


def _run(harness: Path, tmp_path: Path, blob: bytes, *mode: str) -> bytes:
    """The harness's output for input ``blob`` under qemu-aarch64 on two OpenMP threads."""
    (tmp_path / "in.bin").write_bytes(blob)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "QEMU_LD_PREFIX": SYSROOT}
    cmd = [QEMU, "-L", SYSROOT, str(harness), *mode, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return (tmp_path / "out.bin").read_bytes()


def _model(config: wiola.WiolaConfig, scheme: str) -> wiola.fast.WiolaModel:
    torch.manual_seed(0)
    model = wiola.fast.WiolaModel(config).eval().requires_grad_(False)
    with torch.no_grad():  # larger than the init: attention and the gates far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model if scheme == "fp32" else quantize(model, scheme)


@torch.inference_mode()
@pytest.mark.parametrize("B,prompt,steps,pad", [(1, 1, 4, 0), (8, 17, 4, 6)], ids=lambda v: str(v))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scheme", ["fp32", "bf16", "int8", "int4"])
def test_arm_step_matches_oracle(scheme, variant, B, prompt, steps, pad, arm_harness, tmp_path):
    config = VARIANTS[variant]
    if scheme == "int4":  # widths that are multiples of the int4 group (odd vocabulary and heads kept)
        config = dataclasses.replace(config, d_model=2 * GROUP, d_ff=3 * GROUP)
    model = _model(config, scheme)
    ref = reference_on(model)  # the dequantized weights
    gen = torch.Generator().manual_seed(B * 100 + prompt)
    ids = torch.randint(0, config.vocab_size, (B, prompt), generator=gen)
    mask = torch.ones(B, prompt, dtype=torch.long)
    if B > 1:
        mask[1, :pad] = 0
        mask[B - 1, : pad // 2] = 0
    S = prompt + steps
    ref_cache, cache = ref.new_cache(B, S), ref.new_cache(B, S)
    ref(ids, attention_mask=mask, cache=ref_cache)
    ref(ids, attention_mask=mask, cache=cache)
    # The product's binding gathers the step's arguments (order, packed matrices, scales, checks),
    # as the portable variant that the aarch64 build is reads them (the amx variant's are tiled).
    binding = decode_step_cpu.DecodeStepCPU(model, cache, "portable")
    assert binding.quantization == (None if scheme == "fp32" else scheme)
    tokens = torch.randint(0, config.vocab_size, (steps, B), generator=torch.Generator().manual_seed(7))
    blob = struct.pack(f"<{len(binding.dims)}q", *binding.dims) + struct.pack("<f", binding.eps)
    blob += struct.pack("<q", len(binding.step_tensors))
    blob += b"".join(map(_bytes, binding.step_tensors)) + b"".join(map(_bytes, binding.scales))
    blob += b"".join(map(_bytes, binding.state)) + struct.pack("<q", steps)
    want, allowed = [], []
    with AbsSums(ref) as sums:
        for i in range(steps):
            blob += struct.pack(f"<{B + 1}q", cache.length + i, *tokens[i].tolist())
            want.append(ref(tokens[i].view(B, 1), cache=ref_cache).logits[:, 0])
            allowed.append(bound(config, cache.length + i + 1, sums.head[:, 0]))
    out = _run(arm_harness, tmp_path, blob)
    V = config.vocab_size
    logits = torch.from_numpy(np.frombuffer(out, dtype=np.float32, count=steps * B * V).copy()).view(steps, B, V)
    for i in range(steps):
        assert_within(f"ARM {scheme} logits[step {i}]", want[i], logits[i], allowed[i], "portable (aarch64, qemu)")
    at, got = steps * B * V * 4, {}
    for name, t in zip(("k", "v", "key_mask", "gate_sum", "gate_count", "n_real"), binding.state, strict=True):
        n = t.numel() * t.element_size()
        got[name] = torch.frombuffer(bytearray(out[at : at + n]), dtype=t.dtype).view(t.shape)
        at += n
    assert at == len(out), f"the harness wrote {len(out)} bytes, {at} expected"
    real = ref_cache.key_mask[None, :, None, :, None].expand_as(ref_cache.k)
    assert torch.equal(ref_cache.key_mask, got["key_mask"]) and torch.equal(ref_cache.n_real, got["n_real"])
    assert torch.equal(ref_cache.gate_count, got["gate_count"])
    limit = cache_bound(config, S, sums.proj, steps)
    assert_within("ARM cache.k", ref_cache.k[real], got["k"][real], limit["k"])
    assert_within("ARM cache.v", ref_cache.v[real], got["v"][real], limit["v"])
    assert_within("ARM cache.gate_sum", ref_cache.gate_sum, got["gate_sum"], limit["gate_sum"])


@torch.inference_mode()
@pytest.mark.parametrize(
    "case", [PROMPT_CASES[2], PROMPT_CASES[4]], ids=lambda c: "B{}-T{}-H{}-D{}-S{}-start{}-pad{}".format(*c)
)
def test_arm_prompt_functions_match_oracle(case, arm_harness, tmp_path):
    """The prompt's C++ functions on aarch64 (NEON): the attention over the cache (a chunk after
    cached slots, left padding, D 32 and 48), RMSNorm rows after the residual add and the SiLU
    gate (widths with a vector tail, inputs from 1e-3 to past ±87) against the float64 oracles
    within the same error bounds as on x86 (``cpu_prompt_oracle``); the step's product over 9
    rows within its fp32 bound, and each row alone bitwise the same as among the 9."""
    B, T, H, D, S, start, _ = case
    q, k, v, g, cos, sin, k_cache, v_cache, key_mask = (
        t.contiguous() for t in prompt_inputs(*case)
    )  # q, k, v as separate contiguous (B, T, H, D) tensors: ld_b T·H·D, ld_t H·D
    rows, d, F, eps = 9, 40, 37, 1e-6
    x, residual = rows_inputs(rows, d, seed=d), rows_inputs(rows, d, seed=d + 1)
    up, bp = rows_inputs(rows, 2 * F, seed=F), rows_inputs(rows, F, seed=F + 1)
    gamma = torch.randn(d, generator=torch.Generator().manual_seed(3))
    blob = struct.pack("<8q", B, T, H, D, S, start, T * H * D, H * D)
    blob += b"".join(map(_bytes, (q, k, v, g, cos, sin, k_cache, v_cache, key_mask)))
    blob += struct.pack("<2qf", rows, d, eps) + b"".join(map(_bytes, (x, residual, gamma)))
    blob += struct.pack("<2q", rows, F) + b"".join(map(_bytes, (up, bp)))
    M, N, K = 9, 10, 37  # a row tail (37 mod 4) and a block of two rows (10 mod 4)
    px, pw = rows_inputs(M, K, seed=K), torch.randn(N, K, generator=torch.Generator().manual_seed(N)) / K**0.5
    blob += struct.pack("<3q", M, N, K) + b"".join(map(_bytes, (px, pw)))
    out = _run(arm_harness, tmp_path, blob, "prompt")

    sizes = [B * T * H * D, B * H * S * D, B * H * S * D, rows * d, rows * d, rows * F, M * N, M * N]
    assert len(out) == 4 * sum(sizes), f"the harness wrote {len(out)} bytes, {4 * sum(sizes)} expected"
    parts, at = [], 0
    for n in sizes:
        parts.append(torch.from_numpy(np.frombuffer(out, dtype=np.float32, count=n, offset=4 * at).copy()))
        at += n
    att, kc, vc, norm, h, gate, product, alone = parts
    where = "portable (aarch64, qemu)"
    inputs = (q, k, v, g, cos, sin, k_cache, v_cache, key_mask)
    att, kc, vc = att.view(B, T, H, D), kc.view(B, H, S, D), vc.view(B, H, S, D)
    check_prompt_attention(f"ARM prompt attention {case}", inputs, start, att, kc, vc, where)
    check_rms_norm("ARM rms_norm rows", x, residual, gamma, eps, norm.view(rows, d), h.view(rows, d), where)
    check_silu_gate("ARM silu gate rows", up, bp, gate.view(rows, F), where)
    allowed = LAMBDA * K**0.5 * U32 * (px.double().abs() @ pw.double().abs().T)
    assert_within("ARM product rows", px.double() @ pw.double().T, product.view(M, N), allowed, where)
    assert torch.equal(alone, product), f"ARM product rows: a row alone differs from the same row among {M}"


def test_arm_exponential_noise_equals_torchs(arm_harness, tmp_path):
    """The C++ Exp(1) noise (``wiola_exponential``) on aarch64 equals torch's ``exponential_`` here bit
    for bit, and leaves the generator's state as torch's draws leave it: sizes across the MT19937's
    refills, a stream long enough for the threads to share (40,000 values) and a crafted state's
    extremes (u = 0, the smallest two and the largest u)."""
    cases = [(f"seed {n}", torch.Generator().manual_seed(n), n) for n in (1, 313, 4099, 40_000)]
    units = hard_units(4, seed=0)  # 0, 1, 2, 2^53 - 1
    cases.append(("extremes", crafted(units, seed=0), len(units)))
    for name, g, n in cases:
        state = g.get_state()
        out = _run(arm_harness, tmp_path, struct.pack("<q", n) + _bytes(state), "exponential")
        answer = struct.unpack_from("<q", out)[0]
        values = torch.from_numpy(np.frombuffer(out, dtype=np.float32, count=n, offset=8).copy())
        after = torch.from_numpy(np.frombuffer(out, dtype=np.uint8, offset=8 + 4 * n).copy())
        want = torch.empty(n).exponential_(generator=g)
        assert answer >= 0, f"ARM {name}: wiola_exponential returned {answer}"
        differ = (values.view(torch.int32) != want.view(torch.int32)).nonzero()
        assert differ.numel() == 0, (
            f"ARM {name}: {differ.numel()} of {n} values differ from torch's, first at {differ[0]}"
        )
        assert torch.equal(after, g.get_state()), f"ARM {name}: the generator's state differs from torch's after"


def test_arm_sampler_equals_sample_next(arm_harness, tmp_path):
    """The C++ sampler on aarch64 (``wiola_sample_rows`` with no Python to call back): temperature,
    top-k and top-p rows, the noise made to favour the best token the reference's filters drop and
    then the worst one they keep, so a token wrongly kept or dropped wins. Its tokens equal
    ``wiola.generation.sample_next``'s here, except rows whose nucleus ends inside equal logits (no
    caller: token -1), which the tied rows must hit; the double exponential within 2^-50 there too."""
    from wiola.generation import filter_logits, sample_next

    V, gen = 4099, torch.Generator().manual_seed(5)
    settings = [(0.8, 0, 1.0), (1.1, 40, 1.0), (0.9, 0, 0.95), (1.3, 0, 0.5), (0.7, 25, 0.9)]
    rows = []
    for favour in ("dropped", "kept"):
        for tied in (False, True):
            for t, k, p in settings:
                x = torch.randn(V, generator=gen) * 3
                if tied:
                    x = (x * 2).round() / 2  # the nucleus' edge inside a run of equal logits
                rows.append((t, k, p, x, favour, tied))
    B = len(rows)
    logits = torch.stack([r[3] for r in rows])
    noise = torch.ones(B, V)
    for i, (t, k, p, x, favour, _) in enumerate(rows):
        keep = torch.isfinite(filter_logits(x[None] / t, k or None, p if p < 1 else None))[0]
        if favour == "dropped":
            noise[i, ~keep] = 1e-20  # -log E = 46: such a token wins wherever it is not -inf
        else:
            noise[i, torch.where(keep, x, torch.inf).argmin()] = 1e-20
    log_noise = torch.log(noise.clamp_min(1e-30))
    head = struct.pack("<qq", B, V) + b"".join(struct.pack("<fqd", t, k, p) for t, k, p, *_ in rows)
    raw = logits.numpy().tobytes() + log_noise.numpy().tobytes()
    out = _run(arm_harness, tmp_path, head + raw, "sampler")
    exp_error = struct.unpack_from("<d", out)[0]
    tokens = np.frombuffer(out, dtype=np.int64, count=B, offset=8).tolist()
    paths = np.frombuffer(out, dtype=np.int64, count=B, offset=8 + 8 * B).tolist()
    assert exp_error <= 2**-50, f"ARM: the double exponential's error {exp_error:.3g} past 2^-50"
    names = decode_step_cpu.NUCLEUS_PATHS
    for i, (t, k, p, x, favour, tied) in enumerate(rows):
        want = int(sample_next(x[None], t, k or None, p if p < 1 else None, noise=noise[i : i + 1])[0])
        where = f"ARM row {i} (temperature {t}, top_k {k}, top_p {p}, favour {favour}, tied {tied})"
        if names[paths[i]] == "caller":
            assert tied and tokens[i] == -1, f"{where}: handed over ({tokens[i]}) where the bound should decide"
            continue
        assert tokens[i] == want, f"{where}: token {tokens[i]} != sample_next's {want}"
    assert any(names[paths[i]] == "caller" for i in range(B)), "no row's nucleus ended inside equal logits"
    untied = [names[paths[i]] for i, r in enumerate(rows) if r[2] < 1 and not r[5]]
    assert untied and set(untied) == {"bound"}, f"nuclei over distinct logits not decided by the bound: {untied}"
