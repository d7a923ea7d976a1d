"""pilotrun/run/sinks.py: a failing sink warns once and never raises; a tracker whose package is missing is
one line before anything is written; `train.trackers` is checked; export-metrics refuses what it cannot do."""

from __future__ import annotations

import builtins
import math
import warnings

import pytest

from pilotrun.commands.cli import main
from pilotrun.common.errors import ConfigError
from pilotrun.config import TrainConfig, load_run_config
from pilotrun.run.mirror import kept_history, scalar_fields
from pilotrun.run.sinks import (
    GuardedSink,
    check_trackers_available,
    guarded_tensorboard_sink,
    tracker_sinks,
)


def test_scalar_fields_paths_and_non_finite_strings():
    event = {"event": "train", "time": 1.0, "session_id": "s", "step": 3, "loss": "NaN", "ok": True,
             "nested": {"a": [1, 2.5], "name": "unknown", "none": None}, "_line": 4}
    fields = dict(scalar_fields(event))
    assert fields.keys() == {"train/step", "train/loss", "train/nested/a/0", "train/nested/a/1"}
    assert math.isnan(fields["train/loss"]) and fields["train/nested/a/1"] == 2.5


def test_kept_history_drops_what_a_resume_rolled_back():
    events = [{"event": "session_start", "step": 0, "resumed_from": None},
              *({"event": "train", "step": s, "loss": float(s)} for s in (1, 2, 3)),
              {"event": "checkpoint", "step": 2}, {"event": "session_start", "step": 2, "resumed_from": 2},
              {"event": "train", "step": 3, "loss": 30.0}]
    kept = kept_history(events)
    assert [(e["event"], e["step"], e.get("loss")) for e in kept] == [
        ("train", 1, 1.0), ("train", 2, 2.0), ("checkpoint", 2, None), ("train", 3, 30.0)]


class Exploding:
    def __init__(self):
        self.calls = 0

    def write(self, event):
        self.calls += 1
        event["loss"] = -1.0  # a sink that mutates what it gets must not touch the caller's record
        raise OSError("No space left on device")

    def close(self):
        raise OSError("still full")


def test_failing_sink_warns_once_and_leaves_the_record_alone():
    inner = Exploding()
    sink = GuardedSink("exploding", lambda: inner)
    record = {"event": "train", "step": 1, "loss": 2.0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            sink.write(record)
        sink.close()
    assert [str(w.message).count("No space left") for w in caught] == [1]
    assert inner.calls == 1 and record == {"event": "train", "step": 1, "loss": 2.0}


def without(monkeypatch, *packages):
    """Imports and module look-ups of `packages` fail, as where they are not installed."""
    import importlib.util

    real_import, real_find = builtins.__import__, importlib.util.find_spec

    def fake_import(name, *args, **kwargs):
        if name.split(".")[0] in packages:
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in packages else real_find(name, *a))


def test_sink_that_cannot_open_warns_once(tmp_path, monkeypatch):
    without(monkeypatch, "tensorboard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink = guarded_tensorboard_sink(tmp_path / "tb")
        sink.write({"event": "train", "step": 1, "loss": 1.0})
        sink.close()
    assert len(caught) == 1 and "pilotrun[tensorboard]" in str(caught[0].message)
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("name,package", [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio"),
                                          ("tensorboard", "tensorboard")])
def test_a_missing_tracker_package_is_one_line(monkeypatch, name, package):
    without(monkeypatch, package)
    with pytest.raises(ConfigError) as caught:
        check_trackers_available(["tensorboard", name] if name != "tensorboard" else [name])
    message = str(caught.value)
    assert "\n" not in message and f"pip install 'pilotrun[{name}]'" in message and package in message


def test_export_metrics_with_a_missing_package_exits_2_before_writing(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    without(monkeypatch, "wandb")
    assert main(["export-metrics", str(tmp_path), "--to", "tensorboard", "--to", "wandb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pilotrun[wandb]" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_export_metrics_refuses_a_non_run_and_an_unknown_tracker(tmp_path, capsys):
    assert main(["export-metrics", str(tmp_path / "nothing"), "--to", "tensorboard"]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    assert main(["export-metrics", str(tmp_path), "--to", "neptune"]) == 2


def test_trackers_config_key():
    # The alias train.tensorboard is folded into train.trackers when the recipe is loaded
    # (config.loaded_recipe): what configured_trackers(train) added at the sinks is now the list itself, and
    # the alias reads back false.
    config = load_run_config(None, ["train.trackers=[wandb, mlflow]", "train.tensorboard=true"])
    assert (config.train.log.trackers, config.train.log.tensorboard) == (
        ["tensorboard", "wandb", "mlflow"],
        False,
    )
    assert TrainConfig().log.trackers == [] and not TrainConfig().log.tensorboard
    folded = load_run_config(None, ["train.trackers=[wandb, tensorboard]", "train.tensorboard=true"])
    # named already: kept where it was, not twice
    assert folded.train.log.trackers == ["wandb", "tensorboard"]
    with pytest.raises(ConfigError, match="unknown tracker 'neptune'"):
        load_run_config(None, ["train.trackers=[neptune]"])
    with pytest.raises(ConfigError, match="twice"):
        load_run_config(None, ["train.trackers=[wandb, wandb]"])
    with pytest.raises(ConfigError, match="unknown tracker"):
        check_trackers_available(["neptune"])


def test_tracker_sinks_are_guarded_and_write_nothing_before_the_session(tmp_path):
    sinks = tracker_sinks(["tensorboard"], tmp_path / "run")
    assert [type(s).__name__ for s in sinks] == ["GuardedSink"] and not (tmp_path / "run").exists()
    for sink in sinks:
        sink.close()
