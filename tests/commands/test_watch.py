"""pilotrun watch: a live run's stall found within two of its window intervals (a real CPU run stopped with
SIGSTOP), a healthy run watched to its end with exit 0, a loss made to rise by an allowed LR change on resume,
an edited line, --on-alert's JSON, bad input, and never a byte of the run folder changed."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.commands.freeze import freeze_run
from pilotrun.run.folder_lock import live_holder
from tests.report.synthetic import SyntheticRun, crashed_and_resumed

ROOT = Path(__file__).resolve().parents[2]


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _alerts(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_an_edited_line_raises_the_chain_alert_and_on_alert_gets_each_alert_as_json(tmp_path, capsys):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines) if '"event":"train"' in line and '"step":45' in line)
    lines[number] = lines[number].replace('"loss":', '"loss":0.5,"was":', 1)
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    before = _hashes(run_dir)
    received = tmp_path / "received.jsonl"
    code = main(["watch", str(run_dir), "--json", "--on-alert", f"cat >> {received}; echo >> {received}"])
    printed = _alerts(capsys.readouterr().out)
    assert code == 1
    chain = [a for a in printed if a["kind"] == "chain"]
    assert (
        chain
        and f"metrics.jsonl line {number + 1} (train, step 45): hash chain broken" in chain[0]["message"]
    )
    assert _alerts(received.read_text()) == printed  # once per alert, each valid JSON on stdin
    assert _hashes(run_dir) == before


def test_an_allowed_lr_change_on_resume_that_makes_the_loss_rise_raises_the_loss_alert(tmp_path, capsys):
    pilot = crashed_and_resumed(tmp_path / "pilot")
    pilot.write()
    assert freeze_run(tmp_path / "pilot", tmp_path / "lock.json", target_steps=120)[0] == 0
    run = SyntheticRun(tmp_path / "long", max_steps=120)
    run.run["recipe"]["train"]["max_steps"] = pilot.max_steps  # the lock's recipe; max_steps raised by --set
    run.start_session()
    run.train_until(40)
    run.end_session("interrupted")
    base = run.loss
    run.loss = lambda step: base(step) + (3.0 if step > 40 else 0.0)  # the new LR makes the loss rise
    run.resume(from_step=40)
    run.run["allowed_changes"].append({"session_id": run.session_id, "key": "optim.adamw.lr", "old": 1e-3,
                                       "new": 1e-2})
    run.train_until(60)
    run.end_session()
    run.write()
    before = _hashes(tmp_path / "long")
    code = main(["watch", str(tmp_path / "long"), "--against", str(tmp_path / "lock.json"), "--json"])
    alerts = _alerts(capsys.readouterr().out)
    assert code == 1
    loss = {a["kind"]: a for a in alerts if a["kind"] in ("loss_spike", "loss_envelope")}
    assert set(loss) == {"loss_spike", "loss_envelope"}, alerts
    for alert in loss.values():
        assert alert["step"] == 45 and alert["figure"] > alert["bound"]
    assert _hashes(tmp_path / "long") == before


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["watch", str(tmp_path / "empty")]) == 2
    crashed_and_resumed(tmp_path / "pilot").write()
    assert freeze_run(tmp_path / "pilot", tmp_path / "lock.json")[0] == 0
    crashed_and_resumed(tmp_path / "other", batch_size=4).write()
    assert main(["watch", str(tmp_path / "other"), "--against", str(tmp_path / "lock.json")]) == 2
    assert main(["watch", str(tmp_path / "pilot"), "--interval", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("pilotrun: error:")]
    assert len(errors) == 3 and len(err) == 3, err
    assert "is the lock for another recipe" in errors[1] or "another recipe" in errors[1]
    assert "train.batch_size" in errors[1]


def test_a_finished_healthy_run_is_exit_0(tmp_path, capsys):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    assert main(["watch", str(run_dir), "--follow"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_live_run_stopped_with_sigstop_is_a_stall_within_two_windows_and_then_finishes(builtin_data_dir,
                                                                                           tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    steps = ["train.max_steps=300", "optim.schedule.horizon=300", "train.log_every=10", "train.eval_every=0",
             "train.checkpoint_every=0", "train.num_threads=1"]
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pilotrun",
            "train",
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(run_dir),
            *[a for s in steps for a in ("--set", s)],
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watcher = None
    try:
        def train_lines() -> int:
            path = run_dir / "metrics.jsonl"
            return path.read_text().count('"event":"train"') if path.is_file() else 0

        deadline = time.monotonic() + 300  # hang guards only: every wait ends on what the processes write
        while train_lines() < 3 and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.02)
        # The tiny smoke model is neither balanced nor unclipped after a few dozen updates: those rules'
        # bounds are relaxed so that the healthy part of the run is judged healthy; the stall is what is
        # tested.
        watcher = subprocess.Popen(
            [sys.executable, "-m", "pilotrun", "watch", str(run_dir), "--follow", "--keep-going", "--json",
             "--stall-windows", "1.5", "--threshold", "max_clip_rate=1", "--threshold", "max_imbalance=100"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        printed: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [printed.put(line) for line in watcher.stdout], daemon=True).start()
        assert "watching" in watcher.stderr.readline()
        seen = train_lines()
        while train_lines() < seen + 2 and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.02)
        assert trainer.poll() is None, "the run ended before it could be stopped"
        trainer.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        frozen = _hashes(run_dir)
        while True:
            alert = json.loads(printed.get(timeout=120))
            if alert["kind"] == "stall" and alert["time"] >= stopped_at:
                break
        assert live_holder(run_dir)["pid"] == trainer.pid  # the trainer holds its lock; watch never took it
        assert _hashes(run_dir) == frozen  # watch read the stopped live run and wrote nothing into it
        interval = alert["extra"]["interval_seconds"]
        assert alert["extra"]["stall_windows"] == 1.5 and alert["extra"]["windows"] > 1.5
        assert (alert["time"] - stopped_at) / interval <= 2.0, alert  # counted in the run's own windows
        trainer.send_signal(signal.SIGCONT)
        assert trainer.wait(timeout=300) == 0, trainer.stderr.read()
        assert watcher.wait(timeout=300) == 0, watcher.stderr.read()
    finally:
        for process in (trainer, watcher):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()


def test_one_look_at_a_healthy_live_run_prints_one_status_line(tmp_path, capsys):
    from pilotrun.run.folder_lock import RunFolderLock

    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(30)
    shift = time.time() - run.events[-1]["time"]  # its last line written just now
    for record in run.events + run.run["sessions"]:
        record["time" if "time" in record else "started_at"] += shift
    run_dir = run.write()
    lock = RunFolderLock.acquire(run_dir)  # a session holds the run: it is live
    try:
        assert main(["watch", str(run_dir)]) == 0
    finally:
        lock.release()
    captured = capsys.readouterr()
    assert captured.out == ""  # no alert
    (status,) = [line for line in captured.err.splitlines() if line.startswith("status: ")]
    assert status.startswith(f"status: step 30/60  loss {run.loss(30):.4f}  ") and " ETA " in status
    assert "ETA -" not in status and status.endswith("(live: a session holds the run; 0 alert(s) standing)")


def test_one_look_before_the_first_window_shows_the_rules_waiting_not_failed(tmp_path, capsys):
    """A live session that has not closed its first window: exit 0, no alert, and the status line names each
    rule still waiting with what it waits for."""
    from pilotrun.run.folder_lock import RunFolderLock

    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    shift = time.time() - run.events[-1]["time"]
    for record in run.events + run.run["sessions"]:
        record["time" if "time" in record else "started_at"] += shift
    run_dir = run.write()
    lock = RunFolderLock.acquire(run_dir)
    try:
        assert main(["watch", str(run_dir)]) == 0
    finally:
        lock.release()
    captured = capsys.readouterr()
    assert captured.out == ""
    (status,) = [line for line in captured.err.splitlines() if line.startswith("status: ")]
    assert "0 alert(s) standing); rules waiting for their evidence, not failed: losses_finite (for a train " \
           "window); " in status and "skip_rate (for a train window)" in status


def test_a_resume_on_another_thread_count_is_one_note_on_stderr_and_no_alert(tmp_path, capsys):
    run = crashed_and_resumed(tmp_path / "r")
    entry = next(e for e in run.run["sessions"] if e["session_id"] == "s2")
    entry["not_exact"] = {
        "from_update": 21,
        "changes": [{"key": "hardware.torch_threads", "old": 1, "new": 2}],
    }
    run_dir = run.write()
    main(["watch", str(run_dir), "--json"])
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("note: ")]
    assert (
        notes
        == [
            line
            for line in notes
            if "session s2 resumed across hardware.torch_threads 1 -> 2 from update "
            "21: bit-exact continuation is not promised from there" in line
        ]
        and len(notes) == 1
    )
    assert "torch_threads" not in captured.out  # not an alert


def test_an_on_alert_command_past_its_timeout_is_named_with_its_wait_and_watch_goes_on(tmp_path, capsys,
                                                                                      monkeypatch):
    from pilotrun.commands import watch

    run_dir = crashed_and_resumed(tmp_path / "r").write()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[5] = lines[5].replace('"loss":', '"loss":0.5,"was":', 1)
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    monkeypatch.setattr(watch, "ON_ALERT_TIMEOUT_SECONDS", 0.2)
    assert main(["watch", str(run_dir), "--on-alert", "sleep 30"]) == 1
    captured = capsys.readouterr()
    timeouts = [line for line in captured.err.splitlines() if "--on-alert" in line]
    assert timeouts and all(
        line == f"pilotrun watch: --on-alert command 'sleep 30' did not finish within 0.2 s for "
        f"the chain alert at step {line.split('at step ')[1].split(':')[0]}: it was stopped; "
        "watch goes on"
        for line in timeouts
    ), timeouts
    assert len(timeouts) == captured.out.count("ALERT ")  # each alert was delivered, each command waited for


def test_an_interval_past_a_day_is_one_line_exit_2_not_a_sleep_that_overflows(tmp_path, capsys):
    crashed_and_resumed(tmp_path / "pilot").write()
    for interval in ("1e308", "86401"):
        assert main(["watch", str(tmp_path / "pilot"), "--follow", "--interval", interval]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "at most 86400 s (a day) between looks" in err[0], err


def test_an_on_alert_command_past_its_timeout_is_stopped_with_what_it_started(tmp_path, capsys, monkeypatch):
    """The command's shell starts a child that would outlive it: at the timeout the command's whole process
    group is stopped, so nothing it started runs on after watch said it was stopped."""
    from pilotrun.commands import watch

    run_dir = crashed_and_resumed(tmp_path / "r").write()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[5] = lines[5].replace('"loss":', '"loss":0.5,"was":', 1)
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    monkeypatch.setattr(watch, "ON_ALERT_TIMEOUT_SECONDS", 0.5)
    pids = tmp_path / "pids"
    assert main(["watch", str(run_dir), "--on-alert", f"sleep 60 & echo $! >> {pids}; wait"]) == 1
    assert "it was stopped; watch goes on" in capsys.readouterr().err
    started = [int(pid) for pid in pids.read_text().split()]
    assert started
    for pid in started:
        for _ in range(100):  # the kill is delivered at once; its reaping by init may take a moment
            if not running(pid):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the on-alert command's child {pid} outlived its timeout")


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, killed and waiting to be reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def test_follow_waits_for_a_run_still_starting_and_ends_with_the_status_line(tmp_path, capsys, monkeypatch):
    from pilotrun.commands import watch

    run_dir = tmp_path / "starting"
    looks = []

    def sleep(_seconds):  # the run's set-up ends while watch waits: its record appears
        looks.append(_seconds)
        if len(looks) == 2:
            crashed_and_resumed(run_dir).write()

    monkeypatch.setattr(watch.time, "sleep", sleep)
    assert main(["watch", str(run_dir), "--follow"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "waiting" in line] == [f"waiting for {run_dir} to start: no run.json yet"]
    assert err[-2].startswith(f"completed: {run_dir}") and err[-1].startswith("status: "), err


def test_follow_keeps_going_past_an_alert_and_exits_1_at_the_end_while_it_stands(tmp_path, capsys):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[5] = lines[5].replace('"loss":', '"loss":0.5,"was":', 1)
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    assert main(["watch", str(run_dir), "--follow"]) == 1
    captured = capsys.readouterr()
    assert "ALERT " in captured.out and f"completed: {run_dir}" in captured.err
    assert main(["watch", str(run_dir), "--follow", "--stop-at-alert"]) == 1
    captured = capsys.readouterr()
    assert "ALERT " in captured.out and "completed:" not in captured.err
