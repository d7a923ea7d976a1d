"""The steps pilotrun puts in a datatrove pipeline: rows refused as `pilotrun prepare` refuses them, the split
rule, and a row datatrove's reader skips failing its task by file."""

from __future__ import annotations

import pytest

pytest.importorskip("datatrove")

import re  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from pilotrun.common.errors import DataError  # noqa: E402
from pilotrun.data.datatrove_steps import row_adapter  # noqa: E402
from tests.data.datatrove_helpers import prepare_fixture as _prepare  # noqa: E402


def test_a_row_the_reader_skips_fails_its_task_by_file(in_process, corpus, tmp_path, gpt2_tokenizer_path):
    with open(corpus / "part-2.jsonl", "a") as handle:
        handle.write('{"text": "cut off\n')  # datatrove's JsonlReader logs a warning and goes on
    with pytest.raises(DataError) as refused:
        _prepare(corpus, tmp_path / "dt", gpt2_tokenizer_path, tasks=3)
    assert "part-2.jsonl: the reader gave 50 of its 51 rows" in str(refused.value)
    assert re.search(r"task \d \(log [^)]*task_0000\d.log\)", str(refused.value))
    assert not (tmp_path / "dt").exists()




def test_row_adapter_refuses_what_prepare_refuses_and_keeps_blank_rows_for_the_count():
    reader = SimpleNamespace(text_key="text")
    with pytest.raises(DataError, match=r"f.jsonl: row 3: no field 'text' \(fields: body\)"):
        row_adapter(reader, {"body": "x"}, "f.jsonl", 3)
    with pytest.raises(DataError, match="field 'text' is int, not text"):
        row_adapter(reader, {"text": 7}, "f.jsonl", 0)
    assert row_adapter(reader, {"text": None}, "f.jsonl", 4) == {
        "text": " ",
        "id": "f.jsonl#4",
        "metadata": {},
    }
    assert row_adapter(reader, {"text": "hi"}, "a#b.jsonl", 5)["id"] == "a#b.jsonl#5"
