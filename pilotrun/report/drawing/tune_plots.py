"""The plots of a pilot's learning-rate and batch checks (commands/tune.py): one per check, drawn from
tune.json's content into RUN/tune/ and, by the verdict, into RUN/report/.

- tune_lr.png: the validation loss of each LR branch against its factor (log scale), the recipe's own (1x)
  marked, with the yardstick (the pilot's noise) as a band above the best;
- tune_batch.png: per checkpoint, the validation loss after the same tokens against the batch multiple, the
  critical batch marked.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from pilotrun.report.verdict.tuning import TUNE_DIR, TUNE_JSON, factor_name

TUNE_PLOT_TITLES = {
    "tune_lr": "LR check: validation loss of branches at the recipe's learning rates times a factor",
    "tune_batch": "Batch check: validation loss after the same tokens at multiples of the recipe's batch",
}


def _axes(title: str, xlabel: str):
    fig = Figure(figsize=(8, 3.6), dpi=100)
    ax = fig.subplots()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats)")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Figure, ax, path: Path, ticks: list[float]) -> Path:
    ax.set_xticks(ticks, [factor_name(t) for t in ticks])
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    temp = path.with_name(f".{path.name}.partial")
    fig.savefig(temp, format="png")
    os.replace(temp, path)  # a plot is whole or absent, whatever stops the check
    return path


def _finite(pairs: list) -> list[tuple[float, float]]:
    """The (x, loss) pairs whose loss is a finite number (a diverged branch's is infinite, or its name)."""
    return sorted((x, v) for x, v in pairs if isinstance(v, int | float) and math.isfinite(v))


def plot_tune_lr(found: dict[str, Any], yardstick: float, path: Path) -> Path:
    fig, ax = _axes(TUNE_PLOT_TITLES["tune_lr"], "factor on the recipe's Muon and AdamW learning rates")
    pairs = _finite(found["losses"])
    ax.plot([f for f, _ in pairs], [v for _, v in pairs], marker="o", color="C0",
            label=f"from step {found['from_steps'][0]}, {found['updates']} updates")
    ax.axvline(1.0, color="grey", linestyle=":", label="the recipe's")
    best = found["best_loss"]
    ax.axhspan(best, best + yardstick, color="C2", alpha=0.2, label="best + the pilot's noise")
    return _save(fig, ax, path, [f for f, _ in pairs])


def plot_tune_batch(found: dict[str, Any], yardstick: float, path: Path) -> Path:
    fig, ax = _axes(TUNE_PLOT_TITLES["tune_batch"], "multiple of the recipe's global batch (same tokens)")
    ticks: set[float] = set()
    for index, point in enumerate(found["points"]):
        pairs = _finite(point["losses"])
        ticks.update(m for m, _ in pairs)
        ax.plot([m for m, _ in pairs], [v for _, v in pairs], marker="o", color=f"C{index}",
                label=f"from step {point['step']}: critical {factor_name(point['critical'])}x")
        ax.axhspan(point["best_loss"], point["best_loss"] + yardstick, color=f"C{index}", alpha=0.12)
    ax.axvline(found["critical"], color="C3", linestyle="--", label="critical batch over the span")
    return _save(fig, ax, path, sorted(ticks))


def write_tune_plots(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Each check's plot into out_dir as NAME.png; name -> path (empty when no check ran)."""
    out_dir, drawn = Path(out_dir), {}
    yardstick = float(result.get("yardstick") or 0.0)
    if isinstance(result.get("lr"), dict):
        drawn["tune_lr"] = plot_tune_lr(result["lr"], yardstick, out_dir / "tune_lr.png")
    if isinstance(result.get("batch"), dict):
        drawn["tune_batch"] = plot_tune_batch(result["batch"], yardstick, out_dir / "tune_batch.png")
    return drawn


def write_run_tune_plots(run_dir: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """The report's copy: drawn from RUN/tune/tune.json when a check wrote one."""
    try:
        result = json.loads((Path(run_dir) / TUNE_DIR / TUNE_JSON).read_text())
    except (OSError, ValueError):
        return {}
    return write_tune_plots(result, out_dir) if isinstance(result, dict) else {}
