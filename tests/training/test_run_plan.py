"""The plan at a session's start: its figures are the model's own counts and the data's own token counts,
exactly; a mixture's per-source tokens are what the run then reads; the wall time comes from the lock, else
the record, else is unknown."""

from __future__ import annotations

import io
import json
import statistics
import types
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.data.mixed_reader import open_data
from pilotrun.data.reader import open_dataset
from pilotrun.data.windows import batches_per_pass
from pilotrun.model.accounting import count_parameters, flops_per_token
from pilotrun.report.record_check.mixture_account import source_passes
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.evidence import pass_tokens
from pilotrun.run.record import read_run_json, recorded_seconds_per_update
from pilotrun.training.run_plan import UNKNOWN_WALL, data_plan, plan_lines, wall_plan
from pilotrun.training.trainer import Trainer
from tests.conftest import write_mixture

ROOT = Path(__file__).resolve().parents[2]


def recipe(*extra: str):
    return load_run_config(ROOT / "configs" / "smoke.yaml", ["train.num_threads=1", *extra])


def train(data, run_dir, *extra: str, **kwargs) -> tuple[str, Trainer]:
    out = io.StringIO()
    trainer = Trainer(recipe(*extra), data, run_dir, progress=False, out=out, **kwargs)
    assert trainer.run().reason == "completed"
    return out.getvalue(), trainer


@pytest.mark.slow
def test_the_plan_is_the_models_counts_and_the_datas_tokens_and_a_resume_plans_from_the_record(
    builtin_data_dir, tmp_path
):
    run_dir = tmp_path / "run"
    out, trainer = train(builtin_data_dir, run_dir, "train.max_steps=4")
    run = read_run_json(run_dir)
    plan, config = run["plan"], trainer.config  # the vocabulary resolved from the data
    total, active = count_parameters(config.model)
    assert plan["model"] == {"parameters": total, "active_parameters": active,
                             "flops_per_token": float(flops_per_token(config.model, config.train.seq_len))}
    split_tokens = open_dataset(builtin_data_dir).split("train").num_tokens
    per_batch = config.train.batch_size * config.train.seq_len
    one_pass = batches_per_pass(split_tokens, config.train.seq_len, config.train.batch_size) * per_batch
    data = plan["data"]
    assert (data["train_tokens"], data["pass_tokens"]) == (split_tokens, one_pass)
    assert data["tokens"] == 4 * per_batch
    assert data["passes"] == 4 * per_batch / one_pass
    # the verdict's data_passes counts in the same pass
    assert pass_tokens(summarize_run(run_dir))[0] == one_pass
    assert (plan["lock"], plan["wall"]["seconds"], plan["wall"]["from"]) == (None, None, UNKNOWN_WALL)
    assert plan["session_id"] == run["sessions"][0]["session_id"]
    for line in plan_lines(plan):
        assert line in out

    recorded = recorded_seconds_per_update(run_dir)
    out, _ = train(builtin_data_dir, run_dir, "train.max_steps=6", "optim.schedule.horizon=6", resume=True)
    plan = read_run_json(run_dir)["plan"]
    assert (plan["start_step"], plan["wall"]["updates_left"]) == (4, 2)
    assert plan["wall"]["seconds"] == statistics.median(recorded) * 2
    assert plan["wall"]["from"].startswith("the record: median")
    assert plan["session_id"] == read_run_json(run_dir)["sessions"][1]["session_id"]
    assert "plan: wall time left" in out
    assert summarize_run(run_dir).valid  # the plan is beside the record's digested sections


@pytest.mark.slow
def test_a_mixtures_plan_names_each_sources_tokens_as_the_run_then_reads_them(mixture_sources, tmp_path):
    mixture = write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], 0.7),
                                                    (mixture_sources["builtin"], 0.3)])
    run_dir = tmp_path / "run"
    out, _ = train(mixture, run_dir, "train.max_steps=5", "train.gradient_accumulation_steps=2")
    plan = read_run_json(run_dir)["plan"]["data"]
    assert plan["exact"]  # every source owed a row a batch or more: the schedule's rows, not walked
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == "train"][-1]
    assert {s["name"]: s["tokens"] for s in plan["sources"]} == last["tokens_seen_by_source"]
    dataset = open_data(mixture)
    assert [s["train_tokens"] for s in plan["sources"]] == [
        split.num_tokens for split in dataset.splits("train")
    ]
    assert [s["weight"] for s in plan["sources"]] == [0.7, 0.3]
    found = {r["name"]: r["passes"] for r in source_passes(read_run_json(run_dir),
                                                           summarize_run(run_dir).kept_events, 32)}
    assert {s["name"]: s["passes"] for s in plan["sources"]} == found
    assert plan["passes"] == max(found.values())
    assert sum(s["tokens"] for s in plan["sources"]) == plan["tokens"]
    for s in plan["sources"]:
        assert f"plan:   source {s['name']}: weight {s['weight']:g}" in out


def test_a_frozen_runs_wall_time_is_the_locks_projection_scaled_to_the_updates_left():
    run = {"frozen": {"lock_projection": {"target_steps": 200,
                                          "total_wall": {"seconds": 1000.0, "band": [800.0, 1400.0]}}}}
    wall = wall_plan(run, 50, 200, [9.0, 9.0], now=0.0)
    assert (wall["seconds"], wall["band"], wall["updates_left"]) == (750.0, [600.0, 1050.0], 150)
    assert wall["end"] == "1970-01-01T00:12:30+00:00"
    assert wall["from"].startswith("the lock's projection")
    # without a projection the record's median, without a record unknown
    unprojected = {"frozen": {"lock_projection": None}}
    assert wall_plan(unprojected, 50, 200, [1.0, 3.0, 2.0], now=0.0)["seconds"] == 300.0
    assert wall_plan({}, 0, 200, [], now=0.0)["from"] == UNKNOWN_WALL


def test_the_block_names_the_locks_accepted_differences_and_a_repeated_batch():
    plan = {"model": {"parameters": 1000, "active_parameters": 600, "flops_per_token": 3600.0},
            "data": {"tokens": 256, "updates": 2, "global_batches": 2, "passes": None,
                     "why": "data_mode repeat_batch: one batch read 2 times"},
            "lock": {"lock_sha256": "ab" * 32, "pilot_run_id": "run-1", "allowed": ["train.max_steps"],
                     "differences": [{"key": "train.max_steps", "lock": 200, "run": 2000}]},
            "wall": {"seconds": None, "band": None, "end": None, "from": UNKNOWN_WALL, "updates_left": 2}}
    lines = plan_lines(plan)
    assert lines[0] == "plan: model 1,000 parameters, 600 active per token, 3600 training FLOP per token"
    assert lines[1] == "plan: 256 tokens in 2 updates = data_mode repeat_batch: one batch read 2 times"
    assert lines[2] == ("plan: lock abababababab (pilot run-1); accepted differences: train.max_steps 200 -> "
                        "2000")
    assert lines[3] == f"plan: wall time {UNKNOWN_WALL}"


def test_the_wall_line_gives_the_time_left_its_band_and_its_end():
    wall = wall_plan({"frozen": {"lock_projection": {"target_steps": 100, "total_wall": {
        "seconds": 4500.0, "band": [3600.0, 7200.0]}}}}, 0, 100, [], now=0.0)
    plan = {"model": {"parameters": 1, "active_parameters": 1, "flops_per_token": 6.0},
            "data": {"tokens": 8, "updates": 1, "global_batches": 1, "passes": 0.5, "train_tokens": 17,
                     "why": "one pass = 2 global batches of 8 tokens"}, "lock": None, "wall": wall}
    assert plan_lines(plan)[1] == ("plan: 8 tokens in 1 updates = 0.5 passes over the training split (17 "
                                   "tokens; one pass = 2 global batches of 8 tokens)")
    assert plan_lines(plan)[2] == (
        "plan: wall time left 1 h 15 min (band 1 h 00 min .. 2 h 00 min), ending about "
        "1970-01-01T01:15:00+00:00 (the lock's projection: total_wall 4500 s for its 100 updates, scaled to "
        "the 100 left)")
    wall["seconds"], wall["band"] = 0.18, None
    assert plan_lines(plan)[2].startswith("plan: wall time left 0.18 s, ending about")


def test_a_repeated_batch_plans_no_passes():
    loader = types.SimpleNamespace(mode="repeat_batch")
    plan = data_plan(loader, {"tokens_per_update": 128}, max_steps=5, accumulation=2)
    assert plan == {"tokens": 640, "updates": 5, "global_batches": 10, "passes": None,
                    "why": "data_mode repeat_batch: one batch read 10 times"}
