"""``bench.ab_tuning``: each value of a tuning knob timed in one process, interleaved, after the
logits were checked bitwise equal across the values (a knob that changes them is caught); bad
arguments exit 2 naming the problem."""

from __future__ import annotations

import warnings

import pytest
import torch

import wiola
from bench import ab_tuning
from wiola.fast import decode_step_cpu

CONFIG = wiola.WiolaConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=64)


@pytest.fixture
def step_built(plain_cpu) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if decode_step_cpu.load() is None:
            pytest.fail(f"the CPU decode step did not build: {decode_step_cpu.BUILD_ERROR}")


@pytest.mark.parametrize("knob,values", [("prefetch_rows", [4, 16]), ("bytes_per_thread", [1, 1 << 30])])
def test_each_value_is_timed_with_equal_logits(knob, values, step_built, tmp_path):
    """bytes_per_thread 1 and 2^30 run the step on every thread and on one: bitwise the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    try:
        rec = ab_tuning.run(knob, values, "int8", batch=2, rounds=2, steps=1, prompt=5, config=CONFIG)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.rand(1), before), "the run moved the global generator"
    assert rec["knob"] == knob and rec["isa"] == decode_step_cpu.select_isa()
    info = decode_step_cpu.cpu_info()
    assert rec["cpu"] == f"{info['model']} (family {info['family']}, model {info['model_number']})", rec["cpu"]
    assert rec["chosen"] == rec["tuning"][knob]
    assert list(rec["values"]) == [str(v) for v in values]
    for r in rec["values"].values():
        assert len(r["times_us"]) == 2 and min(r["times_us"]) == r["min_us"] > 0
    assert rec["values"][str(values[0])]["speed_vs_first"] == 1.0
    assert torch.is_grad_enabled(), "the run left gradients off for the rest of the process"
    text = ab_tuning.summary(rec)
    assert text.splitlines()[0].startswith(f"{knob} on ") and len(text.splitlines()) == 1 + len(values)
    ab_tuning.plot(rec, tmp_path / "ab.png")
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_times_are_per_step_and_speeds_relative_to_the_first_value(step_built, monkeypatch):
    """On a clock that a step advances by 2 ms at ``prefetch_rows`` 4 and 1 ms at 16: each value's
    median and fastest time are per step (blocks of 4 steps), and 16 runs 2.00x as fast as 4."""
    from wiola.fast import step_layout

    index = step_layout.DIMS.index("prefetch_rows")
    clock = [0.0]
    real = decode_step_cpu.DecodeStepCPU.__call__

    def timed(self, tokens, slot):
        clock[0] += 0.002 if self.dims[index] == 4 else 0.001
        return real(self, tokens, slot)

    monkeypatch.setattr(decode_step_cpu.DecodeStepCPU, "__call__", timed)
    monkeypatch.setattr(ab_tuning.time, "perf_counter", lambda: clock[0])
    rec = ab_tuning.run("prefetch_rows", [4, 16], "int8", batch=1, rounds=2, steps=4, prompt=5, config=CONFIG)
    slow, fast = rec["values"]["4"], rec["values"]["16"]
    assert (slow["median_us"], slow["min_us"], fast["median_us"]) == pytest.approx((2000, 2000, 1000))
    assert (slow["speed_vs_first"], fast["speed_vs_first"]) == pytest.approx((1.0, 2.0))
    assert rec["steps_per_block"] == 4


def test_a_knob_that_changes_results_is_caught(step_built, monkeypatch):
    """The equality check can fail: the gate's switch (a dimension that does change the logits)
    passed off as a knob."""
    monkeypatch.setitem(ab_tuning.KNOBS, "gate", (0, 1))
    with pytest.raises(AssertionError, match="gate=\\[0\\] changed the logits against gate=1"):
        ab_tuning.run("gate", [1, 0], "fp32", rounds=1, steps=1, prompt=5, config=CONFIG)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--knob", "threads", "--values", "1", "2"], "--knob 'threads' is not one of"),
        (["--knob", "stream_head", "--values", "0", "2"], "--values [2] out of range for stream_head"),
        (["--knob", "prefetch_rows", "--values", "8"], "at least two distinct values"),
        (["--knob", "prefetch_rows", "--values", "8", "8"], "at least two distinct values, got [8, 8]"),
        (["--knob", "prefetch_rows", "--values", "8", "16", "--batch", "0"], "--batch must be >= 1, got 0"),
        (["--knob", "prefetch_rows", "--values", "8", "16", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["--knob", "prefetch_rows", "--values", "8", "16", "--scheme", "int3"], "--scheme 'int3' is not one of"),
        (["--knob", "prefetch_rows", "--values", "8", "16", "--rounds", "0"], "--rounds must be >= 1"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    assert ab_tuning.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.ab_tuning: error: ") and message in err, err


def test_an_out_that_is_a_file_is_refused_before_timing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ab_tuning, "run", lambda *a, **k: pytest.fail("timed before --out was checked"))
    (tmp_path / "afile").write_text("kept")
    argv = ["--knob", "prefetch_rows", "--values", "0", "8", "--out", str(tmp_path / "afile")]
    assert ab_tuning.main(argv) == 2
    assert (
        capsys.readouterr().err.strip() == f"bench.ab_tuning: error: --out {tmp_path / 'afile'} is a file, not a folder"
    )
    assert (tmp_path / "afile").read_text() == "kept"


def test_too_many_slots_for_the_model_is_refused(step_built):
    with pytest.raises(ValueError, match="cache slots needed"):
        ab_tuning.run("prefetch_rows", [4, 8], rounds=10, steps=5, prompt=5, config=CONFIG)
