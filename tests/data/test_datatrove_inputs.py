"""What `prepare --engine datatrove` reads: bad input refused before any task starts (one line, exit 2,
nothing written), and each file's record (sha256, rows) as `pilotrun prepare` counts it."""

from __future__ import annotations

import pytest

pytest.importorskip("datatrove")

import hashlib  # noqa: E402
import os  # noqa: E402

from pilotrun.commands.cli import main  # noqa: E402
from pilotrun.data import datatrove_inputs  # noqa: E402
from pilotrun.data.datatrove_inputs import file_record, resolve_inputs  # noqa: E402


def _refused_one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case, expected", [
    ("builtin", "reads local .parquet or .jsonl files, not 'builtin'"),
    ("missing", "no such file"),
    ("txt", "is not a .parquet or .jsonl file"),
    ("mixed", "one kind of file per run"),
    ("field", "no field 'body'"),
    ("bpe", "train it once with `pilotrun prepare`"),
    ("cap", "--train-tokens is not taken by --engine datatrove"),
    ("fraction", "--val-fraction must be in [0, 1)"),
    ("slurm", "--executor slurm needs --slurm-partition"),
    ("tokenizer", "no such file"),
    ("exists", "already exists"),
])
def test_bad_input_is_refused_before_any_task_with_nothing_written(capsys, tmp_path, corpus, fineweb_parquet,
                                                                   gpt2_tokenizer_path, case, expected):
    source, tokenizer, extra = str(corpus / "*.jsonl"), str(gpt2_tokenizer_path), []
    if case == "builtin":
        source = "builtin"
    elif case == "missing":
        source = str(tmp_path / "nowhere.jsonl")
    elif case == "txt":
        (corpus / "notes.txt").write_text("a document")
        source = str(corpus / "*")
    elif case == "mixed":
        os.symlink(fineweb_parquet, corpus / "more.parquet")
        source = str(corpus / "*")
    elif case == "field":
        extra = ["--text-field", "body"]
    elif case == "bpe":
        tokenizer = "bpe:512"
    elif case == "cap":
        extra = ["--train-tokens", "1000"]
    elif case == "fraction":
        extra = ["--val-fraction", "1.5"]
    elif case == "slurm":
        extra = ["--executor", "slurm"]
    elif case == "tokenizer":
        tokenizer = str(tmp_path / "missing-tokenizer.json")
    elif case == "exists":
        (tmp_path / "out").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    err = _refused_one_line(capsys, ["prepare", "--engine", "datatrove", "--out", str(tmp_path / "out"),
                                     "--source", source, "--tokenizer", tokenizer, *extra])
    assert expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_datatrove_options_are_refused_with_the_pilotrun_engine(capsys, tmp_path):
    err = _refused_one_line(capsys, ["prepare", "--out", str(tmp_path / "out"), "--tasks", "4"])
    assert "--tasks is an option of --engine datatrove" in err and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("flag,value", [("--shuffle-buffer", "5"), ("--shuffle-buffer-bytes", "1000"),
                                        ("--progress", "plain")])
def test_pilotrun_engine_options_are_refused_with_datatrove(capsys, tmp_path, flag, value):
    err = _refused_one_line(capsys, ["prepare", "--engine", "datatrove", "--out", str(tmp_path / "out"),
                                     "--source", "x.jsonl", "--tokenizer", "gpt2", flag, value])
    assert f"{flag} has no effect with --engine datatrove" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []




def test_file_record_counts_non_blank_lines_across_read_chunks(monkeypatch, tmp_path):
    monkeypatch.setattr(datatrove_inputs, "READ_BYTES", 3)
    data = b'{"text": "a"}\n\n  \n{"text": "b"}\r\n{"text": "c"}'
    (tmp_path / "f.jsonl").write_bytes(data)
    record = file_record(str(tmp_path / "f.jsonl"), "f.jsonl", "jsonl")
    assert record == {
        "name": "f.jsonl",
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "rows": 3,
    }


def test_files_are_dealt_to_tasks_in_a_seeded_order(corpus):  # noqa: F811
    inputs = resolve_inputs(str(corpus / "*.jsonl"), "text", seed=0)
    assert inputs.names == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
    assert sorted(inputs.ordered_names()) == inputs.names
    assert (
        inputs.task_names(0, 2) + inputs.task_names(1, 2)
        == inputs.ordered_names()[0::2] + inputs.ordered_names()[1::2]
    )
    assert resolve_inputs(str(corpus / "*.jsonl"), "text", seed=0).order == inputs.order
    assert inputs.order_record(2)["tasks"] == 2 and inputs.identity()["files"] == inputs.names
