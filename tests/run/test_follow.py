"""pilotrun/run/follow.py: a record read as it grows, line by line, its chain checked incrementally."""

from __future__ import annotations

import os

import pytest

from pilotrun.run.follow import RecordFollower
from pilotrun.run.record import RecordError
from tests.report.synthetic import crashed_and_resumed


def test_a_growing_log_is_read_once_a_torn_last_line_waits_for_its_newline(tmp_path):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    whole = (run_dir / "metrics.jsonl").read_bytes()
    lines = whole.splitlines(keepends=True)
    path = run_dir / "metrics.jsonl"
    path.write_bytes(b"".join(lines[:3]) + lines[3][:20])  # a writer halfway through line 4
    follower = RecordFollower(run_dir)
    first = follower.poll()
    assert [e["_line"] for e in first.events] == [1, 2, 3] and not first.breaks and first.pending_bytes == 20
    path.write_bytes(whole)
    rest = follower.poll()
    assert [e["_line"] for e in rest.events] == list(range(4, len(lines) + 1)) and not rest.breaks
    assert follower.poll().events == []


def test_an_edited_line_breaks_the_chain_where_it_is_read_and_a_rewrite_is_found(tmp_path):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[5] = lines[5].replace('"session_id":"s1"', '"session_id":"s1","x":1', 1)
    path.write_text("".join(lines))
    follower = RecordFollower(run_dir)
    found = follower.poll()
    assert len(found.breaks) == 1 and found.breaks[0].startswith("metrics.jsonl line 6 (")
    path.write_text("".join(lines[:2]))
    assert "it was truncated; everything is read again" in follower.poll().breaks[0]
    assert len(follower.poll().events) == 2  # read again from the start


@pytest.mark.parametrize("where", [1, -3])
def test_a_line_already_read_edited_in_place_is_named_at_the_next_poll(tmp_path, where):
    """A line read before, edited in place to the same length (an early one and one near the end): the next
    poll names it as changed after it was read, and the chain check of the reread names the line too."""
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    path = run_dir / "metrics.jsonl"
    follower = RecordFollower(run_dir)
    assert not follower.poll().breaks
    lines = path.read_bytes().splitlines(keepends=True)
    number = where + 1 if where > 0 else len(lines) + where + 1
    old = lines[number - 1]
    lines[number - 1] = old.replace(b'"step":', b'"stap":', 1)
    assert len(lines[number - 1]) == len(old) and lines[number - 1] != old
    with open(path, "r+b") as handle:  # in place: the same file, the same size
        handle.write(b"".join(lines))
    breaks = []
    for _ in range(200):  # the piece compared moves through the file each poll; bounded, not timed
        breaks = follower.poll().breaks
        if breaks:
            break
    assert breaks[0] == (
        f"metrics.jsonl: metrics.jsonl line {number} changed after it was read (edited in place); "
        "everything is read again from its start, chained afresh"
    ), breaks
    again = follower.poll().breaks
    assert any(f"metrics.jsonl line {number}" in b for b in again), again


def test_a_log_replaced_by_another_file_is_named_replaced(tmp_path):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    path = run_dir / "metrics.jsonl"
    follower = RecordFollower(run_dir)
    follower.poll()
    copy = path.with_name("copy")
    copy.write_bytes(path.read_bytes() + b"")
    os.replace(copy, path)
    assert follower.poll().breaks[0].startswith("metrics.jsonl: metrics.jsonl was replaced by another file")


def test_a_folder_that_is_not_a_run_is_bad_input(tmp_path):
    with pytest.raises(RecordError):
        RecordFollower(tmp_path)
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(RecordError, match="run_id"):
        RecordFollower(tmp_path)
    (tmp_path / "run.json").write_text('{"run_id": "x"}')
    assert RecordFollower(tmp_path).poll().events == []  # no log yet: a session about to open it


def test_an_incomplete_line_with_an_invalid_byte_is_named_once_and_a_cut_character_waits(tmp_path):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    path = run_dir / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    # A writer halfway through line 4 whose last character ("é", two bytes) is cut: a tear, it waits.
    path.write_bytes(b"".join(lines[:3]) + lines[3][:20] + "é".encode()[:1])
    follower = RecordFollower(run_dir)
    assert not follower.poll().breaks
    # An invalid byte inside the incomplete line: no later write mends it, so it is named now, by its number.
    path.write_bytes(b"".join(lines[:3]) + lines[3][:20] + b"\xff" + lines[3][20:-1])
    assert follower.poll().breaks == ["metrics.jsonl line 4: not UTF-8 (byte 0xff at column 21)"]
    assert follower.poll().breaks == []
    path.write_bytes(b"".join(lines[:3]) + lines[3][:20] + b"\xff" + lines[3][20:] + b"".join(lines[4:]))
    rest = follower.poll()  # the line completed: not named a second time, the lines after it read on
    assert not [b for b in rest.breaks if "line 4: not UTF-8" in b] and rest.events[0]["_line"] == 5


def test_a_line_longer_than_a_poll_is_named_once_and_passed_over(tmp_path):
    """A single 9 MB line (more than one poll reads): named once by its number, never waited for in silence;
    the lines after it are read on (the first of them breaks the chain, as it follows from the long one)."""
    from pilotrun.run.follow import POLL_BYTES

    run_dir = crashed_and_resumed(tmp_path / "r").write()
    path = run_dir / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    follower = RecordFollower(run_dir)
    assert not follower.poll().breaks
    with open(path, "ab") as handle:
        handle.write(b'{"event":"train","pad":"' + b"x" * (9 << 20) + b'"}')
    first = follower.poll()
    assert first.breaks == [f"metrics.jsonl line {len(lines) + 1}: longer than {POLL_BYTES >> 20} MiB (the "
                            "writer's lines are kilobytes); not parsed, passed over"]
    assert follower.poll().breaks == []  # named once while it is still being written
    with open(path, "ab") as handle:
        handle.write(b"\n" + lines[-1])
    follower.poll()  # passes over it
    after = follower.poll()
    assert after.events and after.events[-1]["_line"] == len(lines) + 2
    assert [b for b in after.breaks if "hash chain broken" in b]


def test_a_run_folder_swapped_for_a_link_is_named_once_and_not_read_through(tmp_path):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    other = crashed_and_resumed(tmp_path / "other").write()
    follower = RecordFollower(run_dir)
    assert follower.poll().events
    os.rename(run_dir, tmp_path / "moved")
    os.symlink(other, run_dir)
    first = follower.poll()
    assert (
        first.breaks
        == [
            f"{run_dir}: the run folder was replaced after watching began (it is now a symbolic "
            f"link to {other}); nothing is read through it"
        ]
        and not first.events
    )
    assert follower.poll().breaks == []


def test_a_run_folder_made_after_following_began_is_read_and_a_link_made_there_is_not(tmp_path):
    """The pilot follows its child's run folder before the child has made it: the folder appearing is the run
    starting, not a replacement; a link appearing there is never read through."""
    made = crashed_and_resumed(tmp_path / "made").write()
    follower = RecordFollower(tmp_path / "r", chained=False)
    assert follower.poll().events == []
    os.rename(made, tmp_path / "r")
    found = follower.poll()
    assert found.events and found.breaks == []
    linked = RecordFollower(tmp_path / "l", chained=False)
    os.symlink(tmp_path / "r", tmp_path / "l")
    assert not linked.poll().events
