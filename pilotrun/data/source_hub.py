"""`--source fineweb-edu[:CONFIG][@REVISION]`: HuggingFaceFW/fineweb-edu streamed through the hub seam, the
revision resolved to a commit SHA (default config `sample-10BT`, default revision `main`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.data.hub import HubClient, HuggingFaceHub, resolve_commit
from pilotrun.data.opened_source import OpenedSource, SourceKind, text_of_row

FINEWEB_EDU_REPO = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_DEFAULT_CONFIG = "sample-10BT"


def is_fineweb_spec(spec: str) -> bool:
    return spec == "fineweb-edu" or spec.startswith(("fineweb-edu:", "fineweb-edu@"))


def parse_fineweb_spec(spec: str) -> tuple[str, str]:
    """`fineweb-edu[:CONFIG][@REVISION]` -> (config, revision)."""
    rest = spec[len("fineweb-edu"):]
    revision = "main"
    if "@" in rest:
        rest, revision = rest.split("@", 1)
        if not revision:
            raise DataError(f"--source '{spec}': empty revision after '@'")
    config = FINEWEB_EDU_DEFAULT_CONFIG
    if rest:
        if not rest.startswith(":") or len(rest) == 1:
            raise DataError(f"--source '{spec}': expected fineweb-edu[:CONFIG][@REVISION]")
        config = rest[1:]
    return config, revision


def open_fineweb_edu(spec: str, text_field: str = "text", hub: HubClient | None = None) -> OpenedSource:
    hub = hub or HuggingFaceHub()
    config, revision = parse_fineweb_spec(spec)
    sha = resolve_commit(hub, FINEWEB_EDU_REPO, revision, "dataset")

    def iterate() -> Iterator[str | None]:
        for index, row in enumerate(hub.stream_rows(FINEWEB_EDU_REPO, config, sha)):
            yield text_of_row(row, text_field, f"{FINEWEB_EDU_REPO}:{config}@{sha} row {index}")

    identity = {
        "kind": "hub",
        "dataset": FINEWEB_EDU_REPO,
        "config": config,
        "split": "train",
        "revision_requested": revision,
        "revision": sha,
        "text_field": text_field,
    }
    return OpenedSource(identity=identity, _iterate=iterate)


def requested_fineweb_edu(spec: str, text_field: str = "text") -> dict[str, Any]:
    """All of the identity but the commit a branch or tag resolves to: that is looked up only by a prepare."""
    config, revision = parse_fineweb_spec(spec)
    return {"kind": "hub", "dataset": FINEWEB_EDU_REPO, "config": config, "revision_requested": revision,
            "text_field": text_field}


def describe_fineweb_edu(identity: dict[str, Any]) -> str:
    commit = f" (commit {identity['revision'][:12]})" if identity.get("revision") else ""
    return f"fineweb-edu:{identity.get('config')}@{identity.get('revision_requested')}{commit}"


FINEWEB_EDU = SourceKind("hub", "fineweb-edu[:CONFIG][@REVISION] (needs the [hub] extra)",
                         claims=is_fineweb_spec, open=open_fineweb_edu, requested=requested_fineweb_edu,
                         describe=describe_fineweb_edu)
