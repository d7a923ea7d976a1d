"""Exact continuation in one process (case 1; cases 2 and 3 are test_resume_cli.py), and resume refusals
through the Trainer.

Run A trains N updates straight. Run B trains K updates (its end-of-run checkpoint), then a fresh Trainer
resumes it with max_steps=N and continues. Per-step losses, final weights (expert biases included), optimizer
and scaler state, loader positions, trainer counters and the next draws of every RNG must be identical:
torch.equal and exact float equality, no tolerances. The recipe makes the mechanisms under test act: QK-Clip's
tau is below the tiny model's max logits so heads are clipped most updates, the aux-free expert bias moves
every update, and in fp16 the loss scale starts just under the overflow point and grows every update, so
skipped updates and scale changes straddle the checkpoint.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pilotrun.common.errors import CheckpointError
from pilotrun.config import load_run_config
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from tests.exactness import assert_exactly_equal

ROOT = Path(__file__).resolve().parents[2]
N_STEPS = 8
K_STEPS = 3


def acting_recipe(precision: str, max_steps: int, extra: tuple[str, ...] = ()):
    return load_run_config(ROOT / "configs" / "smoke.yaml", [
        f"train.precision={precision}", f"train.max_steps={max_steps}", "train.num_threads=1",
        "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0", "train.keep_checkpoints=3",
        "optim.qk_clip.tau=0.005",  # below the tiny model's max logits (~0.006-0.01): clipping acts
        "optim.schedule.horizon=20",
        "train.loss_scale_init=2097152", "train.loss_scale_growth_interval=1",  # fp16: overflows recur
        *extra,
    ])


def seed_global_generators(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def next_draws() -> tuple:
    return (random.random(), random.getrandbits(64), np.random.rand(3).tolist(), torch.rand(5))


def train_losses(run_dir: Path) -> dict[int, list[float]]:
    """step -> every `loss` logged for it (one entry per session that logged that step)."""
    losses: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "train":
            assert event["window"]["updates_applied"] == 1  # log_every=1: one applied update per window
            losses.setdefault(event["step"], []).append(event["loss"])
    return losses


def event_count(run_dir: Path, name: str) -> int:
    return sum(
        json.loads(line)["event"] == name for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    )


def make_trainer(config, data_dir, run_dir, **kwargs):
    from pilotrun.training.trainer import Trainer

    return Trainer(config, data_dir, run_dir, progress=False, out=io.StringIO(), **kwargs)


def final_state(trainer) -> dict:
    session = trainer.session
    return {"model": session.raw_model.state_dict(), "optimizer": session.optimizer.state_dict(),
            "scaler": session.scaler.state_dict(), "trainer": session.state.state_dict()}


def qk_counters(trainer):
    """QK-Clip's counters, from the session's update hook of that name."""
    return next(hook for hook in trainer.session.state.hooks if hook.name == "qk_clip").counters


@pytest.fixture
def training_draws_random_numbers(monkeypatch):
    """The recipe's training draws no random numbers after the model is built, so without this the "next
    draws" check would hold even if the checkpoint's RNG state were never restored (the fresh trainer's
    seeding alone would reproduce it). Each microbatch here draws from every generator, as dropout or random
    sampling would, so the RNG state after N updates depends on the updates done before the checkpoint."""
    from pilotrun.data import reader

    original = reader.BatchLoader.next_batch

    def next_batch_drawing(self):
        random.random()
        np.random.rand()
        torch.rand(1)
        return original(self)

    monkeypatch.setattr(reader.BatchLoader, "next_batch", next_batch_drawing)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_in_process_is_bit_identical(
    builtin_data_dir, tmp_path, precision, training_draws_random_numbers
):
    # A: straight to N.
    seed_global_generators(1234)
    run_a = make_trainer(acting_recipe(precision, N_STEPS), builtin_data_dir, tmp_path / "a")
    assert run_a.run().reason == "completed"
    draws_a = next_draws()
    state_a = final_state(run_a)

    # B: to K (the end-of-run checkpoint), then a fresh trainer resumes it to N. The global generators are
    # scrambled in between, so only the checkpoint's RNG state can make the draws match.
    seed_global_generators(1234)
    run_b1 = make_trainer(acting_recipe(precision, K_STEPS), builtin_data_dir, tmp_path / "b")
    assert run_b1.run().reason == "completed"
    assert Checkpointer(tmp_path / "b", keep=3).committed_steps() == [K_STEPS]
    del run_b1
    seed_global_generators(999)
    torch.rand(100)
    run_b2 = make_trainer(acting_recipe(precision, N_STEPS), builtin_data_dir, tmp_path / "b", resume=True)
    assert run_b2.session.state.step == K_STEPS and run_b2.session.resumed_from == K_STEPS
    assert run_b2.run().reason == "completed"
    draws_b = next_draws()
    state_b = final_state(run_b2)

    # The mechanisms under test did act (otherwise equality would prove less).
    assert qk_counters(run_a).updates_with_clip >= N_STEPS - 1
    assert all(bool(layer.gate.expert_bias.abs().sum() > 0) for layer in run_a.session.raw_model.moe_layers())
    if precision == "fp16":
        assert (
            run_a.session.state.updates_skipped > 0
            and event_count(tmp_path / "a", "overflow") == run_a.session.state.updates_skipped
        )

    losses_a, losses_b = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(losses_a) == sorted(losses_b) == list(range(1, N_STEPS + 1))
    for step in losses_a:
        assert losses_b[step] == losses_a[step], f"step {step}: {losses_b[step]} != {losses_a[step]}"
    assert_exactly_equal(state_a, state_b)
    assert state_a["trainer"]["train_loader"] == state_b["trainer"]["train_loader"]
    assert_exactly_equal(draws_a, draws_b, "next RNG draws")

    # The final checkpoints on disk agree too, tensor for tensor.
    saved_a, meta_a = Checkpointer(tmp_path / "a", keep=3).load()
    saved_b, _ = Checkpointer(tmp_path / "b", keep=3).load()
    assert_exactly_equal(saved_a, saved_b, "final checkpoint")
    # Everything an exact resume restores is in the checkpoint.
    assert set(saved_a) == {"model", "optimizer", "scaler", "trainer", "rng"}
    assert any(name.endswith("gate.expert_bias") for name in saved_a["model"])
    assert saved_a["trainer"]["qk_clip"]["updates_with_clip"] == qk_counters(run_a).updates_with_clip
    assert {"recipe", "data", "world_size", "software", "hardware", "optimizer"} <= set(meta_a)
    assert meta_a["recipe"]["train"]["precision"] == precision and meta_a["world_size"] == 1
    assert meta_a["data"]["metadata_sha256"] == run_a.session.dataset.metadata_sha256


@pytest.mark.slow
def test_resume_from_an_earlier_step_and_a_damaged_newest(builtin_data_dir, tmp_path):
    """--from-step: a checkpoint before the newest continues exactly too; a damaged file is named."""
    seed_global_generators(7)
    straight = make_trainer(acting_recipe("fp32", 6), builtin_data_dir, tmp_path / "a")
    straight.run()
    seed_global_generators(7)
    make_trainer(
        acting_recipe("fp32", 6, ("train.checkpoint_every=2",)), builtin_data_dir, tmp_path / "b"
    ).run()
    checkpointer = Checkpointer(tmp_path / "b", keep=3)
    assert checkpointer.committed_steps() == [2, 4, 6]
    victim = tmp_path / "b" / "checkpoints" / "step-00000006" / "model.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x10
    victim.write_bytes(bytes(data))
    recipe = acting_recipe("fp32", 6, ("train.checkpoint_every=2",))
    with pytest.raises(CheckpointError, match=r"step-00000006/model\.pt .*--from-step 4"):
        make_trainer(recipe, builtin_data_dir, tmp_path / "b", resume=True)
    resumed = make_trainer(recipe, builtin_data_dir, tmp_path / "b", resume=True, from_step=2)
    assert resumed.session.state.step == 2
    resumed.run()
    assert_exactly_equal(final_state(straight), final_state(resumed))
    # The abandoned later timeline (steps 4 and damaged 6) was replaced by the resumed one's checkpoints.
    assert Checkpointer(tmp_path / "b", keep=3).committed_steps() == [2, 4, 6]
    saved, _ = Checkpointer(tmp_path / "b", keep=3).load()
    assert_exactly_equal(saved["model"], final_state(straight)["model"])


INCOMPATIBLE_CHANGES = [
    ("model.moe_hidden=96", "model.moe_hidden"),  # also changes the partition's element counts: 2 differences
    ("model.balance=seq", "model.balance"),
    ("optim.muon.lr=0.01", "optim.muon.lr"),
    ("optim.adamw.weight_decay=0.0", "optim.adamw.weight_decay"),
    ("train.batch_size=2", "train.batch_size"),
    ("train.seq_len=16", "train.seq_len"),
    ("train.gradient_accumulation_steps=2", "train.gradient_accumulation_steps"),
    ("train.precision=bf16", "train.precision"),
    ("train.seed=5", "train.seed"),
]


@pytest.fixture(scope="module")
def short_run(builtin_data_dir, tmp_path_factory):
    """A committed 2-step run whose folder the refusal tests copy (each refusal must leave it untouched)."""
    run_dir = tmp_path_factory.mktemp("resume_refusals") / "run"
    make_trainer(acting_recipe("fp32", 2), builtin_data_dir, run_dir).run()
    return run_dir


def folder_snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("override,named", INCOMPATIBLE_CHANGES)
def test_each_incompatible_change_is_refused_naming_it(
    builtin_data_dir, short_run, tmp_path, override, named
):
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)
    before = folder_snapshot(run_dir)
    with pytest.raises(CheckpointError, match=rf"{named}: .* -> ") as caught:
        make_trainer(acting_recipe("fp32", 4, (override,)), builtin_data_dir, run_dir, resume=True)
    expected = 2 if named == "model.moe_hidden" else 1
    assert f"{expected} incompatible difference" in str(caught.value)
    assert folder_snapshot(run_dir) == before  # nothing written: no session, no metrics, no checkpoint change


@pytest.mark.slow
def test_allowed_change_is_applied_and_recorded(builtin_data_dir, short_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)
    trainer = make_trainer(acting_recipe("fp32", 3, ("optim.muon.lr=0.001",)), builtin_data_dir, run_dir,
                           resume=True, allow_changes=["optim.muon.lr"])
    assert trainer.config.optim.muon.lr == 0.001 and trainer.config.train.max_steps == 3
    trainer.run()
    record = json.loads((run_dir / "run.json").read_text())
    assert [(c["key"], c["old"], c["new"]) for c in record["allowed_changes"]] == [
        ("optim.muon.lr", 0.003, 0.001)
    ]
    assert record["recipe"]["optim"]["muon"]["lr"] == 0.001  # the effective recipe, restored + allowed change


@pytest.mark.slow
def test_other_data_is_refused(short_run, tmp_path):
    from pilotrun.data.prepare import prepare_corpus

    other = tmp_path / "other_data"
    prepare_corpus(other, source="builtin", tokenizer="bpe:4096", seed=1, progress=False, workers=1)
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)
    with pytest.raises(CheckpointError, match=r"data\.metadata_sha256: "):
        make_trainer(acting_recipe("fp32", 4), other, run_dir, resume=True)


@pytest.mark.slow
def test_compiled_run_resumes_bit_for_bit_and_trains_like_eager(builtin_data_dir, tmp_path):
    # train.compile=inductor with the CPU kernels (the MoE layers stay eager between the compiled parts):
    # straight to N, and to K then resumed to N in a fresh trainer (which compiles again), give the same
    # losses and state bit for bit; inductor's fused code rounds otherwise than eager, so against eager the
    # losses agree closely.
    compiled = ("train.compile=inductor",)
    losses, states = {}, {}
    for name, steps, resume in (("a", N_STEPS, False), ("b", K_STEPS, False), ("b", N_STEPS, True),
                                ("eager", N_STEPS, False)):
        trainer = make_trainer(
            acting_recipe("fp32", steps, () if name == "eager" else compiled),
            builtin_data_dir,
            tmp_path / name,
            resume=resume,
        )
        assert trainer.run().reason == "completed"
        blocks = [block._compiled_call_impl is not None for block in trainer.session.raw_model.layers]
        assert all(blocks) if name != "eager" else not any(blocks)
        losses[name], states[name] = train_losses(tmp_path / name), final_state(trainer)
    assert losses["a"] == losses["b"] and sorted(losses["a"]) == list(range(1, N_STEPS + 1))
    assert_exactly_equal(states["a"], states["b"])
    for step, (loss,) in losses["eager"].items():
        assert losses["a"][step][0] == pytest.approx(loss, rel=1e-4), step
