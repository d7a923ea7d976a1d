"""The merge of a datatrove prepare: a failed task named with its log, a partial output never merged, a rerun
that redoes only the unfinished tasks to the same bytes, and a rerun with other inputs refused."""

from __future__ import annotations

import pytest

pytest.importorskip("datatrove")

from pilotrun.common.errors import DataError  # noqa: E402
from pilotrun.data import datatrove_steps  # noqa: E402
from pilotrun.data.datatrove_finish import finish_prepare  # noqa: E402
from pilotrun.data.shards import metadata_sha256  # noqa: E402
from tests.data.datatrove_helpers import prepare_fixture as _prepare  # noqa: E402


def test_a_failed_task_is_named_with_its_log_and_a_rerun_redoes_only_the_unfinished(
        in_process, monkeypatch, corpus, tmp_path, gpt2_tokenizer_path):
    clean = _prepare(corpus, tmp_path / "clean", gpt2_tokenizer_path, tasks=3)
    original = datatrove_steps.WriteTaskShards._write_manifest
    ran: list[int] = []

    def failing(self, folder, rank, *args):
        ran.append(rank)
        if rank == 1:
            raise OSError("disk full (injected)")
        return original(self, folder, rank, *args)

    monkeypatch.setattr(datatrove_steps.WriteTaskShards, "_write_manifest", failing)
    out = tmp_path / "dt"
    with pytest.raises(DataError) as refused:
        _prepare(corpus, out, gpt2_tokenizer_path, tasks=3)
    line = str(refused.value)
    assert "task 1 (log " in line and str(tmp_path / "dt.logs" / "logs" / "task_00001.log") in line
    assert "task 2 (not started: no log)" in line and "disk full (injected)" in line
    assert not out.exists() and (tmp_path / "dt.partial" / "tasks" / ".00001.tmp").is_dir()
    # a partial output is never merged: the merge alone refuses the tasks without output, by name
    with pytest.raises(DataError, match=r"2 of 3 tasks have no complete output: task 1 .*task 2"):
        finish_prepare(str(out))
    assert not out.exists()
    ran.clear()
    monkeypatch.setattr(datatrove_steps.WriteTaskShards, "_write_manifest", lambda self, folder, rank, *a:
                        (ran.append(rank), original(self, folder, rank, *a))[1])
    manifest = _prepare(corpus, out, gpt2_tokenizer_path, tasks=3)
    assert ran == [1, 2]  # task 0 was complete: skipped by datatrove, its folder reused
    assert metadata_sha256(manifest) == metadata_sha256(clean)
    for shard in manifest["splits"]["train"]["shards"]:
        assert (out / shard["file"]).read_bytes() == (tmp_path / "clean" / shard["file"]).read_bytes()



def test_a_rerun_with_other_options_is_refused_naming_the_difference(
    in_process, monkeypatch, corpus, tmp_path, gpt2_tokenizer_path
):
    monkeypatch.setattr(datatrove_steps.WriteTaskShards, "_write_manifest", _raise_injected)
    with pytest.raises(DataError):
        _prepare(corpus, tmp_path / "dt", gpt2_tokenizer_path, tasks=2)
    with pytest.raises(DataError, match="tasks: now 3, recorded 2"):
        _prepare(corpus, tmp_path / "dt", gpt2_tokenizer_path, tasks=3)


def _raise_injected(*args):
    raise OSError("injected")
