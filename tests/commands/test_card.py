"""pilotrun/commands/card.py: the card is written for a valid record only, and a record that cannot be
summarized, or a folder that cannot take the card, is one line on stderr, never a traceback."""

from __future__ import annotations

from pilotrun.commands.card import refresh_card, write_card
from pilotrun.report.record_check.report_card import CARD_NAME, report_card
from pilotrun.report.record_check.summarize import summarize_run
from tests.report.synthetic import crashed_and_resumed


def test_a_valid_record_gets_its_card_and_an_invalid_one_none(tmp_path):
    crashed_and_resumed(tmp_path / "r").write()
    summary = summarize_run(tmp_path / "r")
    assert write_card(summary, "pilotrun summarize") == str(tmp_path / "r" / CARD_NAME)
    assert (tmp_path / "r" / CARD_NAME).read_text() == report_card(summary)
    summary.valid = False
    (tmp_path / "r" / CARD_NAME).unlink()
    assert write_card(summary, "pilotrun summarize") is None
    assert not (tmp_path / "r" / CARD_NAME).exists()


def test_refresh_writes_the_card_of_a_fresh_summary_and_names_a_folder_that_holds_no_run(tmp_path, capsys):
    crashed_and_resumed(tmp_path / "r").write()
    assert refresh_card(str(tmp_path / "r"), "pilotrun evaluate") == str(tmp_path / "r" / CARD_NAME)
    assert (tmp_path / "r" / CARD_NAME).read_text() == report_card(summarize_run(tmp_path / "r"),
                                                                  "pilotrun evaluate")
    assert refresh_card(str(tmp_path / "none"), "pilotrun evaluate") is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("report card not written: "), err
