"""A data mixture's account in the report: per-source tokens reconciled with the run's counters, the realised
mixture against the weights, the validation loss and the passes of each source.

A mixed run's `train` events carry `tokens_by_source` (the window's tokens per source),
`tokens_seen_by_source` (cumulative) and `restarts_by_source`; its `val` events `loss_by_source`; run.json's
data section `sources` (name, weight, metadata_sha256, split tokens) and `mixture` (weights, seed). Summarize
holds them to the counters: in every train event the sources add up to tokens_seen and the window's to its
tokens, exactly, and each source's cumulative figure follows from the previous event of its session plus the
window (after a spike's rollback: from the train event at the counters it restored). A run on one folder has
none of these fields and nothing here applies to it.

Passes per source: a source's pass is its train split's windows (data/mixed_reader.py: it restarts alone), so
its passes are its kept tokens over (windows * seq_len); the data_passes rule names the source read most
often.
"""

from __future__ import annotations

from typing import Any

from pilotrun.common.parsing import one_line
from pilotrun.data.windows import batches_per_pass
from pilotrun.run.record import COUNTER_KEYS

TRAIN_FIELDS = ("tokens_by_source", "tokens_seen_by_source")


def sources_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """run.json's mixture sources ([] for a run on one folder)."""
    sources = (run.get("data") or {}).get("sources")
    return [s for s in sources if isinstance(s, dict)] if isinstance(sources, list) else []


def _ints(values: Any) -> dict[str, int] | None:
    if not isinstance(values, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values.values()
    ):
        return None
    return values


def mixture_problems(run: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    """Every train event of a mixed run whose per-source tokens do not reconcile, one reason each."""
    names = [s.get("name") for s in sources_of(run)]
    if not names:
        return []
    problems: list[str] = []
    previous: dict[str, dict[str, int]] = {}
    at: dict[tuple[Any, ...], dict[str, int]] = {}  # the sources' tokens_seen at each train event's counters
    for event in events:
        # the session goes on from the restored checkpoint's (a train event's)
        if event.get("event") == "rollback":
            restored = at.get(tuple(event.get(k) for k in COUNTER_KEYS))
            if restored is None:
                previous.pop(str(event.get("session_id")), None)
            else:
                previous[str(event.get("session_id"))] = restored
        if event.get("event") != "train":
            continue
        where = f"metrics.jsonl line {event.get('_line')} (train, step {event.get('step')})"
        window, seen = _ints(event.get("tokens_by_source")), _ints(event.get("tokens_seen_by_source"))
        if window is None or seen is None or sorted(window) != sorted(names) or sorted(seen) != sorted(names):
            problems.append(f"{where}: tokens_by_source / tokens_seen_by_source missing or not the sources "
                            f"{names} of run.json")
            continue
        if sum(seen.values()) != event.get("tokens_seen"):
            problems.append(
                f"{where}: the sources' tokens_seen add up to {sum(seen.values())}, not tokens_seen "
                f"{event.get('tokens_seen')}"
            )
        tokens = (event.get("window") or {}).get("tokens") if isinstance(event.get("window"), dict) else None
        if sum(window.values()) != tokens:
            problems.append(
                f"{where}: the window's tokens by source add up to {sum(window.values())}, not its "
                f"tokens {tokens}"
            )
        before = previous.get(str(event.get("session_id")))
        if before is not None and any(before[n] + window[n] != seen[n] for n in names):
            problems.append(
                f"{where}: a source's tokens_seen does not follow from the previous window plus this one"
            )
        previous[str(event.get("session_id"))] = seen
        at[tuple(event.get(k) for k in COUNTER_KEYS)] = seen
    return problems


def mixture_overview(run: dict[str, Any], kept_events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per source: weight, share of the weights, kept tokens and their share, the tokens the weights ask for,
    the last validation loss. None for a run on one folder."""
    sources = sources_of(run)
    if not sources:
        return None
    last_train = next((e for e in reversed(kept_events) if e.get("event") == "train"), None)
    last_val = next((e for e in reversed(kept_events) if e.get("event") == "val"
                     and isinstance(e.get("loss_by_source"), dict)), None)
    seen = _ints((last_train or {}).get("tokens_seen_by_source")) or {}
    total_tokens = int((last_train or {}).get("tokens_seen") or 0)
    weights = [float(s.get("weight") or 0.0) for s in sources]
    total_weight = sum(weights) or 1.0
    rows = []
    for source, weight in zip(sources, weights, strict=True):
        name = source.get("name")
        tokens = seen.get(name, 0)
        rows.append(
            {
                "name": name,
                "weight": weight,
                "share_asked": weight / total_weight,
                "tokens_seen": tokens,
                "share_seen": tokens / total_tokens if total_tokens else None,
                "tokens_asked": total_tokens * weight / total_weight,
                "restarts": ((last_train or {}).get("restarts_by_source") or {}).get(name),
                "val_loss": (last_val or {}).get("loss_by_source", {}).get(name),
                "metadata_sha256": source.get("metadata_sha256"),
            }
        )
    mixture = (run.get("data") or {}).get("mixture") or {}
    return {"tokens_seen": total_tokens, "seed": mixture.get("seed"), "sources": rows}


def format_mixture(overview: dict[str, Any] | None) -> str | None:
    if overview is None:
        return None
    lines = [f"data mixture (seed {overview['seed']}): realised against the weights, kept tokens "
             f"{overview['tokens_seen']}"]
    for row in overview["sources"]:
        share = "n/a" if row["share_seen"] is None else f"{row['share_seen']:.4f}"
        val = "" if row["val_loss"] is None else f"; val loss {row['val_loss']:.4f}"
        name = one_line(str(row["name"]))  # a source's name is data: it never breaks the line
        lines.append(
            f"  {name}: weight {row['weight']:g} (share {row['share_asked']:.4f}), tokens "
            f"{row['tokens_seen']} (share {share}; the weights ask {row['tokens_asked']:.1f}), restarts "
            f"{row['restarts']}{val}"
        )
    return "\n".join(lines)


def source_passes(
    run: dict[str, Any], kept_events: list[dict[str, Any]], seq_len: int
) -> list[dict[str, Any]]:
    """Each source's passes over its train split, most-read first ([] for one folder or without figures)."""
    overview = mixture_overview(run, kept_events)
    if overview is None or seq_len <= 0:
        return []
    by_name = {s.get("name"): s for s in sources_of(run)}
    found = []
    for row in overview["sources"]:
        pass_tokens = _source_pass_tokens(by_name[row["name"]], seq_len)
        if pass_tokens is None:
            continue
        found.append(
            {
                "name": row["name"],
                "passes": row["tokens_seen"] / pass_tokens,
                "pass_tokens": pass_tokens,
                "restarts": row["restarts"] or 0,
                "tokens_seen": row["tokens_seen"],
            }
        )
    return sorted(found, key=lambda r: -max(r["passes"], float(r["restarts"])))


def _source_pass_tokens(source: dict[str, Any], seq_len: int) -> int | None:
    """The tokens of one pass over a source's train split (whole windows of seq_len), None where unknown."""
    split_tokens = (source.get("train") or {}).get("tokens")
    if not isinstance(split_tokens, int) or isinstance(split_tokens, bool) or split_tokens <= seq_len <= 0:
        return None
    return batches_per_pass(split_tokens, seq_len, 1) * seq_len


def passes_by_source(run: dict[str, Any], kept_events: list[dict[str, Any]]) -> dict[str, float] | None:
    """{source: passes over its own train split} of the kept history, most-read first; None for one folder
    (a mixture's passes pooled over all its sources hide a small source read many times)."""
    seq_len = ((run.get("recipe") or {}).get("train") or {}).get("seq_len")
    found = source_passes(run, kept_events, seq_len if isinstance(seq_len, int) else 0)
    return {row["name"]: row["passes"] for row in found} if sources_of(run) else None


def projected_passes_by_source(run: dict[str, Any], tokens: int | None) -> dict[str, float] | None:
    """{source: passes over its own train split} that `tokens` training tokens would read at the mixture's
    weights, most-read first; None for one folder or where the figures are missing."""
    sources = sources_of(run)
    seq_len = ((run.get("recipe") or {}).get("train") or {}).get("seq_len")
    if not sources or not tokens or not isinstance(seq_len, int):
        return None
    weights = [float(s.get("weight") or 0.0) for s in sources]
    total = sum(weights)
    found = {}
    for source, weight in zip(sources, weights, strict=True):
        pass_tokens = _source_pass_tokens(source, seq_len)
        if pass_tokens is not None and total > 0:
            found[str(source.get("name"))] = tokens * weight / total / pass_tokens
    return dict(sorted(found.items(), key=lambda item: -item[1])) or None


def format_source_passes(passes: dict[str, float]) -> str:
    """`name X, name Y` (3 significant figures), most-read first; a name is data, one line each."""
    return ", ".join(f"{one_line(str(name))} {value:.3g}" for name, value in passes.items())
