"""What `pilotrun watch` alerts on, judged on a run record as it grows (the reader is pilotrun/run/follow.py,
on the run folder's one reader, pilotrun/run/run_folder.py: the rules are judged on the bytes the follower
read).

Each alert names its kind, the step, the figure and the bound it broke, and has a key: it is raised once,
stays standing while its condition holds and clears when it no longer does (a stall clears when the run writes
again, a rule when it passes again, a killed session when a resume starts). The kinds:
- `chain`: a line whose hash chain does not follow, or an unreadable line (never clears);
- `stall`: no line for more than K window intervals while a session holds the run folder. The interval is the
  run's own: the median seconds between consecutive train lines of a session (the lock's pilot figure until
  the run has two); K and the interval are stated. A checkpoint or evaluation due after the last line adds the
  longest one seen so far, and a session not yet at its first window the longest start-up seen so far, since
  the trainer writes nothing while it does those;
- `throughput`: a steady window's training-only tokens/s below the pilot's band (the lock's `watch` figures);
  on CUDA also its tokens per device second (key `throughput_device`), below the pilot's per-device band: the
  device itself got slower (clocks, a neighbour on the GPU), not the host feeding it;
- `machine_busier` (key `throughput_busy`): a window below the throughput band while the process got less than
  min_cpu_share_ratio of the pilot's CPU seconds per training second (the lock's `cpu_share`), or a smaller
  share with each CPU second still doing the band's work (tokens per CPU second at least the band's low over
  the pilot's share): other load took the machine; the `throughput` alert is kept for a recipe that does less
  per CPU second;
- `loss_spike`: a window's loss that is a spike of the previous windows of the kept history, as the verdict's
  grad_spikes rule judges the gradient norm (pilotrun/training/spikes/bound.py, over logged windows: the
  thresholds spike_factor, spike_median_window and spike_min_history, the loss's floor share);
- `loss_envelope`: a window's loss above the pilot's loss at that step plus its tolerance (the lock's
  envelope);
- `forecast`: past the pilot's reach, validation losses outside the band of the lock's forecast, two
  evaluations in a row (forecast_watch.py); a run the forecast does not apply to hears so once, as a note;
- `forecast_change` (key `forecast_change:SESSION`): a resume that changed what the lock's forecast assumed (a
  recipe key, a mixture's weights; never a cadence, the length or a machine key: forecast_changes.py), raised
  once at the first evaluation after it, naming each key old -> new and the update it took effect from: the
  forecast is a reference from there, the run still held to it. It stands while the run keeps that session's
  updates on the changed recipe, and clears at the first evaluation of a resume from before it that does not
  make the same change again;
- `rule`: one of the verdict's rules that apply to a run in progress FAILs, judged by the rule table itself
  (rules.py) on summarize's view of the record, with the lock's thresholds when one is given; each rule is
  judged only once the kept history holds the evidence the rule states it needs (its `needs`: a train window,
  an applied update, windows past the warm-up, two evaluations, ...): a rule the run has not reached yet is
  waiting (`Watcher.waiting`, shown in watch's status line), not failed;
- `spike` / `rollback`: each spike the trainer detected (with its action and cause) and each rollback
  (restored step, data skipped), raised once per event (so --on-alert hears of each) and cleared by the next
  train window; a resumed session's redo of a spike or rollback already raised (the same attempt,
  report/record_check/spike_history.py) is not raised again, so that an interrupted run alerts as the
  uninterrupted one does;
- `downstream`: an in-loop task (report/verdict/downstream.py) that had risen clear of chance is back near it,
  or, against a lock, below the pilot's figure on the same task file at or past the pilot's step; cleared when
  it is not;
- `hung`: a session the hang watchdog ended (reason `hung`: no progress on some rank past its bound, every
  thread's stack in RUN/hangs/), or one a later session's start found hung (`hang_found`: rank 0 was the stuck
  one and recorded no ending), raised once per such session (so --on-alert hears of each, also when torchrun
  or the requeue restarts it at once) and cleared by the next train window;
- `restarts`: the run's interruptions (interrupted, hung, error, killed sessions: interruptions.py) are more
  than the lock's MTBF makes likely (`freeze --mtbf`; the lock given, else the one the run was started from):
  P(at least as many in the elapsed time) below 1%, judged with the rules; cleared when no longer so;
- `session_end`: the last session ended in error, stopped on skips, was interrupted or killed, and no session
  holds the folder (no resume started). A completed session at its max_steps ends the watch.

Besides the alerts, a note (`Watcher.new_notes`, said once, no alert: the run is not at fault): a resumed
session whose run.json entry records `not_exact` (a changed thread count, numerics library or device) is not
promised bit-exact continuation from the update named there, and the note says which change is why.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.common.strict_json import strict_dumps
from pilotrun.config import recorded_value
from pilotrun.report.projection.long_run import (
    window_cpu_share,
    window_tokens_per_device_second,
    window_tokens_per_s,
)
from pilotrun.report.record_check.interruptions import FASTER_P, against_mtbf, mtbf_of
from pilotrun.report.record_check.spike_history import named_skip, rollback_key, spike_key
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.record_check.time_split import window_profiled
from pilotrun.report.verdict.continuity import not_exact_sessions
from pilotrun.report.verdict.downstream import below_pilot_problem, fallback_problem, task_series
from pilotrun.report.verdict.rules import live_rules
from pilotrun.report.verdict.thresholds import FAIL, THRESHOLD_FIELDS, Thresholds
from pilotrun.report.watch.forecast_watch import ForecastWatch
from pilotrun.run.folder_lock import live_holder
from pilotrun.run.follow import RecordFollower
from pilotrun.run.recipe_lock import PROJECTION_KEY, lock_projection_of
from pilotrun.run.record import is_finite_number
from pilotrun.run.run_folder import RunFolder
from pilotrun.training.spikes.bound import MIN_SCALE_SHARE, spike_against, step_spread

DEFAULT_STALL_WINDOWS = 3.0
INTERVAL_HISTORY = 20  # recent train-to-train gaps the window interval is the median of
# The live rules watch leaves to others: record_valid is the chain alert's (a run.json rewritten for a session
# whose first line is not written yet reads as edited for an instant); loss_decreased, val_tracks_train and
# throughput_steady judge a whole pilot's trajectory, which the envelope, spike and band alerts do for a live
# one; spikes is said event by event by the spike and rollback alerts.
UNWATCHED_RULES = ("record_valid", "loss_decreased", "val_tracks_train", "throughput_steady", "spikes")


@dataclass
class Alert:
    kind: str
    key: str
    message: str
    step: int | None = None
    figure: Any = None
    bound: Any = None
    session_id: str | None = None
    time: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        # An infinite figure (a loss that overflowed) is said as a string: bare Infinity is not JSON.
        return strict_dumps(dataclasses.asdict(self), sort_keys=True, default=str)


def thresholds_from_lock(lock: dict[str, Any] | None) -> Thresholds:
    given = ((lock or {}).get("verdict") or {}).get("thresholds") or {}
    names = {f.name for f in THRESHOLD_FIELDS}
    return Thresholds(**{k: v for k, v in given.items() if k in names})


def envelope_bound(envelope: dict[str, Any], step: int) -> float | None:
    """The pilot's loss at `step` (linear between its windows; its last windows' median past its end) plus the
    tolerance (report/projection/long_run.py)."""
    points = envelope.get("points") or []
    if not points:
        return None
    if step >= points[-1][0]:
        base = statistics.median(p[1] for p in points[-3:])
    elif step <= points[0][0]:
        base = points[0][1]
    else:
        for (s0, l0), (s1, l1) in zip(points, points[1:], strict=False):
            if s0 <= step <= s1:
                base = l0 + (l1 - l0) * (step - s0) / (s1 - s0) if s1 > s0 else l1
                break
    return base + max(
        envelope.get("sigmas", 0) * envelope.get("noise", 0), envelope.get("share", 0) * abs(base)
    )


def busier(rate: float, share: float | None, low: float, pilot_share: Any, ratio: float) -> bool:
    """A window below the band whose process got less of the CPU than the pilot: its share fell below `ratio`
    of the pilot's, or its tokens per CPU second are still those of the band (at least its low over the
    pilot's share), so that the rate fell with the share alone. A recipe that got slower does less per CPU
    second."""
    if not is_finite_number(pilot_share) or pilot_share <= 0 or share is None or share <= 0:
        return False
    return share < ratio * pilot_share or rate / share >= low / pilot_share


def hang_found_alert(event: dict[str, Any], now: float) -> Alert:
    """A session whose stuck rank 0 recorded no ending, found hung by a later session's start."""
    hung, sid = event["hung_session"], event.get("session_id")
    return Alert("hung", f"hung:{hung}",
                 f"session {hung} hung (no session_end: rank {event.get('rank')} wrote its stacks, "
                 f"{event.get('stack_file')}; found by session {sid}'s start)",
                 event.get("step"), "hung", "progress within the hang bound", sid, now)


class Watcher:
    """Follows one run folder; `check()` returns the alerts raised and cleared since the previous call."""

    def __init__(self, run: RunFolder | str | Path, lock: dict[str, Any] | None = None,
                 stall_windows: float = DEFAULT_STALL_WINDOWS, clock: Callable[[], float] = time.time,
                 holder: Callable[[Path], Any] = live_holder, thresholds: Thresholds | None = None):
        self.folder = RunFolder.of(run)
        self.run_dir = self.folder.path
        self.follower = RecordFollower(self.folder)
        self.watch = (lock or {}).get("watch") or {}
        self.mtbf_hours = mtbf_of((lock or {}).get(PROJECTION_KEY))  # None: the run's own lock's, if any
        self.thresholds = thresholds if thresholds is not None else thresholds_from_lock(lock)
        self.stall_windows, self.clock, self.holder = stall_windows, clock, holder
        self.rules = [r for r in live_rules() if r.name not in UNWATCHED_RULES]
        self.active: dict[str, Alert] = {}
        self.raised: list[Alert] = []
        self.events: list[dict[str, Any]] = []
        self.losses: list[tuple[int, float]] = []  # (step, loss) of the kept history's windows so far
        self.downstream: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # task -> its kept (step, figures)
        self.gaps: list[float] = []
        self.last_train: dict[str, float] = {}  # session -> time of its last train line
        self.longest = {"checkpoint": 0.0, "val": 0.0, "startup": 0.0}
        self.session_start_time: float | None = None
        self.session_trained = False
        # session -> its world size (session_start), for per-device rates
        self.world_sizes: dict[str, int] = {}
        self.max_steps: int | None = None
        recipe = self.follower.run.get("recipe")  # of any recipe format
        self.cadence = {"checkpoint_every": recorded_value(recipe, "train.checkpoint.every"),
                        "eval_every": recorded_value(recipe, "train.eval.every")}
        self.pending_judgement = False
        self.waiting: dict[str, str] = {}  # rule -> the evidence it waits for, at the last judgement
        # summarize's, at the last judgement (ledger.py)
        self.against_projection: dict[str, Any] | None = None
        self.last_judged = -1e18
        self.judge_cost = 0.0
        self.completed = False
        self.told: set[str] = set()  # spike_key / rollback_key of every spike and rollback already raised
        # facts said once, not alerts (a resume that exactness is not promised across)
        self.notes: list[str] = []
        self.notes_taken = 0
        self.noted: set[str] = set()  # sessions whose not_exact resume a note already said
        self.forecast = ForecastWatch(lock, self.follower.run)  # the lock's val-loss forecast, if any

    def _first_time(self, key: str) -> bool:
        """Whether this spike or rollback is new to the watch (not a resumed session's redo of one it
        told)."""
        new = key not in self.told
        self.told.add(key)
        return new

    # -------------------------------------------------------------------------------------------- checking
    def check(self, final: bool = False) -> tuple[list[Alert], list[Alert]]:
        now = self.clock()
        found: dict[str, Alert] = {}
        cleared: set[str] = set()
        # one look reads the whole record
        poll = self.follower.poll_to_end() if final else self.follower.poll()
        for reason in poll.breaks:
            key = f"chain:{reason.split(':')[0]}"
            found[key] = Alert("chain", key, reason, time=now)
        for event in poll.events:
            self._read(event, now, found, cleared)
        if poll.events:
            self.pending_judgement = True
        if any(e["event"] == "session_start" for e in poll.events):
            self._not_exact_notes()
        self._session_state(now, found, cleared, poll.pending_bytes)
        if self.pending_judgement and (
            final or self.completed or now - self.last_judged >= 3 * self.judge_cost
        ):
            self._judge_rules(now, found, cleared)
        return self._update(found, cleared)

    def new_notes(self) -> list[str]:
        """The notes added since the last call (watch prints each once)."""
        taken, self.notes_taken = self.notes[self.notes_taken:], len(self.notes)
        return taken

    def _not_exact_notes(self) -> None:
        """A resume that changed what bit-exactness depends on (the thread count, a numerics library, the
        device: run.json's session entry `not_exact`, written before the session's first line) is not a fault:
        the run goes on, but its figures from that update are not promised to match an uninterrupted run's bit
        for bit, and the verdict's resumed rule counts it as no exact continuation. Said once per such
        session."""
        self.folder.refresh()
        started = {str(e["session_id"]) for e in self.events if e["event"] == "session_start"}
        for sid, what in not_exact_sessions(self.folder.run).items():
            if sid in started and sid not in self.noted:
                self.noted.add(sid)
                self.notes.append(
                    f"note: session {sid} resumed across {what}: bit-exact continuation is not "
                    "promised from there (the run goes on; its figures need not match an "
                    "uninterrupted run's bit for bit, and the verdict's resumed rule counts no exact "
                    "continuation from it)"
                )

    def _update(self, found: dict[str, Alert], cleared: set[str]) -> tuple[list[Alert], list[Alert]]:
        gone = [self.active.pop(k) for k in list(self.active) if k in cleared and k not in found]
        new = [a for k, a in found.items() if k not in self.active]
        for alert in new:
            self.active[alert.key] = alert
            self.raised.append(alert)
        return new, gone

    def _read(self, event: dict[str, Any], now: float, found: dict[str, Alert], cleared: set[str]) -> None:
        self.events.append(event)
        kind, sid, step = event["event"], str(event["session_id"]), event["step"]
        cleared.add("stall")
        t = float(event["time"]) if is_finite_number(event.get("time")) else now
        if kind == "val":
            self._forecast(event, now, found, cleared)
        if kind == "session_start":
            # run.json records the session and the changes it made on resume before its first line: read
            # again now, so that a change is said at the session's first evaluation even in this same poll
            self.folder.refresh()
            resumed = event.get("resumed_from")
            self.forecast.restart(sid, resumed)
            self.losses = [p for p in self.losses if resumed is not None and p[0] <= resumed]
            self.downstream = {name: [p for p in points if resumed is not None and p[0] <= resumed]
                               for name, points in self.downstream.items()}
            self.session_start_time, self.session_trained = t, False
            size = event.get("world_size")
            self.world_sizes[sid] = size if isinstance(size, int) and size >= 1 else 1
            self.max_steps = event.get("max_steps") if isinstance(event.get("max_steps"), int) else None
            self.completed = False
            cleared.update(k for k in self.active if k.startswith("session_end"))
        elif kind in ("checkpoint", "val") and is_finite_number(event.get("seconds")):
            self.longest[kind] = max(self.longest[kind], float(event["seconds"]))
        elif kind == "spike":
            key = f"spike:{event.get('spike_step')}:{event.get('_line', t)}"
            if not self._first_time(spike_key(event)):
                # a resumed session's redo of a spike already told (report/record_check/spike_history.py)
                return
            replay = event.get("replay") or {}
            batches = ", ".join(str(b) for b in event.get("batches") or []) or "not recorded"
            found[key] = Alert(
                "spike",
                key,
                f"spike at update {event.get('spike_step')} (batches {batches}: the "
                "loader's cursor positions, counted from 0 as train.skip_data and the rollback count "
                f"them): {'+'.join(event.get('signals') or [])} "
                f"(loss {event.get('loss')}, grad norm {event.get('grad_norm')}) -> {event.get('action')}; "
                f"cause {event.get('cause') or 'not replayed'}"
                + (f": {replay['explanation']}" if replay.get("explanation") else ""),
                step,
                event.get("grad_norm"),
                event.get("bounds"),
                sid,
                now,
            )
        elif kind == "rollback":
            key = f"rollback:{event.get('spike_step')}:{event.get('_line', t)}"
            if not self._first_time(rollback_key(event)):
                return
            found[key] = Alert(
                "rollback",
                key,
                f"rollback {event.get('rollbacks')} of at most "
                f"{event.get('max_rollbacks')} after the spike at update {event.get('spike_step')}: "
                f"back to step {event.get('restored_step')}, skipped {named_skip(event.get('skipped'))}",
                step,
                event.get("rollbacks"),
                event.get("max_rollbacks"),
                sid,
                now,
            )
        elif kind == "downstream" and isinstance(event.get("tasks"), dict):
            self._downstream(event, now, found, cleared)
        elif kind == "session_end":
            self.completed = event.get("reason") == "completed" and (
                self.max_steps is None or step >= self.max_steps
            )
            if event.get("reason") == "hung":
                key = f"hung:{sid}"
                found[key] = Alert(
                    "hung",
                    key,
                    f"session {sid} hung at step {step}: {event.get('message')}",
                    step,
                    "hung",
                    "progress within the hang bound",
                    sid,
                    now,
                )
        elif kind == "hang_found" and isinstance(event.get("hung_session"), str):
            found[f"hung:{event['hung_session']}"] = hang_found_alert(event, now)
        elif kind == "train":
            # trained on
            cleared.update(k for k in self.active if k.startswith(("spike:", "rollback:", "hung:")))
            if sid in self.last_train:
                self.gaps = (self.gaps + [t - self.last_train[sid]])[-INTERVAL_HISTORY:]
            elif self.session_start_time is not None:
                self.longest["startup"] = max(self.longest["startup"], t - self.session_start_time)
            first_of_session = not self.session_trained
            self.last_train[sid], self.session_trained = t, True
            self._loss(event, now, found, cleared)
            if not first_of_session:
                self._throughput(event, now, found, cleared)

    def _loss(self, event: dict[str, Any], now: float, found: dict[str, Alert], cleared: set[str]) -> None:
        loss, step, sid = event.get("loss"), event["step"], str(event["session_id"])
        if not is_finite_number(loss):
            return  # losses_finite, a rule of the table, says so
        t, share = self.thresholds, MIN_SCALE_SHARE["loss"]
        history = [p[1] for p in self.losses[-t.spike_median_window:]]
        spiked, found_bound = spike_against(float(loss), history, t.spike_factor, share, t.spike_min_history,
                                            step_spread)
        if found_bound is not None:
            centre, _, bound = found_bound
            if spiked:
                found.setdefault(
                    "loss_spike",
                    Alert(
                        "loss_spike",
                        "loss_spike",
                        f"loss {loss:.6g} at step {step} is above the median {centre:.6g} of "
                        f"the previous {len(history)} windows by more than {t.spike_factor:g} x max(their "
                        "noise, "
                        f"{share:g} x the median): bound {bound:.6g}",
                        step,
                        loss,
                        bound,
                        sid,
                        now,
                    ),
                )
            else:
                cleared.add("loss_spike")
        envelope = self.watch.get("loss_envelope")
        if isinstance(envelope, dict):
            bound = envelope_bound(envelope, step)
            if bound is not None and loss > bound:
                found.setdefault(
                    "loss_envelope",
                    Alert(
                        "loss_envelope",
                        "loss_envelope",
                        f"loss {loss:.6g} at step {step} is outside the pilot's "
                        f"envelope: above {bound:.6g} (the pilot's loss there plus its tolerance)",
                        step,
                        loss,
                        bound,
                        sid,
                        now,
                    ),
                )
            elif bound is not None:
                cleared.add("loss_envelope")
        self.losses.append((step, float(loss)))

    def _forecast(self, event: dict[str, Any], now: float, found: dict[str, Alert],
                  cleared: set[str]) -> None:
        said = self.forecast.judge(self.follower.run, event)
        self.notes.extend(self.forecast.notes)
        self.forecast.notes = []
        self._forecast_changes(event, now, found, cleared)
        if said is not None and "outside" in said:
            found.setdefault("forecast", Alert("forecast", "forecast", said["outside"], said["step"],
                                               said["figure"], said["bound"], str(event["session_id"]), now,
                                               {"first": said["first"]}))
        elif said is not None:
            cleared.add("forecast")

    def _forecast_changes(self, event: dict[str, Any], now: float, found: dict[str, Alert],
                          cleared: set[str]) -> None:
        """One alert per resume whose changes left what the forecast assumed, at the first evaluation after
        it; it stands (the run is on the changed recipe from then on) until a resume from before that session
        redoes its updates without those changes (cleared at that resume's first evaluation)."""
        for sid in self.forecast.undone:  # raised and undone within one look: never said
            found.pop(f"forecast_change:{sid}", None)
            cleared.add(f"forecast_change:{sid}")
        self.forecast.undone = []
        by_session: dict[str, list[dict[str, Any]]] = {}
        for change in self.forecast.changes:
            by_session.setdefault(str(change["session_id"]), []).append(change)
        self.forecast.changes = []
        for sid, changes in by_session.items():
            first = min(int(c["from_update"]) for c in changes)
            found[f"forecast_change:{sid}"] = Alert(
                "forecast_change", f"forecast_change:{sid}", self.forecast.change_message(changes),
                event["step"], [f"{c['key']} {c['old']} -> {c['new']}" for c in changes],
                "the lock's recipe and data", sid, now, {"from_step": first, "changes": changes})

    def _downstream(
        self, event: dict[str, Any], now: float, found: dict[str, Alert], cleared: set[str]
    ) -> None:
        pilot = self.watch.get("downstream") if isinstance(self.watch.get("downstream"), dict) else {}
        for name, points in task_series([event]).items():
            history = self.downstream.setdefault(name, [])
            history.extend(points)
            for key, problem in ((f"downstream:{name}", fallback_problem(history)),
                                 (f"downstream_pilot:{name}", below_pilot_problem(history, pilot.get(name)))):
                if problem is None:
                    cleared.add(key)
                    continue
                message, figure, bound = problem
                found[key] = Alert("downstream", key, f"task {name}: {message}", event["step"], figure, bound,
                                   str(event["session_id"]), now)

    def _throughput(
        self, event: dict[str, Any], now: float, found: dict[str, Alert], cleared: set[str]
    ) -> None:
        window = event.get("window")
        if not isinstance(window, dict) or window_profiled(window):
            return
        sid = str(event["session_id"])
        rate = window_tokens_per_s(event)
        self._band(
            event,
            now,
            "throughput",
            self.watch.get("throughput"),
            rate,
            "training-only",
            "tok/s",
            found,
            cleared,
        )
        rate = window_tokens_per_device_second(event, self.world_sizes.get(sid, 1))
        self._band(
            event,
            now,
            "throughput_device",
            self.watch.get("device_throughput"),
            rate,
            "per device second",
            "tok",
            found,
            cleared,
        )

    def _band(
        self,
        event: dict[str, Any],
        now: float,
        key: str,
        band: Any,
        rate: float | None,
        what: str,
        unit: str,
        found: dict[str, Alert],
        cleared: set[str],
    ) -> None:
        low = (band or {}).get("low") if isinstance(band, dict) else None
        if not is_finite_number(low) or rate is None:
            return
        pilot_share, share = (band or {}).get("cpu_share"), window_cpu_share(event)
        ratio = self.thresholds.min_cpu_share_ratio
        if rate < low and key == "throughput" and busier(rate, share, low, pilot_share, ratio):
            # Slower with a smaller share of the CPU, each CPU second doing the pilot's work: other load took
            # it.
            found.setdefault(
                "throughput_busy",
                Alert(
                    "machine_busier",
                    "throughput_busy",
                    f"{what} {rate:.1f} {unit} at step {event['step']} is below the "
                    f"pilot's band ({low:.1f} {unit}) while the process got {share:.2f} CPU seconds per "
                    "training second "
                    f"against the pilot's {pilot_share:.2f}, at {rate / share:.0f} tokens per CPU second "
                    "(the band's low "
                    f"at the pilot's share: {low / pilot_share:.0f}; below {ratio:g} of the share counts "
                    "too): the "
                    "machine is busier (other load took the CPU), not the recipe slower",
                    event["step"],
                    rate,
                    low,
                    str(event["session_id"]),
                    now,
                    {"cpu_share": share, "pilot_cpu_share": pilot_share},
                ),
            )
            cleared.add(key)
        elif rate < low:
            found.setdefault(
                key,
                Alert(
                    "throughput",
                    key,
                    f"{what} {rate:.1f} {unit} at step {event['step']} is below the pilot's band (its "
                    f"slowest steady window less {band.get('margin')}: {low:.1f} {unit})",
                    event["step"],
                    rate,
                    low,
                    str(event["session_id"]),
                    now,
                ),
            )
        else:
            cleared.update((key, "throughput_busy") if key == "throughput" else (key,))

    # -------------------------------------------------------------------------------------------- state
    def window_interval(self) -> tuple[float | None, str]:
        if len(self.gaps) >= 2:
            return statistics.median(
                self.gaps
            ), f"median of the run's last {len(self.gaps)} train-to-train gaps"
        pilot = self.watch.get("window_interval_seconds")
        if is_finite_number(pilot):
            return float(pilot), "the pilot's median train-to-train gap (the lock)"
        return None, "unknown until the run has written three train windows"

    def _session_state(self, now: float, found: dict[str, Alert], cleared: set[str], pending: int) -> None:
        if self.completed:
            return
        holder = self.holder(self.run_dir)
        last = self._last_session_event()
        if holder is None and last is not None:
            again = self.follower.poll()  # a session that just ended wrote its last line before letting go
            for event in again.events:
                self._read(event, now, found, cleared)
            last = self._last_session_event()
            if self.completed:
                return
        if holder is not None:
            cleared.update(k for k in self.active if k.startswith("session_end"))
            self._stall(now, last, found)
            return
        if last is None:
            return
        reason = last.get("reason") if last["event"] == "session_end" else "killed (no session_end)"
        if last["event"] == "session_end" and reason == "completed":
            reason = f"completed at step {last['step']} before its max_steps {self.max_steps}"
        key = f"session_end:{last['session_id']}"
        found[key] = Alert(
            "session_end",
            key,
            f"session {last['session_id']} ended: {reason}, at step "
            f"{last['step']}; no session holds the run folder (no resume started)"
            # unterminated, not "torn": an invalid byte inside it is named as damage on its own
            + (f"; an unterminated last line of {pending} bytes" if pending else ""),
            last["step"],
            reason,
            "a running session or a completed run",
            str(last["session_id"]),
            now,
        )

    def _last_session_event(self) -> dict[str, Any] | None:
        """The last line a training session wrote (`pilotrun evaluate`'s lines belong to none)."""
        return next((e for e in reversed(self.events) if e["event"] != "evaluation"), None)

    def _stall(self, now: float, last: dict[str, Any] | None, found: dict[str, Alert]) -> None:
        interval, basis = self.window_interval()
        if interval is None or last is None or interval <= 0:
            return
        allowance, why = 0.0, []
        step, kind = last["step"], last["event"]
        for name, event_kind in (("checkpoint_every", "checkpoint"), ("eval_every", "val")):
            every = self.cadence.get(name)
            due = isinstance(every, int) and every > 0 and step % every == 0 and kind in ("train", "val")
            if due and not (event_kind == "val" and kind == "val"):
                allowance += self.longest[event_kind]
                why.append(f"the longest {event_kind} so far {self.longest[event_kind]:.3g} s")
        if not self.session_trained:
            startup = self.longest["startup"] or 10 * interval
            allowance += startup
            why.append(f"start-up allowance {startup:.3g} s")
        gap = now - float(last["time"])
        bound = self.stall_windows * interval + allowance
        if gap > bound:
            found["stall"] = Alert(
                "stall",
                "stall",
                f"no event for {gap:.2f} s = {gap / interval:.2f} window intervals of {interval:.3g} s "
                f"({basis}); bound {self.stall_windows} intervals"
                + (f" + {', '.join(why)}" if why else "")
                + f" = {bound:.2f} s; last line {last['event']} at step {step}",
                step,
                gap,
                bound,
                str(last["session_id"]),
                now,
                {
                    "windows": gap / interval,
                    "interval_seconds": interval,
                    "stall_windows": self.stall_windows,
                    "last_event_time": float(last["time"]),
                },
            )

    def _restarts(self, summary: Any, now: float, found: dict[str, Alert], cleared: set[str]) -> None:
        ledger = summary.overall.get("time_ledger") or {}
        mtbf = against_mtbf(
            summary.overall.get("session_ends") or {},
            ledger.get("elapsed_seconds") or 0.0,
            self.mtbf_hours if self.mtbf_hours is not None else mtbf_of(lock_projection_of(summary.run)),
        )
        if mtbf is None or not mtbf["faster"]:
            cleared.add("restarts")
            return
        found["restarts"] = Alert(
            "restarts",
            "restarts",
            f"{mtbf['interruptions']} interruption(s) in {mtbf['elapsed_hours']:.3g} h "
            f"(one every {mtbf['hours_between']:.3g} h) against the lock's MTBF of {mtbf['mtbf_hours']:g} h: "
            f"{mtbf['expected']:.3g} expected, P(at least as many) {mtbf['p_at_least']:.2g} < {FASTER_P:g}; "
            f"sessions by end: {', '.join(f'{k} {v}' for k, v in summary.overall['session_ends'].items())}",
            summary.final.step,
            mtbf["hours_between"],
            mtbf["mtbf_hours"],
            None,
            now,
            mtbf,
        )

    def _judge_rules(self, now: float, found: dict[str, Alert], cleared: set[str]) -> None:
        started = time.monotonic()
        self.folder.refresh()  # run.json again if it was replaced since; the log is what the follower read
        summary = summarize_run(self.folder)
        self.against_projection = summary.overall.get("against_projection")
        self._restarts(summary, now, found, cleared)
        self.waiting = {}
        for rule in self.rules:
            key = f"rule:{rule.name}"
            waiting = rule.waiting_for(summary)
            if waiting is not None:
                # The run has not reached what the rule reads (a rule needing a checkpoint before the first
                # one): not judged, not failed. An alert raised on evidence since rolled back stands as it
                # was.
                self.waiting[rule.name] = waiting
                continue
            result = rule.apply(summary, self.thresholds)
            if result.status == FAIL:
                found[key] = Alert(
                    "rule",
                    key,
                    f"rule {rule.name} FAILs: {result.figure} [{result.threshold}]",
                    summary.final.step,
                    result.figure,
                    result.threshold,
                    None,
                    now,
                )
            else:
                cleared.add(key)
        self.pending_judgement, self.last_judged = False, now
        self.judge_cost = time.monotonic() - started
