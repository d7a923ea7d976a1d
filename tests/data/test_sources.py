"""pilotrun/data/sources.py: every registered source kind, each registered whole (its own module, how
`--source` names it, a claim, an opener, what a spec decides offline, a describer), local files last; and the
dispatch, the offline request, the describer and `--source`'s help all reading the one table."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from pilotrun.common.errors import DataError
from pilotrun.data import sources
from pilotrun.data.opened_source import OpenedSource, SourceKind
from pilotrun.data.sources import SOURCE_KINDS, describe_source, open_source, requested_source, source_help

PARTS = ("claims", "open", "requested", "describe")


def half_registrations() -> list[str]:
    """What a kind's registration lacks: a name, a one-line spec, any of its four functions, a module of its
    own (data/source_*.py); and local files not last (a kind after them would never be asked)."""
    found, homes = [], {}
    for kind in sources.SOURCE_KINDS:
        name = kind.name or "<unnamed>"
        if not kind.name or not isinstance(kind.spec, str) or not kind.spec.strip() or "\n" in kind.spec:
            found.append(f"{name}: no name or no one-line spec for --source's help")
        found += [f"{name}: no {part}" for part in PARTS if not callable(getattr(kind, part))]
        module = getattr(kind.open, "__module__", "")
        file = Path(sys.modules[module].__file__) if module in sys.modules else None
        if file is None or not file.name.startswith("source_") or homes.setdefault(module, name) != name:
            found.append(f"{name}: not opened from a module of its own (data/source_*.py)")
    if [kind.name for kind in sources.SOURCE_KINDS][-1:] != ["local"]:
        found.append("local files are not the last kind asked")
    return found


def test_every_source_kind_is_registered_whole():
    assert [(kind.name, kind.spec) for kind in SOURCE_KINDS] == [
        ("builtin", "builtin"), ("hub", "fineweb-edu[:CONFIG][@REVISION] (needs the [hub] extra)"),
        ("local", "local .parquet/.jsonl/.txt files or a glob")]
    assert half_registrations() == []
    assert source_help() == ("builtin | fineweb-edu[:CONFIG][@REVISION] (needs the [hub] extra) | local "
                             ".parquet/.jsonl/.txt files or a glob")


def test_a_half_registered_kind_is_named(monkeypatch):
    local = SOURCE_KINDS[-1]
    planted = dataclasses.replace(local, name="memory", spec="", describe=None)
    monkeypatch.setattr(sources, "SOURCE_KINDS", (*SOURCE_KINDS, planted))
    assert half_registrations() == ["memory: no name or no one-line spec for --source's help",
                                    "memory: no describe",
                                    "memory: not opened from a module of its own (data/source_*.py)",
                                    "local files are not the last kind asked"]


def test_a_registered_kind_is_reached_by_every_reader(monkeypatch, capsys):
    def open_memory(spec, text_field="text", hub=None):
        return OpenedSource(identity={"kind": "memory", "text": spec[len("memory:"):]},
                            _iterate=lambda: iter([spec[len("memory:"):]]))

    memory = SourceKind("memory", "memory:TEXT", claims=lambda spec: spec.startswith("memory:"),
                        open=open_memory,
                        requested=lambda spec, text_field: open_memory(spec).identity,
                        describe=lambda identity: f"the text {identity['text']!r}")
    monkeypatch.setattr(sources, "SOURCE_KINDS", (*SOURCE_KINDS[:-1], memory, SOURCE_KINDS[-1]))
    assert list(open_source(" memory:one document ").documents()) == ["one document"]
    assert requested_source("memory:x") == {"kind": "memory", "text": "x"}
    assert describe_source({"kind": "memory", "text": "x"}) == "the text 'x'"
    from pilotrun.commands.cli import main

    assert main(["prepare", "--help"]) == 0
    assert "| memory:TEXT | local" in " ".join(capsys.readouterr().out.split())


def test_an_empty_spec_and_an_unknown_kind(tmp_path):
    for call in (open_source, requested_source):
        with pytest.raises(DataError, match="^--source is empty$"):
            call("  ")
    with pytest.raises(DataError, match="no such file"):
        requested_source(str(tmp_path / "nope.parquet"))
    assert describe_source({"kind": "ftp", "host": "h"}) == "{'kind': 'ftp', 'host': 'h'}"
