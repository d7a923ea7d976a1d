"""What the verdict's judges read from a summary, and the judges of what the evidence is worth: that it holds
(record_valid), and how many times the pilot read its training data (data_passes).

Every rule reads the kept history (summarize's reconciliation), never the rolled-back work, and the recipe
run.json recorded, never a default: a rule whose evidence the record lacks FAILs rather than guessing.

A pass over the training split is what the loader reads before it restarts (data/reader.py): whole global
batches of `seq_len`-token windows, so the split's tail that fills no batch is never read and one pass holds
fewer tokens than the split. Passes are the kept tokens over that pass size; summarize's
`passes_over_train_split` (tokens over the whole split) understates them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pilotrun.data.windows import batches_per_pass
from pilotrun.report.record_check.mixture_account import source_passes, sources_of
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Finding, Thresholds

if TYPE_CHECKING:
    from pilotrun.report.record_check.summarize import Summary


def train_events(summary: Summary) -> list[dict[str, Any]]:
    """The kept history's train windows, in order."""
    return [e for e in summary.kept_events if e["event"] == "train"]


def window_of(event: dict[str, Any]) -> dict[str, Any]:
    """A train event's window counters ({} where the event has none)."""
    window = event.get("window")
    return window if isinstance(window, dict) else {}


def recipe_value(summary: Summary, dotted: str) -> Any:
    """A value of run.json's recipe, or None where the record lacks it (never a default)."""
    node: Any = summary.run.get("recipe")
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def lacks(dotted: str, threshold: str) -> Finding:
    """The FAIL of a rule whose recipe value the record lacks."""
    return Finding(FAIL, f"run.json's recipe lacks {dotted}: this rule cannot be judged", threshold,
                   "run.json recipe")


@dataclass(frozen=True)
class Need:
    """One piece of evidence a rule's judge reads (each rule states its own: rules.py). A run in progress is
    judged on a rule only once its kept history holds each of the rule's needs: before that the rule is
    waiting (the run has not reached it), not failing. A finished pilot is judged on every rule: what it lacks
    then, it lacks."""
    what: str  # in words, as watch shows a waiting rule
    held: Callable[[Summary], bool]


def _count(kinds: tuple[str, ...], n: int, what: str) -> Need:
    return Need(what, lambda s: sum(1 for e in s.kept_events if e["event"] in kinds) >= n)


def train_windows(n: int) -> Need:
    return _count(("train",), n, "a train window" if n == 1 else f"{n} train windows")


def evaluations(n: int) -> Need:
    return _count(("val",), n, "an evaluation" if n == 1 else f"{n} evaluations")


def steady_windows(n: int) -> Need:
    """`n` train windows that are not their session's first (the warm-up window a rate leaves out)."""
    def held(s: Summary) -> bool:
        windows = [e["session_id"] for e in train_events(s)]
        return len(windows) - len(set(windows)) >= n
    return Need(f"{n} steady train windows (each session's first left out)", held)


def _applied(s: Summary) -> bool:
    return any(window_of(e).get("updates_applied", 1) for e in train_events(s)) and s.final.step > 0


def _past_warmup(s: Summary) -> bool:
    """The kept windows' second half (what clip_rate reads) starts after the warm-up, where clipping is
    expected."""
    warmup = recipe_value(s, "optim.schedule.warmup_steps")
    windows = train_events(s)
    return not isinstance(warmup, int) or bool(windows) and windows[-1]["step"] >= 2 * warmup


def _resumed_and_trained(s: Summary) -> bool:
    resumed = {e["session_id"] for e in s.kept_events if e["event"] == "session_start"
               and e.get("resumed_from") is not None}
    return any(e["session_id"] in resumed for e in train_events(s))


SESSION_START = _count(("session_start",), 1, "a session start")
SESSION_END = _count(("session_end",), 1, "a session end")
CHECKPOINT = _count(("checkpoint",), 1, "a checkpoint")
TRAIN_WINDOW = train_windows(1)
APPLIED_UPDATE = Need("a train window with an applied update", _applied)
PAST_WARMUP = Need("a train window at twice optim.schedule.warmup_steps (a second half past the warm-up)",
                   _past_warmup)
RESUME_TRAINED = Need("a resume followed by a train window", _resumed_and_trained)


def complete(s: Summary) -> bool:
    """The kept history ended its run: a session completed at max_steps (nothing more is coming)."""
    max_steps = s.overall.get("max_steps")
    last_end = next((e for e in reversed(s.kept_events) if e["event"] == "session_end"), None)
    return (isinstance(max_steps, int) and s.final.step >= max_steps and last_end is not None
            and last_end.get("reason") == "completed")


def waiting_for(needs: tuple[Need, ...], s: Summary) -> str | None:
    """What a run in progress has not reached yet of `needs` (None: everything, or the run is complete)."""
    if complete(s):
        return None
    return next((need.what for need in needs if not need.held(s)), None)


def judge_record_valid(summary: Summary, t: Thresholds) -> Finding:
    figure = "valid" if summary.valid else f"{len(summary.reasons)} problem(s); first: {summary.reasons[0]}"
    return Finding(PASS if summary.valid else FAIL, figure, "summarize finds no problem",
                   "run.json + metrics.jsonl, every session")


def _latest(summary: Summary, key: str, kinds: tuple[str, ...]) -> Any:
    """`key` of the last kept event of one of `kinds` that carries it as an int (None where none does)."""
    for e in reversed(summary.kept_events):
        if e["event"] in kinds and isinstance(e.get(key), int):
            return e[key]
    return None


def pass_tokens(summary: Summary) -> tuple[int, str] | None:
    """The tokens one pass over the training split reads, with how they follow from the record; None where
    run.json or the session start lacks a figure it needs."""
    split_tokens = ((summary.run.get("data") or {}).get("train") or {}).get("tokens")
    seq_len = recipe_value(summary, "train.seq_len")
    per_batch = _latest(summary, "tokens_per_microbatch", ("session_start",))  # batch_size * seq_len * world
    if (
        not all(isinstance(x, int) and x > 0 for x in (split_tokens, seq_len, per_batch))
        or per_batch % seq_len
    ):
        return None
    batches = batches_per_pass(split_tokens, seq_len, per_batch // seq_len)
    if batches == 0:
        return None
    return batches * per_batch, (f"one pass = {batches} global batches of {per_batch} tokens of the split's "
                                 f"{split_tokens} (run.json data.train.tokens, recipe seq_len {seq_len})")


def judge_data_passes(summary: Summary, t: Thresholds) -> Finding:
    threshold = (f"the training split read at most once (a re-read WARNs); data_mode successive: <= "
                 f"{t.max_train_passes:g} passes")
    mode = recipe_value(summary, "train.data_mode")
    tokens = summary.final.tokens_seen
    if mode == "repeat_batch":
        # The loader serves its first batch forever: every update after the first re-reads it, by design.
        microbatches = _latest(summary, "tokens_per_microbatch", ("session_start",))
        reads = (
            f"{tokens // microbatches} times"
            if isinstance(microbatches, int) and microbatches > 0
            else "again"
        )
        return Finding(
            WARN,
            f"data_mode repeat_batch: one batch read {reads}; an overfitting check, its loss "
            "says nothing of fresh data",
            threshold,
            "run.json recipe; kept tokens_seen",
        )
    if sources_of(summary.run):
        return _mixture_passes(summary, t, threshold, mode)
    sized = pass_tokens(summary)
    if sized is None:
        return Finding(
            FAIL,
            "run.json or the session start lacks the split's tokens, seq_len or "
            "tokens_per_microbatch: the passes cannot be counted",
            threshold,
            "run.json; session_start",
        )
    size, how = sized
    passes = tokens / size
    # The loader's own count: restarts of the cursor, cumulative and restored with each checkpoint.
    restarts = _latest(summary, "data_restarts", ("train", "data_restart")) or 0
    evidence = f"kept tokens_seen {tokens} / {size} tokens a pass; {how}; data_restarts of the kept history"
    # a cursor moved past batches it never trained on still re-read them
    passes = max(passes, float(restarts))
    figure = f"{passes:.1f} passes over the training split ({restarts} restart{'s' if restarts != 1 else ''})"
    if restarts == 0 and passes <= 1:
        return Finding(
            PASS,
            f"{passes:.2g} of one pass over the training split (0 restarts): no token read twice",
            threshold,
            evidence,
        )
    return _repeated_passes(figure, passes, mode, t, threshold, evidence)


def _mixture_passes(summary: Summary, t: Thresholds, threshold: str, mode: Any) -> Finding:
    """data_passes of a mixture: each source restarts alone, so each is judged on its own passes and the
    source read most often is named (a small source repeated many times is what a mixture hides)."""
    seq_len = recipe_value(summary, "train.seq_len")
    found = source_passes(summary.run, summary.kept_events, seq_len if isinstance(seq_len, int) else 0)
    if not found:
        return Finding(
            FAIL,
            "run.json or the train windows lack the sources' split tokens or tokens_seen_by_source: "
            "the passes cannot be counted",
            threshold,
            "run.json data.sources; train events",
        )
    worst = found[0]
    passes = max(worst["passes"], float(worst["restarts"]))
    listed = ", ".join(f"{r['name']} {max(r['passes'], float(r['restarts'])):.2g} ({r['restarts']} restarts)"
                       for r in found)
    evidence = (f"per source: kept tokens_seen_by_source over the source's windows x seq_len ({listed}); "
                "run.json data.sources")
    figure = (
        f"source {worst['name']}: {passes:.1f} passes over its training split ({worst['restarts']} restarts)"
    )
    if worst["restarts"] == 0 and passes <= 1:
        return Finding(
            PASS,
            f"every source read at most once; most read: {worst['name']} {passes:.2g} of a pass",
            threshold,
            evidence,
        )
    return _repeated_passes(figure, passes, mode, t, threshold, evidence)


def _repeated_passes(
    figure: str, passes: float, mode: Any, t: Thresholds, threshold: str, evidence: str
) -> Finding:
    """data_passes once some tokens were read twice (a folder's or a mixture's most-read source): judged only
    under successive reading; past max_train_passes the loss measures memorised text."""
    if mode != "successive":
        return lacks("train.data_mode", threshold)
    if passes > t.max_train_passes:
        return Finding(
            FAIL,
            f"{figure}: past {t.max_train_passes:g} the loss measures memorised text, not the long run's",
            threshold,
            evidence,
        )
    return Finding(
        WARN, f"{figure}: part of the loss is measured on tokens already trained on", threshold, evidence
    )
