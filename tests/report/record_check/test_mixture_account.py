"""A mixture's account in the report, on hand-made records: per-source tokens reconcile or are named, the
realised mixture is set against the weights, and the passes of each source are counted on its own split."""

from __future__ import annotations

from pilotrun.report.record_check.mixture_account import (
    format_mixture,
    mixture_overview,
    mixture_problems,
    source_passes,
)

RUN = {
    "data": {
        "sources": [
            {"name": "web", "weight": 0.75, "metadata_sha256": "a" * 64, "train": {"tokens": 641}},
            {"name": "math", "weight": 0.25, "metadata_sha256": "b" * 64, "train": {"tokens": 65}},
        ],
        "mixture": {"weights": [0.75, 0.25], "seed": 4},
    }
}


def window(line, step, seen, by_source, tokens, sid="s1"):
    return {
        "event": "train",
        "_line": line,
        "step": step,
        "session_id": sid,
        "tokens_seen": seen,
        "window": {"tokens": tokens},
        "tokens_by_source": by_source,
        "tokens_seen_by_source": dict(by_source) if step == 1 else None,
        "restarts_by_source": {"web": 0, "math": 2},
    }


def good_events():
    first = window(1, 1, 128, {"web": 96, "math": 32}, 128)
    second = window(2, 2, 256, {"web": 96, "math": 32}, 128)
    second["tokens_seen_by_source"] = {"web": 192, "math": 64}
    val = {"event": "val", "_line": 3, "step": 2, "loss_by_source": {"web": 3.5, "math": 2.0}}
    return [first, second, val]


def test_a_reconciled_mixture_has_no_problem_and_a_folder_run_none_at_all():
    assert mixture_problems(RUN, good_events()) == []
    assert mixture_problems({"data": {}}, [{"event": "train", "tokens_seen": 1}]) == []
    assert mixture_overview({"data": {}}, good_events()) is None and format_mixture(None) is None


def test_sources_that_do_not_add_up_are_named_with_the_line():
    events = good_events()
    events[1]["tokens_seen_by_source"]["math"] += 32
    problems = mixture_problems(RUN, events)
    assert any("line 2" in p and "add up to 288, not tokens_seen 256" in p for p in problems)
    assert any("does not follow from the previous window" in p for p in problems)
    events = good_events()
    events[0]["tokens_by_source"] = {"web": 96}
    assert "missing or not the sources" in mixture_problems(RUN, events)[0]


def test_after_a_rollback_a_source_follows_from_the_train_event_at_the_restored_counters():
    """A spike's rollback restores the counters of step 1's checkpoint: the next window follows from step
    1's."""
    first, second, _ = good_events()
    counters = {"updates_attempted": 1, "updates_skipped": 0}
    first.update(counters)
    second.update(updates_attempted=2, updates_skipped=0)
    rollback = {
        "event": "rollback",
        "_line": 3,
        "session_id": "s1",
        "step": 1,
        "tokens_seen": 128,
        **counters,
    }
    redone = window(4, 2, 256, {"web": 64, "math": 64}, 128)
    redone.update(updates_attempted=2, updates_skipped=0, tokens_seen_by_source={"web": 160, "math": 96})
    assert mixture_problems(RUN, [first, second, rollback, redone]) == []
    # no train event at those counters
    unknown = {**rollback, "tokens_seen": 0, "step": 0, "updates_attempted": 0}
    assert mixture_problems(RUN, [first, second, unknown, redone]) == []  # nothing to follow from: not judged
    assert "does not follow" in mixture_problems(RUN, [first, second, redone])[0]


def test_the_realised_mixture_against_the_weights():
    overview = mixture_overview(RUN, good_events())
    web, math = overview["sources"]
    assert overview["tokens_seen"] == 256 and overview["seed"] == 4
    assert (web["tokens_seen"], web["share_seen"], web["tokens_asked"]) == (192, 0.75, 192.0)
    assert math["val_loss"] == 2.0 and math["restarts"] == 2
    text = format_mixture(overview)
    assert (
        "math: weight 0.25 (share 0.2500), tokens 64 (share 0.2500; the weights ask 64.0), restarts 2" in text
    )


def test_passes_are_counted_per_source_most_read_first():
    found = source_passes(RUN, good_events(), seq_len=32)
    assert [r["name"] for r in found] == ["math", "web"]
    assert found[0]["pass_tokens"] == 64 and found[0]["passes"] == 1.0 and found[0]["restarts"] == 2
    assert found[1]["passes"] == 192 / 640


def test_a_source_named_with_a_newline_and_an_escape_stays_on_its_line():
    overview = mixture_overview(RUN, good_events())
    overview["sources"][1]["name"] = "math\nall sources: healthy\x1b]0;owned\x07"
    lines = format_mixture(overview).split("\n")
    assert len(lines) == 3 and "all sources: healthy" not in [line.strip() for line in lines]
    assert lines[2].startswith("  math\\nall sources: healthy\\x1b]0;owned\\x07: weight 0.25")
