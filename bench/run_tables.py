"""The per-run tables of a CPU results folder: tg128, pp512 and ONNX Runtime's forms, one column
entry per run, from the folder's ``bench-1.json`` … ``bench-N.json`` (each a run of
``pytest bench/test_decode_cpu.py -k "tg128 or prefill_cpu or onnx" --benchmark-only``).

    python -m bench.run_tables bench/results/2026-12-05_cpu_tg128-pp512-onnx-amd-zen4/final

Prints Markdown: the tg128 table (tok/s, % of the read floor and of the compute floor, what bounds
each row, the ratio beside it in the same run), then the pp512 and ONNX Runtime tables where the
runs hold those rows. A folder without ``bench-1.json``, or a run without every tg128 row, exits
with status 2 and a message naming what is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SHORT = {"reading the weights": "reading", "the multiply-adds": "multiply-adds"}
PREFILL_ROWS = (  # (record, products, weights); what ran the products is read from each record
    ("fp32-products-fp32-weights", "fp32", "fp32"),
    ("fp32-products-fp32-weights-other-gemm", "fp32", "fp32"),
    ("bf16-products-fp32-weights", "bf16", "fp32"),
    ("fp32-products-bf16-weights", "fp32", "bf16"),
    ("fp32-products-int8-weights", "fp32", "int8"),
    ("fp32-products-int4-weights", "fp32", "int4"),
)
ONNX_FORMS = ("fp32", "int8", "int8-matmul", "int4", "int4-matmul")
TIMED_STEPS = 127  # a tg128 record's timed steps: its first token comes from the untimed prefill


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """``bench-1.json``, ``bench-2.json``, … of ``folder``, in order, until one is missing.
    ``ValueError`` where there is none, or one is not JSON (naming it)."""
    runs = []
    while (path := folder / f"bench-{len(runs) + 1}.json").exists():
        try:
            runs.append(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not runs:
        raise ValueError(f"{folder}: no bench-1.json")
    return runs


def _record(run: dict[str, Any], name: str) -> dict[str, Any]:
    for bench in run["benchmarks"]:
        if bench["name"] == name:
            return bench["extra_info"]
    raise ValueError(f"a run has no {name} row")


def _ratio(record: dict[str, Any], baseline: str, key: str, fmt: str) -> str:
    """A baseline's number in a record, or why there is none (a run without the package records
    ``{"unavailable": "why"}``)."""
    entry = record.get("baselines", {}).get(baseline, {})
    return fmt.format(entry[key]) if key in entry else "unavailable"


def _has(run: dict[str, Any], prefix: str) -> bool:
    return any(b["name"].startswith(prefix) for b in run["benchmarks"])


def _runs(runs: list[dict[str, Any]]) -> str:
    return "tok/s, runs " + " / ".join(str(i + 1) for i in range(len(runs)))


def _join(values: list[float], fmt: str) -> str:
    return " / ".join(fmt.format(v) for v in values)


def tg_table(runs: list[dict[str, Any]]) -> list[str]:
    """The tg128 rows at batch 1 and 8 for each weight form."""
    lines = [
        f"| weights, batch | {_runs(runs)} | % of read floor | % of compute floor | bound by | beside it, same run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for B in (1, 8):
        for w in ("fp32", "bf16", "int8", "int4"):
            rs = [_record(r, f"test_tg128_cpu[B{B}-P16-N128-{w}]") for r in runs]
            tps = [x["tokens_per_s"] for x in rs]
            compute = [100 * x["compute_floor_s_per_step"] * TIMED_STEPS / x["time_s"] for x in rs]
            bound = "/".join(sorted({SHORT.get(x["bound_by"], x["bound_by"]) for x in rs}))
            if w == "fp32":
                beside = "wiola13m: " + " / ".join(_ratio(x, "wiola13m", "speedup", "{:.1f}×") for x in rs)
            else:
                other = "int8" if w == "int4" else "fp32"
                base = [_record(r, f"test_tg128_cpu[B{B}-P16-N128-{other}]")["tokens_per_s"] for r in runs]
                beside = f"{other}: " + _join([a / b for a, b in zip(tps, base)], "{:.2f}×")
            read = _join([x["pct_read_floor"] for x in rs], "{:.0f}")
            lines.append(
                f"| {w}, {B} | {_join(tps, '{:,.0f}')} | {read} | {_join(compute, '{:.0f}')} | {bound} | {beside} |"
            )
    return lines


def prefill_table(runs: list[dict[str, Any]]) -> list[str]:
    """The pp512 rows: tok/s and the ratio to ``wiola13m`` in the same row."""
    lines = [
        f"| products, weights | {_runs(runs)} | against `wiola13m` in the same row |",
        "| --- | --- | --- |",
    ]
    for name, products, weights in PREFILL_ROWS:
        rs = [_record(r, f"test_prefill_cpu[{name}]") for r in runs]
        ratios = " / ".join(_ratio(x, "wiola13m", "speedup", "{:.2f}×") for x in rs)
        ran = " or ".join(dict.fromkeys(_products(x, products) for x in rs))
        label = f"{products} ({ran}), {weights}"
        lines.append(f"| {label} | {_join([512 / x['time_s'] for x in rs], '{:,.0f}')} | {ratios} |")
    return lines


def _products(record: dict[str, Any], products: str) -> str:
    """What ran a pp record's products, from its ``decode_path``: fp32 products on oneDNN or ATen
    (MKL on x86, torch's BLAS elsewhere), bf16 products (autocast) on oneDNN with the CPU's bf16
    unit (its ``cpu_flags``: AMX, AVX-512 BF16); "?" for a record that does not say."""
    path = record.get("decode_path", "")
    if products == "bf16":
        flags = record.get("cpu_flags", "").split()
        unit = "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else None
        return f"oneDNN, {unit}" if unit else "oneDNN"
    if path.startswith("oneDNN products"):
        return "oneDNN"
    if path.startswith("ATen products"):
        x86 = record.get("cpu_isa") in ("amx", "avx512", "avx2") or "x86_64" in str(record.get("ceilings", ""))
        return "ATen: MKL" if x86 else "ATen"
    return "?"


def onnx_table(runs: list[dict[str, Any]]) -> list[str]:
    """ONNX Runtime's forms beside our step on the same weights, batch 1 and 8."""
    lines = ["| form | ONNX Runtime B1 | ours B1 | ONNX Runtime B8 | ours B8 |", "| --- | --- | --- | --- | --- |"]
    for form in ONNX_FORMS:
        cells = []
        for B in (1, 8):
            rs = [_record(r, f"test_decode_cpu_onnx[B{B}-P16-N128-{form}]") for r in runs]
            cells.append(_join([x["tokens"] / x["time_s"] for x in rs], "{:,.0f}"))
            cells.append(" / ".join(_ratio(x, "wiola.fast", "tokens_per_s", "{:,.0f}") for x in rs))
        lines.append(f"| {form} | " + " | ".join(cells) + " |")
    return lines


def tables(runs: list[dict[str, Any]]) -> str:
    """Every table the runs hold, separated by blank lines (``ValueError`` where they hold none)."""
    parts = [tg_table(runs)] if _has(runs[0], "test_tg128_cpu") else []
    if _has(runs[0], "test_prefill_cpu"):
        parts.append(prefill_table(runs))
    if _has(runs[0], "test_decode_cpu_onnx"):
        parts.append(onnx_table(runs))
    if not parts:
        raise ValueError("the runs hold no tg128, pp512 or ONNX Runtime rows")
    return "\n\n".join("\n".join(p) for p in parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run_tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder holding bench-1.json, bench-2.json, …")
    args = parser.parse_args(argv)
    try:
        print(tables(load_runs(args.folder)))
    except ValueError as e:
        print(f"bench.run_tables: {e}", file=sys.stderr)
        return 2
    except KeyError as e:  # a record of another benchmark's shape
        print(f"bench.run_tables: a record of {args.folder} has no field {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
