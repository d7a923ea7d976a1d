"""pilotrun/training/callbacks/window_log.py: when a window closes into a `train` event, and the rare events
after an update."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.run.record import read_metrics_strict
from pilotrun.training.callbacks.base import LoopState, UpdateResult
from pilotrun.training.callbacks.window_log import RareEventsCallback, WindowLogCallback
from pilotrun.training.loop import train_loop
from pilotrun.training.precision import UpdateOutcome
from pilotrun.training.signals import StopSignals
from pilotrun.training.timing import TimeAccount
from pilotrun.training.trainer import Trainer
from tests.training.callbacks.test_base import loop_state

ROOT = Path(__file__).resolve().parents[3]


def test_a_window_closes_on_its_cadence_before_a_checkpoint_and_at_the_last_round():
    callback = WindowLogCallback(log_every=5, checkpoint_every=3)
    assert callback.due(loop_state(step=5)) and callback.due(loop_state(step=3))
    assert not callback.due(loop_state(step=4)) and not callback.due(loop_state(step=5, applied=False))
    final = loop_state(step=4)
    final.final = True
    assert callback.due(final)


def test_rare_events_are_due_after_a_restart_a_skip_or_a_hook_event():
    callback = RareEventsCallback()
    loop = loop_state(step=4)
    assert not callback.due(loop)
    loop.update.restarted = 1
    assert callback.due(loop)
    assert callback.due(loop_state(step=4, applied=False))
    loop = loop_state(step=4)
    loop.update.hook_events.append({"layer": 0})
    assert callback.due(loop)
    loop.update = None
    assert not callback.due(loop)


@pytest.mark.slow
def test_train_events_partition_the_session_into_windows(builtin_data_dir, tmp_path):
    config = load_run_config(ROOT / "configs" / "smoke.yaml", [
        "train.num_threads=1", "train.max_steps=7", "train.log_every=3", "train.eval_every=0",
        "train.checkpoint_every=0"])
    session = Trainer(config, builtin_data_dir, tmp_path / "run", progress=False, out=io.StringIO()).session
    loop = LoopState(session, TimeAccount(), StopSignals(), io.StringIO())
    try:
        train_loop(loop, [WindowLogCallback(log_every=3, checkpoint_every=0)])
    finally:
        session.metrics.close()
        session.release_lock()
    trains = [e for e in read_metrics_strict(tmp_path / "run") if e["event"] == "train"]
    assert [e["step"] for e in trains] == [3, 6, 7] and loop.logged_step == 7
    assert [e["window"]["updates_applied"] for e in trains] == [3, 3, 1]
    assert sum(e["window"]["train_seconds"] for e in trains) == loop.account.time_split()["train_seconds"]
    assert loop.window.attempted == 0  # a fresh window after the last close


@pytest.mark.slow
def test_an_overflow_event_names_the_skip(builtin_data_dir, tmp_path):
    session = Trainer(
        load_run_config(ROOT / "configs" / "smoke.yaml", ["train.num_threads=1"]),
        builtin_data_dir,
        tmp_path / "run",
        progress=False,
        out=io.StringIO(),
    ).session
    loop = LoopState(session, TimeAccount(), StopSignals(), io.StringIO())
    loop.update = UpdateResult(
        UpdateOutcome(False, "overflow", float("inf"), False, 1024.0, 512.0), restarted=1
    )
    RareEventsCallback().after_update(loop)
    session.metrics.close()
    session.release_lock()
    events = read_metrics_strict(tmp_path / "run")
    assert [e["event"] for e in events] == ["data_restart", "overflow"]
    assert events[1]["loss_scale_before"] == 1024.0 and events[1]["loss_scale_after"] == 512.0
    assert session.state.data_restarts == 1



@pytest.mark.slow
def test_progress_written_to_a_file_is_one_plain_line_per_window(builtin_data_dir, tmp_path):
    # stderr into a file (nohup, slurm): "auto" gives plain lines, never carriage-return redraws.
    import os
    import subprocess
    import sys

    log = tmp_path / "train.log"
    with open(log, "w") as err:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pilotrun",
                "train",
                "--config",
                "smoke",
                "--data",
                str(builtin_data_dir),
                "--run-dir",
                str(tmp_path / "run"),
                "--set",
                "train.num_threads=1",
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.DEVNULL,
            stderr=err,
            timeout=300,
        )
    assert done.returncode == 0
    text = log.read_text()
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("train: step ")]
    windows = [e["step"] for e in read_metrics_strict(tmp_path / "run") if e["event"] == "train"]
    assert [int(line.split()[2].split("/")[0]) for line in lines] == windows == [1, 2, 3, 4, 5, 6]
    assert all(line.split()[2].endswith("/6") and " loss=" in line and " ETA " in line for line in lines)
    assert lines[-1].endswith(" ETA 0 s")  # the last window: nothing left


def test_plain_progress_is_the_bar_interface_as_lines():
    from pilotrun.training.callbacks.window_log import PlainProgress

    now = [100.0]
    out = io.StringIO()
    bar = PlainProgress(total=10, initial=4, out=out, clock=lambda: now[0])
    now[0] = 106.0
    bar.update(2)
    bar.set_postfix_str("loss=1.0000", refresh=True)
    bar.close()
    assert out.getvalue() == "train: step 6/10 loss=1.0000 ETA 12 s\n"  # 4 updates left at 3 s each


def test_plain_progress_is_one_line_per_window_each_with_its_eta_however_close_the_windows():
    """The promise of `--progress plain` and of a log file: one line per window (train.log.every), each with
    the ETA at this session's wall-clock rate, however fast the windows come; nothing twice at the end."""
    from pilotrun.training.callbacks.window_log import PlainProgress

    now = [0.0]
    out = io.StringIO()
    bar = PlainProgress(total=10, initial=0, out=out, clock=lambda: now[0])
    for step in range(1, 10):  # a window per update, four seconds apart, then one 0.5 s after the previous
        now[0] = 4.0 * step if step < 9 else 32.5
        bar.update(1)
        bar.set_postfix_str(f"loss={10 - step}.0000", refresh=True)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["train: step 1/10 loss=9.0000 ETA 36 s",  # 9 updates left at 4 s each
                         "train: step 2/10 loss=8.0000 ETA 32 s",
                         "train: step 3/10 loss=7.0000 ETA 28 s"]
    assert lines[-1] == f"train: step 9/10 loss=1.0000 ETA {32.5 / 9:.0f} s"  # 0.5 s later: still its line
    assert len(lines) == 9


def test_an_eta_reads_in_seconds_minutes_or_hours():
    from pilotrun.training.callbacks.window_log import eta_text

    assert [eta_text(s) for s in (None, 0.4, 99.4, 100.0, 5990.0, 6000.0, 86400.0)] == [
        "-", "0 s", "99 s", "1.7 min", "99.8 min", "1.7 h", "24.0 h"]
