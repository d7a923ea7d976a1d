"""`--source builtin`: the offline English prose of builtin_corpus.py, which every Python install carries."""

from __future__ import annotations

from typing import Any

from pilotrun.data.builtin_corpus import builtin_corpus_info, iter_builtin_documents
from pilotrun.data.hub import HubClient
from pilotrun.data.opened_source import OpenedSource, SourceKind


def open_builtin(spec: str, text_field: str = "text", hub: HubClient | None = None) -> OpenedSource:
    info = builtin_corpus_info()
    return OpenedSource(identity=info.to_manifest(), _iterate=iter_builtin_documents,
                        expected_documents=info.documents)


def describe_builtin(identity: dict[str, Any]) -> str:
    return (f"builtin (Python {identity.get('python_version')}, {identity.get('documents')} documents, text "
            f"sha256 {str(identity.get('text_sha256'))[:12]})")


BUILTIN = SourceKind("builtin", "builtin", claims=lambda spec: spec == "builtin", open=open_builtin,
                     requested=lambda spec, text_field: open_builtin(spec, text_field).identity,
                     describe=describe_builtin)
