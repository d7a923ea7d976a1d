"""pilotrun/run/tracker_trackio.py on trackio's local store (TRACKIO_DIR), read back with trackio's own
storage API: metrics equal metrics.jsonl's values exactly, the identity in the run's config, one trackio run
for all sessions with the kept value last at each rolled-back step; export-metrics sends each step once, with
the verdict and the report as an artifact."""

from __future__ import annotations

import os
import sys
import tempfile

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

# trackio reads TRACKIO_DIR once, when it is first imported: point it at a folder of this test module first.
if "trackio" not in sys.modules:
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="pilotrun-trackio-")
trackio = pytest.importorskip("trackio")


def read(project: str, name: str, latest_per_step: bool = False) -> dict[str, list[tuple[int, float]]]:
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[str, list[tuple[int, float]]] = {}
    rows = SQLiteStorage.get_logs(project, name)
    if latest_per_step:  # rows come in the order they were logged: the last one of a step is its latest
        rows = list({row["step"]: row for row in rows}.values())
    for row in sorted(rows, key=lambda r: r["step"]):
        for tag, value in row.items():
            if tag not in ("step", "timestamp") and not tag.startswith("_"):
                out.setdefault(tag, []).append((row["step"], float(value)))
    return out


def config(project: str, name: str) -> dict:
    (run,) = [r for r in trackio.Api().runs(project) if r.name == name]
    return run.config


def step_order(points):
    return {tag: sorted(values, key=lambda p: p[0]) for tag, values in points.items()}


@pytest.mark.slow
def test_live_run_reads_back_exactly_with_the_identity(builtin_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_PROJECT", "pilotrun-live")
    run_dir = live_run(builtin_data_dir, tmp_path / "run", ["trackio"])
    name = identity(run_dir)["run_id"]
    got = read("pilotrun-live", name)
    assert same(got, step_order(expected(run_dir)))
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]
    assert {k: config("pilotrun-live", name)[k] for k in identity(run_dir)} == identity(run_dir)


def test_sessions_are_one_run_and_the_kept_value_is_each_steps_latest(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_PROJECT", "pilotrun-resumed")
    run_dir = crashed_run(tmp_path / "run")
    mirror_session_by_session(run_dir, ["trackio"])
    assert [r.name for r in trackio.Api().runs("pilotrun-resumed")] == ["synthetic-run"]
    assert same(read("pilotrun-resumed", "synthetic-run"), step_order(expected(run_dir, kept=False)))
    latest = read("pilotrun-resumed", "synthetic-run", latest_per_step=True)
    assert same(latest, step_order(expected(run_dir)))
    assert set(ROLLED_BACK) & {s for s, _ in latest["train/loss"]}
    assert config("pilotrun-resumed", "synthetic-run")["resumed_at_step"] == 20


def test_export_metrics_sends_each_step_once_with_the_verdict_and_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_PROJECT", "pilotrun-export")
    run_dir = crashed_run(tmp_path / "run")
    write_verdict(run_dir)
    assert main(["export-metrics", str(run_dir), "--to", "trackio"]) == 0
    got = read("pilotrun-export", "synthetic-run")
    assert got.pop("verdict/go") == [(60, 1.0)] and got.pop("verdict/loss_decreasing/figure") == [(60, 0.25)]
    assert got.pop("verdict/loss_decreasing/threshold") == [(60, 0.05)]
    assert same(got, step_order(expected(run_dir)))
    settings = config("pilotrun-export", "synthetic-run")
    assert settings["verdict/decision"] == "GO" and settings["verdict/loss_decreasing/status"] == "PASS"
    assert settings["run_id"] == "synthetic-run"


def test_exporting_onto_a_full_disk_exits_2_naming_the_store_and_removes_a_run_it_created(tmp_path, capsys,
                                                                                       monkeypatch):
    """ENOSPC at trackio's write midway through the export: exit 2 with one line naming the tracker and the
    project's database in TRACKIO_DIR. trackio's store is not a place pilotrun chose, but a run the export
    created there is removed (trackio's own call); a run that was there before keeps what was sent, and the
    line says so."""
    from trackio.sqlite_storage import SQLiteStorage

    from pilotrun.run.tracker_trackio import TrackioSink
    from tests.run.tracker_runs import full_disk_after

    monkeypatch.setenv("TRACKIO_PROJECT", "pilotrun-full-disk")
    run_dir = crashed_run(tmp_path / "run")
    database = SQLiteStorage.get_project_db_path("pilotrun-full-disk")
    with monkeypatch.context() as patch:
        full_disk_after(TrackioSink, "flush", 10, patch)
        assert main(["export-metrics", str(run_dir), "--to", "trackio"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"pilotrun: error: export-metrics --to trackio: writing {database} failed (No space left on "
        "device); nothing of this export was kept (the trackio run synthetic-run it created removed)"
    ]
    assert SQLiteStorage.get_runs("pilotrun-full-disk") == []
    assert main(["export-metrics", str(run_dir), "--to", "trackio"]) == 0
    capsys.readouterr()
    with monkeypatch.context() as patch:
        full_disk_after(TrackioSink, "flush", 10, patch)
        assert main(["export-metrics", str(run_dir), "--to", "trackio"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(
        f"what it sent before stays in {database}, the tracker's own store (not a place pilotrun chose)"
    )
    assert SQLiteStorage.get_runs("pilotrun-full-disk") == ["synthetic-run"]
