"""Fixtures for the data tests: the real FineWeb-Edu documents and GPT-2 tokenizer from ../shared/fixtures,
and a stand-in for the hub (the network seam) that serves those local rows instead of downloading.

The fixtures live beside the repository (CI has them at ../shared relative to the repo root); tests that
need them skip with a clear reason when the folder is absent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
FINEWEB_JSONL = FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.jsonl"
FINEWEB_PARQUET = FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.parquet"
GPT2_TOKENIZER = FIXTURES / "tokenizers" / "gpt2" / "tokenizer.json"
FAKE_SHA = "0123456789abcdef0123456789abcdef01234567"


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(
            f"shared test fixture {path} is absent (expected ../shared/fixtures beside the repository)"
        )
    return path


@pytest.fixture
def fineweb_jsonl() -> Path:
    return _require(FINEWEB_JSONL)


@pytest.fixture
def fineweb_parquet() -> Path:
    return _require(FINEWEB_PARQUET)


@pytest.fixture
def gpt2_tokenizer_path() -> Path:
    return _require(GPT2_TOKENIZER)


@pytest.fixture
def fineweb_texts(fineweb_jsonl) -> list[str]:
    with open(fineweb_jsonl, encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


class LocalHub:
    """A HubClient that never touches the network: rows and files come from the local fixtures.

    It stands in for `pilotrun.data.hub.HuggingFaceHub` in tests and records every call, so a test can check
    that prepare asked for the resolved commit (not the branch name) when it streamed or downloaded.
    FineWeb-Edu rows are rebuilt around the fixture texts with the dataset's other columns filled in with
    made-up values (the fixtures keep only `text`), to show that prepare reads `text` among real-shaped rows.
    """

    def __init__(self, texts: list[str], files: dict[str, str] | None = None, sha: str = FAKE_SHA) -> None:
        self.texts, self.files, self.sha = texts, files or {}, sha
        self.calls: list[tuple] = []

    def resolve_revision(self, repo_id: str, revision: str, repo_type: str) -> str:
        self.calls.append(("resolve", repo_id, revision, repo_type))
        return self.sha

    def stream_rows(self, repo_id: str, config: str, revision: str) -> Iterator[dict[str, Any]]:
        self.calls.append(("stream", repo_id, config, revision))
        for index, text in enumerate(self.texts):
            yield {
                "text": text,
                "id": f"<urn:uuid:{index}>",
                "dump": "CC-MAIN-2024-10",
                "url": f"https://x/{index}",
                "file_path": "s3://x",
                "language": "en",
                "language_score": 0.97,
                "token_count": len(text) // 4,
                "score": 3.1,
                "int_score": 3,
            }

    def download_file(self, repo_id: str, filename: str, revision: str) -> str:
        self.calls.append(("download", repo_id, filename, revision))
        return self.files[f"{repo_id}/{filename}"]


@pytest.fixture
def in_process(monkeypatch):
    """datatrove's local executor run in this process (tests/data/datatrove_helpers.py)."""
    pytest.importorskip("datatrove")
    from datatrove.executor import LocalPipelineExecutor

    from tests.data.datatrove_helpers import in_process_run

    monkeypatch.setattr(LocalPipelineExecutor, "run", in_process_run)


@pytest.fixture
def corpus(tmp_path, fineweb_texts) -> Path:
    """The FineWeb-Edu fixture dealt over three jsonl files, with a blank document (skipped by both
    engines)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for index in range(3):
        rows = [{"text": t} for t in fineweb_texts[index * 50:(index + 1) * 50]]
        if index == 1:
            rows.insert(3, {"text": "  \n"})
        (folder / f"part-{index}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder
