"""An interrupted prepare continues: SIGKILL at several points (inside a shard, around a commit, while the
manifest is written) and a rerun of the same command give the same bytes as a prepare that never stopped, with
strictly fewer documents tokenized by the rerun; SIGINT/SIGTERM/SIGHUP stop with one line and exit
130/143/129; a rerun with another tokenizer or option is refused with the difference named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pilotrun.commands.cli import main
from pilotrun.data import prepare as prepare_module
from pilotrun.data.prepare_state import PROGRESS_FILE
from tests.commands.test_cli_bad_input import tree_state

from .test_prepare import _tree_bytes

CHILD = Path(__file__).with_name("prepare_child.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def parquet_source(tmp_path, fineweb_texts) -> str:
    """The 150 fixture documents as three parquet files of 20-row groups: 8 reading units each."""
    folder = tmp_path / "source"
    folder.mkdir()
    for index in range(3):
        part = fineweb_texts[index * 50:(index + 1) * 50]
        pq.write_table(pa.table({"text": part}), folder / f"part-{index}.parquet", row_group_size=20)
    return str(folder / "*.parquet")


def prepare_args(out: Path, source: str, tokenizer: str, *extra: str) -> list[str]:
    return ["--out", str(out), "--source", source, "--tokenizer", tokenizer, "--shard-tokens", "5000",
            "--val-fraction", "0.1", "--shuffle-buffer", "16", "--seed", "7", "--workers", "1", *extra]


def counted_prepare(monkeypatch, args: list[str]) -> tuple[int, int]:
    """(exit code, documents tokenized) of an in-process `pilotrun prepare`."""
    encoded = {"documents": 0}
    original = prepare_module.encode_documents

    def counting(tokenizer, texts, *rest):
        encoded["documents"] += len(texts)
        return original(tokenizer, texts, *rest)

    monkeypatch.setattr(prepare_module, "encode_documents", counting)
    code = main(["prepare", *args])
    monkeypatch.setattr(prepare_module, "encode_documents", original)
    return code, encoded["documents"]


def run_child(point: str, n: int, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(CHILD), point, str(n), "--", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture
def reference(tmp_path, monkeypatch, parquet_source, gpt2_tokenizer_path):
    out = tmp_path / "reference"
    code, documents = counted_prepare(
        monkeypatch, prepare_args(out, parquet_source, str(gpt2_tokenizer_path))
    )
    assert code == 0 and documents == 150
    manifest = json.loads((out / "metadata.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) >= 10  # enough shards for kills between them
    return out, documents


@pytest.mark.slow
@pytest.mark.parametrize(
    "point, n", [("encode", 4), ("before-commit", 3), ("after-commit", 2), ("manifest", 1)]
)
def test_sigkill_then_rerun_is_byte_identical_and_tokenizes_less(
    tmp_path, monkeypatch, parquet_source, gpt2_tokenizer_path, reference, point, n
):
    reference_dir, full_documents = reference
    out = tmp_path / "out"
    args = prepare_args(out, parquet_source, str(gpt2_tokenizer_path))
    killed = run_child(point, n, args)
    assert killed.returncode == -9, killed.stderr
    partial = tmp_path / "out.partial"
    assert partial.is_dir() and not out.exists()  # visible and named after its target, never finished-looking
    assert json.loads((partial / PROGRESS_FILE).read_text())["state"] is not None
    code, documents = counted_prepare(monkeypatch, args)
    assert code == 0
    assert documents < full_documents
    if point == "manifest":
        assert documents == 0  # every shard was committed: only the manifest is written again
    assert _tree_bytes(out) == _tree_bytes(reference_dir)
    assert not partial.exists() and not (out / PROGRESS_FILE).exists()
    assert main(["data", "verify", str(out)]) == 0


@pytest.mark.slow
def test_killed_twice_still_byte_identical(
    tmp_path, monkeypatch, parquet_source, gpt2_tokenizer_path, reference
):
    out = tmp_path / "out"
    args = prepare_args(out, parquet_source, str(gpt2_tokenizer_path))
    assert run_child("after-commit", 2, args).returncode == -9
    assert run_child("encode", 3, args).returncode == -9  # the continued prepare is killed in its turn
    code, documents = counted_prepare(monkeypatch, args)
    assert code == 0 and documents < reference[1]
    assert _tree_bytes(out) == _tree_bytes(reference[0])


@pytest.mark.slow
def test_a_changed_tokenizer_or_option_is_refused_with_the_difference(tmp_path, monkeypatch, capsys,
                                                                        parquet_source, gpt2_tokenizer_path):
    out = tmp_path / "out"
    args = prepare_args(out, parquet_source, str(gpt2_tokenizer_path))
    assert run_child("after-commit", 2, args).returncode == -9
    progress_before = (tmp_path / "out.partial" / PROGRESS_FILE).read_bytes()
    folder_before = tree_state(tmp_path / "out.partial")  # bytes and times, the holder's mark included
    capsys.readouterr()
    assert main(["prepare", *prepare_args(out, parquet_source, "bpe:300")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f'tokenizer: now "bpe:300", recorded "{gpt2_tokenizer_path}"' in err and "remove" in err
    assert main(["prepare", *prepare_args(out, parquet_source, str(gpt2_tokenizer_path), "--seed", "8")]) == 2
    assert "options.seed: now 8, recorded 7" in capsys.readouterr().err
    assert (tmp_path / "out.partial" / PROGRESS_FILE).read_bytes() == progress_before  # nothing touched
    assert tree_state(tmp_path / "out.partial") == folder_before  # not even the holder's mark, taken back
    assert main(["prepare", *args]) == 0  # the original command still continues it


@pytest.mark.slow
def test_a_changed_tokenizer_file_is_refused(tmp_path, capsys, parquet_source, gpt2_tokenizer_path):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(gpt2_tokenizer_path.read_bytes())
    args = prepare_args(tmp_path / "out", parquet_source, str(tokenizer))
    assert run_child("after-commit", 2, args).returncode == -9
    edited = json.loads(tokenizer.read_text())
    edited["added_tokens"][0]["content"] = "<|end|>"  # same spec, other content
    tokenizer.write_text(json.dumps(edited))
    capsys.readouterr()
    assert main(["prepare", *args, "--eos", "<|end|>"]) == 2
    assert "options.eos: now" in capsys.readouterr().err
    assert main(["prepare", *args]) == 2
    assert "tokenizer.sha256: now" in capsys.readouterr().err


# SIGHUP (a closed terminal, a dropped ssh session) stops prepare as SIGTERM does: every command's stop
# signals.
@pytest.mark.slow
@pytest.mark.parametrize("point, code, name", [("sigint", 130, "SIGINT"), ("sigterm", 143, "SIGTERM"),
                                               ("sighup", 129, "SIGHUP")])
def test_a_signal_commits_and_stops_with_one_line(tmp_path, monkeypatch, parquet_source, gpt2_tokenizer_path,
                                                  reference, point, code, name):
    out = tmp_path / "out"
    args = prepare_args(out, parquet_source, str(gpt2_tokenizer_path))
    stopped = run_child(point, 4, args)
    assert stopped.returncode == code, stopped.stderr
    assert "Traceback" not in stopped.stderr
    lines = [line for line in stopped.stderr.splitlines() if "pilotrun" in line]
    assert len(lines) == 1 and lines[0].startswith(f"pilotrun prepare: stopped by {name} after ")
    assert f"{out}.partial" in lines[0] and "run the same command again to continue" in lines[0]
    state = json.loads((tmp_path / "out.partial" / PROGRESS_FILE).read_text())["state"]
    assert state["documents_done"] > 0 and not state["complete"]
    rerun, documents = counted_prepare(monkeypatch, args)
    assert rerun == 0 and documents == reference[1] - state["documents_done"]  # exactly the rest
    assert _tree_bytes(out) == _tree_bytes(reference[0])


@pytest.mark.slow
def test_a_trained_bpe_is_not_trained_again(tmp_path, monkeypatch, parquet_source):
    out = tmp_path / "bpe"
    args = prepare_args(out, parquet_source, "bpe:400")
    assert main(["prepare", *prepare_args(tmp_path / "reference", parquet_source, "bpe:400")]) == 0
    assert run_child("encode", 3, args).returncode == -9

    def no_training(*args, **kwargs):
        raise AssertionError("the continued prepare trained its BPE again")

    monkeypatch.setattr("pilotrun.data.tokenizer.train_bpe", no_training)
    code, documents = counted_prepare(monkeypatch, args)
    assert code == 0 and documents < 150
    assert _tree_bytes(out) == _tree_bytes(tmp_path / "reference")


@pytest.mark.slow
def test_train_tokens_stop_resumes_exactly(tmp_path, monkeypatch, parquet_source, gpt2_tokenizer_path):
    extra = ("--train-tokens", "30000")
    reference_dir = tmp_path / "reference"
    assert (
        main(["prepare", *prepare_args(reference_dir, parquet_source, str(gpt2_tokenizer_path), *extra)]) == 0
    )
    args = prepare_args(tmp_path / "out", parquet_source, str(gpt2_tokenizer_path), *extra)
    assert run_child("after-commit", 2, args).returncode == -9
    code, _ = counted_prepare(monkeypatch, args)
    assert code == 0
    assert _tree_bytes(tmp_path / "out") == _tree_bytes(reference_dir)
    assert json.loads((reference_dir / "metadata.json").read_text())["stream"]["stopped_at_train_tokens"]


class _Crash(BaseException):
    """Stands for a process that dies: nothing in prepare handles it."""


def test_a_streamed_hub_source_continues_too(tmp_path, monkeypatch, fineweb_texts, gpt2_tokenizer_path):
    from pilotrun.data.prepare import prepare_corpus
    from pilotrun.data.prepare_state import PartialFolder

    from .conftest import LocalHub

    hub = LocalHub(fineweb_texts, files={"gpt2/tokenizer.json": str(gpt2_tokenizer_path)})
    common = dict(
        source="fineweb-edu@main",
        tokenizer="hub:gpt2",
        hub=hub,
        shard_tokens=5000,
        val_fraction=0.1,
        shuffle_buffer=16,
        workers=1,
        progress=False,
    )
    prepare_corpus(tmp_path / "reference", **common)
    original, calls = PartialFolder.commit, {"n": 0}

    def crashing(self, *args, **kwargs):
        original(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Crash

    monkeypatch.setattr(PartialFolder, "commit", crashing)
    with pytest.raises(_Crash):
        prepare_corpus(tmp_path / "out", **common)
    monkeypatch.setattr(PartialFolder, "commit", original)
    assert (tmp_path / "out.partial" / PROGRESS_FILE).exists()
    manifest = prepare_corpus(tmp_path / "out", **common)
    assert manifest["stream"]["read_order"] == {"units": None, "shuffled": False}  # a stream has no units
    assert _tree_bytes(tmp_path / "out") == _tree_bytes(tmp_path / "reference")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "swap", "remove"])
def test_a_committed_shard_changed_in_the_partial_folder_is_refused_by_name_before_anything_is_added(
        tmp_path, capsys, parquet_source, gpt2_tokenizer_path, damage):
    """A shard the progress file committed, then changed under the partial folder (a byte flipped, swapped for
    its neighbour, removed): the rerun rehashes every committed shard first and refuses, naming it; the folder
    is left byte for byte as it was, so nothing is listed under a hash its file does not have."""
    out = tmp_path / "out"
    args = prepare_args(out, parquet_source, str(gpt2_tokenizer_path))
    assert run_child("after-commit", 3, args).returncode == -9
    partial = tmp_path / "out.partial"
    shards = json.loads((partial / PROGRESS_FILE).read_text())["state"]["splits"]["train"]["shards"]
    assert len(shards) >= 2
    first, second = partial / shards[0]["file"], partial / shards[1]["file"]
    if damage == "flip":
        data = bytearray(first.read_bytes())
        data[-1] ^= 0x01
        first.write_bytes(bytes(data))
    elif damage == "swap":
        first.write_bytes(second.read_bytes())
    else:
        first.unlink()
    holder_note = "prepare.partial.json"  # the lock's note of who holds the folder: rewritten by each holder
    before = {k: v for k, v in _tree_bytes(partial).items() if k != holder_note}
    untouched = tree_state(partial)  # and a refused rerun takes its note back: bytes and times as they were
    capsys.readouterr()
    assert main(["prepare", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{first}: a committed shard of this interrupted prepare" in err[0], err
    assert ("is missing" if damage == "remove" else "not the") in err[0]
    assert {k: v for k, v in _tree_bytes(partial).items() if k != holder_note} == before and not out.exists()
    assert tree_state(partial) == untouched


@pytest.mark.slow
def test_two_prepares_into_one_folder_at_once_give_one_result_and_the_other_is_refused(
    tmp_path, parquet_source, gpt2_tokenizer_path, reference
):
    """Two real `pilotrun prepare` processes started together on the same --out: one prepares, the other exits
    2 naming the first (or, started after the first had finished, refusing the finished folder), and the
    folder is byte for byte the one a lone prepare writes."""
    reference_dir, _ = reference
    out = tmp_path / "out"
    command = [sys.executable, "-m", "pilotrun", "prepare",
               *prepare_args(out, parquet_source, str(gpt2_tokenizer_path))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    both = [
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [(process.pid, *process.communicate(timeout=300), process.returncode) for process in both]
    codes = sorted(code for *_, code in results)
    assert codes == [0, 2], [(code, err[-1500:]) for _, _, err, code in results]
    (winner, *_), (_, _, refusal, _) = sorted(results, key=lambda result: result[-1])
    lines = refusal.strip().splitlines()
    assert len(lines) == 1, refusal
    assert (
        f"held by another pilotrun prepare still running (pid {winner} " in lines[0] or "exists" in lines[0]
    ), lines
    assert _tree_bytes(out) == _tree_bytes(reference_dir)
    assert not (tmp_path / "out.partial").exists()
    assert main(["data", "verify", str(out)]) == 0


@pytest.mark.slow
def test_a_byte_flipped_in_the_pending_tail_is_refused_not_written_into_a_shard(
    tmp_path, capsys, parquet_source, gpt2_tokenizer_path
):
    """The unfinished shard's pending file of an interrupted prepare, one byte flipped: the rerun refuses it
    in one line (its sha256 is recorded with the state), where it used to write the damaged tokens into a
    shard that the manifest then hashed as it lay, so that `data verify` passed data an uninterrupted prepare
    differs from."""
    out = tmp_path / "out"
    args = prepare_args(out, parquet_source, str(gpt2_tokenizer_path))
    assert run_child("after-commit", 3, args).returncode == -9
    partial = tmp_path / "out.partial"
    state = json.loads((partial / PROGRESS_FILE).read_text())["state"]["splits"]["train"]
    assert state["pending_tokens"] > 0
    pending = partial / f"train_{len(state['shards']):05d}.pending"
    data = bytearray(pending.read_bytes())
    data[1] ^= 0x01
    pending.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["prepare", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # its progress note
    errors = [line for line in err if not line.startswith("pilotrun prepare: continuing")]
    assert (
        len(errors) == 1
        and f"{pending}: its {state['pending_tokens']} pending tokens are not the ones" in errors[0]
    )
    assert not out.exists()
