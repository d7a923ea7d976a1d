"""A rollback on a `model_state` cause goes back to before the documents read since the newest checkpoint
(pilotrun/training/spikes/restore_point.py), on a built corpus with three planted noise documents: each one
is caught, each rollback restores a checkpoint from before the documents it names and steps over them to
their end, and the run finishes with three rollbacks and no fourth spike. With no checkpoint early enough the
run stops in one line."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.training.spikes.test_rollback import events, train

SPAN = 128  # tokens a global batch advances: batch_size 4 x seq_len 32 (the smoke recipe)
LONGER = ("train.max_steps=80", "optim.schedule.horizon=80")  # past the third noise document


def noise_text(rng: random.Random) -> str:
    from pilotrun.data.stream import split_of

    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]<>#@$%^&*~|\\/"
    noise = ""
    while not noise or split_of(noise, 0.01) != "train":
        noise = "".join(rng.choice(alphabet) for _ in range(3000))
    return noise


@pytest.fixture(scope="module")
def three_noise_data(tmp_path_factory):
    """Built-in documents, then three 3,000-character noise documents (some 15 updates of 128 tokens each),
    each after about 8,000 characters of ordinary text. Returns (data folder, [(first token, position just
    past the EOS, document index)] per noise document)."""
    from pilotrun.data.builtin_corpus import builtin_documents
    from pilotrun.data.prepare import prepare_corpus
    from pilotrun.data.reader import open_dataset
    from pilotrun.data.stream import split_of

    folder = tmp_path_factory.mktemp("three_noise")
    docs = [d for d in builtin_documents() if len(d) < 1500 and split_of(d, 0.01) == "train"]
    rng = random.Random(1)
    texts, noise_at = [], []
    for _ in range(3):
        gap = 0
        while gap < 8000:
            texts.append(docs.pop(0))
            gap += len(texts[-1])
        noise_at.append(len(texts))
        texts.append(noise_text(rng))
    texts.extend(docs)
    with open(folder / "corpus.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    prepare_corpus(folder / "data", source=str(folder / "corpus.jsonl"), tokenizer="bpe:4096",
                   shuffle_buffer=1, progress=False)
    dataset = open_dataset(folder / "data")
    split = dataset.split("train")
    ends = np.flatnonzero(split.read(0, split.num_tokens) == dataset.eos_id)
    return folder / "data", [(int(ends[i - 1]) + 1, int(ends[i]) + 1, i) for i in noise_at]


@pytest.mark.slow
def test_three_noise_documents_three_rollbacks_each_past_its_document(three_noise_data, tmp_path):
    data, noises = three_noise_data
    run = tmp_path / "run"
    trainer, result = train(data, run, "train.spike.policy=rollback", *LONGER)
    spikes, rollbacks = events(run, "spike"), events(run, "rollback")
    assert result.reason == "completed" and result.step == 80
    assert len(spikes) == len(rollbacks) == 3 and all(s["action"] == "rollback" for s in spikes)
    for rollback, (start, end, index) in zip(rollbacks, noises, strict=True):
        skipped = rollback["skipped"]
        (named,) = skipped["documents"]
        assert named["first"] <= index <= named["last"]  # each rollback names its noise document
        # ... and steps over all of it: from a batch before its first token through the one holding its EOS
        assert skipped["first_batch"] * SPAN <= start
        assert (skipped["first_batch"] + skipped["batches"]) * SPAN + 1 >= end
        # the checkpoint it restored had read none of it
        assert rollback["restored_step"] <= rollback["spike_step"] - 1
        # the checkpoint it restored had read none of the documents it names (its cursor, in its meta)
        restore = rollback["restore"]
        assert restore["cause"] == "model_state" and restore["suspect_first_batch"] == skipped["first_batch"]
        meta = trainer.session.checkpointer.meta(rollback["restored_step"])
        assert meta["batch_index"] <= skipped["first_batch"] <= start // SPAN
    said = [line for line in trainer.out.getvalue().splitlines() if "rolled back to step" in line]
    assert len(said) == 3 and all("cause model_state: the documents read since checkpoint" in s for s in said)
    # The record reconciles: the work after each restored checkpoint counts as rolled back.
    from pilotrun.report.record_check.summarize import summarize_run

    summary = summarize_run(run)
    assert summary.valid, summary.reasons
    assert summary.overall["spikes"]["spikes"] == summary.overall["spikes"]["rollbacks"] == 3


@pytest.mark.slow
def test_no_checkpoint_before_the_documents_stops_the_run_in_one_line(three_noise_data, tmp_path):
    """Checkpoints every 14 updates: the first noise document spikes at update 17, and the only checkpoint
    (step 14) lies inside the ordinary document before it. No checkpoint lies before that document: the run
    stops (exit 1) with a checkpoint, and says why in its spike event and its ending."""
    data, _ = three_noise_data
    run = tmp_path / "run"
    _trainer, result = train(data, run, "train.spike.policy=rollback", "train.checkpoint_every=14",
                             *LONGER)
    (spike,) = events(run, "spike")
    assert spike["cause"] == "model_state" and spike["action"] == "stopped"
    assert spike["note"].startswith("cause model_state: the documents read since checkpoint step 14 began")
    assert "no committed checkpoint lies before it" in spike["note"] and not events(run, "rollback")
    assert result.reason == "stopped" and result.exit_code == 1 and spike["note"] in result.message


class Checkpoints:
    """Committed checkpoints as the restore point reads them: step -> the cursor its meta records (None: a
    checkpoint from before the meta held it)."""

    def __init__(self, cursors: dict[int, int | None]) -> None:
        self.cursors = cursors

    def committed_steps(self) -> list[int]:
        return sorted(self.cursors)

    def meta(self, step: int) -> dict:
        cursor = self.cursors[step]
        return {} if cursor is None else {"batch_index": cursor}


def session_over(data, cursors: dict[int, int | None]):
    from types import SimpleNamespace

    from pilotrun.data.reader import BatchLoader, open_dataset

    dataset = open_dataset(data)
    loader = BatchLoader(dataset.split("train"), batch_size=4, seq_len=32)
    return SimpleNamespace(checkpointer=Checkpoints(cursors), dataset=dataset,
                           state=SimpleNamespace(loader=loader))


def test_a_checkpoint_inside_a_document_sends_the_rollback_to_one_before_it(three_noise_data):
    """The newest checkpoint's cursor lies inside the first noise document and the spike comes on the
    ordinary text after it: the restore point is the newest checkpoint from before the document began, the
    range starts at the batch that reads its first token and runs through the spiking batches' documents;
    with no checkpoint that early, or none whose cursor is known, one line says why."""
    from pilotrun.training.spikes.restore_point import RestorePoint, model_state_restore_point

    data, ((start, end, index), *_) = three_noise_data
    first, inside, after = start // SPAN, (start + end) // 2 // SPAN, end // SPAN + 2
    cursors = {2: first - 6, 3: first - 1, 4: first + 1, 5: inside}
    point = model_state_restore_point(session_over(data, cursors), 5, [after])
    assert isinstance(point, RestorePoint)
    assert (point.step, point.newest_step, point.first_batch) == (3, 5, first)
    (documents,) = point.documents
    assert documents["first"] == index and documents["last"] > index and documents["tokens"][0] == start
    assert point.through >= after
    # The newest checkpoint from before the document is taken, not merely an early one; nothing older known.
    assert model_state_restore_point(session_over(data, {**cursors, 3: None}), 5, [after]).step == 2
    line = model_state_restore_point(session_over(data, {4: first + 1, 5: inside}), 5, [after])
    assert line == (f"cause model_state: the documents read since checkpoint step 5 began at batch "
                    f"{first}, and no committed checkpoint lies before it (the oldest kept reads from batch "
                    f"{first + 1}): no rollback can step over them")
    line = model_state_restore_point(session_over(data, {4: first - 1, 5: None}), 5, [after])
    assert line.startswith("the newest committed checkpoint (step 5) does not record its data cursor")


@pytest.mark.slow
def test_killed_around_a_model_state_rollbacks_commit_the_resumed_run_is_the_uninterrupted_one(
    three_noise_data, tmp_path, monkeypatch
):
    """The first noise document's rollback restores step 6 from the newest checkpoint 12 and commits step 6
    again, pruning 12 (a later timeline). Killed just after that commit, the resume goes on from step 6 past
    the documents; killed just before it, the resume starts from step 12, attempts the spiking update again
    and rolls back to the same checkpoint over the same data. Both train the uninterrupted run's weights bit
    for bit, its kept losses and its skip_data, and the record counts one spike and one rollback."""
    import io

    from pilotrun.training.trainer import Trainer
    from tests.exactness import assert_exactly_equal
    from tests.training.spikes.test_rollback import (
        counted,
        losses,
        recipe,
        snapshot_around_the_rollbacks_commit,
        weights,
    )

    data, _ = three_noise_data
    short = ("train.spike.policy=rollback", "train.max_steps=26", "optim.schedule.horizon=80")
    straight, _ = train(data, tmp_path / "straight", *short)
    (rollback,) = events(tmp_path / "straight", "rollback")
    assert rollback["restored_step"] == 6 and rollback["restore"]["newest_checkpoint"] == 12
    before, after = tmp_path / "before", tmp_path / "after"
    snapshot_around_the_rollbacks_commit(monkeypatch, tmp_path / "run", before, after)
    train(data, tmp_path / "run", *short)
    monkeypatch.undo()
    assert [e["event"] for e in events(after)][-4:] == ["spike", "train", "rollback", "checkpoint"]
    record = (tmp_path / "straight" / "run.json").read_text()
    for killed in (after, before):
        resumed = Trainer(recipe(*short), data, killed, resume=True, progress=False, out=io.StringIO())
        assert resumed.run().reason == "completed"
        assert resumed.session.resumed_from == (6 if killed is after else 12)
        assert_exactly_equal(weights(straight), weights(resumed))
        assert {s: v[-1] for s, v in losses(killed).items()} == {
            s: v[-1] for s, v in losses(tmp_path / "straight").items()}
        assert (json.loads((killed / "run.json").read_text())["skip_data"]
                == json.loads(record)["skip_data"])
        kept = counted(killed)
        assert kept["spikes"]["spikes"] == kept["spikes"]["rollbacks"] == 1
