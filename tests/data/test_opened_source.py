"""pilotrun/data/opened_source.py: a source's reading units visited in a seeded order, each document keeping
its position in the source's own order, and what the manifest records of that order."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from pilotrun.data.sources import open_source


def test_parquet_row_groups_are_units_read_in_a_seeded_order(tmp_path):
    texts = [f"doc {i}" for i in range(100)]
    pq.write_table(pa.table({"text": texts[:60]}), tmp_path / "a.parquet", row_group_size=10)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[60:]))
    source = open_source(str(tmp_path / "*.*"))
    assert [u.name for u in source.units] == [f"a.parquet#{g}" for g in range(6)] + ["b.jsonl"]
    assert [u.start for u in source.units] == [0, 10, 20, 30, 40, 50, 60] and source.expected_documents == 100
    natural = list(source.positioned(None))
    assert natural == list(enumerate(texts))
    mixed = list(source.positioned(order_seed=1))
    assert sorted(mixed) == natural and mixed != natural
    assert all(texts[position] == text for position, text in mixed)  # each keeps its source position
    assert list(source.positioned(order_seed=1)) == mixed and list(source.positioned(order_seed=2)) != mixed
    record = source.order_record(1)
    assert record["units"] == 7 and record["shuffled"] and len(record["order_sha256"]) == 64
    assert source.order_record(None) == {"units": 7, "shuffled": False}
