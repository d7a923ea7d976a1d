"""The verdict's judges of whether the loss behaves: it stays finite, falls by more than its own noise, does
not rise again over the end of the run, val tracks train, the gradient norm does not spike, and clipping,
skipped updates, expert load and QK-Clip stay within their bounds. Each returns a Finding; the rule table
(rules.py) names it and says what it means.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

from pilotrun.report.record_check.spike_history import spike_overview
from pilotrun.report.verdict.evidence import lacks, recipe_value, train_events, window_of
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Finding, Thresholds
from pilotrun.run.record import is_finite_number
from pilotrun.training.spikes.bound import grad_norm_floor_share, spike_against, step_spread

if TYPE_CHECKING:
    from pilotrun.report.record_check.summarize import Summary


def judge_losses_finite(summary: Summary, t: Thresholds) -> Finding:
    losses = [
        (e["event"], e["step"], e.get("loss")) for e in summary.kept_events if e["event"] in ("train", "val")
    ]
    bad = [(kind, step, loss) for kind, step, loss in losses if not is_finite_number(loss)]
    evidence = f"{len(losses)} train/val loss values of the kept history"
    if not losses:
        return Finding(FAIL, "no loss recorded", "every loss finite", evidence)
    if bad:
        kind, step, loss = bad[0]
        return Finding(FAIL, f"{len(bad)} non-finite; first: {kind} loss {loss} at step {step}",
                       "every loss finite", evidence)
    return Finding(PASS, f"all {len(losses)} finite", "every loss finite", evidence)


def loss_noise(losses: list[float], min_windows: int = 4) -> float | None:
    """The per-window noise of the training loss: spike_bound.step_spread, the robust standard deviation of
    successive differences that also scales the spike bound over logged windows. None with fewer than
    `min_windows` windows (at least 3: two differences)."""
    if len(losses) < max(3, min_windows):
        return None
    return step_spread(losses)


def judge_loss_decreased(summary: Summary, t: Thresholds) -> Finding:
    losses = [float(e["loss"]) for e in train_events(summary) if is_finite_number(e.get("loss"))]
    threshold = (
        f"drop > {t.loss_drop_sigmas:g} sigma of the window noise and >= {t.min_loss_drop_floor:.0%} "
        f"(WARN below {t.min_loss_drop:.0%}); first vs last {t.loss_window_fraction:.0%} of windows"
    )
    if len(losses) < 2:
        return Finding(FAIL, f"only {len(losses)} finite train window(s)", threshold,
                       "train windows")
    k = max(1, round(len(losses) * t.loss_window_fraction))
    first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
    drop = (first - last) / abs(first) if first != 0 else 0.0
    noise = loss_noise(losses)
    standard_error = noise * math.sqrt(2 / k) if noise is not None else None
    sigmas = (first - last) / standard_error if standard_error else math.inf if first > last else 0.0
    noise_text = (f"window noise {noise:.4g}, drop = {sigmas:.1f} sigma of the difference of means"
                  if noise is not None else "too few windows to measure the noise")
    figure = f"mean train loss {first:.4f} -> {last:.4f} ({drop:+.2%} drop); {noise_text}"
    if drop <= 0 or drop < t.min_loss_drop_floor or sigmas <= t.loss_drop_sigmas:
        status = FAIL
        why = (
            "the drop is within the loss's own noise" if drop >= t.min_loss_drop_floor else "too small a drop"
        )
        figure = f"not learning ({why}): {figure}"
    else:
        status = PASS if drop >= t.min_loss_drop else WARN
    return Finding(status, figure, threshold,
                   f"{k} first and {k} last of {len(losses)} train windows; noise from all successive pairs")


def judge_loss_rise_at_end(summary: Summary, t: Thresholds) -> Finding:
    """The end of the run against the best level the loss held before it: medians, so that a spike or two in
    either part moves neither, and the noise from successive differences, so that a noisy plateau never
    FAILs."""
    losses = [(e["step"], float(e["loss"])) for e in train_events(summary) if is_finite_number(e.get("loss"))]
    k = max(3, round(len(losses) * t.loss_rise_window_fraction))
    threshold = (
        f"median of the last {t.loss_rise_window_fraction:.0%} of windows (>= 3) <= the best median of as "
        f"many consecutive windows before + max({t.loss_rise_sigmas:g} sigma, {t.min_loss_rise:.0%})"
    )
    evidence = f"{len(losses)} finite train windows; noise from all successive pairs"
    if len(losses) < 2 * k:
        return Finding(
            WARN,
            f"only {len(losses)} finite train window(s): too few to compare the last {k} with as "
            "many before them",
            threshold,
            evidence,
        )
    values = [loss for _, loss in losses]
    end = statistics.median(values[-k:])
    before = values[:-k]
    best, at = min((statistics.median(before[i:i + k]), i) for i in range(len(before) - k + 1))
    noise = loss_noise(values) or 0.0
    # A median of k windows has 1.2533 / sqrt(k) of one window's standard deviation (normal noise).
    standard_error = 1.2533 * noise * math.sqrt(2 / k)
    rise = end - best
    share = rise / abs(best) if best != 0 else 0.0
    sigmas = rise / standard_error if standard_error > 0 else math.inf if rise > 0 else 0.0
    figure = (
        f"median train loss {end:.4f} over the last {k} windows (steps {losses[-k][0]}-{losses[-1][0]}) vs "
        f"the best {best:.4f} (steps {losses[at][0]}-{losses[at + k - 1][0]}): {rise:+.4f} ({share:+.2%}), "
        f"{sigmas:.1f} sigma of window noise {noise:.4g}"
    )
    if rise > 0 and sigmas > t.loss_rise_sigmas and share > t.min_loss_rise:
        return Finding(FAIL, f"the loss rises at the end: {figure}", threshold, evidence)
    return Finding(PASS, figure, threshold, evidence)


def judge_val_tracks_train(summary: Summary, t: Thresholds) -> Finding:
    train = [(e["step"], float(e["loss"])) for e in train_events(summary) if is_finite_number(e.get("loss"))]
    vals = [(e["step"], float(e["loss"])) for e in summary.kept_events
            if e["event"] == "val" and is_finite_number(e.get("loss"))]
    threshold = (
        f"gap growth <= {t.max_val_gap_growth} nats and last val <= best val x {1 + t.max_val_rise:.2f}"
    )
    pairs = []
    for step, val in vals:
        before = [loss for s, loss in train if s <= step]
        if before:
            pairs.append((step, val, before[-1]))
    if len(pairs) < 2:
        return Finding(WARN, f"only {len(pairs)} evaluation(s) with a train loss before them",
                       threshold, "val events")
    # The gap is compared over the second half of the run: early on the loss falls so fast that the window
    # mean of the training loss lags the (end-of-window) val loss, which would look like a widening gap.
    half = pairs[-1][0] / 2
    late = [p for p in pairs if p[0] >= half]
    if len(late) < 2:
        late = pairs[-2:]
    (s0, v0, tr0), (s1, v1, tr1) = late[0], late[-1]
    growth = (v1 - tr1) - (v0 - tr0)
    best = min(v for _, v, _ in pairs)
    rise = (v1 - best) / abs(best) if best != 0 else 0.0
    status = FAIL if growth > t.max_val_gap_growth or rise > t.max_val_rise else PASS
    figure = (
        f"val {v0:.4f} -> {v1:.4f} (steps {s0} -> {s1}), val-train gap {v0 - tr0:+.4f} -> {v1 - tr1:+.4f} "
        f"(growth {growth:+.4f}), last val {rise:+.1%} vs best"
    )
    return Finding(
        status,
        figure,
        threshold,
        f"{len(pairs)} val events vs the latest train window; gap over the {len(late)} from step {s0}",
    )


def judge_grad_spikes(summary: Summary, t: Thresholds) -> Finding:
    """A window whose largest gradient norm is a spike of the previous windows' (training/spikes/bound.py:
    median + spike_factor x max(step spread, floor share x the median), over logged windows). The floor share
    is the trainer's detector's for the run's tokens per update (bound.grad_norm_floor_share): a window's
    largest norm is one update's, as noisy as the batch it was computed on."""
    history: list[float] = []
    spikes = []
    tokens = summary.run.get("tokens_per_update")
    share = grad_norm_floor_share(tokens if type(tokens) is int and tokens > 0 else None)
    for e in train_events(summary):
        value = e.get("grad_norm_max", e.get("grad_norm"))
        if not is_finite_number(value):
            continue  # a non-finite norm is a skipped update, judged by the skip rule
        spiked, found = spike_against(float(value), history[-t.spike_median_window:], t.spike_factor, share,
                                      t.spike_min_history, step_spread)
        if spiked and found is not None:
            spikes.append((e["step"], float(value), found[0], found[2]))
        history.append(float(value))
    threshold = (f"<= {t.max_grad_spikes} spike(s) > median + {t.spike_factor:g} x max(step spread, "
                 f"{share:.3g} x median) of the previous {t.spike_median_window} windows "
                 f"(>= {1 + t.spike_factor * share:.3g}x the median)")
    evidence = f"grad_norm_max of {len(history)} train windows"
    if not history:
        return Finding(FAIL, "no gradient norm recorded: the record lacks this rule's evidence",
                       threshold, evidence)
    trainers, loss_only = trainer_spikes(summary, {s for s, *_ in spikes})
    if not spikes and not trainers:
        return Finding(
            PASS, f"no gradient-norm spike; max grad norm {max(history):.4g}{loss_only}", threshold, evidence
        )
    listed = ", ".join([*(f"step {s}: {v:.4g} (bound {b:.4g}, {v / m:.1f}x median)" if m > 0 else
                          f"step {s}: {v:.4g} (bound {b:.4g})" for s, v, m, b in spikes[:5]), *trainers[:5]])
    status = WARN if len(spikes) + len(trainers) <= t.max_grad_spikes else FAIL
    return Finding(status, f"{len(spikes) + len(trainers)} spike(s): {listed}{loss_only}", threshold,
                   evidence + "; the trainer's spike events")


def trainer_spikes(summary: Summary, steps: set[int]) -> tuple[list[str], str]:
    """The trainer's own spikes (its per-update bound, the spikes row's) as this row tells them: those in the
    gradient norm that no logged window shows (a skipped or rolled-back update leaves none) count here too,
    and those in the loss alone are named as such, so that this row never says "no spike" beside them."""
    overview = (summary.overall or {}).get("spikes") or spike_overview(
        summary.kept_events + summary.rolled_back_events
    )
    found, loss_only = [], []
    for spike in overview.get("list") or []:
        signals, step = spike.get("signals") or [], spike.get("step")
        if "grad_norm" in signals and step not in steps:
            norm = spike.get("grad_norm")
            found.append(f"update {step}: {norm:.4g} (the trainer's spike, above its per-update bound)"
                         if is_finite_number(norm) else f"update {step}: not finite (the trainer's spike)")
        elif "grad_norm" not in signals:
            loss_only.append(str(step))
    said = (
        f"; the trainer's spike(s) at update(s) {', '.join(loss_only[:5])} were in the loss alone (spikes "
        "row)"
        if loss_only
        else ""
    )
    return found, said


def judge_clip_rate(summary: Summary, t: Thresholds) -> Finding:
    grad_clip = recipe_value(summary, "optim.grad_clip")
    events = train_events(summary)
    threshold = f"clipped / applied <= {t.max_clip_rate:.0%} over the second half"
    if grad_clip is None:
        return lacks("optim.grad_clip", threshold)
    if grad_clip == 0:
        return Finding(PASS, "clipping disabled (optim.grad_clip = 0)", threshold, "recipe")
    final_step = events[-1]["step"] if events else 0
    second_half = [e for e in events if e["step"] > final_step / 2]
    clipped = [window_of(e).get("clipped") for e in second_half]
    applied = sum(int(window_of(e).get("updates_applied", 0)) for e in second_half)
    if not second_half or any(not isinstance(c, int) for c in clipped) or applied == 0:
        return Finding(FAIL, "clipping counts not recorded: the record lacks this rule's evidence",
                       threshold, "train windows")
    rate = sum(clipped) / applied
    return Finding(PASS if rate <= t.max_clip_rate else FAIL,
                   f"{sum(clipped)} of {applied} applied updates clipped ({rate:.1%})", threshold,
                   f"{len(second_half)} train windows after step {final_step // 2}")


def judge_skip_rate(summary: Summary, t: Thresholds) -> Finding:
    attempted, skipped = summary.final.updates_attempted, summary.final.updates_skipped
    threshold = f"skipped / attempted <= {t.max_skip_rate:.1%}"
    if attempted == 0:
        return Finding(FAIL, "no update attempted", threshold, "counters")
    rate = skipped / attempted
    return Finding(PASS if rate <= t.max_skip_rate else FAIL,
                   f"{skipped} of {attempted} updates skipped ({rate:.1%})", threshold,
                   "cumulative counters of the kept history")


def judge_experts(summary: Summary, t: Thresholds) -> Finding:
    events = [e for e in train_events(summary) if isinstance(e.get("moe"), dict)
              and isinstance(e["moe"].get("tokens_per_expert"), list) and e["moe"]["tokens_per_expert"]]
    threshold = f"dead experts <= {t.max_dead_experts}; max/mean load <= {t.max_imbalance} per layer"
    if not events:
        config = (summary.run.get("model") or {}).get("config") or {}
        if not (isinstance(config.get("n_layers"), int) and isinstance(config.get("n_dense_layers"), int)):
            return Finding(FAIL, "run.json lacks model.config.n_layers / n_dense_layers", threshold,
                           "run.json")
        if config["n_layers"] > config["n_dense_layers"]:
            return Finding(FAIL, "MoE layers exist but no expert load was recorded: the record lacks "
                           "this rule's evidence", threshold, "train windows")
        return Finding(PASS, "not applicable: the model has no MoE layer", threshold, "model config")
    k = max(1, round(len(events) * t.balance_window_fraction))
    tail = events[-k:]
    layers = len(tail[-1]["moe"]["tokens_per_expert"])
    dead, imbalances = 0, []
    for layer in range(layers):
        rows = [
            e["moe"]["tokens_per_expert"][layer] for e in tail if len(e["moe"]["tokens_per_expert"]) > layer
        ]
        totals = [sum(float(r[i]) for r in rows) for i in range(len(rows[0]))]
        mean = statistics.fmean(totals)
        dead += sum(1 for c in totals if c == 0)
        imbalances.append(max(totals) / mean if mean > 0 else math.inf)
    worst = max(imbalances)
    status = FAIL if dead > t.max_dead_experts or worst > t.max_imbalance else PASS
    return Finding(
        status,
        f"{dead} dead expert(s); max/mean load per layer {', '.join(f'{x:.2f}' for x in imbalances)}",
        threshold,
        f"tokens_per_expert summed over the last {k} of {len(events)} train windows",
    )


def judge_qk_clip(summary: Summary, t: Thresholds) -> Finding:
    qk_enabled = recipe_value(summary, "optim.qk_clip.enabled")
    events = train_events(summary)
    threshold = f"updates with a QK-Clip rescale <= {t.max_qk_clip_rate:.0%} of applied updates"
    if not isinstance(qk_enabled, bool):
        return lacks("optim.qk_clip.enabled", threshold)
    max_logits = [float(x) for e in events if isinstance(e.get("qk_clip"), dict)
                  and isinstance(e["qk_clip"].get("max_logit"), list)
                  for x in e["qk_clip"]["max_logit"] if is_finite_number(x)]
    peak = f"; max logit {max(max_logits):.2f}" if max_logits else ""
    if qk_enabled is False:
        return Finding(PASS, f"QK-Clip disabled (optim.qk_clip.enabled = false){peak}", threshold,
                       "recipe")
    # updates_with_clip is cumulative over the run (restored with the checkpoint), so the last kept window's
    # value counts every update of the kept history on which any head was rescaled.
    counts = [
        e["qk_clip"].get("updates_with_clip") if isinstance(e.get("qk_clip"), dict) else None for e in events
    ]
    applied = summary.final.step
    if not events or not isinstance(counts[-1], int) or applied == 0:
        return Finding(FAIL, "QK-Clip counts not recorded: the record lacks this rule's evidence",
                       threshold, "train windows")
    rate = counts[-1] / applied
    first = next((e for e in summary.kept_events if e["event"] == "qk_clip" and e.get("first_time")), None)
    first_text = (
        f"; first clip at step {first['step']} (layer {first.get('layer')}, head {first.get('head')}, "
        f"max logit {first.get('max_logit'):.4g})"
        if first and is_finite_number(first.get("max_logit"))
        else ""
    )
    return Finding(PASS if rate <= t.max_qk_clip_rate else FAIL,
                   f"QK-Clip rescaled heads on {counts[-1]} of {applied} applied updates ({rate:.1%}){peak}"
                   f"{first_text}", threshold,
                   "cumulative qk_clip.updates_with_clip of the last kept train window; qk_clip events")


