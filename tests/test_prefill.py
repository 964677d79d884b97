"""The CPU prompt path's modes (``wiola.fast.prefill``): the choice from the CPU's flags and
``$WIOLA_CPU_PREFILL``, where bf16 applies, and what bf16 products cost: logits within the bf16
error bound of the fp32 prompt; ``auto`` never picks a mode whose validation loss is more than
0.001 nats from fp32's. The fp32 GEMM (``$WIOLA_CPU_GEMM``): its choice from the CPU's vendor
and family, or on a CPU outside the table from timing the two (oneDNN only past the margin; the
times kept per CPU, torch and thread count in the build cache), where it applies, and the model's
logits on each GEMM within the fp32 bound of each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from numerics import U_BF16, AbsSums, assert_within, bound, left_padded_prompt, platform_line

import wiola
import wiola.fast
from wiola.fast import prefill
from wiola.fast.quantize import quantize
from wiola.ops import linear

CONFIG = wiola.WiolaConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=160)
# A prompt's products a sequence (one call each past 64 positions): per layer q/k/v, o, up, bp and
# down; then the head (the gate's small ones run in C++ with the rest of the gate).
PRODUCTS = 5 * CONFIG.n_layers + 1


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
    delta = loss["bf16"] - loss["fp32"]  # SPEC: +0.0023 nats with torch 2.13, +0.0008 with torch 2.11
    if abs(delta) > 1e-3:
        assert "bf16" not in prefill.AUTO.values(), f"auto picks bf16 on some CPU, whose loss is off by {delta:+.4f}"


@pytest.fixture
def gemm_cache(monkeypatch, tmp_path):
    """An empty build cache and no measurement yet in this process; ``times`` sets what
    ``measure_gemms`` returns (ATen's and oneDNN's seconds) and counts its calls; the machine reads
    as quiet while it runs (``times["busy"]``, the share of the CPUs others used, sets otherwise)."""
    monkeypatch.setenv("WIOLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(prefill.GEMM_ENV, raising=False)
    monkeypatch.setattr(prefill, "_MEASURED", {})
    calls: list[tuple] = []
    times = {"aten": 2.0, "onednn": 1.0}

    def measure(shapes=prefill.GEMM_SHAPES, rounds=prefill.GEMM_ROUNDS):
        calls.append((shapes, rounds))
        return {name: times[name] for name in ("aten", "onednn")}

    monkeypatch.setattr(prefill, "measure_gemms", measure)
    monkeypatch.setattr(prefill, "others_busy", lambda work: (work(), times.get("busy", 0.0)))
    return times, calls, tmp_path / "cache" / prefill.GEMM_CACHE


def test_gemm_choice_from_cpu_and_environment(monkeypatch, gemm_cache):
    times, calls, _ = gemm_cache
    times.update(aten=1.0, onednn=1.0)  # level where not in the table: ATen stays
    monkeypatch.setattr(prefill, "GEMM_AUTO", {("AuthenticAMD", "26"): "onednn"})
    monkeypatch.setattr(linear, "onednn_available", lambda: True)
    for vendor, family, want in (
        ("AuthenticAMD", "26", "onednn"),
        ("AuthenticAMD", "25", "aten"),
        ("GenuineIntel", "6", "aten"),
    ):
        cpu = {"vendor": vendor, "family": family, "machine": "x86_64", "flags": "", "name": vendor}
        monkeypatch.setattr(prefill, "_cpu", lambda cpu=cpu: cpu)
        assert prefill.select_gemm() == want, (vendor, family)
    assert len(calls) == 1, f"auto timed the GEMMs {len(calls)} times, not once a process"
    assert prefill._describe_gemm().startswith(
        "fp32 GEMM aten (auto: GenuineIntel family 6 not in the table; oneDNN ran a prompt's products "
        "1.00x as fast as ATen on "
    )
    monkeypatch.setattr(prefill, "_cpu", lambda: {"vendor": "AuthenticAMD", "family": "26", "machine": "x86_64"})
    assert prefill._describe_gemm() == "fp32 GEMM onednn (auto: AuthenticAMD family 26 measured)"
    monkeypatch.setattr(linear, "onednn_available", lambda: False)  # a torch without oneDNN: auto takes ATen
    monkeypatch.setattr(prefill, "_cpu", lambda: {"vendor": "GenuineIntel", "family": "6", "machine": "x86_64"})
    assert prefill.select_gemm() == "aten"
    assert prefill._describe_gemm() == "fp32 GEMM aten (auto: this torch has no oneDNN)"
    with pytest.raises(ValueError, match="WIOLA_CPU_GEMM=onednn, but this torch has no oneDNN"):
        monkeypatch.setenv(prefill.GEMM_ENV, "onednn")
        prefill.select_gemm()
    monkeypatch.setenv(prefill.GEMM_ENV, " ATEN ")
    assert prefill.select_gemm() == "aten"
    assert prefill._describe_gemm() == "fp32 GEMM aten (forced: WIOLA_CPU_GEMM=aten)"
    monkeypatch.setenv(prefill.GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="WIOLA_CPU_GEMM='mkl' is not one of auto, measure, aten, onednn"):
        prefill.select_gemm()
    assert len(calls) == 1, "a forced GEMM or a listed family timed the GEMMs"
    # measure: the timed choice on a listed family too (ATen, level in this process's measurement)
    monkeypatch.setattr(linear, "onednn_available", lambda: True)
    monkeypatch.setattr(prefill, "_cpu", lambda: {"vendor": "AuthenticAMD", "family": "26", "machine": "x86_64"})
    monkeypatch.setenv(prefill.GEMM_ENV, "Measure")
    assert prefill.select_gemm() == "aten" and len(calls) == 1
    assert prefill._describe_gemm().startswith(
        "fp32 GEMM aten (measure: WIOLA_CPU_GEMM=measure; oneDNN ran a prompt's products 1.00x as fast as ATen"
    ), prefill._describe_gemm()


@pytest.mark.parametrize(
    ("aten", "onednn", "want"),
    [(1.0, 1.0, "aten"), (1.09, 1.0, "aten"), (1.1, 1.0, "onednn"), (2.0, 1.0, "onednn"), (1.0, 2.0, "aten")],
)
def test_unlisted_cpu_takes_onednn_only_past_the_margin(monkeypatch, gemm_cache, aten, onednn, want):
    times, calls, path = gemm_cache
    times.update(aten=aten, onednn=onednn)
    monkeypatch.setattr(prefill, "GEMM_AUTO", {})
    monkeypatch.setattr(linear, "onednn_available", lambda: True)
    m = prefill.measured_gemm()
    assert (m["chosen"], m["source"]) == (want, "measured"), (aten, onednn, prefill.GEMM_MARGIN, m)
    assert prefill.select_gemm() == want and m["ratio"] == pytest.approx(aten / onednn)
    assert prefill._describe_gemm().endswith("; timed now)"), prefill._describe_gemm()
    assert len(calls) == 1 and path.exists()


def test_measured_choice_is_kept_per_cpu_torch_and_threads(monkeypatch, gemm_cache):
    times, calls, path = gemm_cache
    monkeypatch.setattr(prefill, "GEMM_AUTO", {})
    monkeypatch.setattr(linear, "onednn_available", lambda: True)
    assert prefill.measured_gemm()["chosen"] == "onednn" and len(calls) == 1
    records = json.loads(path.read_text())
    ((key, record),) = records.items()
    assert record["aten_s"] == 2.0 and record["onednn_s"] == 1.0 and record["torch"] == torch.__version__
    assert record["threads"] == torch.get_num_threads() and record["shapes"] == [list(s) for s in prefill.GEMM_SHAPES]
    assert record["cpu"] == prefill._cpu()["name"] and record["busy"] == 0.0

    # Another process on this machine (nothing measured in it yet) reads the file: no timing, same choice.
    monkeypatch.setattr(prefill, "_MEASURED", {})
    times.update(aten=1.0, onednn=1.0)  # were it timed again, ATen would win
    m = prefill.measured_gemm()
    assert (m["chosen"], m["source"], len(calls)) == ("onednn", str(path), 1), m
    assert prefill._describe_gemm().endswith(f"; timed before, {path})")

    # Another thread count is measured of its own and added beside the first.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert prefill.measured_gemm()["chosen"] == "aten" and len(calls) == 2
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads(path.read_text())) == 2
    assert prefill.measured_gemm()["chosen"] == "onednn" and len(calls) == 2

    # A record for another torch, a damaged record and a damaged file are measured past and replaced.
    monkeypatch.setattr(prefill.torch, "__version__", "0.0-other")
    monkeypatch.setattr(prefill, "_MEASURED", {})
    assert prefill.measured_gemm()["source"] == "measured" and len(calls) == 3
    monkeypatch.setattr(prefill, "_MEASURED", {})
    key = prefill._gemm_key(torch.get_num_threads())
    path.write_text(json.dumps(json.loads(path.read_text()) | {key: {"aten_s": "fast", "onednn_s": -1.0}}))
    assert prefill.measured_gemm()["source"] == "measured" and len(calls) == 4
    assert json.loads(path.read_text())[key]["aten_s"] == 1.0
    # no time (no ratio either), or no proof of a quiet machine (a record without "busy", or a busy one)
    for zero in (
        {"aten_s": 0.0, "onednn_s": 0.0, "busy": 0.0},
        {"aten_s": 1.0, "onednn_s": 0.0, "busy": 0.0},
        {"aten_s": 2.0, "onednn_s": 1.0},
        {"aten_s": 2.0, "onednn_s": 1.0, "busy": prefill.GEMM_QUIET},
        {"aten_s": 2.0, "onednn_s": 1.0, "busy": "idle"},
    ):
        monkeypatch.setattr(prefill, "_MEASURED", {})
        path.write_text(json.dumps(json.loads(path.read_text()) | {key: zero}))
        calls_before = len(calls)
        assert prefill.measured_gemm()["source"] == "measured" and len(calls) == calls_before + 1, zero
    monkeypatch.setattr(prefill, "_MEASURED", {})
    path.write_text("{not json")
    assert prefill.measured_gemm()["source"] == "measured" and len(calls) == 10
    assert len(json.loads(path.read_text())) == 1
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")], "a temporary file was left"


@pytest.mark.parametrize("busy", [0.5, prefill.GEMM_QUIET])
def test_a_busy_machines_measurement_is_not_kept(monkeypatch, gemm_cache, busy):
    """Timed while others used ``GEMM_QUIET`` or more of the CPUs' time, the choice holds for this
    process and is not written; the next process times again, and keeps a quiet measurement."""
    times, calls, path = gemm_cache
    times.update(aten=1.33, onednn=1.0, busy=busy)
    monkeypatch.setattr(prefill, "GEMM_AUTO", {})
    monkeypatch.setattr(linear, "onednn_available", lambda: True)
    m = prefill.measured_gemm()
    assert (m["chosen"], m["source"], m["busy"]) == ("onednn", "measured", busy) and not path.exists(), m
    assert prefill._describe_gemm().endswith(
        f"; timed now, not kept: others used {busy:.0%} of the CPUs' time meanwhile)"
    ), prefill._describe_gemm()
    assert prefill.measured_gemm() is m and len(calls) == 1  # once a process all the same
    for quiet in (None, prefill.GEMM_QUIET / 2):  # unreadable, or quiet: kept
        monkeypatch.setattr(prefill, "_MEASURED", {})
        times.update(aten=1.0, busy=quiet)
        assert prefill.measured_gemm()["chosen"] == "aten" and path.exists()
        assert prefill._describe_gemm().endswith("; timed now)"), prefill._describe_gemm()
        monkeypatch.setattr(prefill, "_MEASURED", {})  # the next process reads it
        assert (
            prefill.measured_gemm()["source"] == str(path)
            and json.loads(path.read_text()).popitem()[1]["busy"] == quiet
        )
        path.unlink()
    assert len(calls) == 3


def test_others_busy_counts_other_processes_cpu_time():
    """A process spinning on one of this process's CPUs while this one sleeps takes that CPU's
    time, 1/cpus of theirs: ``others_busy`` sees at least half of that (start-up and scheduler
    ticks aside), more where others run too."""
    if prefill._cpu_jiffies(prefill._cpus()) is None:
        pytest.skip("no /proc/stat on this system")
    spin = "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.1)  # the child's interpreter is up and spinning
        result, busy = prefill.others_busy(lambda: time.sleep(0.4) or "done")
    finally:
        child.wait()
    cpus = len(prefill._cpus() or range(os.cpu_count() or 1))  # the child inherits this process's CPUs
    assert result == "done" and busy is not None and busy >= 0.5 / cpus, (busy, cpus, prefill._cpu()["name"])


def test_others_busy_subtracts_this_process(monkeypatch):
    """The share is the busy ticks of this process's CPUs less its own CPU time, over all their
    ticks; None where /proc/stat cannot be read or too few ticks passed."""
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    affinity = {0, 2, 5, 7}
    cpus = len(affinity)
    monkeypatch.setattr(prefill, "_cpus", lambda: affinity)
    asked: list[set[int] | None] = []

    def ticks(values):
        values = iter(values)
        return lambda cpus: asked.append(cpus) or next(values)

    span = 400 * cpus  # ticks of those CPUs while the work ran
    for busy_ticks, own_s, want in ((150 * cpus, 100 * cpus * tick, 0.125), (40, 0.0, 0.1 / cpus), (10, 9.0, 0.0)):
        own = iter([2.0, 2.0 + own_s])
        monkeypatch.setattr(prefill, "_cpu_jiffies", ticks([(1000, 5000), (1000 + busy_ticks, 5000 + span)]))
        monkeypatch.setattr(prefill.time, "process_time", own.__next__)
        assert prefill.others_busy(lambda: 7) == (7, pytest.approx(want)), (busy_ticks, own_s)
    assert asked == [affinity] * 6, f"the ticks were read for {asked}, not the process's CPUs {affinity}"
    for before, after in (((1000, 5000), None), (None, (2000, 9000)), ((1000, 5000), (1001, 5000 + 2 * cpus - 1))):
        monkeypatch.setattr(prefill, "_cpu_jiffies", ticks([before, after]))
        monkeypatch.setattr(prefill.time, "process_time", lambda: 0.0)
        assert prefill.others_busy(lambda: 7) == (7, None), (before, after)


def test_cpu_ticks_of_the_cpus_this_process_may_run_on(tmp_path):
    """``/proc/stat``'s cpuN lines of the given CPUs summed (busy: all but idle and iowait), every
    cpuN line where they are unknown; None for a file without them or a short line."""
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  60 0 6 600 6 0 0 6 0 0\n"
        "cpu0 10 0 1 100 1 0 0 1 0 0\n"  # busy 12 of 113
        "cpu1 20 0 2 200 2 0 0 2 0 0\n"  # busy 24 of 226
        "cpu2 30 0 3 300 3 0 0 3 0 0\n"  # busy 36 of 339
        "intr 1 2 3\n"
    )
    for cpus, want in (({1}, (24, 226)), ({0, 2}, (48, 452)), (None, (72, 678)), ({7}, None)):
        assert prefill._cpu_jiffies(cpus, str(stat)) == want, cpus
    stat.write_text("cpu0 10 0 1 100\n")
    assert prefill._cpu_jiffies(None, str(stat)) is None
    assert prefill._cpu_jiffies(None, str(tmp_path / "missing")) is None


def test_measured_choice_without_a_usable_cache(monkeypatch, gemm_cache, tmp_path):
    _, calls, _ = gemm_cache
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # others may write: refused as a build cache (decode_step_cpu.private_dir)
    monkeypatch.setenv("WIOLA_CACHE_DIR", str(shared))
    monkeypatch.setattr(prefill, "GEMM_AUTO", {})
    monkeypatch.setattr(linear, "onednn_available", lambda: True)
    assert prefill.measured_gemm()["source"] == "measured" and list(shared.iterdir()) == []
    assert prefill.measured_gemm()["source"] == "measured" and len(calls) == 1  # once a process


def test_a_failing_onednn_is_not_taken(monkeypatch, gemm_cache):
    _, _, path = gemm_cache
    monkeypatch.setattr(prefill, "GEMM_AUTO", {})
    monkeypatch.setattr(linear, "onednn_available", lambda: True)

    def fails(shapes=prefill.GEMM_SHAPES, rounds=prefill.GEMM_ROUNDS):
        raise RuntimeError("could not create a primitive\n descriptor")

    monkeypatch.setattr(prefill, "measure_gemms", fails)
    assert prefill.select_gemm() == "aten" and not path.exists()
    assert prefill._describe_gemm().endswith(
        "not in the table; oneDNN failed: could not create a primitive descriptor)"
    ), prefill._describe_gemm()


def test_measure_gemms_times_both_on_real_products(monkeypatch):
    """Each GEMM runs every shape once untimed and once a round, on operands of those shapes;
    both times are positive; bad shapes or rounds are refused."""
    ran: dict[str, list[tuple[int, int, int]]] = {"aten": [], "onednn": []}
    aten, onednn = prefill.F.linear, linear.onednn_linear

    def spy(name, real):
        return lambda x, w: ran[name].append((*x.shape, w.shape[0])) or real(x, w)

    monkeypatch.setattr(prefill.F, "linear", spy("aten", aten))
    monkeypatch.setattr(linear, "onednn_linear", spy("onednn", onednn))
    shapes = ((65, 16, 24), (70, 8, 8))
    times = prefill.measure_gemms(shapes, rounds=3)
    assert set(times) == set(linear.CPU_GEMMS) and all(t > 0.0 for t in times.values()), times
    assert ran["aten"] == ran["onednn"] == list(shapes) * 4, ran
    for bad, rounds in ((shapes, 0), ((), 1), (((65, 0, 8),), 1)):
        with pytest.raises(ValueError, match="measure_gemms: shapes="):
            prefill.measure_gemms(bad, rounds)


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


@pytest.mark.skipif(
    not hasattr(torch.backends.mkldnn.matmul, "fp32_precision"), reason="this torch has no per-backend precision"
)
@pytest.mark.parametrize("allowed", ["bf16", "tf32"])
def test_a_precision_lowered_through_torch_backends_mkldnn_takes_f_linear(plain_cpu, allowed):
    """``torch.backends.mkldnn.matmul.fp32_precision`` set (torch's per-backend API, after which
    it refuses ``get_float32_matmul_precision``): the fast model's prompt, scoring pass and
    ``generate`` run, their products on ``F.linear`` as the caller asked; "ieee" keeps them strict."""
    model = _model()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    mkldnn = torch.backends.mkldnn.matmul
    old = mkldnn.fp32_precision
    try:
        mkldnn.fp32_precision = allowed
        assert not linear._strict_fp32()
        with torch.inference_mode():
            assert model(ids, cache=model.new_cache(2, 80)).logits.shape == (2, 70, CONFIG.vocab_size)
            assert model(ids).logits.shape == (2, 70, CONFIG.vocab_size)
            assert model.generate(ids[:, :10], 4, temperature=0).shape == (2, 14)
        mkldnn.fp32_precision = "ieee"
        assert linear._strict_fp32()
    finally:
        mkldnn.fp32_precision = old
    assert linear._strict_fp32()


@pytest.mark.skipif(not linear.onednn_available(), reason="this torch has no oneDNN")
@torch.inference_mode()
def test_onednn_prompt_within_the_fp32_bound(plain_cpu, monkeypatch):
    """The prompt (3 rows of 70 tokens, one left-padded) on oneDNN and on ATen: every product (70
    positions a sequence, more than 64: one call a sequence) counted on oneDNN and none on ATen, the logits within the
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
        ran = sum(calls)  # PRODUCTS for each of the 3 sequences
        assert ran == (3 * PRODUCTS if gemm == "onednn" else 0), f"{gemm}: {ran} products on oneDNN"
        assert torch.isfinite(model(ids[:, -1:], cache=cache).logits).all()
    real_rows = mask.bool()
    allowed = bound(CONFIG, 70, sums.head)[real_rows]
    got, want = logits["onednn"][real_rows], logits["aten"][real_rows]
    assert_within("oneDNN prompt logits against ATen's", want, got, allowed, "oneDNN fp32 GEMM")


@torch.inference_mode()
def test_the_configs_norm_eps_reaches_the_cpu_prompt_and_step(plain_cpu):
    """A model with ``norm_eps`` 0.5 (not the default): the fast model's prompt (the C++ RMSNorms)
    and its one-token steps (the C++ step) within the fp32 bound of the reference's full pass,
    where an eps of 1e-6 moves the logits by far more."""
    import dataclasses

    config = dataclasses.replace(CONFIG, norm_eps=0.5)
    torch.manual_seed(4)
    fast = wiola.fast.WiolaModel(config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref = wiola.WiolaModel(config).eval()
    ref.load_state_dict(fast.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    cache = fast.new_cache(2, 43)
    got = [fast(ids, cache=cache).logits]
    tokens = ids
    for _ in range(3):
        nxt = got[-1][:, -1:].argmax(-1)
        tokens = torch.cat([tokens, nxt], 1)
        got.append(fast(nxt, cache=cache).logits)
    got = torch.cat(got, 1)
    with AbsSums(ref) as sums:
        want = ref(tokens).logits
    allowed = bound(config, tokens.shape[1], sums.head)
    assert_within("norm_eps 0.5: the fast model's prompt and steps", want, got, allowed, "C++ prompt and step")
    other = wiola.WiolaModel(dataclasses.replace(config, norm_eps=1e-6)).eval()
    other.load_state_dict(fast.state_dict())
    assert ((other(tokens).logits - want).abs() > allowed).any(), "the bound cannot tell another eps"


@torch.inference_mode()
@pytest.mark.parametrize(("aten", "want"), [(3.0, 3 * PRODUCTS), (1.0, 0)])
def test_prompt_on_an_unlisted_cpu_follows_the_measurement(plain_cpu, monkeypatch, gemm_cache, aten, want):
    """``auto`` on a CPU outside ``GEMM_AUTO``: the model's prompt of 70 positions a sequence runs
    every product on oneDNN where it was measured past the margin, none where the two were level."""
    times, calls, _ = gemm_cache
    times.update(aten=aten, onednn=1.0)
    monkeypatch.setattr(prefill, "GEMM_AUTO", {})
    model = _model(seed=3)
    ids, mask = left_padded_prompt(CONFIG.vocab_size, 3, 70, 9)
    ran, real = [], linear._onednn_applies
    monkeypatch.setattr(linear, "_onednn_applies", lambda x, w: ran.append(on := real(x, w)) or on)
    model(ids, attention_mask=mask, cache=model.new_cache(3, 72))
    assert sum(ran) == want and len(calls) == 1, (aten, sum(ran), len(calls))


# 13m widths (d 256: the products' shapes), two layers, and a head of 1,001 rows (the last a block of one).
WIDE = wiola.WiolaConfig(vocab_size=1001, d_model=256, n_layers=2, n_heads=8, d_ff=512, max_seq_len=160)
WIDE_MODELS: dict[str, wiola.fast.WiolaModel] = {}


def _wide(scheme: str) -> wiola.fast.WiolaModel:
    if scheme not in WIDE_MODELS:
        torch.manual_seed(5)
        model = wiola.fast.WiolaModel(WIDE).eval().requires_grad_(False)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        WIDE_MODELS[scheme] = model if scheme == "fp32" else quantize(model, scheme)
    return WIDE_MODELS[scheme]


@torch.inference_mode()
@pytest.mark.parametrize("gemm", ["auto", *linear.CPU_GEMMS])
@pytest.mark.parametrize("scheme", ["fp32", "int8", "bf16", "int4"])
def test_prompt_row_alone_equals_the_row_in_a_batch(plain_cpu, monkeypatch, scheme, gemm):
    """A row's prompt logits (every position's, and the last one's alone as ``generate`` asks for
    them) and its logits over the next 3 steps are bitwise the same alone and as any row of a batch
    of 8 rows of its length (the first, the last and rows between, one per length), for prompts of 2 to 130 positions: up to 64 a sequence the products run
    on the C++ step's product, whose rows do not depend on the rows beside them; above, on the GEMM,
    one product of many rows either way. On the GEMM ``auto`` picks here and on each forced."""
    if gemm == "onednn" and not linear.onednn_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv(prefill.GEMM_ENV, gemm)
    model = _wide(scheme)
    gen = torch.Generator().manual_seed(1)
    for T, at in zip((2, 5, 12, 64, 65, 130), (0, 7, 3, 5, 1, 6)):
        _check_row_alone_and_in_a_batch(model, torch.randint(0, WIDE.vocab_size, (8, T), generator=gen), scheme, at)


def _check_row_alone_and_in_a_batch(
    model: wiola.fast.WiolaModel, ids: torch.Tensor, what_model: str, row: int, masked: bool = False
) -> None:
    """Row ``row`` of ``ids`` alone and in the batch: every position's prompt logits, the last
    one's, and 3 greedy steps, bitwise the same; ``masked``: each call given an ``attention_mask``
    (of ones), which the C++ step does not take, so the steps run the per-row C++ functions."""
    T, B = ids.shape[1], ids.shape[0]
    runs = {}

    def mask(n: int, width: int) -> dict[str, torch.Tensor]:
        return {"attention_mask": torch.ones(n, width, dtype=torch.long)} if masked else {}

    for name, rows, at in (("alone", ids[row : row + 1], 0), ("in the batch", ids, row)):
        n = rows.shape[0]
        every = model(rows, cache=model.new_cache(n, T), **mask(n, T)).logits[at]
        cache = model.new_cache(n, T + 3)
        out = model(rows, cache=cache, logits_to_keep=1, **mask(n, T)).logits[:, -1]
        seq = [every, out[at]]
        for step in range(3):
            out = model(out.argmax(-1, keepdim=True), cache=cache, **mask(n, T + step + 1)).logits[:, -1]
            seq.append(out[at])
        runs[name] = seq
    for i, what in enumerate(
        ("every position's prompt logits", "the prompt's last logits", "step 1", "step 2", "step 3")
    ):
        a, b = runs["alone"][i], runs["in the batch"][i]
        assert torch.equal(a, b), (
            f"{what_model}, {prefill._describe_gemm()}, {T} positions: {what} of row {row} of {B} differ from the row alone "
            f"(max {float((a - b).abs().max()):.2e}); {platform_line()}"
        )


@torch.inference_mode()
@pytest.mark.parametrize("scheme", ["fp32", "int8"])
def test_masked_steps_of_a_row_alone_equal_the_row_in_a_batch(plain_cpu, scheme):
    """The same with an ``attention_mask`` on every call (the prompt and each one-token step, which
    then runs outside the C++ step, on the per-row products and the C++ attention)."""
    model = _wide(scheme)
    gen = torch.Generator().manual_seed(4)
    for T, at in zip((5, 12, 70), (3, 0, 7)):
        ids = torch.randint(0, WIDE.vocab_size, (8, T), generator=gen)
        _check_row_alone_and_in_a_batch(model, ids, f"{scheme}, masked", at, masked=True)


@torch.inference_mode()
@pytest.mark.parametrize("head_dim", [40, 10])
def test_odd_head_width_row_alone_equals_the_row_in_a_batch(plain_cpu, head_dim):
    """The same for head widths that are not a multiple of the vectors' lanes (the C++ prompt
    attention's last columns one at a time; PyTorch's batched SDPA would differ by the batch)."""
    config = wiola.WiolaConfig(vocab_size=101, d_model=2 * head_dim, n_layers=1, n_heads=2, d_ff=64, max_seq_len=96)
    torch.manual_seed(2)
    with pytest.warns(UserWarning, match=f"head width {head_dim}"):
        model = wiola.fast.WiolaModel(config).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    for T, at in zip((5, 17, 70), (7, 0, 4)):
        _check_row_alone_and_in_a_batch(
            model, torch.randint(0, 101, (8, T), generator=gen), f"head width {head_dim}", at
        )
