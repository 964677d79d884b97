"""The benchmark frame (bench/frame.py) on the CPU: input rotation, repetition counts, the
forward+backward wrapper, and the record ``Bench.run`` writes (derived metrics recomputed here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import frame  # noqa: E402
from bench.roofline import Cost  # noqa: E402


class FakeBenchmark:
    """The attributes of pytest-benchmark's fixture that the frame uses."""

    def __init__(self, disabled: bool = False) -> None:
        self.name = self.fullname = "fake"
        self.group = None
        self.extra_info: dict = {}
        self.disabled = disabled


def test_input_rotation_counts() -> None:
    calls = []

    def make(nbytes: int):
        def inputs():
            calls.append(1)
            return (torch.randn(nbytes // 4),)

        return inputs

    # 100-byte sets, L2 of 1000 bytes: ceil(3 · 1000 / 100) = 30 sets, each made fresh
    assert len(frame.make_input_sets(make(100), 1000)) == 30 and len(calls) == 30
    assert len(frame.make_input_sets(make(8), 1000)) == frame.MAX_INPUT_SETS  # 375 capped at 32
    assert len(frame.make_input_sets(make(4000), 1000)) == 1  # larger than 3× L2: no rotation
    assert len(frame.make_input_sets(make(100), 0)) == 1  # CPU: no L2 given
    assert frame.make_input_sets(None, 1000) == [()]
    sets = frame.make_input_sets(make(400), 1000)
    assert not torch.equal(sets[0][0], sets[1][0]), "input sets must be fresh random data, not copies"


@pytest.mark.parametrize(
    "estimate, expected",
    [
        (0.01, 200),  # 3 s / 0.01 s = 300, capped at max_reps 200 (2 s in all)
        (0.5, 6),  # 3 s / 0.5 s = 6
        (2.0, 3),  # min_reps 3 would take 6 s > 5 s: int(5 / 2) = 2, raised to the floor of 3
        (1e-9, 200),
    ],
)
def test_repetition_count(estimate: float, expected: int) -> None:
    assert frame._reps(estimate, target_s=3.0, min_reps=3, max_reps=200) == expected


def test_fwd_bwd_matches_autograd() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(7, 3, requires_grad=True)
    f = lambda x, w: torch.tanh(x @ w)
    got = frame.fwd_bwd(f, seed=3)(x, w)
    upstream = torch.randn((5, 3), generator=torch.Generator().manual_seed(3))
    want = torch.autograd.grad(f(x, w), (x, w), upstream)
    for name, g, r in zip(("dx", "dw"), got, want):
        assert torch.allclose(g, r), f"{name}: fwd_bwd gradient differs from autograd"
    assert x.grad is None and w.grad is None, "fwd_bwd must not accumulate into .grad"


def test_run_record_metrics_and_baselines() -> None:
    bm = FakeBenchmark()
    ceilings = frame.Ceilings("cpu", "fake cpu", 1e11, 1e10, "fp32 test", "test copy")
    bench = frame.Bench(bm, "cpu", ceilings)
    x = torch.randn(64, 64)
    cost = Cost(2 * 64**3, 3 * 64 * 64 * 4)

    def broken(a):
        raise ImportError("liger_kernel is not installed")

    rec = bench.run(
        lambda a: a @ a,
        op="matmul",
        cost=cost,
        shape={"N": 64},
        dtype=torch.float32,
        inputs=lambda: x,
        tokens=64,
        baselines={"twice": lambda a: (a @ a, a @ a), "liger": broken, "flex": "flex_attention missing"},
    )
    assert bm.extra_info is not None and bm.extra_info["op"] == "matmul" and bm.group == "matmul fwd"
    t = rec["time_s"]
    assert rec["tflops"] == pytest.approx(cost.flops / t / 1e12)
    assert rec["gbs"] == pytest.approx(cost.bytes / t / 1e9)
    floor = max(cost.flops / 1e11, cost.bytes / 1e10)
    assert rec["floor_s"] == pytest.approx(floor) and rec["pct_floor"] == pytest.approx(100 * floor / t)
    assert rec["mfu_pct"] == pytest.approx(100 * cost.flops / t / 1e11)  # of the matmul ceiling, in %
    assert rec["time_iqr_s"] >= 0
    assert rec["tokens_per_s"] == pytest.approx(64 / t)
    twice = rec["baselines"]["twice"]
    assert twice["speedup"] == pytest.approx(twice["time_s"] / t)
    assert rec["baselines"]["liger"]["unavailable"] == "ImportError: liger_kernel is not installed"
    assert rec["baselines"]["flex"] == {"unavailable": "flex_attention missing"}
    assert rec["shape_id"] == "N64" and rec["dtype"] == "float32" and rec["threads"] == torch.get_num_threads()


def test_run_smoke_mode_calls_each_once() -> None:
    calls = {"ours": 0, "ref": 0}

    def counted(name):
        def fn():
            calls[name] += 1

        return fn

    bench = frame.Bench(FakeBenchmark(disabled=True), "cpu", None)
    assert bench.quick
    rec = bench.run(counted("ours"), op="x", cost=Cost(1, 1), shape={"N": 1}, dtype="float32",
                    baselines={"ref": counted("ref")})  # fmt: skip
    assert calls == {"ours": 1, "ref": 1}
    assert rec["quick"] and "time_s" not in rec and rec["baselines"]["ref"] == {"ran": True}


def test_between_runs_after_each_timed_call_of_ours_only_and_is_not_timed(monkeypatch) -> None:
    """``between`` (a floor read at the same moments as the step) runs untimed after each timed call
    of ours, never around the warm-up or a baseline. On a clock that only the calls advance (ours
    1 ms, the baseline 2 ms, ``between`` 1 s), every timed rep of ours is exactly 1 ms."""
    log: list[str] = []
    clock = [0.0]
    monkeypatch.setattr(frame.time, "perf_counter", lambda: clock[0])

    def ours():
        log.append("ours")
        clock[0] += 1e-3

    def between():
        log.append("between")
        clock[0] += 1.0

    def ref():
        log.append("ref")
        clock[0] += 2e-3

    bench = frame.Bench(FakeBenchmark(), "cpu", None)
    rec = bench.run(ours, op="x", cost=Cost(1, 1), shape={"N": 1}, dtype="float32",
                    baselines={"ref": ref}, between=between)  # fmt: skip
    mine = log[: log.index("ref")]
    assert mine[0] == "ours" and mine[1:] == ["ours", "between"] * rec["reps"], mine
    assert "between" not in log[log.index("ref") :]
    assert rec["time_s"] == pytest.approx(1e-3, rel=1e-9), rec["time_s"]
    assert rec["baselines"]["ref"]["time_s"] == pytest.approx(2e-3, rel=1e-9), rec["baselines"]


def test_our_errors_propagate() -> None:
    def ours():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        frame.Bench(FakeBenchmark(), "cpu", None).run(ours, op="x", cost=Cost(1, 1), shape={}, dtype="float32")


def test_shape_id() -> None:
    assert frame.shape_id({"B": 32, "T": 512, "H": 8, "D": 32}) == "B32-T512-H8-D32"
    assert frame.shape_id({"preset": "13m", "B": 64, "T": 512}) == "13m-B64-T512"


def test_forward_only_and_rel_err():
    from bench.frame import forward_only, rel_err

    x = torch.ones(3, requires_grad=True)
    y = forward_only(lambda t: t * 2)(x)
    assert not y.requires_grad and torch.equal(y, torch.full((3,), 2.0))
    assert rel_err(torch.tensor([2.0, -4.0]), torch.tensor([2.0, -3.0])) == 0.25


def test_wrapper_for_and_reference_baselines() -> None:
    """The mode picks the wrapper; the reference baselines are the eager reference and its
    ``torch.compile`` (not called here: compiling on the CPU takes minutes), both wrapped."""
    assert frame.wrapper_for("fwd_bwd") is frame.fwd_bwd
    assert frame.wrapper_for("fwd") is frame.forward_only
    x = torch.ones(3, requires_grad=True)
    baselines = frame.reference_baselines(lambda t: t * 2, frame.forward_only)
    assert list(baselines) == ["reference", "torch.compile"]
    y = baselines["reference"](x)
    assert not y.requires_grad and torch.equal(y, torch.full((3,), 2.0)), (
        "reference baseline: not the wrapped reference"
    )
    assert callable(baselines["torch.compile"])


def test_ours_is_recorded_before_any_baseline_and_an_interrupted_baseline_is_kept(tmp_path, monkeypatch) -> None:
    """The JSONL holds our result before the first baseline is called; a baseline interrupted the way
    pytest-timeout interrupts (an exception outside ``Exception``) is recorded, then re-raised; the
    report keeps the last line of the record."""
    from bench import report

    jsonl = tmp_path / "bench.jsonl"
    monkeypatch.setenv("WIOLA_BENCH_STAGE", "headline")
    seen_before_baseline = []

    def first(a):
        seen_before_baseline.append([json.loads(line) for line in jsonl.read_text().splitlines()])
        return a + 1

    def hangs(a):
        pytest.fail("Timeout >90.0s")  # raises pytest's Failed, a BaseException, as pytest-timeout does

    bench = frame.Bench(FakeBenchmark(), "cpu", None, str(jsonl))
    with pytest.raises(pytest.fail.Exception, match="Timeout"):
        bench.run(lambda a: a * 2, op="x", cost=Cost(1, 1), shape={"N": 4}, dtype="float32",
                  inputs=lambda: torch.ones(4), baselines={"first": first, "hangs": hangs, "never": first})  # fmt: skip
    early = seen_before_baseline[0]
    assert len(early) == 1 and early[0]["extra_info"]["baselines"] == {}
    assert early[0]["extra_info"]["baselines_pending"] == ["first", "hangs", "never"]
    assert early[0]["extra_info"]["time_s"] > 0 and early[0]["extra_info"]["stage"] == "headline"
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == 3 and len({e["extra_info"]["record_id"] for e in lines}) == 1
    last = lines[-1]["extra_info"]
    assert last["baselines"]["hangs"] == {"unavailable": "interrupted: Failed: Timeout >90.0s"}
    assert last["baselines_pending"] == ["never"] and "speedup" in last["baselines"]["first"]
    run = report.load_run(jsonl)
    assert len(run.records) == 1 and run.records[0]["baselines_pending"] == ["never"]
    header, rows, notes = report.group_table(run.records)
    assert header[-3:] == ["first", "hangs", "never"] and rows[0][-1] == "n/a [2]" and notes[1] == report.PENDING


def test_the_l3_floor_uses_the_cache_copy_rate() -> None:
    """With a measured cache copy rate, ``pct_floor_l3`` is the floor at that rate (every byte from
    the L3), beside ``pct_floor`` at the DRAM copy rate."""
    ceilings = frame.Ceilings("cpu", "fake cpu", 1e12, 1e10, "fp32 test", "test copy", 1e11, "test L3 copy", 32 << 20)
    bench = frame.Bench(FakeBenchmark(), "cpu", ceilings)
    m = bench._metrics(1.0, Cost(0, 1e10), None)
    assert (m["pct_floor"], m["pct_floor_l3"]) == (pytest.approx(100.0), pytest.approx(10.0)), m


def test_cpu_ceilings_arithmetic(monkeypatch) -> None:
    """``measure_cpu_ceilings`` on a fake clock (every timed call 1 s): the matmul rate is 2n³ a
    second, a copy moves its bytes twice (read and written), the cache copy is sized from the
    last-level cache."""
    from wiola.fast import decode_step_cpu

    monkeypatch.setattr(frame, "time_cpu", lambda *a, **k: [1.0])
    monkeypatch.setattr(decode_step_cpu, "last_level_cache_bytes", lambda: 32 << 20)
    c = frame.measure_cpu_ceilings()
    assert c.matmul_flops == 2 * 1024**3 and c.copy_bytes_per_s == 2 * (256 << 20), c
    assert c.cache_copy_bytes_per_s == 2 * (8 << 20) and c.cache_bytes == 32 << 20, c
    assert c.cache_copy == "8 MiB copy in a 32 MiB L3", c


def test_greedy_agreement_by_hand() -> None:
    prompt = torch.tensor([[5, 6], [7, 8], [9, 9]])
    expected = torch.cat((prompt, torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])), 1)
    got = torch.cat((prompt, torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 9, 9]])), 1)
    a = frame.greedy_agreement(expected, got, 2)
    assert a["rows_identical"] == pytest.approx(1 / 3)
    assert a["prefix_agreement"] == pytest.approx((4 + 1 + 2) / 12)  # equal prefixes 4, 1, 2 of 4 new tokens
    assert a["first_divergence"] == {"row": 1, "step": 1}
    assert frame.greedy_agreement(expected, expected, 2)["first_divergence"] is None
    same_step = torch.cat((prompt, torch.tensor([[1, 2, 3, 4], [9, 2, 3, 4], [9, 9, 9, 9]])), 1)
    assert frame.greedy_agreement(expected, same_step, 2)["first_divergence"] == {"row": 1, "step": 0}
    with pytest.raises(ValueError, match="same"):
        frame.greedy_agreement(expected, got[:, :-1], 2)
    with pytest.raises(ValueError, match="start 6"):
        frame.greedy_agreement(expected, got, 6)


def test_compile_heavy_switch(monkeypatch) -> None:
    built = []
    factories = {"torch.compile": lambda: built.append(1) or "compiled"}
    monkeypatch.setenv("WIOLA_BENCH_COMPILED", "0")
    assert frame.compile_heavy(factories) == (
        {},
        ["torch.compile: not run here (compile-heavy baselines, WIOLA_BENCH_COMPILED=0)"],
    )
    assert built == [], "a switched-off baseline must not be built"
    monkeypatch.delenv("WIOLA_BENCH_COMPILED")
    assert frame.compile_heavy(factories) == ({"torch.compile": "compiled"}, []) and built == [1]


class FakeGPU:
    """A stream on a simulated clock, for ``time_cuda`` without CUDA: the host queues work (its
    own clock moves by what each call costs it), the device runs the queue in order and cannot
    finish a call's kernels before the host has queued them; ``_sleep`` spins at ``rate`` cycles
    a second; events complete when the queue reaches them."""

    def __init__(self, rate: float, queue_s: float, gpu_s: float) -> None:
        self.host = self.device = 0.0
        self.rate, self.queue_s, self.gpu_s = rate, queue_s, gpu_s
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = 0.0

            def record(self) -> None:
                gpu.device = self.t = max(gpu.device, gpu.host)

            def elapsed_time(self, other: Event) -> float:
                return (other.t - self.t) * 1e3

        self.Event = Event

    def perf_counter(self) -> float:
        return self.host

    def sleep(self, cycles: int) -> None:
        self.device = max(self.device, self.host) + cycles / self.rate

    def synchronize(self) -> None:
        self.host = max(self.host, self.device)

    def call(self) -> None:  # the measured function
        begin = max(self.device, self.host)
        self.host += self.queue_s
        self.device = max(begin + self.gpu_s, self.host)


@pytest.mark.parametrize("calibrated_at", [1.0, 0.2], ids=["right-rate", "cold-clock-rate"])
def test_time_cuda_times_the_device_when_the_host_is_slower(monkeypatch, calibrated_at) -> None:
    """A call whose host side (20 ms) is slower than its kernels (8 ms): the spin ahead of each
    call lets the host queue it all, so the events time the kernels. A spin rate calibrated at a
    lower clock than the GPU later runs at (a cold GPU) makes the spin short; the timer sees it
    from the spin's own events, rescales the rate and times again."""
    from types import SimpleNamespace

    gpu = FakeGPU(rate=1e9, queue_s=0.020, gpu_s=0.008)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "_sleep", gpu.sleep, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(frame, "time", SimpleNamespace(perf_counter=gpu.perf_counter))
    monkeypatch.setattr(frame, "_SLEEP_CYCLES_PER_S", [gpu.rate * calibrated_at])
    times = frame.time_cuda(lambda: gpu.call(), [()], min_reps=10)
    host = frame.LAST_CUDA_HOST
    assert all(abs(t - 0.008) < 1e-9 for t in times), f"not the device's 8 ms: {times}"
    assert host["host_median_s"] == pytest.approx(0.020)
    assert host["sleep_recalibrated"] == (calibrated_at != 1.0), host
    assert host["gpu_slept_median_s"] == pytest.approx(0.030), host  # 1.5x the host's 20 ms
    # without the spin the same loop times the host: the test can tell the two apart
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    assert frame._median(frame._timed_reps(lambda: gpu.call(), [()], 5, 0.03)[0]) == pytest.approx(0.020)


def test_loop_time_is_a_call_in_a_loop(monkeypatch) -> None:
    """Two warm-up calls, then ``rounds`` loops of ``steps`` calls timed as wholes: the median
    loop over its steps (a fake clock that each call moves on by its own cost)."""
    clock = [0.0]
    costs = iter([9.0, 9.0] + [0.5] * 4 + [0.25] * 4 + [2.0] * 4)  # warm-ups, then 3 loops of 4
    calls = []

    def fn(x):
        calls.append(x)
        clock[0] += next(costs)

    monkeypatch.setattr(frame.time, "perf_counter", lambda: clock[0])
    assert frame.loop_time(fn, (7,), steps=4, rounds=3) == 0.5  # median of 0.5, 0.25, 2.0 a call
    assert calls == [7] * 14


def test_spread_and_ceiling_units_by_hand() -> None:
    """``time_iqr_s`` is the third quartile less the first (statistics' exclusive method: 4.5 for
    1..8); fewer than 4 times have none; the ceilings record GB/s and TFLOP/s in decimal units."""
    assert frame._iqr([1, 2, 3, 4, 5, 6, 7, 8]) == 4.5 and frame._iqr([1, 2, 3]) == 0.0
    c = frame.Ceilings("cpu", "x", 2e12, 20e9, "m", "c", cache_copy_bytes_per_s=50e9)
    d = c.as_dict()
    assert (d["matmul_tflops"], d["copy_gbs"], d["cache_copy_gbs"]) == (2.0, 20.0, 50.0)
