"""pilotrun/data/source_hub.py: the fineweb-edu spec, and its rows through the hub seam at the resolved
commit."""

from __future__ import annotations

import pytest

from pilotrun.common.errors import DataError
from pilotrun.data.source_hub import parse_fineweb_spec
from pilotrun.data.sources import open_source

from .conftest import FAKE_SHA, LocalHub


def test_fineweb_spec_parsing():
    assert parse_fineweb_spec("fineweb-edu") == ("sample-10BT", "main")
    assert parse_fineweb_spec("fineweb-edu:sample-100BT") == ("sample-100BT", "main")
    assert parse_fineweb_spec("fineweb-edu:default@v1.2.0") == ("default", "v1.2.0")
    assert parse_fineweb_spec("fineweb-edu@abc") == ("sample-10BT", "abc")
    for bad in ("fineweb-edu:", "fineweb-edu@", "fineweb-edux"):
        with pytest.raises(DataError):
            parse_fineweb_spec(bad)


def test_fineweb_rows_come_through_the_seam_at_the_resolved_commit(fineweb_texts):
    hub = LocalHub(fineweb_texts[:5])
    source = open_source("fineweb-edu:sample-10BT@v1", hub=hub)
    assert source.identity["revision"] == FAKE_SHA and source.identity["revision_requested"] == "v1"
    assert list(source.documents()) == fineweb_texts[:5]
    assert hub.calls == [("resolve", "HuggingFaceFW/fineweb-edu", "v1", "dataset"),
                         ("stream", "HuggingFaceFW/fineweb-edu", "sample-10BT", FAKE_SHA)]
