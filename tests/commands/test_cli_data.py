"""The data commands through the command line: prepare's number options, prepare then verify, and merge."""

from __future__ import annotations

import json

import pytest

from pilotrun.commands.cli import main


@pytest.mark.parametrize("flag, value", [("--shard-tokens", "0"), ("--train-tokens", "1.5"),
                                         ("--shard-tokens", "inf")])
def test_counts_must_be_positive_whole_numbers_one_line_exit_2(tmp_path, capsys, flag, value):
    assert main(["prepare", "--out", str(tmp_path / "d"), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pilotrun: error: {flag} must be a positive whole number, got {float(value)}"]
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.partial").exists()


def test_prepare_then_verify_then_merge_with_itself_is_refused_by_name(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["prepare", "--out", str(out), "--tokenizer", "bpe:300", "--train-tokens", "4000",
                 "--shard-tokens", "2048"]) == 0
    assert json.loads((out / "metadata.json").read_text())["splits"]["train"]["tokens"] >= 4000
    assert main(["data", "verify", str(out)]) == 0
    capsys.readouterr()
    merged = tmp_path / "merged"
    # The same data given twice would be read twice per epoch: refused in one line, nothing written.
    assert main(["data", "merge", "--out", str(merged), str(out), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "are the same data" in err[0] and "each would be read twice" in err[0]
    assert not merged.exists()
