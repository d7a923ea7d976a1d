"""`pilotrun watch RUN [--against LOCK] [--follow] [--stop-at-alert] [--on-alert CMD] [--json] [--interval S]`
(and `--stall-windows`, `--threshold`).

Reads a run as it grows and prints its alerts (pilotrun/report/watch/alerts.py); the run folder is opened once
(pilotrun/run/run_folder.py) and its record read through pilotrun/run/follow.py, which only opens files for
reading, and whether a session is live is read from /proc/locks (pilotrun.run.folder_lock.live_holder), so
watch never writes into the run folder and never takes its lock. A note (on stderr, said once, never an alert)
names a resume across which bit-exact continuation is not promised (run.json's `not_exact`: the update it
applies from and the change). `--on-alert CMD` runs CMD (through the shell, in watch's own working folder,
never the run's) once per alert with the alert as JSON on its stdin.

With --follow it waits for a run still starting (its folder or run.json not written yet: said once) and
watches until the run completes; an alert is a line and an --on-alert call, and watching goes on (a warm-up
alert that clears long before the end is no reason to stop watching). `--stop-at-alert` ends it at the first
alert instead (exit 1); `--keep-going` names the default.

Exit codes: without --follow, one look: 0 when no alert stands, 1 when one does. With --follow, at the
run's end: 0 when every alert raised has cleared by then (a stall that ended, a rule that passes again),
else 1; with --stop-at-alert, 1 at the first alert. A folder that is not a run, or a lock for another run's
recipe, is bad input: one line, exit 2.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pilotrun.common.errors import PilotrunError
from pilotrun.common.parsing import one_line, terminal_safe
from pilotrun.report.projection.ledger import format_against
from pilotrun.report.verdict.thresholds import parse_thresholds
from pilotrun.report.watch.alerts import DEFAULT_STALL_WINDOWS, Alert, Watcher, thresholds_from_lock
from pilotrun.run.recipe_lock import FreezeError, describe_difference, load_lock, lock_differences
from pilotrun.run.record import RUN_JSON
from pilotrun.run.run_folder import RunFolder

ON_ALERT_TIMEOUT_SECONDS = 60.0


def check_lock_matches(
    run: RunFolder | str | Path, lock_path: str | Path
) -> tuple[dict[str, Any], RunFolder]:
    """(the lock, the run folder opened) when the run runs the lock's recipe: started from that very lock, or
    with the same recipe and data (the keys the run was allowed to change left aside). Anything else is
    FreezeError (exit 2). The lock is read first, so that a bad lock is named before the run."""
    lock = load_lock(lock_path)
    folder = RunFolder.of(run)
    run_dir, run = folder.path, folder.run
    frozen = run.get("frozen") if isinstance(run.get("frozen"), dict) else {}
    if frozen.get("lock_sha256") == lock["sha256"]:
        return lock, folder
    if frozen.get("lock_sha256"):
        raise FreezeError(f"--against {lock_path}: {run_dir} was started from another lock "
                          f"(sha256 {str(frozen['lock_sha256'])[:16]}, this one {lock['sha256'][:16]})")
    data_sha = ((run.get("data") or {}).get("train") or {}).get("metadata_sha256")
    allowed = {str(c.get("key")) for c in run.get("allowed_changes") or [] if isinstance(c, dict)}
    differences = [
        d
        for d in lock_differences(
            lock["recipe"],
            lock["data"]["metadata_sha256"],
            run.get("recipe") or {},
            data_sha,
            lock_mixture=lock["data"].get("mixture"),
            mixture=(run.get("data") or {}).get("mixture"),
        )
        if d["key"] not in allowed
    ]
    if differences:
        shown = "; ".join(describe_difference(d) for d in differences[:3])
        raise FreezeError(f"--against {lock_path}: the lock is for another recipe than {run_dir}'s: "
                          f"{len(differences)} difference(s): {shown}")
    return lock, folder


def run_on_alert(command: str, payload: str) -> int:
    """The --on-alert command's exit code, the alert on its stdin. It runs in a process group of its own, so
    that at its timeout the whole group is stopped: stopping the shell alone left what it started running
    after watch had said it was stopped (and after watch itself had exited)."""
    process = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE, text=True, start_new_session=True)
    try:
        process.communicate(payload, timeout=ON_ALERT_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return process.returncode


def _deliver(alert: Alert, as_json: bool, on_alert: str | None) -> None:
    # A message quotes the record (a session id, a spike's cause): escaped, so that the record cannot drive
    # the terminal.
    print(alert.to_json() if as_json else one_line(f"ALERT {alert.kind}: {alert.message}"), flush=True)
    if on_alert:
        try:
            returncode = run_on_alert(on_alert, alert.to_json() + "\n")
            if returncode != 0:
                print(
                    terminal_safe(
                        f"pilotrun watch: --on-alert command {on_alert!r} exited {returncode} for "
                        f"the {alert.kind} alert; watch goes on"
                    ),
                    file=sys.stderr,
                )
        except subprocess.TimeoutExpired:
            print(
                terminal_safe(
                    f"pilotrun watch: --on-alert command {on_alert!r} did not finish within "
                    f"{ON_ALERT_TIMEOUT_SECONDS:g} s for the {alert.kind} alert at step {alert.step}: "
                    "it was stopped; watch goes on"
                ),
                file=sys.stderr,
                flush=True,
            )
        except OSError as exc:
            print(
                terminal_safe(
                    f"pilotrun watch: --on-alert command {on_alert!r} could not be run for the "
                    f"{alert.kind} alert ({exc.strerror or exc}); watch goes on"
                ),
                file=sys.stderr,
                flush=True,
            )


def _say_against_projection(watcher: Watcher) -> None:
    """A run started from a lock with a projection: elapsed, goodput and tok/s beside it, and the band."""
    line = format_against(watcher.against_projection)
    if line is not None:
        print(terminal_safe(line), file=sys.stderr, flush=True)


def status_line(watcher: Watcher) -> str:
    """One look's answer to "how is it doing": the newest window's step and loss, this session's wall-clock
    rate and ETA (the pilot's progress figures), whether a session holds the run now, and the rules still
    waiting for the evidence they read (alerts.py: not judged yet, not failed)."""
    from pilotrun.commands.child_progress import format_progress, progress_figures

    max_steps = watcher.max_steps or 0
    figures = progress_figures(watcher.events, max_steps)
    state = (
        "completed"
        if watcher.completed
        else "live: a session holds the run"
        if watcher.holder(watcher.run_dir) is not None
        else "no session running"
    )
    shown = format_progress(figures, max_steps) if figures else "no train window yet"
    waiting = "; ".join(f"{name} (for {what})" for name, what in watcher.waiting.items())
    return (f"status: {shown} ({state}; {len(watcher.active)} alert(s) standing)"
            + (f"; rules waiting for their evidence, not failed: {waiting}" if waiting else ""))


MAX_INTERVAL = 86400.0  # seconds between looks, at most
START_POLL_SECONDS = 1.0  # between looks for a run still starting


def wait_for_start(run_dir: str | Path, interval: float | None) -> None:
    """--follow of a run still starting: `train` writes its folder and run.json after its set-up (a
    scheduler's job may not have started at all), so until run.json is there watch waits, saying so once. A
    path that is a file is bad input at once (RunFolder names it)."""
    path = Path(run_dir) / RUN_JSON
    said = False
    while not path.is_file() and not Path(run_dir).is_file():
        if not said:
            print(one_line(f"waiting for {run_dir} to start: no {RUN_JSON} yet"), file=sys.stderr, flush=True)
            said = True
        time.sleep(interval if interval is not None else START_POLL_SECONDS)


def watch_run(run_dir: str | Path, against: str | Path | None = None, follow: bool = False,
              keep_going: bool = True, on_alert: str | None = None, as_json: bool = False,
              interval: float | None = None, stall_windows: float | None = None,
              thresholds: list[str] | tuple[str, ...] = (), watcher: Watcher | None = None) -> int:
    """Watch once, or follow (module docstring); `thresholds` are NAME=VALUE overrides of the rules'
    thresholds, over the lock's (the pilot's) or the defaults."""
    for flag, value in (("--interval", interval), ("--stall-windows", stall_windows)):
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise PilotrunError(f"{flag} {value}: must be a positive number")
    if interval is not None and interval > MAX_INTERVAL:
        # A sleep the OS cannot take (1e308 s overflows it) or a watch that looks once a year watches nothing.
        raise PilotrunError(f"--interval {interval:g}: at most {MAX_INTERVAL:g} s (a day) between looks")
    stall_windows = stall_windows or DEFAULT_STALL_WINDOWS
    if follow and watcher is None:
        wait_for_start(run_dir, interval)
    lock, folder = check_lock_matches(run_dir, against) if against is not None else (None, None)
    held = parse_thresholds(list(thresholds), thresholds_from_lock(lock))
    watcher = watcher or Watcher(
        folder if folder is not None else run_dir, lock, stall_windows=stall_windows, thresholds=held
    )
    print(
        f"watching {run_dir}" + (f" against {against}" if against else "") + f"; stall after {stall_windows} "
        "window intervals",
        file=sys.stderr,
        flush=True,
    )
    while True:
        new, cleared = watcher.check(final=not follow)
        for note in watcher.new_notes():
            print(one_line(note), file=sys.stderr, flush=True)
        for alert in new:
            _deliver(alert, as_json, on_alert)
        for alert in cleared:
            print(one_line(f"cleared {alert.kind}: {alert.key}"), file=sys.stderr, flush=True)
        if not follow:
            _say_against_projection(watcher)
            print(one_line(status_line(watcher)), file=sys.stderr, flush=True)
            return 1 if watcher.active else 0
        if new and not keep_going:
            return 1
        if watcher.completed:
            new, _ = watcher.check(final=True)  # the last rules' judgement on the finished record
            for alert in new:
                _deliver(alert, as_json, on_alert)
            if new and not keep_going:
                return 1
            _say_against_projection(watcher)
            print(
                f"completed: {run_dir}"
                + (
                    f"; {len(watcher.raised)} alert(s) raised, {len(watcher.active)} still standing"
                    if watcher.raised
                    else ""
                ),
                file=sys.stderr,
                flush=True,
            )
            # the one look's line at the end too: where it stands, what still waits
            print(one_line(status_line(watcher)), file=sys.stderr, flush=True)
            return 1 if watcher.active else 0
        window, _ = watcher.window_interval()
        time.sleep(interval if interval is not None else min(5.0, max(0.05, window / 5)) if window else 0.5)
