"""pilotrun/run/sinks.py: TensorBoard scalars read back equal the metrics.jsonl values exactly; a failing sink
warns once and never raises; `pilotrun tensorboard RUN` converts a finished run."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.config import load_run_config
from pilotrun.run.record import read_metrics_strict as read_metrics
from pilotrun.run.sinks import (
    MIRRORED_EVENTS,
    GuardedSink,
    TensorBoardSink,
    guarded_tensorboard_sink,
    scalar_fields,
)
from pilotrun.training.trainer import Trainer

pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_run(builtin_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sinks") / "run"
    config = load_run_config(ROOT / "configs" / "smoke.yaml", ["train.num_threads=1", "train.max_steps=4",
                                                                "train.eval_every=2", "train.checkpoint_every=2"])
    Trainer(config, builtin_data_dir, run_dir, progress=False).run()
    return run_dir


def read_back(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files: tag -> [(step, value)] in write order, values as stored (float64)."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(log_dir), size_guidance={TENSORS: 0})
    accumulator.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in accumulator.Tensors(tag)]
            for tag in accumulator.Tags()["tensors"]}


def expected_scalars(events: list[dict]) -> dict[str, list[tuple[int, float]]]:
    expected: dict[str, list[tuple[int, float]]] = {}
    for event in events:
        if event["event"] in MIRRORED_EVENTS:
            for tag, value in scalar_fields(event):
                expected.setdefault(tag, []).append((event["step"], value))
    return expected


def same(a: dict, b: dict) -> bool:
    """Exact equality, NaN equal to NaN (the record may carry non-finite figures)."""
    if a.keys() != b.keys():
        return False
    return all(len(a[t]) == len(b[t]) and all(sa == sb and (va == vb or (math.isnan(va) and math.isnan(vb)))
                                              for (sa, va), (sb, vb) in zip(a[t], b[t])) for t in a)


def test_converted_scalars_equal_the_jsonl_values_exactly(tiny_run, tmp_path):
    out = tmp_path / "tb"
    assert main(["tensorboard", str(tiny_run), "--out", str(out)]) == 0
    events = read_metrics(tiny_run)
    scalars = read_back(out)
    expected = expected_scalars(events)
    assert {"train/loss", "val/loss", "train/grad_norm", "train/moe/maxvio/0", "checkpoint/step"} <= set(scalars)
    assert same(scalars, expected)
    losses = [e["loss"] for e in events if e["event"] == "train"]
    assert [value for _, value in scalars["train/loss"]] == losses  # the full-precision float, bit for bit
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4]


def test_live_sink_mirrors_events_as_written(tiny_run, tmp_path):
    events = read_metrics(tiny_run)
    sink = guarded_tensorboard_sink(tmp_path / "live")
    for event in events:
        sink.write(event)
    sink.close()
    assert sink.failure is None
    assert same(read_back(tmp_path / "live"), expected_scalars(events))


def test_scalar_fields_paths_and_non_finite_strings():
    event = {"event": "train", "time": 1.0, "session_id": "s", "step": 3, "loss": "NaN", "ok": True,
             "nested": {"a": [1, 2.5], "name": "unknown", "none": None}}
    fields = dict(scalar_fields(event))
    assert fields.keys() == {"train/step", "train/loss", "train/nested/a/0", "train/nested/a/1"}
    assert math.isnan(fields["train/loss"]) and fields["train/nested/a/1"] == 2.5


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


def test_sink_that_cannot_open_warns_once(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink = guarded_tensorboard_sink(tmp_path / "tb")
        sink.write({"event": "train", "step": 1, "loss": 1.0})
        sink.close()
    assert len(caught) == 1 and "pilotrun[tensorboard]" in str(caught[0].message)
    assert not (tmp_path / "tb").exists()


def test_convert_refuses_an_occupied_folder_and_a_non_run(tiny_run, tmp_path, capsys):
    out = tmp_path / "tb"
    out.mkdir()
    (out / "other").write_text("x")
    assert main(["tensorboard", str(tiny_run), "--out", str(out)]) == 2
    assert main(["tensorboard", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not an empty folder" in err[0] and "metrics.jsonl" in err[1]
    assert [p.name for p in out.iterdir()] == ["other"]


def test_tensorboard_sink_skips_unmirrored_events(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write({"event": "session_start", "step": 0, "max_steps": 5})
    sink.write({"event": "val", "step": 2, "loss": 1.5})
    sink.close()
    assert read_back(tmp_path / "tb") == {"val/step": [(2, 2.0)], "val/loss": [(2, 1.5)]}
