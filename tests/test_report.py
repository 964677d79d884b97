"""bench/report.py on a fixture (tests/fixtures/bench_sample.json: invented numbers, not results):
the generated tables carry the fixture's measurements, the speed-ups computed from them, the
unavailable baselines with their reasons, and the links between runs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "bench_sample.json"


def _table_rows(md: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the first markdown table after ``heading``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and heading in line)
    table = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip("|").split("|")])
        elif table:
            break
    return table[0], table[2:]


@pytest.fixture
def sample_md(tmp_path: Path) -> str:
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(FIXTURE), "--out", str(out)]) == 0
    return out.read_text()


def test_attention_table_numbers(sample_md: str) -> None:
    header, rows = _table_rows(sample_md, "attention fwd_bwd")
    assert header == [
        "shape", "dtype", "impl", "ours", "TFLOP/s", "GB/s", "% of floor", "reference", "torch.compile", "flex_attention",
    ]  # fmt: skip
    assert len(rows) == 1, f"attention table rows: {rows}"
    row = dict(zip(header, rows[0]))
    assert row["shape"] == "B32-T512-H8-D32"
    assert row["ours"] == "1.23 ms"  # time_s 0.00123
    assert row["TFLOP/s"] == "12.3"
    assert row["GB/s"] == "456"
    assert row["% of floor"] == "45%"
    # speed-ups recomputed from the medians: 0.00456 / 0.00123 = 3.7073 -> 3.71×; 0.00246 / 0.00123 = 2.00×
    assert row["reference"] == "4.56 ms (ours 3.71×)"
    assert row["torch.compile"] == "2.46 ms (ours 2.00×)"
    assert row["flex_attention"] == "n/a [1]"
    assert "[1] unavailable: ImportError: cannot import name 'flex_attention'" in sample_md


def test_decode_table_tokens_per_second(sample_md: str) -> None:
    header, rows = _table_rows(sample_md, "decode greedy")
    row = dict(zip(header, rows[0]))
    assert row["impl"] == "wiola.fast"
    assert row["ours"] == "32 ms · 8,000 tok/s"
    assert row["% of floor"] == "5.5%"  # 5.46875 -> one decimal under 10%
    assert row["reference"] == "128 ms · 2,000 tok/s (ours 4.00×)"  # 0.128 / 0.032
    assert row["wiola13m"] == "512 ms · 500 tok/s (ours 16.00×)"  # 0.512 / 0.032
    assert "Note: fixture note" in sample_md


def test_metadata_and_ceilings(sample_md: str) -> None:
    assert "## GPU: FIXTURE-GPU (not a measurement) — latest run" in sample_md
    assert "matmul bf16 8192x8192x8192 at 1,000 TFLOP/s; copy 2.0 GiB device-to-device at 4,000 GB/s" in sample_md
    assert "driver 0.0" in sample_md and "torch 0.0.0-fixture" in sample_md
    assert report.UNMEASURED_GPU not in sample_md  # a GPU run is present
    assert "test_not_from_the_frame" not in sample_md  # records without the frame's fields are left out


def test_latest_run_shown_and_older_linked(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    old_dir, new_dir = tmp_path / "results" / "2000-01-02_gpu", tmp_path / "results" / "2000-02-03_gpu"
    old_dir.mkdir(parents=True)
    new_dir.mkdir(parents=True)
    shutil.copy(FIXTURE, old_dir / "bench.json")
    data["machine_info"]["wiola"]["date"] = "2000-02-03T00:00:00Z"
    data["benchmarks"][0]["extra_info"]["time_s"] = 0.00228  # reference 0.00456 -> 2.00×
    (new_dir / "bench.json").write_text(json.dumps(data))
    out = tmp_path / "BENCHMARKS.md"
    report.main([str(old_dir / "bench.json"), str(new_dir / "bench.json"), "--out", str(out)])
    md = out.read_text()
    _, rows = _table_rows(md, "attention fwd_bwd")
    assert rows[0][3] == "2.28 ms" and rows[0][7] == "4.56 ms (ours 2.00×)", f"latest run not shown: {rows}"
    assert md.count("### attention fwd_bwd") == 1, "only the latest run is tabulated"
    assert "- 2000-01-02T03:04:05Z: [results/2000-01-02_gpu/bench.json](results/2000-01-02_gpu/bench.json)" in md


def test_each_table_from_the_newest_run_that_has_it(tmp_path: Path) -> None:
    """A newer run with the decoding rows alone leaves the attention table to the older run, which
    is then shown, not merely linked."""
    data = json.loads(FIXTURE.read_text())
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(data))
    data["machine_info"]["wiola"]["date"] = "2000-02-03T00:00:00Z"
    data["benchmarks"] = [b for b in data["benchmarks"] if b["extra_info"].get("op") == "decode"]
    data["benchmarks"][0]["extra_info"]["time_s"] = 0.016  # 16,000 tok/s: 256 tokens
    data["benchmarks"][0]["extra_info"]["tokens_per_s"] = 16000.0
    new.write_text(json.dumps(data))
    out = tmp_path / "BENCHMARKS.md"
    report.main([str(old), str(new), "--out", str(out)])
    md = out.read_text()
    assert md.count("### decode greedy") == 1 and md.count("### attention fwd_bwd") == 1, md
    _, rows = _table_rows(md, "decode greedy")
    assert rows[0][3] == "16 ms · 16,000 tok/s", f"decode table not from the newer run: {rows}"
    _, rows = _table_rows(md, "attention fwd_bwd")
    assert rows[0][3] == "1.23 ms", rows
    assert md.index("date 2000-02-03") < md.index("### decode greedy") < md.index("date 2000-01-02")
    assert "Raw results: [new.json](new.json)" in md and "Raw results: [old.json](old.json)" in md
    assert "Earlier" not in md  # both runs are shown


def test_cpu_only_says_gpu_unmeasured(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    data["machine_info"]["wiola"]["gpu"] = None
    for b in data["benchmarks"]:
        b["extra_info"]["device"] = "cpu"
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    md = report.build_markdown([report.load_run(path)], tmp_path / "B.md")
    assert report.UNMEASURED_GPU in md
    assert "## CPU (its model not recorded) — latest run" in md  # the fixture's records name no CPU


def test_jsonl_input_and_charts(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    jsonl = tmp_path / "bench.jsonl"
    jsonl.write_text("\n".join(json.dumps(b) for b in data["benchmarks"]) + "\n")
    run = report.load_run(jsonl)
    assert [r["op"] for r in run.records] == ["attention", "decode"]
    paths = report.write_charts(run, tmp_path / "charts")
    assert sorted(paths) == ["attention fwd_bwd", "decode greedy"]
    for p in paths.values():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{p} is not a PNG"
    combined = report.write_combined_chart(run, tmp_path / "all.png")
    assert combined is not None and combined.read_bytes()[:4] == b"\x89PNG"


def test_chart_series_values() -> None:
    run = report.load_run(FIXTURE)
    decode = [r for r in run.records if r["op"] == "decode"]
    labels, series, unit = report._chart_series(decode)
    assert unit.startswith("tokens/s")
    assert series == {"wiola.fast": [8000.0], "reference": [2000.0], "wiola13m": [500.0]}
    attn = [r for r in run.records if r["op"] == "attention"]
    _, series, unit = report._chart_series(attn)
    assert unit.startswith("ms")
    # flex_attention was unavailable on every record: no series (no legend entry, no bar slot)
    assert set(series) == {"ours", "reference", "torch.compile"}, series
    assert series["ours"] == [pytest.approx(1.23)] and series["reference"] == [pytest.approx(4.56)]
    measured_once = [{**attn[0], "baselines": {"flex_attention": {"time_s": 2e-3}}}, attn[0]]
    _, series, _ = report._chart_series(measured_once)
    assert series["flex_attention"] == [pytest.approx(2.0), None], series


def test_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match="no results file"):
        report.load_run(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("this is not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        report.load_run(bad)
    for path, message in ((tmp_path / "missing.json", "no results file"), (bad, "line 1 is not JSON")):
        with pytest.raises(SystemExit) as exit_info:
            report.main([str(path), "--out", str(tmp_path / "out.md")])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out.md").exists()
    other = tmp_path / "quality.json"
    other.write_text(json.dumps({"env": {}, "results": []}, indent=2))
    with pytest.raises(ValueError, match='JSON, but not a pytest-benchmark results file \\(no "benchmarks" list\\)'):
        report.load_run(other)
    (tmp_path / "afile").write_text("kept")
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(FIXTURE), "--out", str(tmp_path / "afile" / "out.md"), "--charts", str(tmp_path / "c")])
    assert exit_info.value.code == 2 and f"{tmp_path / 'afile'} is not a folder" in capsys.readouterr().err
    assert not (tmp_path / "c").exists(), "charts drawn before --out was checked"


@pytest.mark.parametrize(
    "seconds, text", [(2.5, "2.5 s"), (0.00123, "1.23 ms"), (4.56e-5, "45.6 µs"), (0.032, "32 ms")]
)
def test_fmt_time(seconds: float, text: str) -> None:
    assert report.fmt_time(seconds) == text


ZEN4_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni vaes"
ZEN3_FLAGS = "fpu sse2 avx avx2 fma vaes"


def _cpu_run(
    directory: Path,
    date: str,
    model: str,
    flags: str,
    tok_s: float,
    read_pct: float | None,
    cpuinfo: dict | None = None,
) -> Path:
    """A CPU results file like bench/test_decode_cpu.py's: the fixture's decode record moved to a
    CPU (``cpuinfo``: pytest-benchmark's ``machine_info["cpu"]``, py-cpuinfo's fields)."""
    data = json.loads(FIXTURE.read_text())
    data["machine_info"]["wiola"] = {"date": date, "gpu": None, "cpu": "x86_64", "cpu_count": 2, "torch": "t"}
    if cpuinfo is not None:
        data["machine_info"]["cpu"] = cpuinfo
    decode = next(b for b in data["benchmarks"] if b["extra_info"].get("op") == "decode")
    info = decode["extra_info"]
    info.update(device="cpu", cpu_model=model, cpu_flags=flags, time_s=256 / tok_s, tokens_per_s=tok_s)
    info["notes"] = [f"CPU flags: {flags}", f"CPU: {model} (x86_64)"]
    if read_pct is not None:
        info["pct_read_floor"] = read_pct
    data["benchmarks"] = [decode]
    directory.mkdir(parents=True)
    path = directory / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_cpu_runs_grouped_by_machine(tmp_path: Path) -> None:
    """Each CPU (model name, family and model numbers, vector units) gets its latest run in full; a
    run recorded without the numbers joins the one numbered CPU of its name and units."""
    zen4 = "AMD EPYC (family 25, model 17)"
    new4 = _cpu_run(tmp_path / "r" / "zen4-new", "2000-03-01T00:00:00Z", zen4, ZEN4_FLAGS, 2000.0, 41.0)
    old4 = _cpu_run(tmp_path / "r" / "zen4-old", "2000-02-01T00:00:00Z", "AMD EPYC", ZEN4_FLAGS, 1000.0, None)
    zen3 = _cpu_run(tmp_path / "r" / "zen3", "2000-02-15T00:00:00Z", "AMD EPYC", ZEN3_FLAGS, 800.0, 55.5)
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(old4), str(zen3), str(new4), "--out", str(out), "--charts", str(tmp_path / "c")]) == 0
    md = out.read_text()
    titles = [line for line in md.splitlines() if line.startswith("## ")]
    assert titles == [
        "## CPU: AMD EPYC (family 25, model 17), AVX-512 with BF16/VNNI — latest run",
        "## CPU: AMD EPYC, AVX2 — latest run",
    ], titles
    assert report.UNMEASURED_GPU in md
    header, rows = _table_rows(md, "decode greedy")  # the first table: Zen 4's newest run
    row = dict(zip(header, rows[0]))
    assert row["ours"] == "128 ms · 2,000 tok/s" and row["% of read floor"] == "41%", row
    zen3_section = md[md.index("## CPU: AMD EPYC, AVX2") :]
    header, rows = _table_rows(zen3_section, "decode greedy")
    assert dict(zip(header, rows[0]))["% of read floor"] == "56%"  # 55.5, rounded
    assert "- 2000-02-01T00:00:00Z: [r/zen4-old/bench.json]" in md  # listed under Zen 4, not tabulated
    assert md.count("### decode greedy") == 2
    assert "CPU vector flags: avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni" in md
    assert "vaes" not in md and "fpu" not in md  # the flags note keeps the vector units only
    assert "Note: CPU: " not in md  # the metadata line names the CPU
    charts = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert charts == [
        "AMD_EPYC_AVX2_decode_greedy.png",
        "AMD_EPYC_family_25_model_17_AVX-512_with_BF16_VNNI_decode_greedy.png",
    ], charts


def test_cpu_numbers_from_machine_info(tmp_path: Path) -> None:
    """Records without the family and model numbers take them from pytest-benchmark's
    ``machine_info`` (py-cpuinfo), so an older run joins its own CPU when two numbered CPUs share
    the name and units; a run whose records name no CPU is labelled from ``machine_info`` alone."""
    zen4, zen5 = "AMD EPYC (family 25, model 17)", "AMD EPYC (family 26, model 2)"
    info = {"brand_raw": "AMD EPYC", "family": 25, "model": 17, "flags": ZEN4_FLAGS.split()}
    runs = [
        _cpu_run(tmp_path / "r" / "zen4", "2000-03-01T00:00:00Z", zen4, ZEN4_FLAGS, 2000.0, 41.0),
        _cpu_run(tmp_path / "r" / "zen5", "2000-03-02T00:00:00Z", zen5, ZEN4_FLAGS, 3000.0, 80.0),
        _cpu_run(tmp_path / "r" / "old", "2000-02-01T00:00:00Z", "AMD EPYC", ZEN4_FLAGS, 1000.0, None, info),
        _cpu_run(tmp_path / "r" / "bare", "2000-01-01T00:00:00Z", "", "", 900.0, None, info),
    ]
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([*map(str, runs), "--out", str(out)]) == 0
    md = out.read_text()
    titles = [line for line in md.splitlines() if line.startswith("## ")]
    assert titles == [
        "## CPU: AMD EPYC (family 26, model 2), AVX-512 with BF16/VNNI — latest run",
        "## CPU: AMD EPYC (family 25, model 17), AVX-512 with BF16/VNNI — latest run",
    ], titles
    zen4_section = md[md.index(titles[1].removeprefix("## ")) :]
    for name in ("old", "bare"):
        assert f"[r/{name}/bench.json]" in zen4_section, name
    for model in ("AMD EPYC", zen4):  # the numbers once, whether the record's name has them or not
        assert report.cpu_label({"cpu_model": model, "cpu_flags": "avx2 fma"}, "family 25, model 17") == f"{zen4}, AVX2"


@pytest.mark.parametrize("ceiling, cell", [(129.4, "129%"), (7.25, "7.2%"), (None, "—")])
def test_ceiling_column(tmp_path: Path, ceiling: float | None, cell: str) -> None:
    """A tg record with the most of its read floor a step reaches at the multiply-add peak gets the
    column; a record without it, a dash; a table where no record has it, no column."""
    path = _cpu_run(tmp_path / "r", "2000-03-01T00:00:00Z", "AMD EPYC (family 26, model 2)", ZEN4_FLAGS, 4000.0, 31.0)
    data = json.loads(path.read_text())
    if ceiling is not None:
        data["benchmarks"][0]["extra_info"].update(read_ceiling_pct=ceiling)
    data["benchmarks"].append(json.loads(json.dumps(data["benchmarks"][0])))
    data["benchmarks"][1]["extra_info"].update(read_ceiling_pct=24.0)
    path.write_text(json.dumps(data))
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(path), "--out", str(out), "--charts", str(tmp_path / "c")]) == 0
    header, rows = _table_rows(out.read_text(), "decode greedy")
    assert [dict(zip(header, row))["most at the FMA peak"] for row in rows] == [cell, "24%"], rows
    plain = _cpu_run(tmp_path / "p", "2000-03-01T00:00:00Z", "AMD EPYC (family 26, model 2)", ZEN4_FLAGS, 4000.0, 31.0)
    assert report.main([str(plain), "--out", str(out), "--charts", str(tmp_path / "c")]) == 0
    assert "most at the FMA peak" not in _table_rows(out.read_text(), "decode greedy")[0]


@pytest.mark.parametrize(
    "bound, pct, cell",
    [("the multiply-adds", 69.6, "compute (70%)"), ("reading the weights", 8.25, "read (8.2%)"), (None, None, "—")],
)
def test_bound_column(tmp_path: Path, bound: str | None, pct: float | None, cell: str) -> None:
    """A tg record that says what bounds its step gets the column: which floor and the % of it reached;
    a record without it, a dash."""
    path = _cpu_run(tmp_path / "r", "2000-03-01T00:00:00Z", "AMD EPYC (family 26, model 2)", ZEN4_FLAGS, 4000.0, 31.0)
    data = json.loads(path.read_text())
    if bound is not None:
        data["benchmarks"][0]["extra_info"].update(bound_by=bound, pct_roofline=pct)
    data["benchmarks"].append(json.loads(json.dumps(data["benchmarks"][0])))  # a second row, always bounded
    data["benchmarks"][1]["extra_info"].update(bound_by="the multiply-adds", pct_roofline=50.0)
    path.write_text(json.dumps(data))
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(path), "--out", str(out), "--charts", str(tmp_path / "c")]) == 0
    header, rows = _table_rows(out.read_text(), "decode greedy")
    assert [dict(zip(header, row))["bound by (% of it)"] for row in rows] == [cell, "compute (50%)"], rows


@pytest.mark.parametrize(
    "flags, units",
    [
        (ZEN4_FLAGS, "AVX-512 with BF16/VNNI"),
        ("avx2 avx512f avx512_bf16 avx512_vnni avx512_fp16 amx_tile amx_bf16", "AVX-512 with BF16/VNNI/FP16, AMX"),
        ("avx512f avx512bw", "AVX-512"),
        (ZEN3_FLAGS, "AVX2"),
        ("fp asimd asimdhp sve", "SVE"),
        ("fp asimd", "NEON"),
        ("fpu sse2", ""),
    ],
)
def test_vector_units(flags: str, units: str) -> None:
    assert report.vector_units(flags) == units


@pytest.mark.parametrize(
    "host, flagged",
    [
        ({"gpu_sleep_s": 0.0, "host_median_s": 0.0485}, True),  # unspun, the host as slow as the call
        ({"gpu_sleep_s": 0.0494, "host_median_s": 0.0569}, False),  # spun ahead: the GPU's time
        ({"gpu_sleep_s": 0.0, "host_median_s": 0.001}, False),  # unspun, but the host far faster
        (None, False),  # no host record
    ],
)
def test_host_paced_cuda_time_is_flagged(tmp_path: Path, host: dict | None, flagged: bool) -> None:
    """A CUDA time taken without the spin ahead, with the host as slow as the call, gets a note
    saying it is the host's pace; other records get none."""
    data = json.loads(FIXTURE.read_text())
    rec = data["benchmarks"][1]["extra_info"]  # the decode record
    rec["time_s"] = 0.0485
    if host is not None:
        rec["host"] = host
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    text = out.read_text()
    note = "B1-P512-N256 (wiola.fast): the GPU was not spun ahead of the host"
    assert (note in text) == flagged, text
    if flagged:
        assert "48.5 ms is the host's pace, not the GPU's time" in text, text


def test_loop_time_gets_a_note(tmp_path: Path) -> None:
    """A record with frame.loop_time's pace gets a note beside its device time."""
    data = json.loads(FIXTURE.read_text())
    rec = data["benchmarks"][1]["extra_info"]  # the decode record
    rec["time_s"] = 0.01
    rec["info"] = {**rec.get("info", {}), "loop_s_per_step": 0.037, "loop_tokens_per_s": 442_811.0, "loop_steps": 10}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "BENCHMARKS.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    note = "B1-P512-N256 (wiola.fast) in a loop (10 calls back to back, one sync): 37 ms a call, 442,811 tok/s, 3.70×"
    assert note in out.read_text()


def test_summary_lines_by_hand() -> None:
    """The terminal table: a row per record with its time, tokens/s, the % of its (roofline) floor,
    and each baseline as baseline time / ours; a record without a floor shows a dash."""
    timed = {"op": "decode", "mode": "cpu", "impl": "ours", "shape_id": "B1", "time_s": 0.002, "tokens_per_s": 500.0,
             "pct_floor": 40.0, "pct_floor_l3": 90.0, "baselines": {"peer": {"time_s": 0.006}}}  # fmt: skip
    bare = {"op": "prefill", "impl": "ours", "shape_id": "P8", "time_s": 1.0, "baselines": {"x": {"unavailable": "no"}}}
    run = report.Run(Path("r.json"), {}, [timed, bare])
    header, first, second = report.summary_lines([run])
    assert header.split()[:5] == ["benchmark", "shape", "impl", "ours", "floor"]
    assert first.split() == ["decode", "cpu", "B1", "ours", "2", "ms", "·", "500", "tok/s", "40%", "peer", "3.00×"]
    assert second.split()[-3:] == ["—", "x", "n/a"], second
