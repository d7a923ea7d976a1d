"""Worker-process tokenizing (`prepare --workers N`, N >= 2): the same bytes as the in-process paths for any
N, interrupted and continued included; workers end with their pass, with an error, and with a SIGKILLed
parent."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from pilotrun.commands.cli import main
from pilotrun.common.errors import DataError
from pilotrun.data.prepare import prepare_corpus
from pilotrun.data.shards import metadata_sha256
from pilotrun.data.tokenize_pool import TokenizePool, encoded_in_order
from pilotrun.data.tokenizer import encode_documents, plain_encoder

from .test_prepare import _tree_bytes
from .test_prepare_resume import parquet_source, prepare_args, run_child  # noqa: F401 (a fixture)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _all_gone(pids: list[int], patience_s: float = 20.0) -> bool:
    # Death is asynchronous (the kernel delivers the parent-death signal): wait for it, bounded, never timed.
    deadline = time.monotonic() + patience_s
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(_gone(pid) for pid in pids)


@pytest.fixture
def gpt2_json(gpt2_tokenizer_path) -> str:
    return plain_encoder(gpt2_tokenizer_path.read_text()).to_str()


@pytest.mark.slow
def test_chunks_come_back_in_order_equal_to_in_process_encoding(gpt2_json, fineweb_texts):
    chunks = [(fineweb_texts[i:i + 7], [f"extra-{i}"]) for i in range(0, 70, 7)]
    encoder = plain_encoder(gpt2_json)
    pool = TokenizePool(gpt2_json, 50256, "uint16", 3)
    try:
        results = list(pool.encoded_in_order(iter(chunks)))
        pids = pool.pids
    finally:
        pool.close()
    assert [extras for extras, _, _ in results] == [extras for _, extras in chunks]
    for (texts, _), (_, tokens, lengths) in zip(chunks, results):
        expected_tokens, expected_lengths = encode_documents(encoder, texts, 50256, "uint16")
        assert tokens.dtype == np.uint16 and np.array_equal(tokens, expected_tokens)
        assert np.array_equal(lengths, expected_lengths)
    assert len(pids) == 3 and _all_gone(pids)


@pytest.mark.slow
def test_a_pass_closed_early_stops_its_workers(gpt2_json, fineweb_texts):
    endless = ((fineweb_texts[i % 100:i % 100 + 5], [i]) for i in range(10**9))
    stream = encoded_in_order(endless, gpt2_json, 50256, "uint16", 2)
    next(stream)
    children_before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    stream.close()  # what prepare does at the --train-tokens stop, a stop request or an error
    workers = [pid for pid in children_before if _parent_of(pid) == os.getpid() and _is_worker(pid)]
    assert _all_gone(workers)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"spawn_main" in handle.read()  # not the resource tracker
    except OSError:
        return False


@pytest.mark.slow
def test_an_encoding_error_and_a_dead_worker_are_one_data_error(gpt2_json, fineweb_texts):
    pool = TokenizePool(gpt2_json, 50256, "uint16", 2)
    try:
        with pytest.raises(DataError, match="tokenizing worker pilotrun-tokenize-0: TypeError"):
            list(pool.encoded_in_order(iter([([1, 2], [None])])))
    finally:
        pool.close()
    pool = TokenizePool(gpt2_json, 50256, "uint16", 2)
    try:
        os.kill(pool.pids[1], 9)
        with pytest.raises(DataError, match=r"pilotrun-tokenize-1 \(pid \d+\) exited with code -9"):
            list(pool.encoded_in_order(iter([(fineweb_texts[:2], [0]), (fineweb_texts[2:4], [1])])))
    finally:
        pool.close()


@pytest.mark.slow
def test_byte_identical_for_zero_one_and_two_workers(tmp_path, fineweb_jsonl, gpt2_tokenizer_path):
    common = dict(source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path), val_fraction=0.1,
                  shard_tokens=7000, shuffle_buffer=32, seed=5, progress=False)
    manifests = {n: prepare_corpus(tmp_path / f"w{n}", workers=n, **common) for n in (0, 1, 2)}
    reference = _tree_bytes(tmp_path / "w0")
    assert len([name for name in reference if name.startswith("train_")]) >= 10
    assert _tree_bytes(tmp_path / "w1") == reference and _tree_bytes(tmp_path / "w2") == reference
    assert len({metadata_sha256(m) for m in manifests.values()}) == 1
    build = json.loads((tmp_path / "w2" / "build_info.json").read_text())
    assert build["workers"] == 2 and build["tokenize"] == "processes" and build["worker_peak_rss_mb"] > 0
    assert json.loads((tmp_path / "w0" / "build_info.json").read_text())["tokenize"] == "threads"


@pytest.mark.slow
def test_sigkilled_with_workers_then_rerun_is_byte_identical_and_leaves_no_worker(
        tmp_path, monkeypatch, parquet_source, gpt2_tokenizer_path):  # noqa: F811 (the fixture)
    reference = tmp_path / "reference"
    assert main(["prepare", *prepare_args(reference, parquet_source, str(gpt2_tokenizer_path))]) == 0
    out, pids_file = tmp_path / "out", tmp_path / "pids"
    # the last one wins
    args = [*prepare_args(out, parquet_source, str(gpt2_tokenizer_path)), "--workers", "2"]
    monkeypatch.setenv("PREPARE_CHILD_PIDS", str(pids_file))
    killed = run_child("chunk", 5, args)
    assert killed.returncode == -9, killed.stderr
    pids = [int(line) for line in pids_file.read_text().split()]
    assert len(pids) >= 2  # the two workers (and multiprocessing's resource tracker)
    assert _all_gone(pids), [pid for pid in pids if not _gone(pid)]
    assert (tmp_path / "out.partial").is_dir() and not out.exists()
    assert json.loads((tmp_path / "out.partial" / "progress.json").read_text())["state"]["documents_done"] > 0
    assert main(["prepare", *args]) == 0
    assert _tree_bytes(out) == _tree_bytes(reference)
