"""The device check's planner (bench/plan.py) on a small fixture: the build and tuning counts and
the seconds worked out by hand (tests/fixtures/aot_builds_sample.json: invented build seconds), the
look-up order of build seconds, the cache shared between stages; the real kernels' autotuners as
the planner reads them (pruned per dtype and head width); and the parity plugin's one-config
choice on the real autotuner."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

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


def tuners(dtype, D, rows):  # k_attn keeps A and B at head width 32 (and unpruned), only A elsewhere
    return [A, B] if D in (32, None) else [A]


TUNERS = {"k_attn": tuners}


def seconds():
    return plan.build_seconds(plan.load_aot_records(FIXTURE), "sm_90")


def test_build_seconds_lookup_order() -> None:
    s = seconds()
    # cpu_seconds (2 s) preferred over the wall seconds (9 s); arch 80's 50 s ignored
    assert s("k_attn", "bf16", A) == (2.0, "aot_builds.json: this kernel, dtype and config")
    assert s("k_attn", "bf16", B)[0] == 3.0  # config given as a dict in the record, arch as "sm_90"
    assert s("k_attn", "fp32", B) == (4.0, "aot_builds.json: this kernel and config, another dtype")  # median(3, 5)
    # C is only in k_attn_bwd's records (100 s): k_attn has builds of its own, so those are not its
    assert s("k_attn", "bf16", C) == (2.5, "aot_builds.json: this kernel and dtype, median")  # median(2, 3)
    assert s("k_attn", "bf16", {}) == (2.5, "aot_builds.json: this kernel and dtype, median")  # a fixed build
    assert s("k_attn", "fp32", C) == (3.0, "aot_builds.json: this kernel, median")  # median(2, 3, 5)
    assert s("k_ffn", "bf16", F1)[0] == 1.0  # dtype and config parsed from the spec name
    # an op's name stands for its kernels: k_op_fwd 0.5 s, k_op_bwd 1.5 s (fp32) and 7 s (bf16)
    assert s("k_op", "fp32", {}) == (1.0, "aot_builds.json: the k_op_* kernels and dtype, median")
    assert s("k_op", "fp16", {}) == (1.5, "aot_builds.json: the k_op_* kernels, median")
    assert s("k_other", "bf16", A) == (plan.FALLBACK_SECONDS["*"], plan.FALLBACK_LABEL)
    assert plan.build_seconds([], "sm_90")("attention_fwd", "bf16", A)[0] == plan.FALLBACK_SECONDS["attention_fwd"]


def test_stage_arithmetic_by_hand() -> None:
    launches = [
        Launch("k_attn", "bf16", ("D32", "T16k"), key=(512, 32, "bf16"), D=32),  # builds A 2 s + B 3 s; times 2
        Launch("k_attn", "bf16", ("D32", "T16k"), key=(512, 32, "bf16"), D=32),  # the same: nothing new
        Launch("k_attn", "bf16", ("D32", "T16k"), key=(1024, 32, "bf16"), D=32),  # same builds, a new key: times 2
        Launch(
            "k_attn", "bf16", ("D64", "T16k"), key=(512, 64, "bf16"), D=64
        ),  # new variant: A 2 s; one config, untimed
        Launch("k_ffn", "bf16", ("N1",)),  # fixed config: k_ffn's bf16 median, (1 + 4) / 2 s
    ]
    stage = Stage("s", "fixture", 100, launches, allowance_s=10, allowance_note="", processes=2, extra_compile_s=7)
    p = plan.plan_stage(stage, TUNERS, seconds(), factor=1.5)
    assert p.compile_s == pytest.approx(1.5 * (2 + 3 + 2 + 2.5))
    assert p.tune_s == pytest.approx(4 * plan.BENCH_SECONDS_PER_CONFIG)
    assert p.wall_s == pytest.approx((14.25 + 4 * plan.BENCH_SECONDS_PER_CONFIG) / 2 + 7 + 10)
    rows = {r["kernel"]: r for r in p.rows}
    assert (rows["k_attn"]["builds"], rows["k_attn"]["keys"], rows["k_attn"]["configs"]) == (3, 2, 2)
    assert (rows["k_ffn"]["builds"], rows["k_ffn"]["keys"]) == (1, 0)
    assert p.fits and p.cached_builds == 0


def test_later_stages_reuse_builds_and_on_disk_tuning() -> None:
    ln = Launch("k_attn", "bf16", ("D32",), key=(512, 32), D=32)
    first = Stage("a", "", 10, [ln], 0, "", autotune_cache=True)
    second = Stage("b", "", 10, [ln, Launch("k_attn", "fp32", ("D32",), key=(512, 32), D=32)], 0, "",
                   autotune_cache=True)  # fmt: skip
    third = Stage("c", "", 10, [ln], 0, "")  # no on-disk tuning: times the key again
    a, b, c = plan.make_plan([first, second, third], TUNERS, seconds())
    assert (a.compile_s, a.cached_builds) == (5.0, 0)
    assert b.cached_builds == 1 and b.cached_keys == 1  # the key's winner loaded from disk, built by a
    # fp32 has no records: A from bf16 at sm_90 (2 s; sm_80's 50 s ignored), B = median(bf16 3, fp16 5)
    assert b.compile_s == pytest.approx(2.0 + 4.0)
    assert b.tune_s == pytest.approx(2 * plan.BENCH_SECONDS_PER_CONFIG)  # only the fp32 key
    assert c.compile_s == 0 and c.tune_s == pytest.approx(2 * plan.BENCH_SECONDS_PER_CONFIG)


def test_a_tuned_key_builds_only_its_winner_for_a_new_variant() -> None:
    key = (512, 32, "bf16")
    first = Launch("k_attn", "bf16", ("D32", "T16k"), key=key, D=32)
    other_T = Launch("k_attn", "bf16", ("D32", "T1"), key=key, D=32)  # same key, another binary
    third_T = Launch("k_attn", "bf16", ("D32", "Tn"), key=key, D=32)
    a, b = plan.make_plan(
        [Stage("a", "", 10, [first, other_T], 0, "", autotune_cache=True),
         Stage("b", "", 10, [third_T, first], 0, "", autotune_cache=True)],
        TUNERS, seconds(),
    )  # fmt: skip
    assert a.compile_s == pytest.approx(2 + 3 + 2.5)  # A and B tuned on T16k, then the winner (mean 2.5) for T1
    assert a.tune_s == pytest.approx(2 * plan.BENCH_SECONDS_PER_CONFIG)
    # the key is on disk: the winner for the new binary only, untimed; T16k's configs are all cached
    assert (b.compile_s, b.tune_s, b.cached_keys, b.cached_builds) == (2.5, 0.0, 1, 1)


def test_one_config_and_forced_counts() -> None:
    launches = [
        Launch("k_attn", "bf16", ("D32",), key=(64, 32), D=32),
        Launch("k_attn", "bf16", ("D32",), key=(128, 32), D=32),  # same variant, another key: another build
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
    with pytest.raises(ValueError, match="no build records"):
        plan.load_aot_records(bad)
    bad.write_text(json.dumps({"triton": "3.6.0", "records_of_builds": [{"kernel": "k", "seconds": 1}]}))
    with pytest.raises(ValueError, match="expected a list of build records"):
        plan.load_aot_records(bad)


def test_attention_launches_keys_and_variants() -> None:
    fwd, pre, dq, dkdv = plan.attention("bf16", 32, 300, True, backward=True)
    assert fwd.key == (512, 32, True, True, "bf16")  # T_BUCKET, D, HAS_MASK, STORE_RESIDUAL, dtype
    assert dq.key == dkdv.key == (512, 32, True, "bf16") and pre.key is None  # no STORE_RESIDUAL
    assert fwd.binary == (32, True, "n", True)  # T 300: neither 1 nor a multiple of 16; residual stored
    assert plan.attention("bf16", 32, 300, True, backward=False)[0].key == (512, 32, True, False, "bf16")
    assert plan.attention("fp32", 32, 512, False, backward=True)[0].binary == (32, False, "16k", False)
    assert [ln.kernel for ln in plan.attention("bf16", 16, 1, False, backward=False)] == ["attention_fwd"]


def test_butterfly_launches_keys_and_variants() -> None:
    up, down, up_bwd = plan.butterfly("bf16", 64, 128, 51, "fp32", backward=True)
    assert up.key == up_bwd.key == (64, 64, 128, "bf16")  # N_BUCKET 64 for N 51, D, F, dtype
    assert down.key == (64, 64, 128, True, "bf16", "fp32") and down.binary == ("n", "fp32")
    one, eight = plan.butterfly("bf16", 256, 512, 1, None, False), plan.butterfly("bf16", 256, 512, 8, None, False)
    assert one[0].key == eight[0].key == (16, 256, 512, "bf16") and one[0].binary != eight[0].binary
    assert plan.butterfly("bf16", 256, 512, 32768, None, False)[0].key[0] == 16384  # the bucket's cap
    assert all(ln.key is None for ln in plan.butterfly("fp32", 64, 128, 3, None, True))  # the fixed small tile


_LISTS = {"attention_fwd": "FWD_CONFIGS", "attention_bwd_dq": "DQ_CONFIGS", "attention_bwd_dkdv": "DKDV_CONFIGS"}


def test_real_autotuners_as_the_planner_reads_them() -> None:
    from wiola_kernels import attention, butterfly

    t = plan.kernel_tuners()
    assert set(t) == {*_LISTS, "butterfly_up", "butterfly_up_bwd", "butterfly_down"}
    for kernel, name in _LISTS.items():
        lists = getattr(attention, name)
        every = {c.key() for cfgs in lists.values() for c in cfgs}
        assert {(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) for c in t[kernel](None, None)} == every
        for dtype, cls in (("fp32", "fp32"), ("bf16", "half"), ("fp16", "half")):
            for D in attention.SUPPORTED_HEAD_DIMS:
                got = {(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) for c in t[kernel](dtype, D)}
                assert got == {c.key() for c in lists[cls] if D in c.head_dims}, (kernel, dtype, D)
    for rows, cls in ((16, "few"), (butterfly.FEW_ROWS, "few"), (2 * butterfly.FEW_ROWS, "many")):
        for name, lists in (("butterfly_up", butterfly.UP_CONFIGS), ("butterfly_down", butterfly.DOWN_CONFIGS)):
            got = {
                (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"])
                for c in t[name]("bf16", None, rows)
            }
            assert got == {c.key() for c in lists[cls]}, (name, rows)
    assert len(t["butterfly_up_bwd"](None, None)) == len(butterfly._UP_BWD_CONFIGS)


def test_stage_counts_what_the_real_autotuners_compile() -> None:
    """bf16 D 64 attention forward + backward and a bf16 and fp32 butterfly, counted by hand from
    the kernels' config lists: the half lists at D 64; butterfly fp32 is one fixed build each."""
    from wiola_kernels import attention, butterfly

    launches = plan.attention("bf16", 64, 300, True, True) + plan.butterfly("bf16", 64, 128, 17, None, True)
    launches += plan.butterfly("fp32", 64, 128, 17, None, True)
    p = plan.plan_stage(Stage("s", "", 100, launches, 0, ""), plan.kernel_tuners(), plan.build_seconds([]))
    rows = {r["kernel"]: (r["builds"], r["keys"]) for r in p.rows}
    at64 = {k: sum(64 in c.head_dims for c in getattr(attention, n)["half"]) for k, n in _LISTS.items()}
    assert rows == {
        **{k: (n, 1) for k, n in at64.items()},
        "attention_bwd_preprocess": (1, 0),
        "butterfly_up": (len(butterfly.UP_CONFIGS["few"]) + 1, 1),  # N 17: few rows
        "butterfly_down": (len(butterfly.DOWN_CONFIGS["few"]) + 1, 1),
        "butterfly_up_bwd": (len(butterfly._UP_BWD_CONFIGS) + 1, 1),
    }
    assert p.tune_s == pytest.approx(
        (sum(at64.values()) + len(butterfly.UP_CONFIGS["few"]) + len(butterfly.DOWN_CONFIGS["few"])
         + len(butterfly._UP_BWD_CONFIGS)) * plan.BENCH_SECONDS_PER_CONFIG
    )  # fmt: skip


def test_bad_aot_and_arch_exit_2(tmp_path, capsys) -> None:
    """An --aot file asked for by name that is missing or not JSON, an --arch that is no CUDA
    architecture or has no build in the records: one line, exit 2 (not a plan of fallbacks)."""
    (tmp_path / "bad.json").write_text("{")
    for argv, message in (
        (["--aot", str(tmp_path / "missing.json")], f"--aot {tmp_path / 'missing.json'} does not exist"),
        (["--aot", str(tmp_path / "bad.json")], f"--aot {tmp_path / 'bad.json'}: Expecting property name"),
        (["--arch", "hopper"], "--arch must be a CUDA architecture such as sm_90, got 'hopper'"),
        (["--arch", "sm_99"], "--arch sm_99: "),
    ):
        with pytest.raises(SystemExit) as exit_info:
            plan.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv


def test_default_plan_puts_the_headline_first_and_fits() -> None:
    plans = plan.make_plan(plan.default_stages(420), plan.kernel_tuners(), plan.build_seconds([]))
    names = [p.stage.name for p in plans]
    assert names[:3] == ["setup", "headline", "parity"]
    assert all(p.fits for p in plans if not p.stage.optional)
    text = plan.format_plan(plans, 420, "fallback")
    assert text.index("== headline") < text.index("== parity") and "each fits its budget" in text
    required = [p for p in plans if not p.stage.optional]  # the totals line counts these alone
    estimate, budgets = sum(p.wall_s for p in required), sum(p.stage.budget_s for p in required)
    assert f"required stages (setup, headline, parity): estimate {estimate:.0f} s, budgets {budgets:.0f} s of" in text
    assert estimate <= budgets <= 420 and any(p.stage.optional for p in plans), "the optional stages are left out"


def test_a_short_run_shrinks_the_required_stages_as_the_script_does(capsys) -> None:
    """``device_check.sh`` gives the headline at most what leaves the parity stage and the report
    theirs, and the parity stage what leaves the report its own: at 100 s that is 0 s and 50 s."""
    budgets = {s.name: s.budget_s for s in plan.default_stages(100)}
    b = plan.BUDGETS
    assert budgets["headline"] == 0 and budgets["parity"] == 100 - b["setup"] - b["report"]
    assert {s.name: s.budget_s for s in plan.default_stages(420)}["headline"] == b["headline"]
    # between: the headline leaves setup, parity and the report theirs; extra takes what every
    # other stage (the sanitizer's and the split's included) leaves
    for total, headline, extra in ((300, 140, 0), (320, 160, 0), (420, 160, 0), (500, 160, 60)):
        budgets = {s.name: s.budget_s for s in plan.default_stages(total)}
        assert (budgets["headline"], budgets["extra"]) == (headline, extra), (total, budgets)
        assert headline == min(b["headline"], total - b["setup"] - b["parity"] - b["report"])
        others = ("setup", "headline", "parity", "split", "sanitizer", "report")
        assert extra == max(0, total - sum(b[k] for k in others))
    assert plan.main(["--budget", "100"]) == 1
    assert "a required stage does NOT fit" in capsys.readouterr().out
    assert plan.main([]) == 0
    out = capsys.readouterr().out
    records = plan.load_aot_records(plan.DEFAULT_AOT)
    mine = sum(r["arch"] in (None, "sm_90") for r in records)
    assert f"({mine} of its {len(records)} records for sm_90)" in out, out.splitlines()[0]
    for flag in ("--budget", "--factor"):
        with pytest.raises(SystemExit) as exit_info:
            plan.main([flag, "-5"])
        assert exit_info.value.code == 2 and f"{flag} must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_parity_plugin_picks_one_of_the_dtype_pruned_configs(dtype: torch.dtype) -> None:
    """On a copy of the real forward autotuner: per key one config, always one listed for q's
    dtype class and D (the autotuner's own pruning), and different keys get different ones."""
    from wiola_kernels import attention

    tuner = copy.copy(attention._attn_fwd_tuned)
    parity_plugin.one_config(tuner)
    cls = "fp32" if dtype == torch.float32 else "half"
    for D in attention.SUPPORTED_HEAD_DIMS:
        listed = {c.key() for c in attention.FWD_CONFIGS[cls] if D in c.head_dims}
        chosen = set()
        for bucket in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            tuner.nargs = {"Q": torch.empty(0, dtype=dtype), "T_BUCKET": bucket}
            picked = tuner.prune_configs({"D": D, "HAS_MASK": False, "STORE_RESIDUAL": False})
            assert len(picked) == 1
            c = picked[0]
            chosen.add((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages))
        assert chosen <= listed, f"{dtype} D={D}: chose {sorted(chosen - listed)}, not listed for it"
        assert len(chosen) > 1, f"{dtype} D={D}: every key got the same config of {len(listed)}"
    assert attention._attn_fwd_tuned.prune_configs is not tuner.prune_configs  # the original is untouched
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
    assert exit_code(_stages(headline=0, parity=0, split=1)) == 4
    assert exit_code(_stages(headline=0, parity=0, split=124, extra=None)) == 0, "split cut by its limit"


def test_decode_split_lines(tmp_path: Path) -> None:
    from bench.device_check import split_lines

    assert split_lines(tmp_path / "split.jsonl") == []  # the stage did not run
    row = {"batch": 1, "new": 256, "generate_s": 0.060, "prefill_s": 0.004, "prefill_host_s": 0.0038,
           "replay_s_per_step": 188e-6, "generate_kernel_busy_s": 0.050}  # fmt: skip
    (tmp_path / "split.jsonl").write_text(
        json.dumps(row) + "\nTraceback (most recent call last):\n" + json.dumps({"batch": 8})
    )
    (line,) = split_lines(tmp_path / "split.jsonl")  # the partial record and the traceback are skipped
    assert line == (
        "decode split B1: generate 60.0 ms = prefill 4.00 ms (host 3.80 ms to issue it) + 256 steps × 188 µs "
        "replayed (48.1 ms) + the rest 7.9 ms; GPU idle 10.0 ms of the call"
    ), line


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
    # time_cuda's host-side times, where recorded, get a line of their own under the result
    rec["host"] = {"warmup_s": [2.5, 0.25, 0.125], "host_median_s": 0.375, "gpu_sleep_s": 0.0,
                   "gpu_slept_median_s": 0.03, "sleep_recalibrated": True}  # fmt: skip
    (tmp_path / "bench.jsonl").write_text(json.dumps({"extra_info": rec}) + "\n")
    lines = headline_lines(tmp_path / "bench.jsonl")
    assert (
        len(lines) == 4
        and "host: 375 ms a timed call (GPU 500 ms, spun 30 ms ahead, spin rate recalibrated)" in lines[2]
    ), lines
    assert "warm-up calls 2.5 s, 250 ms, 125 ms" in lines[2], lines[2]
    # frame.loop_time's pace in a loop, where recorded, gets its line too
    rec["info"] = {**rec["info"], "loop_s_per_step": 1.5, "loop_tokens_per_s": 341.0, "loop_steps": 10}
    (tmp_path / "bench.jsonl").write_text(json.dumps({"extra_info": rec}) + "\n")
    lines = headline_lines(tmp_path / "bench.jsonl")
    assert "in a loop (10 calls back to back, one sync): 1.5 s a call, 341 tok/s, 3.00× the device time" in lines[3]
    assert headline_lines(tmp_path / "missing.jsonl") == ["headline: no results recorded"]
    (tmp_path / "stages.tsv").write_text("setup\t0\t3\t30\tCUDA device found\nextra\t-\t0\t0\tno CUDA device\n")
    assert [(s["name"], s["rc"], s["note"]) for s in read_stages(tmp_path)] == [
        ("setup", 0, "CUDA device found"),
        ("extra", None, "no CUDA device"),
    ]


def test_declared_workloads_follow_the_tests_they_describe() -> None:
    """The planner reads its parity launches from the tests' own constants (as importing them gives)."""
    import test_attention
    import test_butterfly
    import test_fast

    assert {(T, D, pad != "none") for _, T, _, D, _, pad in test_attention.CASES} == set(plan.attention_test_cases())
    assert plan.read_test_constant("test_fast.py", "CONFIG") == test_fast.CONFIG
    declared = {(math.prod(lead), d, f) for lead, d, f in test_butterfly.SHAPES}
    assert set(plan.butterfly_test_shapes()) == declared
    with pytest.raises(ValueError, match="no module-level constant NOPE"):
        plan.read_test_constant("test_fast.py", "NOPE")


def test_device_check_selections_exist() -> None:
    from bench.device_check import BENCH_FILES, HEADLINE_FILES, PARITY_TESTS, PARITY_TESTS_CPU

    for path in [*PARITY_TESTS, *PARITY_TESTS_CPU, *BENCH_FILES]:
        assert (ROOT / path).is_file(), f"{path} is selected but does not exist"
    gpu_benchmarks = {f"bench/{p.name}" for p in (ROOT / "bench").glob("test_*.py")} - {"bench/test_decode_cpu.py"}
    assert set(BENCH_FILES) == gpu_benchmarks and BENCH_FILES[:3] == HEADLINE_FILES
