"""`pilotrun tune RUN --check lr,batch`: does the pilot's recipe use a learning rate and a batch near the best
it could, measured by short branches from the pilot's own committed checkpoints.

A command of its own that reads a finished pilot's folder (and `pilotrun pilot --check` calls it after its
resumed run): the checks need the whole pilot (its committed checkpoints past warm-up, its record's noise and
seconds per update), so they are a step after the pilot, and can be run again, or later, on any pilot folder
without running the pilot again.

1. plan: from RUN/run.json (the effective recipe, the data folder) and the committed checkpoints, the
   checkpoints to branch from, the updates per branch and every branch; the cost (updates, and seconds
   projected from the pilot's own record: its updates, and every fixed cost a branch and its process pay
   again, commands/tune_cost.py) is stated before anything runs, and K is the most that fits `budget` times
   the pilot's own updates and wall seconds (a check that fits only in updates is refused, or run with its
   overrun stated where the user allows it);
2. each branch (commands/tune_branch.py) is a `pilotrun train --resume --from-step N` into RUN/tune/NAME with
   its allowed change, a session of its own; the branches run one after another in one process
   (commands/tune_child.py), which pays the interpreter's launch and the imports once, or each under torchrun
   where the pilot ran on several ranks; a branch already complete is reused, an interrupted one run again
   from its checkpoint;
3. the findings (report/verdict/tuning.py) go to RUN/tune/tune.json (written last, atomically) and its plots
   beside it; `pilotrun verdict RUN` then shows them as evidence and draws them in the report, and `freeze`
   carries them into the lock.

The learning-rate branches multiply both the Muon and the AdamW rate by each factor of LR_FACTORS. The batch
branches change the global batch by train.gradient_accumulation_steps where it can (the cursor geometry and
the per-device memory stay), else by train.batch_size (with train.eval.batches scaled so that every branch
evaluates on the same validation windows), and each reads the same tokens: a branch at m times the batch runs
1/m of the updates.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pilotrun.commands.next_commands import train_words
from pilotrun.commands.pilot_process import TrainingChild, log_cause
from pilotrun.commands.tune_branch import (
    Branch,
    branch_val_loss,
    cadence_overrides,
    clock_start_of,
    make_branch_folder,
    own_events,
    pilot_session_ids,
    val_loss_of,
)
from pilotrun.commands.tune_cost import PilotTimings, pilot_timings
from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import write_text_atomic
from pilotrun.common.strict_json import strict_dumps
from pilotrun.report.verdict.tuning import (
    BATCH_MULTIPLES,
    LR_FACTORS,
    TUNE_DIR,
    TUNE_JSON,
    factor_name,
    judge_batch,
    judge_lr,
    noise_yardstick,
)
from pilotrun.run.marker import committed_checkpoint_steps
from pilotrun.run.record import (
    RUN_JSON,
    read_metrics_tolerant,
    read_run_json,
)

CHECKS = ("lr", "batch")
DEFAULT_BUDGET = 3.0  # the checks' updates, at the recipe's batch, as a multiple of the pilot's own
RECIPE_FILE = "recipe.json"  # the pilot's effective recipe, which every branch is started with


class TuneError(PilotrunError):
    """The checks cannot run on this folder (not a pilot, no checkpoint to branch from, over budget)."""


@dataclass
class TunePlan:
    run_dir: Path
    checks: tuple[str, ...]
    updates: int
    lr_step: int | None
    batch_steps: list[int]
    branches: list[Branch] = field(default_factory=list)
    pilot_updates: int = 0
    timings: PilotTimings = field(default_factory=lambda: PilotTimings(None, None, None, None))
    overrun: bool = False  # over the budget in seconds, run because the user allowed it
    shared: bool = True  # the branches share one process (its launch paid once); False: each under torchrun
    notes: list[str] = field(default_factory=list)
    # measured as the branches ran: the shared process's spawn to its first branch's session clock start
    measured_launch_seconds: float | None = None
    # the pilot's noise on the scale of one evaluation (pilot_yardstick), read with its timings; None: too few
    # windows to measure
    yardstick: float | None = None

    @property
    def cost_updates(self) -> int:
        """Updates at the recipe's batch that the branches cost (a branch at m times the batch: m each)."""
        return sum(round(b.updates * (b.value if b.kind == "batch" else 1.0)) for b in self.branches)

    @property
    def priced_updates(self) -> int:
        """The updates the seconds are priced by, each at the pilot's seconds per update: as cost_updates,
        but an update at a smaller batch than the recipe's counts whole, not as its share of the tokens: it
        pays the same optimizer step and per-update work, so it costs more than its share and no more than a
        whole one (measured on the CPU pilots of bench_tune: half a batch 8 or 64 update, 0.5-0.8 of the
        whole one's seconds, as the load moved); the whole one is the bound the budget is kept under."""
        return sum(round(b.updates * (max(b.value, 1.0) if b.kind == "batch" else 1.0))
                   for b in self.branches)

    @property
    def cost_seconds(self) -> float | None:
        """Projected wall seconds: the priced updates at the pilot's rate, every branch's fixed costs and
        the launch of each process (commands/tune_cost.py)."""
        return self.timings.projected_seconds(self.priced_updates, len(self.branches), self.processes)

    @property
    def processes(self) -> int:
        return 1 if self.shared else len(self.branches)

    def fits(self, budget: float) -> bool:
        """Within `budget` times the pilot's updates and, where the record says them, its wall seconds."""
        return (self.cost_updates <= budget * self.pilot_updates
                and self.timings.fits(self.priced_updates, len(self.branches), self.processes, budget))

    def cost_line(self, budget: float) -> str:
        return (f"{len(self.branches)} branches of {self.updates} updates cost {self.cost_updates} updates "
                f"at the recipe's batch = {self.cost_updates / self.pilot_updates:.2f}x the pilot's "
                f"{self.pilot_updates}{self._seconds_part(budget)}")

    def _seconds_part(self, budget: float) -> str:
        t, projected = self.timings, self.cost_seconds
        if projected is None:
            return f" (budget {budget:g}x, in updates only: the record has no seconds per update)"
        parts = self._seconds_parts()
        if not t.pilot_seconds:
            return (f" (budget {budget:g}x, in updates only: the record has no session's wall seconds), "
                    f"about {projected:.0f} s projected: {parts}")
        over = (f": OVER the budget by {projected / t.pilot_seconds - budget:.2f}x, run as --allow-overrun "
                "asked" if self.overrun else "")
        return (f"; projected {projected:.0f} s = {projected / t.pilot_seconds:.2f}x the pilot's own "
                f"{t.pilot_seconds:.0f} s (budget {budget:g}x{over}): {parts}")

    def _seconds_parts(self) -> str:
        """The projection's parts, each with the pilot's figure it is counted from."""
        t, count, processes = self.timings, len(self.branches), self.processes
        training = self.priced_updates * (t.seconds_per_update or 0.0)
        shared = "the branches share one process" if self.shared else "a process a branch, under torchrun"
        startup, launch = t.startup_seconds or 0.0, t.launch_seconds or 0.0
        whole = self.priced_updates - self.cost_updates
        text = (f"{training:.0f} s of training at the pilot's {t.seconds_per_update:.3g} s per update"
                + (f" ({whole} more for the smaller batch's updates, each priced whole)" if whole else "")
                + f" and {count * startup:.0f} s of start-up ({count} x the pilot's {startup:.2g} s a "
                "session)")
        each = [(t.eval_seconds, "an evaluation"), (t.save_seconds, "a save"),
                (t.bookkeeping_seconds, "a session's bookkeeping")]
        known = [(seconds, what) for seconds, what in each if seconds is not None]
        if known:
            text += (f" and {count * sum(s for s, _ in known):.0f} s of {count} x the pilot's "
                     + ", ".join(f"{s:.2g} s {what}" for s, what in known))
        source = ("the pilot's own, from its command's start to its session's clock, imports included"
                  if t.launch_from_record else "measured for a process that imports the trainer")
        return (text + f" and {processes * launch:.0f} s of launch ({processes} x {launch:.2g} s {source}: "
                f"{shared})")


def parse_checks(text: str) -> tuple[str, ...]:
    checks = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or not checks:
        raise TuneError(f"--check {text!r}: the checks are {', '.join(CHECKS)} (comma-separated)")
    return checks


def _read_pilot(run_dir: Path) -> dict[str, Any]:
    if not (run_dir / RUN_JSON).is_file():
        raise TuneError(f"{run_dir} is not a pilot's run folder: it has no {RUN_JSON} (pass the folder "
                        "`pilotrun train --run-dir` or `pilotrun pilot` wrote)")
    run = read_run_json(run_dir)
    recipe = run.get("recipe")
    needed = ("optim.schedule.warmup_steps", "optim.muon.lr", "optim.adamw.lr", "train.max_steps",
              "train.batch_size")
    for key in needed:
        value: Any = recipe
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TuneError(f"{run_dir / RUN_JSON} holds no recipe with {key}: not a pilot's run folder")
    return run


def _batch_change(train: dict[str, Any], multiple: float) -> tuple[list[str], list[str]] | None:
    """(--set, --allow-change) that make the global batch `multiple` times the recipe's; None: cannot."""
    accumulation, batch = int(train.get("gradient_accumulation_steps", 1)), int(train["batch_size"])
    if multiple >= 1:
        key, value = "train.gradient_accumulation_steps", round(accumulation * multiple)
        return [f"{key}={value}"], [key]
    if accumulation % round(1 / multiple) == 0:
        key, value = "train.gradient_accumulation_steps", round(accumulation * multiple)
        return [f"{key}={value}"], [key]
    if batch % round(1 / multiple) == 0:
        eval_batches = round(int((train.get("eval") or {}).get("batches", 1)) / multiple)
        return ([f"train.batch_size={round(batch * multiple)}", f"train.eval.batches={eval_batches}"],
                ["train.batch_size"])
    return None


def _lr_branches(recipe: dict[str, Any], step: int, updates: int) -> list[Branch]:
    muon, adamw = recipe["optim"]["muon"]["lr"], recipe["optim"]["adamw"]["lr"]
    branches = []
    for factor in LR_FACTORS:
        change = ([f"optim.muon.lr={muon * factor!r}", f"optim.adamw.lr={adamw * factor!r}"]
                  if factor != 1.0 else [])
        allow = ["optim.muon.lr", "optim.adamw.lr"] if change else []
        branches.append(Branch("lr" if factor != 1.0 else "base", factor, step, updates, change, allow))
    return branches


def _batch_branches(recipe: dict[str, Any], steps: list[int], updates: int,
                    notes: list[str]) -> list[Branch]:
    branches = []
    for step in steps:
        for multiple in BATCH_MULTIPLES:
            if multiple == 1.0:
                branches.append(Branch("base", 1.0, step, updates))
                continue
            change = _batch_change(recipe["train"], multiple)
            if change is None:
                notes.append(f"batch {factor_name(multiple)}x left out: neither the recipe's "
                             "gradient_accumulation_steps nor its batch_size divides by "
                             f"{round(1 / multiple)}")
                continue
            branches.append(Branch("batch", multiple, step, round(updates / multiple), *change))
    return branches


def _choose_points(eligible: list[int], middle: float,
                   checks: tuple[str, ...]) -> tuple[int | None, list[int]]:
    """The LR check's checkpoint (nearest the pilot's middle past warm-up) and the batch check's (that one and
    the farthest from it: two points of the pilot's span)."""
    lr_step = min(eligible, key=lambda s: (abs(s - middle), s))
    batch_steps = sorted({lr_step, max(eligible, key=lambda s: (abs(s - lr_step), s))})
    return (lr_step if "lr" in checks else None), (batch_steps if "batch" in checks else [])


def _unique(branches: list[Branch]) -> list[Branch]:
    seen, kept = set(), []
    for branch in branches:
        if branch.name not in seen:
            seen.add(branch.name)
            kept.append(branch)
    return kept


def _branches_for(recipe: dict[str, Any], checks: tuple[str, ...], past: list[int], updates: int,
                  max_steps: int, warmup: int) -> TunePlan | None:
    eligible = [s for s in past if s + updates <= max_steps]
    if not eligible:
        return None
    lr_step, batch_steps = _choose_points(eligible, (warmup + max_steps) / 2, checks)
    notes: list[str] = []
    branches = _lr_branches(recipe, lr_step, updates) if lr_step is not None else []
    branches += _batch_branches(recipe, batch_steps, updates, notes)
    return TunePlan(Path(), checks, updates, lr_step, batch_steps, _unique(branches), notes=notes)


def plan_checks(run_dir: str | Path, checks: tuple[str, ...], updates: int | None = None,
                budget: float = DEFAULT_BUDGET, allow_overrun: bool = False,
                launch_seconds: float | None = None, nproc: int | None = None) -> TunePlan:
    """Every branch of the checks, or a TuneError that says what the pilot lacks. K is the most updates a
    branch that fit `budget` times the pilot's updates and its wall seconds (projected from its record and
    `launch_seconds`, measured now where None); where only the seconds do not fit even at the smallest K,
    `allow_overrun` runs the most that fits in updates, its overrun stated."""
    run_dir = Path(run_dir)
    run = _read_pilot(run_dir)
    recipe = run["recipe"]
    warmup = int(recipe["optim"]["schedule"].get("warmup_steps", 0))
    committed = committed_checkpoint_steps(run_dir)
    max_steps = max([int(recipe["train"]["max_steps"]), *committed] or [0])
    past = [s for s in committed if warmup < s < max_steps]
    if not past:
        raise TuneError(f"{run_dir} has no committed checkpoint past warm-up (step > {warmup}) and before "
                        f"its last update {max_steps} (it has: {', '.join(map(str, committed)) or 'none'}): "
                        "the checks branch from one; keep more checkpoints (train.checkpoint.keep) or run "
                        "longer")
    if updates is not None and (updates < 4 or updates % 4):
        raise TuneError(f"--updates {updates}: must be a multiple of 4 (a 4x batch runs a quarter of them)")
    candidates = [updates] if updates is not None else range((max_steps - past[0]) // 4 * 4, 0, -4)
    plans = []
    for k in candidates:
        plan = _branches_for(recipe, checks, past, k, max_steps, warmup)
        if plan is not None:
            plan.run_dir, plan.pilot_updates = run_dir, max_steps
            plan.shared = not (nproc if nproc is not None else _pilot_ranks(run))
            plans.append(plan)
    if plans:  # the pilot's record, read once: its timings and its noise
        events = read_metrics_tolerant(run_dir).events
        timings, yardstick = pilot_timings(events, launch_seconds), pilot_yardstick(events)
        for plan in plans:
            plan.timings, plan.yardstick = timings, yardstick
    return _within_budget(run_dir, plans, max_steps, updates, budget, allow_overrun)


def _within_budget(run_dir: Path, plans: list[TunePlan], max_steps: int, updates: int | None, budget: float,
                   allow_overrun: bool) -> TunePlan:
    """The plan with the most updates a branch that fits the budget (`plans` by updates, most first)."""
    in_updates = [p for p in plans if p.cost_updates <= budget * p.pilot_updates]
    if updates is not None and plans and not in_updates:
        raise TuneError(f"the checks would cost more than the budget: {plans[0].cost_line(budget)}; pass "
                        "fewer --updates or a larger --budget")
    if not in_updates:
        raise TuneError(f"{run_dir} is too short to branch: no committed checkpoint past warm-up leaves "
                        f"{updates or 4} updates before its last update {max_steps} within a budget of "
                        f"{budget:g}x its updates; run the pilot longer or keep more checkpoints")
    fitting = [p for p in in_updates if p.fits(budget)]
    if fitting:
        return fitting[0]
    if not allow_overrun:
        smallest = in_updates[-1]
        which = "at --updates" if updates is not None else "even at the fewest,"
        raise TuneError(f"the checks do not fit {budget:g}x the pilot's wall seconds {which} "
                        f"{smallest.updates} updates a branch: {smallest.cost_line(budget)}; pass a larger "
                        "--budget, or --allow-overrun to run them anyway")
    plan = in_updates[0]
    plan.overrun = True
    return plan


def pilot_yardstick(events: list[dict[str, Any]]) -> float | None:
    """The pilot's noise on the scale of one evaluation (report/verdict/tuning.py noise_yardstick), from its
    record's events; None: too few windows to measure."""
    train = [e for e in events if e.get("event") == "train" and isinstance(e.get("loss"), float)]
    val_tokens = [e["tokens"] for e in events if e.get("event") == "val" and isinstance(e.get("tokens"), int)]
    window_tokens = [(e.get("window") or {}).get("tokens") for e in train]
    window_tokens = [t for t in window_tokens if isinstance(t, int) and t > 0]
    if not train or not val_tokens or not window_tokens:
        return None
    return noise_yardstick([e["loss"] for e in train], int(statistics.median(window_tokens)), val_tokens[-1])


def _pilot_ranks(run: dict[str, Any]) -> int | None:
    """The ranks the pilot's last session ran on, where more than one: its branches run under torchrun the
    same way (a resume on another world size is refused)."""
    last = (run.get("sessions") or [{}])[-1]
    world = ((last.get("hardware") or {}) if isinstance(last, dict) else {}).get("world_size")
    return world if isinstance(world, int) and world > 1 else None


def _prepare_branch(plan: TunePlan, branch: Branch, recipe_file: Path, data: Path, sessions: set[str],
                    out: TextIO) -> tuple[float | None, list[str]]:
    """(its loss, []) for a branch already complete; else (None, the `pilotrun train` words that run it),
    its folder assembled (an interrupted one's replaced)."""
    folder = plan.run_dir / TUNE_DIR / branch.name
    loss = branch_val_loss(folder, sessions, branch.last_step)
    if loss is not None:
        print(f"[tune] {branch.name}: already done, val loss {loss:.4f}", file=out, flush=True)
        return loss, []
    if folder.exists():
        print(f"[tune] {branch.name}: an interrupted branch, run again from its checkpoint", file=out,
              flush=True)
        shutil.rmtree(folder)
    make_branch_folder(plan.run_dir, folder, branch.from_step)
    return None, train_words(config=recipe_file, data=data, run_dir=folder,
                             overrides=[*branch.overrides, *cadence_overrides(branch)],
                             allow_changes=branch.allow, resume=True,
                             extra=["--from-step", str(branch.from_step), "--progress", "none"])


def _branch_result(plan: TunePlan, branch: Branch, sessions: set[str], code: int, out: TextIO
                   ) -> tuple[float, float | None]:
    """The branch's loss from its finished training's exit code and folder, and when its session's clock
    started (None: not recorded), both from one read of its record (the pilot's copied events make it as long
    as the pilot's)."""
    log = _branch_log(plan, branch)
    if code not in (0, 1):
        raise TuneError(f"branch {branch.name} failed: {log_cause(log)} (its log: {log})")
    own = own_events(plan.run_dir / TUNE_DIR / branch.name, sessions)
    if code == 1:  # the branch stopped itself (a loss that left finite numbers, too many spike rollbacks)
        print(f"[tune] {branch.name}: stopped itself ({log_cause(log)}): counted as diverged", file=out,
              flush=True)
        return math.inf, clock_start_of(own)
    loss = val_loss_of(own, branch.last_step)
    if loss is None:
        raise TuneError(f"branch {branch.name} ended without a validation loss at step {branch.last_step}")
    print(f"[tune] {branch.name}: val loss {loss:.4f}", file=out, flush=True)
    return loss, clock_start_of(own)


def _branch_log(plan: TunePlan, branch: Branch) -> Path:
    return plan.run_dir / TUNE_DIR / "logs" / f"{branch.name}.log"


def _run_shared(plan: TunePlan, pending: dict[str, tuple[Branch, list[str]]], sessions: set[str],
                out: TextIO) -> dict[str, float]:
    """The pending branches one after another in one process (commands/tune_child.py), each result taken as
    its exit code is written; the process is ended where a branch fails."""
    logs = plan.run_dir / TUNE_DIR / "logs"
    plan_file, codes_file = logs / "shared.json", logs / "shared-codes.json"
    codes_file.unlink(missing_ok=True)
    spawned = time.time()  # on the record's clock, which the first branch's session clock start is read on
    write_text_atomic(plan_file, strict_dumps({"codes": str(codes_file), "branches": [
        {"name": name, "words": words, "log": str(_branch_log(plan, branch))}
        for name, (branch, words) in pending.items()]}, indent=1) + "\n")
    child = TrainingChild([str(plan_file)], logs / "shared.log",
                          launcher=[sys.executable, "-m", "pilotrun.commands.tune_child"])
    losses: dict[str, float] = {}
    clock_starts: dict[str, float | None] = {}
    try:
        while len(losses) < len(pending):
            ended = child.poll() is not None
            codes = json.loads(codes_file.read_text()) if codes_file.is_file() else {}
            for name in [n for n in pending if n in codes and n not in losses]:
                losses[name], clock_starts[name] = _branch_result(plan, pending[name][0], sessions,
                                                                  codes[name], out)
            if ended and len(losses) < len(pending):
                raise TuneError(f"the branches' process ended (exit {child.poll()}) before every branch ran: "
                                f"{log_cause(child.log)} (its log: {child.log})")
            time.sleep(0.2)
    finally:
        if child.poll() is None:
            child.process.terminate()
        child.wait()
    plan.measured_launch_seconds = clock_starts[next(iter(pending))]
    if plan.measured_launch_seconds is not None:
        plan.measured_launch_seconds -= spawned
    return losses


def _run_branches(plan: TunePlan, recipe_file: Path, data: Path, sessions: set[str], nproc: int | None,
                  out: TextIO) -> dict[str, float]:
    """Every branch's loss: complete ones reused; the rest in one shared process, or each under torchrun
    where the pilot ran on several ranks."""
    losses: dict[str, float] = {}
    pending: dict[str, tuple[Branch, list[str]]] = {}
    for branch in plan.branches:
        loss, words = _prepare_branch(plan, branch, recipe_file, data, sessions, out)
        if loss is not None:
            losses[branch.name] = loss
        else:
            pending[branch.name] = (branch, words)
    if pending and nproc:
        for name, (branch, words) in pending.items():
            code = TrainingChild(words, _branch_log(plan, branch), nproc=nproc).wait()
            losses[name] = _branch_result(plan, branch, sessions, code, out)[0]
    elif pending:
        losses.update(_run_shared(plan, pending, sessions, out))
    return {b.name: losses[b.name] for b in plan.branches}


def _findings(plan: TunePlan, losses: dict[str, float], yardstick: float) -> dict[str, Any]:
    found: dict[str, Any] = {}
    by = {(b.kind if b.kind != "base" else k, b.value, b.from_step): losses[b.name]
          for b in plan.branches for k in ("lr", "batch")}
    if plan.lr_step is not None:
        lr = {f: by[("lr", f, plan.lr_step)] for f in LR_FACTORS}
        found["lr"] = {**judge_lr(lr, yardstick), "losses": [[f, v] for f, v in lr.items()],
                       "from_steps": [plan.lr_step], "updates": plan.updates}
    if plan.batch_steps:
        points = [{"step": s, "losses": {m: by[("batch", m, s)] for m in BATCH_MULTIPLES
                                         if ("batch", m, s) in by}} for s in plan.batch_steps]
        judged = judge_batch(points, yardstick)
        for point, source in zip(judged["points"], points, strict=True):
            point["losses"] = [[m, v] for m, v in source["losses"].items()]
        found["batch"] = {**judged, "from_steps": plan.batch_steps, "updates": plan.updates}
    return found


def run_checks(plan: TunePlan, data: str | Path | None = None, nproc: int | None = None,
               budget: float = DEFAULT_BUDGET, out: TextIO = sys.stdout,
               started: float | None = None) -> dict[str, Any]:
    """Run every branch of `plan` (reusing complete ones), judge, write RUN/tune/tune.json and its plots.
    `started`: the check's start on time.perf_counter (its plan included), for the seconds it measured."""
    started = started if started is not None else time.perf_counter()
    run = read_run_json(plan.run_dir)
    data_dir = Path(data) if data is not None else Path(str((run.get("data") or {}).get("dir", "")))
    if not (data_dir / "metadata.json").is_file() and not data_dir.is_file():
        raise TuneError(f"the pilot's data folder {data_dir} is not there: pass --data DIR")
    tune_dir = plan.run_dir / TUNE_DIR
    (tune_dir / "logs").mkdir(parents=True, exist_ok=True)
    recipe_file = tune_dir / RECIPE_FILE
    write_text_atomic(recipe_file, strict_dumps(run["recipe"], indent=1) + "\n")
    sessions = pilot_session_ids(plan.run_dir)
    nproc = nproc if nproc is not None else _pilot_ranks(run)
    losses = _run_branches(plan, recipe_file, data_dir, sessions, nproc, out)
    measured = plan.yardstick
    yardstick = measured if measured is not None else 0.0
    result = {"run_id": run.get("run_id"), "checks": list(plan.checks), "updates": plan.updates,
              "cost": _cost(plan, budget),
              "yardstick": yardstick, "yardstick_measured": measured is not None, "notes": plan.notes,
              "branches": {b.name: {"kind": b.kind, "value": b.value, "from_step": b.from_step,
                                    "updates": b.updates, "set": b.overrides, "allow_change": b.allow,
                                    "val_loss": losses[b.name]} for b in plan.branches},
              **_findings(plan, losses, yardstick)}
    from pilotrun.report.drawing.tune_plots import write_tune_plots

    write_tune_plots(result, tune_dir)
    result["cost"]["measured_seconds"] = time.perf_counter() - started  # all but writing tune.json
    # a branch that diverged has an infinite gain: written by its name, as the record writes a non-finite loss
    write_text_atomic(tune_dir / TUNE_JSON, strict_dumps(result, indent=1) + "\n")
    return result


def _cost(plan: TunePlan, budget: float) -> dict[str, Any]:
    """tune.json's `cost`: what was stated before the branches ran, each part's pilot figure, and the launch
    measured as they ran."""
    t = plan.timings
    return {"updates": plan.cost_updates, "pilot_updates": plan.pilot_updates, "budget": budget,
            "seconds_per_update": t.seconds_per_update, "seconds": plan.cost_seconds,
            "pilot_seconds": t.pilot_seconds, "startup_seconds": t.startup_seconds,
            "eval_seconds": t.eval_seconds, "save_seconds": t.save_seconds,
            "bookkeeping_seconds": t.bookkeeping_seconds, "launch_seconds": t.launch_seconds,
            "launch_from_record": t.launch_from_record,
            "measured_launch_seconds": plan.measured_launch_seconds,
            "overrun": plan.overrun, "line": plan.cost_line(budget)}


def format_findings(result: dict[str, Any]) -> list[str]:
    lines = [f"yardstick (the pilot's noise on one evaluation): {result['yardstick']:.4g}"
             + ("" if result.get("yardstick_measured") else " (too few windows to measure: 0)")]
    for check in CHECKS:
        if check in result:
            lines.append(f"{check}: {result[check]['line']}")
    lines += [f"note: {n}" for n in result.get("notes") or []]
    return lines


def tune(run_dir: str | Path, checks: tuple[str, ...] = CHECKS, updates: int | None = None,
         budget: float = DEFAULT_BUDGET, data: str | Path | None = None, nproc: int | None = None,
         allow_overrun: bool = False, launch_seconds: float | None = None,
         out: TextIO = sys.stdout) -> dict[str, Any]:
    """Plan, state the cost, run, judge: the command's whole work; returns tune.json's content."""
    started = time.perf_counter()
    if not math.isfinite(budget) or budget <= 0:
        raise TuneError(f"--budget {budget}: must be a positive multiple of the pilot's updates")
    plan = plan_checks(run_dir, checks, updates, budget, allow_overrun, launch_seconds, nproc)
    print(f"[tune] {plan.cost_line(budget)}", file=out, flush=True)
    for note in plan.notes:
        print(f"[tune] note: {note}", file=out, flush=True)
    result = run_checks(plan, data=data, nproc=nproc, budget=budget, out=out, started=started)
    for line in format_findings(result):
        print(f"[tune] {line}", file=out, flush=True)
    return result
