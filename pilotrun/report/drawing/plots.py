"""The report's PNG plots, drawn with matplotlib's Agg renderer (no display, no pyplot global state).

Every plot is drawn from the kept history; where a crashed session's rolled-back windows exist they are
shown faintly on the loss plot, and each resume is a dotted vertical line, so a reader sees exactly where
the run was interrupted and what was redone. The run's loud moments are marked where they explain a curve
(marks.py): on the loss plot every data pass boundary, spike, rollback and recipe change at resume; on the
LR plot the recipe changes and rollbacks; on the gradient-norm plot the spikes and rollbacks. A plot whose
data the record lacks is still written, saying so, so that the report always has the same set of files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from pilotrun.report.drawing.marks import draw_marks, drawn, run_marks
from pilotrun.report.projection.forecast_record import pilot_forecast
from pilotrun.report.record_check.summarize import Summary
from pilotrun.report.record_check.time_split import window_profiled, window_train_tokens
from pilotrun.run.record import is_finite_number

PLOT_NAMES = ("loss", "lr", "grad_norm", "throughput", "loss_scale", "expert_load", "qk_max_logit",
              "parameter_groups", "block_output_rms", "time_ledger", "downstream_accuracy", "forecast")
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*", "P")
PLOT_TITLES = {
    "loss": "Training and validation loss",
    "lr": "Learning rate",
    "grad_norm": "Gradient norm (before clipping) with clipped windows",
    "throughput": "Throughput: training-only and wall-clock",
    "loss_scale": "Loss scale and skipped updates",
    "expert_load": "Expert load per MoE layer over time",
    "qk_max_logit": "QK max logit per attention layer",
    "parameter_groups": "Weight RMS and update RMS / lr per parameter group",
    "block_output_rms": "Residual stream RMS after each block",
    "time_ledger": "Time ledger: where each session's seconds went (goodput = productive / elapsed)",
    "downstream_accuracy": "Downstream accuracy per task (in the loop; evaluations of checkpoints as "
                           "squares)",
    "forecast": "Validation loss forecast for a 10x long run (the law fitted to the pilot's evaluations)",
}


def _series(events: list[dict[str, Any]], getter) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for e in events:
        try:
            value = getter(e)
        except (KeyError, TypeError, IndexError):
            value = None
        if is_finite_number(value):
            xs.append(e["step"])
            ys.append(float(value))
    return xs, ys


def _new_axes(title: str, ylabel: str, height: float = 3.6):
    fig = Figure(figsize=(8, height), dpi=100)
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel("step (applied updates)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _mark_resumes(ax, summary: Summary) -> None:
    steps = [
        s.start["step"]
        for s in summary.sessions
        if s.session_id in summary.lineage and s.resumed_from is not None
    ]
    for index, step in enumerate(steps):
        ax.axvline(step, color="grey", linestyle=":", linewidth=1.2, label="resume" if index == 0 else None)


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what} not recorded", ha="center", va="center", transform=ax.transAxes)


def _save(fig: Figure, ax, path: Path) -> Path:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _train(summary: Summary) -> list[dict[str, Any]]:
    return [e for e in summary.kept_events if e["event"] == "train"]


def plot_loss(summary: Summary, path: Path) -> Path:
    fig, ax = _new_axes(PLOT_TITLES["loss"], "cross-entropy (nats)")
    xs, ys = _series(_train(summary), lambda e: e["loss"])
    ax.plot(xs, ys, label="train (window mean)", color="C0")
    vx, vy = _series([e for e in summary.kept_events if e["event"] == "val"], lambda e: e["loss"])
    if vx:
        ax.plot(vx, vy, "o-", label="val", color="C1")
    rx, ry = _series([e for e in summary.rolled_back_events if e["event"] == "train"], lambda e: e["loss"])
    if rx:
        ax.plot(rx, ry, "x", color="grey", alpha=0.6, label="rolled back (before the kill)")
    if not xs:
        _no_data(ax, "loss")
    _mark_resumes(ax, summary)
    draw_marks(ax, run_marks(summary))
    return _save(fig, ax, path)


def plot_lr(summary: Summary, path: Path) -> Path:
    # The trainer logs the LR of the optimizer's first parameter group; every group follows the same
    # multiplier.
    groups = (summary.run.get("optimizer") or {}).get("groups") or []
    first = drawn(groups[0].get("group", "?")) if groups and isinstance(groups[0], dict) else "?"
    fig, ax = _new_axes(PLOT_TITLES["lr"], f"learning rate of group '{first}'")
    xs, ys = _series(_train(summary), lambda e: e["lr"])
    others = f"; the other {len(groups) - 1} groups follow the same multiplier" if len(groups) > 1 else ""
    ax.plot(xs, ys, color="C2", label=f"group '{first}' (the first of {len(groups) or '?'}{others})")
    if not xs:
        _no_data(ax, "learning rate")
    _mark_resumes(ax, summary)
    draw_marks(ax, run_marks(summary), ("recipe_change", "rollback"))
    return _save(fig, ax, path)


def plot_grad_norm(summary: Summary, path: Path) -> Path:
    fig, ax = _new_axes(PLOT_TITLES["grad_norm"], "global gradient norm")
    events = _train(summary)
    xs, ys = _series(events, lambda e: e["grad_norm"])
    ax.plot(xs, ys, label="last update of the window", color="C0")
    mx, my = _series(events, lambda e: e["grad_norm_max"])
    if mx:
        ax.plot(mx, my, color="C3", alpha=0.5, linewidth=0.8, label="max in the window")
    cx, cy = _series([e for e in events if (e.get("window") or {}).get("clipped")],
                     lambda e: e.get("grad_norm_max", e.get("grad_norm")))
    if cx:
        ax.plot(cx, cy, "v", color="C3", markersize=5, label="window with clipped updates")
    grad_clip = ((summary.run.get("recipe") or {}).get("optim") or {}).get("grad_clip")
    if is_finite_number(grad_clip) and grad_clip > 0:
        ax.axhline(
            grad_clip, color="C3", linestyle="--", linewidth=0.8, label=f"clip threshold {grad_clip:g}"
        )
    if ys and min(ys) > 0:
        ax.set_yscale("log")
    if not xs:
        _no_data(ax, "gradient norm")
    _mark_resumes(ax, summary)
    draw_marks(ax, run_marks(summary), ("spike", "rollback"))
    return _save(fig, ax, path)


def _train_rate(event: dict[str, Any]) -> float | None:
    """A window's training-only tok/s; None when it trained nothing outside the profiler."""
    tokens, seconds = window_train_tokens(event["window"]), event["window"]["train_seconds"]
    return tokens / seconds if tokens and is_finite_number(seconds) and seconds > 0 else None


def plot_throughput(summary: Summary, path: Path) -> Path:
    fig, ax = _new_axes(PLOT_TITLES["throughput"], "tokens / second")
    events = _train(summary)
    # Profiled windows: their training-phase tokens (profiled attempts left out) over their train seconds, and
    # marked, since the rule leaves them out (the profiler slows the updates around it too).
    xs, ys = _series(events, _train_rate)
    ax.plot(xs, ys, label="training-only (train seconds)", color="C0")
    wx, wy = _series(events, lambda e: e["window"]["tokens"] / e["window"]["wall_seconds"])
    ax.plot(wx, wy, label="wall-clock (window wall seconds)", color="C1")
    # Each session's first window pays for warm-up (allocator, caches, first touch of the data): the
    # throughput_steady rule leaves it out, and so it is marked here rather than read as a slowdown.
    firsts, seen = [], set()
    for e in events:
        if e["session_id"] not in seen:
            seen.add(e["session_id"])
            firsts.append(e)
    fx, fy = _series(firsts, _train_rate)
    if fx:
        ax.plot(fx, fy, "s", color="grey", fillstyle="none", markersize=9,
                label="session's first window: warm-up, excluded from the rule")
    px, py = _series([e for e in events if window_profiled(e.get("window") or {})],
                     _train_rate)
    if px:
        ax.plot(px, py, "D", color="C3", fillstyle="none", markersize=9,
                label="window with profiled updates (train.profile), excluded from the rule")
    if not xs:
        _no_data(ax, "throughput")
    _mark_resumes(ax, summary)
    return _save(fig, ax, path)


def plot_loss_scale(summary: Summary, path: Path) -> Path:
    fig, ax = _new_axes(PLOT_TITLES["loss_scale"], "loss scale")
    precision = ((summary.run.get("recipe") or {}).get("train") or {}).get("precision")
    if precision in ("fp32", "bf16"):  # the file is still written so every report folder has the same set
        ax.text(
            0.5,
            0.5,
            f"{precision}: no loss scaling (the scale stays 1.0), so no update can be skipped for "
            "overflow.\nThis plot matters for fp16 runs only.",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=9,
        )
        return _save(fig, ax, path)
    xs, ys = _series(_train(summary), lambda e: e["loss_scale"])
    ax.plot(xs, ys, color="C4", label="loss scale (end of window)")
    skips = [e for e in summary.kept_events if e["event"] == "overflow"]
    if skips:
        sx, sy = _series(skips, lambda e: e["loss_scale_before"])
        ax.plot(sx, sy, "x", color="C3", label=f"skipped update ({len(skips)})")
    if ys and min(ys) > 0:
        ax.set_yscale("log")
    if not xs:
        _no_data(ax, "loss scale")
    ax.text(
        0.01, 0.02, f"{len(skips)} skipped update(s) in the kept history", transform=ax.transAxes, fontsize=8
    )
    _mark_resumes(ax, summary)
    return _save(fig, ax, path)


def plot_expert_load(summary: Summary, path: Path) -> Path:
    events = [e for e in _train(summary) if isinstance(e.get("moe"), dict)
              and isinstance(e["moe"].get("tokens_per_expert"), list) and e["moe"]["tokens_per_expert"]]
    layers = max((len(e["moe"]["tokens_per_expert"]) for e in events), default=0)
    if layers == 0:
        fig, ax = _new_axes(PLOT_TITLES["expert_load"], "expert")
        _no_data(ax, "expert load")
        return _save(fig, ax, path)
    fig = Figure(figsize=(8, 1.2 + 1.8 * layers), dpi=100)
    axes = fig.subplots(layers, 1, squeeze=False)[:, 0]
    steps = [e["step"] for e in events]
    for layer, ax in enumerate(axes):
        rows = []
        for e in events:
            counts = (
                e["moe"]["tokens_per_expert"][layer] if len(e["moe"]["tokens_per_expert"]) > layer else []
            )
            numbers = [float(c) if is_finite_number(c) else 0.0 for c in counts]
            mean = sum(numbers) / len(numbers) if numbers else 0.0
            rows.append([c / mean if mean > 0 else 0.0 for c in numbers])
        width = max(len(r) for r in rows)
        matrix = [[r[i] if i < len(r) else 0.0 for r in rows] for i in range(width)]  # experts x windows
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, width - 0.5, -0.5))
        ax.set_ylabel(f"MoE layer {layer}\nexpert")
        fig.colorbar(image, ax=ax, label="load / mean")
    axes[0].set_title(PLOT_TITLES["expert_load"] + " (tokens routed / mean; 0 = dead)")
    axes[-1].set_xlabel("step (applied updates)")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _plot_per_layer(ax, summary: Summary, section: str, key: str, label: str) -> int:
    """One line per layer of the per-layer list `event[section][key]` of the train events; returns how
    many."""
    events = [
        e
        for e in _train(summary)
        if isinstance(e.get(section), dict) and isinstance(e[section].get(key), list)
    ]
    layers = max((len(e[section][key]) for e in events), default=0)
    for layer in range(layers):
        xs, ys = _series(events, lambda e, layer=layer: e[section][key][layer])
        ax.plot(xs, ys, label=f"{label} {layer}", color=f"C{layer % 10}")
    return layers


def plot_qk_max_logit(summary: Summary, path: Path) -> Path:
    fig, ax = _new_axes(PLOT_TITLES["qk_max_logit"], "max pre-softmax logit (over heads)")
    layers = _plot_per_layer(ax, summary, "qk_clip", "max_logit", "layer")
    qk = ((summary.run.get("recipe") or {}).get("optim") or {}).get("qk_clip") or {}
    if qk.get("enabled", True) and is_finite_number(qk.get("tau")):
        # A tau far above the logits would squash them into a flat band: draw the line only when it is within
        # reach of the data, and otherwise say how far below it the largest logit stayed.
        peak = max((y for line in ax.get_lines() for y in line.get_ydata()), default=None)
        if peak is not None and qk["tau"] > 1.5 * peak:
            low, high = ax.get_ylim()
            ax.set_ylim(low, high + 0.15 * (high - low))  # headroom for the note above the lines
            ax.text(0.99, 0.97, f"QK-Clip tau {qk['tau']:g} is above this range (largest logit {peak:.3g})",
                    ha="right", va="top", transform=ax.transAxes, fontsize=8, color="C3")
        else:
            ax.axhline(
                qk["tau"], color="C3", linestyle="--", linewidth=0.8, label=f"QK-Clip tau {qk['tau']:g}"
            )
    # The qk_clip events as lines: a head clipped for the first time, or hard (gamma < 0.5), at the logit that
    # did it.
    clips = [
        e for e in summary.kept_events if e["event"] == "qk_clip" and is_finite_number(e.get("max_logit"))
    ]
    for marker, label, chosen in (("o", "first clip of a head", [e for e in clips if e.get("first_time")]),
                                  ("x", "hard clip (gamma < 0.5)", [e for e in clips if e.get("hard")])):
        if chosen:
            cx, cy = _series(chosen, lambda e: e["max_logit"])
            ax.plot(cx, cy, marker, color="C3", fillstyle="none", label=f"{label} ({len(chosen)})")
    if layers == 0:
        _no_data(ax, "QK max logit")
    _mark_resumes(ax, summary)
    return _save(fig, ax, path)


def plot_parameter_groups(summary: Summary, path: Path) -> Path:
    """Two panels: each group's weight RMS (Moonlight watches it grow without weight decay), and the RMS of
    its update direction (Muon in moonlight mode holds it near 0.2 by construction, AdamW's moves with the
    gradients)."""
    events = [e for e in _train(summary) if isinstance(e.get("optimizer"), dict)]
    fig = Figure(figsize=(8, 6.4), dpi=100)
    weight_ax, update_ax = fig.subplots(2, 1, sharex=True)
    for ax, key, label in (
        (weight_ax, "weight_rms", "weight RMS"),
        (update_ax, "update_rms", "update RMS / lr"),
    ):
        groups = sorted({name for e in events if isinstance(e["optimizer"].get(key), dict)
                         for name in e["optimizer"][key]})
        every = max(len(groups), len(events) // 6, 1)  # markers staggered: each group's sit at other steps
        for index, group in enumerate(groups):
            xs, ys = _series(events, lambda e, group=group, key=key: e["optimizer"][key][group])
            # Colour, line style and marker all vary, so groups that overlap stay distinguishable.
            ax.plot(
                xs,
                ys,
                label=drawn(group),
                color=f"C{index % 10}",
                linestyle=LINESTYLES[index % len(LINESTYLES)],
                marker=MARKERS[index % len(MARKERS)],
                markevery=(index % every, every),
                markersize=5,
                fillstyle="none",
            )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if groups:
            ax.set_yscale("log")
            ax.legend(loc="best", fontsize=7, ncol=2)
        else:
            _no_data(ax, label)
        _mark_resumes(ax, summary)
    weight_ax.set_title(PLOT_TITLES["parameter_groups"])
    update_ax.set_xlabel("step (applied updates)")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_block_output_rms(summary: Summary, path: Path) -> Path:
    fig, ax = _new_axes(PLOT_TITLES["block_output_rms"], "RMS of the block's output")
    if _plot_per_layer(ax, summary, "activations", "block_output_rms", "block") == 0:
        _no_data(ax, "block output RMS")
    else:
        ax.set_yscale("log")  # an RMS is positive; growth over orders of magnitude is what to see
    _mark_resumes(ax, summary)
    return _save(fig, ax, path)


# More sessions than this and the time ledger's labels stand upright (each then takes a line's height of the
# axis, not its text's width).
UPRIGHT_SESSION_LABELS_ABOVE = 8


def session_label(number: int, session_id: Any) -> str:
    """A session as the time ledger's axis names it: its number in the run and when it started (a session id
    is the UTC start stamp and a random tail, `YYYYMMDD-HHMMSS-xxxxxxxx`: month-day hour:minute), or the id's
    first 13 characters where it is not of that form."""
    text = str(session_id)
    stamp = text.split("-")
    if len(stamp) >= 2 and len(stamp[0]) == 8 and len(stamp[1]) == 6 and (stamp[0] + stamp[1]).isdigit():
        when = f"{stamp[0][4:6]}-{stamp[0][6:]} {stamp[1][:2]}:{stamp[1][2:4]}"
    else:
        when = text[:13]
    return drawn(f"{number}: {when}")


def plot_time_ledger(summary: Summary, path: Path) -> Path:
    """One stacked bar per session: its ledger parts (ledger.py), the dead time before it included. Each bar
    is named by its number and start (session_label), upright past UPRIGHT_SESSION_LABELS_ABOVE sessions, so
    that the names never overlap however many sessions a long run has."""
    from pilotrun.report.projection.ledger import PARTS

    ledger = summary.overall.get("time_ledger") or {}
    fig, ax = _new_axes(PLOT_TITLES["time_ledger"], "seconds")
    sessions = ledger.get("sessions") or []
    if not sessions:
        _no_data(ax, "sessions with events")
        return _save(fig, ax, path)
    positions = list(range(len(sessions)))
    upright = len(sessions) > UPRIGHT_SESSION_LABELS_ABOVE
    ax.set_xticks(positions, [session_label(n + 1, s["session_id"]) for n, s in enumerate(sessions)],
                  rotation=90 if upright else 0, fontsize=7 if upright else 8)
    bottoms = [0.0] * len(sessions)
    for part in PARTS:
        heights = [s["dead_before"] if part == "dead" else s["parts"][part] for s in sessions]
        if any(h > 0 for h in heights):
            ax.bar(positions, heights, bottom=bottoms, label=part)
            bottoms = [b + max(h, 0.0) for b, h in zip(bottoms, heights, strict=True)]
    good = ledger.get("goodput")
    ax.set_xlabel(f"session (goodput {100 * good:.1f}% of {ledger.get('elapsed_seconds', 0):.1f} s elapsed)"
                  if good is not None else "session")
    return _save(fig, ax, path)


def plot_downstream(summary: Summary, path: Path) -> Path:
    """Each in-loop task's accuracy over steps with its chance level, and each `pilotrun evaluate` figure at
    the step of the checkpoint it measured (hollow where the evaluation no longer stands)."""
    from pilotrun.report.verdict.downstream import task_series

    fig, ax = _new_axes(PLOT_TITLES["downstream_accuracy"], "accuracy")
    series = task_series(summary.kept_events)
    for index, (name, points) in enumerate(series.items()):
        colour = f"C{index % 10}"
        ax.plot([p[0] for p in points], [p[1]["acc"] for p in points], "o-", color=colour, label=drawn(name))
        ax.plot([p[0] for p in points], [p[1]["chance"] for p in points], ":", color=colour,
                label=f"{drawn(name)} chance")
    evaluations = summary.overall.get("evaluations") or []
    for entry in evaluations:
        for name, figures in entry["tasks"].items():
            if is_finite_number(figures.get("acc")) and isinstance(entry.get("step"), int):
                stands = entry["status"] == "stands"
                ax.plot(
                    [entry["step"]],
                    [figures["acc"]],
                    "s",
                    color="black",
                    fillstyle="full" if stands else "none",
                    label=drawn(
                        f"evaluate {name} ({entry['harness']}{'' if stands else ', ' + entry['status']})"
                    ),
                )
    if not series and not evaluations:
        _no_data(ax, "downstream accuracy (train.downstream.tasks, pilotrun evaluate)")
    _mark_resumes(ax, summary)
    return _save(fig, ax, path)


def plot_forecast(summary: Summary, path: Path) -> Path:
    """The pilot's validation losses, the law's curve over a 10x run with its 90% interval and the watch's
    band (report/projection/forecast_record.py); "no forecast: <why>" where the pilot gives none."""
    fig, ax = _new_axes(PLOT_TITLES["forecast"], "validation cross-entropy (nats)")
    made = pilot_forecast(summary)
    vx, vy = _series([e for e in summary.kept_events if e["event"] == "val"], lambda e: e["loss"])
    if "curve" in made:
        steps, centre, low, high, band_low, band_high = zip(*made["curve"], strict=True)
        ax.fill_between(steps, band_low, band_high, color="C2", alpha=0.15,
                        label="band watch holds the run to")
        ax.fill_between(steps, low, high, color="C2", alpha=0.35, label="90% interval")
        ax.plot(steps, centre, color="C2",
                label=f"forecast ({made['law']}: {made['formula'].split(' (')[0]})")
        final = made["final"]
        ax.errorbar([final["step"]], [final["value"]], yerr=[[final["value"] - final["low"]],
                    [final["high"] - final["value"]]], fmt="s", color="C3",
                    label=f"final {final['value']:.4g} ({final['low']:.4g}-{final['high']:.4g})")
    else:
        ax.text(0.5, 0.5, drawn(made.get("unavailable")), transform=ax.transAxes, ha="center", va="center",
                wrap=True, fontsize=9)
    if vx:
        ax.plot(vx, vy, "o", color="C1", label="pilot's val")
    return _save(fig, ax, path)


PLOTTERS = {
    "loss": plot_loss,
    "lr": plot_lr,
    "grad_norm": plot_grad_norm,
    "throughput": plot_throughput,
    "loss_scale": plot_loss_scale,
    "expert_load": plot_expert_load,
    "qk_max_logit": plot_qk_max_logit,
    "parameter_groups": plot_parameter_groups,
    "block_output_rms": plot_block_output_rms,
    "time_ledger": plot_time_ledger,
    "downstream_accuracy": plot_downstream,
    "forecast": plot_forecast,
}


def write_plots(summary: Summary, out_dir: str | Path) -> dict[str, Path]:
    """Draw every plot into out_dir as NAME.png; returns name -> path in PLOT_NAMES order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {name: PLOTTERS[name](summary, out_dir / f"{name}.png") for name in PLOT_NAMES}
