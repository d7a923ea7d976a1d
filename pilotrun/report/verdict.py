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
- min_loss_drop 0.05: mean training loss over the last `loss_window_fraction` (0.2) of windows must be at
  least 5% below the mean over the first 0.2 (FAIL when it did not fall at all, WARN when it fell less).
- max_val_gap_growth 0.5 nats: val minus train loss may grow at most this much between the evaluations of
  the second half of the run; max_val_rise 0.05: the last val loss may be at most 5% above the best one.
- spike_factor 5.0: a window whose max gradient norm exceeds 5x the median of the previous
  `spike_median_window` (20) windows (after `spike_min_history` (5)) is a spike; one spike WARNs, more than
  max_grad_spikes (1) FAIL.
- max_clip_rate 0.5: share of applied updates clipped over the second half of the pilot (warm-up clipping
  is expected); max_skip_rate 0.05: skipped / attempted updates over the kept history.
- min_throughput_ratio 0.6: median training-only tokens/s over the last third of windows over the first
  third (each session's first window is warm-up and left out).
- memory_budget_gb 0 (= the recipe's train.memory_budget_gb; 0 there too = no budget): peak memory (CUDA
  max allocated, else peak RSS) must fit; max_memory_growth 1.5: RSS at a session's last window over its
  first may grow at most 1.5x (a leak).
- max_imbalance 1.5 (max/mean tokens per expert, per layer) and max_dead_experts 0 (experts with no token),
  both over the last `balance_window_fraction` (0.25) of windows summed.
- max_qk_clip_rate 0.5: share of applied updates on which QK-Clip rescaled any head.
- the kept history includes at least one resume (waived by --no-resume-required, then WARN).

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

from pilotrun.errors import PilotrunError
from pilotrun.record import is_finite_number
from pilotrun.report.summarize import Summary, summarize_run

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


class ThresholdError(PilotrunError):
    """An unknown threshold name or a value of the wrong type (`--threshold NAME=VALUE`)."""


@dataclass
class Thresholds:
    min_loss_drop: float = 0.05
    loss_window_fraction: float = 0.2
    max_val_gap_growth: float = 0.5
    max_val_rise: float = 0.05
    spike_factor: float = 5.0
    spike_median_window: int = 20
    spike_min_history: int = 5
    max_grad_spikes: int = 1
    max_clip_rate: float = 0.5
    max_skip_rate: float = 0.05
    min_throughput_ratio: float = 0.6
    memory_budget_gb: float = 0.0
    max_memory_growth: float = 1.5
    max_imbalance: float = 1.5
    max_dead_experts: int = 0
    balance_window_fraction: float = 0.25
    max_qk_clip_rate: float = 0.5
    resume_required: bool = True


def parse_thresholds(overrides: list[str], base: Thresholds | None = None) -> Thresholds:
    """Apply `NAME=VALUE` overrides; an unknown name or a bad value is one clear error."""
    thresholds = dataclasses.replace(base or Thresholds())
    types = {f.name: f.type for f in dataclasses.fields(Thresholds)}
    for text in overrides:
        if "=" not in text:
            raise ThresholdError(f"--threshold expects NAME=VALUE, got '{text}'")
        name, raw = (part.strip() for part in text.split("=", 1))
        if name not in types:
            raise ThresholdError(f"--threshold: unknown name '{name}' (known: {', '.join(types)})")
        kind = types[name]
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                value: Any = raw.lower() in ("true", "1")
            elif kind == "int":
                value = int(raw)
            else:
                value = float(raw)
        except ValueError:
            raise ThresholdError(f"--threshold {name}: '{raw}' is not a valid {kind}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ThresholdError(f"--threshold {name}: '{raw}' is not a finite number")
        setattr(thresholds, name, value)
    return thresholds


@dataclass
class RuleResult:
    name: str
    status: str
    figure: str  # what was measured, with numbers
    threshold: str  # the bound it was held to
    evidence: str  # which records the figure comes from


@dataclass
class Verdict:
    decision: str  # "GO" or "NO-GO"
    rules: list[RuleResult]
    statement: str
    thresholds: Thresholds
    summary: Summary = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "statement": self.statement,
                "rules": [dataclasses.asdict(r) for r in self.rules],
                "thresholds": dataclasses.asdict(self.thresholds), "summary": self.summary.to_dict()}


def _train_events(summary: Summary) -> list[dict[str, Any]]:
    return [e for e in summary.kept_events if e["event"] == "train"]


def _window(event: dict[str, Any]) -> dict[str, Any]:
    window = event.get("window")
    return window if isinstance(window, dict) else {}


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


def rule_loss_decreased(summary: Summary, t: Thresholds) -> RuleResult:
    losses = [float(e["loss"]) for e in _train_events(summary) if is_finite_number(e.get("loss"))]
    threshold = f"drop >= {t.min_loss_drop:.1%} (first vs last {t.loss_window_fraction:.0%} of windows)"
    if len(losses) < 2:
        return RuleResult("loss_decreased", FAIL, f"only {len(losses)} finite train window(s)", threshold,
                          "train windows")
    k = max(1, round(len(losses) * t.loss_window_fraction))
    first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
    drop = (first - last) / abs(first) if first != 0 else 0.0
    status = PASS if drop >= t.min_loss_drop else (WARN if drop > 0 else FAIL)
    return RuleResult("loss_decreased", status, f"mean train loss {first:.4f} -> {last:.4f} ({drop:+.1%} drop)",
                      threshold, f"{k} first and {k} last of {len(losses)} train windows")


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
        return RuleResult("grad_spikes", WARN, "no gradient norm recorded", threshold, evidence)
    if not spikes:
        return RuleResult("grad_spikes", PASS, f"no spike; max grad norm {max(history):.4g}", threshold, evidence)
    listed = ", ".join(f"step {s}: {v:.4g} ({v / m:.1f}x median)" for s, v, m in spikes[:5])
    status = WARN if len(spikes) <= t.max_grad_spikes else FAIL
    return RuleResult("grad_spikes", status, f"{len(spikes)} spike(s): {listed}", threshold, evidence)


def rule_clip_rate(summary: Summary, t: Thresholds) -> RuleResult:
    grad_clip = ((summary.run.get("recipe") or {}).get("optim") or {}).get("grad_clip")
    events = _train_events(summary)
    threshold = f"clipped / applied <= {t.max_clip_rate:.0%} over the second half"
    if grad_clip == 0:
        return RuleResult("clip_rate", PASS, "clipping disabled (optim.grad_clip = 0)", threshold, "recipe")
    final_step = events[-1]["step"] if events else 0
    second_half = [e for e in events if e["step"] > final_step / 2]
    clipped = [_window(e).get("clipped") for e in second_half]
    applied = sum(int(_window(e).get("updates_applied", 0)) for e in second_half)
    if not second_half or any(not isinstance(c, int) for c in clipped) or applied == 0:
        return RuleResult("clip_rate", WARN, "clipping counts not recorded", threshold, "train windows")
    rate = sum(clipped) / applied
    return RuleResult("clip_rate", PASS if rate <= t.max_clip_rate else FAIL,
                      f"{sum(clipped)} of {applied} applied updates clipped ({rate:.1%})", threshold,
                      f"{len(second_half)} train windows after step {final_step // 2}")


def rule_skip_rate(summary: Summary, t: Thresholds) -> RuleResult:
    o = summary.overall
    attempted, skipped = o.get("updates_attempted") or 0, o.get("updates_skipped") or 0
    threshold = f"skipped / attempted <= {t.max_skip_rate:.1%}"
    if attempted == 0:
        return RuleResult("skip_rate", FAIL, "no update attempted", threshold, "counters")
    rate = skipped / attempted
    return RuleResult("skip_rate", PASS if rate <= t.max_skip_rate else FAIL,
                      f"{skipped} of {attempted} updates skipped ({rate:.1%})", threshold,
                      "cumulative counters of the kept history")


def rule_throughput_steady(summary: Summary, t: Thresholds) -> RuleResult:
    rates = []
    seen_sessions = set()
    for e in _train_events(summary):
        w = _window(e)
        first_of_session = e["session_id"] not in seen_sessions
        seen_sessions.add(e["session_id"])
        if first_of_session:
            continue  # warm-up: allocator, caches, first-touch of the data
        if is_finite_number(w.get("tokens")) and is_finite_number(w.get("train_seconds")) and w["train_seconds"] > 0:
            rates.append(w["tokens"] / w["train_seconds"])
    threshold = f"last-third / first-third median >= {t.min_throughput_ratio}"
    evidence = f"training-only tokens/s of {len(rates)} train windows (each session's first left out)"
    if len(rates) < 6:
        return RuleResult("throughput_steady", WARN, f"only {len(rates)} windows to compare", threshold, evidence)
    third = len(rates) // 3
    first, last = statistics.median(rates[:third]), statistics.median(rates[-third:])
    ratio = last / first
    return RuleResult("throughput_steady", PASS if ratio >= t.min_throughput_ratio else FAIL,
                      f"median {first:.1f} -> {last:.1f} tok/s (ratio {ratio:.2f})", threshold, evidence)


def rule_memory(summary: Summary, t: Thresholds) -> RuleResult:
    budget_gb = t.memory_budget_gb or float(((summary.run.get("recipe") or {}).get("train") or {})
                                            .get("memory_budget_gb") or 0.0)
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
        return RuleResult("memory", WARN, "memory not recorded", threshold, "train windows")
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
        has_moe = int(config.get("n_layers", 0) or 0) > int(config.get("n_dense_layers", 0) or 0)
        if has_moe:
            return RuleResult("experts", WARN, "MoE layers exist but no expert load was recorded", threshold,
                              "train windows")
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
    qk_cfg = ((summary.run.get("recipe") or {}).get("optim") or {}).get("qk_clip") or {}
    events = _train_events(summary)
    threshold = f"updates with a QK-Clip rescale <= {t.max_qk_clip_rate:.0%} of applied updates"
    max_logits = [float(x) for e in events if isinstance(e.get("qk_clip"), dict)
                  and isinstance(e["qk_clip"].get("max_logit"), list)
                  for x in e["qk_clip"]["max_logit"] if is_finite_number(x)]
    peak = f"; max logit {max(max_logits):.2f}" if max_logits else ""
    if qk_cfg.get("enabled") is False:
        return RuleResult("qk_clip", PASS, f"QK-Clip disabled (optim.qk_clip.enabled = false){peak}", threshold,
                          "recipe")
    # updates_with_clip is cumulative over the run (restored with the checkpoint), so the last kept window's
    # value counts every update of the kept history on which any head was rescaled.
    counts = [e["qk_clip"].get("updates_with_clip") if isinstance(e.get("qk_clip"), dict) else None for e in events]
    applied = int(summary.overall.get("updates_applied") or 0)
    if not events or not isinstance(counts[-1], int) or applied == 0:
        return RuleResult("qk_clip", WARN, "QK-Clip counts not recorded", threshold, "train windows")
    rate = counts[-1] / applied
    first = next((e for e in summary.kept_events if e["event"] == "qk_clip" and e.get("first_time")), None)
    first_text = (f"; first clip at step {first['step']} (layer {first.get('layer')}, head {first.get('head')}, "
                  f"max logit {first.get('max_logit'):.4g})" if first and is_finite_number(first.get("max_logit"))
                  else "")
    return RuleResult("qk_clip", PASS if rate <= t.max_qk_clip_rate else FAIL,
                      f"QK-Clip rescaled heads on {counts[-1]} of {applied} applied updates ({rate:.1%}){peak}"
                      f"{first_text}", threshold,
                      "cumulative qk_clip.updates_with_clip of the last kept train window; qk_clip events")


def _window_key(e: dict[str, Any]) -> tuple:
    w = _window(e)
    return (e["event"], e["step"], e["tokens_seen"], e["updates_attempted"], w.get("updates_applied"),
            w.get("updates_attempted"))


def rule_resumed(summary: Summary, t: Thresholds) -> RuleResult:
    """At least one resume in the kept history, counters continuous, replayed windows bit-identical."""
    sessions = {s.session_id: s for s in summary.sessions}
    resumes = [sid for sid in summary.lineage if sessions[sid].resumed_from is not None]
    threshold = ">= 1 resume with continuous counters; replayed windows bit-identical"
    kept = {_window_key(e): e for e in summary.kept_events if e["event"] in ("train", "val")}
    compared, mismatched = 0, []
    for e in summary.rolled_back_events:
        twin = kept.get(_window_key(e)) if e["event"] in ("train", "val") else None
        if twin is None:
            continue
        compared += 1
        for key in ("loss", "grad_norm"):
            if key in e and e.get(key) != twin.get(key):
                mismatched.append(f"{e['event']} step {e['step']} {key} {e.get(key)!r} before the kill vs "
                                  f"{twin.get(key)!r} after the resume")
    replay = (f"{compared} replayed window(s) compared, {len(mismatched)} differ" if compared
              else "no replayed window to compare")
    evidence = "session starts vs committed checkpoints; rolled-back vs replayed windows"
    points = ", ".join(f"session {sid} from step {sessions[sid].resumed_from}" for sid in resumes)
    if mismatched:
        return RuleResult("resumed", FAIL, f"{replay}; first: {mismatched[0]}", threshold, evidence)
    if resumes and not summary.valid:
        return RuleResult("resumed", FAIL, f"{len(resumes)} resume(s) but the record is invalid (see record_valid)",
                          threshold, evidence)
    if resumes:
        return RuleResult("resumed", PASS, f"{len(resumes)} resume(s): {points}; counters continuous; {replay}",
                          threshold, evidence)
    if not t.resume_required:
        return RuleResult("resumed", WARN, "no resume in the kept history; waived (--no-resume-required)",
                          threshold, evidence)
    return RuleResult("resumed", FAIL, "no resume in the kept history: the pilot never proved it can continue",
                      threshold, evidence)


RULES = (rule_record_valid, rule_losses_finite, rule_loss_decreased, rule_val_tracks_train, rule_grad_spikes,
         rule_clip_rate, rule_skip_rate, rule_throughput_steady, rule_memory, rule_experts, rule_qk_clip,
         rule_resumed)


def judge_summary(summary: Summary, thresholds: Thresholds | None = None) -> Verdict:
    t = thresholds or Thresholds()
    rules = [rule(summary, t) for rule in RULES]
    failed = [r.name for r in rules if r.status == FAIL]
    warned = [r.name for r in rules if r.status == WARN]
    o = summary.overall
    decision = "NO-GO" if failed else "GO"
    basis = (f"Judged on the pilot's own record: {o.get('updates_applied')} applied updates, {o.get('tokens_seen')} "
             f"tokens, {o.get('sessions')} session(s) with {o.get('resumes')} resume(s).")
    if failed:
        statement = f"NO-GO: {', '.join(failed)} failed. {basis}"
    else:
        statement = (f"GO: no rule failed{' (warnings: ' + ', '.join(warned) + ')' if warned else ''}. {basis} "
                     "This says the recipe ran without the problems checked here for this long; it does not say "
                     "the final model will be good.")
    return Verdict(decision=decision, rules=rules, statement=statement, thresholds=t, summary=summary)


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
    lines += ["", f"VERDICT: {verdict.decision}", verdict.statement]
    return "\n".join(lines)


def verdict_json(verdict: Verdict) -> str:
    return json.dumps(verdict.to_dict(), indent=2)
