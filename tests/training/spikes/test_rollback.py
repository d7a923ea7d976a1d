"""Spikes in a real (smoke-sized) training run: a poisoned batch (tests/training/spike_faults.py) makes a
spike at its update; each policy answers it and the record reconciles.

- record: the spike event names the update, the batch and the cause ("batch": it recurs bit for bit on its
  batch, not on the next); the replay changes nothing: the run equals one without replay, bit for bit;
- skip: one skipped update with reason spike (a `spike` event, no `overflow`), the step and schedule unmoved;
- rollback: the continued run equals, bit for bit (weights, optimizer, every kept loss), a reference run told
  to skip the same data from the start with the `train.skip_data` the rollback event records; the updates
  between the checkpoint and the spike are redone with the same losses; summarize counts the undone work as
  rolled back;
- a spike storm hits train.spike.max_rollbacks and the run stops ("stopped", exit 1) with a checkpoint;
- with the replay on, the same constant storm after a model_state rollback to step 6 is met from a model whose
  gradient norm on it is under the bound, then fitted (its loss falls, its norm shrinks): no spike, the run
  completes; against a bound it clears (train.spike.factor=3) it is caught again after the rollback and stops
  at the cap;
- a long noise document (real data, no poison: it spans ~15 updates) spikes once: the rollback skips it to its
  end, and the run completes (skipping only the spiking update and the margin met the rest of it three times);
- a rollback on a mixture skips each source's documents to their end and names the sources;
- an older run's batch ranges (in its recipe, none in its trainer state) are stepped over after a resume;
- killed right after a rollback (after its commit, or before it) and resumed, the run trains and counts as the
  uninterrupted one.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.verdict import judge_summary
from tests.exactness import assert_exactly_equal
from tests.training.spike_faults import poison_batches

ROOT = Path(__file__).resolve().parents[3]
POISON = 16  # cursor position of the poisoned microbatch: update 17 reads it (accumulation 1)


@pytest.fixture(scope="module")
def noise_data(tmp_path_factory):
    """Short built-in documents (about 15 updates' worth) in their order, then a 3,000-character noise
    document (random letters, digits and symbols: some 1,900 tokens, 15 updates of 128 tokens), then more
    documents. Returns (data folder, the noise document's first token, the position just past its EOS, its
    index)."""
    import random

    import numpy as np

    from pilotrun.data.builtin_corpus import builtin_documents
    from pilotrun.data.prepare import prepare_corpus
    from pilotrun.data.reader import open_dataset
    from pilotrun.data.stream import split_of

    folder = tmp_path_factory.mktemp("noise")
    docs = [d for d in builtin_documents() if len(d) < 1500 and split_of(d, 0.01) == "train"]
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]<>#@$%^&*~|\\/"
    noise = ""
    while not noise or split_of(noise, 0.01) != "train":
        noise = "".join(rng.choice(alphabet) for _ in range(3000))
    before: list[str] = []
    while sum(map(len, before)) < 8000:
        before.append(docs.pop(0))
    with open(folder / "corpus.jsonl", "w") as f:
        for text in [*before, noise, *docs]:
            f.write(json.dumps({"text": text}) + "\n")
    prepare_corpus(
        folder / "data",
        source=str(folder / "corpus.jsonl"),
        tokenizer="bpe:4096",
        shuffle_buffer=1,
        progress=False,
    )
    dataset = open_dataset(folder / "data")
    split = dataset.split("train")
    ends = np.flatnonzero(split.read(0, split.num_tokens) == dataset.eos_id)
    return folder / "data", int(ends[len(before) - 1]) + 1, int(ends[len(before)]) + 1, len(before)


def recipe(*extra: str):
    return load_run_config(ROOT / "configs" / "smoke.yaml", [
        "train.num_threads=1", "train.max_steps=24", "train.checkpoint_every=6", "train.keep_checkpoints=5",
        "train.eval_every=0", "train.log_every=1", "optim.schedule.horizon=24", "optim.muon.lr=0.02",
        "optim.adamw.lr=0.01", "train.spike.min_history=8", "train.spike.window=20", *extra])


def train(data_dir, run_dir, *extra):
    from pilotrun.training.trainer import Trainer

    trainer = Trainer(recipe(*extra), data_dir, run_dir, progress=False, out=io.StringIO())
    return trainer, trainer.run()


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    every = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in every if kind is None or e["event"] == kind]


def losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in events(run_dir, "train"):
        if e["window"]["updates_applied"]:
            out.setdefault(e["step"], []).append(e["loss"])
    return out


def weights(trainer) -> dict:
    session = trainer.session
    return {"model": session.raw_model.state_dict(), "optimizer": session.optimizer.state_dict()}


@pytest.mark.slow
def test_record_names_the_poisoned_batch_and_its_replay_changes_nothing(
    builtin_data_dir, tmp_path, monkeypatch
):
    poison_batches(POISON, monkeypatch=monkeypatch)
    replayed, result = train(builtin_data_dir, tmp_path / "replayed")
    assert result.reason == "completed" and result.updates_skipped == 0
    (spike,) = events(tmp_path / "replayed", "spike")
    assert (
        spike["spike_step"] == POISON + 1 and spike["batches"] == [POISON] and spike["action"] == "recorded"
    )
    assert "grad_norm" in spike["signals"] and spike["grad_norm"] > spike["bounds"]["grad_norm"]["bound"]
    assert spike["cause"] == "batch" and spike["replay"]["bitwise"] is True
    assert spike["replay"]["same_batch"] == spike["per_rank"] and spike["replay"]["next_batches"] == [
        POISON + 1
    ]
    said = [line for line in replayed.out.getvalue().splitlines() if line.startswith("spike at update")]
    assert len(said) == 1 and said[0].startswith(f"spike at update {POISON + 1} (batches {POISON}): loss ")
    assert (
        f"grad norm {spike['grad_norm']:.4g} > bound {spike['bounds']['grad_norm']['bound']:.4g}" in said[0]
    )
    assert said[0].endswith(" -> recorded, applied; cause batch")
    plain, _ = train(builtin_data_dir, tmp_path / "plain", "train.spike.replay=false")
    assert events(tmp_path / "plain", "spike")[0]["replay"] is None
    assert losses(tmp_path / "replayed") == losses(tmp_path / "plain")
    assert_exactly_equal(weights(replayed), weights(plain))
    summary = summarize_run(tmp_path / "replayed")
    assert summary.valid, summary.reasons
    assert summary.overall["spikes"]["spikes"] == 1
    assert summary.overall["time_ledger"]["parts"]["replay"] > 0
    spikes_rule = next(r for r in judge_summary(summary).rules if r.name == "spikes")
    assert spikes_rule.status == "WARN" and "cause batch" in spikes_rule.figure


@pytest.mark.slow
def test_skip_counts_one_skipped_update_with_reason_spike(builtin_data_dir, tmp_path, monkeypatch):
    poison_batches(POISON, monkeypatch=monkeypatch)
    trainer, result = train(builtin_data_dir, tmp_path / "run", "train.spike.policy=skip")
    assert result.reason == "completed" and result.step == 24
    assert result.updates_skipped == 1 and result.updates_attempted == 25
    (spike,) = events(tmp_path / "run", "spike")
    # step unmoved
    assert spike["action"] == "skipped" and spike["skipped"] is True and spike["step"] == POISON
    assert spike["updates_skipped"] == 1 and events(tmp_path / "run", "overflow") == []
    summary = summarize_run(tmp_path / "run")
    assert summary.valid, summary.reasons
    assert summary.overall["updates_skipped"] == 1


@pytest.mark.slow
def test_rollback_continues_exactly_as_a_run_told_to_skip_the_same_data(
    builtin_data_dir, tmp_path, monkeypatch
):
    poison_batches(POISON, monkeypatch=monkeypatch)
    rolled, result = train(builtin_data_dir, tmp_path / "rolled", "train.spike.policy=rollback")
    assert result.reason == "completed" and result.step == 24
    (rollback,) = events(tmp_path / "rolled", "rollback")
    assert rollback["restored_step"] == 12 and rollback["spike_step"] == POISON + 1
    assert rollback["step"] == 12 and rollback["redo_updates"] == 4
    margin = rolled.config.train.spike.margin
    assert rollback["skipped"]["first_batch"] == POISON and rollback["skipped"]["batches"] == 1 + margin
    assert rollback["skipped"]["tokens"] == (1 + margin) * rolled.session.tokens_per_microbatch
    assert rollback["skip_data"] == [[POISON, 1 + margin]]
    assert rollback["reproduce"] == f"--set train.skip_data=[[{POISON},{1 + margin}]]"
    # The skip is the run's record (trainer state and run.json), not a change of its recipe.
    assert rolled.config.train.skip_data == []
    (record,) = json.loads((tmp_path / "rolled" / "run.json").read_text())["skip_data"]
    assert record["origin"] == "rollback" and record["spike_step"] == POISON + 1
    assert (record["first_batch"], record["batches"]) == (POISON, 1 + margin)
    assert (
        record["documents"] == rollback["skipped"]["documents"]
        and record["read"] == rollback["skipped"]["read"]
    )
    # The updates between the checkpoint and the spike were redone on the same data: the same losses.
    rolled_losses = losses(tmp_path / "rolled")
    for step in range(13, POISON + 1):
        assert rolled_losses[step][0] == rolled_losses[step][1]

    reference, ref_result = train(
        builtin_data_dir, tmp_path / "reference", rollback["reproduce"].removeprefix("--set ")
    )
    assert ref_result.reason == "completed" and events(tmp_path / "reference", "spike") == []
    ref_losses = losses(tmp_path / "reference")
    assert sorted(ref_losses) == sorted(rolled_losses) == list(range(1, 25))
    for step, values in ref_losses.items():
        assert rolled_losses[step][-1] == values[-1], f"step {step}"
    assert_exactly_equal(weights(rolled), weights(reference))
    state, ref_state = rolled.session.state, reference.session.state
    assert state.counters() == ref_state.counters()  # the skipped data is never counted as seen
    assert state.loader.state_dict() == ref_state.loader.state_dict()

    summary = summarize_run(tmp_path / "rolled")
    assert summary.valid, summary.reasons
    assert summary.overall["updates_applied"] == 24 and summary.overall["tokens_seen"] == state.tokens_seen
    assert summary.overall["updates_rolled_back"] == 4
    assert summary.overall["spikes"]["rollbacks"] == 1
    rule = next(r for r in judge_summary(summary).rules if r.name == "spikes")
    assert rule.status == "WARN"
    # The restored checkpoint and the completed run's final one are protected from pruning, for good.
    marker = json.loads(
        (tmp_path / "rolled" / "checkpoints" / "step-00000024" / "COMMITTED.json").read_text()
    )
    assert marker["protected"] == {"12": "rollback", "24": "final"}


@pytest.mark.slow
def test_a_spike_storm_hits_the_rollback_cap_and_stops(builtin_data_dir, tmp_path, monkeypatch):
    # Without the replay, no cause is named and each rollback restores the newest checkpoint (step 12), whose
    # model meets the poison again with a gradient norm over the bound. With the replay the cause is
    # model_state and the rollback goes back to step 6, where the first poisoned update is under the bound
    # (test_a_constant_poison_met_again_after_a_model_state_rollback_is_fitted_not_flagged); the storm the
    # rule catches with the replay on is the next test's.
    poison_batches(POISON, storm=True, monkeypatch=monkeypatch)
    trainer, result = train(builtin_data_dir, tmp_path / "run", "train.spike.policy=rollback",
                            "train.spike.max_rollbacks=2", "train.spike.margin=0", "train.spike.replay=false")
    assert result.reason == "stopped" and result.exit_code == 1 and "max_rollbacks=2" in result.message
    assert len(events(tmp_path / "run", "rollback")) == 2
    assert [e["action"] for e in events(tmp_path / "run", "spike")][-1] == "stopped"
    assert trainer.session.checkpointer.committed_steps()[-1] == result.step
    summary = summarize_run(tmp_path / "run")
    assert summary.valid, summary.reasons
    assert summary.overall["ended"] == "stopped"
    rule = next(r for r in judge_summary(summary).rules if r.name == "spikes")
    assert rule.status == "FAIL"



def kept(run_dir: Path, field: str) -> dict[int, float]:
    """Per step, the figure of the update the run kept (the last train event of that step)."""
    return {e["step"]: e[field] for e in events(run_dir, "train") if e["window"]["updates_applied"]}


@pytest.mark.slow
def test_a_constant_poison_met_again_after_a_model_state_rollback_is_fitted_not_flagged(
    builtin_data_dir, tmp_path, monkeypatch
):
    """The storm with the replay on, as the rule judges it. Every batch from POISON on reads the same
    degenerate window. From the model of step 16 the first one spikes (gradient norm just over the bound),
    the replay calls the cause model_state and the rollback restores step 6 and skips batches 8..17. Update 9
    back reads poison (batch 18) from the model of step 8, whose gradient norm on it is a poison's (over 4x
    the clean median) but under the bound, even under the bound that flagged the first one: the window judging
    it is not why. Applied, it enters the window, and the model fits the constant window: its loss falls on
    every update to below any loss on the text, its gradient norm shrinks. No update is a spike by
    the rule."""
    import statistics

    from pilotrun.commands.inspect_batch import microbatches_for_step

    poison_batches(POISON, storm=True, monkeypatch=monkeypatch)
    run = tmp_path / "run"
    _, result = train(builtin_data_dir, run, "train.spike.policy=rollback", "train.spike.max_rollbacks=2",
                      "train.spike.margin=0")
    assert result.reason == "completed" and result.step == 24
    (spike,) = events(run, "spike")
    (rollback,) = events(run, "rollback")
    assert spike["spike_step"] == POISON + 1 and spike["cause"] == "model_state"
    assert rollback["restored_step"] == 6 and rollback["skip_data"] == [[8, 10]]
    assert microbatches_for_step(run, 8)[0] == [7] and microbatches_for_step(run, 9)[0] == [18]
    norms, kept_losses = kept(run, "grad_norm"), kept(run, "loss")
    clean = statistics.median(norms[step] for step in range(1, 9))
    first = norms[9]
    assert 4 * clean < first < spike["bounds"]["grad_norm"]["bound"] < spike["grad_norm"]
    assert all(norms[step] < first for step in range(10, 25))
    poisoned = [kept_losses[step] for step in range(9, 25)]
    assert all(later < earlier for earlier, later in zip(poisoned, poisoned[1:]))
    assert poisoned[-1] < min(kept_losses[step] for step in range(1, 9))
    summary = summarize_run(run)
    assert summary.valid, summary.reasons
    assert summary.overall["spikes"]["spikes"] == 1 and summary.overall["spikes"]["rollbacks"] == 1
    # The updates redone after the skip read other batches by design: the resumed rule does not take them
    # for a replay that differs (it has no resume to judge here, and says only that).
    resumed = next(r for r in judge_summary(summary).rules if r.name == "resumed")
    assert "differ" not in resumed.figure and "no resume in the kept history" in resumed.figure
    from pilotrun.report.verdict.continuity import redone_on_other_data

    assert redone_on_other_data(summary) == [(6, POISON + 1)]


@pytest.mark.slow
def test_with_the_replay_a_storm_over_the_bound_is_caught_after_its_rollback_and_stops_at_the_cap(
    builtin_data_dir, tmp_path, monkeypatch
):
    """The same storm against a bound it clears from either model (train.spike.factor=3: 4x the median
    gradient norm at this batch's floor share, the poison's 4.7x to 7.3x): with the replay on, the spike at
    update 17 (cause model_state) rolls back to step 6, the first poisoned update back (update 9, batch 18) is
    caught again, and with train.spike.max_rollbacks=1 the run stops there in one line (exit 1), its
    checkpoint committed."""
    poison_batches(POISON, storm=True, monkeypatch=monkeypatch)
    run = tmp_path / "run"
    trainer, result = train(builtin_data_dir, run, "train.spike.policy=rollback",
                            "train.spike.max_rollbacks=1", "train.spike.margin=0", "train.spike.factor=3")
    assert result.reason == "stopped" and result.exit_code == 1
    assert "max_rollbacks=1 rollbacks done" in result.message and "\n" not in result.message
    first, again = events(run, "spike")
    (rollback,) = events(run, "rollback")
    assert (first["spike_step"], first["cause"], first["action"]) == (POISON + 1, "model_state", "rollback")
    assert rollback["restored_step"] == 6 and rollback["skip_data"] == [[8, 10]]
    assert (again["spike_step"], again["batches"], again["action"]) == (9, [18], "stopped")
    assert again["cause"] == "model_state" and "grad_norm" in again["signals"]
    assert trainer.session.checkpointer.committed_steps()[-1] == result.step == 8
    summary = summarize_run(run)
    assert summary.valid, summary.reasons
    assert summary.overall["ended"] == "stopped"
    verdict = judge_summary(summary)
    # Two spikes and one rollback are within the spikes rule's thresholds (it WARNs); the stop is a NO-GO.
    rule = next(r for r in verdict.rules if r.name == "spikes")
    assert rule.status == "WARN" and rule.figure.startswith("2 spike(s), 1 rollback(s), ")
    assert verdict.decision == "NO-GO", [r.name for r in verdict.rules if r.status == "FAIL"]

@pytest.mark.slow
def test_one_rollback_skips_a_long_noise_document_to_its_end(noise_data, tmp_path):
    """The noise document spans batches `first`..`last` (128 tokens a batch): its first update spikes, and the
    rollback skips from the spiking batch through the batch that holds the document's EOS, so training goes on
    past it with no other spike and completes. run.json's skip_data names the noise document by its index and
    token positions, with the batch range it made the reader pass over."""
    data, start, end, noise = noise_data
    span = 128  # tokens a global batch advances: batch_size 4 x seq_len 32
    first, last = start // span, (end - 2) // span
    assert last - first >= 12  # the document spans many updates
    trainer, result = train(data, tmp_path / "run", "train.spike.policy=rollback")
    assert result.reason == "completed" and result.step == 24
    (spike,) = events(tmp_path / "run", "spike")
    (rollback,) = events(tmp_path / "run", "rollback")
    (batch,) = spike["batches"]
    assert first <= batch <= first + 1 and spike["action"] == "rollback"  # on the noise, as soon as it starts
    skipped = rollback["skipped"]
    # The replay finds the next batches (more noise) spiking too: cause model_state, so the rollback starts
    # the skip where the documents read since the newest checkpoint began (restore_point.py), before the
    # noise, and restores a checkpoint from before that.
    assert spike["cause"] == "model_state"
    skip = rollback["restore"]["suspect_first_batch"]
    assert rollback["restore"] == {"cause": "model_state", "newest_checkpoint": 12,
                                   "suspect_first_batch": skip}
    assert skip <= first and rollback["restored_step"] == 6
    assert skipped["first_batch"] == skip and skipped["documents_through_batch"] == last
    assert skipped["batches"] == last - skip + 1
    assert rollback["skip_data"] == [[skip, last - skip + 1]]
    # every later batch past the noise
    assert trainer.session.state.loader.batch_index == 24 + last - skip + 1
    from pilotrun.commands.inspect_batch import microbatches_for_step

    # inspect-batch names what the last update read: the batch before the cursor, past the skipped noise.
    assert microbatches_for_step(tmp_path / "run", 24)[0] == [trainer.session.state.loader.batch_index - 1]
    said = [line for line in trainer.out.getvalue().splitlines() if line.startswith("spike at update")]
    assert said[0].startswith(f"spike at update {spike['spike_step']} (batches {batch}): loss ")
    assert " -> rolling back; cause " in said[0] and len(said) == 2
    assert said[1].startswith(f"spike at update {spike['spike_step']}: rolled back to step 6, ")
    assert "cause model_state: the documents read since checkpoint step 12 to their end: " in said[1]
    # and both marked on the report's plots, read back from the record: the spike, the span it undid
    from pilotrun.report.drawing.marks import Mark, run_marks

    assert run_marks(summarize_run(tmp_path / "run")) == [
        Mark("rollback", rollback["restored_step"], f"rollback to {rollback['restored_step']}",
             end=spike["spike_step"]),
        Mark("spike", spike["spike_step"], "spike (rollback)")]
    # The record: one rollback, the noise document named (index and where it lies), and the batches skipped.
    (record,) = json.loads((tmp_path / "run" / "run.json").read_text())["skip_data"]
    assert record["origin"] == "rollback" and record["spike_step"] == spike["spike_step"]
    assert (record["first_batch"], record["batches"]) == (skip, last - skip + 1)
    (cause,) = record["documents"]
    assert "source" not in cause and cause["pass"] == 0 and cause["last"] == noise
    assert cause["first"] < noise  # the document the newest checkpoint lay in, and the noise after it
    assert cause["tokens"][1] == end and skip * span <= cause["tokens"][0] < (skip + 1) * span
    (read,) = record["read"]
    # the first skipped batch starts in the document before the one the checkpoint lay in
    assert read["tokens"] == [skip * span, (last + 1) * span + 1] and read["documents"][0] < cause["first"]
    assert read["documents"][1] >= noise  # the last skipped batch holds the noise's EOS (and what follows it)
    assert record == {"origin": "rollback", "spike_step": spike["spike_step"], "first_batch": skip,
                      "batches": last - skip + 1, "documents": skipped["documents"], "read": skipped["read"]}
    # The checkpoint committed right after the rollback holds the record in its trainer state.
    detector = next(h for h in trainer.session.state.hooks if h.name == "spike")
    assert detector.skip_data == [record] and detector.rollbacks == 1
    assert detector.floor_shares["grad_norm"] == 1.0  # the session's 128 tokens per update
    summary = summarize_run(tmp_path / "run")
    assert summary.valid, summary.reasons
    assert summary.overall["spikes"]["spikes"] == summary.overall["spikes"]["rollbacks"] == 1


@pytest.mark.slow
def test_a_rollback_on_a_mixture_names_each_source_it_skips(mixture_sources, tmp_path, monkeypatch):
    """A mixture's spiking batch reads rows of several sources: the rollback steps over each one's documents
    to their end, and the record names them per source (the batches are global: every source's rows in them
    go)."""
    import torch

    from pilotrun.data.mixed_reader import MixedLoader
    from tests.conftest import write_mixture

    original = MixedLoader.next_batch

    def poisoned(self):  # as spike_faults.poison_batches does for a folder, with ids inside this vocabulary
        index = self.batch_index
        inputs, targets = original(self)
        return (
            (torch.full_like(inputs, 7), torch.full_like(targets, 500)) if index == 9 else (inputs, targets)
        )

    monkeypatch.setattr(MixedLoader, "next_batch", poisoned)
    mixture = write_mixture(
        tmp_path / "mix.yaml", [(mixture_sources["edu"], 0.7), (mixture_sources["builtin"], 0.3)]
    )
    trainer, result = train(mixture, tmp_path / "run", "train.spike.policy=rollback", "train.max_steps=14",
                            "train.spike.min_history=4", "optim.schedule.horizon=14")
    assert result.reason == "completed" and result.step == 14
    (rollback,) = events(tmp_path / "run", "rollback")
    assert rollback["spike_step"] == 10 and rollback["restored_step"] == 6
    (record,) = json.loads((tmp_path / "run" / "run.json").read_text())["skip_data"]
    assert record["first_batch"] == 9 and record["batches"] == rollback["skipped"]["batches"] >= 3
    loader = trainer.session.state.loader
    rows = {row["source"] for row in loader.describe_batch(9)}
    assert {d["source"] for d in record["documents"]} == rows and {
        r["source"] for r in record["read"]
    } == set(loader.names)
    assert all(d["first"] <= d["last"] and d["tokens"][0] < d["tokens"][1] for d in record["documents"])
    summary = summarize_run(tmp_path / "run")
    assert summary.valid, summary.reasons


@pytest.mark.slow
def test_an_older_runs_batch_ranges_are_read_and_resumed(builtin_data_dir, tmp_path, monkeypatch):
    """A run from before rollbacks kept their own records: its ranges are batch ranges in the checkpoint's
    recipe and its detector state has no skip_data. Resumed before the range with a command that names none,
    it steps over the range as the run without interruption does, bit for bit, and run.json describes the
    range's documents."""
    from pilotrun.training.spikes.detector import SpikeDetector
    from pilotrun.training.trainer import Trainer

    older = SpikeDetector.state_dict
    monkeypatch.setattr(SpikeDetector, "state_dict", lambda self: {
        k: v for k, v in older(self).items() if k != "skip_data"})  # the older checkpoint format
    train(builtin_data_dir, tmp_path / "older", "train.skip_data=[[16,3]]", "train.max_steps=12")
    monkeypatch.undo()
    resumed = Trainer(
        recipe(), builtin_data_dir, tmp_path / "older", resume=True, progress=False, out=io.StringIO()
    )
    resumed.run()
    straight, _ = train(builtin_data_dir, tmp_path / "straight", "train.skip_data=[[16,3]]")
    assert_exactly_equal(weights(straight), weights(resumed))
    assert losses(tmp_path / "older") == losses(tmp_path / "straight")
    assert resumed.session.state.loader.batch_index == straight.session.state.loader.batch_index == 27
    (described,) = json.loads((tmp_path / "older" / "run.json").read_text())["skip_data"]
    assert described["origin"] == "recipe" and (described["first_batch"], described["batches"]) == (16, 3)
    assert described["read"][0]["tokens"] == [16 * 128, 19 * 128 + 1]
    assert summarize_run(tmp_path / "older").valid


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_poisoned_run_resumed_after_its_spike_continues_exactly(
    builtin_data_dir, tmp_path, monkeypatch, policy
):
    """The detector's window and rollback count travel in the checkpoint: resumed after the spike's answer,
    the run judges and trains as one that never stopped."""
    from pilotrun.training.trainer import Trainer

    poison_batches(POISON, monkeypatch=monkeypatch)
    straight, _ = train(builtin_data_dir, tmp_path / "a", f"train.spike.policy={policy}")
    first = Trainer(
        recipe(f"train.spike.policy={policy}", "train.max_steps=20"),
        builtin_data_dir,
        tmp_path / "b",
        progress=False,
        out=io.StringIO(),
    )
    first.run()
    resumed = Trainer(recipe(f"train.spike.policy={policy}"), builtin_data_dir, tmp_path / "b", resume=True,
                      progress=False, out=io.StringIO())
    resumed.run()
    assert_exactly_equal(weights(straight), weights(resumed))
    detector = next(h for h in resumed.session.state.hooks if h.name == "spike")
    assert (
        detector.state_dict()
        == next(h for h in straight.session.state.hooks if h.name == "spike").state_dict()
    )
    assert summarize_run(tmp_path / "b").valid


def snapshot_around_the_rollbacks_commit(monkeypatch, run_dir: Path, before: Path, after: Path) -> None:
    """The rollback's commit (the checkpoint callback's `save_now`) copies the run folder just before and just
    after it: each copy is the folder a SIGKILL at that moment leaves (every line of the record is flushed as
    it is written)."""
    import shutil

    from pilotrun.training.callbacks.checkpointing import CheckpointCallback

    save_now = CheckpointCallback.save_now

    def snapshotting(self, loop):
        shutil.copytree(run_dir, before, ignore=shutil.ignore_patterns("run.lock"))
        save_now(self, loop)
        shutil.copytree(run_dir, after, ignore=shutil.ignore_patterns("run.lock"))

    monkeypatch.setattr(CheckpointCallback, "save_now", snapshotting)


def counted(run_dir: Path):
    """Everything the verdict, summarize and watch count from a run's record."""
    from pilotrun.report.watch.alerts import Watcher

    summary = summarize_run(run_dir)
    assert summary.valid, summary.reasons
    verdict = judge_summary(summary)
    o = summary.overall
    watcher = Watcher(run_dir)
    watcher.check(final=True)
    return {
        "decision": verdict.decision,
        "rules": [(r.name, r.status, r.figure) for r in verdict.rules],
        "spikes": {k: v for k, v in o["spikes"].items() if k not in ("list", "rollback_list")},
        "listed": [{k: v for k, v in s.items() if k != "line"} for s in o["spikes"]["list"]],
        "counts": {
            k: o[k]
            for k in (
                "updates_applied",
                "updates_attempted",
                "updates_skipped",
                "tokens_seen",
                "updates_rolled_back",
            )
        },
        "alerts": sorted((a.kind, a.message) for a in watcher.raised),
    }


@pytest.mark.slow
def test_a_run_killed_right_after_a_rollback_resumes_as_the_uninterrupted_run(
    builtin_data_dir, tmp_path, monkeypatch
):
    """SIGKILLed right after the rollback committed the restored step again (with the skip and the count in
    its trainer state), the resumed run goes on past the spike's data: the same kept losses and weights, bit
    for bit, one spike and one rollback on file, and the verdict, summarize and watch count exactly what they
    count for the run that was not killed. Killed between the rollback's event and that commit, the resumed
    session starts from the older copy, attempts the spiking update again and logs its spike and rollback a
    second time: it trains exactly the same, and the record counts the spike and the rollback once."""
    from pilotrun.training.trainer import Trainer

    poison_batches(POISON, monkeypatch=monkeypatch)
    # Windows of 6 updates. A first session to step 6 in both, so that both records hold a resume.
    both = ("train.spike.policy=rollback", "train.log_every=6")
    for name in ("straight", "run"):
        train(builtin_data_dir, tmp_path / name, *both, "train.max_steps=6")
    straight = Trainer(recipe(*both), builtin_data_dir, tmp_path / "straight", resume=True, progress=False,
                       out=io.StringIO())
    straight.run()
    before, after = tmp_path / "before", tmp_path / "after"
    snapshot_around_the_rollbacks_commit(monkeypatch, tmp_path / "run", before, after)
    Trainer(
        recipe(*both), builtin_data_dir, tmp_path / "run", resume=True, progress=False, out=io.StringIO()
    ).run()
    monkeypatch.undo()
    poison_batches(POISON, monkeypatch=monkeypatch)
    assert [e["event"] for e in events(before)][-3:] == ["spike", "train", "rollback"]
    assert [e["event"] for e in events(after)][-4:] == ["spike", "train", "rollback", "checkpoint"]
    assert events(after, "checkpoint")[-1]["step"] == events(after, "rollback")[0]["restored_step"] == 12
    straight_record = json.loads((tmp_path / "straight" / "run.json").read_text())["skip_data"]
    straight_counts = counted(tmp_path / "straight")
    for killed in (after, before):
        resumed = Trainer(
            recipe(*both), builtin_data_dir, killed, resume=True, progress=False, out=io.StringIO()
        )
        resumed.run()
        assert_exactly_equal(weights(straight), weights(resumed))
        assert {s: v[-1] for s, v in losses(killed).items()} == {
            s: v[-1] for s, v in losses(tmp_path / "straight").items()
        }
        assert json.loads((killed / "run.json").read_text())["skip_data"] == straight_record
        killed_counts = counted(killed)
        assert killed_counts["spikes"]["spikes"] == killed_counts["spikes"]["rollbacks"] == 1
        assert [kind for kind, _ in killed_counts["alerts"] if kind in ("spike", "rollback")] == [
            "rollback",
            "spike",
        ]
        redone = killed is before  # killed before the commit: the spiking attempt was made again
        assert len(events(killed, "spike")) == len(events(killed, "rollback")) == 1 + redone
        # What the interruption itself cost is the interrupted run's own: one more session (a resume more, one
        # window fewer past a session's first to compare throughput, another process's memory), and where the
        # attempt was redone, its updates rolled back twice. Every other figure and status is the
        # uninterrupted run's.
        assert killed_counts["counts"]["updates_rolled_back"] == (
            straight_counts["counts"]["updates_rolled_back"] + 4 * redone)
        own = ("resumed", "throughput_steady", "memory")
        assert ([(n, s, None if n in own else f) for n, s, f in killed_counts["rules"]]
                == [(n, s, None if n in own else f) for n, s, f in straight_counts["rules"]])
        for key in ("decision", "spikes", "listed", "alerts"):
            assert killed_counts[key] == straight_counts[key], key
        assert {k: v for k, v in killed_counts["counts"].items() if k != "updates_rolled_back"} == {
            k: v for k, v in straight_counts["counts"].items() if k != "updates_rolled_back"}
