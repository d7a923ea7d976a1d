"""`pilotrun freeze`: judge a pilot and write its candidate's lock (the format lives in pilotrun/run/lock.py).

After a GO (or with `--despite-no-go`, recorded in the lock) the lock holds:
- the effective recipe (run.json's, the one in force at the pilot's end) and the changes made on resume;
- the data identity (metadata_sha256), tokens per update;
- the code identity (git commit, dirty flag, diff hash) and software of the pilot's last kept session;
- the verdict: decision, statement, every rule with its figure, threshold and evidence, the thresholds;
- `sha256` over everything else, so the lock identifies itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pilotrun.files import canonical_sha256
from pilotrun.report.verdict import judge
from pilotrun.run.changes import recipe_changes_in_history
from pilotrun.run.lock import LOCK_FORMAT, FreezeError, write_lock


def build_lock(verdict: Any, despite_no_go: bool) -> dict[str, Any]:
    """The lock of a judged pilot (a `pilotrun.report.verdict.Verdict`), its `sha256` included."""
    summary = verdict.summary
    run = summary.run
    sessions = {str(s.get("session_id")): s for s in run.get("sessions") or [] if isinstance(s, dict)}
    last = sessions.get(summary.lineage[-1], {}) if summary.lineage else {}
    recipe = run.get("recipe")
    data = run.get("data") or {}
    hardware = last.get("hardware") or {}
    lock: dict[str, Any] = {
        "format": LOCK_FORMAT,
        "pilot": {"run_id": run.get("run_id"), "run_dir": str(Path(summary.run_dir).resolve()),
                  "final_step": summary.overall.get("updates_applied"),
                  "tokens_seen": summary.overall.get("tokens_seen")},
        "decision": verdict.decision,
        "despite_no_go": bool(despite_no_go and verdict.decision != "GO"),
        "recipe": recipe,
        "recipe_sha256": canonical_sha256(recipe),
        "recipe_changes": [dataclasses.asdict(c) for c in recipe_changes_in_history(run, summary.lineage)],
        "tokens_per_update": run.get("tokens_per_update"),
        "data": {"metadata_sha256": (data.get("train") or {}).get("metadata_sha256"), "source": data.get("source"),
                 "tokenizer": data.get("tokenizer"), "train_tokens": (data.get("train") or {}).get("tokens")},
        "code": last.get("git"),
        "software": last.get("software"),
        "hardware": {k: hardware.get(k) for k in ("device", "device_name", "world_size")},
        "verdict": {"decision": verdict.decision, "statement": verdict.statement,
                    "rules": [dataclasses.asdict(r) for r in verdict.rules],
                    "thresholds": dataclasses.asdict(verdict.thresholds)},
    }
    lock["sha256"] = canonical_sha256(lock)
    return lock


def freeze_run(run_dir: str | Path, out: str | Path, despite_no_go: bool = False,
               thresholds: Any = None) -> tuple[int, dict[str, Any], Any]:
    """Judge the pilot and write its lock: (0, lock, verdict) written; (1, lock, verdict) NO-GO without
    `despite_no_go`, nothing written. An existing --out is refused before anything is judged."""
    out = Path(out)
    if out.exists():
        raise FreezeError(f"--out {out}: already exists; a lock is never overwritten (choose another path)")
    if not out.parent.is_dir():
        raise FreezeError(f"--out {out}: folder {out.parent} does not exist")
    verdict = judge(run_dir, thresholds)
    if verdict.summary.run.get("recipe") is None:
        raise FreezeError(f"{run_dir}: run.json has no recipe to freeze")
    lock = build_lock(verdict, despite_no_go)
    if verdict.decision != "GO" and not despite_no_go:
        return 1, lock, verdict
    write_lock(out, lock)
    return 0, lock, verdict
