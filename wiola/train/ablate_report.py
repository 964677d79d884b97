"""The statistics, ``results.json``, ``report.md`` and PNG figures of a sweep (``wiola.train.ablate``).

Over seeds, each variant's final validation loss and bits per byte are given as mean ± the
half-width of a 95% confidence interval from Student's t distribution (``t_{0.975, n-1} · s /
√n``, ``s`` the sample standard deviation; none for one seed). The difference to the baseline
is paired by seed (same initialisation seed and data order): the mean of ``variant_s −
baseline_s`` over the seeds both have, with the same interval. Everything in ``results.json``
comes from the run folders' ``metrics.jsonl`` (evaluations, and the gradient norms of the
steps on the logging grid) and ``positions.json``, with no paths and no times, so a sweep that
was interrupted and continued writes the same bytes as one that was not. The training loss is
left out: a stopped run logs the step it stopped at, so its logged intervals differ (each run
folder's own ``loss_curve.png`` shows it).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from wiola.train.env import require
from wiola.train.plots import _figure, _save

RESULTS_FILE, REPORT_FILE = "results.json", "report.md"
FIGURES = ("loss_curves.png", "gates.png", "grad_norms.png", "positions.png")
REPORT_FILES = (RESULTS_FILE, REPORT_FILE, *FIGURES)  # what ``write_report`` writes
GRAD_NORM_COLUMNS = 3  # panels per row of grad_norms.png: more variants wrap into rows


def check_report_packages() -> None:
    """``ImportError`` naming the ``ablate`` extra when the report's packages (scipy for the
    intervals, matplotlib for the figures) do not import: a sweep checks before its first run."""
    for module in ("scipy.stats", "matplotlib"):
        require(module, "the sweep's report", extra="ablate")


def mean_ci(values: list[float], level: float = 0.95) -> dict[str, Any]:
    """``{"mean", "ci95", "n", "values"}``: the mean and the half-width of its t-interval (None for n < 2)."""
    from scipy.stats import t

    n = len(values)
    mean = float(np.mean(values)) if n else math.nan
    half = None
    if n >= 2:
        half = float(t.ppf(0.5 + level / 2, n - 1) * np.std(values, ddof=1) / math.sqrt(n))
    return {"mean": mean, "ci95": half, "n": n, "values": [float(v) for v in values]}


def _records(run_dir: Path) -> list[dict[str, Any]]:
    from wiola.train.run_folder import METRICS_FILE, read_metrics

    return read_metrics(run_dir / METRICS_FILE)


def _run_summary(run: Any, positions: dict[str, Any], threshold: float) -> dict[str, Any]:
    records = _records(run.run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    # Training lines on the logging grid only: a stopped run also logs the step it stopped at,
    # and the next line's loss then averages a shorter interval (not the same curve).
    steps, every = run.config.steps, run.config.log_every
    train = [r for r in records if r["kind"] == "train" and (r["step"] % every == 0 or r["step"] == steps)]
    head = next((r for r in records if r.get("kind") == "run"), None)
    if head is None:
        raise ValueError(
            f'{run.run_dir / "metrics.jsonl"} has no run record (kind "run", the run\'s model and settings): '
            "delete that run folder and run wiola ablate again to train it anew"
        )
    if not evals:
        raise ValueError(f"{run.run_dir} has no evaluation: set eval_every <= steps")
    gates = [np.asarray(r["gates"]) for r in evals]
    return {
        "parameters": head["parameters"],
        "model_config": head["model_config"],
        "final": {"loss": evals[-1]["loss"], "bits_per_byte": evals[-1]["bits_per_byte"], "step": evals[-1]["step"]},
        "val_loss": [[r["step"], r["loss"]] for r in evals],
        "gates": [[r["step"], g.tolist()] for r, g in zip(evals, gates)],
        "gate_share_under": [[r["step"], float((g < threshold).mean())] for r, g in zip(evals, gates)],
        "layer_grad_norms": [[r["step"], r["layer_grad_norms"]] for r in train if "layer_grad_norms" in r],
        "positions": positions["buckets"],
    }


def collect(spec: Any, runs: list[Any], positions: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """The sweep's results (the ``results.json`` object) from its finished run folders."""
    per_run = {(r.variant, r.seed): _run_summary(r, positions[(r.variant, r.seed)], spec.gate_threshold) for r in runs}
    variants: dict[str, Any] = {}
    for v in spec.variants:
        seeds = {s: per_run[(v.name, s)] for s in spec.seeds}
        first = seeds[spec.seeds[0]]
        entry = {
            "model": v.model,
            "d_ff": first["model_config"]["d_ff"],
            "parameters": first["parameters"],
            "final": {k: mean_ci([r["final"][k] for r in seeds.values()]) for k in ("loss", "bits_per_byte")},
            "seeds": {str(s): r for s, r in seeds.items()},
        }
        if v.name != spec.baseline:
            base = {s: per_run[(spec.baseline, s)] for s in spec.seeds}
            entry["paired_vs_baseline"] = {
                k: mean_ci([seeds[s]["final"][k] - base[s]["final"][k] for s in spec.seeds])
                for k in ("loss", "bits_per_byte")
            }
        variants[v.name] = entry
    return {
        "name": spec.name,
        "spec": spec.source,
        "baseline": spec.baseline,
        "seeds": spec.seeds,
        "gate_threshold": spec.gate_threshold,
        "position_bucket": spec.position_bucket,
        "variants": variants,
    }


def _pm(stat: dict[str, Any], digits: int = 4, signed: bool = False) -> str:
    """``mean ± ci95``; ``signed``: the mean with its sign always (a paired difference)."""
    ci = "" if stat["ci95"] is None else f" ± {stat['ci95']:.{digits}f}"
    return f"{stat['mean']:{'+' if signed else ''}.{digits}f}{ci}"


def _table(results: dict[str, Any]) -> list[str]:
    n = len(results["seeds"])
    lines = [
        f"| variant | d_ff | parameters | val loss (n={n}) | bits/byte | Δ loss vs {results['baseline']} | Δ bits/byte |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in results["variants"].items():
        paired = v.get("paired_vs_baseline")
        d_loss = _pm(paired["loss"], signed=True) if paired else "—"
        d_bpb = _pm(paired["bits_per_byte"], signed=True) if paired else "—"
        lines.append(
            f"| {name} | {v['d_ff']} | {v['parameters']:,} | {_pm(v['final']['loss'])} | "
            f"{_pm(v['final']['bits_per_byte'])} | {d_loss} | {d_bpb} |"
        )
    return lines


def _claims(results: dict[str, Any]) -> list[str]:
    thr = results["gate_threshold"]
    lines = ["", "## Gates (implicit head selection)", "", f"Share of heads whose mean gate is under {thr}:", ""]
    lines += ["| variant | first evaluation | last evaluation |", "|---|---:|---:|"]
    for name, v in results["variants"].items():
        if not _gated(v):  # every gate is 1 by construction: nothing was measured
            lines.append(f"| {name} (no gate) | — | — |")
            continue
        first = mean_ci([r["gate_share_under"][0][1] for r in v["seeds"].values()])
        last = mean_ci([r["gate_share_under"][-1][1] for r in v["seeds"].values()])
        lines.append(f"| {name} | {_pm(first, 3)} | {_pm(last, 3)} |")
    lines += ["", "## Gradient flow", "", "Per-layer gradient norm (before clipping), last logged step:", ""]
    for name, v in results["variants"].items():
        norms = np.array([r["layer_grad_norms"][-1][1] for r in v["seeds"].values()])  # (seeds, L)
        lines.append(f"- {name}: " + ", ".join(f"L{i} {m:.3g}" for i, m in enumerate(norms.mean(0))))
    lines += ["", "## Long range", "", "Validation loss by target position:", ""]
    names = list(results["variants"])
    buckets = results["variants"][names[0]]["seeds"][str(results["seeds"][0])]["positions"]
    lines += ["| positions | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for i, b in enumerate(buckets):
        cells = [
            _pm(mean_ci([r["positions"][i]["loss"] for r in results["variants"][n]["seeds"].values()]), 3)
            for n in names
        ]
        lines.append(f"| {b['start']}–{b['end'] - 1} | " + " | ".join(cells) + " |")
    return lines


def _gated(variant: dict[str, Any]) -> bool:
    """Whether a variant's model has gates (``gate = false`` builds none: every gate is 1)."""
    return all(r["model_config"].get("gate", True) for r in variant["seeds"].values())


def write_report(spec: Any, results: dict[str, Any], out: str | os.PathLike) -> Path:
    """Write ``results.json``, the PNG figures and ``report.md`` into ``out``; returns the report's path."""
    out = Path(out)
    text = json.dumps(results, indent=1, sort_keys=True) + "\n"
    tmp = out / f".{RESULTS_FILE}.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / RESULTS_FILE)
    figures = plot_all(results, out)
    lines = [f"# Ablation: {results['name']}", ""]
    n = len(results["seeds"])
    lines += [
        f"{n} seed{'s' * (n != 1)} ({', '.join(map(str, results['seeds']))}) per variant, the same data order "
        "per seed; mean ± 95% t-interval over seeds; Δ paired by seed against the baseline. Figures: "
        + ", ".join(f"[{p.stem}]({p.name})" for p in figures),
        "",
    ]
    lines += _table(results) + _claims(results)
    lines += [""] + [f"![{p.stem}]({p.name})" for p in figures]
    (out / REPORT_FILE).write_text("\n".join(lines) + "\n")
    return out / REPORT_FILE


MARKED_POINTS = 12  # a series of at most this many points is drawn with markers (one point: a dot, not nothing)


def _band(ax: Any, series: list[list[list[float]]], label: str) -> None:
    """Mean line and min–max band over seeds of ``[[step, value], ...]`` series (same steps); the
    points marked where there are few of them, and the steps on whole numbers."""
    from matplotlib.ticker import MaxNLocator

    steps = [s for s, _ in series[0]]
    values = np.array([[v for _, v in s] for s in series])
    marker = "o" if len(steps) <= MARKED_POINTS else None
    line = ax.plot(steps, values.mean(0), label=label, marker=marker, ms=4)[0]
    if len(series) > 1:
        ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
    if len(steps) == 1:  # one step: its tick alone (the locator finds too few whole numbers around it)
        ax.set_xticks(steps)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_all(results: dict[str, Any], out: Path) -> list[Path]:
    """``loss_curves.png``, ``gates.png``, ``grad_norms.png``, ``positions.png`` in ``out``."""
    variants = results["variants"]
    paths = []
    fig = _figure(6, 4)
    ax = fig.subplots()
    for name, v in variants.items():
        _band(ax, [r["val_loss"] for r in v["seeds"].values()], name)
    ax.set(title="validation loss (band: seeds' min–max)", xlabel="step", ylabel="nats/token")
    ax.legend()
    paths.append(_save(fig, out / "loss_curves.png"))
    fig = _figure(6, 4)
    ax = fig.subplots()
    gated = {name: v for name, v in variants.items() if _gated(v)}  # a no-gate variant has nothing to show
    for name, v in gated.items():
        _band(ax, [r["gate_share_under"] for r in v["seeds"].values()], name)
    left_out = " (no-gate variants left out)" if len(gated) < len(variants) else ""
    title = f"share of heads with mean gate < {results['gate_threshold']}{left_out}"
    ax.set(title=title, xlabel="step", ylabel="share of heads (of layers × heads)", ylim=(-0.02, 1.02))
    if gated:
        ax.legend()
    paths.append(_save(fig, out / "gates.png"))
    cols = min(len(variants), GRAD_NORM_COLUMNS)
    rows = math.ceil(len(variants) / cols)
    fig = _figure(4 * cols, 3.5 * rows)
    fig.set_layout_engine("constrained")  # a row's step labels clear of the next row's titles
    axes = fig.subplots(rows, cols, sharey=True, squeeze=False).ravel()
    for ax in axes[len(variants) :]:  # the empty panels of the last row
        ax.set_visible(False)
    for ax, (name, v) in zip(axes, variants.items()):
        runs = [r["layer_grad_norms"] for r in v["seeds"].values()]
        for layer in range(len(runs[0][0][1])):
            _band(ax, [[[s, n[layer]] for s, n in r] for r in runs], f"layer {layer}")
        ax.set(title=f"{name}: gradient norm per layer", xlabel="step", yscale="log")
        ax.legend(fontsize=7)
    for ax in axes[::cols]:  # the panels share their y axis: its label at the left of each row
        ax.set_ylabel("L2 norm of the layer's gradient (before clipping)")
    paths.append(_save(fig, out / "grad_norms.png"))
    fig = _figure(6, 4)
    ax = fig.subplots()
    for k, (name, v) in enumerate(variants.items()):
        runs = [r["positions"] for r in v["seeds"].values()]
        stats = [mean_ci([r[i]["loss"] for r in runs]) for i in range(len(runs[0]))]
        width = runs[0][0]["end"] - runs[0][0]["start"]  # each variant a little apart: intervals do not hide each other
        x = [b["start"] + (k - (len(variants) - 1) / 2) * 0.1 * width for b in runs[0]]
        ax.errorbar(
            x, [s["mean"] for s in stats], yerr=[s["ci95"] or 0 for s in stats], label=name, capsize=3, marker="o", ms=4
        )
    buckets = next(iter(next(iter(variants.values()))["seeds"].values()))["positions"]  # every run's are the same
    starts = [b["start"] for b in buckets]  # ticks at the buckets, named by their positions
    ax.set_xticks(starts, [f"{b['start']}–{b['end'] - 1}" for b in buckets])
    half = (buckets[0]["end"] - buckets[0]["start"]) / 2
    ax.set_xlim(starts[0] - half, starts[-1] + half)
    ax.set(title="validation loss by target position (95% CI)", xlabel="target positions", ylabel="nats/token")
    ax.legend()
    paths.append(_save(fig, out / "positions.png"))
    return paths
