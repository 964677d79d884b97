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


def test_cpu_only_says_gpu_unmeasured(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    data["machine_info"]["wiola"]["gpu"] = None
    for b in data["benchmarks"]:
        b["extra_info"]["device"] = "cpu"
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    md = report.build_markdown([report.load_run(path)], tmp_path / "B.md")
    assert report.UNMEASURED_GPU in md
    assert "## CPU — latest run" in md


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
    assert series["ours"] == [pytest.approx(1.23)] and series["flex_attention"] == [None]


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no results file"):
        report.load_run(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("this is not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        report.load_run(bad)


@pytest.mark.parametrize(
    "seconds, text", [(2.5, "2.5 s"), (0.00123, "1.23 ms"), (4.56e-5, "45.6 µs"), (0.032, "32 ms")]
)
def test_fmt_time(seconds: float, text: str) -> None:
    assert report.fmt_time(seconds) == text
