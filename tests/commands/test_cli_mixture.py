"""`pilotrun train --data MIXTURE` with bad input: exit 2, one line naming what and where, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.commands.test_cli_bad_input import SMOKE, THREADS, run_cli, tree_hashes

BAD = {
    "zero": (
        "{edu}, weight: 0}}, {{path: {builtin}, weight: 1}}",
        "weight 0 must be a finite number above 0",
    ),
    "negative": ("{edu}, weight: -0.5}}, {{path: {builtin}, weight: 1}}", "weight -0.5 must be"),
    "nan": ("{edu}, weight: .nan}}, {{path: {builtin}, weight: 1}}", "weight nan must be"),
    "text": ("{edu}, weight: heavy}}, {{path: {builtin}, weight: 1}}", "weight 'heavy' is not a number"),
    "total": ("{edu}, weight: 1.0e+308}}, {{path: {builtin}, weight: 1.0e+308}}", "not a positive total"),
    "missing": ("{edu}, weight: 1}}, {{path: {builtin}/nothing, weight: 1}}", "data folder"),
    "twice": ("{edu}, weight: 1}}, {{path: {edu}/., weight: 1}}", "the same folder twice"),
    "tokenizers": ("{builtin}, weight: 1}}, {{path: {other}, weight: 1}}", "differ in tokenizer sha256"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_mixture_is_one_line_exit_2_and_nothing_written(case, mixture_sources, tmp_path, capsys):
    entries, said = BAD[case]
    mixture = tmp_path / "mix.yaml"
    mixture.write_text("mixture: [{path: " + entries.format(**{k: str(v) for k, v in mixture_sources.items()})
                       + "]\n")
    before = tree_hashes(tmp_path)
    code, err = run_cli(capsys, ["train", "--config", SMOKE, "--data", str(mixture), "--run-dir",
                                 str(tmp_path / "run"), *THREADS])
    assert code == 2 and len(err) == 1 and said in err[0] and str(mixture) in err[0], err
    assert tree_hashes(tmp_path) == before and not Path(tmp_path / "run").exists()
    if case == "tokenizers":
        assert "builtin" in err[0] and "other" in err[0]


def test_a_file_that_is_not_a_mixture_is_named(tmp_path, capsys):
    not_mixture = tmp_path / "notes.txt"
    not_mixture.write_text("just some words\n")
    code, err = run_cli(capsys, ["train", "--config", SMOKE, "--data", str(not_mixture), "--run-dir",
                                 str(tmp_path / "run"), *THREADS])
    assert code == 2 and len(err) == 1 and "a mixture file is a mapping" in err[0]
    assert not (tmp_path / "run").exists()


def test_pilot_takes_a_mixture_file_as_its_data_and_checks_it_first(mixture_sources, tmp_path):
    import io

    from pilotrun.commands.pilot import _prepare_data
    from pilotrun.common.errors import DataError
    from tests.conftest import write_mixture

    mixture = write_mixture(
        tmp_path / "mix.yaml", [(mixture_sources["edu"], 1), (mixture_sources["builtin"], 2)]
    )
    out = io.StringIO()
    assert _prepare_data(tmp_path / "work", mixture, "builtin", "bpe:512", out) == mixture
    assert "using the data mixture" in out.getvalue() and not (tmp_path / "work").exists()
    bad = write_mixture(tmp_path / "bad.yaml", [(mixture_sources["edu"], 0)])
    with pytest.raises(DataError, match="weight 0"):
        _prepare_data(tmp_path / "work", bad, "builtin", "bpe:512", io.StringIO())
