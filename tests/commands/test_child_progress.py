"""The pilot's progress line: figures read from a child's metrics.jsonl, the newest session only."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from pilotrun.commands.child_progress import (
    ProgressLine,
    format_progress,
    progress_figures,
    read_complete_events,
    wait_with_progress,
)


def _event(**fields) -> dict:
    counters = {"session_id": "s", "step": 0, "tokens_seen": 0, "updates_attempted": 0, "updates_skipped": 0}
    return {**counters, **fields}


def events_of_two_sessions() -> list[dict]:
    return [_event(**e) for e in [
        {"event": "session_start", "time": 100.0, "step": 0},
        {"event": "train", "time": 110.0, "step": 10, "loss": 5.0, "throughput": {"wall_tokens_per_s": 50.0}},
        {"event": "session_start", "time": 200.0, "step": 8},
        {"event": "train", "time": 204.0, "step": 12, "loss": 4.5, "throughput": {"wall_tokens_per_s": 64.0}},
        {"event": "train", "time": 208.0, "step": 16, "loss": 4.0, "throughput": {"wall_tokens_per_s": 80.0}},
    ]]


def test_figures_come_from_the_newest_session():
    figures = progress_figures(events_of_two_sessions(), max_steps=40)
    # 8 updates in 8 s since the resumed session started at step 8: 24 left at 1 update/s
    assert figures == {"step": 16, "loss": 4.0, "wall_tokens_per_s": 80.0, "eta_seconds": 24.0}
    assert progress_figures(events_of_two_sessions()[:3], max_steps=40) is None  # no window yet
    assert format_progress(figures, 40)


def test_a_resumed_childs_line_waits_for_its_own_session():
    # Before the resumed session's session_start the record holds only the killed session's windows: showing
    # them would print the killed session's last line again, with a new ETA.
    killed = events_of_two_sessions()[:2]
    assert progress_figures(killed, max_steps=40) is not None
    assert progress_figures(killed, max_steps=40, sessions_before=1) is None
    assert progress_figures(events_of_two_sessions()[:3], max_steps=40, sessions_before=1) is None
    assert progress_figures(events_of_two_sessions(), max_steps=40, sessions_before=1)["step"] == 16


def test_partial_last_line_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_event(event="session_start", time=1.0)) + "\n{\"event\": \"tra")
    (event,) = read_complete_events(path)
    assert (event["event"], event["time"], event["step"]) == ("session_start", 1.0, 0)


@pytest.mark.slow
def test_wait_shows_progress_until_the_child_exits(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events_of_two_sessions()))
    out = io.StringIO()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    events = wait_with_progress(child, metrics, 40, ProgressLine(out, prefix=""), poll_seconds=0.01,
                                timeout_seconds=60)
    assert child.returncode == 0
    assert len(events) == 5
    assert out.getvalue().strip() == format_progress(progress_figures(events, 40), 40)


@pytest.mark.slow
def test_wait_stops_when_the_condition_holds(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events_of_two_sessions()))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        events = wait_with_progress(child, metrics, 40, ProgressLine(io.StringIO()), poll_seconds=0.01,
                                    timeout_seconds=60, stop_when=lambda ev: ev[-1]["step"] == 16)
        assert child.poll() is None and events[-1]["step"] == 16
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_ctrl_c_waits_for_the_child_then_reports_exit_130(tmp_path, monkeypatch):
    import pytest

    from pilotrun.commands import child_progress

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    calls = []

    def interrupted_sleep(seconds):
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(child_progress.time, "sleep", interrupted_sleep)
    with pytest.raises(child_progress.ChildInterrupted) as caught:
        wait_with_progress(
            child,
            tmp_path / "metrics.jsonl",
            40,
            ProgressLine(io.StringIO()),
            poll_seconds=0.01,
            timeout_seconds=60,
        )
    assert child.returncode == 0  # waited for the child to end by itself, not killed
    assert caught.value.exit_code == 130


class _Running:
    """A child that has not exited (the poll never reaches the timeout's kill or a wait)."""

    def poll(self):
        return None


def _record_text() -> bytes:
    return "".join(json.dumps(e) + "\n" for e in events_of_two_sessions()).encode()


def _whole_lines(text: bytes) -> list[bytes]:
    return text.splitlines(keepends=True)


def _torn_pieces(text: bytes) -> list[bytes]:
    return [text[i:i + 37] for i in range(0, len(text), 37)]  # lines arrive torn, as a writer appends them


@pytest.mark.parametrize("cut", [_whole_lines, _torn_pieces])
def test_the_poll_reads_each_byte_of_the_record_once(tmp_path, monkeypatch, cut):
    """Every byte goes through the follower's reader, counted; the whole-file reader is not used while
    polling. A complete line is read once; only a line still being written (no newline yet) is read again at
    the next poll, until its newline arrives (run/follow.py)."""
    from pilotrun.commands import child_progress
    from pilotrun.run import run_folder

    text = _record_text()
    pieces = cut(text)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b"")
    read_sizes = []

    class Counted:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def seek(self, *args):
            return self.handle.seek(*args)

        def read(self, size=-1):
            data = self.handle.read(size)
            read_sizes.append(len(data))
            return data

    monkeypatch.setattr(run_folder, "open", lambda path, mode="r": Counted(open(path, mode)), raising=False)
    monkeypatch.setattr(
        child_progress, "read_metrics_tolerant", lambda run_dir: pytest.fail("whole file read")
    )
    sizes = []

    def append_next(events):  # between two polls the child appends its next piece
        if pieces:
            with open(metrics, "ab") as handle:
                handle.write(pieces.pop(0))
            sizes.append(metrics.stat().st_size)
        return not pieces and len(events) == 5

    out = io.StringIO()
    events = wait_with_progress(_Running(), metrics, 40, ProgressLine(out, prefix=""), poll_seconds=0.0,
                                timeout_seconds=600, stop_when=append_next)
    # What a poll read again: the bytes of the line being written when it looked (none with whole lines).
    written_again = sum(size - (text.rfind(b"\n", 0, size) + 1) for size in sizes)
    assert sum(read_sizes) == len(text) + written_again and len(read_sizes) == len(cut(text)) + 1
    if cut is _whole_lines:
        assert sum(read_sizes) == len(text)  # each byte once
    assert [{k: v for k, v in e.items() if k != "_line"} for e in events] == events_of_two_sessions()
    # the last, at the end
    assert out.getvalue().splitlines()[-1] == format_progress(progress_figures(events, 40), 40)


def test_a_rewritten_record_is_read_again_from_its_start(tmp_path):
    from pilotrun.commands.child_progress import GrowingEvents

    metrics = tmp_path / "metrics.jsonl"
    two = events_of_two_sessions()
    metrics.write_text("".join(json.dumps(e) + "\n" for e in two))
    record = GrowingEvents(metrics)
    assert len(record.read()) == 5
    metrics.write_text(json.dumps(two[0]) + "\n")  # shorter than what was read: rewritten, not appended to
    record.read()
    assert [e["event"] for e in record.read()] == ["session_start"]
