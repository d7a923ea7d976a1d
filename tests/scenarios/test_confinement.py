"""Confinement through the real commands (cli.main in process): a link where verdict, freeze or export writes
is refused by name with the outside file or folder unchanged (hashed before and after); a verdict that fails
halfway (a full disk at the third plot) leaves the older report whole and no temp; what a killed freeze left
is named and removed by the next freeze."""

from __future__ import annotations

import contextlib
import hashlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.report.drawing import plots

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    assert "Traceback" not in text, text
    return code, text


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(builtin_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("confined") / "run"
    code, err = _run(
        [
            "train",
            "--config",
            str(SMOKE),
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(run_dir),
            "--set",
            "train.num_threads=1",
            "--set",
            "train.max_steps=2",
            "--set",
            "train.eval_every=0",
        ]
    )
    assert code == 0, err
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    return run_dir


@pytest.mark.slow
def test_verdict_refuses_a_linked_report_folder(run_copy, tmp_path):
    outside = tmp_path / "users-report"
    outside.mkdir()
    (outside / "report.html").write_text("the user's report")
    (outside / "loss.png").write_bytes(b"\x89PNG the user's plot")
    before = _tree(outside)
    (run_copy / "report").symlink_to(outside, target_is_directory=True)
    code, err = _run(["verdict", str(run_copy), "--no-resume-required"])
    assert code == 2
    assert f"{run_copy / 'report'} is a symbolic link" in err.strip().splitlines()[-1]
    assert _tree(outside) == before


@pytest.mark.slow
def test_a_verdict_that_fails_halfway_leaves_the_older_report_whole(run_copy, monkeypatch):
    assert _run(["verdict", str(run_copy), "--no-resume-required"])[0] in (0, 1)
    before = _tree(run_copy / "report")
    drawn = []
    real = plots.PLOTTERS["grad_norm"]

    def full_disk(summary, path):
        drawn.append(path)
        path.write_bytes(b"\x89PNG cut")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setitem(plots.PLOTTERS, "grad_norm", full_disk)
    code, err = _run(["verdict", str(run_copy), "--no-resume-required"])
    assert code == 2 and "No space left on device" in err
    assert drawn and real is not full_disk
    assert _tree(run_copy / "report") == before
    assert sorted(p.name for p in run_copy.iterdir() if p.name.startswith(".")) == []  # no temp left


@pytest.mark.slow
def test_freeze_refuses_a_link_at_out_and_names_a_killed_freezes_temp(run_copy, tmp_path):
    outside = tmp_path / "users-file"
    outside.write_text("keep me")
    (tmp_path / "linked.lock.json").symlink_to(outside)
    code, err = _run(
        ["freeze", str(run_copy), "--out", str(tmp_path / "linked.lock.json"), "--despite-no-go"]
    )
    assert code == 2 and "is a symbolic link" in err.strip().splitlines()[-1]
    assert outside.read_text() == "keep me"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    leftover = tmp_path / f".recipe.lock.json.tmp-{dead}"
    leftover.write_text("{half a lock")
    code, err = _run(
        ["freeze", str(run_copy), "--out", str(tmp_path / "recipe.lock.json"), "--despite-no-go"]
    )
    assert code == 0, err
    assert not leftover.exists() and str(leftover) in err


def test_export_refuses_a_link_at_out(run_copy, tmp_path):
    pytest.importorskip("safetensors")
    outside = tmp_path / "users-folder"
    outside.mkdir()
    (tmp_path / "linked-export").symlink_to(outside, target_is_directory=True)
    code, err = _run(["export", str(run_copy), "--out", str(tmp_path / "linked-export")])
    assert code == 2 and "is a symbolic link" in err.strip().splitlines()[-1]
    assert list(outside.iterdir()) == []


def test_sigterm_during_a_verdict_removes_its_temp_and_exits_143(run_copy, monkeypatch):
    import os
    import signal

    def terminated(summary, path):
        path.write_bytes(b"\x89PNG half")
        os.kill(os.getpid(), signal.SIGTERM)  # the real signal, delivered while the report is half written

    monkeypatch.setitem(plots.PLOTTERS, "grad_norm", terminated)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as ended:
        main(["verdict", str(run_copy), "--no-resume-required"])
    assert ended.value.code == 143
    assert not (run_copy / "report").exists()
    assert [p.name for p in run_copy.iterdir() if p.name.startswith(".")] == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the command's handler is put back
