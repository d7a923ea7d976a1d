"""pilotrun/run/tracker_wandb.py, offline: the run files W&B writes (RUN/wandb/offline-run-*/run-ID.wandb),
read back record by record with the wandb package's own protobuf records, hold metrics.jsonl's values exactly
(float64), the identity as config, and after a resume W&B's rewind to the checkpoint's step, so that each step
shows once with the kept value; export-metrics adds the verdict (summary) and the report (an artifact)."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from tests.run.tracker_runs import (
    ROLLED_BACK,
    crashed_run,
    expected,
    identity,
    live_run,
    mirror_session_by_session,
    same,
    write_verdict,
)

pytest.importorskip("wandb")

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of records with 7-byte headers


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):
            return  # the writer is halfway through this record: the file is not complete yet
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (2, 3):  # first, middle
            pending += chunk
            continue
        yield wandb_internal_pb2.Record.FromString(pending + chunk)
        pending = b""


def complete_records(path: Path, timeout: float = 60.0) -> list:
    """W&B's service process may still be writing the file when `finish()` has returned (a record may be torn
    at the end, or a block half written): read again until its closing `exit` record is there."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            found = list(records(path))
        except DecodeError:  # a block the service process has not finished writing: read again
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_runs(run_dir: Path):
    """Each offline session file in order: its config, its history rows and its summary/artifact records."""
    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        session = {"config": {}, "rows": [], "summary": {}, "artifacts": [], "run_id": None}
        for record in complete_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                session["run_id"] = record.run.run_id
                session["config"].update({key(c): json.loads(c.value_json) for c in record.run.config.update})
            elif kind == "config":
                session["config"].update({key(c): json.loads(c.value_json) for c in record.config.update})
            elif kind == "history":
                session["rows"].append({key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                session["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
            elif kind == "artifact":
                session["artifacts"].append(
                    (record.artifact.type, [c.path for c in record.artifact.manifest.contents])
                )
        out.append(session)
    return out


def history(sessions) -> dict[str, list[tuple[int, float]]]:
    """The run's history as W&B keeps it: a session resumed from a branch point rewinds the rows after it."""
    rows: list[dict] = []
    for session in sessions:
        branch = (session["config"].get("_wandb") or {}).get("branch_point")
        if branch is not None:
            rows = [row for row in rows if row["_step"] <= branch["step"]]
        rows.extend(session["rows"])
    points: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag, value in row.items():
            if not tag.startswith("_"):
                points.setdefault(tag, []).append((row["_step"], float(value)))
    return points


def by_record_order(points, want):
    """W&B merges the values of one step into one row: compare per tag in the record's step order."""
    return {tag: sorted(values, key=lambda p: p[0]) for tag, values in points.items()}, \
        {tag: sorted(values, key=lambda p: p[0]) for tag, values in want.items()}


@pytest.fixture(autouse=True, scope="module")
def offline():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("WANDB_DIR", raising=False)
        patch.delenv("WANDB_PROJECT", raising=False)
        yield


@pytest.mark.slow
def test_live_run_reads_back_exactly_with_the_identity(builtin_data_dir, tmp_path):
    run = live_run(builtin_data_dir, tmp_path / "run", ["wandb"])
    sessions = read_runs(run)
    assert len(sessions) == 1 and sessions[0]["run_id"] == identity(run)["run_id"]
    got, want = by_record_order(history(sessions), expected(run))
    assert same(got, want)
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4] and [s for s, _ in got["val/loss"]] == [2, 4]
    assert {k: sessions[0]["config"][k] for k in identity(run)} == identity(run)
    assert sessions[0]["config"]["recipe/train/max_steps"] == 4


def test_resume_rewinds_so_rolled_back_steps_show_once(tmp_path):
    run = crashed_run(tmp_path / "run")
    # W&B names an offline session's folder by the second
    mirror_session_by_session(run, ["wandb"], pause=1.1)
    sessions = read_runs(run)
    assert len(sessions) == 2 and (sessions[1]["config"]["_wandb"]["branch_point"] ==
                                   {"run_id": "synthetic-run", "step": 20})
    got, want = by_record_order(history(sessions), expected(run))
    assert same(got, want)
    steps = [s for s, _ in got["train/loss"]]
    assert len(steps) == len(set(steps)) and set(ROLLED_BACK) & set(steps)


def test_export_metrics_sends_the_kept_history_the_verdict_and_the_report(tmp_path, capsys):
    run = crashed_run(tmp_path / "run")
    write_verdict(run)
    assert main(["export-metrics", str(run), "--to", "wandb"]) == 0
    assert "wandb:" in capsys.readouterr().out
    (session,) = read_runs(run)
    got, want = by_record_order(history([session]), expected(run))
    assert same(got, want)
    assert session["summary"]["verdict/decision"] == "GO" and session["summary"]["verdict/go"] == 1.0
    assert session["summary"]["verdict/loss_decreasing/figure"] == 0.25
    assert session["summary"]["verdict/loss_decreasing/status"] == "PASS"
    assert session["artifacts"] == [("report", ["loss.png", "report.html", "summary.json"])]
    assert not math.isnan(got["train/loss"][0][1])


def test_exporting_onto_a_full_disk_exits_2_and_leaves_run_wandb_as_it_was(tmp_path, capsys, monkeypatch):
    """ENOSPC at W&B's write midway through the export: exit 2, one line naming the tracker and RUN/wandb, and
    RUN/wandb as before the export: absent where the export made it, the earlier export's files alone where
    there was one (the new offline run removed, the latest-run link pointed back)."""
    from pilotrun.run.tracker_wandb import WandbSink
    from tests.run.tracker_runs import full_disk_after, tree

    run = crashed_run(tmp_path / "run")
    with monkeypatch.context() as patch:
        full_disk_after(WandbSink, "log", 10, patch)
        assert main(["export-metrics", str(run), "--to", "wandb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"pilotrun: error: export-metrics --to wandb: writing {run / 'wandb'} "
        "failed (No space left on device); nothing of this export was kept"
    )
    assert not (run / "wandb").exists()
    assert main(["export-metrics", str(run), "--to", "wandb"]) == 0
    before = tree(run / "wandb")
    capsys.readouterr()
    with monkeypatch.context() as patch:
        full_disk_after(WandbSink, "log", 10, patch)
        assert main(["export-metrics", str(run), "--to", "wandb"]) == 2
    after = tree(run / "wandb")
    # The paths and links as before; the earlier run's own logs may still be closing (W&B's service writes
    # them).
    assert sorted(after) == sorted(before)
    assert {k: v for k, v in after.items() if isinstance(v, tuple)} == {
        k: v for k, v in before.items() if isinstance(v, tuple)}
    (session,) = read_runs(run)
    assert same(*by_record_order(history([session]), expected(run)))
