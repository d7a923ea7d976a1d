"""The one seam between `prepare` and the network: the Hugging Face hub.

Everything that touches the hub goes through a `HubClient`: resolving a revision (a branch or tag) to the
commit SHA that the manifest records, streaming a dataset's rows, and downloading one file of a model repo
(a `tokenizer.json`). `HuggingFaceHub` is the real client; it imports `datasets` / `huggingface_hub` only
when called, because they are the optional `[hub]` extra. Tests pass their own client that serves local
rows (built from ../shared/fixtures), so no test ever reaches the network.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Protocol

from pilotrun.common.errors import DataError

COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


class HubClient(Protocol):
    def resolve_revision(self, repo_id: str, revision: str, repo_type: str) -> str:
        """The 40-hex commit SHA that `revision` (branch, tag or SHA) of the repo points at now."""
        ...

    def stream_rows(self, repo_id: str, config: str, revision: str) -> Iterator[dict[str, Any]]:
        """The rows of the dataset's train split at that exact commit, in the dataset's stream order."""
        ...

    def download_file(self, repo_id: str, filename: str, revision: str) -> str:
        """A local path to `filename` of the model repo at that exact commit."""
        ...


OFFLINE_HINTS = {
    "dataset": "use local files instead: --source data.parquet, data.jsonl, data.txt or a glob",
    "model": "use a local tokenizer instead: --tokenizer path/to/tokenizer.json (or bpe:VOCAB to train one)",
}


def _hub_import_error(exc: ImportError) -> DataError:
    return DataError(
        f"this source/tokenizer needs the optional hub libraries ({exc.name} is missing): install the [hub] "
        "extra with `.venv/bin/pip install -e '.[hub]'` (or `make install EXTRAS=hub`), or use local files"
    )


def _hub_unreachable(action: str, repo_type: str, exc: BaseException) -> DataError:
    """One line for any failure of the hub libraries (offline, DNS, HTTP, not found): what failed, the first
    line of the library's message, and what to use without the network."""
    lines = str(exc).strip().splitlines()
    detail = lines[0][:200] if lines else ""
    return DataError(f"cannot {action} on the Hugging Face hub ({type(exc).__name__}: {detail}); if offline, "
                     f"{OFFLINE_HINTS[repo_type]}")


class HuggingFaceHub:
    """The real hub client (network). Imported libraries are loaded on first use only."""

    def resolve_revision(self, repo_id: str, revision: str, repo_type: str) -> str:
        try:
            from huggingface_hub import HfApi
        except ImportError as exc:
            raise _hub_import_error(exc) from None
        api = HfApi()
        try:
            if repo_type == "dataset":
                info = api.dataset_info(repo_id, revision=revision)
            else:
                info = api.model_info(repo_id, revision=revision)
        except Exception as exc:  # the hub library raises many types (HTTP, offline, not found)
            raise _hub_unreachable(f"resolve revision '{revision}' of {repo_type} {repo_id}", repo_type,
                                   exc) from None
        return str(info.sha)

    def stream_rows(self, repo_id: str, config: str, revision: str) -> Iterator[dict[str, Any]]:
        try:
            from datasets import load_dataset
        except ImportError as exc:
            raise _hub_import_error(exc) from None
        try:
            yield from load_dataset(repo_id, name=config, split="train", streaming=True, revision=revision)
        except DataError:
            raise
        except Exception as exc:  # the connection may fail at the start or in the middle of the stream
            raise _hub_unreachable(f"stream {repo_id}:{config}@{revision}", "dataset", exc) from None

    def download_file(self, repo_id: str, filename: str, revision: str) -> str:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError as exc:
            raise _hub_import_error(exc) from None
        try:
            return hf_hub_download(repo_id, filename, revision=revision)
        except Exception as exc:
            raise _hub_unreachable(f"download {filename} of {repo_id}@{revision}", "model", exc) from None


def resolve_commit(hub: HubClient, repo_id: str, revision: str, repo_type: str) -> str:
    """Resolve and check: whatever the client returns must be a full commit SHA, or the record means
    nothing."""
    sha = hub.resolve_revision(repo_id, revision, repo_type)
    if not isinstance(sha, str) or not COMMIT_SHA.match(sha):
        raise DataError(
            f"revision '{revision}' of {repo_type} {repo_id} resolved to {sha!r}, not a commit SHA"
        )
    return sha
