"""Run identity through the real commands: a checkpoint copied in from a sibling run (same recipe, same or
another seed) is never resumed, whatever --allow-change says, and the verdict's final_checkpoint rule and
summarize name it as another run's. A marker older than run identity is accepted with a note."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.run.marker import MARKER_NAME, step_folder_name

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
RECIPE = ["train.num_threads=1", "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0",
          "train.keep_checkpoints=2"]


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _train(data: Path, run_dir: Path, *extra: str) -> tuple[int, str]:
    argv = ["train", "--config", str(SMOKE), "--data", str(data), "--run-dir", str(run_dir)]
    for item in RECIPE:
        argv += ["--set", item]
    return _run(argv + list(extra))


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["run_id"]


def _swap_checkpoint(source: Path, target: Path, step: int) -> None:
    folder = target / "checkpoints" / step_folder_name(step)
    shutil.rmtree(folder)
    shutil.copytree(source / "checkpoints" / step_folder_name(step), folder)


@pytest.fixture(scope="module")
def siblings(builtin_data_dir, tmp_path_factory):
    """Three finished runs of the same recipe: a, b (same seed as a) and c (another seed)."""
    root = tmp_path_factory.mktemp("siblings")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        code, err = _train(builtin_data_dir, root / name, "--set", f"train.seed={seed}")
        assert code == 0, err
    return root


def _copy_run(siblings: Path, name: str, tmp_path: Path) -> Path:
    run_dir = tmp_path / name
    shutil.copytree(siblings / name, run_dir)
    return run_dir


@pytest.mark.slow
def test_every_marker_names_its_run(siblings):
    for name in ("a", "b", "c"):
        marker = json.loads((siblings / name / "checkpoints" / step_folder_name(4) / MARKER_NAME).read_text())
        assert marker["run_id"] == _run_id(siblings / name) == marker["meta"]["run_id"]
    assert _run_id(siblings / "a") != _run_id(siblings / "b")


@pytest.mark.parametrize("sibling,extra", [("b", ()), ("c", ()), ("c", ("--allow-change", "train.seed"))])
def test_resume_from_a_siblings_checkpoint_is_refused(builtin_data_dir, siblings, tmp_path, sibling, extra):
    run_dir = _copy_run(siblings, "a", tmp_path)
    _swap_checkpoint(siblings / sibling, run_dir, 4)
    before = {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    code, err = _train(builtin_data_dir, run_dir, "--resume", "--set", "train.max_steps=6", *extra)
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert _run_id(siblings / sibling) in line and _run_id(run_dir) in line, line
    assert "another run" in line and "Traceback" not in err
    after = {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # a refused resume writes nothing


@pytest.mark.slow
def test_a_foreign_final_checkpoint_is_named_by_summarize_and_verdict(siblings, tmp_path):
    run_dir = _copy_run(siblings, "a", tmp_path)
    _swap_checkpoint(siblings / "c", run_dir, 4)
    code, _ = _run(["summarize", str(run_dir), "--require-step", "4", "--json"])
    assert code == 1
    code, _ = _run(["verdict", str(run_dir), "--json", "--no-resume-required"])
    assert code == 1
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    text = json.dumps(summary)
    assert "a checkpoint of another run" in text and _run_id(siblings / "c") in text
    assert "its marker names run" in text  # the chain-head check says what it found, not "rewritten"


@pytest.mark.slow
def test_a_marker_without_run_id_is_accepted_with_a_note(builtin_data_dir, siblings, tmp_path):
    run_dir = _copy_run(siblings, "a", tmp_path)
    path = run_dir / "checkpoints" / step_folder_name(4) / MARKER_NAME
    marker = json.loads(path.read_text())
    del marker["run_id"], marker["meta"]["run_id"]
    path.write_text(json.dumps(marker))
    code, err = _train(builtin_data_dir, run_dir, "--resume", "--set", "train.max_steps=5")
    assert code == 0, err
    notes = json.loads((run_dir / "run.json").read_text())["sessions"][-1]["notes"]
    assert any("records no run_id" in note for note in notes), notes
