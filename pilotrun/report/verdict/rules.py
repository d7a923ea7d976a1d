"""The verdict's rules as one table: each Rule names itself, says what it checks, which thresholds it reads
(each declared with its default and meaning in thresholds.py), which plot shows its evidence, where it
applies, and the judge that measures it.

Everything about a rule is read from here: the verdict judges RULES in order, report.html links each rule row
to its plot and prints each rule's meaning with the thresholds it was held to, and `pilotrun verdict --help`
lists every rule with every threshold's default and meaning (`rules_help`). Importing the table judges
nothing, so a reader of a live run can take the rules that apply to it (`live_rules`, `window_rules`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pilotrun.report.record_check import spike_history as spikes
from pilotrun.report.verdict import continuity, downstream, evidence, resources, stability
from pilotrun.report.verdict.evidence import (
    APPLIED_UPDATE,
    CHECKPOINT,
    PAST_WARMUP,
    RESUME_TRAINED,
    SESSION_END,
    SESSION_START,
    TRAIN_WINDOW,
    Need,
    evaluations,
    steady_windows,
    train_windows,
)
from pilotrun.report.verdict.thresholds import (
    THRESHOLD_FIELDS,
    Finding,
    RuleResult,
    Thresholds,
    threshold_meaning,
)

if TYPE_CHECKING:
    from pilotrun.report.record_check.summarize import Summary


@dataclass(frozen=True)
class Rule:
    name: str  # the rule's name in the verdict, its JSON, the report and --help
    meaning: str  # what it checks, and when it WARNs (allows GO) or FAILs
    judge: Callable[[Summary, Thresholds], Finding]  # measures it on a summarized run
    thresholds: tuple[str, ...] = ()  # the Thresholds fields the judge reads
    plot: str | None = None  # the report plot (plots.PLOT_NAMES) that shows its evidence; None: no plot does
    live: bool = True  # it can be judged on a run still in progress, over the kept history so far
    per_window: bool = False  # its figure can be measured on one train window alone
    # The evidence its judge reads (evidence.Need): a run in progress is judged on the rule only once its kept
    # history holds each; until then the rule waits (watch shows it waiting) rather than failing for what the
    # run has not reached. A finished pilot's verdict judges every rule regardless.
    needs: tuple[Need, ...] = ()

    def waiting_for(self, summary: Summary) -> str | None:
        """What of its evidence a run in progress has not reached yet (None: the rule can be judged)."""
        return evidence.waiting_for(self.needs, summary)

    def apply(self, summary: Summary, t: Thresholds) -> RuleResult:
        """Judge the rule on a summary: its judge's finding under the rule's name."""
        found = self.judge(summary, t)
        return RuleResult(self.name, found.status, found.figure, found.threshold, found.evidence)


RECORD_VALID = Rule(
    "record_valid",
    "summarize finds no problem, and run.json holds everything the rules read (the recipe, the model config, "
    "the "
    "data identity, the recorded changes): a rule never falls back to a default.",
    evidence.judge_record_valid,
)

LOSSES_FINITE = Rule(
    "losses_finite", "every train and val loss of the kept history is a finite number.",
    stability.judge_losses_finite, plot="loss", per_window=True, needs=(TRAIN_WINDOW,))

LOSS_DECREASED = Rule(
    "loss_decreased",
    "mean training loss over the first and the last loss_window_fraction of windows. The drop is judged "
    "against "
    "the loss's own noise: the window-to-window spread (a robust standard deviation of successive "
    "differences) "
    "gives the standard error of the difference of the two means, and the drop must exceed loss_drop_sigmas "
    "of "
    "it. FAIL (not learning) when the drop is within the noise or below min_loss_drop_floor; WARN when it is "
    "real but below min_loss_drop.",
    stability.judge_loss_decreased,
    ("min_loss_drop", "min_loss_drop_floor", "loss_drop_sigmas", "loss_window_fraction"),
    plot="loss",
    needs=(train_windows(2),),
)

LOSS_RISE_AT_END = Rule(
    "loss_rise_at_end",
    "the median training loss over the last loss_rise_window_fraction of windows (at least 3) against the "
    "lowest "
    "median of as many consecutive windows before them: a loss that fell and then climbed back is a recipe "
    "going "
    "wrong, whatever its start-to-end drop. FAIL when the end sits above that best level by more than "
    "loss_rise_sigmas standard errors of the difference of two medians (from the window-to-window noise, a "
    "robust "
    "standard deviation of successive differences) and by more than min_loss_rise of it; fewer than twice "
    "that "
    "many windows WARNs (thin evidence). On a run in progress it reads the end so far: a loss climbing now.",
    stability.judge_loss_rise_at_end,
    ("loss_rise_window_fraction", "loss_rise_sigmas", "min_loss_rise"),
    plot="loss",
    needs=(train_windows(6),),
)

VAL_TRACKS_TRAIN = Rule(
    "val_tracks_train",
    "val minus train loss may grow at most max_val_gap_growth between the evaluations of the second half of "
    "the "
    "run, and the last val loss may be at most max_val_rise above the best one. Fewer than two evaluations "
    "WARNs "
    "(thin evidence, shown).",
    stability.judge_val_tracks_train,
    ("max_val_gap_growth", "max_val_rise"),
    plot="loss",
    needs=(evaluations(2),),
)

GRAD_SPIKES = Rule(
    "grad_spikes",
    "a window whose max gradient norm lies above median + spike_factor x scale of the previous "
    "spike_median_window windows (after spike_min_history) is a spike, the one definition the trainer and "
    "watch "
    "use too (pilotrun/training/spikes/bound.py): scale = max(a robust std of successive windows, half the "
    "median), so a "
    "spike is at least 5x the median at the default factor 8; up to max_grad_spikes spikes WARN, more FAIL.",
    stability.judge_grad_spikes,
    ("spike_factor", "spike_median_window", "spike_min_history", "max_grad_spikes"),
    plot="grad_norm",
    needs=(APPLIED_UPDATE,),
)

CLIP_RATE = Rule(
    "clip_rate",
    "the share of applied updates clipped over the second half of the pilot (warm-up clipping is expected) "
    "is at "
    "most max_clip_rate.",
    stability.judge_clip_rate,
    ("max_clip_rate",),
    plot="grad_norm",
    per_window=True,
    needs=(APPLIED_UPDATE, PAST_WARMUP),
)

SKIP_RATE = Rule(
    "skip_rate", "skipped / attempted updates over the kept history are at most max_skip_rate.",
    stability.judge_skip_rate, ("max_skip_rate",), plot="loss_scale", per_window=True, needs=(TRAIN_WINDOW,))

THROUGHPUT_STEADY = Rule(
    "throughput_steady",
    "median training-only tokens/s over the last third of windows over the first third is at least "
    "min_throughput_ratio (each session's first window is warm-up and left out, and so is every window with "
    "update attempts run under the profiler, window.profiled_attempts > 0). Below it, on a CPU run whose "
    "windows "
    "record what other processes did (window.other_cpu_seconds, the CPU seconds the rest of the machine "
    "used, and "
    "window.involuntary_switches, the times the run's threads were descheduled for other tasks), a rise of "
    "at "
    "least min_other_cpus_rise CPUs used by others or min_switch_ratio times the switches per second, last "
    "third "
    "against first, means the threads lost CPU to other processes: the rule WARNs naming the machine, never "
    "the "
    "recipe (threads that wait on a descheduled sibling spin, so the work per CPU second falls there too). "
    "Else, "
    "on a CPU run whose windows "
    "record the process's CPU seconds, the same ratio is taken of tokens per CPU second: when that one holds "
    "(the "
    "work per token did not grow) the machine got busier, not the run slower, and the rule WARNs with both "
    "figures. Failing that, when the process's CPU seconds per training second (its share of the CPU) fell "
    "below "
    "min_cpu_share_ratio of the first third's, other load took the CPU and the rule WARNs too: sharing a "
    "core "
    "makes every token cost more CPU time as well (each switch to another task evicts the trainer's caches; "
    "two "
    "competing processes cost 1.2x to 4x per token on this project's machine), so the work per CPU second "
    "cannot "
    "tell the recipe's own slowdown apart there, and the WARN says to judge it on a quiet machine. Otherwise "
    "(the "
    "share held, each token cost more) it FAILs. On CUDA the same holds with tokens per device second "
    "(window.device_seconds, from CUDA timing events around each update): the process CPU time says nothing "
    "of "
    "the device's work there.",
    resources.judge_throughput_steady,
    ("min_throughput_ratio", "min_cpu_share_ratio", "min_other_cpus_rise", "min_switch_ratio"),
    plot="throughput",
    needs=(steady_windows(6),),
)

MEMORY = Rule(
    "memory",
    "peak memory (CUDA max allocated, else peak RSS) fits memory_budget_gb (or the recipe's "
    "train.memory_budget_gb), and RSS at a session's last window over its first grows at most "
    "max_memory_growth "
    "(a leak).",
    resources.judge_memory,
    ("memory_budget_gb", "max_memory_growth"),
    needs=(TRAIN_WINDOW,),
)

EXPERTS = Rule(
    "experts",
    "over the last balance_window_fraction of windows summed, each MoE layer has at most max_dead_experts "
    "experts with no token and a max/mean load per expert of at most max_imbalance.",
    stability.judge_experts,
    ("max_imbalance", "max_dead_experts", "balance_window_fraction"),
    plot="expert_load",
    per_window=True,
    needs=(TRAIN_WINDOW,),
)

QK_CLIP = Rule(
    "qk_clip", "the share of applied updates on which QK-Clip rescaled any head is at most max_qk_clip_rate.",
    stability.judge_qk_clip, ("max_qk_clip_rate",), plot="qk_max_logit", needs=(APPLIED_UPDATE,))

SPIKES = Rule(
    "spikes",
    "the spikes the trainer detected (train.spike) and what answered them: each is named with the cause its "
    "replay "
    "found (batch, model_state, not_reproducible) and WARNs, so a pilot that had one never gets a silent GO; "
    "more "
    "than max_spikes spikes, max_spike_rollbacks rollbacks or max_unreproduced_spikes spikes the replay "
    "could not "
    "reproduce FAIL.",
    spikes.judge_spikes,
    ("max_spikes", "max_spike_rollbacks", "max_unreproduced_spikes"),
    plot="loss",
)

DATA_PASSES = Rule(
    "data_passes",
    "how many times the pilot read its training split: the kept tokens over the tokens one pass reads (the "
    "loader's whole global batches of the split, run.json data.train.tokens and the recipe's seq_len), "
    "beside the "
    "loader's own restarts (data_restarts). Any re-read WARNs: part of the loss is then measured on tokens "
    "already trained on; with data_mode successive more than max_train_passes passes FAIL. data_mode "
    "repeat_batch re-reads one batch by design and WARNs. A data mixture is judged per source (each restarts "
    "alone: its kept tokens over its own split's windows) and the source read most often is named. On a run "
    "in "
    "progress it counts the passes so far.",
    evidence.judge_data_passes,
    ("max_train_passes",),
    needs=(SESSION_START,),
)

RESUMED = Rule(
    "resumed",
    "the kept history includes a resume followed by at least one applied update (a finished run resumed with "
    "nothing left to do proves nothing), counters continuous, replayed windows bit-identical; a resume that "
    "changed the thread count, a numerics library or the device (run.json's not_exact) is not promised a "
    "bit-identical replay, so its replay is the fact: windows replayed bit-identical show the continuation "
    "(WARN naming the change); windows that differ name the change as their likely cause and prove nothing; "
    "waived by resume_required = false (--no-resume-required), then a missing resume WARNs.",
    continuity.judge_resumed, ("resume_required",), plot="loss", live=False, needs=(RESUME_TRAINED,))

FINAL_CHECKPOINT = Rule(
    "final_checkpoint",
    "the checkpoint at the final step is committed, its marker names this run (run.json's run_id), and every "
    "file matches the sha256 in its marker; missing, damaged or another run's, the run cannot be continued "
    "from "
    "where it ended: FAIL.",
    continuity.judge_final_checkpoint,
    live=False,
    needs=(SESSION_END, CHECKPOINT),
)

RECIPE_CHANGES = Rule(
    "recipe_changes",
    "every change accepted on resume (--allow-change) is named with the update it took effect from; the "
    "evidence "
    "supports the recipe in force at the end, over the updates since the last change. A change WARNs; it "
    "FAILs "
    "when the windows after it show the optimizer ran another peak LR than the recorded recipe (lr / "
    "lr_multiplier of the first optimizer group): the change was recorded, not applied.",
    continuity.judge_recipe_changes,
)

DOWNSTREAM = Rule(
    "downstream",
    "the in-loop multiple-choice tasks (train.downstream.tasks): each task's last accuracy beside chance, "
    "what it "
    "is above chance and a guesser's noise on that many examples (sqrt(c(1-c)/n)). Shown, never failed: at "
    "pilot "
    "scale accuracy sits near chance and moves by whole examples, so a task within that noise of chance "
    "WARNs "
    "(expected of a small pilot) and one clear of it PASSes; no task scored PASSes.",
    downstream.judge_downstream,
    plot="downstream_accuracy",
)

# The verdict's rules in the order they are judged and printed.
RULES: tuple[Rule, ...] = (
    RECORD_VALID,
    LOSSES_FINITE,
    LOSS_DECREASED,
    LOSS_RISE_AT_END,
    VAL_TRACKS_TRAIN,
    GRAD_SPIKES,
    SPIKES,
    CLIP_RATE,
    SKIP_RATE,
    THROUGHPUT_STEADY,
    MEMORY,
    EXPERTS,
    QK_CLIP,
    DATA_PASSES,
    DOWNSTREAM,
    RESUMED,
    FINAL_CHECKPOINT,
    RECIPE_CHANGES,
)
RULES_BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}
# Which plot shows each rule's evidence (report.html links the rule's row to it).
RULE_PLOTS: dict[str, str] = {rule.name: rule.plot for rule in RULES if rule.plot is not None}


def table_problems() -> list[str]:
    """What keeps the table from being one account of the rules: a threshold no rule reads, or read by two, a
    rule naming a threshold that does not exist, a name used twice, a threshold without a meaning."""
    problems = []
    owners: dict[str, list[str]] = {}
    for rule in RULES:
        for name in rule.thresholds:
            owners.setdefault(name, []).append(rule.name)
    fields = {f.name for f in THRESHOLD_FIELDS}
    problems += [
        f"rule {', '.join(owners[n])} reads {n}, which Thresholds lacks" for n in owners if n not in fields
    ]
    problems += [f"threshold {n} belongs to no rule" for n in sorted(fields - set(owners))]
    problems += [
        f"threshold {n} is read by several rules: {', '.join(r)}" for n, r in owners.items() if len(r) > 1
    ]
    problems += [
        f"threshold {f.name} has no meaning" for f in THRESHOLD_FIELDS if not f.metadata.get("meaning")
    ]
    if len({rule.name for rule in RULES}) != len(RULES):
        problems.append("two rules share a name")
    return problems


def live_rules() -> tuple[Rule, ...]:
    """The rules that apply to a run still in progress, judged over its kept history so far."""
    return tuple(rule for rule in RULES if rule.live)


def window_rules() -> tuple[Rule, ...]:
    """The rules whose figure one train window carries (a live reader can check each window as it lands)."""
    return tuple(rule for rule in RULES if rule.per_window)


def rules_help(width: int = 100) -> str:
    """Every rule with its meaning, and under it each threshold it reads with default and meaning (`verdict
    --help`)."""
    lines = textwrap.wrap(
        "Rules, each PASS, WARN or FAIL (GO when none FAILs; a WARN is shown and allows GO; a "
        "rule that finds the evidence it needs missing from the record FAILs), with the thresholds "
        "each reads (--threshold NAME=VALUE):",
        width,
        break_on_hyphens=False,
    )
    defaults = {f.name: f.default for f in THRESHOLD_FIELDS}
    for rule in RULES:
        lines += textwrap.wrap(
            f"{rule.name}: {rule.meaning}",
            width,
            initial_indent="- ",
            subsequent_indent="  ",
            break_on_hyphens=False,
        )
        for name in rule.thresholds:
            lines += textwrap.wrap(f"{name}={defaults[name]}: {threshold_meaning(name)}", width,
                                   initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)
