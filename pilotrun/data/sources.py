"""Sources: where documents come from, and the identity of that origin for the manifest. Every kind of
`--source` is one module (data/source_*.py) and one entry in SOURCE_KINDS below, the only place a kind is
registered: opening a spec, what a spec decides without the network, the one-line name of a recorded
identity and `--source`'s help all read this table.

The kinds: `builtin` (source_builtin.py), `fineweb-edu[:CONFIG][@REVISION]` (source_hub.py) and local
files (source_local.py). What an opened source gives, and how a kind is declared: opened_source.py.
"""

from __future__ import annotations

from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.data.hub import HubClient
from pilotrun.data.opened_source import OpenedSource, SourceKind
from pilotrun.data.source_builtin import BUILTIN
from pilotrun.data.source_hub import FINEWEB_EDU
from pilotrun.data.source_local import LOCAL

# Asked in this order; the first kind that claims a spec opens it. Local files claim whatever is left.
SOURCE_KINDS: tuple[SourceKind, ...] = (BUILTIN, FINEWEB_EDU, LOCAL)


def source_kind(spec: str) -> tuple[str, SourceKind]:
    """`spec` stripped, and the registered kind that claims it."""
    spec = str(spec).strip()
    if not spec:
        raise DataError("--source is empty")
    return spec, next(kind for kind in SOURCE_KINDS if kind.claims(spec))


def open_source(spec: str, text_field: str = "text", hub: HubClient | None = None) -> OpenedSource:
    spec, kind = source_kind(spec)
    return kind.open(spec, text_field, hub)


def requested_source(spec: str, text_field: str = "text") -> dict[str, Any]:
    """The fields of the manifest's `source` that this `--source` determines (all of them, but for the hub
    commit a branch or tag resolves to: that is looked up only by a prepare)."""
    spec, kind = source_kind(spec)
    return kind.requested(spec, text_field)


def describe_source(identity: dict[str, Any]) -> str:
    """A recorded source identity in one line, by the kind that wrote it (an unknown kind: as it is)."""
    kind = next((k for k in SOURCE_KINDS if k.name == identity.get("kind")), None)
    return kind.describe(identity) if kind is not None else str(identity)


def source_help() -> str:
    """`--source`'s help: every registered kind as `--source` names it."""
    return " | ".join(kind.spec for kind in SOURCE_KINDS)
