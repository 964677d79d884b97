"""``bench.run_tables``: a results folder's runs as Markdown tables, one entry per run in each cell,
every ratio taken within its own run; a folder without runs, or a run missing a row, exits 2 naming it."""

from __future__ import annotations

import json
from pathlib import Path

from bench import run_tables

FORMS = ("fp32", "bf16", "int8", "int4")


def _run(scale: float, prefill: bool = True) -> dict:
    """A run's records with tokens/s of 1,000 x (form's index + 1) x scale at batch 1 and twice that
    at batch 8, and wiola13m at 100 x scale."""
    benches = []
    for B in (1, 8):
        for i, w in enumerate(FORMS):
            tps = 1000.0 * (i + 1) * scale * (2 if B == 8 else 1)
            info = {
                "tokens_per_s": tps,
                "time_s": run_tables.TIMED_STEPS * B / tps,
                "compute_floor_s_per_step": 0.5 * B / tps,  # half the step's time: 50%
                "pct_read_floor": 40.0 + i,
                "bound_by": "the multiply-adds" if i else "reading the weights",
                "baselines": {"wiola13m": {"speedup": tps / (100.0 * scale)}},
            }
            benches.append({"name": f"test_tg128_cpu[B{B}-P16-N128-{w}]", "extra_info": info})
    if prefill:
        for name, products, _ in run_tables.PREFILL_ROWS:
            info = {"time_s": 512 / (4000.0 * scale), "baselines": {"wiola13m": {"speedup": 3.5}}}
            gemm = "ATen" if name.endswith("-other-gemm") else "oneDNN"
            info |= {"cpu_isa": "avx512", "cpu_flags": "fpu avx512f avx512_bf16 avx512_vnni"}
            info["decode_path"] = f"{gemm} products, C++ attention" if products == "fp32" else "PyTorch prompt path"
            benches.append({"name": f"test_prefill_cpu[{name}]", "extra_info": info})
    return {"benchmarks": benches}


def _folder(tmp_path: Path, runs: list[dict]) -> Path:
    for i, run in enumerate(runs, 1):
        (tmp_path / f"bench-{i}.json").write_text(json.dumps(run))
    return tmp_path


def test_tables_hold_each_run_and_ratios_within_it(tmp_path, capsys):
    folder = _folder(tmp_path, [_run(1.0), _run(2.0)])
    assert run_tables.main([str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| weights, batch | tok/s, runs 1 / 2 |")
    rows = {line.split(" | ")[0]: line for line in out if line.startswith("| ")}
    assert rows["| fp32, 1"] == ("| fp32, 1 | 1,000 / 2,000 | 40 / 40 | 50 / 50 | reading | wiola13m: 10.0× / 10.0× |")
    assert rows["| int4, 8"].endswith("| multiply-adds | int8: 1.33× / 1.33× |")  # 8,000 / 6,000 in each run
    assert rows["| bf16, 8"].split(" | ")[1] == "4,000 / 8,000"
    assert rows["| fp32 (oneDNN), fp32"] == "| fp32 (oneDNN), fp32 | 4,000 / 8,000 | 3.50× / 3.50× |"
    assert not any(line.startswith("| form |") for line in out)  # no ONNX rows in these runs


def test_prefill_labels_name_what_ran_each_records_products(tmp_path, capsys):
    """The GEMM and bf16 unit of a pp row come from its records: where ``auto`` kept ATen (so the
    "other GEMM" row is oneDNN's), the labels follow; AMX where the CPU has it; runs that differ
    name both."""
    runs = [_run(1.0), _run(2.0)]
    for run in runs:
        for bench in run["benchmarks"]:
            info = bench["extra_info"]
            if bench["name"] == "test_prefill_cpu[fp32-products-fp32-weights]":
                info["decode_path"] = "ATen products, C++ attention"
            if bench["name"] == "test_prefill_cpu[fp32-products-fp32-weights-other-gemm]":
                info["decode_path"] = "oneDNN products, C++ attention"
            if bench["name"].startswith("test_prefill_cpu[bf16"):
                info["cpu_flags"] += " amx_bf16 amx_tile"
    runs[1]["benchmarks"][-1]["extra_info"]["decode_path"] = "ATen products"  # int4 on ATen in run 2 alone
    assert run_tables.main([str(_folder(tmp_path, runs))]) == 0
    labels = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if "products" not in line]
    pp = [label for label in labels if label.endswith(("), fp32", "), bf16", "), int8", "), int4"))]
    assert pp == [
        "| fp32 (ATen: MKL), fp32",
        "| fp32 (oneDNN), fp32",
        "| bf16 (oneDNN, AMX), fp32",
        "| fp32 (oneDNN), bf16",
        "| fp32 (oneDNN), int8",
        "| fp32 (oneDNN or ATen: MKL), int4",
    ], pp


def test_onnx_rows_make_their_table(tmp_path, capsys):
    """Runs with ONNX Runtime's rows (``test_decode_cpu_onnx``) get the ONNX table: each form's
    tokens/s (tokens over time) beside ours on the same weights, per run."""
    runs = []
    for scale in (1.0, 2.0):
        run = _run(scale)
        for form in run_tables.ONNX_FORMS:
            for B in (1, 8):
                info = {
                    "tokens": 128 * B,
                    "time_s": 0.1 / scale,
                    "baselines": {"wiola.fast": {"tokens_per_s": 2000.0 * B}},
                }
                run["benchmarks"].append({"name": f"test_decode_cpu_onnx[B{B}-P16-N128-{form}]", "extra_info": info})
        runs.append(run)
    assert run_tables.main([str(_folder(tmp_path, runs))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| form | ONNX Runtime B1 | ours B1 | ONNX Runtime B8 | ours B8 |" in out, out
    for form in run_tables.ONNX_FORMS:
        assert f"| {form} | 1,280 / 2,560 | 2,000 / 2,000 | 10,240 / 20,480 | 16,000 / 16,000 |" in out, (form, out)


def test_tg128_alone_where_the_runs_hold_nothing_else(tmp_path, capsys):
    assert run_tables.main([str(_folder(tmp_path, [_run(1.0, prefill=False)]))]) == 0
    out = capsys.readouterr().out
    assert "| int4, 8 |" in out and "products, weights" not in out


def test_pp512_alone_where_the_runs_hold_no_tg128(tmp_path, capsys):
    """A folder of ``-k prefill_cpu`` runs: the pp512 table alone; a run of none of the three kinds
    of rows exits 2 saying so."""
    run = _run(1.0)
    run["benchmarks"] = [b for b in run["benchmarks"] if b["name"].startswith("test_prefill_cpu")]
    assert run_tables.main([str(_folder(tmp_path, [run, run]))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| products, weights | tok/s, runs 1 / 2 |") and "| fp32, 1 |" not in out
    assert "| fp32 (oneDNN), fp32 | 4,000 / 4,000 | 3.50× / 3.50× |" in out
    (tmp_path / "bench-1.json").write_text(json.dumps({"benchmarks": []}))
    (tmp_path / "bench-2.json").unlink()
    assert run_tables.main([str(tmp_path)]) == 2
    assert "hold no tg128, pp512 or ONNX Runtime rows" in capsys.readouterr().err


def test_the_compute_floor_counts_the_timed_steps(tmp_path, capsys):
    """A tg128 record times 127 steps (its first token is the untimed prefill's): the % of the
    compute floor is 127 steps at that floor over the time, as the record's own pct_roofline."""
    run = _run(1.0)
    record = next(b for b in run["benchmarks"] if b["name"] == "test_tg128_cpu[B1-P16-N128-int8]")["extra_info"]
    record.update(time_s=0.1, compute_floor_s_per_step=0.1 * 0.64 / 127)  # 64% of 127 steps' floor
    assert run_tables.main([str(_folder(tmp_path, [run]))]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| int8, 1 |"))
    assert row.split(" | ")[3] == "64", row


def test_a_run_without_wiola13m_says_so(tmp_path, capsys):
    """A run made where the ``wiola13m`` package was missing records it unavailable: the ratio
    cells say so, the rest of the table is made."""
    run = _run(1.0)
    for b in run["benchmarks"]:
        if "wiola13m" in b["extra_info"].get("baselines", {}):
            b["extra_info"]["baselines"]["wiola13m"] = {
                "unavailable": "ModuleNotFoundError: No module named 'wiola13m'"
            }
    assert run_tables.main([str(_folder(tmp_path, [run, _run(2.0)]))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert next(line for line in out if line.startswith("| fp32, 1 |")).endswith("| wiola13m: unavailable / 10.0× |")
    assert "| fp32 (oneDNN), fp32 | 4,000 / 8,000 | unavailable / 3.50× |" in out, out


def test_missing_runs_and_rows_exit_2(tmp_path, capsys):
    assert run_tables.main([str(tmp_path)]) == 2
    assert "no bench-1.json" in capsys.readouterr().err
    run = _run(1.0)
    run["benchmarks"] = [b for b in run["benchmarks"] if b["name"] != "test_tg128_cpu[B8-P16-N128-int8]"]
    assert run_tables.main([str(_folder(tmp_path, [run]))]) == 2
    assert "test_tg128_cpu[B8-P16-N128-int8]" in capsys.readouterr().err
    (tmp_path / "bench-1.json").write_text('{"benchmarks": [')
    assert run_tables.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"bench.run_tables: {tmp_path / 'bench-1.json'}: not JSON (")
