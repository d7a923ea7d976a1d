"""train.num_threads 0: the thread count chosen from the process's affinity, the cores free at start and a
short measured comparison on the recipe's own update; recorded once and kept on resume; skipped when set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.training import thread_choice
from pilotrun.training.thread_choice import candidates, choose_threads, free_cpus, measure, recorded_threads

ROOT = Path(__file__).resolve().parents[2]


def _recipe(*overrides: str):
    config = load_run_config("smoke", list(overrides))
    config.model.vocab_size = 256  # what the session resolves from the data
    return config


def _never(*args, **kwargs):
    raise AssertionError("nothing is measured here")


def test_a_set_count_a_recorded_one_and_several_ranks_are_not_measured():
    assert choose_threads(_recipe("train.num_threads=3"), local_ranks=1, world_size=1, device_type="cpu",
                          measure_fn=_never, free_fn=_never).record()["how"] == "set"
    kept = choose_threads(
        _recipe(),
        local_ranks=1,
        world_size=1,
        device_type="cpu",
        recorded=1,
        measure_fn=_never,
        free_fn=_never,
    )
    assert (kept.threads, kept.how) == (1, "recorded") and "kept on resume" in kept.describe()
    ranks = choose_threads(_recipe(), local_ranks=2, world_size=2, device_type="cpu", measure_fn=_never,
                           free_fn=_never)
    assert ranks.how == "default" and "not measured (several ranks)" in ranks.describe()
    assert choose_threads(_recipe(), local_ranks=1, world_size=1, device_type="cuda", measure_fn=_never,
                          free_fn=_never).how == "default"


@pytest.mark.parametrize(("timed", "chosen"), [
    ({1: 0.05, 2: 2.0}, 1),  # a busy machine: the second thread waits on a descheduled sibling
    ({1: 0.10, 2: 0.06}, 2),  # a quiet one: two cores, twice the work done
    ({1: 0.10, 2: 0.095}, 1),  # a near tie goes to fewer threads, leaving the machine's other work a core
])
def test_the_fastest_measured_count_wins(monkeypatch, timed, chosen):
    monkeypatch.setattr(thread_choice, "default_threads", lambda local_ranks: 2)
    asked = []
    choice = choose_threads(_recipe(), local_ranks=1, world_size=1, device_type="cpu",
                            measure_fn=lambda config, options: asked.append(options) or timed,
                            free_fn=lambda cpus: 0.4)
    assert asked == [[1, 2]] and (choice.threads, choice.how) == (chosen, "measured")
    record = choice.record()
    assert (
        record["seconds_per_update"] == {str(k): v for k, v in timed.items()} and record["free_cpus"] == 0.4
    )
    assert choice.describe().startswith(f"threads: {chosen}, measured on the recipe's update")


def test_too_slow_to_measure_falls_back_to_the_cores_free_at_start(monkeypatch):
    monkeypatch.setattr(thread_choice, "default_threads", lambda local_ranks: 8)
    choice = choose_threads(_recipe(), local_ranks=1, world_size=1, device_type="cpu",
                            measure_fn=lambda config, options: {}, free_fn=lambda cpus: 2.7)
    assert (choice.threads, choice.how) == (3, "default") and "too slow to compare" in choice.why


def test_candidates_and_the_free_cpus_of_the_affinity():
    assert candidates(8, 2.7) == [1, 3, 8] and candidates(2, 0.0) == [1, 2] and candidates(1, None) == [1]
    stats = iter(
        [
            "cpu  1 1 1 1 1 1 1 1\ncpu0 0 0 100 100 0 0 0 0\ncpu1 0 0 100 100 0 0 0 0\ncpu2 0 0 0 0 0 0 0 "
            "0\n",
            "cpu  1 1 1 1 1 1 1 1\ncpu0 0 0 175 125 0 0 0 0\ncpu1 0 0 100 200 0 0 0 0\ncpu2 0 0 9 9 0 0 0 "
            "0\n",
        ]
    )
    # cpu0 was idle a quarter of the sample, cpu1 all of it; cpu2 is outside the affinity.
    assert free_cpus([0, 1], read_stat=lambda: next(stats), sleep=lambda s: None) == 1.25


def test_measure_times_every_candidate_on_a_throwaway_copy_of_the_recipe():
    import torch

    before = torch.random.get_rng_state()
    timed = measure(_recipe(), [1, 2], budget_seconds=60.0)
    assert sorted(timed) == [1, 2] and all(seconds > 0 for seconds in timed.values())
    assert torch.get_num_threads() == 1  # the test's own setting is back
    assert torch.equal(before, torch.random.get_rng_state())  # the run's generator is where it was


def test_the_recorded_count_is_the_first_chosen_one():
    run = {"sessions": [{"hardware": {"threads": {"threads": 1, "how": "measured"}}},
                        {"hardware": {"threads": {"threads": 4, "how": "set"}}}]}
    assert recorded_threads(run) == 1 and recorded_threads({"sessions": [{"hardware": {}}]}) is None


@pytest.mark.slow
def test_a_run_states_its_choice_in_the_plan_records_it_and_keeps_it_on_resume(
    builtin_data_dir, tmp_path, capsys
):
    from pilotrun.commands.cli import main

    run_dir = tmp_path / "run"
    base = [
        "train",
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--data",
        str(builtin_data_dir),
        "--run-dir",
        str(run_dir),
        "--set",
        "train.max_steps=3",
    ]
    assert main(base) == 0
    assert main([*base, "--set", "train.max_steps=5", "--resume"]) == 0
    assert main([*base, "--set", "train.max_steps=6", "--set", "train.num_threads=1", "--resume"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: threads: ")]
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    first, second, third = (s["hardware"]["threads"] for s in sessions)
    assert first["how"] in ("measured", "default") and notes[0].startswith(
        f"note: threads: {first['threads']}"
    )
    assert (second["how"], second["threads"]) == ("recorded", first["threads"])
    assert sessions[1]["hardware"]["torch_threads"] == first["threads"]
    assert (third["how"], third["threads"]) == ("set", 1) and len(notes) == 3
