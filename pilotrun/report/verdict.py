"""`pilotrun verdict`: GO or NO-GO for a pilot, from documented rules over the kept history of the run.

Each rule gives PASS, WARN or FAIL with the figure it measured; the pilot is GO when no rule FAILs. WARN
means the evidence is thin or borderline (shown, not blocking). The rules judge the pilot's own record:
a GO says "this recipe ran without the listed problems for these updates", never that the final model
will be good.

Only the kept history counts (summarize's reconciliation): windows a crashed session logged after the
checkpoint its successor resumed from are rolled back. They are still useful once: where the resumed
session replayed the same window (same step range and counters), its loss must be bit-identical to the
rolled-back one, which is direct evidence of exact continuation.

Thresholds (defaults below, each overridable with `--threshold NAME=VALUE`):
- record_valid: summarize finds no problem, and run.json holds everything the rules read (the recipe, the
  model config, the data identity, the recorded changes): a rule never falls back to a default.
- loss_decreased: mean training loss over the first and the last `loss_window_fraction` (0.2) of windows.
  The drop is judged against the loss's own noise: the window-to-window spread (a robust standard deviation
  of successive differences) gives the standard error of the difference of the two means, and the drop must
  exceed `loss_drop_sigmas` (3.0) of it. FAIL ("not learning") when the drop is within the noise or below
  `min_loss_drop_floor` (1%); WARN when it is real but below `min_loss_drop` (5%); a WARN allows GO.
- max_val_gap_growth 0.5 nats: val minus train loss may grow at most this much between the evaluations of
  the second half of the run; max_val_rise 0.05: the last val loss may be at most 5% above the best one.
  Fewer than two evaluations WARNs (allows GO: thin evidence, shown).
- spike_factor 5.0: a window whose max gradient norm exceeds 5x the median of the previous
  `spike_median_window` (20) windows (after `spike_min_history` (5)) is a spike; one spike WARNs (allows
  GO), more than max_grad_spikes (1) FAIL.
- max_clip_rate 0.5: share of applied updates clipped over the second half of the pilot (warm-up clipping
  is expected); max_skip_rate 0.05: skipped / attempted updates over the kept history.
- min_throughput_ratio 0.6: median training-only tokens/s over the last third of windows over the first
  third (each session's first window is warm-up and left out, and so is every window with update attempts run
  under the profiler, `window.profiled_attempts` > 0). Below it, on a CPU run whose windows record
  the process's CPU seconds, the same ratio is taken of tokens per CPU second: when that one holds (the
  work per token did not grow) the machine got busier, not the run slower, and the rule WARNs with both
  figures (allows GO). min_cpu_share_ratio 0.6: failing that, when the process's CPU seconds per training
  second (its share of the CPU) fell below 0.6 of the first third's, other load took the CPU, and the rule
  WARNs too: sharing a core makes every token cost more CPU time as well (each switch to another task evicts
  the trainer's caches; two competing processes cost 1.2x to 4x per token on this project's machine), so the
  work per CPU second cannot tell the recipe's own slowdown apart there, and the WARN says to judge it on a
  quiet machine. Otherwise (the share held, each token cost more) it FAILs. On CUDA the same holds with tokens per device second
  (`window.device_seconds`, from CUDA timing events around each update): the process CPU time says nothing of
  the device's work there.
- memory_budget_gb 0 (= the recipe's train.memory_budget_gb; 0 there too = no budget): peak memory (CUDA
  max allocated, else peak RSS) must fit; max_memory_growth 1.5: RSS at a session's last window over its
  first may grow at most 1.5x (a leak).
- max_imbalance 1.5 (max/mean tokens per expert, per layer) and max_dead_experts 0 (experts with no token),
  both over the last `balance_window_fraction` (0.25) of windows summed.
- max_qk_clip_rate 0.5: share of applied updates on which QK-Clip rescaled any head.
- resumed: the kept history includes a resume followed by at least one applied update (a finished run
  resumed with nothing left to do proves nothing), counters continuous, replayed windows bit-identical
  (waived by --no-resume-required, then WARN, which allows GO).
- final_checkpoint: the checkpoint at the final step is committed and every file matches the sha256 in its
  marker; missing or damaged, the run cannot be continued from where it ended: FAIL.
- recipe_changes: every change accepted on resume (--allow-change) is named with the update it took effect
  from; the evidence supports the recipe in force at the end, over the updates since the last change. A
  change WARNs (allows GO); it FAILs when the windows after it show the optimizer ran another peak LR than
  the recorded recipe (lr / lr_multiplier of the first optimizer group): the change was recorded, not applied.
A rule that finds the evidence it needs missing from the record FAILs. GO means no rule FAILed; the WARNs
are printed under the GO line.

`judge(run_dir)` summarizes with `--require-step max_steps`: a pilot that has not finished is not valid.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.files import canonical_sha256
from pilotrun.report.continuity import (
    recipe_changes_in_history,
    rule_final_checkpoint,
    rule_recipe_changes,
    rule_resumed,
)
from pilotrun.report.summarize import Summary, summarize_run, window_profiled
from pilotrun.report.thresholds import (  # noqa: F401  (ThresholdError, parse_thresholds: re-exported for the CLI)
    FAIL,
    PASS,
    WARN,
    RuleResult,
    ThresholdError,
    Thresholds,
    parse_thresholds,
)
from pilotrun.run.lock import describe_frozen_status, frozen_candidate_status
from pilotrun.run.record import is_finite_number


@dataclass
class Verdict:
    decision: str  # "GO" or "NO-GO"
    rules: list[RuleResult]
    statement: str
    thresholds: Thresholds
    summary: Summary = field(repr=False)
    # The recipe the evidence supports (the one in force at the end), its sha256 and the changes on resume.
    candidate: dict[str, Any] = field(default_factory=dict)
    frozen: dict[str, Any] | None = None  # the frozen candidate a run started from, and whether it still matches

    @property
    def warnings(self) -> list[RuleResult]:
        return [r for r in self.rules if r.status == WARN]

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "statement": self.statement,
                "rules": [dataclasses.asdict(r) for r in self.rules],
                "failed": [r.name for r in self.rules if r.status == FAIL],
                "warnings": [dataclasses.asdict(r) for r in self.warnings], "candidate": self.candidate,
                "frozen": self.frozen, "thresholds": dataclasses.asdict(self.thresholds),
                "summary": self.summary.to_dict()}


def _train_events(summary: Summary) -> list[dict[str, Any]]:
    return [e for e in summary.kept_events if e["event"] == "train"]


def _window(event: dict[str, Any]) -> dict[str, Any]:
    window = event.get("window")
    return window if isinstance(window, dict) else {}


def _recipe_value(summary: Summary, dotted: str) -> Any:
    """A value of run.json's recipe, or None where the record lacks it (never a default)."""
    node: Any = summary.run.get("recipe")
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _lacks(name: str, dotted: str, threshold: str) -> RuleResult:
    return RuleResult(name, FAIL, f"run.json's recipe lacks {dotted}: this rule cannot be judged", threshold,
                      "run.json recipe")


def rule_record_valid(summary: Summary, t: Thresholds) -> RuleResult:
    figure = "valid" if summary.valid else f"{len(summary.reasons)} problem(s); first: {summary.reasons[0]}"
    return RuleResult("record_valid", PASS if summary.valid else FAIL, figure, "summarize finds no problem",
                      "run.json + metrics.jsonl, every session")


def rule_losses_finite(summary: Summary, t: Thresholds) -> RuleResult:
    losses = [(e["event"], e["step"], e.get("loss")) for e in summary.kept_events if e["event"] in ("train", "val")]
    bad = [(kind, step, loss) for kind, step, loss in losses if not is_finite_number(loss)]
    evidence = f"{len(losses)} train/val loss values of the kept history"
    if not losses:
        return RuleResult("losses_finite", FAIL, "no loss recorded", "every loss finite", evidence)
    if bad:
        kind, step, loss = bad[0]
        return RuleResult("losses_finite", FAIL, f"{len(bad)} non-finite; first: {kind} loss {loss} at step {step}",
                          "every loss finite", evidence)
    return RuleResult("losses_finite", PASS, f"all {len(losses)} finite", "every loss finite", evidence)


def loss_noise(losses: list[float]) -> float | None:
    """The per-window noise of the training loss: a robust standard deviation of successive differences
    (1.4826 x their median absolute deviation, over sqrt 2 since a difference carries two windows' noise).
    The trend adds to the differences too, which only makes the estimate, and so the rule, more cautious.
    None with fewer than 4 windows."""
    if len(losses) < 4:
        return None
    diffs = [b - a for a, b in zip(losses, losses[1:], strict=False)]
    centre = statistics.median(diffs)
    return 1.4826 * statistics.median(abs(d - centre) for d in diffs) / math.sqrt(2)


def rule_loss_decreased(summary: Summary, t: Thresholds) -> RuleResult:
    losses = [float(e["loss"]) for e in _train_events(summary) if is_finite_number(e.get("loss"))]
    threshold = (f"drop > {t.loss_drop_sigmas:g} sigma of the window noise and >= {t.min_loss_drop_floor:.0%} "
                 f"(WARN below {t.min_loss_drop:.0%}); first vs last {t.loss_window_fraction:.0%} of windows")
    if len(losses) < 2:
        return RuleResult("loss_decreased", FAIL, f"only {len(losses)} finite train window(s)", threshold,
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
        why = "the drop is within the loss's own noise" if drop >= t.min_loss_drop_floor else "too small a drop"
        figure = f"not learning ({why}): {figure}"
    else:
        status = PASS if drop >= t.min_loss_drop else WARN
    return RuleResult("loss_decreased", status, figure, threshold,
                      f"{k} first and {k} last of {len(losses)} train windows; noise from all successive pairs")


def rule_val_tracks_train(summary: Summary, t: Thresholds) -> RuleResult:
    train = [(e["step"], float(e["loss"])) for e in _train_events(summary) if is_finite_number(e.get("loss"))]
    vals = [(e["step"], float(e["loss"])) for e in summary.kept_events
            if e["event"] == "val" and is_finite_number(e.get("loss"))]
    threshold = f"gap growth <= {t.max_val_gap_growth} nats and last val <= best val x {1 + t.max_val_rise:.2f}"
    pairs = []
    for step, val in vals:
        before = [loss for s, loss in train if s <= step]
        if before:
            pairs.append((step, val, before[-1]))
    if len(pairs) < 2:
        return RuleResult("val_tracks_train", WARN, f"only {len(pairs)} evaluation(s) with a train loss before them",
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
    figure = (f"val {v0:.4f} -> {v1:.4f} (steps {s0} -> {s1}), val-train gap {v0 - tr0:+.4f} -> {v1 - tr1:+.4f} "
              f"(growth {growth:+.4f}), last val {rise:+.1%} vs best")
    return RuleResult("val_tracks_train", status, figure, threshold,
                      f"{len(pairs)} val events vs the latest train window; gap over the {len(late)} from step {s0}")


def rule_grad_spikes(summary: Summary, t: Thresholds) -> RuleResult:
    history: list[float] = []
    spikes = []
    events = _train_events(summary)
    for e in events:
        value = e.get("grad_norm_max", e.get("grad_norm"))
        if not is_finite_number(value):
            continue  # a non-finite norm is a skipped update, judged by the skip rule
        recent = history[-t.spike_median_window:]
        if len(recent) >= t.spike_min_history:
            median = statistics.median(recent)
            if median > 0 and value > t.spike_factor * median:
                spikes.append((e["step"], float(value), median))
        history.append(float(value))
    threshold = f"<= {t.max_grad_spikes} spike(s) > {t.spike_factor}x running median"
    evidence = f"grad_norm_max of {len(history)} train windows"
    if not history:
        return RuleResult("grad_spikes", FAIL, "no gradient norm recorded: the record lacks this rule's evidence",
                          threshold, evidence)
    if not spikes:
        return RuleResult("grad_spikes", PASS, f"no spike; max grad norm {max(history):.4g}", threshold, evidence)
    listed = ", ".join(f"step {s}: {v:.4g} ({v / m:.1f}x median)" for s, v, m in spikes[:5])
    status = WARN if len(spikes) <= t.max_grad_spikes else FAIL
    return RuleResult("grad_spikes", status, f"{len(spikes)} spike(s): {listed}", threshold, evidence)


def rule_clip_rate(summary: Summary, t: Thresholds) -> RuleResult:
    grad_clip = _recipe_value(summary, "optim.grad_clip")
    events = _train_events(summary)
    threshold = f"clipped / applied <= {t.max_clip_rate:.0%} over the second half"
    if grad_clip is None:
        return _lacks("clip_rate", "optim.grad_clip", threshold)
    if grad_clip == 0:
        return RuleResult("clip_rate", PASS, "clipping disabled (optim.grad_clip = 0)", threshold, "recipe")
    final_step = events[-1]["step"] if events else 0
    second_half = [e for e in events if e["step"] > final_step / 2]
    clipped = [_window(e).get("clipped") for e in second_half]
    applied = sum(int(_window(e).get("updates_applied", 0)) for e in second_half)
    if not second_half or any(not isinstance(c, int) for c in clipped) or applied == 0:
        return RuleResult("clip_rate", FAIL, "clipping counts not recorded: the record lacks this rule's evidence",
                          threshold, "train windows")
    rate = sum(clipped) / applied
    return RuleResult("clip_rate", PASS if rate <= t.max_clip_rate else FAIL,
                      f"{sum(clipped)} of {applied} applied updates clipped ({rate:.1%})", threshold,
                      f"{len(second_half)} train windows after step {final_step // 2}")


def rule_skip_rate(summary: Summary, t: Thresholds) -> RuleResult:
    attempted, skipped = summary.final.updates_attempted, summary.final.updates_skipped
    threshold = f"skipped / attempted <= {t.max_skip_rate:.1%}"
    if attempted == 0:
        return RuleResult("skip_rate", FAIL, "no update attempted", threshold, "counters")
    rate = skipped / attempted
    return RuleResult("skip_rate", PASS if rate <= t.max_skip_rate else FAIL,
                      f"{skipped} of {attempted} updates skipped ({rate:.1%})", threshold,
                      "cumulative counters of the kept history")


def _session_devices(summary: Summary) -> set[str]:
    kept = set(summary.lineage)
    return {str((s.get("hardware") or {}).get("device")) for s in summary.run.get("sessions") or []
            if isinstance(s, dict) and str(s.get("session_id")) in kept}


def rule_throughput_steady(summary: Summary, t: Thresholds) -> RuleResult:
    rates, cpu_rates, device_rates = [], [], []
    seen_sessions = set()
    profiled = 0
    for e in _train_events(summary):
        w = _window(e)
        first_of_session = e["session_id"] not in seen_sessions
        seen_sessions.add(e["session_id"])
        if first_of_session:
            continue  # warm-up: allocator, caches, first-touch of the data
        if window_profiled(w):
            # torch.profiler slows what it records and the updates around it (its start, its trace): such a
            # window says nothing about the recipe's steady speed.
            profiled += 1
            continue
        if is_finite_number(w.get("tokens")) and is_finite_number(w.get("train_seconds")) and w["train_seconds"] > 0:
            rates.append(w["tokens"] / w["train_seconds"])
            cpu = w.get("cpu_seconds")
            cpu_rates.append(w["tokens"] / cpu if is_finite_number(cpu) and cpu > 0 else None)
            device = w.get("device_seconds")
            device_rates.append(w["tokens"] / device if is_finite_number(device) and device > 0 else None)
    threshold = (f"last-third / first-third median of training-only tok/s >= {t.min_throughput_ratio} (tok per "
                 "process CPU second on a CPU, per device second on CUDA, held to the same bound separates a busier "
                 f"machine, and so does, on a CPU, the process's share of the CPU falling below {t.min_cpu_share_ratio} "
                 "of what it was)")
    evidence = f"training-only tokens/s of {len(rates)} train windows (each session's first left out"
    evidence += f", and {profiled} with profiled updates)" if profiled else ")"
    if len(rates) < 6:
        return RuleResult("throughput_steady", WARN, f"only {len(rates)} windows to compare", threshold, evidence)
    third = len(rates) // 3
    first, last = statistics.median(rates[:third]), statistics.median(rates[-third:])
    ratio = last / first
    figure = f"median {first:.1f} -> {last:.1f} tok/s (ratio {ratio:.2f})"
    have_cpu = all(r is not None for r in cpu_rates)
    if have_cpu:
        cpu_first = statistics.median(cpu_rates[:third])
        cpu_last = statistics.median(cpu_rates[-third:])
        cpu_ratio = cpu_last / cpu_first
        share_first = statistics.median(c / r for c, r in zip(rates[:third], cpu_rates[:third], strict=True))
        share_last = statistics.median(c / r for c, r in zip(rates[-third:], cpu_rates[-third:], strict=True))
        figure += (f"; per process CPU second {cpu_first:.1f} -> {cpu_last:.1f} tok (ratio {cpu_ratio:.2f}), CPU "
                   f"seconds per training second {share_first:.2f} -> {share_last:.2f}")
        evidence += "; window.cpu_seconds"
    have_device = all(r is not None for r in device_rates)
    if have_device:
        device_first = statistics.median(device_rates[:third])
        device_last = statistics.median(device_rates[-third:])
        device_ratio = device_last / device_first
        figure += f"; per device second {device_first:.1f} -> {device_last:.1f} tok (ratio {device_ratio:.2f})"
        evidence += "; window.device_seconds (CUDA timing events)"
    if ratio >= t.min_throughput_ratio:
        return RuleResult("throughput_steady", PASS, figure, threshold, evidence)
    devices = _session_devices(summary)
    on_cuda = bool(devices) and all(d.startswith("cuda") for d in devices)
    if (have_cpu and devices == {"cpu"} and cpu_ratio >= t.min_throughput_ratio) or \
            (have_device and on_cuda and device_ratio >= t.min_throughput_ratio):
        what = "process CPU second" if devices == {"cpu"} else "device second"
        return RuleResult("throughput_steady", WARN, f"the machine got busier: {figure}; the work per token (tokens "
                          f"per {what}) held, so the slowdown is other load on the machine, not the recipe",
                          threshold, evidence)
    if have_cpu and devices == {"cpu"} and share_last / share_first < t.min_cpu_share_ratio:
        # The process got much less of the CPU per training second than before: other load took it. Sharing a
        # core also makes each token cost more CPU time (every switch to another task evicts the trainer's
        # caches; measured here at 1.2x to 4x under two competing processes), so the work per CPU second cannot
        # acquit the recipe either way; the slowdown is reported, and the recipe's own speed left to a quiet run.
        return RuleResult("throughput_steady", WARN, f"the machine got busier: {figure}; the process got "
                          f"{share_last / share_first:.2f} of its share of the CPU, so other load took it; its work "
                          "per CPU second fell too (sharing a core evicts its caches), so judge the recipe's own speed "
                          "on a quiet machine", threshold, evidence)
    if on_cuda and not have_device:
        figure += "; device time not recorded, so contention cannot be told apart"
    elif not on_cuda and not have_cpu:
        figure += "; CPU time not recorded, so contention cannot be told apart"
    elif devices != {"cpu"} and not on_cuda:
        figure += f"; devices {', '.join(sorted(devices))}: no one measure of the work per token"
    else:
        figure += "; the work per token grew too: the run itself slowed"
    return RuleResult("throughput_steady", FAIL, figure, threshold, evidence)


def rule_memory(summary: Summary, t: Thresholds) -> RuleResult:
    recipe_budget = _recipe_value(summary, "train.memory_budget_gb")
    if not is_finite_number(recipe_budget):
        return _lacks("memory", "train.memory_budget_gb", f"RSS growth within a session <= {t.max_memory_growth}x")
    budget_gb = t.memory_budget_gb or float(recipe_budget)
    peaks, growth = [], []
    by_session: dict[str, list[float]] = {}
    for e in _train_events(summary):
        memory = e.get("memory") if isinstance(e.get("memory"), dict) else {}
        cuda = memory.get("cuda_max_allocated_mb")
        peak = cuda if is_finite_number(cuda) and cuda > 0 else memory.get("peak_rss_mb")
        if is_finite_number(peak):
            peaks.append(float(peak))
        if is_finite_number(memory.get("rss_mb")):
            by_session.setdefault(e["session_id"], []).append(float(memory["rss_mb"]))
    for sid, values in by_session.items():
        if len(values) >= 3 and values[0] > 0:
            growth.append((values[-1] / values[0], sid))
    budget_text = f"peak <= {budget_gb:g} GB" if budget_gb > 0 else "no budget set (train.memory_budget_gb = 0)"
    threshold = f"{budget_text}; RSS growth within a session <= {t.max_memory_growth}x"
    if not peaks:
        return RuleResult("memory", FAIL, "memory not recorded: the record lacks this rule's evidence", threshold,
                          "train windows")
    peak = max(peaks)
    worst = max(growth) if growth else (1.0, "-")
    figure = f"peak {peak:.0f} MB; worst RSS growth {worst[0]:.2f}x (session {worst[1]})"
    over = budget_gb > 0 and peak > budget_gb * 1024
    status = FAIL if over or worst[0] > t.max_memory_growth else PASS
    return RuleResult("memory", status, figure, threshold, f"memory of {len(peaks)} train windows")


def rule_experts(summary: Summary, t: Thresholds) -> RuleResult:
    events = [e for e in _train_events(summary) if isinstance(e.get("moe"), dict)
              and isinstance(e["moe"].get("tokens_per_expert"), list) and e["moe"]["tokens_per_expert"]]
    threshold = f"dead experts <= {t.max_dead_experts}; max/mean load <= {t.max_imbalance} per layer"
    if not events:
        config = (summary.run.get("model") or {}).get("config") or {}
        if not (isinstance(config.get("n_layers"), int) and isinstance(config.get("n_dense_layers"), int)):
            return RuleResult("experts", FAIL, "run.json lacks model.config.n_layers / n_dense_layers", threshold,
                              "run.json")
        if config["n_layers"] > config["n_dense_layers"]:
            return RuleResult("experts", FAIL, "MoE layers exist but no expert load was recorded: the record lacks "
                              "this rule's evidence", threshold, "train windows")
        return RuleResult("experts", PASS, "not applicable: the model has no MoE layer", threshold, "model config")
    k = max(1, round(len(events) * t.balance_window_fraction))
    tail = events[-k:]
    layers = len(tail[-1]["moe"]["tokens_per_expert"])
    dead, imbalances = 0, []
    for layer in range(layers):
        rows = [e["moe"]["tokens_per_expert"][layer] for e in tail if len(e["moe"]["tokens_per_expert"]) > layer]
        totals = [sum(float(r[i]) for r in rows) for i in range(len(rows[0]))]
        mean = statistics.fmean(totals)
        dead += sum(1 for c in totals if c == 0)
        imbalances.append(max(totals) / mean if mean > 0 else math.inf)
    worst = max(imbalances)
    status = FAIL if dead > t.max_dead_experts or worst > t.max_imbalance else PASS
    return RuleResult("experts", status,
                      f"{dead} dead expert(s); max/mean load per layer {', '.join(f'{x:.2f}' for x in imbalances)}",
                      threshold, f"tokens_per_expert summed over the last {k} of {len(events)} train windows")


def rule_qk_clip(summary: Summary, t: Thresholds) -> RuleResult:
    qk_enabled = _recipe_value(summary, "optim.qk_clip.enabled")
    events = _train_events(summary)
    threshold = f"updates with a QK-Clip rescale <= {t.max_qk_clip_rate:.0%} of applied updates"
    if not isinstance(qk_enabled, bool):
        return _lacks("qk_clip", "optim.qk_clip.enabled", threshold)
    max_logits = [float(x) for e in events if isinstance(e.get("qk_clip"), dict)
                  and isinstance(e["qk_clip"].get("max_logit"), list)
                  for x in e["qk_clip"]["max_logit"] if is_finite_number(x)]
    peak = f"; max logit {max(max_logits):.2f}" if max_logits else ""
    if qk_enabled is False:
        return RuleResult("qk_clip", PASS, f"QK-Clip disabled (optim.qk_clip.enabled = false){peak}", threshold,
                          "recipe")
    # updates_with_clip is cumulative over the run (restored with the checkpoint), so the last kept window's
    # value counts every update of the kept history on which any head was rescaled.
    counts = [e["qk_clip"].get("updates_with_clip") if isinstance(e.get("qk_clip"), dict) else None for e in events]
    applied = summary.final.step
    if not events or not isinstance(counts[-1], int) or applied == 0:
        return RuleResult("qk_clip", FAIL, "QK-Clip counts not recorded: the record lacks this rule's evidence",
                          threshold, "train windows")
    rate = counts[-1] / applied
    first = next((e for e in summary.kept_events if e["event"] == "qk_clip" and e.get("first_time")), None)
    first_text = (f"; first clip at step {first['step']} (layer {first.get('layer')}, head {first.get('head')}, "
                  f"max logit {first.get('max_logit'):.4g})" if first and is_finite_number(first.get("max_logit"))
                  else "")
    return RuleResult("qk_clip", PASS if rate <= t.max_qk_clip_rate else FAIL,
                      f"QK-Clip rescaled heads on {counts[-1]} of {applied} applied updates ({rate:.1%}){peak}"
                      f"{first_text}", threshold,
                      "cumulative qk_clip.updates_with_clip of the last kept train window; qk_clip events")


RULES = (rule_record_valid, rule_losses_finite, rule_loss_decreased, rule_val_tracks_train, rule_grad_spikes,
         rule_clip_rate, rule_skip_rate, rule_throughput_steady, rule_memory, rule_experts, rule_qk_clip,
         rule_resumed, rule_final_checkpoint, rule_recipe_changes)


def candidate_of(summary: Summary) -> dict[str, Any]:
    """The recipe the pilot's evidence supports: run.json's (in force at the end), with the changes on resume."""
    changes = recipe_changes_in_history(summary.run, summary.lineage)
    recipe = summary.run.get("recipe")
    final_step = summary.final.step
    return {"recipe_sha256": canonical_sha256(recipe) if isinstance(recipe, dict) else None,
            "changes": [dataclasses.asdict(c) for c in changes],
            "supported_from_update": changes[-1].from_update if changes else 1, "final_step": final_step}


def judge_summary(summary: Summary, thresholds: Thresholds | None = None) -> Verdict:
    t = thresholds or Thresholds()
    rules = [rule(summary, t) for rule in RULES]
    failed = [r.name for r in rules if r.status == FAIL]
    warned = [r.name for r in rules if r.status == WARN]
    o = summary.overall
    decision = "NO-GO" if failed else "GO"
    candidate = candidate_of(summary)
    basis = (f"Judged on the pilot's own record: {o.get('updates_applied')} applied updates, {o.get('tokens_seen')} "
             f"tokens, {o.get('sessions')} session(s) with {o.get('resumes')} resume(s).")
    sha = str(candidate["recipe_sha256"])[:16]
    supports = (f"The evidence supports the recipe in force at the end (recipe sha256 {sha}), over updates "
                f"{candidate['supported_from_update']}..{candidate['final_step']}"
                f"{' after ' + str(len(candidate['changes'])) + ' change(s) on resume' if candidate['changes'] else ''}.")
    if failed:
        statement = f"NO-GO: {', '.join(failed)} failed. {basis}"
    else:
        statement = (f"GO: no rule failed{' (warnings: ' + ', '.join(warned) + ')' if warned else ''}. {basis} "
                     f"{supports} This says the recipe ran without the problems checked here for this long; it does "
                     "not say the final model will be good.")
    return Verdict(decision=decision, rules=rules, statement=statement, thresholds=t, summary=summary,
                   candidate=candidate, frozen=frozen_candidate_status(summary.run))


def judge(run_dir: str | Path, thresholds: Thresholds | None = None) -> Verdict:
    """Judge a finished pilot: the record must also hold a session_end at its max_steps (the last session's)."""
    summary = summarize_run(run_dir)
    max_steps = summary.overall.get("max_steps")
    if isinstance(max_steps, int):
        summary = summarize_run(run_dir, require_step=max_steps)
    return judge_summary(summary, thresholds)


def format_verdict(verdict: Verdict) -> str:
    width = max(len(r.name) for r in verdict.rules)
    lines = [f"{'rule':<{width}}  status  figure  [threshold]"]
    for r in verdict.rules:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.figure}  [{r.threshold}]")
    lines += ["", f"VERDICT: {verdict.decision}"]
    lines += [f"  WARN {r.name}: {r.figure}" for r in verdict.warnings]
    lines.append(verdict.statement)
    if verdict.frozen is not None:
        lines.append(describe_frozen_status(verdict.frozen))
    return "\n".join(lines)


def verdict_json(verdict: Verdict) -> str:
    return json.dumps(verdict.to_dict(), indent=2)
