"""Spikes and rollbacks as the record tells them, on hand-made events: the cut a rollback makes, the check
that it restored a checkpoint's counters, the overview, the ledger's replay seconds and the spikes rule."""

from __future__ import annotations

from types import SimpleNamespace

from pilotrun.report.record_check.spike_history import (
    describe_spikes,
    judge_spikes,
    replay_seconds,
    rollback_problems,
    spike_overview,
    split_rollbacks,
)
from pilotrun.report.verdict.thresholds import Thresholds


def event(kind, line, step, attempted, tokens, **fields):
    return {"event": kind, "_line": line, "step": step, "updates_attempted": attempted, "tokens_seen": tokens,
            "updates_skipped": attempted - step, **fields}


RECORD = [
    event("train", 1, 4, 4, 40), event("checkpoint", 2, 4, 4, 40), event("train", 3, 5, 5, 50),
    event("spike", 4, 5, 6, 60, spike_step=6, action="rollback", cause="batch", signals=["loss"],
          replay={"seconds": 0.5, "ranks_differing": []}),
    event("train", 5, 5, 6, 60), event("rollback", 6, 4, 4, 40, restored_step=4, spike_step=6,
                                        skipped={"tokens": 30}, seconds=0.25),
    event("train", 7, 5, 5, 50),
]


def test_a_rollback_cuts_the_history_back_to_the_counters_it_restored():
    kept, rolled = split_rollbacks(RECORD)
    assert [e["_line"] for e in kept] == [1, 2, 6, 7] and [e["_line"] for e in rolled] == [3, 4, 5]


def test_a_rollback_must_restore_a_recorded_checkpoint():
    assert rollback_problems(RECORD) == []
    wrong = [*RECORD[:5], {**RECORD[5], "tokens_seen": 41}]
    assert "no checkpoint recorded before it holds" in rollback_problems(wrong)[0]


def test_overview_ledger_seconds_and_line():
    overview = spike_overview(RECORD)
    assert overview["spikes"] == 1 and overview["rollbacks"] == 1 and overview["skipped_tokens"] == 30
    assert overview["list"][0]["cause"] == "batch"
    assert replay_seconds(RECORD) == 0.75
    assert "update 6 loss -> rollback, cause batch" in describe_spikes(overview)
    assert describe_spikes(spike_overview([])) is None


def test_the_line_names_the_skipped_documents_and_reads_older_records_by_their_batches():
    """A rollback's `skipped` names the spiking batches' documents (per source of a mixture); one written
    before rollbacks named documents has the batches only, and is read as such."""
    skipped = {"first_batch": 14, "batches": 16, "tokens": 2048,
               "documents": [{"source": "web", "pass": 0, "first": 40, "last": 41, "tokens": [1700, 3753]}]}
    record = [*RECORD[:5], {**RECORD[5], "skipped": skipped}]
    assert (
        "rollbacks 1 (batches 14..29: web documents 40..41 (pass 0)), data skipped by them 2048 tokens"
        in describe_spikes(spike_overview(record))
    )
    older = [*RECORD[:5], {**RECORD[5], "skipped": {"first_batch": 16, "batches": 3, "tokens": 30}}]
    assert "rollbacks 1 (batches 16..18), data skipped by them 30 tokens" in describe_spikes(
        spike_overview(older)
    )
    assert "rollbacks 1 (skip not recorded)" in describe_spikes(spike_overview(RECORD))


def test_the_rule_warns_on_any_spike_and_fails_past_its_bounds():
    summary = SimpleNamespace(
        overall={"spikes": spike_overview(RECORD)}, kept_events=[], rolled_back_events=[]
    )
    assert judge_spikes(summary, Thresholds()).status == "WARN"
    assert judge_spikes(summary, Thresholds(max_spike_rollbacks=0)).status == "FAIL"
    quiet = SimpleNamespace(overall={}, kept_events=RECORD[:3], rolled_back_events=[])
    assert judge_spikes(quiet, Thresholds()).status == "PASS"
    unreproduced = [
        {**RECORD[3], "cause": "not_reproducible", "_line": n, "updates_attempted": n} for n in (4, 8)
    ]
    twice = SimpleNamespace(
        overall={"spikes": spike_overview(unreproduced)}, kept_events=[], rolled_back_events=[]
    )
    assert judge_spikes(twice, Thresholds()).status == "FAIL"


def test_a_resumed_sessions_redo_of_a_spike_and_its_rollback_counts_once():
    """Killed after the rollback and resumed from the checkpoint at step 4, the run attempts update 6 again
    from the same state on the same data: the same spike and rollback are logged again, one spike of the run
    all the same."""
    redone = [{**e, "_line": e["_line"] + 10, "session_id": "b"} for e in RECORD[2:6]]
    overview = spike_overview(RECORD + redone)
    assert overview["spikes"] == 1 and overview["rollbacks"] == 1 and overview["skipped_tokens"] == 30
    assert [s["line"] for s in overview["list"]] == [4]
    # Another attempt at the same update (later: more attempted, more tokens) is another spike.
    again = {**RECORD[3], "_line": 20, "updates_attempted": 7, "tokens_seen": 70}
    assert spike_overview([*RECORD, again])["spikes"] == 2
