"""pilotrun/run/tracker_tensorboard.py: classic scalars that `EventAccumulator(...).Scalars(tag)` reads, equal
to the float32 rounding of metrics.jsonl's values exactly; a resume's rolled-back steps once, with the kept
value; the converter replaces its own output and nothing else."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pilotrun.commands.cli import main
from pilotrun.run.record import read_metrics_strict
from pilotrun.run.sinks import guarded_tensorboard_sink
from pilotrun.run.tracker_tensorboard import TensorBoardSink
from tests.run.tracker_runs import (
    ROLLED_BACK,
    crashed_run,
    expected,
    identity,
    live_run,
    mirror_session_by_session,
    write_verdict,
)

pytest.importorskip("tensorboard")


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def text(log_dir, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator.Tensors(tag)[-1].tensor_proto.string_val[0].decode()


def as_float32(points: dict) -> dict:
    return {
        tag: [(step, float(np.float32(value))) for step, value in values] for tag, values in points.items()
    }


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        [s for s, _ in a[t]] == [s for s, _ in b[t]]
        and all(x == y or (math.isnan(x) and math.isnan(y)) for (_, x), (_, y) in zip(a[t], b[t])) for t in a)


@pytest.fixture(scope="module")
def live(builtin_data_dir, tmp_path_factory):
    return live_run(builtin_data_dir, tmp_path_factory.mktemp("tb") / "run", ["tensorboard"])


@pytest.mark.slow
def test_live_mirror_reads_back_as_classic_scalars(live):
    read = scalars(live / "tensorboard")
    assert {"train/loss", "train/tokens_seen", "val/loss", "checkpoint/step", "train/moe/maxvio/0"} <= set(
        read
    )
    assert equal(read, as_float32(expected(live)))
    losses = [e["loss"] for e in read_metrics_strict(live) if e["event"] == "train"]
    assert [v for _, v in read["train/loss"]] == [float(np.float32(x)) for x in losses]
    assert [s for s, _ in read["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in read["val/loss"]] == [2, 4]
    shown = text(live / "tensorboard", "run/identity")
    assert all(value in shown for value in identity(live).values())


def test_converted_run_equals_the_record_and_replaces_its_own_output(live, tmp_path, capsys):
    out = tmp_path / "tb"
    assert main(["tensorboard", str(live), "--out", str(out)]) == 0
    assert equal(scalars(out), as_float32(expected(live)))
    first = sorted(p.name for p in out.iterdir())
    assert main(["tensorboard", str(live), "--out", str(out)]) == 0  # again: its own output is replaced
    assert len(list(out.iterdir())) == 1 and sorted(p.name for p in out.iterdir()) != first
    assert equal(scalars(out), as_float32(expected(live)))
    (out / "notes.txt").write_text("mine")
    assert main(["tensorboard", str(live), "--out", str(out)]) == 2
    assert "other than TensorBoard event files" in capsys.readouterr().err
    assert main(["tensorboard", str(live), "--out", str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 2
    assert equal(scalars(out), as_float32(expected(live)))


def test_rolled_back_steps_show_once_with_the_kept_value_live_and_exported(tmp_path):
    run = crashed_run(tmp_path / "run")
    mirror_session_by_session(run, ["tensorboard"])
    want = as_float32(expected(run))
    every = expected(run, kept=False)
    # the record itself holds the redone steps twice
    assert len(every["train/loss"]) > len(want["train/loss"])
    live_read = scalars(run / "tensorboard")
    assert equal(live_read, want)
    steps = [s for s, _ in live_read["train/loss"]]
    assert len(steps) == len(set(steps)) and set(ROLLED_BACK) & set(steps)
    write_verdict(run)
    assert main(["export-metrics", str(run), "--to", "tensorboard", "--out", str(tmp_path / "exported")]) == 0
    exported = scalars(tmp_path / "exported")
    assert exported.pop("verdict/go") == [(60, 1.0)]
    assert exported.pop("verdict/loss_decreasing/figure") == [(60, float(np.float32(0.25)))]
    assert exported.pop("verdict/loss_decreasing/threshold") == [(60, float(np.float32(0.05)))]
    assert equal(exported, want)
    assert "GO" in text(tmp_path / "exported", "verdict/statement")


def test_sink_skips_unmirrored_events_and_needs_no_run(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write({"event": "session_start", "step": 0, "max_steps": 5, "resumed_from": None})
    sink.write({"event": "val", "step": 2, "loss": 1.5})
    sink.close()
    assert scalars(tmp_path / "tb") == {"val/step": [(2, 2.0)], "val/loss": [(2, 1.5)]}


def test_guarded_sink_writes_nothing_before_the_first_event(tmp_path):
    sink = guarded_tensorboard_sink(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()
    sink.close()
    assert sink.failure is None


def _tree(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else None


def test_exporting_a_damaged_record_is_refused_naming_the_line_and_writes_nothing(tmp_path, capsys):
    run = crashed_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[5] = lines[5].replace('"loss":', '"loss":1e-9,"x":', 1)  # an edit after the fact: the chain breaks
    (run / "metrics.jsonl").write_text("".join(lines))
    for tracker in ("tensorboard", "mlflow"):
        assert main(["export-metrics", str(run), "--to", tracker, "--out", str(tmp_path / "tb")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "damaged record, not exported: metrics.jsonl line 6" in err[0], err
    assert (
        not (tmp_path / "tb").exists() and not (run / "mlflow.db").exists() and not (run / "mlruns").exists()
    )


def test_exporting_onto_a_full_disk_leaves_the_previous_event_files_and_no_half_file(
    tmp_path, capsys, monkeypatch
):
    from pilotrun.run import tracker_tensorboard

    run = crashed_run(tmp_path / "run")
    assert main(["export-metrics", str(run), "--to", "tensorboard", "--out", str(tmp_path / "tb")]) == 0
    before = _tree(tmp_path / "tb")
    real, written = tracker_tensorboard.EventFile.add_event, []

    def disk_fills(self, event):
        if len(written) == 10:
            raise OSError(28, "No space left on device")
        written.append(event)
        real(self, event)

    monkeypatch.setattr(tracker_tensorboard.EventFile, "add_event", disk_fills)
    capsys.readouterr()
    assert main(["export-metrics", str(run), "--to", "tensorboard", "--out", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "No space left on device" in err[0] and "1 previous event file(s) kept" in err[0]
    ), err
    assert _tree(tmp_path / "tb") == before
    written.clear()
    assert main(["export-metrics", str(run), "--to", "tensorboard", "--out", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()  # a folder it made for the export goes with the half-written file


def test_a_read_only_event_folder_switches_the_live_mirror_off_with_one_warning_and_no_thread_traceback(
        tmp_path, monkeypatch):
    """A folder that refuses the new event file (read-only, immutable) fails where the session's first event
    is given: the guard warns once and the session goes on; no writer thread prints a traceback of its own."""
    import threading

    from pilotrun.run import tracker_tensorboard

    def refused(path, mode="r", *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(tracker_tensorboard, "open", refused, raising=False)
    hooked = []
    monkeypatch.setattr(threading, "excepthook", lambda args: hooked.append(args))
    sink = guarded_tensorboard_sink(tmp_path / "tb")
    with pytest.warns(RuntimeWarning, match="metrics sink 'tensorboard' failed .* PermissionError"):
        sink.write({"event": "session_start", "step": 4, "max_steps": 6, "resumed_from": 4})
    sink.write({"event": "val", "step": 5, "loss": 1.5})
    sink.close()
    assert sink.failure is not None and not hooked and list((tmp_path / "tb").iterdir()) == []
