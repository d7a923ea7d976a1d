"""Every path argument of every command given a path of the wrong kind, through the real command line (in
process): a file where a folder is expected is named "is a file, not a folder", a folder where a file is
expected "is a folder, not a file"; one line on stderr, exit 2, no traceback, never "does not exist", and the
path given is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from tests.commands.test_cli_bad_input import run_cli, tree_hashes

FOLDER, FILE = "folder", "file"
# Each command's argv with X where the path under test goes; the other paths need not exist (the kind of every
# path is checked before the command reads anything).
CASES = [
    (["prepare", "--out", "X"], FOLDER),
    (["prepare", "--out", "{new}", "--source", "X"], FILE),
    (["data", "verify", "X"], FOLDER),
    (["data", "merge", "--out", "X", "{missing}", "{missing}"], FOLDER),
    (["data", "merge", "--out", "{new}", "{missing}", "X"], FOLDER),
    (["train", "--config", "X", "--data", "{missing}", "--run-dir", "{new}"], FILE),
    (["train", "--frozen", "X", "--data", "{missing}", "--run-dir", "{new}"], FILE),
    # train --data takes a folder or a mixture file: a file is read as a mixture
    # (tests/commands/test_cli_mixture.py)
    (["train", "--config", "smoke", "--data", "{missing}", "--run-dir", "X"], FOLDER),
    (["train", "--config", "smoke", "--data", "{missing}", "--run-dir", "X", "--resume"], FOLDER),
    (["inspect-batch", "X", "--step", "1"], FOLDER),
    (["summarize", "X"], FOLDER),
    (["verdict", "X"], FOLDER),
    (["freeze", "X", "--out", "{new}"], FOLDER),
    (["freeze", "{missing}", "--out", "X"], FILE),
    (["watch", "X"], FOLDER),
    (["watch", "{missing}", "--against", "X"], FILE),
    (["pilot", "--workdir", "X"], FOLDER),
    (["pilot", "--workdir", "{new}", "--config", "X"], FILE),
    (["pilot", "--workdir", "{new}", "--freeze", "X"], FILE),
    (["export", "X", "--out", "{new}"], FOLDER),
    (["export", "{missing}", "--out", "X"], FOLDER),
    (["tensorboard", "X"], FOLDER),
    (["tensorboard", "{missing}", "--out", "X"], FOLDER),
    (["export-metrics", "X", "--to", "tensorboard"], FOLDER),
    (["export-metrics", "{missing}", "--to", "tensorboard", "--out", "X"], FOLDER),
    (["config", "--config", "X"], FILE),
]


def _case_id(case) -> str:
    argv, expected = case
    return (
        "-".join(a.strip("-") for a in argv[: argv.index("X") + 1] if not a.startswith("{"))
        + f"-wants-{expected}"
    )


def _wrong_kind(tmp_path: Path, expected: str) -> Path:
    """A file where a folder is expected, a folder (holding a file) where a file is expected."""
    if expected == FOLDER:
        path = tmp_path / "a-file"
        path.write_text("not a folder\n")
    else:
        path = tmp_path / "a-folder"
        path.mkdir()
        (path / "inside").write_text("kept\n")
    return path


@pytest.mark.parametrize("argv,expected", CASES, ids=[_case_id(c) for c in CASES])
def test_a_path_of_the_wrong_kind_is_named_as_such(tmp_path, capsys, argv, expected):
    wrong = _wrong_kind(tmp_path, expected)
    before = tree_hashes(tmp_path)
    filled = [
        str(wrong) if a == "X" else str(tmp_path / a.strip("{}")) if a.startswith("{") else a for a in argv
    ]
    code, err = run_cli(capsys, filled)
    said = "is a file, not a folder" if expected == FOLDER else "is a folder, not a file"
    assert code == 2 and len(err) == 1 and err[0].startswith("pilotrun: error:"), err
    assert f"{wrong} {said}" in err[0] and "does not exist" not in err[0] and "not found" not in err[0]
    assert tree_hashes(tmp_path) == before


def test_a_path_under_a_file_names_the_file(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = run_cli(capsys, ["summarize", str(blocker / "run")])
    assert code == 2 and len(err) == 1 and f"{blocker} is a file, not a folder" in err[0]


def test_a_packaged_recipe_name_is_not_taken_for_a_folder_of_that_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").mkdir()  # `--config smoke` names the packaged recipe, not this folder
    assert main(["config", "--config", "smoke", "--json"]) == 0
    assert '"key"' in capsys.readouterr().out


def test_a_tokenizer_folder_without_a_tokenizer_json_says_so(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    code, err = run_cli(
        capsys, ["prepare", "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "model")]
    )
    assert code == 2 and len(err) == 1 and "a folder without a tokenizer.json" in err[0]
    assert not (tmp_path / "out").exists()
