"""pilotrun/run/start_costs.py: a session's set-up, from its command's start to its first train window, read
from the record; the run's last save."""

from __future__ import annotations

import json

from pilotrun.run import start_costs
from pilotrun.run.record import read_metrics_tolerant
from pilotrun.run.start_costs import (
    ReadHandover,
    StartCosts,
    last_save_of,
    read_start_costs,
    setup_seconds_of,
)


def window(time: float, wall: float, sid: str = "a") -> dict:
    return {"event": "train", "time": time, "session_id": sid, "window": {"wall_seconds": wall}}


def test_set_up_runs_from_the_command_s_start_to_the_first_window():
    events = [
        {"event": "session_start", "time": 100.0, "session_id": "a", "setup_seconds": 7.5},
        window(110.0, 4.0), window(120.0, 10.0),  # the first window began at 106: 6 s after the line
        {"event": "session_end", "time": 121.0, "session_id": "a"},
        {"event": "session_start", "time": 200.0, "session_id": "b"},  # written before setup_seconds
        window(203.25, 1.0, "b"),
        {"event": "session_start", "time": 300.0, "session_id": "c", "setup_seconds": 3.0},  # never trained
    ]
    assert setup_seconds_of(events) == [13.5, 2.25]


def test_read_from_a_run_folder(tmp_path):
    lines = [{"event": "session_start", "time": 10.0, "session_id": "a", "setup_seconds": 1.0},
             window(14.0, 2.0),
             {"event": "checkpoint", "time": 15.0, "session_id": "a", "seconds": 0.75},
             {"event": "checkpoint", "time": 16.0, "session_id": "a", "seconds": 0.5}]
    counters = {"step": 0, "tokens_seen": 0, "updates_attempted": 0, "updates_skipped": 0}
    text = "".join(json.dumps({**line, **counters}) + "\n" for line in lines)
    (tmp_path / "metrics.jsonl").write_text(text)
    recorded = read_metrics_tolerant(tmp_path).events
    assert setup_seconds_of(recorded) == [3.0]
    assert last_save_of(recorded) == 0.5
    assert read_start_costs(tmp_path) == StartCosts([], [3.0], 0.5)  # the window holds no update
    none = read_metrics_tolerant(tmp_path / "none").events
    assert setup_seconds_of(none) == [] and last_save_of(none) is None
    assert read_start_costs(tmp_path / "none") == StartCosts([], [], None)


def test_the_checks_read_is_handed_over_once_and_only_while_the_file_is_unchanged(tmp_path, monkeypatch):
    counters = {"step": 0, "tokens_seen": 0, "updates_attempted": 0, "updates_skipped": 0}
    first = {"event": "session_start", "time": 10.0, "session_id": "a", **counters}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(first) + "\n")
    reads = []
    real = start_costs.read_record_once
    monkeypatch.setattr(start_costs, "read_record_once",
                        lambda run_dir: reads.append(run_dir) or real(run_dir))
    handover = ReadHandover(tmp_path)
    costs = handover.start_costs()
    assert handover.start_costs() is costs and reads == [tmp_path]  # the checks read once, on first use
    assert handover.take() is costs.read and reads == [tmp_path]  # unchanged: not read again
    again = handover.take()  # taken once: a second take reads
    assert again is not costs.read and again.events == costs.read.events and reads == [tmp_path] * 2
    changed = ReadHandover(tmp_path)
    changed.start_costs()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({**first, "time": 11.0}) + "\n")
    now = read_metrics_tolerant(tmp_path).events
    assert [e["time"] for e in now] == [10.0, 11.0]
    assert changed.take().events == now  # changed since the checks' read: read again
    assert ReadHandover(tmp_path).take().events == now  # the checks read nothing: read
    assert len(reads) == 5
