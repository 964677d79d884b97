"""PNG figures of a training run: the loss curve and the gate heat map (matplotlib, Agg canvas:
no display and no global backend switch)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from wiola.train.env import require


def _figure(width: float, height: float) -> Any:
    require("matplotlib", "plotting")  # a clear error naming the extra when matplotlib is missing
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike) -> Path:
    """Write atomically: a reader never sees half a PNG."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png", bbox_inches="tight")
    os.replace(tmp, path)
    return path


def plot_loss_curve(
    records: Iterable[dict[str, Any]], path: str | os.PathLike, *, title: str = "Wiola training"
) -> Path:
    """Training loss (per logged step) and validation loss (per evaluation) against the step.

    ``records`` are the metrics JSONL rows: ``{"kind": "train", "step", "loss"}`` and
    ``{"kind": "eval", "step", "loss", "bits_per_byte"}``; a horizontal line marks
    ``{"kind": "reference", "name", "value"}`` rows (e.g. the unigram entropy). Returns the path.
    """
    records = list(records)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["loss"]) for r in records if r.get("kind") == "eval"]
    refs = [(r["name"], r["value"]) for r in records if r.get("kind") == "reference"]
    fig = _figure(7, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        s, l = zip(*train)
        ax.plot(s, l, lw=1.0, alpha=0.8, label="train loss", color="tab:blue")
    if val:
        s, l = zip(*val)
        ax.plot(s, l, "o-", ms=3.5, lw=1.5, label="validation loss", color="tab:orange")
    for (name, value), color in zip(refs, ["tab:gray", "tab:green", "tab:red"]):
        ax.axhline(value, ls="--", lw=1.0, color=color, label=f"{name} ({value:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if train or val or refs:
        ax.legend(loc="upper right", fontsize=8)
    finite = [l for _, l in train + val + refs if math.isfinite(l)]
    if finite:
        ax.set_ylim(bottom=max(0.0, min(finite) - 0.2))
    return _save(fig, path)


def plot_gate_heatmap(gates: Any, path: str | os.PathLike, *, title: str = "mean gate per layer × head") -> Path:
    """Heat map of the ``(L, H)`` mean gates (layers down, heads across), values printed in the
    cells, colour scale fixed to [0, 1] so maps of different steps compare. Returns the path."""
    g = np.asarray(gates, dtype=np.float64)
    if g.ndim != 2:
        raise ValueError(f"gates must be a 2-D (layers, heads) array, got shape {g.shape}")
    L, H = g.shape
    fig = _figure(max(3.5, 0.65 * H + 2.0), max(2.5, 0.5 * L + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(g, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    fig.colorbar(im, ax=ax, fraction=0.05, label="mean gate")
    ax.set_xticks(range(H), [str(h) for h in range(H)])
    ax.set_yticks(range(L), [str(l) for l in range(L)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    if L * H <= 256:
        for l in range(L):
            for h in range(H):
                ax.text(
                    h,
                    l,
                    f"{g[l, h]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if g[l, h] < 0.6 else "black",
                )
    return _save(fig, path)
