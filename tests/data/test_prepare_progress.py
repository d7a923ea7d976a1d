"""prepare's progress: a total known up front for local files (so the bar has an ETA), a bar that never runs
past its total, and a warning when val is smaller than one evaluation of the packaged stability recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pilotrun.data.prepare import _progress_bar, small_val_warnings
from pilotrun.data.reader import tokens_per_evaluation
from pilotrun.data.sources import open_source


def write_sources(folder: Path) -> tuple[Path, Path]:
    texts = ["first document", "", "third", "   ", "fifth and last"]  # two empty ones: skipped but counted
    jsonl = folder / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "\n")  # a trailing blank line
    parquet = folder / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), parquet)
    return jsonl, parquet


def test_local_sources_know_their_document_count(tmp_path):
    jsonl, parquet = write_sources(tmp_path)
    assert open_source(str(jsonl)).expected_documents == 5
    assert open_source(str(parquet)).expected_documents == 5
    (tmp_path / "a.txt").write_text("one document")
    (tmp_path / "b.txt").write_text("another")
    assert open_source(str(tmp_path / "*.txt")).expected_documents == 2
    builtin = open_source("builtin")
    assert builtin.expected_documents == builtin.identity["documents"]


@pytest.mark.parametrize("which", [0, 1])
def test_document_bar_reaches_exactly_its_total_on_a_full_pass(tmp_path, which):
    opened = open_source(str(write_sources(tmp_path)[which]))
    bar, position = _progress_bar(None, opened, progress=False)
    read = sum(1 for _ in opened.documents())
    assert (read, opened.skipped_empty) == (3, 2)
    assert bar.total == 5
    assert position(0, read) == bar.total


def test_capped_bar_never_passes_its_total():
    bar, position = _progress_bar(1000, None, progress=False)
    assert bar.total == 1000
    assert position(999, 5) == 999
    assert position(1311, 7) == 1000  # the last document carried the count past the cap


def test_small_val_warning_against_the_stability_recipe():
    needed = tokens_per_evaluation(batch_size=8, seq_len=64, eval_batches=3)  # configs/stability.yaml
    assert small_val_warnings(needed) == []
    assert len(small_val_warnings(needed - 1)) == 1
    assert len(small_val_warnings(0)) == 1


def test_prepare_warns_when_its_val_split_is_smaller_than_one_evaluation(tmp_path, capsys):
    from pilotrun.commands.cli import main

    for i in range(40):  # 40 one-line documents: a tenth of them is far less than one stability evaluation
        (tmp_path / f"d{i:02d}.txt").write_text(
            f"Document {i} talks about the weather and the hills near town {i}."
        )
    out = tmp_path / "data"
    assert main(["prepare", "--out", str(out), "--source", str(tmp_path / "*.txt"), "--tokenizer", "bpe:300",
                 "--val-fraction", "0.1"]) == 0
    val_tokens = json.loads((out / "metadata.json").read_text())["splits"]["val"]["tokens"]
    assert 0 < val_tokens < tokens_per_evaluation(batch_size=8, seq_len=64, eval_batches=3)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"pilotrun prepare: warning: {small_val_warnings(val_tokens)[0]}"]


@pytest.mark.slow
def test_prepare_into_a_file_writes_plain_progress_lines_and_no_carriage_return(tmp_path, fineweb_jsonl,
                                                                               gpt2_tokenizer_path):
    # `pilotrun prepare ... > log 2>&1` as under nohup or slurm: --progress auto sees no terminal.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "prepare.log"
    with open(log, "w") as handle:
        code = subprocess.call([sys.executable, "-m", "pilotrun", "prepare", "--out", str(tmp_path / "data"),
                                "--source", str(fineweb_jsonl), "--tokenizer", str(gpt2_tokenizer_path),
                                "--workers", "1"], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                               stdout=handle, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert code == 0, text
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("prepare (documents): ")]
    assert lines and lines[-1].startswith("prepare (documents): 150/150 doc (100%), "), text
    assert "docs 150" in lines[-1]


def test_prepare_progress_none_is_silent_and_bar_redraws(
    tmp_path, capsys, fineweb_jsonl, gpt2_tokenizer_path
):
    from pilotrun.commands.cli import main

    common = ["--source", str(fineweb_jsonl), "--tokenizer", str(gpt2_tokenizer_path), "--workers", "1"]
    assert main(["prepare", "--out", str(tmp_path / "quiet"), "--progress", "none", *common]) == 0
    err = capsys.readouterr().err
    assert "prepare (documents)" not in err
    assert main(["prepare", "--out", str(tmp_path / "bar"), "--progress", "bar", *common]) == 0
    assert "\r" in capsys.readouterr().err  # asked for the bar: drawn even off a terminal
