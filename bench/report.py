"""Turn benchmark result JSON into ``BENCHMARKS.md`` tables and PNG bar charts.

    python -m bench.report RESULTS.json [MORE.json ...] --out BENCHMARKS.md [--charts DIR] [--combined-chart PNG]

Inputs are pytest-benchmark ``--benchmark-json`` files or the frame's JSON-lines files
(``WIOLA_BENCH_JSONL``); a ``env.json`` beside a results file is read as its metadata. Runs are
grouped by machine (a GPU by its name, a CPU by its model name, family and model numbers and
vector units, as the records name it); for each, every table comes from the newest run that has
it, and the other runs are linked. Every number printed comes from the inputs: nothing is
estimated or filled in.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNMEASURED_GPU = "GPU: unmeasured — no GPU run is recorded yet (no GPU was lent to the tasks so far)."


@dataclass
class Run:
    """One benchmark session: its metadata and its benchmark records (``extra_info`` dicts)."""

    path: Path
    meta: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def device(self) -> str:
        gpu = self.meta.get("gpu")
        devices = {r.get("device") for r in self.records}
        if gpu and "cuda" in devices:
            return str(gpu)
        return "cpu"

    @property
    def date(self) -> str:
        return str(self.meta.get("date", ""))

    @property
    def cpu(self) -> str:
        """The CPU the records name (``cpu_label``), with the family and model numbers that
        pytest-benchmark's ``machine_info`` gives where the records lack them (those before
        2026-12-03), or that ``machine_info``'s CPU alone where no record names one; else ""."""
        seen = self.meta.get("machine_cpu") or {}
        record = next((r for r in self.records if r.get("cpu_model")), None)
        if record is None:
            if not seen.get("name"):
                return ""
            record = {"cpu_model": seen["name"], "cpu_flags": seen.get("flags", "")}
        return cpu_label(record, seen.get("numbers"))

    @property
    def machine(self) -> str:
        """What the run's numbers belong to: the GPU's name, the CPU's label, or "cpu"."""
        return self.device if self.device != "cpu" else self.cpu or "cpu"


# The vector units that set a CPU's speed here (the C++ step's variants, the prompt's bf16/int8
# units), by the flags /proc/cpuinfo lists.
AVX512_EXTRAS = (("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI"), ("avx512_fp16", "FP16"))
VECTOR_FLAG_PREFIXES = ("avx", "fma", "amx", "f16c", "asimd", "sve", "neon")


def vector_units(flags: str) -> str:
    """``"AVX-512 with BF16/VNNI"``, ``"AVX2"``, ``"NEON"``… from a CPU's flags ("" when none of these)."""
    have = set(flags.split())
    if "avx512f" in have:
        extras = [name for flag, name in AVX512_EXTRAS if flag in have]
        units = "AVX-512" + (" with " + "/".join(extras) if extras else "")
        return units + (", AMX" if "amx_tile" in have else "")
    for flag, name in (("avx2", "AVX2"), ("sve", "SVE"), ("asimd", "NEON")):
        if flag in have:
            return name
    return ""


def cpu_label(record: dict[str, Any], numbers: str | None = None) -> str:
    """A CPU record's machine: its model name (x86's family and model numbers with it in records
    that have them, else ``numbers``, ``"family 25, model 17"``, where given) and vector units,
    ``"AMD EPYC (family 25, model 17), AVX-512 with BF16/VNNI"``."""
    name = str(record["cpu_model"])
    if numbers and "(family " not in name:
        name = f"{name} ({numbers})"
    units = vector_units(record.get("cpu_flags") or "")
    return f"{name}, {units}" if units else name


def _machine_cpu(machine_info: dict[str, Any]) -> dict[str, str]:
    """The CPU in pytest-benchmark's ``machine_info`` (py-cpuinfo's): its name, x86's family and
    model numbers as ``cpu_label`` writes them, and its flags."""
    cpu = machine_info.get("cpu") or {}
    out = {"name": str(cpu.get("brand_raw") or ""), "flags": " ".join(cpu.get("flags") or [])}
    if cpu.get("family") is not None and cpu.get("model") is not None:
        out["numbers"] = f"family {cpu['family']}, model {cpu['model']}"
    return out


# ---------------------------------------------------------------------------------- loading
def _entries_from_file(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "benchmarks" in data:
        meta = dict(data.get("machine_info", {}).get("wiola", {}))
        meta["machine_cpu"] = _machine_cpu(data.get("machine_info", {}))
        if "date" not in meta and "datetime" in data:
            meta["date"] = data["datetime"]
        return data["benchmarks"], meta
    if data is not None and not (isinstance(data, dict) and "extra_info" in data):  # JSON of another shape
        # (a quality.json, a config; one line of frame records is one record, kept)
        raise ValueError(f'{path}: JSON, but not a pytest-benchmark results file (no "benchmarks" list)')
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {n} is not JSON: {exc}") from exc
    if not entries and data is None:
        raise ValueError(f"{path}: neither pytest-benchmark JSON nor JSON lines")
    return entries, {}


def load_run(path: str | Path) -> Run:
    """Read one results file (and its neighbouring ``env.json``, if any) into a ``Run``.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for one that is not a
    results file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results file {path}")
    entries, meta = _entries_from_file(path)
    env = path.parent / "env.json"
    if env.is_file():
        meta = {**json.loads(env.read_text()), **meta}
    records: list[dict[str, Any]] = []
    where: dict[str, int] = {}  # record_id -> index: a later line of the same record replaces the earlier
    for e in entries:
        info = e.get("extra_info") or {}
        if "op" not in info:
            continue  # a benchmark that does not use the frame: nothing to tabulate
        rec = dict(info)
        if "time_s" not in rec and e.get("stats", {}).get("median") is not None and not rec.get("quick"):
            rec["time_s"] = e["stats"]["median"]
        rec["test"] = e.get("fullname") or e.get("name")
        rid = rec.get("record_id")
        if rid is not None and rid in where:
            records[where[rid]] = rec
            continue
        if rid is not None:
            where[rid] = len(records)
        records.append(rec)
    return Run(path, meta, records)


# ------------------------------------------------------------------------------- formatting
def fmt_time(seconds: float) -> str:
    """``0.00123`` -> ``"1.23 ms"``: three significant digits in s, ms or µs."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def fmt_rate(x: float) -> str:
    """Tokens/s with thousands separators (three significant digits under 1000)."""
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def fmt_num(x: float) -> str:
    """Three significant digits, whole numbers with separators from 100 up: ``12.3``, ``456``, ``1,000``."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def fmt_speedup(x: float) -> str:
    return f"{x:.2f}×"


def fmt_pct(x: float) -> str:
    return f"{x:.1f}%" if x < 10 else f"{x:.0f}%"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def group_key(rec: dict[str, Any]) -> str:
    """The op group a record belongs to: its op and mode (``"attention fwd+bwd"``)."""
    return f"{rec['op']} {rec.get('mode', '')}".strip()


def _ours_cell(rec: dict[str, Any]) -> str:
    if rec.get("quick") or "time_s" not in rec:
        return "smoke run (not timed)"
    cell = fmt_time(rec["time_s"])
    if "tokens_per_s" in rec:
        cell += f" · {fmt_rate(rec['tokens_per_s'])} tok/s"
    return cell


def speedup(ours: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """Baseline time / our time (above 1: ours is faster), from the two measured medians."""
    if "time_s" not in ours or "time_s" not in baseline or ours.get("quick"):
        return None
    return baseline["time_s"] / ours["time_s"]


PENDING = "not measured: the run ended before this baseline finished"


def _baseline_cell(r: dict[str, Any], b: dict[str, Any] | None, notes: list[str]) -> str:
    if b is None:
        return "—"
    if b.get("pending"):
        notes.append(PENDING)
        return f"n/a [{len(notes)}]"
    if "unavailable" in b:
        notes.append(b["unavailable"])
        return f"n/a [{len(notes)}]"
    if "time_s" not in b:
        return "ran (not timed)"
    cell = fmt_time(b["time_s"])
    if "tokens_per_s" in b:
        cell += f" · {fmt_rate(b['tokens_per_s'])} tok/s"
    s = speedup(r, b)
    if s is not None:
        cell += f" (ours {fmt_speedup(s)})"
    return cell


def speedup_cells(r: dict[str, Any]) -> list[str]:
    """One short cell per baseline of record ``r`` for a terminal table: ``"name N×"`` (baseline time /
    our time), ``"name n/a"`` (unavailable or not timed) or ``"name not measured"`` (the run ended first)."""
    cells = []
    for name, b in r.get("baselines", {}).items():
        s = speedup(r, b)
        cells.append(f"{name} {fmt_speedup(s)}" if s is not None else f"{name} n/a")
    return cells + [f"{name} not measured" for name in r.get("baselines_pending", [])]


def _baseline(r: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The baseline ``name`` of record ``r``; ``{"pending": True}`` when the run ended before it was measured."""
    if name in r.get("baselines", {}):
        return r["baselines"][name]
    return {"pending": True} if name in r.get("baselines_pending", []) else None


def group_table(records: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, rows and footnotes of the table of one op group.

    Columns: shape, dtype, implementation, our time (and tokens/s), achieved TFLOP/s and GB/s,
    % of the roofline floor, % of the read floor where a record has one (a step's bytes read once a
    step at the rate the same run read that many bytes: ``bench/test_decode_cpu.py``), what bounds
    the step where a record says (``bound_by``: the read floor or the compute floor, and the % of
    the larger reached: ``pct_roofline``), the most of the read floor a step reaches with its
    multiply-adds at the CPU's fp32 multiply-add peak where a record has it (``read_ceiling_pct``),
    then one column per baseline: its time and ``ours N×`` (baseline time / our time: above 1 means ours is
    faster).
    """
    baselines: list[str] = []
    for r in records:
        for name in [*r.get("baselines", {}), *r.get("baselines_pending", [])]:
            if name not in baselines:
                baselines.append(name)
    read = any("pct_read_floor" in r for r in records)
    bound = any("bound_by" in r for r in records)
    ceiling = any("read_ceiling_pct" in r for r in records)
    if bound:  # torch comes with it: imported only for the tables that need it
        from wiola.fast.speed import bound_label
    header = [
        "shape",
        "dtype",
        "impl",
        "ours",
        "TFLOP/s",
        "GB/s",
        "% of floor",
        *(["% of read floor"] * read),
        *(["bound by (% of it)"] * bound),
        *(["most at the FMA peak"] * ceiling),
        *baselines,
    ]
    rows, notes = [], []
    for r in records:
        timed = "time_s" in r and not r.get("quick")
        row = [
            r.get("shape_id", ""),
            r.get("dtype", ""),
            r.get("impl", "ours"),
            _ours_cell(r),
            fmt_num(r["tflops"]) if timed and "tflops" in r else "—",
            fmt_num(r["gbs"]) if timed and "gbs" in r else "—",
            fmt_pct(r["pct_floor"]) if timed and "pct_floor" in r else "—",
        ]
        if read:
            row.append(fmt_pct(r["pct_read_floor"]) if timed and "pct_read_floor" in r else "—")
        if bound:
            by = r.get("bound_by")
            row.append(f"{bound_label(by)} ({fmt_pct(r['pct_roofline'])})" if timed and by else "—")
        if ceiling:
            row.append(fmt_pct(r["read_ceiling_pct"]) if timed and "read_ceiling_pct" in r else "—")
        row += [_baseline_cell(r, _baseline(r, name), notes) for name in baselines]
        rows.append(row)
    return header, rows, notes


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _meta_lines(run: Run) -> list[str]:
    m = run.meta
    parts = [f"date {m.get('date', '?')}"]
    if m.get("gpu"):
        parts.append(f"GPU {m['gpu']}")
        if m.get("driver"):
            parts.append(f"driver {m['driver']}")
        if m.get("cuda"):
            parts.append(f"CUDA {m['cuda']}")
    else:
        cpu = f"CPU {run.cpu} ({m.get('cpu', '?')})" if run.cpu else f"CPU {m.get('cpu', '?')}"
        if m.get("cpu_count"):
            cpu += f", {m['cpu_count']} cores"
        if m.get("load_avg_1m") is not None:
            cpu += f", load average {m['load_avg_1m']} when the run ended"
        parts.append(cpu)
    parts.append(f"torch {m.get('torch', '?')}")
    parts.append(f"triton {m.get('triton', '?')}")
    if m.get("commit"):
        parts.append(f"commit {m['commit']}")
    lines = ["- " + ", ".join(parts)]
    ceilings = m.get("ceilings") or {}
    for c in ceilings.values():
        lines.append(
            f"- ceilings measured in this run ({c.get('device_name', '?')}): matmul {c['matmul']} at "
            f"{fmt_num(c['matmul_tflops'])} TFLOP/s; copy {c['copy']} at {fmt_num(c['copy_gbs'])} GB/s"
        )
    if not ceilings:
        seen = {json.dumps(r["ceilings"], sort_keys=True) for r in run.records if "ceilings" in r}
        for s in sorted(seen):
            c = json.loads(s)
            lines.append(
                f"- ceilings measured in this run ({c.get('device_name', '?')}): matmul {c['matmul']} at "
                f"{fmt_num(c['matmul_tflops'])} TFLOP/s; copy {c['copy']} at {fmt_num(c['copy_gbs'])} GB/s"
            )
    return lines


def _short_note(note: str, cpu: str) -> str | None:
    """A record's note as the report prints it: a CPU's whole flags line cut to its vector flags;
    None for the note naming the CPU where the run's metadata line names it (``cpu``)."""
    if cpu and note.startswith("CPU: "):
        return None
    if not note.startswith("CPU flags: "):
        return note
    keep = [f for f in note[len("CPU flags: ") :].split() if f.startswith(VECTOR_FLAG_PREFIXES)]
    return "CPU vector flags: " + (" ".join(keep) or "none")


def host_paced_note(r: dict[str, Any]) -> str | None:
    """A note for a CUDA record whose GPU was not spun ahead of the host (``host.gpu_sleep_s`` 0:
    the timer's probe found the host slower than its spin cap, ``bench/frame.py``) and whose host
    took at least 80% of the measured time a call: that time is the host's pace, not the GPU's.
    None for every other record."""
    host = r.get("host") or {}
    time_s, host_s = r.get("time_s"), host.get("host_median_s")
    if r.get("device") != "cuda" or host.get("gpu_sleep_s", 1) != 0 or not time_s or not host_s:
        return None
    if host_s < 0.8 * time_s:
        return None
    return (
        f"{r.get('shape_id', '?')} ({r.get('impl', 'ours')}): the GPU was not spun ahead of the host, which took "
        f"{fmt_time(host_s)} a call: {fmt_time(time_s)} is the host's pace, not the GPU's time"
    )


def loop_line(r: dict[str, Any]) -> str | None:
    """``"in a loop ..."`` for a timed record with ``info["loop_s_per_step"]`` (``frame.loop_time``:
    ``info["loop_steps"]`` calls back to back, one sync at the end, nothing spun ahead), beside its
    device time; else None."""
    info = r.get("info") or {}
    loop = info.get("loop_s_per_step")
    if not loop or "time_s" not in r or r.get("quick"):
        return None
    rate, steps = info.get("loop_tokens_per_s"), info.get("loop_steps")
    return (
        f"in a loop ({f'{steps} calls' if steps else 'calls'} back to back, one sync): {fmt_time(loop)} a call"
        + (f", {fmt_rate(rate)} tok/s" if rate else "")
        + f", {loop / r['time_s']:.2f}× the device time"
    )


def run_section(
    run: Run, level: int = 3, chart_links: dict[str, str] | None = None, only: Sequence[str] | None = None
) -> str:
    """Markdown for one run: metadata, then one table per op group (those in ``only`` if given)."""
    out = _meta_lines(run)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in run.records:
        if only is None or group_key(r) in only:
            groups.setdefault(group_key(r), []).append(r)
    for key, recs in groups.items():
        header, rows, notes = group_table(recs)
        out.append("")
        out.append(f"{'#' * level} {key} ({recs[0].get('device', '?')})")
        out.append("")
        out.append(markdown_table(header, rows))
        for i, n in enumerate(notes, 1):
            out.append(f"\n[{i}] unavailable: {n}")
        cpu = [r for r in recs if r.get("device") == "cpu" and "threads" in r]
        if cpu:
            loads = [r["load_avg_1m"] for r in cpu if "load_avg_1m" in r]
            load = f", 1-minute load average {min(loads)}–{max(loads)} on the machine" if loads else ""
            threads = sorted({r["threads"] for r in cpu})
            out.append(f"\nCPU: {'/'.join(map(str, threads))} torch thread(s){load}.")
        shown = [_short_note(note, run.cpu) for r in recs for note in r.get("notes", [])]
        shown += [host_paced_note(r) for r in recs]
        shown += [f"{r.get('shape_id', '?')} ({r.get('impl', 'ours')}) {line}" for r in recs if (line := loop_line(r))]
        extra = sorted({note for note in shown if note})
        for n in extra:
            out.append(f"\nNote: {n}")
        if chart_links and key in chart_links:
            out.append(f"\n![{key}]({chart_links[key]})")
    if not run.records:
        out.append("\n(no benchmark records in this run)")
    return "\n".join(out)


# ----------------------------------------------------------------------------------- charts
def _chart_series(recs: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, list[float | None]], str]:
    """x labels (shapes), {implementation: values}, and the unit: tokens/s if every record has it, else ms."""
    use_tokens = all("tokens_per_s" in r for r in recs)
    unit = "tokens/s (higher is better)" if use_tokens else "ms (lower is better)"
    labels = [f"{r.get('shape_id', '')}\n" + "\n".join(textwrap.wrap(str(r.get("impl", "")), 24)) for r in recs]
    series: dict[str, list[float | None]] = {}

    def value(d: dict[str, Any]) -> float | None:
        if "time_s" not in d:
            return None
        return d["tokens_per_s"] if use_tokens else d["time_s"] * 1e3

    for i, r in enumerate(recs):
        impls = {r.get("impl", "ours"): r, **{k: v for k, v in r.get("baselines", {}).items()}}
        for name, d in impls.items():
            series.setdefault(name, [None] * len(recs))[i] = value(d)
    # A baseline measured nowhere in the group (unavailable on every record) has no bar: no legend
    # entry, no slot beside the others.
    return labels, {name: vals for name, vals in series.items() if any(v is not None for v in vals)}, unit


def _draw(ax: Any, title: str, recs: Sequence[dict[str, Any]]) -> None:
    labels, series, unit = _chart_series(recs)
    n = max(1, len(series))
    width = 0.8 / n
    for j, (name, vals) in enumerate(series.items()):
        xs = [i + (j - (n - 1) / 2) * width for i, v in enumerate(vals) if v is not None]
        ax.bar(xs, [v for v in vals if v is not None], width, label=name)  # no bar where nothing was measured
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel(unit, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # beside the bars


def _timed_groups(run: Run) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in run.records:
        if "time_s" in r and not r.get("quick"):
            groups.setdefault(group_key(r), []).append(r)
    return groups


def write_charts(run: Run, directory: str | Path, only: Sequence[str] | None = None) -> dict[str, Path]:
    """One PNG bar chart per op group of ``run`` (those in ``only`` if given) in ``directory``;
    returns {group: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, recs in _timed_groups(run).items():
        if only is not None and key not in only:
            continue
        fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(recs) + 2), 3.6))
        _draw(ax, f"{key} — {run.machine}", recs)
        fig.tight_layout()
        path = directory / f"{_slug(run.machine)}_{_slug(key)}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend beside the axes included
        plt.close(fig)
        paths[key] = path
    return paths


def write_combined_chart(run: Run, path: str | Path) -> Path | None:
    """Every op group of ``run`` as subplots of one PNG (for places that take few files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _timed_groups(run)
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 3.4 * len(groups)), squeeze=False)
    for ax, (key, recs) in zip(axes[:, 0], groups.items()):
        _draw(ax, f"{key} — {run.machine}", recs)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------- report
def by_machine(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs grouped by ``Run.machine``, newest first, the newest machine first (GPUs before CPUs).
    A CPU run whose records lack the family and model numbers (recorded since 2026-12-03) joins the
    one numbered CPU of the same name and vector units, where there is exactly one."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.machine, []).append(run)
    numbered = re.compile(r" \(family [^)]*\)")
    for label in [k for k in groups if numbered.search(k) is None]:
        matches = [k for k in groups if k != label and numbered.sub("", k) == label]
        if len(matches) == 1:
            groups[matches[0]] += groups.pop(label)
    ordered = sorted(((k, sorted(v, key=lambda r: r.date, reverse=True)) for k, v in groups.items()),
                     key=lambda kv: kv[1][0].date, reverse=True)  # fmt: skip
    return dict(sorted(ordered, key=lambda kv: kv[1][0].device == "cpu"))  # stable: GPUs first, each newest first


def newest_per_group(ordered: Sequence[Run]) -> list[tuple[Run, list[str]]]:
    """For one machine's runs, newest first: each run that is the newest to hold some op group,
    with those groups (a run of the decoding rows alone after a run of decoding and prompt rows
    leaves the prompt's table to the earlier run)."""
    seen: set[str] = set()
    out = []
    for run in ordered:
        keys = [k for k in dict.fromkeys(group_key(r) for r in run.records) if k not in seen]
        if keys:
            out.append((run, keys))
            seen.update(keys)
    return out


def build_markdown(runs: Sequence[Run], out_path: str | Path, charts: dict[str, dict[str, Path]] | None = None) -> str:
    """The whole ``BENCHMARKS.md``: for each machine, each op group from the newest run that has
    it, the other runs linked."""
    out_dir = Path(out_path).resolve().parent
    groups = by_machine(runs)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m bench.report` from the raw results under `bench/results/`; every number",
        "below was measured by `pytest bench/` (see `bench/README.md` for how each is timed and counted).",
        "`ours N×` = baseline time / our time (above 1: ours is faster). `% of floor` = the roofline time",
        "(from the matmul and copy ceilings measured in the same run) / the measured time; `% of read",
        "floor` = the time to read the step's bytes once a token (its weights, and from the records that",
        "carry `read_floor_bytes` on, also the cache's keys and values its attention reads), at the rate",
        "the same run read as many bytes, / the measured time (CPU decoding).",
        "",
    ]
    if all(group[0].device == "cpu" for group in groups.values()):
        lines += [f"**{UNMEASURED_GPU}**", ""]
    for machine, ordered in groups.items():
        latest = ordered[0]
        if latest.device != "cpu":
            title = f"GPU: {machine}"
        else:
            title = "CPU (its model not recorded)" if machine == "cpu" else f"CPU: {machine}"
        lines += [f"## {title} — latest run", ""]
        if latest.device == "cpu":
            lines += [
                "CPU times depend on whatever else the machine runs (the load average is given with each",
                "table): compare implementations within one run, which share the conditions, not across runs.",
                "",
            ]
        shown = newest_per_group(ordered)
        for run, keys in shown:
            links = None
            if charts and str(run.path) in charts:
                links = {k: os.path.relpath(p, out_dir) for k, p in charts[str(run.path)].items()}
            lines.append(run_section(run, chart_links=links, only=keys))
            lines.append("")
            rel = os.path.relpath(run.path, out_dir)
            lines.append(f"Raw results: [{rel}]({rel})")
            lines.append("")
        earlier = [r for r in ordered if all(r is not run for run, _ in shown)]
        if earlier:
            lines += [f"### Earlier {title} runs", ""]
            for r in earlier:
                rel = os.path.relpath(r.path, out_dir)
                lines.append(f"- {r.date}: [{rel}]({rel}) ({len(r.records)} benchmarks)")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def summary_lines(runs: Sequence[Run]) -> list[str]:
    """A short plain-text table (one line per benchmark) for a terminal."""
    lines = [f"{'benchmark':<34} {'shape':<22} {'impl':<12} {'ours':>20} {'floor':>7}  baselines (ours N×)"]
    for run in runs:
        for r in run.records:
            key = group_key(r)[:34]
            pct = fmt_pct(r["pct_floor"]) if "pct_floor" in r else "—"
            ours = _ours_cell(r)
            lines.append(
                f"{key:<34} {r.get('shape_id', '')[:22]:<22} {r.get('impl', '')[:12]:<12} {ours:>20} {pct:>7}  "
                + ", ".join(speedup_cells(r))
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="pytest-benchmark JSON or frame JSON-lines files")
    parser.add_argument("--out", default="BENCHMARKS.md", help="markdown file to write (default BENCHMARKS.md)")
    parser.add_argument("--charts", default=None, help="folder for one PNG per op group of each device's latest run")
    parser.add_argument("--combined-chart", default=None, help="one PNG with every op group of the latest run")
    parser.add_argument("--summary", action="store_true", help="print a short table to stdout")
    args = parser.parse_args(argv)
    out_dir = Path(args.out).parent
    if not out_dir.is_dir():  # checked before any chart is drawn
        parser.error(f"--out {args.out}: {out_dir} is not a folder")

    try:
        runs = [load_run(p) for p in args.results]
    except (OSError, ValueError) as e:  # a file that is missing, unreadable or not results
        parser.error(str(e))
    charts: dict[str, dict[str, Path]] = {}
    if args.charts:
        for group in by_machine(runs).values():
            for run, keys in newest_per_group(group):
                charts[str(run.path)] = write_charts(run, args.charts, only=keys)
    if args.combined_chart:
        newest = max(runs, key=lambda r: r.date)
        write_combined_chart(newest, args.combined_chart)
    text = build_markdown(runs, args.out, charts)
    Path(args.out).write_text(text)
    if args.summary:
        print("\n".join(summary_lines(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
