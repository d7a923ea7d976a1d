"""The record's writer: every metrics.jsonl line strict JSON and flushed, a torn tail cut before appending and
the chain continued from the last complete line, run.json replaced atomically."""

import json

import pytest

from pilotrun.run.record import (
    Counters,
    chain_breaks,
    parse_metrics_bytes,
    read_metrics_strict,
    read_run_json,
)
from pilotrun.run.writer import MetricsWriter, RunRecord, repair_torn_tail, write_json_atomic


def test_metrics_line_is_flushed_and_carries_required_fields(tmp_path):
    log = MetricsWriter(tmp_path, "s1")
    loss = 1.2345678901234567
    log.log("train", Counters(step=3, tokens_seen=384, updates_attempted=4, updates_skipped=1), loss=loss)
    # Read back before close: the line must already be on disk (flushed per line).
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "train" and record["session_id"] == "s1"
    assert (
        record["step"],
        record["tokens_seen"],
        record["updates_attempted"],
        record["updates_skipped"],
    ) == (3, 384, 4, 1)
    assert record["loss"] == loss  # full precision: exact float round trip
    assert isinstance(record["time"], float)
    log.close()


def test_unknown_event_is_refused(tmp_path):
    log = MetricsWriter(tmp_path, "s1")
    with pytest.raises(ValueError):
        log.log("tarin", Counters())


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsWriter(tmp_path, "s1", enabled=False)
    assert log.log("train", Counters()) is None
    assert not (tmp_path / "metrics.jsonl").exists()


def test_torn_tail_is_cut_and_appends_start_on_a_fresh_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = ('{"event":"train","session_id":"s1","step":1,"tokens_seen":8,"updates_attempted":1,'
             '"updates_skipped":0,"time":1.0}')
    path.write_text(first + '\n{"event":"tra')
    # the partial line is not parsed
    assert read_metrics_strict(tmp_path) == [{**json.loads(first), "_line": 1}]
    assert repair_torn_tail(path) == len('{"event":"tra')
    assert path.read_text() == first + '\n'
    assert repair_torn_tail(path) == 0
    log = MetricsWriter(tmp_path, "s2")
    log.log("session_start", Counters(step=1, tokens_seen=8, updates_attempted=1, updates_skipped=0))
    log.close()
    assert [r["event"] for r in read_metrics_strict(tmp_path)] == ["train", "session_start"]


def test_the_writer_itself_cuts_a_torn_tail_and_chains_on_from_the_last_complete_line(tmp_path):
    first = MetricsWriter(tmp_path, "s1", run_id="r1")
    first.log("session_start", Counters())
    first.log("train", Counters(step=1, tokens_seen=8, updates_attempted=1))
    first.close()
    complete = (tmp_path / "metrics.jsonl").read_bytes()
    (tmp_path / "metrics.jsonl").write_bytes(complete + b'{"event":"train","sess')  # a kill mid-write
    second = MetricsWriter(tmp_path, "s2", run_id="r1")
    assert second.repaired_bytes == len('{"event":"train","sess')
    second.log("session_start", Counters(step=1, tokens_seen=8, updates_attempted=1))
    second.close()
    raw = (tmp_path / "metrics.jsonl").read_bytes()
    assert raw.startswith(complete) and raw.count(b"\n") == 3
    parsed = parse_metrics_bytes(raw)
    assert not parsed.notes and not parsed.damage
    assert chain_breaks(parsed, "r1") == []
    assert len(chain_breaks(parsed, "another-run")) == 1  # the first line chains to this run's id only


def test_torn_single_line_file_is_emptied(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event":"tr')
    assert repair_torn_tail(path) == 12
    assert path.read_text() == ""


def test_write_json_atomic_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "run.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "x": float("nan")})
    assert json.loads(path.read_text()) == {"a": 2, "x": "NaN"}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_run_record_round_trip(tmp_path):
    record = RunRecord.create(tmp_path, run_id="r1", tokens_per_update=128, model={"parameters": 10},
                              optimizer={"groups": []}, recipe={"train": {}}, data={"dir": "d"})
    record.add_session({"session_id": "s1", "start_step": 0})
    record.record_allowed_changes("s1", [{"key": "train.seed", "old": 0, "new": 1}])
    record.save()
    loaded = RunRecord.load(tmp_path)
    assert loaded.data == read_run_json(tmp_path) == record.data
    assert loaded.data["allowed_changes"] == [{"session_id": "s1", "key": "train.seed", "old": 0, "new": 1}]
    assert loaded.data["tokens_per_update"] == 128


