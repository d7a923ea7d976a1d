"""Spikes in a real (smoke-sized) training run: a poisoned batch (tests/training/spike_faults.py) makes a spike at
its update; each policy answers it and the record reconciles.

- record: the spike event names the update, the batch and the cause ("batch": it recurs bit for bit on its
  batch, not on the next); the replay changes nothing: the run equals one without replay, bit for bit;
- skip: one skipped update with reason spike (a `spike` event, no `overflow`), the step and schedule unmoved;
- rollback: the continued run equals, bit for bit (weights, optimizer, every kept loss), a reference run told to
  skip the same data from the start with the `train.skip_data` the rollback event records; the updates between
  the checkpoint and the spike are redone with the same losses; summarize counts the undone work as rolled back;
- a spike storm hits train.spike.max_rollbacks and the run stops ("stopped", exit 1) with a checkpoint.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.report.summarize import summarize_run
from pilotrun.report.verdict import judge_summary
from tests.exactness import assert_exactly_equal
from tests.training.spike_faults import poison_batches

ROOT = Path(__file__).resolve().parents[3]
POISON = 16  # cursor position of the poisoned microbatch: update 17 reads it (accumulation 1)


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
def test_record_names_the_poisoned_batch_and_its_replay_changes_nothing(builtin_data_dir, tmp_path, monkeypatch):
    poison_batches(POISON, monkeypatch=monkeypatch)
    replayed, result = train(builtin_data_dir, tmp_path / "replayed")
    assert result.reason == "completed" and result.updates_skipped == 0
    (spike,) = events(tmp_path / "replayed", "spike")
    assert spike["spike_step"] == POISON + 1 and spike["batches"] == [POISON] and spike["action"] == "recorded"
    assert "grad_norm" in spike["signals"] and spike["grad_norm"] > spike["bounds"]["grad_norm"]["bound"]
    assert spike["cause"] == "batch" and spike["replay"]["bitwise"] is True
    assert spike["replay"]["same_batch"] == spike["per_rank"] and spike["replay"]["next_batches"] == [POISON + 1]
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
    assert spike["action"] == "skipped" and spike["skipped"] is True and spike["step"] == POISON  # step unmoved
    assert spike["updates_skipped"] == 1 and events(tmp_path / "run", "overflow") == []
    summary = summarize_run(tmp_path / "run")
    assert summary.valid, summary.reasons
    assert summary.overall["updates_skipped"] == 1


@pytest.mark.slow
def test_rollback_continues_exactly_as_a_run_told_to_skip_the_same_data(builtin_data_dir, tmp_path, monkeypatch):
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
    # The updates between the checkpoint and the spike were redone on the same data: the same losses.
    rolled_losses = losses(tmp_path / "rolled")
    for step in range(13, POISON + 1):
        assert rolled_losses[step][0] == rolled_losses[step][1]

    reference, ref_result = train(builtin_data_dir, tmp_path / "reference", rollback["reproduce"].removeprefix("--set "))
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
    marker = json.loads((tmp_path / "rolled" / "checkpoints" / "step-00000024" / "COMMITTED.json").read_text())
    assert marker["protected"] == {"12": "rollback", "24": "final"}


@pytest.mark.slow
def test_a_spike_storm_hits_the_rollback_cap_and_stops(builtin_data_dir, tmp_path, monkeypatch):
    poison_batches(POISON, storm=True, monkeypatch=monkeypatch)
    trainer, result = train(builtin_data_dir, tmp_path / "run", "train.spike.policy=rollback",
                            "train.spike.max_rollbacks=2", "train.spike.margin=0")
    assert result.reason == "stopped" and result.exit_code == 1 and "max_rollbacks=2" in result.message
    assert len(events(tmp_path / "run", "rollback")) == 2
    assert [e["action"] for e in events(tmp_path / "run", "spike")][-1] == "stopped"
    assert trainer.session.checkpointer.committed_steps()[-1] == result.step
    summary = summarize_run(tmp_path / "run")
    assert summary.valid, summary.reasons
    assert summary.overall["ended"] == "stopped"
    rule = next(r for r in judge_summary(summary).rules if r.name == "spikes")
    assert rule.status == "FAIL"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_poisoned_run_resumed_after_its_spike_continues_exactly(builtin_data_dir, tmp_path, monkeypatch, policy):
    """The detector's window and rollback count travel in the checkpoint: resumed after the spike's answer, the
    run judges and trains as one that never stopped."""
    from pilotrun.training.trainer import Trainer

    poison_batches(POISON, monkeypatch=monkeypatch)
    straight, _ = train(builtin_data_dir, tmp_path / "a", f"train.spike.policy={policy}")
    first = Trainer(recipe(f"train.spike.policy={policy}", "train.max_steps=20"), builtin_data_dir, tmp_path / "b",
                    progress=False, out=io.StringIO())
    first.run()
    resumed = Trainer(recipe(f"train.spike.policy={policy}"), builtin_data_dir, tmp_path / "b", resume=True,
                      progress=False, out=io.StringIO())
    resumed.run()
    assert_exactly_equal(weights(straight), weights(resumed))
    detector = next(h for h in resumed.session.state.hooks if h.name == "spike")
    assert detector.state_dict() == next(h for h in straight.session.state.hooks if h.name == "spike").state_dict()
    assert summarize_run(tmp_path / "b").valid
