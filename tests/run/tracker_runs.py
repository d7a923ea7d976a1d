"""The runs the tracker tests mirror, and what each tracker must read back: a short real run (the trainer with
`tracker_sinks` as its sinks), and a synthetic run that crashed after step 33 and resumed from its checkpoint
at 20 (steps 21-33 rolled back and redone), mirrored session by session as the trainer would, or exported."""

from __future__ import annotations

import math
import time
from pathlib import Path

from pilotrun.common.files import canonical_sha256
from pilotrun.config import load_run_config
from pilotrun.run.mirror import MIRRORED_EVENTS, kept_history, scalar_fields
from pilotrun.run.record import read_metrics_strict, read_run_json
from pilotrun.run.sinks import tracker_sinks
from tests.report.synthetic import SyntheticRun

ROOT = Path(__file__).resolve().parents[2]
ROLLED_BACK = range(21, 34)


def live_run(data_dir: Path, run_dir: Path, names: list[str]) -> Path:
    """Four steps of the smoke recipe (val and checkpoint at 2 and 4), mirrored live into `names` as the
    recipe's `train.trackers` asks (the trainer opens them)."""
    from pilotrun.training.trainer import Trainer

    config = load_run_config(
        ROOT / "configs" / "smoke.yaml",
        [
            "train.num_threads=1",
            "train.max_steps=4",
            "train.eval_every=2",
            "train.checkpoint_every=2",
            f"train.trackers=[{', '.join(names)}]",
        ],
    )
    result = Trainer(config, data_dir, run_dir, progress=False).run()
    assert result.exit_code == 0
    return run_dir


def crashed_run(run_dir: Path) -> Path:
    """Trains to 33 (checkpoint at 20), is killed, resumes from 20 and finishes at 60; the redone steps get
    other losses than the rolled-back ones, so that a reader showing the wrong one is caught."""
    run = SyntheticRun(run_dir)
    run.start_session()
    run.train_until(33)
    run.kill()
    run.resume()
    run.loss = lambda step: 1.0 + 1.0 / (3.0 + step)
    run.val_loss = lambda step: 1.5 + 1.0 / (7.0 + step)
    run.train_until(run.max_steps)
    run.end_session()
    run.write()
    return run_dir


def mirror_session_by_session(run_dir: Path, names: list[str], pause: float = 0.0) -> None:
    """What the trainer does for each session: fresh sinks, every event of that session, close; `pause`
    seconds between sessions (real sessions are far apart; a tracker may name a session by the second)."""
    events = read_metrics_strict(run_dir)
    sessions: dict[str, list[dict]] = {}
    for event in events:
        sessions.setdefault(event["session_id"], []).append(event)
    for index, session_events in enumerate(sessions.values()):
        if index:
            time.sleep(pause)
        sinks = tracker_sinks(names, run_dir)
        for event in session_events:
            for sink in sinks:
                sink.write(event)
        for sink in sinks:
            sink.close()
            assert sink.failure is None, sink.failure


def expected(run_dir: Path, kept: bool = True) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in record order: the kept history (each step once) or every point logged."""
    events = read_metrics_strict(run_dir)
    chosen = kept_history(events) if kept else [e for e in events if e["event"] in MIRRORED_EVENTS]
    out: dict[str, list[tuple[int, float]]] = {}
    for event in chosen:
        for tag, value in scalar_fields(event):
            out.setdefault(tag, []).append((event["step"], value))
    return out


def identity(run_dir: Path) -> dict[str, str]:
    run = read_run_json(run_dir)
    return {"run_id": run["run_id"], "recipe_sha256": canonical_sha256(run["recipe"]),
            "data_metadata_sha256": run["data"]["metadata_sha256"],
            "git_commit": str((run["sessions"][-1].get("git") or {}).get("commit"))}


def same(a: dict, b: dict) -> bool:
    """Exact equality of two tag -> [(step, value)] maps, NaN equal to NaN."""
    if a.keys() != b.keys():
        return False
    return all(len(a[t]) == len(b[t]) and all(sa == sb and (va == vb or (math.isnan(va) and math.isnan(vb)))
                                              for (sa, va), (sb, vb) in zip(a[t], b[t])) for t in a)


def write_verdict(run_dir: Path) -> dict:
    """RUN/report/ as `pilotrun verdict` leaves it (summary.json, report.html, a plot)."""
    import json

    report = run_dir / "report"
    report.mkdir(exist_ok=True)
    summary = {"decision": "GO", "statement": "the pilot shows what a long run needs",
               "rules": [{"name": "loss_decreasing", "status": "PASS", "figure": 0.25, "threshold": 0.05,
                          "evidence": "x"},
                         {"name": "resume_exact", "status": "PASS", "figure": None, "threshold": None,
                          "evidence": "y"}]}
    (report / "summary.json").write_text(json.dumps(summary))
    (report / "report.html").write_text("<html><body>GO</body></html>")
    (report / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return summary


def tree(folder: Path) -> dict[str, object] | None:
    """Every path under `folder` with its bytes (a link: where it points), or None where there is no
    folder."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (("link", str(p.readlink())) if p.is_symlink() else
                                         p.read_bytes() if p.is_file() else "folder")
            for p in sorted(folder.rglob("*"))}


def full_disk_after(cls, method: str, calls: int, monkeypatch) -> None:
    """`cls.method` (a tracker's write) raises ENOSPC, as a full disk does, from its `calls`-th call on."""
    import errno

    real, done = getattr(cls, method), []

    def filling(self, *args, **kwargs):
        if len(done) >= calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        done.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, filling)
