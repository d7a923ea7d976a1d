"""The builtin corpus: big enough, deterministic, and gathered without importing arbitrary modules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pilotrun.data.builtin_corpus import builtin_corpus_info, builtin_documents


def test_at_least_a_million_characters_of_prose():
    info = builtin_corpus_info()
    documents = builtin_documents()
    assert info.characters >= 1_000_000 and info.documents == len(documents) >= 300
    assert all(text.strip() == text and text for text in documents)
    assert any("exception" in text for text in documents)  # language reference prose from pydoc_data
    assert info.python_version == ".".join(map(str, sys.version_info[:3]))


@pytest.mark.slow
def test_same_corpus_in_a_fresh_interpreter_without_side_effect_imports():
    code = ("import sys, json; before = set(sys.modules);"
            "from pilotrun.data.builtin_corpus import builtin_corpus_info; info = builtin_corpus_info();"
            "print(json.dumps({'sha': info.text_sha256, 'new': sorted(set(sys.modules) - before)}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    assert report["sha"] == builtin_corpus_info().text_sha256
    for module in ("tkinter", "antigravity", "this", "turtle", "idlelib", "smtplib", "ssl"):
        assert module not in report["new"]
