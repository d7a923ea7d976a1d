"""The recipes in configs/: each validates, has the shapes it claims, and does what it is for."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.model.accounting import count_parameters
from pilotrun.run.record import read_metrics_strict
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = ("smoke", "overfit", "acceptance", "stability")
# The bound the overfit recipe must reach: mean CE of its last logging window (10 updates) on the one
# repeated batch. The initial loss is ln(4096) ~ 8.3 on the built-in corpus's 4,096-token vocabulary.
OVERFIT_BOUND = 0.05


def run_recipe(name: str, data_dir: Path, run_dir: Path, *overrides: str):
    config = load_run_config(CONFIGS / f"{name}.yaml", ["train.num_threads=1", *overrides])
    trainer = Trainer(config, data_dir, run_dir, progress=False)
    return trainer, trainer.run(), read_metrics_strict(run_dir)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("gpu/*.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_recipe_validates(path):
    config = load_run_config(path)
    assert config.model.vocab_size == 0  # the data folder's tokenizer decides
    assert config.train.num_threads == 0  # left to torch; tests pin it


def test_cpu_and_gpu_recipe_sets_match():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(RECIPES)
    assert {p.stem for p in (CONFIGS / "gpu").glob("*.yaml")} == set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_gpu_recipes_are_gpu_100m(name):
    config = load_run_config(CONFIGS / "gpu" / f"{name}.yaml", ["model.vocab_size=32768"])
    total, active = count_parameters(config.model)
    # the gpu-100m preset: 104.7M total / 55.1M active with a 32,768 vocabulary
    assert total == pytest.approx(104.7e6, rel=0.005) and active == pytest.approx(55.1e6, rel=0.005)
    assert config.train.precision == "bf16"


def test_cpu_recipes_data_modes():
    modes = {name: load_run_config(CONFIGS / f"{name}.yaml").train.data_mode for name in RECIPES}
    assert modes == {"smoke": "successive", "overfit": "repeat_batch", "acceptance": "repeat_batch",
                     "stability": "successive"}


@pytest.mark.slow
def test_overfit_recipe_drives_the_loss_below_the_bound(builtin_data_dir, tmp_path):
    _, result, events = run_recipe("overfit", builtin_data_dir, tmp_path / "run")
    trains = [e for e in events if e["event"] == "train"]
    assert result.reason == "completed" and result.updates_skipped == 0
    assert trains[0]["loss"] > 5.0  # it started far from the bound
    assert trains[-1]["loss"] < OVERFIT_BOUND, [round(e["loss"], 4) for e in trains]


@pytest.mark.slow
def test_acceptance_recipe_exercises_the_full_machinery(builtin_data_dir, tmp_path):
    trainer, result, events = run_recipe("acceptance", builtin_data_dir, tmp_path / "run")
    assert result.reason == "completed" and result.step == 80
    trains = [e for e in events if e["event"] == "train"]
    # accumulation
    assert all(e["window"]["microbatches"] == 2 * e["window"]["updates_attempted"] for e in trains)
    assert trains[-1]["loss"] < 1.0 < trains[0]["loss"]  # it memorises the repeated batch
    final_qk = trains[-1]["qk_clip"]
    assert final_qk["cumulative_interventions"] > 0 and final_qk["updates_with_clip"] > 0  # QK-Clip acted
    assert sum(e["qk_clip"]["heads_clipped"] for e in trains) == final_qk["cumulative_interventions"]
    assert any(e["qk_clip"]["first_clipped"] for e in trains)
    assert trainer.config.model.q_lora_rank > 0  # the compressed-query path was the one clipped
    assert trains[-1]["moe"]["bias_abs_max"] > 0  # the aux-free bias moved
    assert {g["optimizer"] for g in trainer.partition} == {"muon", "adamw"}
    assert Checkpointer(tmp_path / "run", keep=2).committed_steps() == [60, 80]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [20, 40, 60, 80]
    assert [e["step"] for e in events if e["event"] == "val"] == [20, 40, 60, 80]


@pytest.mark.slow
def test_stability_recipe_starts(builtin_data_dir, tmp_path):
    # The whole recipe is the pilot's job (minutes); here its first updates must run and be recorded.
    _, result, events = run_recipe("stability", builtin_data_dir, tmp_path / "run", "train.max_steps=5")
    assert result.step == 5 and [e["event"] for e in events].count("train") == 1
    assert result.tokens_seen == 5 * 8 * 64
