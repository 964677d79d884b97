"""The device check's planner (bench/plan.py) on a small fixture: the build and tuning counts and
the seconds worked out by hand (tests/fixtures/aot_builds_sample.json: invented build seconds), the
look-up order of build seconds, the cache shared between stages; the real kernels' autotuners as
the planner reads them; and the parity plugin's one-config choice."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import parity_plugin, plan  # noqa: E402
from bench.plan import Launch, Stage  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "aot_builds_sample.json"
A = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
B = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
C = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}  # in no record
F1 = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}


def tuners(prune):  # k_attn keeps A and B at head width 32, only A elsewhere; k_ffn has one config
    return [A, B] if prune in (32, None) else [A]


TUNERS = {"k_attn": tuners, "k_ffn": lambda prune: [F1]}


def seconds():
    return plan.build_seconds(plan.load_aot_records(FIXTURE), "sm_90")


def test_build_seconds_lookup_order() -> None:
    s = seconds()
    assert s("k_attn", "bf16", A) == (2.0, "aot_builds.json: this kernel, dtype and config")  # sm_80's 50 s ignored
    assert s("k_attn", "bf16", B)[0] == 3.0  # config given as a dict in the record
    assert s("k_attn", "fp32", B) == (4.0, "aot_builds.json: this kernel and config, another dtype")  # median(3, 5)
    assert s("k_attn", "bf16", C) == (3.0, "aot_builds.json: this kernel's median")  # median(2, 3, 5)
    assert s("k_ffn", "bf16", F1)[0] == 1.0  # dtype and config parsed from the spec name
    assert s("k_other", "bf16", A) == (plan.FALLBACK_SECONDS["*"], plan.FALLBACK_LABEL)
    assert plan.build_seconds([], "sm_90")("attention_fwd", "bf16", A)[0] == plan.FALLBACK_SECONDS["attention_fwd"]


def test_stage_arithmetic_by_hand() -> None:
    launches = [
        Launch("k_attn", "bf16", ("D32", "T16k"), key=(512, 32, "bf16"), prune=32),  # builds A 2 s + B 3 s; times 2
        Launch("k_attn", "bf16", ("D32", "T16k"), key=(512, 32, "bf16"), prune=32),  # the same: nothing new
        Launch("k_attn", "bf16", ("D32", "T16k"), key=(1024, 32, "bf16"), prune=32),  # same builds, a new key: times 2
        Launch(
            "k_attn", "bf16", ("D64", "T16k"), key=(512, 64, "bf16"), prune=64
        ),  # new variant: A 2 s; one config, untimed
        Launch("k_ffn", "bf16", ("N1",)),  # fixed config: F1 1 s
    ]
    stage = Stage("s", "fixture", 100, launches, allowance_s=10, allowance_note="", processes=2, extra_compile_s=7)
    p = plan.plan_stage(stage, TUNERS, seconds(), factor=1.5)
    assert p.compile_s == pytest.approx(1.5 * (2 + 3 + 2 + 1))
    assert p.tune_s == pytest.approx(4 * plan.BENCH_SECONDS_PER_CONFIG)
    assert p.wall_s == pytest.approx((12 + 4 * plan.BENCH_SECONDS_PER_CONFIG) / 2 + 7 + 10)
    rows = {r["kernel"]: r for r in p.rows}
    assert (rows["k_attn"]["builds"], rows["k_attn"]["keys"], rows["k_attn"]["configs"]) == (3, 2, 2)
    assert (rows["k_ffn"]["builds"], rows["k_ffn"]["keys"]) == (1, 0)
    assert p.fits and p.cached_builds == 0


def test_later_stages_reuse_builds_and_on_disk_tuning() -> None:
    ln = Launch("k_attn", "bf16", ("D32",), key=(512, 32), prune=32)
    first = Stage("a", "", 10, [ln], 0, "", autotune_cache=True)
    second = Stage("b", "", 10, [ln, Launch("k_attn", "fp32", ("D32",), key=(512, 32), prune=32)], 0, "",
                   autotune_cache=True)  # fmt: skip
    third = Stage("c", "", 10, [ln], 0, "")  # no on-disk tuning: times the key again
    a, b, c = plan.make_plan([first, second, third], TUNERS, seconds())
    assert (a.compile_s, a.cached_builds) == (5.0, 0)
    assert b.cached_builds == 2 and b.cached_keys == 1
    # fp32 has no records: A from bf16 at sm_90 (2 s; sm_80's 50 s ignored), B = median(bf16 3, fp16 5)
    assert b.compile_s == pytest.approx(2.0 + 4.0)
    assert b.tune_s == pytest.approx(2 * plan.BENCH_SECONDS_PER_CONFIG)  # only the fp32 key
    assert c.compile_s == 0 and c.tune_s == pytest.approx(2 * plan.BENCH_SECONDS_PER_CONFIG)


def test_one_config_and_forced_counts() -> None:
    launches = [
        Launch("k_attn", "bf16", ("D32",), key=(64, 32), prune=32),
        Launch("k_attn", "bf16", ("D32",), key=(128, 32), prune=32),  # same variant, another key: another build
        *plan.forced("k_attn", "bf16", ("forced",)),  # every config (unpruned), never timed
    ]
    p = plan.plan_stage(Stage("p", "", 100, launches, 0, "", one_config=True), TUNERS, seconds())
    assert p.compile_s == pytest.approx(2.5 + 2.5 + 2 + 3)  # two one-config builds at mean(2, 3), then A and B
    assert p.tune_s == pytest.approx(2 * plan.BENCH_SECONDS_PER_CONFIG)


def test_bad_aot_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "aot.json"
    bad.write_text(json.dumps([{"kernel": "k"}]))
    with pytest.raises(ValueError, match="record 0 needs 'kernel' and 'seconds'"):
        plan.load_aot_records(bad)
    bad.write_text(json.dumps({"builds": []}))
    with pytest.raises(ValueError, match="expected a list of build records"):
        plan.load_aot_records(bad)


def test_attention_launches_keys_and_variants() -> None:
    fwd, pre, dq, dkdv = plan.attention("bf16", 32, 300, True, backward=True)
    assert fwd.key == dq.key == dkdv.key == (512, 32, True, "bf16") and pre.key is None
    assert fwd.binary == (32, True, "n", True)  # T 300: neither 1 nor a multiple of 16; residual stored
    assert plan.attention("fp32", 32, 512, False, backward=True)[0].binary == (32, False, "16k", False)
    assert [ln.kernel for ln in plan.attention("bf16", 16, 1, False, backward=False)] == ["attention_fwd"]
    assert plan.butterfly("fp32", 64, 128, 3, None, True)[0].key is None  # fp32: the fixed small tile


def test_real_autotuners_as_the_planner_reads_them() -> None:
    from kernels import attention, butterfly

    t = plan.kernel_tuners()
    want = [c for c in attention.FWD_CONFIGS if 32 in c.head_dims]
    got = t["attention_fwd"](32)
    assert [(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) for c in got] == [c.key() for c in want]
    assert len(t["attention_bwd_dq"](None)) == len(attention.DQ_CONFIGS)
    assert len(t["butterfly_down"](None)) == len(butterfly._DOWN_CONFIGS)


def test_default_plan_puts_the_headline_first_and_fits() -> None:
    plans = plan.make_plan(plan.default_stages(420), plan.kernel_tuners(), plan.build_seconds([]))
    names = [p.stage.name for p in plans]
    assert names[:3] == ["setup", "headline", "parity"]
    assert all(p.fits for p in plans if not p.stage.optional)
    text = plan.format_plan(plans, 420, "fallback")
    assert text.index("== headline") < text.index("== parity") and "each fits its budget" in text


class FakeTuner:
    """The attributes of triton's Autotuner that the plugin uses."""

    def __init__(self) -> None:
        self.keys, self.arg_names = ["D"], ["X", "D"]
        self.nargs = {"X": None, "D": 32}

    def prune_configs(self, kwargs):
        return ["c0", "c1", "c2"]


def test_parity_plugin_one_config_per_key() -> None:
    tuner = FakeTuner()
    parity_plugin.one_config(tuner)
    assert tuner.prune_configs({}) == [parity_plugin.choose(["c0", "c1", "c2"], (32,))]
    tuner.nargs = {"X": None, "D": 64}
    assert tuner.prune_configs({}) == [parity_plugin.choose(["c0", "c1", "c2"], (64,))]
    keys = [(d,) for d in range(16, 200, 8)]
    assert {parity_plugin.choose(["c0", "c1", "c2"], k) for k in keys} == {"c0", "c1", "c2"}, "keys spread over configs"
    with pytest.raises(ValueError, match="no autotune config"):
        parity_plugin.choose([], (1,))


# ------------------------------------------------------------------ the device check's summary
def _stages(**rcs):
    return [{"name": n.replace("_", "-"), "rc": rc, "seconds": 1, "budget": 2, "note": ""} for n, rc in rcs.items()]


def test_device_check_exit_codes() -> None:
    from bench.device_check import SANITIZER_ERRORS, exit_code

    assert exit_code(_stages(setup=0, headline=0, parity=0, extra=None, sanitizer=None)) == 0  # CPU dry run
    assert exit_code(_stages(headline=0, parity=1)) == 1
    assert exit_code(_stages(headline=0, parity=124)) == 1, "parity cut by its time limit is not a pass"
    assert exit_code(_stages(headline=0)) == 1, "parity never ran"
    assert exit_code(_stages(headline=1, parity=0)) == 2
    assert exit_code(_stages(headline=0, parity=0, parity_compile=1)) == 1
    assert exit_code(_stages(headline=0, parity=0, parity_compile=124, extra=124, sanitizer=124)) == 0
    assert exit_code(_stages(headline=0, parity=0, sanitizer=SANITIZER_ERRORS)) == 3
    assert exit_code(_stages(headline=0, parity=0, extra=1)) == 4


def test_headline_table_reads_only_the_headline_stage(tmp_path: Path) -> None:
    from bench.device_check import headline_lines, read_stages

    rec = {"op": "decode", "mode": "greedy", "impl": "wiola.fast", "shape_id": "B1-P512-N256", "dtype": "bfloat16",
           "time_s": 0.5, "tokens_per_s": 512.0, "stage": "headline",
           "baselines": {"reference": {"time_s": 1.0}}, "baselines_pending": ["wiola13m"],
           "info": {"greedy_vs_reference": {"rows_identical": 0.0, "prefix_agreement": 0.25,
                                            "first_divergence": {"row": 0, "step": 14},
                                            "reference_top2_gap_at_divergence": 0.0625}}}  # fmt: skip
    other = {**rec, "stage": "extra", "impl": "other-stage"}
    (tmp_path / "bench.jsonl").write_text(
        json.dumps({"extra_info": rec}) + "\n" + json.dumps({"extra_info": other}) + "\n"
    )
    lines = headline_lines(tmp_path / "bench.jsonl")
    assert len(lines) == 3 and "other-stage" not in "\n".join(lines)
    assert (
        "500 ms" in lines[1]
        and "512" in lines[1]
        and "reference 2.00×" in lines[1]
        and "wiola13m not measured" in lines[1]
    )
    assert "first divergence new token 14 (row 0)" in lines[2] and "top-2 gap there 0.0625" in lines[2]
    assert headline_lines(tmp_path / "missing.jsonl") == ["headline: no results recorded"]
    (tmp_path / "stages.tsv").write_text("setup\t0\t3\t30\tCUDA device found\nextra\t-\t0\t0\tno CUDA device\n")
    assert [(s["name"], s["rc"], s["note"]) for s in read_stages(tmp_path)] == [
        ("setup", 0, "CUDA device found"),
        ("extra", None, "no CUDA device"),
    ]


def test_declared_workloads_follow_the_tests_they_describe() -> None:
    """The planner's parity launches are written from the tests: they must change together."""
    import test_attention
    import test_butterfly
    import test_fast

    assert {(T, D, pad != "none") for _, T, _, D, _, pad in test_attention.CASES} == set(plan._ATTENTION_TEST_CASES)
    assert (test_fast.CONFIG["d_model"] // test_fast.CONFIG["n_heads"], test_fast.CONFIG["d_ff"]) == (16, 128)
    declared = {(1, 64, 128), (17, 64, 128), (300, 64, 128), (17, 256, 512), (300, 256, 512)}
    assert {(math.prod(lead), d, f) for lead, d, f in test_butterfly.SHAPES} == declared


def test_device_check_selections_exist() -> None:
    from bench.device_check import BENCH_FILES, HEADLINE_FILES, PARITY_TESTS, PARITY_TESTS_CPU

    for path in [*PARITY_TESTS, *PARITY_TESTS_CPU, *BENCH_FILES]:
        assert (ROOT / path).is_file(), f"{path} is selected but does not exist"
    gpu_benchmarks = {f"bench/{p.name}" for p in (ROOT / "bench").glob("test_*.py")} - {"bench/test_decode_cpu.py"}
    assert set(BENCH_FILES) == gpu_benchmarks and BENCH_FILES[:3] == HEADLINE_FILES
