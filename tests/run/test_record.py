"""run.json is replaced atomically; metrics.jsonl lines are strict JSON, flushed, and a torn tail is cut;
the strict reader refuses damage that the tolerant reader lists."""

import json
import math

import pytest

from pilotrun.run import record
from pilotrun.run.record import (
    Counters,
    RecordError,
    json_safe,
    read_metrics_strict,
    read_metrics_tolerant,
    read_record_once,
    recorded_seconds_per_update,
)
from pilotrun.run.writer import MetricsWriter


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


def test_json_safe_keeps_finite_values_exactly():
    value = {"a": (0.1, 2), "b": {"c": 1e-300}}
    assert json_safe(value) == {"a": [0.1, 2], "b": {"c": 1e-300}}


def test_strict_reader_refuses_damage_the_tolerant_reader_lists(tmp_path):
    log = MetricsWriter(tmp_path, "s1")
    log.log("session_start", Counters())
    log.log("train", Counters(step=1, tokens_seen=8, updates_attempted=1), loss=float("nan"))
    log.close()
    events = read_metrics_strict(tmp_path)
    # NaN read back as a float
    assert [e["_line"] for e in events] == [1, 2] and math.isnan(events[1]["loss"])
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
    earlier = Counters.of(
        {"step": 2, "tokens_seen": 16, "updates_attempted": 3, "updates_skipped": 1, "x": 0}
    )
    later = Counters(step=3, tokens_seen=24, updates_attempted=4, updates_skipped=1)
    assert earlier.as_dict() == {"step": 2, "tokens_seen": 16, "updates_attempted": 3, "updates_skipped": 1}
    assert later.covers(earlier) and not earlier.covers(later)


def test_an_invalid_byte_is_damage_on_the_last_line_too_and_only_a_cut_character_is_a_tear(tmp_path):
    log = MetricsWriter(tmp_path, "s1")
    log.log("session_start", Counters())
    log.log("train", Counters(step=1, tokens_seen=8, updates_attempted=1), loss=1.5)
    log.close()
    path = tmp_path / "metrics.jsonl"
    cut = path.read_bytes().rstrip(b"\n")
    start = cut.rindex(b"\n") + 1
    path.write_bytes(cut[:start + 20] + "é".encode()[:1])  # killed halfway through a two-byte character
    torn = read_metrics_tolerant(tmp_path)
    assert torn.damage == [] and torn.notes[0].startswith("metrics.jsonl line 2: torn last line")
    for ending in (b"", b"\n"):  # an invalid byte inside the last line, with and without its newline
        path.write_bytes(cut[:start + 10] + b"\xff" + cut[start + 10:] + ending)
        assert read_metrics_tolerant(tmp_path).damage == [
            "metrics.jsonl line 2: not UTF-8 (byte 0xff at column 11)"
        ]


def test_the_recorded_rate_of_the_whole_log_or_of_its_last_bytes_only(tmp_path):
    log = MetricsWriter(tmp_path, "s1")
    log.log("session_start", Counters())
    for step in range(1, 6):
        log.log("train", Counters(step=2 * step, tokens_seen=16 * step, updates_attempted=2 * step),
                window={"train_seconds": float(step), "updates_attempted": 2})
    log.close()
    assert recorded_seconds_per_update(tmp_path) == [0.5, 1.0, 1.5, 2.0, 2.5]
    lines = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    # the last two lines and a cut piece of the one before: the piece is left out, not read as damage
    assert recorded_seconds_per_update(tmp_path, len(lines[-1]) + len(lines[-2]) + 5) == [2.0, 2.5]
    assert recorded_seconds_per_update(tmp_path, 1 << 20) == recorded_seconds_per_update(tmp_path)
    assert recorded_seconds_per_update(tmp_path / "none", 1 << 20) == []


def test_one_read_gives_the_whole_log_s_events_and_its_recent_rate_and_knows_when_the_file_changed(
    tmp_path, monkeypatch
):
    log = MetricsWriter(tmp_path, "s1")
    log.log("session_start", Counters())
    for step in range(1, 6):
        log.log("train", Counters(step=2 * step, tokens_seen=16 * step, updates_attempted=2 * step),
                window={"train_seconds": float(step), "updates_attempted": 2})
    lines = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    # a recent part that cuts a line: the same windows as the read of the file's last bytes
    recent = len(lines[-1]) + len(lines[-2]) + 5
    monkeypatch.setattr(record, "RECENT_BYTES", recent)
    read = read_record_once(tmp_path)
    assert read.events == read_metrics_tolerant(tmp_path).events
    assert read.recent_seconds_per_update() == recorded_seconds_per_update(tmp_path, recent) == [2.0, 2.5]
    assert read.current(tmp_path)
    log.log("val", Counters(step=10, tokens_seen=80, updates_attempted=10), loss=1.0)
    log.close()
    assert not read.current(tmp_path)  # an append since: no longer the file
    missing = read_record_once(tmp_path / "none")
    assert missing.events == [] and missing.recent_seconds_per_update() == []
    assert not missing.current(tmp_path / "none")  # nothing read: always read again
