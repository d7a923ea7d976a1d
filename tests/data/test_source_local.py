"""pilotrun/data/source_local.py: local files and globs (hashed, sorted, named relative to their folder), read
in bounded batches, and a clear line for every file it cannot read."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pilotrun.common.errors import DataError
from pilotrun.data.sources import open_source


def test_parquet_and_jsonl_fixtures_give_the_same_documents(fineweb_jsonl, fineweb_parquet, fineweb_texts):
    from_jsonl = list(open_source(str(fineweb_jsonl)).documents())
    from_parquet = open_source(str(fineweb_parquet))
    assert from_jsonl == list(from_parquet.documents()) == fineweb_texts
    record = from_parquet.identity["files"][0]
    assert record["name"] == fineweb_parquet.name
    assert record["sha256"] == hashlib.sha256(fineweb_parquet.read_bytes()).hexdigest()


def test_glob_is_sorted_and_files_are_named_relative(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub" / "c.jsonl").write_text('{"body": "third"}\n\n{"body": "  "}\n{"body": null}\n')
    source = open_source(str(tmp_path / "**" / "*.*"), text_field="body")
    assert list(source.documents()) == ["first", "second", "third"]
    assert source.skipped_empty == 2
    assert [f["name"] for f in source.identity["files"]] == ["a.txt", "b.txt", "sub/c.jsonl"]
    assert str(tmp_path) not in json.dumps(source.identity)


def test_text_field_errors_name_file_and_line(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: no field 'text'"):
        list(open_source(str(tmp_path / "x.jsonl")).documents())
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "y.parquet")
    with pytest.raises(DataError, match=r"y\.parquet: no column 'text'.*--text-field"):
        list(open_source(str(tmp_path / "y.parquet")).documents())
    (tmp_path / "z.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"z\.jsonl:1: not valid JSON"):
        list(open_source(str(tmp_path / "z.jsonl")).documents())


def test_missing_or_unsupported_inputs(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        open_source(str(tmp_path / "nope.parquet"))
    with pytest.raises(DataError, match="matches no files"):
        open_source(str(tmp_path / "*.jsonl"))
    (tmp_path / "table.csv").write_text("text\n")
    with pytest.raises(DataError, match="not a .parquet, .jsonl or .txt"):
        open_source(str(tmp_path / "table.csv"))
    with pytest.raises(DataError, match="is a folder"):
        open_source(str(tmp_path))


def test_parquet_is_read_without_pre_buffering(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "a.parquet")
    opened = []
    original = pq.ParquetFile

    def recording(*args, **kwargs):
        opened.append(kwargs.get("pre_buffer", True))
        return original(*args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", recording)
    assert list(open_source(str(tmp_path / "a.parquet")).documents()) == ["one", "two"]
    assert opened[-1] is False  # the reading pass (the footer-only open at open_source may use the default)


def _texts(tmp_path, table) -> list:
    pq.write_table(table, tmp_path / "t.parquet")
    return [text for _, text in open_source(str(tmp_path / "t.parquet"), "text").positioned(None)]


def test_a_dictionary_encoded_string_column_is_read(tmp_path):
    column = pa.array(["one document", "another", "one document"]).dictionary_encode()
    assert _texts(tmp_path, pa.table({"text": column})) == ["one document", "another", "one document"]


def test_invalid_utf8_in_a_string_column_is_one_line_naming_the_rows(tmp_path):
    column = pa.array([b"fine", b"bad \xff\xfe bytes"], type=pa.binary()).view(pa.string())
    with pytest.raises(
        DataError, match=r"t\.parquet: column 'text', row group 0, rows 0\.\.1: not valid UTF-8"
    ):
        _texts(tmp_path, pa.table({"text": column}))


@pytest.mark.parametrize(
    ("column", "named"),
    [
        (pa.array([["a", "b"]], pa.list_(pa.string())), "list<"),
        (pa.array([["a"]], pa.large_list(pa.string())), "large_list<"),
        (pa.array([{"t": "a"}], pa.struct([("t", pa.string())])), "struct<"),
    ],
)
def test_a_text_column_of_lists_or_records_is_one_line_naming_its_type(tmp_path, column, named):
    pq.write_table(pa.table({"text": column}), tmp_path / "x.parquet")
    with pytest.raises(DataError, match=rf"x\.parquet: column 'text' has type {named}.*>, not string"):
        list(open_source(str(tmp_path / "x.parquet")).documents())
