"""pilotrun/training/callbacks/profiling.py driven directly around tiny-model updates on the CPU (no
trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pilotrun.common.errors import ConfigError
from pilotrun.config import ModelConfig, OptimConfig, ProfileConfig, RunConfig, validate_run_config
from pilotrun.model.transformer import build_model
from pilotrun.optim.muon_adamw import build_optimizer
from pilotrun.training.callbacks.profiling import ProfileWindow, profile_folder


def tiny_training(updates: int, window: ProfileWindow, first_step: int = 1) -> None:
    """`updates` applied updates of a tiny model, the window driven as the training loop drives it."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, kv_lora_rank=16,
                                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, moe_hidden=16,
                                    dense_hidden=32, max_seq_len=16))
    optimizer = build_optimizer(model, OptimConfig())
    tokens = torch.randint(0, 64, (2, 17))
    for step in range(first_step, first_step + updates):
        window.before_update(step)
        loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.after_update()
    window.close()


def optimizer_steps_recorded(rows: list[dict]) -> int:
    """torch.optim records one `Optimizer.step#<class>.step` range per step()."""
    return sum(row["calls"] for row in rows if row["name"].startswith("Optimizer.step#"))


def test_window_profiles_exactly_its_updates_and_writes_trace_and_table(tmp_path):
    window = ProfileWindow(ProfileConfig(start_step=3, steps=2, top_operators=500), tmp_path)
    tiny_training(6, window)
    folder = profile_folder(tmp_path, 3)
    assert sorted(p.name for p in folder.iterdir()) == ["top_operators-rank0.json", "top_operators-rank0.txt",
                                                         "trace-rank0.json"]
    assert sorted(window.written) == sorted(folder.iterdir())
    trace = json.loads((folder / "trace-rank0.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    table = json.loads((folder / "top_operators-rank0.json").read_text())
    assert (table["start_step"], table["update_attempts"], table["device"]) == (3, 2, "cpu")
    assert optimizer_steps_recorded(table["operators"]) == 2  # the two window updates, not the other four
    self_times = [row["self_cpu_us"] for row in table["operators"]]
    assert self_times == sorted(self_times, reverse=True) and self_times[0] > 0
    text = (folder / "top_operators-rank0.txt").read_text()
    assert "2 update attempt(s) from the one making step 3" in text and "aten::" in text
    assert not list((tmp_path / "profile").glob(".tmp-*"))


def test_off_by_default_and_writes_nothing(tmp_path):
    window = ProfileWindow(RunConfig().train.profile, tmp_path)
    assert not window.enabled
    tiny_training(3, window)
    assert not (tmp_path / "profile").exists() and not window.active


def test_window_cut_short_by_the_end_of_the_session_writes_what_it_saw(tmp_path):
    window = ProfileWindow(ProfileConfig(start_step=2, steps=5), tmp_path)
    tiny_training(2, window)  # steps 1 and 2: the window opens at 2, the session ends, close() writes
    table = json.loads((profile_folder(tmp_path, 2) / "top_operators-rank0.json").read_text())
    assert table["update_attempts"] == 1 and optimizer_steps_recorded(table["operators"]) == 1


def test_a_session_starting_past_the_window_never_profiles(tmp_path):
    window = ProfileWindow(ProfileConfig(start_step=2, steps=1), tmp_path)
    tiny_training(2, window, first_step=4)  # a resumed session: steps 4 and 5
    assert not (tmp_path / "profile").exists()


def test_active_marks_the_profiled_attempts(tmp_path):
    window = ProfileWindow(ProfileConfig(start_step=2, steps=2), tmp_path)
    seen = []
    for step in range(1, 6):
        seen.append(window.before_update(step))
        window.after_update()
    assert seen == [False, True, True, False, False]
    assert window.finished and (profile_folder(tmp_path, 2) / "trace-rank0.json").is_file()


@pytest.mark.parametrize(("key", "value"), [("steps", -1), ("start_step", 0), ("top_operators", 0)])
def test_bad_profile_config_is_refused(key, value):
    config = RunConfig()
    setattr(config.train.profile, key, value)
    with pytest.raises(ConfigError, match=f"train.profile.{key}"):
        validate_run_config(config)


def test_profile_keys_are_yaml_settable(tmp_path):
    from pilotrun.config import load_run_config

    path = Path(tmp_path / "r.yaml")
    path.write_text("train:\n  profile: {start_step: 5, steps: 3}\n")
    config = load_run_config(path, ["train.profile.top_operators=10"])
    assert (
        config.train.profile.start_step,
        config.train.profile.steps,
        config.train.profile.top_operators,
    ) == (5, 3, 10)
