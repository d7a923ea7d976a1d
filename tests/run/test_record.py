"""run.json is replaced atomically; metrics.jsonl lines are strict JSON, flushed, and a torn tail is cut;
the strict reader refuses damage that the tolerant reader lists."""

import json
import math

import pytest

from pilotrun.run.record import (
    Counters,
    RecordError,
    chain_breaks,
    json_safe,
    parse_metrics_bytes,
    read_metrics_strict,
    read_metrics_tolerant,
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
    assert (record["step"], record["tokens_seen"], record["updates_attempted"], record["updates_skipped"]) == (
        3, 384, 4, 1)
    assert record["loss"] == loss  # full precision: exact float round trip
    assert isinstance(record["time"], float)
    log.close()


def test_non_finite_floats_are_strict_json_strings(tmp_path):
    log = MetricsWriter(tmp_path, "s1")
    log.log("train", Counters(step=0, tokens_seen=0, updates_attempted=1, updates_skipped=1),
            loss=float("nan"), grad_norm=float("inf"), other=[float("-inf"), 1.0])
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict JSON constant {name}"))
    assert record["loss"] == "NaN" and math.isnan(float(record["loss"]))
    assert record["grad_norm"] == "Infinity" and float(record["grad_norm"]) == math.inf
    assert record["other"] == ["-Infinity", 1.0]


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
    first = '{"event":"train","session_id":"s1","step":1,"tokens_seen":8,"updates_attempted":1,"updates_skipped":0}'
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


def test_json_safe_keeps_finite_values_exactly():
    value = {"a": (0.1, 2), "b": {"c": 1e-300}}
    assert json_safe(value) == {"a": [0.1, 2], "b": {"c": 1e-300}}


def test_strict_reader_refuses_damage_the_tolerant_reader_lists(tmp_path):
    log = MetricsWriter(tmp_path, "s1")
    log.log("session_start", Counters())
    log.log("train", Counters(step=1, tokens_seen=8, updates_attempted=1), loss=float("nan"))
    log.close()
    events = read_metrics_strict(tmp_path)
    assert [e["_line"] for e in events] == [1, 2] and math.isnan(events[1]["loss"])  # NaN read back as a float
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + "not json\n" + '{"event":"train"}\n')
    tolerant = read_metrics_tolerant(tmp_path)
    assert [e["event"] for e in tolerant.events] == ["session_start", "train"]
    assert tolerant.damage == ["metrics.jsonl line 3: not a JSON object ('not json')",
                               "metrics.jsonl line 4: event lacks session_id, step, tokens_seen, "
                               "updates_attempted, updates_skipped"]
    with pytest.raises(RecordError, match="line 3: not a JSON object.*and 1 more"):
        read_metrics_strict(tmp_path)


def test_missing_metrics_file_is_damage_to_the_tolerant_reader_and_empty_to_the_strict_one(tmp_path):
    assert read_metrics_strict(tmp_path) == []
    parsed = read_metrics_tolerant(tmp_path)
    assert parsed.missing and parsed.events == [] and len(parsed.damage) == 1


def test_counters_read_from_an_event_and_ordered_by_work():
    earlier = Counters.of({"step": 2, "tokens_seen": 16, "updates_attempted": 3, "updates_skipped": 1, "x": 0})
    later = Counters(step=3, tokens_seen=24, updates_attempted=4, updates_skipped=1)
    assert earlier.as_dict() == {"step": 2, "tokens_seen": 16, "updates_attempted": 3, "updates_skipped": 1}
    assert later.covers(earlier) and not earlier.covers(later)
