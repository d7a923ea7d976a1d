"""The trainer's observers, on real tiny runs: the profiler window (train.profile) and the metrics sinks
(train.tensorboard, and sinks passed through the Python API).

Three runs of the same recipe, pinned to one intra-op thread so that they are bit-identical: a plain one, one
profiled at steps 8 and 9, and one mirrored to TensorBoard beside a sink that fails at its first write.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import signal
import warnings
from pathlib import Path

import pytest

from pilotrun.commands import api
from pilotrun.config import load_run_config
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.record_check.time_split import SPLIT_PHASES
from pilotrun.report.verdict.thresholds import Thresholds
from pilotrun.report.verdict.verdict import rule_throughput_steady
from pilotrun.run.record import PHASES, dumps_line, read_metrics_strict
from pilotrun.training.callbacks.profiling import profile_folder
from pilotrun.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
# Ten updates, one train window each (smoke's log_every 1), so that the throughput rule has windows to compare
# once the warm-up window and the two profiled ones are left out.
RECIPE = ["train.num_threads=1", "train.max_steps=10", "optim.schedule.horizon=10", "train.eval_every=5",
          "train.checkpoint_every=5"]
PROFILED = ["train.profile.start_step=8", "train.profile.steps=2", "train.profile.top_operators=500"]
# What differs between two identical runs: identity, clocks, the figures measured from clocks or the OS, and a
# checkpoint's size (its files hold the run's own recipe and identity, which differ in length between runs).
VARYING = {
    "time",
    "session_id",
    "chain",
    "_line",
    "path",
    "run_json_sha256",
    "throughput",
    "memory",
    "time_split",
    "seconds",
    "train_seconds",
    "wall_seconds",
    "cpu_seconds",
    "profile_seconds",
    "bytes",
    "involuntary_switches",
    "other_cpu_seconds",
    "blocking_seconds",
    "background_seconds",
    "total_seconds",
    "waited_seconds",
    "hashed_at",  # a shard check's wall time, like `time`
    "setup_seconds",  # a session_start's: the command's start to the line
}


def config(*overrides: str):
    return load_run_config(ROOT / "configs" / "smoke.yaml", [*RECIPE, *overrides])


def stable(value, also: frozenset[str] = frozenset()):
    """An event with the fields that vary between identical runs (and those named in `also`) removed,
    recursively."""
    if isinstance(value, dict):
        return {k: stable(v, also) for k, v in value.items() if k not in VARYING and k not in also}
    if isinstance(value, list):
        return [stable(v, also) for v in value]
    return value


def as_written(event: dict) -> dict:
    """An event as metrics.jsonl holds it once read back, without the reader's and the chain's fields."""
    return {k: v for k, v in event.items() if k not in ("_line", "chain")}


@pytest.fixture(scope="module")
def plain_run(builtin_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("observers") / "plain"
    result = Trainer(config(), builtin_data_dir, run_dir, progress=False).run()
    assert result.reason == "completed"
    return run_dir


@pytest.fixture(scope="module")
def profiled_run(builtin_data_dir, tmp_path_factory):
    import io

    run_dir = tmp_path_factory.mktemp("observers") / "profiled"
    out = io.StringIO()
    result = Trainer(config(*PROFILED), builtin_data_dir, run_dir, progress=False, out=out).run()
    assert result.reason == "completed"
    return run_dir, out.getvalue()


class FailingSink:
    """A tracker whose every write raises (a full disk, a server down)."""

    def __init__(self):
        self.writes = 0
        self.closed = False

    def write(self, event):
        self.writes += 1
        raise OSError("tracker unreachable")

    def close(self):
        self.closed = True


class RecordingSink:
    def __init__(self):
        self.events: list[dict] = []
        self.closed = False

    def write(self, event):
        self.events.append(event)

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def mirrored_run(builtin_data_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("observers") / "mirrored"
    failing, recording = FailingSink(), RecordingSink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = api.train(
            config(),
            data=builtin_data_dir,
            run_dir=run_dir,
            overrides=["train.tensorboard=true"],
            sinks=[failing, recording],
        )
    return run_dir, result, failing, recording, [w for w in caught if issubclass(w.category, RuntimeWarning)]


# ---------------------------------------------------------------------------------------------- profiler
@pytest.mark.slow
def test_profiled_run_writes_trace_and_table_and_trains_exactly_as_an_unprofiled_one(profiled_run, plain_run):
    run_dir, out = profiled_run
    folder = profile_folder(run_dir, 8)
    assert sorted(p.name for p in folder.iterdir()) == ["top_operators-rank0.json", "top_operators-rank0.txt",
                                                         "trace-rank0.json"]
    assert not list((run_dir / "profile").glob(".tmp-*"))
    table = json.loads((folder / "top_operators-rank0.json").read_text())
    assert (table["start_step"], table["update_attempts"], table["device"]) == (8, 2, "cpu")
    # torch.optim records one range per optimizer step: exactly the two profiled updates, not the other eight.
    assert sum(row["calls"] for row in table["operators"] if row["name"].startswith("Optimizer.step#")) == 2
    assert any(
        e.get("name") == "aten::mm"
        for e in json.loads((folder / "trace-rank0.json").read_text())["traceEvents"]
    )
    assert f"profile: 3 file(s) in {folder}" in out
    # Profiling observes: every loss, counter and statistic equals the plain run's (only the marks differ).
    marks = frozenset({"profiled_attempts", "profiled_tokens"})
    assert stable(read_metrics_strict(run_dir), marks) == stable(read_metrics_strict(plain_run), marks)


def test_profiled_attempts_are_the_profile_phase_and_the_phases_add_up_to_the_wall_clock(profiled_run):
    run_dir, out = profiled_run
    events = read_metrics_strict(run_dir)
    trains = [e for e in events if e["event"] == "train"]
    split = [e for e in events if e["event"] == "session_end"][-1]["time_split"]
    assert split["profile_seconds"] > 0 and split["report_seconds"] > 0
    assert sum(split[f"{phase}_seconds"] for phase in PHASES) == pytest.approx(
        split["wall_seconds"], rel=1e-9
    )
    # The windows partition the training seconds and the profile seconds alike.
    assert split["train_seconds"] == pytest.approx(
        sum(e["window"]["train_seconds"] for e in trains), rel=1e-9
    )
    assert split["profile_seconds"] == pytest.approx(
        sum(e["window"]["profile_seconds"] for e in trains), rel=1e-9
    )
    profiled = {e["step"]: e["window"] for e in trains if e["window"]["profiled_attempts"]}
    assert sorted(profiled) == [8, 9]
    for step, window in profiled.items():
        assert (window["profiled_attempts"], window["profiled_tokens"], window["tokens"]) == (1, 128, 128)
        assert 0 < window["profile_seconds"] <= window["wall_seconds"]
        # The whole window ran under the profiler: no training-phase tokens, so no training-only figure.
        throughput = next(e for e in trains if e["step"] == step)["throughput"]
        assert throughput["train_tokens_per_s"] is None and throughput["achieved_flops_per_s"] is None
        assert throughput["wall_tokens_per_s"] > 0
    assert all(e["window"]["profile_seconds"] == 0.0 for e in trains if e["step"] not in profiled)
    end_line = next(line for line in out.splitlines() if line.startswith("session_end:"))
    assert all(f" {phase} " in end_line for phase in PHASES)


def test_summarize_accounts_the_profiled_run(profiled_run):
    run_dir, _ = profiled_run
    summary = summarize_run(run_dir)
    assert summary.valid, summary.reasons
    (session,) = summary.sessions
    trains = [e for e in summary.kept_events if e["event"] == "train"]
    assert session.profile_seconds > 0
    assert sum(getattr(session, k) for k in SPLIT_PHASES) == pytest.approx(session.wall_seconds, rel=1e-9)
    # Training-only throughput: the training phase's tokens (8 unprofiled updates) over its seconds.
    assert session.train_tokens_per_s == pytest.approx(8 * 128 / session.train_seconds, rel=1e-12)
    assert summary.overall["train_tokens_per_s"] == pytest.approx(8 * 128 / session.train_seconds, rel=1e-12)
    assert session.train_seconds == pytest.approx(sum(e["window"]["train_seconds"] for e in trains), rel=1e-9)


def test_throughput_rule_leaves_the_profiled_windows_out(profiled_run):
    run_dir, _ = profiled_run
    summary = summarize_run(run_dir)
    result = rule_throughput_steady(summary, Thresholds())
    # Ten windows: the session's first (warm-up) and the two profiled ones are left out, seven compared.
    assert result.evidence.startswith(
        "training-only tokens/s of 7 train windows (each session's first left out, "
        "and 2 with profiled updates)"
    )

    def with_profiled_windows(change) -> dict:
        edited = copy.deepcopy(summary)
        for event in edited.kept_events:
            if event["event"] == "train" and event["window"]["profiled_attempts"]:
                change(event["window"])
        return dataclasses.asdict(rule_throughput_steady(edited, Thresholds()))

    def absurdly_fast(window):
        window["train_seconds"] = 1e-9

    # Whatever the profiled windows' figures, the rule's result is the same: they are not read.
    assert with_profiled_windows(absurdly_fast) == dataclasses.asdict(result)

    def unmarked_and_absurdly_fast(window):
        window["profiled_attempts"] = window["profiled_tokens"] = 0
        absurdly_fast(window)

    # Control: the same windows, were they not marked, would be compared (steps 8 and 9 in the last third).
    control = with_profiled_windows(unmarked_and_absurdly_fast)
    assert control["evidence"].startswith("training-only tokens/s of 9 train windows")
    assert control["figure"] != result.figure


# ---------------------------------------------------------------------------------------------- sinks
@pytest.mark.slow
def test_live_tensorboard_scalars_equal_the_recorded_values_exactly(mirrored_run):
    pytest.importorskip("tensorboard")
    import numpy as np

    from tests.run.test_tracker_tensorboard import as_float32
    from tests.run.test_tracker_tensorboard import scalars as read_back
    from tests.run.tracker_runs import expected, same

    run_dir, result, *_ = mirrored_run
    assert result.reason == "completed" and result.step == 10
    events = read_metrics_strict(run_dir)
    scalars = read_back(run_dir / "tensorboard")
    assert {"train/loss", "val/loss", "train/grad_norm", "train/moe/maxvio/0", "checkpoint/step"} <= set(
        scalars
    )
    # TensorBoard's classic scalars hold float32: each value is the recorded one rounded to float32, exactly.
    assert same(scalars, as_float32(expected(run_dir)))
    assert [value for _, value in scalars["train/loss"]] == [float(np.float32(e["loss"])) for e in events
                                                              if e["event"] == "train"]
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, 11))


def test_a_failing_sink_warns_once_and_changes_neither_training_nor_the_record(mirrored_run, plain_run):
    run_dir, result, failing, recording, caught = mirrored_run
    assert result.reason == "completed" and result.step == 10
    assert failing.writes == 1  # switched off after its first failure
    assert len(caught) == 1 and "metrics sink 'FailingSink' failed" in str(caught[0].message)
    assert "tracker unreachable" in str(caught[0].message)
    # metrics.jsonl is what a run without sinks writes: losses, counters and every statistic equal exactly.
    mirrored, plain = read_metrics_strict(run_dir), read_metrics_strict(plain_run)
    assert [e["event"] for e in mirrored] == [e["event"] for e in plain]
    assert stable(mirrored) == stable(plain)
    assert [e["loss"] for e in mirrored if e["event"] == "train"] == [
        e["loss"] for e in plain if e["event"] == "train"
    ]


def test_a_sink_passed_through_the_api_receives_every_event_as_recorded(mirrored_run):
    run_dir, _, failing, recording, _ = mirrored_run
    recorded = [as_written(e) for e in read_metrics_strict(run_dir)]
    assert [json.loads(dumps_line(e)) for e in recording.events] == recorded
    assert recording.events[0]["event"] == "session_start" and recording.events[-1]["event"] == "session_end"
    assert recording.closed and not failing.closed  # a sink switched off is not called again, close included
    split = recording.events[-1]["time_split"]
    assert sum(split[f"{phase}_seconds"] for phase in PHASES) == pytest.approx(
        split["wall_seconds"], rel=1e-9
    )


# ---------------------------------------------------------------------------------------------- cut short
class StopAtStep:
    """A sink that asks the trainer to stop (as its SIGTERM handler does) when it sees the train event of
    `step`."""

    def __init__(self, step: int):
        self.step, self.trainer = step, None

    def write(self, event):
        if event["event"] == "train" and event["step"] == self.step:
            self.trainer.signals.request(signal.SIGTERM)

    def close(self):
        pass


@pytest.mark.slow
def test_a_signal_inside_the_profiler_window_still_writes_what_it_saw(builtin_data_dir, tmp_path):
    stopper = StopAtStep(3)
    trainer = Trainer(config("train.profile.start_step=2", "train.profile.steps=5"), builtin_data_dir,
                      tmp_path / "run", progress=False, sinks=[stopper])
    stopper.trainer = trainer
    result = trainer.run()
    # The stop is seen after the next update (4): attempts 2, 3 and 4 ran under the profiler, then the session
    # ended before the window's five and wrote them.
    assert (result.reason, result.exit_code, result.step) == ("interrupted", 143, 4)
    table = json.loads((profile_folder(tmp_path / "run", 2) / "top_operators-rank0.json").read_text())
    assert table["update_attempts"] == 3
    events = read_metrics_strict(tmp_path / "run")
    split = events[-1]["time_split"]
    assert events[-1]["reason"] == "interrupted"
    assert sum(split[f"{phase}_seconds"] for phase in PHASES) == pytest.approx(
        split["wall_seconds"], rel=1e-9
    )
    windows = [e["window"] for e in events if e["event"] == "train"]
    assert [w["profiled_attempts"] for w in windows] == [0, 1, 1, 1]
    # Writing the files came after the last window closed: in the session's profile seconds, in no window's.
    assert split["profile_seconds"] > sum(w["profile_seconds"] for w in windows) > 0
    assert split["train_seconds"] == pytest.approx(sum(w["train_seconds"] for w in windows), rel=1e-9)


@pytest.mark.slow
def test_an_error_inside_the_profiler_window_still_writes_what_it_saw(
    builtin_data_dir, tmp_path, monkeypatch
):
    from pilotrun.training import loop as loop_module

    trainer = Trainer(config("train.profile.start_step=2", "train.profile.steps=5"), builtin_data_dir,
                      tmp_path / "run", progress=False)
    real_update = loop_module.train_one_update

    def failing_update(loop):
        result = real_update(loop)
        if loop.session.state.step == 3:
            raise RuntimeError("planted failure after update 3")
        return result

    monkeypatch.setattr(loop_module, "train_one_update", failing_update)
    with pytest.raises(RuntimeError, match="planted failure"):
        trainer.run()
    table = json.loads((profile_folder(tmp_path / "run", 2) / "top_operators-rank0.json").read_text())
    assert table["start_step"] == 2 and table["update_attempts"] == 1  # the failing attempt never completed
    end = read_metrics_strict(tmp_path / "run")[-1]
    assert end["event"] == "session_end" and end["reason"] == "error" and "planted failure" in end["message"]
    split = end["time_split"]
    assert split["profile_seconds"] > 0
    assert sum(split[f"{phase}_seconds"] for phase in PHASES) == pytest.approx(
        split["wall_seconds"], rel=1e-9
    )


def test_a_tracker_whose_package_is_missing_is_refused_before_anything_is_written(builtin_data_dir, tmp_path,
                                                                                monkeypatch):
    import importlib.util

    from pilotrun.common.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"train.trackers: wandb needs the wandb package: pip install 'pilotrun\[wandb\]'"
    ):
        Trainer(config("train.trackers=[wandb]"), builtin_data_dir, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
