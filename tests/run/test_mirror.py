"""pilotrun/run/mirror.py: the identity every tracker gets, the verdict's figures, the report's files and the
kept history, read from a run folder."""

from __future__ import annotations

from pilotrun.common.files import canonical_sha256
from pilotrun.run.mirror import kept_history, read_identity, read_verdict, report_files, resume_step
from pilotrun.run.record import read_metrics_strict, read_run_json
from tests.run.tracker_runs import ROLLED_BACK, crashed_run, write_verdict


def test_identity_verdict_and_report_files(tmp_path):
    run = crashed_run(tmp_path / "run")
    identity = read_identity(run)
    assert identity["run_id"] == "synthetic-run" and identity["sessions"] == 2
    assert identity["recipe_sha256"] == canonical_sha256(read_run_json(run)["recipe"])
    assert read_verdict(run) is None and report_files(run) == []
    write_verdict(run)
    verdict = read_verdict(run)
    assert verdict["decision"] == "GO" and verdict["status"]["verdict/resume_exact/status"] == "PASS"
    assert verdict["scalars"] == {"verdict/go": 1.0, "verdict/loss_decreasing/figure": 0.25,
                                  "verdict/loss_decreasing/threshold": 0.05}
    assert [p.name for p in report_files(run)] == ["loss.png", "report.html", "summary.json"]


def test_kept_history_matches_summarize(tmp_path):
    from pilotrun.report.record_check.summarize import summarize_run

    run = crashed_run(tmp_path / "run")
    events = read_metrics_strict(run)
    assert [resume_step(e) for e in events if e["event"] == "session_start"] == [None, 20]
    kept = [
        (e["event"], e["step"], e.get("loss")) for e in kept_history(events) if e["event"] in ("train", "val")
    ]
    summary = [(e["event"], e["step"], e.get("loss")) for e in summarize_run(run).kept_events
               if e["event"] in ("train", "val")]
    assert kept == summary
    assert len([s for _, s, _ in kept]) == len({(k, s) for k, s, _ in kept}) and {
        s for _, s, _ in kept
    } & set(ROLLED_BACK)
